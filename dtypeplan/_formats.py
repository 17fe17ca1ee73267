"""The optimizer-state formats as records: how one state (an Adam moment, SGD's momentum) is
stored between steps, one :class:`StateFormat` per value of the ``states`` dimension.

A record holds what every part of the package asks of a format, so that none checks a format
by its name or guesses it from a torch dtype: the resolver takes the names
(``STATE_DTYPES``) and the bytes (``plan.memory()``) from it, the optimizers make, encode and
decode their states through it (``optimizers/state/storage.py``), and the checkpoints save a
state's codes under the record's tag, so codes load only into a state of the same format:

* ``fp32``: the values themselves;
* ``bf16``: rounded to nearest (DeepSpeed's ``bf16_optimizer_states``);
* ``int8``: torchao's ``OptimState8bit``: 8-bit codes of a dynamic-tree map (arXiv
  2110.02861), one map for signed states (Adam's first moment) and one for non-negative ones,
  and one fp32 absmax scale per block of 256 values;
* ``fp8``: torchao's ``OptimStateFp8``: e4m3 codes (signed either way) and one fp32 absmax
  scale per block of 256.

A quantized state is one of torchao's tensors over whole blocks (``optimizers/state/storage``
lays each parameter out on block boundaries); a format of the same torchao class with another
code table (another codebook in uint8, say) is another format, told apart by its table. torchao
is imported only when a quantized state is made or read (importing it costs seconds), never
by the resolver.

The wire's ``int8`` (``comm/_quantized_wire.py``, ZeRO++'s quantized gradients) is another
code: symmetric and linear (``absmax / 127``, signed int8 codes), its block its own. Its name
is the config's and it is not a state format: it has no record here.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from dtypeplan import _int8_codes
from dtypeplan._quiet_imports import torchao_import_quiet

__all__ = [
    "BF16",
    "FORMATS",
    "FP8",
    "FP32",
    "INT8",
    "CodebookFormat",
    "Fp8Format",
    "PlainFormat",
    "QuantizedFormat",
    "StateFormat",
    "format_of",
    "state_format",
    "torchao",
]


@functools.cache
def torchao() -> Any:
    """torchao's ``(subclass_8bit, subclass_fp8, quant_utils)``, imported once."""
    try:
        with torchao_import_quiet():
            from torchao.optim import quant_utils, subclass_8bit, subclass_fp8
    except ImportError as error:  # pragma: no cover - torchao is a dependency
        raise ImportError(
            "int8 and fp8 optimizer states are torchao's quantized states: pip install torchao"
        ) from error
    return subclass_8bit, subclass_fp8, quant_utils


@dataclass(frozen=True)
class StateFormat(abc.ABC):
    """One way of storing a state's values: its name, its storage, and its bytes."""

    name: str
    """The ``states`` dimension's spelling (``"int8"``)."""
    bits: int
    """Bits one value takes in storage: a code, or the plain value."""
    storage_dtype: torch.dtype
    """The dtype of the stored values or codes (a packed format holds several per element)."""
    block: int = 1
    """Values per scale (1 for a plain format: no scale)."""
    scale_dtype: torch.dtype | None = None
    """The dtype of a block's scale; None for a plain format."""
    signed_codebooks: bool = False
    """Whether a signed state (Adam's first moment) and a non-negative one (the second) take
    different codes (torchao's int8 maps); else one code serves both."""
    codebook_bytes: int = 0
    """Bytes of the code table of one sign, held once per device (``plan.memory()`` counts
    one per quantized moment)."""
    checkpoint_tag: str = ""
    """The name a checkpoint saves this format's codes under (default: ``name``): codes load
    only into a state whose format has the same tag."""
    reads_untagged_codes: bool = False
    """Whether a state dict written before codes carried their format's tag (``exp_avg.codes``)
    holds this format's codes when they are in ``storage_dtype``: int8 and fp8, the only
    quantized formats then, each with a codes dtype of its own."""

    @property
    def quantized(self) -> bool:
        """Whether values are stored as codes and block scales (else as themselves)."""
        return self.scale_dtype is not None

    @property
    def tag(self) -> str:
        return self.checkpoint_tag or self.name

    def code_count(self, numel: int) -> int:
        """Elements of ``storage_dtype`` that hold ``numel`` values (whole blocks)."""
        return numel * self.bits // (self.storage_dtype.itemsize * 8)

    def stored_bytes(self, numel: int) -> int:
        """Bytes of one state of ``numel`` values: the values, or the codes of whole blocks
        and a scale per block."""
        if self.scale_dtype is None:
            return numel * self.bits // 8
        blocks = -(-numel // self.block)
        return blocks * self.block * self.bits // 8 + blocks * self.scale_dtype.itemsize

    def spans(self, begin: int, end: int) -> tuple[slice, slice]:
        """The codes and the scales that hold stored values ``[begin, end)`` (whole blocks)."""
        codes = slice(self.code_count(begin), self.code_count(end))
        return codes, slice(begin // self.block, end // self.block)

    @abc.abstractmethod
    def holds(self, value: Any) -> bool:
        """Whether ``value`` is a state stored in this format."""


@dataclass(frozen=True)
class PlainFormat(StateFormat):
    """Values stored as themselves in ``storage_dtype`` (rounded to nearest into it)."""

    def holds(self, value: Any) -> bool:
        return type(value) is torch.Tensor and value.dtype == self.storage_dtype


@dataclass(frozen=True)
class QuantizedFormat(StateFormat):
    """Codes and block scales in one of torchao's tensors: what the optimizers call to make,
    encode and decode such a state (``optimizers/state/storage.py``)."""

    @abc.abstractmethod
    def container(self) -> type:
        """The torchao class that holds this format's codes."""

    def holds(self, value: Any) -> bool:
        # A plain tensor never is: torchao is not imported for it.
        return type(value) is not torch.Tensor and isinstance(value, self.container())

    @abc.abstractmethod
    def new(self, numel: int, device: torch.device, *, signed: bool) -> torch.Tensor:
        """A zero state of ``numel`` stored values (whole blocks, at least one)."""

    def parts(self, state: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``state``'s codes, scales, and whether it is signed."""
        return state.codes, state.scale, bool(getattr(state, "signed", True))

    @abc.abstractmethod
    def encode(self, values: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of fp32 ``values`` (whole blocks)."""

    @abc.abstractmethod
    def decode(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, signed: bool
    ) -> None:
        """The fp32 values of ``codes`` and their blocks' ``scales``, into ``out``."""


@dataclass(frozen=True)
class CodebookFormat(QuantizedFormat):
    """8-bit codes that index a table of 256 values in ``[-1, 1]`` (one per sign where
    ``signed_codebooks``), each block scaled by its absmax: torchao's ``OptimState8bit``.
    ``codebook(signed)`` gives the table's values (``codebook(True)`` serves both signs
    without ``signed_codebooks``)."""

    codebook: Callable[[bool], Sequence[float]] | None = None

    def container(self) -> type:
        return torchao()[0].OptimState8bit

    def table(self, device: torch.device, signed: bool) -> torch.Tensor:
        """The code table of ``signed`` states on ``device`` (one tensor, shared)."""
        key = (self.name, device, signed or not self.signed_codebooks)
        found = _TABLES.get(key)  # a dict, not functools.cache: read for every piece
        if found is None:
            assert self.codebook is not None, self.name
            values = list(self.codebook(key[2]))
            found = _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
        return found

    def holds(self, value: Any) -> bool:
        if not super().holds(value):
            return False
        own = self.table(value.qmap.device, value.signed)
        return value.qmap is own or torch.equal(value.qmap, own)

    def new(self, numel: int, device: torch.device, *, signed: bool) -> torch.Tensor:
        codes = torch.zeros(self.code_count(numel), dtype=torch.uint8, device=device)
        scales = torch.zeros(numel // self.block, dtype=self.scale_dtype, device=device)
        return self.container()(codes, scales, self.table(device, signed), signed)

    def encode(self, values: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, quant_utils = torchao()
        scaled, scales = quant_utils.scale_tensor(values, self.block)
        tables = _fast_tables(self, scaled.device, signed or not self.signed_codebooks)
        if tables is None:  # a table the two-table quantizer cannot reproduce: torchao's search
            table = self.table(scaled.device, signed)
            return quant_utils.quantize_8bit_with_qmap(scaled, table), scales
        return _int8_codes.quantize(scaled, tables), scales

    def decode(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, signed: bool
    ) -> None:
        # torchao's dequant_with_qmap (qmap[codes] * scale), with index_select for the lookup:
        # the same values, several times faster than tensor[index] on CPU.
        values = torch.index_select(self.table(codes.device, signed), 0, codes.int())
        blocks = out.view(-1, self.block)
        torch.mul(values.view(-1, self.block), scales.view(-1, 1), out=blocks)


_TABLES: dict[tuple[str, torch.device, bool], torch.Tensor] = {}
"""Each codebook format's table by (name, device, sign)."""


@functools.cache
def _fast_tables(
    fmt: CodebookFormat, device: torch.device, signed: bool
) -> _int8_codes.CodeTables | None:
    """The two-table form of torchao's quantizer for ``fmt``'s table (``_int8_codes``), or None
    where the table has more than one code step in a 16-bit bucket."""
    _, _, quant_utils = torchao()
    qmap = fmt.table(torch.device("cpu"), signed)
    try:
        tables = _int8_codes.build_tables(lambda v: quant_utils.quantize_8bit_with_qmap(v, qmap))
    except ValueError:
        return None
    return tables.to(device)


@dataclass(frozen=True)
class Fp8Format(QuantizedFormat):
    """e4m3 codes, each block scaled so its absmax is e4m3's largest value (448): torchao's
    ``OptimStateFp8``."""

    def container(self) -> type:
        return torchao()[1].OptimStateFp8

    def new(self, numel: int, device: torch.device, *, signed: bool) -> torch.Tensor:
        codes = torch.zeros(self.code_count(numel), dtype=self.storage_dtype, device=device)
        scales = torch.zeros(numel // self.block, dtype=self.scale_dtype, device=device)
        return self.container()(codes, scales)

    def encode(self, values: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torchao()[1].quantize_fp8(values, self.block)

    def decode(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, signed: bool
    ) -> None:
        # Every e4m3 code's fp32 value by lookup: exactly what codes.float() gives, which CPU
        # torch converts element by element at several times the cost.
        values = torch.index_select(_e4m3_values(codes.device), 0, codes.view(torch.uint8).int())
        blocks = out.view(-1, self.block)
        torch.mul(values.view(-1, self.block), scales.view(-1, 1), out=blocks)


@functools.cache
def _e4m3_values(device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 e4m3 codes, by their bits."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.float().to(device)


def _dynamic_tree(signed: bool) -> Sequence[float]:
    subclass_8bit = torchao()[0]
    return subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned()


FP32 = PlainFormat("fp32", 32, torch.float32)
BF16 = PlainFormat("bf16", 16, torch.bfloat16)
INT8 = CodebookFormat(
    "int8",
    8,
    torch.uint8,
    block=256,
    scale_dtype=torch.float32,
    signed_codebooks=True,
    codebook_bytes=256 * 4,
    reads_untagged_codes=True,
    codebook=_dynamic_tree,
)
FP8 = Fp8Format(
    "fp8",
    8,
    torch.float8_e4m3fn,
    block=256,
    scale_dtype=torch.float32,
    reads_untagged_codes=True,
)

_REGISTRY: dict[str, StateFormat] = {f.name: f for f in (FP32, BF16, INT8, FP8)}
FORMATS: Mapping[str, StateFormat] = MappingProxyType(_REGISTRY)
"""Every state format by name, in the order the table shows them."""


def state_format(name: str) -> StateFormat:
    """The record of the state format ``name``; ValueError naming the formats otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer-state format {name!r}; the formats are {', '.join(FORMATS)}"
        ) from None


def format_of(value: Any) -> StateFormat | None:
    """The format ``value`` (a state) is stored in, or None (a tensor of no state format: an
    fp16 copy, or a torchao state whose code table no format has)."""
    if not torch.is_tensor(value):
        return None
    for fmt in FORMATS.values():
        if fmt.holds(value):
            return fmt
    return None
