"""Optimizer-state formats as records (``dtypeplan/_formats.py``): the records hold what the
code assumed of int8 and fp8, the memory model gives the numbers it gave before, checkpoints
and state dicts name a state's format from its record (codes of one format never load as
another's, even in the same storage dtype), and quantized states work on ranks that hold no
element of some parameter.

The checkpoint cases use a format of the tests' own: ``lin8``, linear 8-bit codes in uint8
in torchao's ``OptimState8bit``, like int8 in everything but its code table. A checkpoint that
read the format off the codes' dtype took lin8 codes for int8 ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan import _formats, checkpoint
from dtypeplan._formats import FORMATS, INT8, CodebookFormat, format_of, state_format
from dtypeplan.launch import spawn
from dtypeplan.optimizers.state import storage
from dtypeplan.resolver._dimensions import STATE_DTYPES, STATE_PAIRS
from dtypeplan.resolver._memory import memory_model
from tests._helpers import make_model
from tests.workers import checkpoint as checkpoint_cases
from tests.workers.state_formats import empty_pieces_group

EPS = {"fp8": 2.0**-4, "int8": 0.123, "int8_unsigned": 0.066}
"""Each format's error of a value, relative to its block's absmax (test_optimizer_states.py)."""


def test_the_records_hold_what_the_code_assumed() -> None:
    assert STATE_DTYPES == tuple(FORMATS) == ("fp32", "bf16", "int8", "fp8")
    assert [f.name for f in FORMATS.values() if f.quantized] == ["int8", "fp8"]
    for name in ("int8", "fp8"):
        fmt = FORMATS[name]
        assert (fmt.bits, fmt.block, fmt.scale_dtype, fmt.tag) == (8, 256, torch.float32, name)
        # One byte a value of whole blocks, one fp32 scale a block.
        assert fmt.stored_bytes(300) == 512 + 2 * 4 and fmt.stored_bytes(0) == 0
        assert fmt.spans(256, 768) == (slice(256, 768), slice(1, 3))
    assert FORMATS["int8"].storage_dtype == torch.uint8 and FORMATS["int8"].signed_codebooks
    assert FORMATS["fp8"].storage_dtype == torch.float8_e4m3fn
    assert not FORMATS["fp8"].signed_codebooks
    assert (FORMATS["int8"].codebook_bytes, FORMATS["fp8"].codebook_bytes) == (1024, 0)
    assert FORMATS["fp32"].stored_bytes(10) == 40 and FORMATS["bf16"].stored_bytes(10) == 20
    with pytest.raises(ValueError, match="int8, fp8"):
        state_format("fp4")
    for name in FORMATS:
        stored = storage.to_storage(torch.randn(300), name, signed=True)
        assert format_of(stored) is FORMATS[name]
    assert format_of(torch.zeros(3, dtype=torch.float16)) is None


def _old_state_bytes(dtype: str, numel: int) -> int:
    """``resolver/_memory.state_bytes`` before the records, verbatim."""
    if dtype == "fp32":
        return 4 * numel
    if dtype == "bf16":
        return 2 * numel
    blocks = -(-numel // 256)
    return blocks * 256 + 4 * blocks


def _old_states(
    exp_avg: str, exp_avg_sq: str, shard: int, numels: list[int] | None, stage: int, w: int
) -> int:
    """The ``optimizer_states`` of ``memory_model`` before the records (AdamW, no offload)."""

    def moment(dtype: str) -> int:
        if dtype not in ("int8", "fp8") or numels is None:
            return _old_state_bytes(dtype, shard)
        if stage >= 3:
            return sum(_old_state_bytes(dtype, -(-n // w)) for n in numels)
        return sum(_old_state_bytes(dtype, n) for n in numels) * shard // max(sum(numels), 1)

    return moment(exp_avg) + moment(exp_avg_sq) + 1024 * [exp_avg, exp_avg_sq].count("int8")


@pytest.mark.parametrize("states", list(STATE_PAIRS))
def test_the_memory_model_gives_the_numbers_it_gave_before(states: str) -> None:
    exp_avg, exp_avg_sq = STATE_PAIRS[states]
    numels = [1, 255, 256, 257, 4096, 10_000, 3]
    for stage in (0, 1, 2, 3):
        for w in (1, 2, 3, 8):
            for param_numels in (None, numels):
                n = sum(numels)
                got = memory_model(
                    num_params=n,
                    world_size=w,
                    param_dtype=torch.bfloat16,
                    accum_dtype=torch.float32,
                    accumulator_sharded=stage >= 2,
                    zero_stage=stage,
                    state_bytes_per_param=8,
                    exp_avg_dtype=exp_avg,
                    exp_avg_sq_dtype=exp_avg_sq,
                    param_numels=param_numels,
                )
                flat_stage = 2 if stage == 3 and w == 1 else stage
                shard = n // (w if stage >= 1 else 1)
                want = _old_states(exp_avg, exp_avg_sq, shard, param_numels, flat_stage, w)
                assert got["optimizer_states"] == want, (states, stage, w, param_numels)


# --- lin8: a format of the tests' own, in the same storage dtype as int8 --------------------


def _linear(signed: bool) -> list[float]:
    return [k / 127 for k in range(-128, 128)] if signed else [k / 255 for k in range(256)]


LIN8 = CodebookFormat(
    "lin8",
    8,
    torch.uint8,
    block=256,
    scale_dtype=torch.float32,
    signed_codebooks=True,
    codebook_bytes=1024,
    codebook=_linear,
)


@pytest.fixture
def lin8(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(_formats._REGISTRY, "lin8", LIN8)
    yield


CONFIG: dict[str, Any] = {
    "optimizer_states": "int8",
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


def _optimizer(states: str, seed: int) -> tuple[torch.nn.Module, Any]:
    """One process at ZeRO-1, its moments stored as ``states`` (lin8: an int8 plan whose
    moments are switched before the first step, as the table knows no lin8)."""
    plan = dtypeplan.resolve(CONFIG)
    model = plan.prepare_model(make_model(seed))
    optimizer = plan.build(model.parameters())
    if states == "lin8":
        optimizer.low_precision_update.moment_dtypes.update(exp_avg="lin8", exp_avg_sq="lin8")
    return model, optimizer


def _trained(states: str) -> tuple[Any, dict[str, Any]]:
    model, optimizer = _optimizer(states, 0)
    checkpoint_cases.train(model, optimizer, range(3))
    held = {t.dtype for t in optimizer.held_tensors().optimizer_states}
    assert torch.uint8 in held  # codes, as int8's
    return optimizer, checkpoint_cases.snapshot(optimizer)


def _assert_int8_of(value: torch.Tensor, ref: torch.Tensor, key: str) -> None:
    eps = EPS["int8_unsigned" if key.endswith("_sq") else "int8"]
    assert float((value - ref).abs().max()) <= eps * float(ref.abs().max()) + 1e-12, key


def test_lin8_is_a_working_format_of_its_own(lin8: None) -> None:
    """The test format stores and reads back within a linear code's half step (of the
    block's absmax), and its states are lin8's, not int8's, though both are uint8 codes."""
    values = torch.randn(600, generator=torch.Generator().manual_seed(1))
    stored = storage.to_storage(values, "lin8", signed=True)
    assert format_of(stored) is LIN8 and not INT8.holds(stored)
    back = storage.state_values(stored, 600)
    for block in (slice(0, 256), slice(256, 512), slice(512, 600)):
        bound = 0.5 / 127 * float(values[block].abs().max()) * 1.0001
        assert float((back[block] - values[block]).abs().max()) <= bound
    optimizer, _ = _trained("lin8")
    quantized = [v for s in optimizer.inner.state.values() for v in s.values()]
    assert {format_of(v) for v in quantized if storage.is_quantized(v)} == {LIN8}


def test_a_checkpoint_names_its_codes_format_never_its_dtype(lin8: None, tmp_path: Any) -> None:
    """lin8 moments saved, loaded into a run with int8 moments (same layout, same uint8
    codes): the codes are tagged lin8, so the int8 run quantizes the saved values anew
    (each within int8's error), where reading the format off the dtype restored the lin8
    codes bit for bit as int8 codes (values off by up to the whole block's absmax). lin8 into
    lin8 restores them bit for bit."""
    optimizer, saved = _trained("lin8")
    directory = str(tmp_path / "lin8")
    checkpoint.save(optimizer, directory)
    _, into_int8 = _optimizer("int8", 1)
    checkpoint.load(into_int8, directory)
    loaded = checkpoint_cases.snapshot(into_int8)
    for mine, ref in zip(loaded["masters"], saved["masters"], strict=True):
        assert torch.equal(mine, ref)
    for key, ref in saved["states"].items():
        _assert_int8_of(loaded["states"][key], ref, key)
    codes = _manifest_codes(directory)
    assert codes and all(key.split(".")[-2] == "lin8" for key in codes), codes
    _, into_lin8 = _optimizer("lin8", 1)
    checkpoint.load(into_lin8, directory)
    again = checkpoint_cases.snapshot(into_lin8)
    for key, ref in saved["states"].items():
        assert torch.equal(again["states"][key], ref), key


def _manifest_codes(directory: str) -> list[str]:
    latest = (Path(directory) / "LATEST").read_text().strip()
    return list(json.loads((Path(directory) / latest / "manifest.json").read_text())["codes"])


def test_a_state_dict_names_its_codes_format(lin8: None) -> None:
    """The same through ``state_dict()`` / ``load_state_dict()``: lin8 codes carry their tag
    (``exp_avg.lin8.codes``) and an int8 run quantizes the values anew; a state dict written
    before the tags (``exp_avg.codes``) still restores int8 codes bit for bit into int8 and is
    never taken as lin8's."""
    optimizer, saved = _trained("lin8")
    state_dict = optimizer.state_dict()
    _, into_int8 = _optimizer("int8", 1)
    into_int8.load_state_dict(state_dict)
    loaded = checkpoint_cases.snapshot(into_int8)
    for key, ref in saved["states"].items():
        _assert_int8_of(loaded["states"][key], ref, key)
    entries = [e for e in state_dict["state"].values() if isinstance(e, dict)]
    assert any("exp_avg.lin8.codes" in e for e in entries), entries[0].keys()
    # Untagged codes (a state dict of before): int8's when uint8.
    int8_optimizer, int8_saved = _trained("int8")
    untagged = _untagged(int8_optimizer.state_dict(), "int8")
    _, into_int8 = _optimizer("int8", 1)
    into_int8.load_state_dict(untagged)
    for key, ref in int8_saved["states"].items():
        assert torch.equal(checkpoint_cases.snapshot(into_int8)["states"][key], ref), key
    _, into_lin8 = _optimizer("lin8", 1)
    into_lin8.load_state_dict(_untagged(int8_optimizer.state_dict(), "int8"))
    loaded = checkpoint_cases.snapshot(into_lin8)
    for key, ref in int8_saved["states"].items():
        bound = 0.5 / 127 * float(ref.abs().max()) * 1.0001  # lin8's half step, not int8 codes
        assert float((loaded["states"][key] - ref).abs().max()) <= bound, key


def _untagged(state_dict: dict[str, Any], tag: str) -> dict[str, Any]:
    """``state_dict`` with its codes keys as they were before the tags."""
    for entry in state_dict["state"].values():
        if isinstance(entry, dict):
            for key in [k for k in entry if f".{tag}." in k]:
                entry[key.replace(f".{tag}.", ".")] = entry.pop(key)
    return state_dict


BEFORE = Path(__file__).parent / "data" / "checkpoints" / "before-trust-bf16-int8-fp8-zero1"
"""A checkpoint saved before the records (int8 first moments, fp8 second), tagged int8 / fp8."""


def test_a_checkpoint_saved_before_the_records_restores_its_codes() -> None:
    """Its ``codes.*.int8`` / ``codes.*.fp8`` keys are the int8 and fp8 records' tags: a load
    into the same layout and formats restores the codes bit for bit, so the moments read back
    as the fp32 values the checkpoint stored (what fp32 states load), where quantizing those
    values anew moves some by a code step (1% or more). (Within 1 ulp, not bit for bit: with
    ``ATEN_CPU_CAPABILITY=default`` a few int8 values decode 1 ulp off what the AVX build that
    saved them wrote, on main as here.)"""
    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 300},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    codes = _manifest_codes(str(BEFORE))
    assert {key.split(".")[-2] for key in codes} == {INT8.tag, FORMATS["fp8"].tag}
    loaded = {}
    for states in ("int8/fp8", "fp32"):
        exp_avg, exp_avg_sq = STATE_PAIRS[states]
        plan = dtypeplan.resolve(
            {**config, "optimizer_states": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}
        )
        optimizer = plan.build(plan.prepare_model(make_model(5)).parameters())
        checkpoint.load(optimizer, str(BEFORE))
        loaded[states] = checkpoint_cases.snapshot(optimizer)["states"]
    assert loaded["int8/fp8"].keys() == loaded["fp32"].keys()
    for key, values in loaded["fp32"].items():
        torch.testing.assert_close(loaded["int8/fp8"][key], values, rtol=2**-21, atol=0)


# --- ranks that hold no element of a parameter ---------------------------------------------

STEPS, LR = 3, 1e-2


def _empty_pieces_cases() -> list[dict[str, Any]]:
    def case(stage: int, states: str) -> dict[str, Any]:
        exp_avg, exp_avg_sq = STATE_PAIRS[states]
        return {
            "name": f"z{stage}-{states}",
            "steps": STEPS,
            "states": states,
            "config": {
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 10_000},
                "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
                "optimizer_states": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            },
        }

    return [case(3, "int8"), case(3, "fp8"), case(3, "fp8/int8"), case(1, "int8"), case(2, "fp8")]


def _eps(states: str) -> float:
    """Adam's direction m / sqrt(v) off by at most eps_m + eps_v / 2 relative per step."""
    exp_avg, exp_avg_sq = STATE_PAIRS[states]
    return EPS[exp_avg] + EPS["int8_unsigned" if exp_avg_sq == "int8" else exp_avg_sq] / 2


EMPTY_ON_A_RANK = ("token", "head.weight", "head.bias", "scale")
"""The parameters some rank holds no element of (ZeRO-3: rank 1; flat: rank 0 or 1)."""


@pytest.mark.slow
def test_quantized_states_on_ranks_without_a_piece_of_a_parameter(tmp_path: Any) -> None:
    """2 gloo ranks. ZeRO-3 with int8 / fp8 states and parameters whose first dimension is 1
    (a ``[1, d]`` token, a ``Linear(d, 1)`` head, a 0-dim scale): rank 1's local shards of
    them are empty (it raised ZeroDivisionError inside torchao while rank 0 waited in the next
    collective). ZeRO-1/2: one flat bucket, rank 0's chunk holds none of the head, rank 1's
    none of the token. Against one-process fp32 AdamW after ``STEPS``: step 1 is exact, each
    later one moves a weight by at most lr * eps * |u| more or less (|u| up to 2): every
    weight of those parameters within that (their moments have blocks of their own), and all
    weights together within it relative to their RMS of 0.3 (test_optimizer_states.py's
    bound: an element far below its block's absmax, as fp8 flushes a small second moment,
    can be off by more alone). A checkpoint and a state_dict restore the states exactly and
    train on."""
    cases = _empty_pieces_cases()
    per_rank = spawn(empty_pieces_group, 2, cases, str(tmp_path), timeout_s=300)
    for results in per_rank:
        for case, result in zip(cases, results, strict=True):
            step_error = 2 * (STEPS - 1) * LR * _eps(case["states"])
            for name in EMPTY_ON_A_RANK:
                error = result["errors"][name]
                assert error <= step_error, (result["name"], name, error, step_error)
            rtol = step_error / 0.3
            assert result["rel_error"] <= rtol, (result["name"], result["rel_error"], rtol)
            assert result["restored"] == {"checkpoint": True, "state_dict": True}, result
