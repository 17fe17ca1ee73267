"""DeepSpeed's batch arithmetic: micro-batches per step from the batch sizes and the ranks.

DeepSpeed (``runtime/config.py``, ``_set_batch_related_parameters`` and ``_batch_assertion``)
ties ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
data-parallel ranks``: given two of the three it works the third out, given all three it
checks them, and a combination that does not multiply out is refused at initialization. The
world size is only known when the optimizer is built, so this runs there.

dtypeplan needs the count for one thing: knowing which backward is the last of a step, so that
it starts the step's reduction (and takes the clipping norm) inside it. It takes the count
where the config gives it or where DeepSpeed derives it from both batch sizes. Where DeepSpeed
falls back to one micro-batch per step (only one batch size given) it does not: the caller's
loop decides, and nothing is counted.
"""

from __future__ import annotations

from typing import NamedTuple

from dtypeplan.errors import PrecisionConfigError

__all__ = ["AccumulationSteps", "accumulation_steps"]


class AccumulationSteps(NamedTuple):
    """Micro-batches per step, and where the number came from (for messages)."""

    micro_batches: int
    source: str


def accumulation_steps(
    steps: int | None, train_batch: int | None, micro_batch: int | None, ranks: int
) -> AccumulationSteps | None:
    """The micro-batches per step on ``ranks`` data-parallel ranks; None where not known.

    Raises :class:`PrecisionConfigError` where DeepSpeed refuses the batch sizes at this world
    size: ``train_batch_size`` not equal to micro x steps x ranks.
    """
    if train_batch is not None:
        # DeepSpeed completes the triple, then checks that it multiplies out.
        if steps is None and micro_batch is None:
            _check(train_batch, train_batch // ranks, 1, ranks)  # it takes one micro-batch
        elif steps is None:
            assert micro_batch is not None
            _check(train_batch, micro_batch, train_batch // (micro_batch * ranks), ranks)
        else:
            micro = micro_batch if micro_batch is not None else train_batch // (steps * ranks)
            _check(train_batch, micro, steps, ranks)
    if steps is not None:
        return AccumulationSteps(steps, "gradient_accumulation_steps")
    if train_batch is None or micro_batch is None:
        return None
    ranks_text = f"{ranks} data-parallel rank{'s' if ranks != 1 else ''}"
    source = (
        f"gradient_accumulation_steps derived as DeepSpeed does: train_batch_size "
        f"{train_batch} / (train_micro_batch_size_per_gpu {micro_batch} x {ranks_text})"
    )
    return AccumulationSteps(micro_batches=train_batch // (micro_batch * ranks), source=source)


def _check(train_batch: int, micro: int, steps: int, ranks: int) -> None:
    if micro > 0 and steps > 0 and train_batch == micro * steps * ranks:
        return
    raise PrecisionConfigError(
        f"train_batch_size {train_batch} is not train_micro_batch_size_per_gpu x "
        f"gradient_accumulation_steps x data-parallel ranks on {ranks} rank"
        f"{'s' if ranks != 1 else ''} ({micro} x {steps} x {ranks} = {micro * steps * ranks}); "
        "DeepSpeed refuses these batch sizes the same way. Fix the batch sizes for this world "
        "size, or remove train_batch_size"
    )
