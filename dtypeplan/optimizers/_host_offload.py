"""Optimizer offload: the update runs on the host, next to the master shard and its states.

With ``zero_optimization.offload_optimizer.device: cpu`` the flat engine keeps this rank's fp32
master chunks, and with them every optimizer state (the inner ``torch.optim`` creates its
states like the masters), in host memory, pinned when the parameters are on an accelerator.
The device keeps only the parameters and the accumulator. One step, bucket chunk by bucket
chunk, is a pipeline of three stages over two reused host gradient slots::

    device:  reduce --copy g[k+1] down------------------ upload p[k] -- all-gather[k] ...
    host:                    wait g[k] -- update[k] (fused CPU Adam) -- wait g[k+1] -- ...

* down: the reduced gradient chunk ``k + 1`` is copied into host slot ``(k + 1) % 2``
  (``non_blocking`` from device memory into pinned memory, an event recorded after it) while
  the host updates chunk ``k`` from the other slot. A slot is reused two chunks later, once
  the host has consumed it, so reuse needs no wait of its own.
* update: the host waits for chunk ``k``'s event and steps the masters with torch's fused CPU
  Adam/AdamW (the caller's update; other optimizers step through their CPU path).
* up: the updated fp32 master chunk is copied straight into the device's parameter chunk
  (``non_blocking`` from pinned memory; the cast to the parameter dtype happens on the device),
  and the caller starts that bucket's all-gather behind it on the same stream. Copying fp32
  moves twice the bytes of a 16-bit staging copy, but needs no host slot whose reuse the host
  would have to wait for.

Waits for the device, each counted in :attr:`HostOffload.device_waits` (the same count on the
CPU, where the "device" is the host and nothing is in flight), ``buckets + 2`` per step: one
per bucket chunk (the host cannot update a gradient still on its way), one for the step's
gradient factor (clip / (loss scale * divisor)), which the host-side update divides by, and
one after the last upload, so that the host may write the masters again as soon as the step
returns (a checkpoint load, a model change picked up) without racing a copy that still reads
them; by then only the last chunk's copy can be in flight. Nothing else waits:
the gradient norm, the non-finite check and the clip factor are still computed once, on the
device, over the whole group (``_clip.py``), as without offload.

The step's host slots are dropped at its end (pinned memory comes back from torch's caching
host allocator, so this costs no ``cudaHostAlloc`` per step), so between steps the host holds
what ``plan.memory()`` counts: masters and states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["HostOffload", "OffloadedChunk"]


@dataclass(frozen=True)
class OffloadedChunk:
    """One bucket chunk of an offloaded step: where its gradient is, what it updates."""

    grad: torch.Tensor
    """This rank's reduced gradient chunk, on the device (any dtype)."""
    master: torch.Tensor
    """Its fp32 master chunk, on the host."""
    param: torch.Tensor
    """The parameters' chunk on the device (the parameter dtype), written from ``master``."""


class _Event:
    """A point in the device's stream the host can wait for (``None`` on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostOffload:
    """Host memory for the master shard and states, and the copies between host and device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_accelerator = device.type != "cpu"
        # Without pinned memory a non_blocking copy to the host is synchronous (CUDA stages it
        # through a pinned bounce buffer), so every host tensor is pinned on an accelerator.
        self.pin = device.type == "cuda"
        self.device_waits = 0
        """Waits for the device so far (see the module docstring for which ones)."""
        self._slots: list[torch.Tensor | None] = [None, None]

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    def host_zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed host tensor, pinned on an accelerator (master chunks, states)."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)

    def _wait(self, event: _Event) -> None:
        self.device_waits += 1
        event.wait()

    def factor_to_host(self, factor: torch.Tensor) -> torch.Tensor:
        """The step's 0-dim gradient factor, on the host for the host-side update (one wait)."""
        if factor.device.type == "cpu":
            self.device_waits += 1  # the same wait, already satisfied: the device is the host
            return factor
        host = torch.empty((), dtype=factor.dtype, pin_memory=self.pin)
        host.copy_(factor, non_blocking=True)
        self._wait(_Event(self.device))
        return host

    def _slot(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Host gradient slot ``index`` as a tensor of ``like``'s size and dtype (reused)."""
        slot = self._slots[index]
        nbytes = like.numel() * like.element_size()
        if slot is None or slot.numel() < nbytes:
            slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._slots[index] = slot
        return slot[:nbytes].view(like.dtype)

    def _copy_down(self, index: int, chunk: OffloadedChunk) -> tuple[torch.Tensor, _Event]:
        host = self._slot(index % 2, chunk.grad)
        host.copy_(chunk.grad, non_blocking=self.on_accelerator)
        return host, _Event(self.device)

    def gradients_to_host(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """All of ``grads`` on the host at once, for an optimizer that steps every chunk in one
        call (its states are created by ``inner.step()``): one wait for the lot."""
        hosts = []
        for grad in grads:
            host = torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=self.pin)
            host.copy_(grad, non_blocking=self.on_accelerator)
            hosts.append(host)
        self._wait(_Event(self.device))
        return hosts

    def upload(self, master: torch.Tensor, param: torch.Tensor) -> None:
        """Write the updated fp32 ``master`` into the device's ``param`` chunk (cast there)."""
        param.copy_(master, non_blocking=self.on_accelerator)

    def step(
        self,
        chunks: Sequence[OffloadedChunk],
        update: Callable[[int, torch.Tensor], None],
        written: Callable[[int], None],
        *,
        upload: bool = True,
    ) -> None:
        """Run the pipeline over ``chunks`` in order: ``update(k, host_grad)`` steps chunk
        ``k``'s master on the host; ``written(k)`` is called once its parameters are on their
        way to the device (the caller starts the bucket's all-gather there). Without
        ``upload`` the masters are only updated (the caller writes the parameters itself)."""
        if not chunks:
            return
        pending = self._copy_down(0, chunks[0])
        for k, chunk in enumerate(chunks):
            host_grad, ready = pending
            if k + 1 < len(chunks):
                # Slot (k + 1) % 2 last held chunk k - 1, which the host has consumed.
                pending = self._copy_down(k + 1, chunks[k + 1])
            self._wait(ready)
            update(k, host_grad)
            if upload:
                self.upload(chunk.master, chunk.param)
                written(k)
        if upload:
            self.settle()

    def settle(self) -> None:
        """Wait until the parameter uploads issued so far are done (one wait), so that the host
        may write the masters again at once (a load, a model change picked up, the next step)."""
        self._wait(_Event(self.device))

    def release(self) -> None:
        """Drop the step's host slots (between steps the host holds masters and states)."""
        self._slots = [None, None]
