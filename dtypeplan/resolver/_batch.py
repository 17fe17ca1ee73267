"""DeepSpeed's batch arithmetic: micro-batches per step from the batch sizes and the ranks.

DeepSpeed (``runtime/config.py``, ``_set_batch_related_parameters`` and ``_batch_assertion``)
ties ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
data-parallel ranks``: given two of the three it works the third out, given all three it
checks them, and a combination that does not multiply out is refused at initialization. The
world size is only known when the optimizer is built, so this runs there.

dtypeplan needs the count for one thing: knowing which backward is the last of a step, so that
it starts the step's reduction (and takes the clipping norm) inside it. It takes the count
where the config gives it, or where DeepSpeed derives it from both batch sizes and the sizes
multiply out. Where DeepSpeed falls back to one micro-batch per step (only one batch size
given) it does not: the caller's loop decides, and nothing is counted. Batch sizes DeepSpeed
would refuse are reported (:func:`batch_size_mismatch`), not refused: the caller's loop, not
``train_batch_size``, decides what a step holds, and no number depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from dtypeplan.resolver._auto import FROM_CALLER, AutoValue

__all__ = ["AccumulationSteps", "accumulation_steps", "batch_size_mismatch", "counted_sizes"]

BATCH_KEYS = ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu")


def counted_sizes(
    values: tuple[int | None, int | None, int | None], auto_values: Iterable[AutoValue]
) -> tuple[int | None, int | None, int | None]:
    """``(gradient_accumulation_steps, train_batch_size, train_micro_batch_size_per_gpu)`` as
    counted: an ``"auto"`` that took the HF Trainer's default (not the caller's fill) is a guess
    about the training loop, and a count from it would refuse a loop that runs another number
    of micro-batches, so it counts as absent."""
    guessed = {a.path for a in auto_values if a.source != FROM_CALLER}
    steps, train, micro = (
        None if key in guessed else value for key, value in zip(BATCH_KEYS, values, strict=True)
    )
    return steps, train, micro


class AccumulationSteps(NamedTuple):
    """Micro-batches per step, and where the number came from (for messages)."""

    micro_batches: int
    source: str


def accumulation_steps(
    steps: int | None, train_batch: int | None, micro_batch: int | None, ranks: int
) -> AccumulationSteps | None:
    """The micro-batches per step on ``ranks`` data-parallel ranks; None where not known."""
    if steps is not None:
        return AccumulationSteps(steps, "gradient_accumulation_steps")
    if train_batch is None or micro_batch is None:
        return None
    derived = train_batch // (micro_batch * ranks)
    if derived < 1 or derived * micro_batch * ranks != train_batch:
        return None  # DeepSpeed refuses these sizes: batch_size_mismatch says why
    ranks_text = f"{ranks} data-parallel rank{'s' if ranks != 1 else ''}"
    source = (
        f"gradient_accumulation_steps derived as DeepSpeed does: train_batch_size "
        f"{train_batch} / (train_micro_batch_size_per_gpu {micro_batch} x {ranks_text})"
    )
    return AccumulationSteps(micro_batches=derived, source=source)


def batch_size_mismatch(
    steps: int | None, train_batch: int | None, micro_batch: int | None, ranks: int
) -> str | None:
    """Why DeepSpeed would refuse these batch sizes on ``ranks`` ranks; None if it would not.

    DeepSpeed completes the triple from what is given (one micro-batch per step where only
    ``train_batch_size`` is), then checks that it multiplies out.
    """
    if train_batch is None:
        return None
    given = steps
    if steps is None and micro_batch is None:
        steps, micro = 1, train_batch // ranks
    elif steps is None:
        assert micro_batch is not None
        micro, steps = micro_batch, train_batch // (micro_batch * ranks)
    else:
        micro = micro_batch if micro_batch is not None else train_batch // (steps * ranks)
    if micro > 0 and steps > 0 and train_batch == micro * steps * ranks:
        return None
    counted = (
        f"it counts the {given} micro-batches of gradient_accumulation_steps"
        if given is not None
        else "it counts no micro-batches: the step's reduction waits for step()"
    )
    return (
        f"train_batch_size {train_batch} is not train_micro_batch_size_per_gpu x "
        f"gradient_accumulation_steps x data-parallel ranks on {ranks} rank"
        f"{'s' if ranks != 1 else ''} ({micro} x {steps} x {ranks} = {micro * steps * ranks}): "
        f"DeepSpeed would refuse these batch sizes at this world size. dtypeplan goes on, as "
        f"the training loop decides what a step holds ({counted}); fix the batch sizes to keep "
        "the config valid for DeepSpeed"
    )
