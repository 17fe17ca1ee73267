"""The torch-path update of the flat engine's master chunks, with the scaling folded in.

torch's fused Adam/AdamW divide each gradient by a ``grad_scale`` tensor inside the kernel
(the hook ``GradScaler`` uses), so the step's factor (clip / (loss scale * divisor)) costs no
pass of its own and never visits the host. What the update moves per element depends on the
accumulator:

* fp32: the reduced chunks are the gradients as they are, no copy, and one fused call covers
  a whole bucket chunk (on CUDA at least several MB a launch: a bucket is 16 MiB of fp32 by
  default), unless a 16-bit parameter chunk is written from it (CPU: pieces, see below).
* 16-bit: each piece of ``CPU_CHUNK`` elements is converted into one reused fp32 scratch that
  stays in cache, and updated from there: no fp32 copy of the accumulator is ever written to
  memory. On CUDA the conversion is a separate kernel either way, so pieces are a bucket chunk.

On CPU, a 16-bit parameter chunk is written right after its piece of master is updated, while
that piece is still in cache (the cast reads no memory), and the caller starts the bucket's
all-gather as soon as the bucket is done.

Adam and AdamW take this path (their states are created here under torch's names, so
``state_dict`` cannot tell it from ``inner.step()``); other optimizers step through
``inner.step()`` with ``inner.grad_scale`` set where they support it
(``_step_supports_amp_scaling``), and get a scaling pass otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "CPU_CHUNK",
    "FlatAdamUpdate",
    "decoupled_weight_decay",
    "fused_adam_kernel",
    "inner_step_grads",
    "is_adam",
    "is_unit_factor",
    "kernel_grad_scale",
    "unit_factor",
]

CPU_CHUNK = 1 << 20
"""Elements per fused call on CPU: 4 MiB of fp32 scratch, which stays in cache between the
conversion that writes it and the update that reads it (and a master piece between its update
and its cast). Measured on one AMD EPYC core: pieces of 2**16 elements are ~1.3x slower
(per-call overhead), 2**18 to 2**20 alike."""


def decoupled_weight_decay(torch_class: type[torch.optim.Optimizer], group: dict[str, Any]) -> bool:
    """Whether ``group`` decays weights the AdamW way (decoupled) rather than as L2.

    AdamW always does; Adam does with ``decoupled_weight_decay=True`` (torch >= 2.6), which
    the group carries (the inner optimizer's groups hold every default).
    """
    return issubclass(torch_class, torch.optim.AdamW) or bool(
        group.get("decoupled_weight_decay", False)
    )


def fused_adam_kernel(
    torch_class: type[torch.optim.Optimizer], group: dict[str, Any], grad_scale: torch.Tensor
) -> tuple[Any, dict[str, Any]]:
    """torch's fused Adam or AdamW kernel for ``group`` and its keyword arguments.

    The gradients it is given are divided by ``grad_scale`` inside the kernel (the unscale,
    average and clip factor folded into one device scalar; no separate pass), unless the host
    knows it is exactly 1 (:func:`kernel_grad_scale`).
    """
    beta1, beta2 = group["betas"]
    fused = (
        torch._fused_adamw_ if decoupled_weight_decay(torch_class, group) else torch._fused_adam_
    )
    kwargs = {
        "lr": group["lr"],
        "beta1": beta1,
        "beta2": beta2,
        "weight_decay": group["weight_decay"],
        "eps": group["eps"],
        "amsgrad": False,
        "maximize": False,
        "grad_scale": kernel_grad_scale(grad_scale),
    }
    return fused, kwargs


_UNIT_FACTORS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def unit_factor(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor and inverse of a step that the host knows multiplies by exactly 1.

    The same two fp32 ones on ``device`` every time (never written: the kernels only read a
    factor), so that :func:`is_unit_factor` knows them by identity, with no device read.
    """
    device = torch.device(device)
    if device not in _UNIT_FACTORS:
        one = torch.ones((), dtype=torch.float32, device=device)
        _UNIT_FACTORS[device] = (one, one)
    return _UNIT_FACTORS[device]


def is_unit_factor(factor: torch.Tensor) -> bool:
    """Whether ``factor`` is one of :func:`unit_factor`'s (the value 1, known on the host)."""
    unit = _UNIT_FACTORS.get(factor.device)
    return unit is not None and factor is unit[0]


def kernel_grad_scale(grad_scale: torch.Tensor) -> torch.Tensor | None:
    """What torch's fused kernel is given as ``grad_scale``: None for a factor known to be 1.

    With a ``grad_scale``, torch's fused Adam/AdamW write every unscaled gradient back to
    memory, one more pass over the gradients (one core, 16.8 M values: fp32 8.8 against 8.0 ms,
    bf16 13.7 against 11.0 ms). A division by exactly 1 changes no bit (NaN and infinities
    included), so a factor the host knows is 1 (:func:`unit_factor`: no clipping, no
    loss scale, nothing left to average) is left out, without reading the device.
    """
    return None if is_unit_factor(grad_scale) else grad_scale


class FlatAdamUpdate:
    """Adam/AdamW over one param group's master chunks by direct fused calls, a bucket at a time."""

    def __init__(self, inner: torch.optim.Optimizer, torch_class: type[torch.optim.Optimizer]):
        self.inner = inner
        self.torch_class = torch_class
        self._scratch: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def supports(inner: torch.optim.Optimizer, torch_class: type[torch.optim.Optimizer]) -> bool:
        """Adam/AdamW whose every group is fused and plain (no amsgrad, maximize, capturable)."""
        return issubclass(torch_class, (torch.optim.Adam, torch.optim.AdamW)) and all(
            g.get("fused")
            and not g.get("amsgrad")
            and not g.get("maximize")
            and not g.get("differentiable")
            for g in inner.param_groups
        )

    def slot(self, master: torch.Tensor) -> dict[str, Any]:
        """``master``'s state in the inner optimizer, created (zeroed, step 0) if missing."""
        slot = self.inner.state[master]
        if "exp_avg" not in slot:
            slot["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            slot["exp_avg"] = torch.zeros_like(master)
            slot["exp_avg_sq"] = torch.zeros_like(master)
        return slot

    def bucket(
        self,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        param_chunk: torch.Tensor | None,
        grad_scale: torch.Tensor,
    ) -> None:
        """Update one master chunk from ``grad / grad_scale``; cast it into ``param_chunk``.

        ``grad`` (fp32) is overwritten with the unscaled gradient, as torch's fused kernels do;
        the engine no longer needs it. ``param_chunk`` is None where it is the master itself.
        """
        slot = self.slot(master)
        step = slot["step"]
        step += 1
        fused, kwargs = fused_adam_kernel(self.torch_class, group, grad_scale)
        # Flat views (a no-op for the flat engine's chunks; ZeRO-3's host masters are shaped
        # like their shards and key the states so).
        master, grad = master.view(-1), grad.view(-1)
        exp_avg, exp_avg_sq = slot["exp_avg"].view(-1), slot["exp_avg_sq"].view(-1)
        on_cpu = master.device.type == "cpu"
        size = CPU_CHUNK if on_cpu else master.numel()
        needs_copy = grad.dtype != torch.float32
        if needs_copy or (on_cpu and param_chunk is not None):
            for begin in range(0, master.numel(), size):
                end = min(begin + size, master.numel())
                piece = grad[begin:end]
                if needs_copy:
                    piece = self._scratch_for(master.device, end - begin)
                    piece.copy_(grad[begin:end])
                fused(
                    [master[begin:end]],
                    [piece],
                    [exp_avg[begin:end]],
                    [exp_avg_sq[begin:end]],
                    [],
                    [step],
                    **kwargs,
                )
                if param_chunk is not None and on_cpu:
                    param_chunk[begin:end].copy_(master[begin:end])
        else:
            fused([master], [grad], [exp_avg], [exp_avg_sq], [], [step], **kwargs)
        if param_chunk is not None and not on_cpu:
            param_chunk.copy_(master)

    def release_scratch(self) -> None:
        """Drop the conversion scratch at the end of a step: between steps (where
        ``plan.memory()`` counts) the optimizer holds none of it."""
        self._scratch.clear()

    def _scratch_for(self, device: torch.device, numel: int) -> torch.Tensor:
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(numel, dtype=torch.float32, device=device)
            self._scratch[device] = scratch
        return scratch[:numel]


@contextlib.contextmanager
def inner_step_grads(
    inner: torch.optim.Optimizer,
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    factor: torch.Tensor,
    inverse: torch.Tensor,
) -> Iterator[None]:
    """Inside, ``masters`` hold fp32 ``grads`` scaled by ``factor`` for ``inner.step()``.

    Optimizers that take ``grad_scale`` in their fused step get ``inverse`` there (no pass);
    the others get one multiply by the device factor (still no host sync). A factor known to be
    1 (:func:`unit_factor`) gets neither: no multiply pass, and no fused kernel writing every
    gradient back. On the way out the masters' ``.grad`` and the scale are removed, whatever
    happened inside.
    """
    fp32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    if not is_unit_factor(factor):
        if getattr(inner, "_step_supports_amp_scaling", False) and all(
            g.get("fused") for g in inner.param_groups
        ):
            inner.grad_scale = inverse  # type: ignore[attr-defined]
            inner.found_inf = None  # type: ignore[attr-defined]
        else:
            torch._foreach_mul_(fp32, factor)
    for master, grad in zip(masters, fp32, strict=True):
        master.grad = grad
    try:
        yield
    finally:
        for master in masters:
            master.grad = None
        for name in ("grad_scale", "found_inf"):
            if hasattr(inner, name):
                delattr(inner, name)


def is_adam(torch_class: type[torch.optim.Optimizer]) -> bool:
    """Whether the update is Adam or AdamW (a step counter beside its moments, the Triton path)."""
    return issubclass(torch_class, (torch.optim.Adam, torch.optim.AdamW))
