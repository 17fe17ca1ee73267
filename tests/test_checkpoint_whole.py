"""Checkpoint, resume and reshard of the optimizers that need each parameter whole
(``optimizers/whole``): Adafactor (row and column statistics, a vector's variance: states not
laid out like their parameter), DeepSpeed's ``"Muon"`` (Muon's momentum on matrices, AdamW's
step and moments on the rest: other state names per parameter) and ``torch.optim.Muon``, at
ZeRO 0-3, in one process and on 2 ranks, fp32 and bf16 masters and states.

A resumed run ends bitwise where the uninterrupted one does wherever the two see the same
gradients: the same layout, and ZeRO 0, 1 and 2 on 2 ranks (each sums the two ranks' gradients
and divides by 2). Across world sizes (the batch split otherwise) and into or out of ZeRO-3
(FSDP2 reduce-scatters the mean), the state at the cut differs by the ulps of another
summation order, and the resumed run follows the uninterrupted one within the whole-tensor
bounds of tests/test_whole_tensor.py (fp32 Adafactor 1e-5, Muon 2e-3 of the masters; bf16
masters or states 2e-2), with every scalar state (steps, stochastic rounding counts) equal.
Measured (masters, relative, after 4 steps): fp32 Adafactor 1.9e-8 and DeepSpeed's Muon 1.1e-10
across world sizes, 0 between ZeRO-1 and ZeRO-3 on 2 ranks; bf16 Kahan masters and states
(DeepSpeed's Muon) 3.7e-3 to 4.5e-3, as far as the two layouts' uninterrupted runs are apart
(3.8e-3: bf16 parameters at ZeRO-1, FSDP2's fp32 shards at ZeRO-3).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from dtypeplan import checkpoint
from dtypeplan.checkpoint import CheckpointError, CheckpointMismatchError
from dtypeplan.launch import spawn
from tests._helpers import OUT
from tests.workers import checkpoint_whole as cases

MASTER_BOUND = {"Adafactor": 1e-5, "Muon": 2e-3}
BF16_BOUND = 2e-2
SAME_GRADIENTS = {"z1 -> 0": 0, "z1 -> 1": 1, "z1 -> 2": 2, "z3 -> 3": 3}
"""2-rank resumes that see the uninterrupted run's gradients: bitwise to it."""


def _bound(name: str) -> float:
    if "bf16" in name:
        return BF16_BOUND
    return MASTER_BOUND["Adafactor" if name.startswith("Adafactor") else "Muon"]


def _assert_bitwise(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, (what, key)
            assert torch.equal(
                got[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
            ), (what, key)
        else:
            assert got[key] == value, (what, key)


def _relative(got: dict[str, Any], want: dict[str, Any], suffix: str) -> float:
    diff = size = 0.0
    for key, value in want.items():
        if key.endswith(suffix) and torch.is_tensor(value):
            diff += float((got[key].float() - value.float()).square().sum())
            size += float(value.float().square().sum())
    return (diff / size) ** 0.5


def _assert_within(got: dict[str, Any], want: dict[str, Any], name: str, what: str) -> None:
    """Same tensors and shapes, equal scalar states, masters within the case's bound."""
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for key, value in want.items():
        if torch.is_tensor(value) and value.dim() > 0:
            assert got[key].shape == value.shape and got[key].dtype == value.dtype, (what, key)
        elif key.startswith("scalar.param.") or key == "scalar.step":
            assert got[key] == value if not torch.is_tensor(value) else torch.equal(got[key], value)
    error = _relative(got, want, ".master")
    assert error <= _bound(name), (what, error)


def _run(names: list[str], root: str) -> dict[str, dict[str, Any]]:
    """Every layout of ``names``: one process, a 2-rank group, one process again."""
    out: dict[str, dict[str, Any]] = {name: cases.one_process(name, root) for name in names}
    per_rank = spawn(cases.two_rank_group, 2, root, names, timeout_s=300)
    for name in names:
        for rank in per_rank:
            result = rank[name]
            assert result["ok"], f"{name}: {result['message']}\n{result['trace']}"
        out[name].update(per_rank[0][name]["value"])
        out[name].update(cases.one_process_from_two_ranks(name, root))
    return out


def _check(name: str, result: dict[str, Any]) -> None:
    one = result["uninterrupted"]
    _assert_bitwise(result["resumed 0"], one, f"{name}: one process, ZeRO 0 -> 0")
    _assert_bitwise(result["resumed 1"], one, f"{name}: one process, ZeRO 0 -> 1")
    for key, stage in SAME_GRADIENTS.items():
        _assert_bitwise(result[key], result[f"uninterrupted {stage}"], f"{name}: 2 ranks {key}")
    for key in ("z1 -> 3", "z3 -> 1", "p1 -> 1", "p1 -> 3"):
        stage = int(key[-1])
        _assert_within(result[key], result[f"uninterrupted {stage}"], name, f"2 ranks {key}")
        _assert_within(result[key], one, name, f"2 ranks {key} against one process")
    for key in ("from z1", "from z3"):
        _assert_within(result[key], one, name, f"one process {key}")


@pytest.fixture(scope="module")
def default_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _run(list(cases.DEFAULT), str(tmp_path_factory.mktemp("whole")))


@pytest.mark.parametrize("name", cases.DEFAULT)
@pytest.mark.slow
def test_resume_and_reshard(default_results: dict[str, dict[str, Any]], name: str) -> None:
    _check(name, default_results[name])


@pytest.mark.slow
def test_resume_and_reshard_of_every_case(tmp_path: Any) -> None:
    names = [name for name in cases.CASES if name not in cases.DEFAULT]
    results = _run(names, str(tmp_path))
    for name in names:
        _check(name, results[name])


# --- the manifest, refusals, older versions --------------------------------------------------
def _manifest_path(path: str) -> str:
    with open(os.path.join(path, "LATEST")) as handle:
        return os.path.join(path, handle.read().strip(), "manifest.json")


def _read(path: str) -> dict[str, Any]:
    with open(_manifest_path(path)) as handle:
        return json.load(handle)


def _write(path: str, manifest: dict[str, Any]) -> None:
    with open(_manifest_path(path), "w") as handle:
        json.dump(manifest, handle)


def _saved(name: str, path: str) -> str:
    cases.save_at_cut(name, 0, path)
    return path


def test_manifest_records_each_state_with_its_own_shape(tmp_path: Any) -> None:
    manifest = _read(_saved("Adafactor", str(tmp_path / "a")))
    assert manifest["version"] == checkpoint.FORMAT_VERSION == 3
    # Linear(12, 24) weight and bias: factored statistics, and a vector's variance.
    assert manifest["tensors"][0] == {"master": [24, 12], "row_var": [24, 1], "col_var": [1, 12]}
    assert manifest["tensors"][1] == {"master": [24], "variance": [24]}
    assert manifest["scalars"]["param_states"]["scalar.param.1.step"]["value"] == cases.CUT
    manifest = _read(_saved("DeepSpeed Muon", str(tmp_path / "m")))
    assert manifest["tensors"][0] == {"master": [24, 12], "momentum_buffer": [24, 12]}
    assert manifest["tensors"][1] == {"master": [24], "exp_avg": [24], "exp_avg_sq": [24]}
    assert "scalar.param.0.step" not in manifest["scalars"]["param_states"]  # Muon has none


class _LateLayer(torch.nn.Module):
    """The MLP, then a layer that only joins once ``on`` is set: at the cut it has no state."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = cases.whole_model(seed, bias=True)
        self.late = torch.nn.Linear(OUT, OUT)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed + 1)
            for param in self.late.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return self.late(y) if self.on else y


@pytest.mark.parametrize("name", ["Adafactor", "DeepSpeed Muon"])
def test_a_parameter_without_state_at_the_cut_resumes_as_the_uninterrupted_run(
    name: str, tmp_path: Any
) -> None:
    late = _LateLayer(0)
    model, opt = cases.build(name, 0, model=late)
    cases.train(model, opt, range(cases.CUT))
    path = str(tmp_path / "late")
    checkpoint.save(opt, path)
    late.on = True
    cases.train(model, opt, range(cases.CUT, cases.STEPS))
    want = cases.final_state(opt)
    assert _read(path)["tensors"][-1] == {"master": [OUT]}  # the late bias: no state yet
    resumed_late = _LateLayer(7)
    resumed_model, resumed = cases.build(name, 0, model=resumed_late)
    checkpoint.load(resumed, path)
    resumed_late.on = True
    cases.train(resumed_model, resumed, range(cases.CUT, cases.STEPS))
    _assert_bitwise(cases.final_state(resumed), want, f"{name}: late layer")


def test_checkpoint_of_another_class_is_refused_and_the_optimizer_unchanged(
    tmp_path: Any,
) -> None:
    path = _saved("Adafactor", str(tmp_path / "a"))
    model, muon = cases.build("DeepSpeed Muon", 0, seed=3)
    cases.train(model, muon, range(1))
    before = cases.final_state(muon)
    with pytest.raises(CheckpointMismatchError, match="the checkpoint has Adafactor"):
        checkpoint.load(muon, path)
    _assert_bitwise(cases.final_state(muon), before, "refused")


def test_states_another_muon_split_would_misread_are_refused(tmp_path: Any) -> None:
    """Saved with the second matrix on Muon, loaded where it is tagged for AdamW: Muon's
    momentum would be dropped (AdamW starts its moments at zero) without a word."""
    path = _saved("DeepSpeed Muon", str(tmp_path / "m"))
    model = cases.whole_model(3, bias=True)
    model[2].weight.use_muon = False  # type: ignore[union-attr]
    model, opt = cases.build("DeepSpeed Muon", 0, model=model)
    before = cases.final_state(opt)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"parameter 2: the checkpoint holds the states momentum_buffer \[24, 24\], but "
        r"this optimizer's MuonWithAuxAdamW keeps exp_avg \[24, 24\], exp_avg_sq \[24, 24\]",
    ):
        checkpoint.load(opt, path)
    _assert_bitwise(cases.final_state(opt), before, "refused")


def test_version_2_manifest_without_tensors_still_loads(tmp_path: Any) -> None:
    """torch's Muon keeps only momentum laid out like each matrix: what version 2 described."""
    path = _saved("torch Muon", str(tmp_path / "m"))
    manifest = _read(path)
    del manifest["tensors"]
    manifest["version"] = 2
    _write(path, manifest)
    want = cases.uninterrupted("torch Muon", 0)
    _assert_bitwise(cases.resume("torch Muon", 0, path), want, "version 2")


def test_manifest_tensors_are_validated(tmp_path: Any) -> None:
    path = _saved("Adafactor", str(tmp_path / "a"))
    good = _read(path)
    _model, opt = cases.build("Adafactor", 0, seed=3)
    edits = {
        r"tensors\[1\].*not a mapping of its states": lambda m: m["tensors"][1].update(
            variance=[-1]
        ),
        r"tensors\[0\].*not a mapping of its states": lambda m: m["tensors"][0].update(
            master=[12, 24]
        ),
        "'tensors' is missing": lambda m: m.pop("tensors"),
    }
    for message, edit in edits.items():
        manifest = json.loads(json.dumps(good))
        edit(manifest)
        _write(path, manifest)
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(opt, path)
