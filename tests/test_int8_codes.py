"""The two-table int8 quantizer gives torchao's codes bit for bit (``_int8_codes.py``).

torchao's own ``quantize_8bit_with_qmap`` is the oracle, on the values a block scaling can
produce: every code value and its float neighbours, every rounding step (found from torchao's
codes on a dense grid) and its neighbours, random values at several magnitudes, random bit
patterns in ``[-1, 1]``, signed zeros, subnormals and NaN; both the signed and the unsigned
code tables. A same-layout checkpoint resumes bitwise only if these codes are torchao's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtypeplan import _formats
from dtypeplan import _int8_codes as int8_codes
from dtypeplan._formats import INT8
from dtypeplan.optimizers.state import storage


def _torchao_codes(values: torch.Tensor, signed: bool) -> torch.Tensor:
    _, _, quant_utils = _formats.torchao()
    qmap = INT8.table(torch.device("cpu"), signed)
    return quant_utils.quantize_8bit_with_qmap(values, qmap)


def _neighbours(values: torch.Tensor, ulps: int = 3) -> torch.Tensor:
    """``values`` and their ``ulps`` nearest floats on each side."""
    out, up, down = [values], values, values
    for _ in range(ulps):
        up = torch.nextafter(up, torch.tensor(2.0))
        down = torch.nextafter(down, torch.tensor(-2.0))
        out += [up, down]
    return torch.cat(out)


def _cases(signed: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    qmap = INT8.table(torch.device("cpu"), signed)
    low = -1.0 if signed else 0.0
    grid = torch.linspace(low, 1.0, 1 << 21)
    codes = _torchao_codes(grid, signed)
    steps = grid[1:][codes[1:] != codes[:-1]]
    uniform = torch.rand(1 << 20, generator=generator) * (1.0 - low) + low
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 21,), generator=generator, dtype=torch.int32)
    patterns = bits.view(torch.float32)
    patterns = patterns[(patterns.abs() <= 1) | patterns.isnan()]
    if not signed:
        patterns = patterns[~(patterns < 0)]
    special = torch.tensor([0.0, -0.0, 1.0, 1e-45, 1e-38, 1e-30, float("nan")])
    if signed:
        special = torch.cat([special, -special[:-1], torch.tensor([-1.0])])
    return {
        "code values": _neighbours(qmap),
        "rounding steps": _neighbours(steps),
        "uniform": uniform,
        "1e-3": uniform * 1e-3,
        "1e-6": uniform * 1e-6,
        "1e-9": uniform * 1e-9,
        "bit patterns": patterns,
        "special": special,
    }


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_equal_torchao(signed: bool) -> None:
    tables = _formats._fast_tables(INT8, torch.device("cpu"), signed)
    assert tables is not None
    for name, values in _cases(signed).items():
        values = values.clamp(-1.0, 1.0) if name != "special" else values
        expected = _torchao_codes(values, signed)
        got = int8_codes.quantize(values, tables)
        differ = expected != got
        assert not bool(differ.any()), (
            f"{name}: {int(differ.sum())} codes differ from torchao's, e.g. values "
            f"{values[differ][:4].tolist()} -> {got[differ][:4].tolist()} "
            f"(torchao {expected[differ][:4].tolist()})"
        )


def test_a_table_with_two_steps_in_a_bucket_is_refused() -> None:
    # Codes 0..2 with steps 1e-4 apart just above 0.5: both fall in one 16-bit bucket.
    def crowded(values: torch.Tensor) -> torch.Tensor:
        return (values >= 0.5001).to(torch.uint8) + (values >= 0.5002).to(torch.uint8)

    with pytest.raises(ValueError, match="more than one code step"):
        int8_codes.build_tables(crowded)


def test_quantized_state_uses_the_tables_and_keeps_torchao_codes() -> None:
    """A stored int8 state holds torchao's codes (what its own ``copy_`` would write)."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 1e-2
    for signed, data in ((True, values), (False, values.abs())):
        stored: object = storage.to_storage(data, "int8", signed=signed)
        _, _, quant_utils = _formats.torchao()
        scaled, _ = quant_utils.scale_tensor(data, 256)
        expected = _torchao_codes(scaled, signed)
        assert torch.equal(stored.codes, expected)  # type: ignore[attr-defined]


def test_dequantized_values_equal_torchao() -> None:
    """Reading an int8 state back gives torchao's own dequantization, bit for bit."""
    _, _, quant_utils = _formats.torchao()
    values = torch.randn(8192, generator=torch.Generator().manual_seed(5)) * 1e-3
    for signed, data in ((True, values), (False, values.abs())):
        stored: Any = storage.to_storage(data, "int8", signed=signed)
        expected = quant_utils.dequant_with_qmap(stored.codes, stored.qmap, stored.scale)
        assert torch.equal(storage.state_values(stored, data.numel()), expected)


def test_fp8_state_reads_back_as_torch_converts_it() -> None:
    """The e4m3 lookup table gives torch's conversion of every code, NaN included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    table = _formats._e4m3_values(torch.device("cpu"))
    assert torch.equal(table.isnan(), codes.float().isnan())
    assert torch.equal(table.nan_to_num(), codes.float().nan_to_num())
    values = torch.randn(8192, generator=torch.Generator().manual_seed(6)) * 1e-3
    stored: Any = storage.to_storage(values, "fp8", signed=True)
    expected = (stored.codes.float().view(-1, 256) * stored.scale.view(-1, 1)).view(-1)
    assert torch.equal(storage.state_values(stored, values.numel()), expected)
