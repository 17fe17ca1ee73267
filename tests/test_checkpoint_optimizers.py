"""Checkpoints of every elementwise ``torch.optim`` class: per-element states per parameter,
scalar states (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``...) per param group.

A resumed run must end bitwise where the uninterrupted one does: the update is elementwise and
every chunk sees the same gradients and scalars, so nothing may differ, not even an ulp. In this
process (world size 1) every class goes ZeRO 0 -> 1 or 1 -> 0 through ``dtypeplan.checkpoint``
and through ``state_dict()``; one spawned 2-rank group reshards three classes from stage 1 to
stage 2 with other buckets (see ``tests/workers/checkpoint_optimizers.py``).
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
from dtypeplan.resolver._optimizer_kind import ELEMENTWISE
from tests._helpers import CLIENT_HYPERPARAMETERS
from tests.workers import checkpoint_optimizers as cases

NAMES = sorted(CLIENT_HYPERPARAMETERS)


def test_every_elementwise_class_is_covered() -> None:
    assert {cls.__name__ for cls in ELEMENTWISE} == set(NAMES)


def _assert_bitwise(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(
                got[key].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)
            ), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("name", NAMES)
def test_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(
    name: str, tmp_path: Any
) -> None:
    save_stage = NAMES.index(name) % 2
    want = cases.uninterrupted(name, 1 - save_stage)
    got = cases.resumed(name, str(tmp_path / "ckpt"), save_stage, 1 - save_stage)
    _assert_bitwise(got, want)
    # The scalars are really there (not only step): e.g. NAdam's mu_product, ASGD's eta, mu.
    scalars = {k.rsplit(".", 1)[1] for k in want if k.startswith("scalar.group.1.")}
    expected = {
        "SGD": set(),
        "NAdam": {"step", "mu_product"},
        "ASGD": {"step", "eta", "mu"},
    }.get(name, {"step"})
    assert scalars == expected


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_of_every_class(name: str) -> None:
    stage = NAMES.index(name) % 2
    _assert_bitwise(cases.state_dict_resumed(name, stage), cases.uninterrupted(name, stage))


def test_two_ranks_stage1_checkpoint_resumes_bitwise_at_stage2(tmp_path: Any) -> None:
    results = spawn(cases.two_rank_group, 2, str(tmp_path), timeout_s=240)
    for rank in results:
        for name in cases.RESHARDED:
            result = rank[name]
            assert result["ok"], f"{name}: {result['message']}\n{result['trace']}"
            _assert_bitwise(result["value"]["resumed"], result["value"]["uninterrupted"])


def _manifest_path(path: str) -> str:
    with open(os.path.join(path, "LATEST")) as handle:
        return os.path.join(path, handle.read().strip(), "manifest.json")


def _edit(path: str, edit: Any) -> None:
    with open(_manifest_path(path)) as handle:
        manifest = json.load(handle)
    edit(manifest)
    with open(_manifest_path(path), "w") as handle:
        json.dump(manifest, handle)


@pytest.fixture
def nadam(tmp_path: Any) -> str:
    model, opt = cases.build("NAdam", 1)
    cases.train(model, opt, range(cases.BEFORE))
    path = str(tmp_path / "nadam")
    checkpoint.save(opt, path)
    return path


def test_group_scalars_are_in_the_manifest_with_their_dtype(nadam: str) -> None:
    with open(_manifest_path(nadam)) as handle:
        states = json.load(handle)["scalars"]["group_states"]
    assert set(states) == {f"scalar.group.{g}.{n}" for g in (0, 1) for n in ("step", "mu_product")}
    assert states["scalar.group.0.step"] == {"value": 3.0, "dtype": "float32"}
    assert states["scalar.group.1.mu_product"]["dtype"] == "float32"


def test_checkpoint_of_another_class_is_refused(nadam: str) -> None:
    _model, radam = cases.build("RAdam", 0)
    before = cases.final_state(radam)
    with pytest.raises(
        CheckpointMismatchError, match="the checkpoint has NAdam, this optimizer is RAdam"
    ):
        checkpoint.load(radam, nadam)
    _assert_bitwise(cases.final_state(radam), before)


def test_param_group_count_must_match_when_scalars_are_per_group(nadam: str) -> None:
    _model, opt = cases.build("NAdam", 0)
    _edit(nadam, lambda m: m["param_groups"].append(dict(m["param_groups"][1])))
    # The manifest's own groups hold its scalars; the optimizer has 2 groups, the checkpoint 3.
    with pytest.raises(CheckpointMismatchError, match="the checkpoint has 3 param groups"):
        checkpoint.load(opt, nadam, verify=False)


BAD_GROUP_STATES = {
    "nan": (lambda s: s["scalar.group.0.mu_product"].update(value=float("nan"))),
    "beyond-groups": (lambda s: s.update({"scalar.group.2.step": {"value": 3.0}})),
    "malformed-key": (lambda s: s.update({"scalar.group.x.step": {"value": 3.0}})),
    "unknown-dtype": (lambda s: s["scalar.group.0.step"].update(dtype="float33")),
    "float-in-int-dtype": (lambda s: s["scalar.group.0.step"].update(dtype="int64")),
    "extra-field": (lambda s: s["scalar.group.0.step"].update(device="cuda")),
}


@pytest.mark.parametrize("case", sorted(BAD_GROUP_STATES))
def test_damaged_group_scalars_are_refused_before_anything_changes(nadam: str, case: str) -> None:
    _edit(nadam, lambda m: BAD_GROUP_STATES[case](m["scalars"]["group_states"]))
    model, opt = cases.build("NAdam", 1, seed=3)
    cases.train(model, opt, range(2))
    before = cases.final_state(opt)
    with pytest.raises(CheckpointError, match="group_states"):
        checkpoint.load(opt, nadam, verify=False)
    _assert_bitwise(cases.final_state(opt), before)


def test_checkpoint_without_group_scalars_still_loads_adam(tmp_path: Any) -> None:
    """Written before the scalars were kept per group: ``scalars.step`` is Adam's step."""
    path = str(tmp_path / "old")
    model, opt = cases.build("Adam", 1)
    cases.train(model, opt, range(cases.BEFORE))
    checkpoint.save(opt, path)
    _edit(path, lambda m: m["scalars"].pop("group_states"))
    fresh_model, fresh = cases.build("Adam", 1, seed=7)
    checkpoint.load(fresh, path, verify=False)
    cases.train(fresh_model, fresh, range(cases.BEFORE, cases.BEFORE + cases.AFTER))
    _assert_bitwise(cases.final_state(fresh), cases.uninterrupted("Adam", 1))
