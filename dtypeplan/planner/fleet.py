"""The GPUs a plan runs on: how many, how they are grouped in nodes, their memory and links.

Sizes and bandwidths are read as people write them (``"80GB"``, ``"1TB"``, ``"900GB/s"``,
``"400Gb/s"``): decimal units (``GB`` = 10**9 bytes), binary ones with an ``i`` (``GiB`` =
2**30), and a lower-case ``b`` for bits (``Gb/s``: a NIC's rating, divided by 8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Fleet", "parse_bandwidth", "parse_size"]

_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?)?([Bb])?\s*$")


def parse_size(text: str | float | int) -> float:
    """Bytes in ``text`` (``"80GB"``, ``"80 GiB"``, ``"1TB"``, ``"400Gb"``, ``1e9``).

    Raises :class:`ValueError` naming the accepted forms."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return float(text)
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(
            f"cannot read {text!r} as a size: write a number with a unit, e.g. 80GB, 80GiB, "
            "1TB or 400Gb (B bytes, b bits; K/M/G/T decimal, Ki/Mi/Gi/Ti binary)"
        )
    number, unit, byte_or_bit = match.groups()
    value = float(number) * _UNITS[unit or ""]
    return value / 8 if byte_or_bit == "b" else value


def parse_bandwidth(text: str | float | int) -> float:
    """Bytes per second in ``text`` (``"900GB/s"``, ``"400Gb/s"``, ``"50 GB/s"``)."""
    if isinstance(text, str):
        body = text.strip()
        if not body.endswith("/s"):
            raise ValueError(f"cannot read {text!r} as a bandwidth: write e.g. 450GB/s or 400Gb/s")
        text = body[:-2]
    value = parse_size(text)
    if value <= 0:
        raise ValueError(f"a bandwidth must be positive: {text!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Fleet:
    """The data-parallel fleet: every GPU runs one rank.

    Bandwidths are per GPU and per direction, as a ring collective uses them: H100 SXM's NVLink
    4 is 900 GB/s both ways together, 450 GB/s each way; one 400 Gb/s NIC per GPU is 50 GB/s.
    """

    gpus: int
    """Ranks in the data-parallel group (the world size)."""
    gpu_memory: float
    """Bytes of memory per GPU."""
    gpus_per_node: int = 8
    """GPUs per node: collectives within a node run on the intra-node links."""
    host_memory: float | None = None
    """Bytes of host memory per node (None: not checked; offload still counted)."""
    intra_node_bandwidth: float = 450e9
    """Bytes per second each GPU sends within its node (H100 NVLink 4: 450 GB/s each way)."""
    inter_node_bandwidth: float = 50e9
    """Bytes per second each GPU sends to other nodes (a 400 Gb/s NIC per GPU)."""
    host_link_bandwidth: float = 25e9
    """Bytes per second between a GPU and host memory (PCIe 4 x16, about 25 GB/s), for the
    per-step copies of an offloaded optimizer."""
    gpu_flops: float = 400e12
    """Sustained 16-bit matmul flops per GPU for the compute-time model (H100 SXM: 989e12
    dense bf16 peak; 400e12 is about 40% of it, a typical training utilization); fp8 matmuls
    run at twice this, fp32 ones (TF32) at half."""
    native_mxfp8: bool = False
    """Whether the GPUs have MXFP8 kernels (SM100+: B200, GB200); without them the planner
    leaves the mxfp8 recipe out (it would run emulated, slower than bf16). H100 is SM90."""
    reserved_fraction: float = 0.1
    """Share of each GPU's memory not counted as usable: the CUDA context, the caching
    allocator's fragmentation, NCCL's buffers."""

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Fleet.{name} must be a whole number >= 1, not {value!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}: give "
                "--gpus as a multiple of --gpus-per-node"
            )
        if self.gpu_memory <= 0:
            raise ValueError("Fleet.gpu_memory must be positive")
        if not 0 <= self.reserved_fraction < 1:
            raise ValueError("Fleet.reserved_fraction must be in [0, 1)")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    @property
    def usable_gpu_memory(self) -> float:
        return self.gpu_memory * (1 - self.reserved_fraction)

    @property
    def usable_host_memory_per_rank(self) -> float | None:
        if self.host_memory is None:
            return None
        return self.host_memory * (1 - self.reserved_fraction) / self.ranks_per_node

    def bandwidth(self, ranks: int) -> float:
        """The bandwidth of a ring over ``ranks`` consecutive ranks: intra-node while they fit
        one node, else the inter-node link, which every ring that leaves a node waits on."""
        return (
            self.intra_node_bandwidth if ranks <= self.gpus_per_node else self.inter_node_bandwidth
        )

    def describe(self) -> str:
        return (
            f"{self.gpus} GPUs ({self.nodes} node{'s' if self.nodes > 1 else ''} of "
            f"{self.ranks_per_node}), {self.gpu_memory / 1e9:g} GB each, links "
            f"{self.intra_node_bandwidth / 1e9:g} GB/s within a node, "
            f"{self.inter_node_bandwidth / 1e9:g} GB/s across"
            + (f", host {self.host_memory / 1e9:g} GB per node" if self.host_memory else "")
        )
