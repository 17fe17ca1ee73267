"""Collectives with an explicit wire dtype over one data-parallel process group.

Gradient reductions (the ``*_mean`` calls) average where the backend does so natively: NCCL
gets ``ReduceOp.AVG``, so the wire carries the mean and an fp16 sum cannot overflow at 1/N of
the size the mean would. Elsewhere (gloo, whose AVG has been reported to return sums) they SUM
in the wire dtype and leave the divide to the caller, who folds
:attr:`Communicator.reduction_divisor` into the scaling it applies anyway (no extra pass). The
``*_sum`` calls always sum. Nothing is sent when the group has one rank. Two ways to reduce
16-bit data:

* ``"collective"``: the backend's own reduce-scatter / all-reduce in the wire dtype. A ring
  rounds the partial sum to the wire dtype at every hop, so the error grows with world size.
* ``"fp32_sum"``: an all-to-all moves each rank's slice of every peer's data in the wire dtype,
  and the receiver sums the world-size pieces in fp32. The bytes on the wire are those of a
  reduce-scatter; the sum is rounded once.

Every call adds to :attr:`Communicator.stats` (calls and bytes sent per collective), which the
benchmarks read to compare the wire traffic with theory.

A collective that fails (a peer died, or stalled past the group's timeout, or the backend broke)
raises :class:`CollectiveError`, which names the collective, its size and the group, with the
backend's own error chained: gloo's "Connection closed by peer" alone does not say which of a
step's dozen collectives was waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtypeplan._dtypes import dtype_name
from dtypeplan.comm._quantized_wire import start_all_reduce_quantized
from dtypeplan.errors import RankMismatchError

__all__ = ["CollectiveError", "CommStats", "Communicator", "mean_reduction"]

# torch >= 2.13 renamed the flat-tensor collectives; the old names still work but warn.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def mean_reduction(backend: str, world_size: int) -> tuple[Any, int]:
    """The op a gradient mean goes on the wire with, and what its result is still to be divided by.

    NCCL averages natively (``ReduceOp.AVG``: divided by the world size on the wire, nothing
    left to divide). Every other backend sums, and the caller divides by the world size.
    """
    if backend == "nccl":
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, world_size


class CollectiveError(RuntimeError):
    """A collective of the data-parallel group failed; the backend's error is ``__cause__``.

    The message names the collective (``"reduce_scatter of 4096 bf16 elements"``), the group
    (name, backend, this rank and the world size) and the backend's message.
    """


@dataclass
class CommStats:
    """Bytes this rank sends, per collective, by the ring algorithm's count."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes_sent[op] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())


class Communicator:
    """The data-parallel group of one optimizer."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.stats = CommStats()
        self.backend = self._backend()
        self._mean_op, self.reduction_divisor = mean_reduction(self.backend, self.world_size)
        """What a ``*_mean`` result is still to be divided by: 1 where the backend averaged
        on the wire (NCCL), the world size where it summed (gloo)."""
        self.description = self._describe_group()

    def _backend(self) -> str:
        if not self.distributed:
            return "none"
        try:
            return str(dist.get_backend(self.group))
        except (RuntimeError, ValueError):
            return "unknown backend"

    def _describe_group(self) -> str:
        if not self.distributed:
            return "a single process"
        name = getattr(self.group, "group_name", None) or "?"
        return f"process group {name!r} ({self.backend}, rank {self.rank} of {self.world_size})"

    @contextlib.contextmanager
    def _guard(
        self, op: str, numel: int | None = None, dtype: torch.dtype | None = None
    ) -> Iterator[None]:
        """Re-raise a failure of the collective inside as a CollectiveError that names it.

        A NotImplementedError is this rank's own: torch has no such collective for its
        tensors (a DTensor, sharded by FSDP2, where whole tensors belong), and no peer failed.
        """
        what = op
        if numel is not None:
            kind = f" {dtype_name(dtype)}" if dtype is not None else ""
            what += f" of {numel}{kind} elements"
        try:
            yield
        except NotImplementedError as exc:
            raise CollectiveError(
                f"{what} could not start on {self.description}: {type(exc).__name__}: {exc}. "
                "This rank's tensors cannot go through it (no peer failed): a DTensor, "
                "sharded by FSDP2, handed to an optimizer that takes whole tensors?"
            ) from exc
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's RuntimeError
            raise CollectiveError(
                f"{what} failed on {self.description}: {type(exc).__name__}: {exc}. "
                "A peer rank probably died or stalled longer than the group's timeout "
                "(init_process_group(timeout=...)); look at the other ranks' logs first"
            ) from exc

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _ring_bytes(self, numel: int, dtype: torch.dtype) -> int:
        # A ring reduce-scatter or all-gather of `numel` elements sends (N-1)/N of them.
        return numel * dtype.itemsize * (self.world_size - 1) // self.world_size

    def all_reduce_sum_(self, tensor: torch.Tensor, wire_dtype: torch.dtype, method: str) -> None:
        """Sum ``tensor`` over the group in place, on the wire in ``wire_dtype``."""
        self._start_all_reduce(tensor, wire_dtype, method, mean=False)()

    def start_all_reduce_sum(
        self, tensor: torch.Tensor, wire_dtype: torch.dtype, method: str
    ) -> Callable[[], None]:
        """:meth:`all_reduce_sum_`, launched asynchronously; call the result to finish it.

        ``fp32_sum`` (a reduce-scatter and an all-gather) runs synchronously.
        """
        return self._start_all_reduce(tensor, wire_dtype, method, mean=False)

    def start_all_reduce_mean(
        self, tensor: torch.Tensor, wire_dtype: torch.dtype, method: str
    ) -> Callable[[], None]:
        """:meth:`start_all_reduce_sum`, but the result is the sum over ``reduction_divisor``."""
        return self._start_all_reduce(tensor, wire_dtype, method, mean=True)

    def _start_all_reduce(
        self, tensor: torch.Tensor, wire_dtype: torch.dtype, method: str, *, mean: bool
    ) -> Callable[[], None]:
        if not self.active:
            return _nothing
        if method == "fp32_sum" and wire_dtype != torch.float32:
            shard = tensor.new_empty(tensor.numel() // self.world_size, dtype=tensor.dtype)
            self._start_reduce_scatter(shard, tensor, wire_dtype, method, mean=mean)()
            self.all_gather(tensor, shard, wire_dtype)
            return _nothing
        wire = tensor if tensor.dtype == wire_dtype else tensor.to(wire_dtype)
        op = self._mean_op if mean else dist.ReduceOp.SUM
        self.stats.add("all_reduce", 2 * self._ring_bytes(wire.numel(), wire_dtype))
        with self._guard("all_reduce", wire.numel(), wire_dtype):
            work = dist.all_reduce(wire, op=op, group=self.group, async_op=True)

        def finish(wire: torch.Tensor = wire) -> None:
            with self._guard("all_reduce", wire.numel(), wire_dtype):
                work.wait()
            if wire is not tensor:
                tensor.copy_(wire)

        return finish

    def start_all_reduce_quantized(self, tensor: torch.Tensor, fmt: str) -> Callable[[], None]:
        """Sum ``tensor`` over the group in place (no mean), each rank's contribution
        block-quantized in ``fmt`` ("int8" or "fp8") on the wire and summed in fp32; see
        :mod:`dtypeplan.comm._quantized_wire`. Call the result to finish it."""
        return start_all_reduce_quantized(self, tensor, fmt)

    def reduce_scatter_sum(
        self, output: torch.Tensor, full: torch.Tensor, wire_dtype: torch.dtype, method: str
    ) -> None:
        """Write into ``output`` this rank's slice of the group-wide sum of ``full``.

        ``full`` is split into ``world_size`` equal slices; slice ``rank`` of the sum lands in
        ``output`` (any dtype). ``full`` is not modified.
        """
        self.start_reduce_scatter_sum(output, full, wire_dtype, method)()

    def start_reduce_scatter_sum(
        self, output: torch.Tensor, full: torch.Tensor, wire_dtype: torch.dtype, method: str
    ) -> Callable[[], None]:
        """:meth:`reduce_scatter_sum`, launched asynchronously.

        Returns the function that waits for it and finishes it (casts, the fp32 sum of
        ``fp32_sum``); ``output`` holds the result only after that call, and ``full`` must not
        change before it. Ranks must finish their launches in the same order.
        """
        return self._start_reduce_scatter(output, full, wire_dtype, method, mean=False)

    def start_reduce_scatter_mean(
        self, output: torch.Tensor, full: torch.Tensor, wire_dtype: torch.dtype, method: str
    ) -> Callable[[], None]:
        """:meth:`start_reduce_scatter_sum`, but ``output`` gets the sum over
        ``reduction_divisor`` (NCCL: the mean, averaged on the wire; gloo: the sum)."""
        return self._start_reduce_scatter(output, full, wire_dtype, method, mean=True)

    def _start_reduce_scatter(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        wire_dtype: torch.dtype,
        method: str,
        *,
        mean: bool,
    ) -> Callable[[], None]:
        if not self.active:
            output.copy_(full)
            return _nothing
        wire = full if full.dtype == wire_dtype else full.to(wire_dtype)
        if method == "fp32_sum" and wire_dtype != torch.float32:
            received = torch.empty_like(wire)
            self.stats.add("all_to_all", self._ring_bytes(wire.numel(), wire_dtype))
            with self._guard("all_to_all", wire.numel(), wire_dtype):
                work = dist.all_to_all_single(received, wire, group=self.group, async_op=True)

            def finish_sum(wire: torch.Tensor = wire) -> None:  # keeps `wire` alive until done
                with self._guard("all_to_all", wire.numel(), wire_dtype):
                    work.wait()
                # One kernel over all pieces, rounded once; a mean divides by what the wire
                # (which here carried every rank's own values) did not.
                total = received.view(self.world_size, -1).sum(0, dtype=torch.float32)
                if mean and self.reduction_divisor != self.world_size:
                    total.div_(self.world_size / self.reduction_divisor)
                output.copy_(total)

            return finish_sum
        out = output
        if output.dtype != wire_dtype:
            out = output.new_empty(output.shape, dtype=wire_dtype)
        op = self._mean_op if mean else dist.ReduceOp.SUM
        self.stats.add("reduce_scatter", self._ring_bytes(wire.numel(), wire_dtype))
        with self._guard("reduce_scatter", wire.numel(), wire_dtype):
            work = _reduce_scatter_flat(out, wire, op=op, group=self.group, async_op=True)

        def finish(wire: torch.Tensor = wire) -> None:  # keeps `wire` alive until done
            with self._guard("reduce_scatter", wire.numel(), wire_dtype):
                work.wait()
            if out is not output:
                output.copy_(out)

        return finish

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, wire_dtype: torch.dtype) -> None:
        """Fill ``full`` with every rank's ``shard`` in rank order, wire dtype ``wire_dtype``."""
        self.start_all_gather(full, shard, wire_dtype)()

    def start_all_gather(
        self, full: torch.Tensor, shard: torch.Tensor, wire_dtype: torch.dtype
    ) -> Callable[[], None]:
        """:meth:`all_gather`, launched asynchronously; call the result to finish it."""
        if not self.active:
            full.copy_(shard)
            return _nothing
        wire_shard = shard if shard.dtype == wire_dtype else shard.to(wire_dtype)
        out = full if full.dtype == wire_dtype else full.new_empty(full.shape, dtype=wire_dtype)
        self.stats.add("all_gather", self._ring_bytes(out.numel(), wire_dtype))
        with self._guard("all_gather", out.numel(), wire_dtype):
            work = _all_gather_flat(out, wire_shard, group=self.group, async_op=True)

        def finish(wire_shard: torch.Tensor = wire_shard) -> None:  # alive until done
            with self._guard("all_gather", out.numel(), wire_dtype):
                work.wait()
            if out is not full:
                full.copy_(out)

        return finish

    def broadcast_from_first_(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with the group's first rank's, in place."""
        if not self.active:
            return
        assert self.group is not None  # active implies torch.distributed and a group
        source = dist.get_global_rank(self.group, 0)
        for tensor in tensors:
            with self._guard("broadcast", tensor.numel(), tensor.dtype):
                dist.broadcast(tensor, src=source, group=self.group)

    def all_reduce_scalars(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small fp32 vector (norms, overflow flags) over the group; returns it."""
        if self.active:
            with self._guard("all_reduce", values.numel(), values.dtype):
                dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values

    def check_consistent(self, facts: dict[str, Any]) -> None:
        """Raise RankMismatchError on every rank if any rank was given other ``facts``.

        Each fact is hashed on its own, so the error names what differs rather than hanging
        later in a collective of mismatched sizes. A fact that is a dict is also hashed entry by
        entry, and the error then names the entries too (``plan.comm_dtype``).
        """
        if not self.active:
            return
        digests: dict[str, str] = {}
        for key, value in facts.items():
            digests[key] = _digest(value)
            if isinstance(value, dict):
                digests.update({f"{key}.{sub}": _digest(item) for sub, item in value.items()})
        gathered: list[dict[str, str] | None] = [None] * self.world_size
        with self._guard("all_gather_object of the plan digests"):
            dist.all_gather_object(gathered, digests, group=self.group)
        others = [other for other in gathered if other is not None]
        differing = sorted(
            {
                key
                for other in others
                for key in digests.keys() | other.keys()
                if other.get(key) != digests.get(key)
            }
        )
        top = [key for key in differing if key in facts]
        if top:
            by_rank = "; ".join(
                f"rank {rank}: " + ", ".join(f"{k}={other.get(k, 'missing')[:8]}" for k in top)
                for rank, other in enumerate(gathered)
                if other is not None
            )
            entries = [key for key in differing if key not in facts]
            detail = f"; the entries that differ: {', '.join(entries)}" if entries else ""
            raise RankMismatchError(
                f"ranks of the data-parallel group disagree on {', '.join(top)} "
                f"({by_rank}){detail}. Every rank must resolve the same config and build the "
                "optimizer over parameters of the same shapes, in the same order"
            )


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _nothing() -> None:
    """The finisher of a collective that had nothing to send."""
