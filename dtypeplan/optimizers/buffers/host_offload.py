"""Optimizer offload: the update runs on the host, next to the master shard and its states.

With ``zero_optimization.offload_optimizer.device: cpu`` the flat engine keeps this rank's fp32
master chunks, and with them every optimizer state (the inner ``torch.optim`` creates its
states like the masters), in host memory, pinned when the parameters are on an accelerator.
The device keeps only the parameters and the accumulator. One step, bucket chunk by bucket
chunk, is a pipeline of three stages, each over two reused pinned host slots::

    device:  reduce --copy g[k+1] down----------------------- copy p[k] up -- all-gather[k] ...
    host:                    wait g[k] -- update[k] -- cast p[k] -- wait g[k+1] -- update ...

* down: the reduced gradient chunk ``k + 1`` is copied into gradient slot ``(k + 1) % 2``
  (``non_blocking`` from device memory into pinned memory, an event recorded after it) while
  the host updates chunk ``k`` from the other slot. A gradient slot is reused two chunks later,
  after the host has read it, so its reuse needs no wait.
* update: the host waits for chunk ``k``'s event and steps the masters with torch's fused CPU
  Adam/AdamW (the caller's update; other optimizers step through their CPU path).
* up: the updated fp32 master chunk is cast on the host into parameter slot ``k % 2`` (the
  parameter dtype: half the bytes of fp32 over the bus for 16-bit parameters) and copied
  ``non_blocking`` into the device's parameter chunk; the caller starts that bucket's
  all-gather behind it on the same stream. (A copy straight from the fp32 master would make
  torch cast into a pageable temporary, and a copy from pageable memory blocks the host.) The
  slot is written again two chunks later, once its copy has finished: one wait, which has
  normally long returned. fp32 parameters are copied from the pinned master itself.

Where the device is the host (training on the CPU) nothing travels: the reduced gradient chunk
already is host memory and the parameter chunk is too, so the pipeline is not staged
(:attr:`HostOffload.staged` is False). The update reads the gradient chunk where it is, and the
master chunk is then cast straight into the parameter chunk: the gradient slot's copy (8 bytes a
parameter for an fp32 gradient) and, for 16-bit parameters, the parameter slot's second copy (4
bytes) are gone. One fused call and one copy a chunk, not cache-sized pieces: a piece of
``CPU_CHUNK`` values is 4 MiB, beyond a core's L2 (2 MiB here), so it saved nothing, and each
piece is a parallel region of its own, which on a loaded machine at 2 threads made the step
twice as slow (measured: the 16.8 M-parameter step 133 ms in pieces, 62 ms whole). The values
are the same bits either way (the same fused kernel on the same fp32 values, the same cast).
Tests set ``staged`` to run the accelerator's pipeline (slots, copies, waits) on a CPU-only
machine.

Waits for the device, each counted in :attr:`HostOffload.device_waits` (the staged pipeline counts
them on the CPU as well, where the "device" is the host and nothing is in flight). Per staged step,
with ``C`` bucket chunks: ``C`` for the gradient copies (the host cannot update a gradient still on
its way); ``max(C - 2, 0)`` for parameter slots written again (16-bit parameters only); one for the
step's gradient factor (clip / (loss scale * divisor)), which the host-side update divides by; and
one after the last upload, so that the host may write the masters again as soon as the step returns
(a checkpoint load, a model change picked up) without racing a copy that still reads them. Nothing
else waits: the gradient norm, the non-finite check and the clip factor are still computed once, on
the device, over the whole group (``grads/factor.py``), as without offload. Unstaged, only the
factor's wait is counted (it is satisfied at once).

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

    def __init__(self, device: torch.device, *, staged: bool | None = None) -> None:
        self.device = device
        self.on_accelerator = device.type != "cpu"
        self.staged = self.on_accelerator if staged is None else staged
        """Whether gradients and parameters travel through the host slots (always on an
        accelerator; on the CPU only where a test asks for the accelerator's pipeline)."""
        # Without pinned memory a non_blocking copy to the host is synchronous (CUDA stages it
        # through a pinned bounce buffer), so every host tensor is pinned on an accelerator.
        self.pin = device.type == "cuda"
        self.device_waits = 0
        """Waits for the device so far (see the module docstring for which ones)."""
        self._grad_slots: list[torch.Tensor | None] = [None, None]
        self._param_slots: list[torch.Tensor | None] = [None, None]
        self._param_slot_free: list[_Event | None] = [None, None]
        """The event after each parameter slot's last copy up (None: never used this step)."""

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

    def _view(
        self, slots: list[torch.Tensor | None], index: int, like: torch.Tensor
    ) -> torch.Tensor:
        """Slot ``index`` of ``slots`` as a tensor of ``like``'s size and dtype (grown, reused)."""
        slot = slots[index]
        nbytes = like.numel() * like.element_size()
        if slot is None or slot.numel() < nbytes:
            slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            slots[index] = slot
        return slot[:nbytes].view(like.dtype)

    def _copy_down(self, index: int, chunk: OffloadedChunk) -> tuple[torch.Tensor, _Event]:
        host = self._view(self._grad_slots, index % 2, chunk.grad)
        host.copy_(chunk.grad, non_blocking=self.on_accelerator)
        return host, _Event(self.device)

    def gradients_to_host(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """All of ``grads`` on the host at once, for an optimizer that steps every chunk in one
        call (its states are created by ``inner.step()``): one wait for the lot."""
        if not self.staged:
            return list(grads)  # already host memory: the inner step reads them in place
        hosts = []
        for grad in grads:
            host = torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=self.pin)
            host.copy_(grad, non_blocking=self.on_accelerator)
            hosts.append(host)
        self._wait(_Event(self.device))
        return hosts

    def _upload(self, index: int, master: torch.Tensor, param: torch.Tensor) -> None:
        """Write the updated fp32 ``master`` into the device's ``param`` chunk: straight from
        the pinned master for fp32 parameters, else cast on the host into parameter slot
        ``index % 2`` first (waiting, if the slot was used, for its previous copy)."""
        if param.dtype == master.dtype:
            param.copy_(master, non_blocking=self.on_accelerator)
            return
        slot = index % 2
        previous = self._param_slot_free[slot]
        if previous is not None:
            self._wait(previous)
        staged = self._view(self._param_slots, slot, param)
        staged.copy_(master)
        param.copy_(staged, non_blocking=self.on_accelerator)
        self._param_slot_free[slot] = _Event(self.device)

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
        if not self.staged:
            for k, chunk in enumerate(chunks):
                update(k, chunk.grad)
                if upload:
                    chunk.param.copy_(chunk.master)
                    written(k)
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
                self._upload(k, chunk.master, chunk.param)
                written(k)
        if upload:
            self.settle()

    def settle(self) -> None:
        """Wait until the parameter uploads issued so far are done (one wait), so that the host
        may write the masters again at once (a load, a model change picked up, the next step)."""
        self._wait(_Event(self.device))

    def release(self) -> None:
        """Drop the step's host slots (between steps the host holds masters and states); call
        it after :meth:`settle`, when no copy reads them any more."""
        self._grad_slots = [None, None]
        self._param_slots = [None, None]
        self._param_slot_free = [None, None]
