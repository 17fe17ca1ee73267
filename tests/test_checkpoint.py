"""dtypeplan.checkpoint: resharding loads, atomic saves, refusals.

One spawned group of 4 ranks carries the multi-rank cases (see ``tests/checkpoint_cases.py``):
a 2-rank subgroup saves four runs (fp32 AdamW, bf16 AdamW, fp32 SGD with momentum, fp16 AdamW
with a moving loss scale) at ZeRO stage 1 with several buckets; they are loaded on 4 ranks at
stages 1 and 2, on 2 ranks at stages 0 and 2, and in this process (torch.distributed off) on one
rank. A resumed run must continue with the losses of the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import threading
import time
from typing import Any
from unittest import mock

import pytest
import torch

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.checkpoint import CheckpointError, CheckpointMismatchError, _io
from dtypeplan.launch import spawn
from tests._helpers import make_model
from tests.workers import checkpoint as cases
from tests.workers import exact_resume

LOSS_RTOL = {"fp32": 1e-5, "sgd": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
TIMINGS: dict[str, float] = {}


def _ok(result: dict[str, Any]) -> Any:
    assert result["ok"], f"{result['type']}: {result['message']}\n{result['trace']}"
    return result["value"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def spawned(root: str) -> list[dict[str, Any]]:
    """The one spawned group (4 ranks; see checkpoint_cases), per rank."""
    start = time.perf_counter()
    results = spawn(cases.four_rank_group, 4, root, timeout_s=240)
    TIMINGS["4-rank group"] = time.perf_counter() - start
    return results


@pytest.fixture(scope="module")
def saved(spawned: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The 2-rank reference runs, as rank 0 saw them."""
    return {case: _ok(result) for case, result in spawned[0]["save"].items()}


@pytest.fixture(scope="module")
def one(root: str, spawned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Loads in this process, torch.distributed not initialized."""
    start = time.perf_counter()
    loads = {}
    for case, stage in [("fp32", 1), ("fp32", 0), ("bf16", 1), ("sgd", 1), ("fp16", 0)]:
        loads[f"1 rank/{case}/stage{stage}"] = cases.capture(
            lambda case=case, stage=stage: cases.load_case(root, case, stage, None)
        )
    TIMINGS["1-rank loads"] = time.perf_counter() - start
    return [{"load": loads}]


def _loads(request: pytest.FixtureRequest, group: str) -> list[tuple[str, dict[str, Any]]]:
    ranks = request.getfixturevalue(group)
    return [(key, rank["load"][key]) for rank in ranks for key in rank["load"]]


def test_public_names() -> None:
    for name in checkpoint.__all__:
        assert hasattr(checkpoint, name), name
    assert issubclass(CheckpointMismatchError, CheckpointError)
    assert issubclass(CheckpointError, ValueError)


def test_saves_succeed_on_every_rank(spawned: list[dict[str, Any]]) -> None:
    for rank in spawned[:2]:
        assert rank["save"].keys() == cases.CASES.keys()
        for result in rank["save"].values():
            _ok(result)
    keys = {key for rank in spawned for key in rank["load"]}
    assert len(keys) == len(cases.FOUR_RANK_LOADS) + sum(len(v) for v in cases.PAIR_LOADS.values())


@pytest.mark.parametrize("group", ["one", "spawned"])
def test_resumed_run_continues_the_uninterrupted_one(
    request: pytest.FixtureRequest, group: str, saved: dict[str, dict[str, Any]]
) -> None:
    """Losses after a load (other world size / stage / bucket layout) equal the reference."""
    for key, result in _loads(request, group):
        loaded = _ok(result)
        case = key.split("/")[1]
        reference = saved[case]
        for step, (mine, ref) in enumerate(
            zip(loaded["losses_after"], reference["losses_after"], strict=True)
        ):
            assert abs(mine - ref) <= LOSS_RTOL[case] * abs(ref), (
                f"{group} {key}: step {cases.STEPS_BEFORE + step} loss {mine} "
                f"vs uninterrupted {ref}"
            )


@pytest.mark.parametrize("group", ["one", "spawned"])
def test_load_restores_weights_states_and_scalars(
    request: pytest.FixtureRequest, group: str, saved: dict[str, dict[str, Any]]
) -> None:
    for key, result in _loads(request, group):
        loaded = _ok(result)
        reference = saved[key.split("/")[1]]
        for i, (mine, ref) in enumerate(zip(loaded["masters"], reference["masters"], strict=True)):
            assert torch.equal(mine, ref), f"{group} {key}: master {i} differs"
        for i, (param, ref) in enumerate(zip(loaded["params"], reference["masters"], strict=True)):
            assert torch.equal(param, ref.to(param.dtype)), (
                f"{group} {key}: parameter {i} not loaded"
            )
        assert loaded["states"].keys() == reference["states"].keys(), key
        for name, ref in reference["states"].items():
            assert torch.equal(loaded["states"][name], ref), f"{group} {key}: {name} differs"
        # The loss scaler carries state only in fp16; elsewhere it is off and not restored.
        scalars = ("step", "loss_scale", "skipped_steps") + (("scaler",) if "fp16" in key else ())
        for scalar in scalars:
            assert loaded[scalar] == reference[scalar], f"{group} {key}: {scalar}"


def test_sharded_loads_read_only_their_shard(spawned: list[dict[str, Any]]) -> None:
    """ZeRO 1-2 ranks read their own shard of the masters (a chunk: at most total/n + ALIGN)."""
    total = sum(p.numel() for p in cases.make_model(0).parameters())
    for key, ranks in [("4 ranks/fp32/stage1", spawned), ("2 ranks/fp32/stage2", spawned[2:])]:
        counts = [_ok(rank["load"][key])["read_numel"] for rank in ranks]
        assert sum(counts) == total, (key, counts)
        assert max(counts) <= total / len(ranks) + 64, (key, counts)
    # Stage 0 holds (and reads) everything on every rank.
    for rank in spawned[:2]:
        assert _ok(rank["load"]["2 ranks/fp32/stage0"])["read_numel"] == total


def test_fp16_loss_scale_and_step_survive(
    saved: dict[str, dict[str, Any]], spawned: list[dict[str, Any]]
) -> None:
    reference = saved["fp16"]
    # The run moved the scale (overflow at step 1, growth every 2 steps) and skipped one step,
    # so a load that fell back to the initial scale would not match.
    assert reference["skipped_steps"] == 1
    assert reference["loss_scale"] != 2.0**8
    assert reference["step"] == cases.STEPS_BEFORE - 1
    for rank in spawned:
        loaded = _ok(rank["load"]["4 ranks/fp16/stage1"])
        assert loaded["loss_scale"] == reference["loss_scale"]
        assert loaded["skipped_steps"] == 1
        assert loaded["step"] == reference["step"]
        assert loaded["scaler"] == reference["scaler"]


def test_interrupted_save_keeps_the_previous_checkpoint(spawned: list[dict[str, Any]]) -> None:
    for rank in spawned[2:]:
        outcome = _ok(rank["interrupted"])
        failed = outcome["failed"]
        assert not failed["ok"] and failed["type"] == "CheckpointError", failed
        assert "disk died" in failed["message"]
        # A failed save removes its temporary directory (issue 12, item 7).
        assert outcome["leftovers"] == []
        for who in ("one", "all"):  # ENOSPC on one rank, on both
            full = outcome["disk_full"][who]
            assert not full["ok"] and full["type"] == "CheckpointError", full
            assert "no space left on device" in full["message"], full["message"]
            assert len(full["entries"]) == 2 and "LATEST" in full["entries"], full["entries"]
        for mine, ref in zip(outcome["reloaded_masters"], outcome["first_masters"], strict=True):
            assert torch.equal(mine, ref)
        assert len(outcome["after_next_save"]) == 2 and "LATEST" in outcome["after_next_save"]


def test_refusals_on_every_rank(spawned: list[dict[str, Any]]) -> None:
    for rank in spawned[2:]:
        out = _ok(rank["refusals"])
        kind = out["optimizer_type"]
        assert kind["type"] == "CheckpointMismatchError", kind
        assert "AdamW" in kind["message"] and "SGD" in kind["message"]
        shapes = out["shapes"]
        assert shapes["type"] == "CheckpointMismatchError", shapes
        assert "6 trainable parameters, this optimizer 4" in shapes["message"]
        assert "[24, 12]" in shapes["message"] and "[20, 12]" in shapes["message"]
        truncated = out["truncated"]
        assert truncated["type"] == "CheckpointError", truncated
        assert "damaged-truncated" in truncated["message"] and "truncated" in truncated["message"]
        zeroed = out["zeroed"]
        assert zeroed["type"] == "CheckpointError", zeroed
        # Bytes overwritten with sizes kept: caught by the sha256 check before DCP reads.
        assert "damaged-zeroed" in zeroed["message"] and "sha256 differs" in zeroed["message"]
        assert out["unchanged_after_failed_loads"]


def test_format_written_through_full_state_loads_sharded(
    root: str, spawned: list[dict[str, Any]]
) -> None:
    """4 ranks wrote full tensors (full_state); one process reads them into its shard layout."""
    reference = _ok(spawned[0]["full_state_save"])
    model, opt = cases.build("fp32", stage=1, seed=5)
    checkpoint.load(opt, os.path.join(root, "written-as-full"))
    loaded = cases.snapshot(opt)
    for mine, ref in zip(loaded["masters"], reference["masters"], strict=True):
        assert torch.equal(mine, ref)
    for name, ref in reference["states"].items():
        assert torch.equal(loaded["states"][name], ref), name
    assert loaded["step"] == reference["step"] == 2
    with open(os.path.join(root, "written-as-full", "LATEST")) as handle:
        snap = handle.read().strip()
    with open(os.path.join(root, "written-as-full", snap, "manifest.json")) as handle:
        manifest = json.load(handle)
    assert manifest["written_as"] == "full" and manifest["world_size"] == 4
    assert manifest["plan"]["zero_stage"] == 2


# --- single process: damage, refusals, dtype change ------------------------------------------
@pytest.fixture
def trained(tmp_path: Any) -> tuple[str, torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    model, opt = cases.build("fp32", stage=1)
    cases.train(model, opt, range(2))
    path = str(tmp_path / "ckpt")
    checkpoint.save(opt, path)
    return path, model, opt


def _snapshot_dir(path: str) -> str:
    with open(os.path.join(path, "LATEST")) as handle:
        return os.path.join(path, handle.read().strip())


def _load_fresh(path: str, case: str = "fp32") -> dtypeplan.MixedPrecisionOptimizer:
    _model, opt = cases.build(case, stage=0, seed=4)
    checkpoint.load(opt, path)
    return opt


def test_manifest_records_layout_free_facts(trained: tuple[str, Any, Any]) -> None:
    path, model, opt = trained
    with open(os.path.join(_snapshot_dir(path), "manifest.json")) as handle:
        manifest = json.load(handle)
    assert manifest["version"] == checkpoint.FORMAT_VERSION and manifest["world_size"] == 1
    assert manifest["scalars"]["param_states"] == {}  # every parameter stepped every step
    assert manifest["shapes"] == [list(p.shape) for p in model.parameters()]
    assert (
        manifest["optimizer"]["type"] == "AdamW" and manifest["optimizer"]["params"]["lr"] == 1e-2
    )
    assert manifest["states"] == ["master", "exp_avg", "exp_avg_sq"]
    assert manifest["scalars"]["step"] == 2
    assert manifest["plan"] == json.loads(json.dumps(opt.plan.to_dict()))
    assert manifest["written_as"] == "sharded"


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p, s: os.remove(os.path.join(p, "LATEST")), "no LATEST file"),
        (lambda p, s: shutil.rmtree(s), "which does not exist"),
        (
            lambda p, s: open(os.path.join(p, "LATEST"), "w").write("../../etc\n"),
            "not a snapshot name",
        ),
        (lambda p, s: os.remove(os.path.join(s, "manifest.json")), "manifest is missing"),
        (
            lambda p, s: open(os.path.join(s, "manifest.json"), "w").write('{"format": '),
            "not valid JSON",
        ),
        (lambda p, s: os.remove(os.path.join(s, ".metadata")), "missing from the checkpoint"),
        (lambda p, s: os.remove(os.path.join(s, "__0_0.distcp")), "missing from the checkpoint"),
        (
            lambda p, s: open(os.path.join(s, "__0_0.distcp"), "ab").write(b"x"),
            "the manifest recorded",
        ),
    ],
    ids=[
        "no-latest",
        "no-snapshot",
        "bad-latest",
        "no-manifest",
        "bad-json",
        "no-metadata",
        "no-data",
        "grown",
    ],
)
def test_damaged_checkpoint_is_refused_by_name(
    trained: tuple[str, Any, Any], damage: Any, expected: str
) -> None:
    path, _model, _opt = trained
    damage(path, _snapshot_dir(path))
    with pytest.raises(CheckpointError, match=expected) as info:
        _load_fresh(path)
    assert path in str(info.value) and info.value.path == path


def _load_in_thread(path: str, fifos: list[str]) -> BaseException | None:
    """``_load_fresh(path)`` with a deadline: a load blocked opening a FIFO is released by
    opening the FIFO for writing (which ends the reader's wait), and reported as a hang."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            _load_fresh(path)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10.0)
    if worker.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(20.0)
        pytest.fail(f"checkpoint.load blocked on a FIFO in {path}")
    return outcome[0]


def _replace_with_fifo(file: str) -> list[str]:
    os.remove(file)
    os.mkfifo(file)
    return [file]


def _replace_with_link(file: str, target: str) -> list[str]:
    os.remove(file)
    os.symlink(target, file)
    return []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize(
    "make, expected",
    [
        (
            lambda p, s: _replace_with_fifo(os.path.join(p, "LATEST")),
            r"cannot read LATEST \(is a FIFO \(named pipe\), not a regular file\)",
        ),
        (
            lambda p, s: _replace_with_fifo(os.path.join(s, "manifest.json")),
            r"cannot read the manifest \(is a FIFO",
        ),
        (
            lambda p, s: _replace_with_fifo(os.path.join(s, "__0_0.distcp")),
            r"__0_0.distcp: is a FIFO \(named pipe\), not a regular file",
        ),
        (
            lambda p, s: _replace_with_link(os.path.join(p, "LATEST"), os.devnull),
            r"cannot read LATEST \(is a character device",
        ),
    ],
    ids=["latest-fifo", "manifest-fifo", "data-fifo", "latest-device"],
)
def test_checkpoint_files_that_are_not_regular_are_refused_without_blocking(
    trained: tuple[str, Any, Any], make: Any, expected: str
) -> None:
    """A FIFO (open blocks until a writer comes) or a device as LATEST, the manifest or a data
    file is refused by name, as a config path is, instead of hanging the load."""
    path, _model, _opt = trained
    fifos = make(path, _snapshot_dir(path))
    error = _load_in_thread(path, fifos)
    assert isinstance(error, CheckpointError), error
    assert re.search(expected, str(error)), str(error)


def test_manifest_with_wrong_version_or_fields_is_refused(trained: tuple[str, Any, Any]) -> None:
    path, _model, _opt = trained
    where = os.path.join(_snapshot_dir(path), "manifest.json")
    with open(where) as handle:
        good = json.load(handle)
    for change, expected in [
        ({"version": 99}, "manifest version 99"),
        ({"shapes": "x"}, "'shapes'"),
    ]:
        with open(where, "w") as handle:
            json.dump({**good, **change}, handle)
        with pytest.raises(CheckpointError, match=expected):
            _load_fresh(path)


def test_version_1_manifest_loads_as_before(trained: tuple[str, Any, Any]) -> None:
    """A version-1 checkpoint (one count per param group, no ``param_states``) loads to the
    same state as the version-2 one it is made from; param_states in it, or malformed ones in
    version 2, are refused."""
    path, _model, _opt = trained
    expected = _state_copy(_load_fresh(path))
    where = os.path.join(_snapshot_dir(path), "manifest.json")
    with open(where) as handle:
        good = json.load(handle)
    old = copy.deepcopy(good)
    old["version"] = 1
    del old["scalars"]["param_states"]
    with open(where, "w") as handle:
        json.dump(old, handle)
    assert _bitwise_equal(_state_copy(_load_fresh(path)), expected)
    step = {"value": 1.0, "dtype": "float32"}
    for version, states, message in [
        (1, {"scalar.param.0.step": step}, "which version 2 introduced"),
        (2, {"scalar.param.9.step": step}, "one of its 6 trainable parameters"),
        (2, {"scalar.param.0.no_state": {"value": 2}}, r"it must be \{\"value\": 1\}"),
        (2, {"scalar.param.0.step": {"value": "x"}}, "a finite number"),
    ]:
        bad = copy.deepcopy(good)
        bad["version"] = version
        bad["scalars"]["param_states"] = states
        with open(where, "w") as handle:
            json.dump(bad, handle)
        with pytest.raises(CheckpointError, match=message):
            _load_fresh(path)


def _late_run(
    optimizer: type[torch.optim.Optimizer], bucket: int, steps: int, skip: int
) -> tuple[torch.nn.Sequential, Any]:
    """Two layers, stage 0; the second gets no gradient at step ``skip`` (its first step
    when ``skip`` is 0: a late start), so its scalar states are its own."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 0, "reduce_bucket_size": bucket}})
    torch.manual_seed(3)
    model = plan.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    opt = plan.build(model.parameters(), optimizer=optimizer, lr=0.01)
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        hidden = model[0](x)
        loss = hidden.square().mean()
        if step != skip:
            loss = loss + model[1](hidden).square().mean()
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    return model, opt


def _scalars_by_param(opt: Any) -> dict[int, dict[str, float]]:
    return {
        i: {n: float(v) for n, v in entry.items() if torch.is_tensor(v) and v.dim() == 0}
        for i, entry in opt.state_dict()["state"].items()
    }


@pytest.mark.parametrize("optimizer", [torch.optim.NAdam, torch.optim.ASGD])
def test_parameters_own_scalar_states_through_full_state(
    tmp_path: Any, optimizer: type[torch.optim.Optimizer]
) -> None:
    """A parameter that skipped a step keeps its own ``step`` (and NAdam's ``mu_product``,
    ASGD's ``eta``/``mu``) through a checkpoint written by ``full_state()`` and loaded in
    pieces into other buckets, and through one written in pieces and loaded by
    ``load_full_state()``; one that has no state yet (save before its first gradient) gets
    none. (The 2-rank and ZeRO 1-3 cases are test_optim_db's late heads.)"""
    from dtypeplan.checkpoint import _adapters

    for steps, skip in ((3, 1), (1, 0)):
        _model, opt = _late_run(optimizer, 40, steps, skip)
        mine = _scalars_by_param(opt)
        assert mine.get(2) != mine[0], mine  # the second layer's own history
        for name, save_io, load_io in (
            ("full-to-pieces", _adapters.FullStateAdapter, _adapters.adapter_for),
            ("pieces-to-full", _adapters.adapter_for, _adapters.FullStateAdapter),
        ):
            path = str(tmp_path / f"{name}-{steps}")
            with mock.patch.object(_io, "adapter_for", save_io):
                checkpoint.save(opt, path)
            _other, fresh = _late_run(optimizer, 1000, 2, -1)  # other buckets, other states
            with mock.patch.object(_io, "adapter_for", load_io):
                checkpoint.load(fresh, path)
            assert _scalars_by_param(fresh) == mine, name
            assert sorted(fresh.state_dict()["state"]) == sorted(mine), name


def test_missing_path_and_foreign_directory(tmp_path: Any, trained: tuple[str, Any, Any]) -> None:
    _path, _model, opt = trained
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        checkpoint.load(opt, tmp_path / "nothing")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a dtypeplan checkpoint directory"):
        checkpoint.save(opt, foreign)
    assert os.listdir(foreign) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint.save(opt, tmp_path / "file")


def test_single_process_save_dying_before_commit_keeps_previous(
    trained: tuple[str, Any, Any],
) -> None:
    path, model, opt = trained
    before = [p.detach().clone() for p in model.parameters()]
    cases.train(model, opt, range(2, 3))
    with mock.patch.object(_io, "commit_directory", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(opt, path)
    assert any(e.endswith(".tmp") for e in os.listdir(path))
    fresh = _load_fresh(path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, [p for g in fresh.param_groups for p in g["params"]], strict=True)
    )


def test_mismatched_model_and_optimizer_are_refused(trained: tuple[str, Any, Any]) -> None:
    path, _model, _opt = trained
    plan = dtypeplan.resolve(cases.config("fp32", stage=1))
    wider = torch.nn.Sequential(
        torch.nn.Linear(12, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 25),
        torch.nn.Tanh(),
        torch.nn.Linear(25, 6),
    )
    opt = plan.build(wider.parameters())
    before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(CheckpointMismatchError) as info:
        checkpoint.load(opt, path)
    message = str(info.value)
    assert "parameter 2 shape: the checkpoint has [24, 24], this optimizer [25, 24]" in message
    assert "parameter 4 shape: the checkpoint has [6, 24], this optimizer [6, 25]" in message
    assert "count" not in message
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))
    _m, adam = cases.build("fp32", stage=1, optimizer="sgd")
    with pytest.raises(
        CheckpointMismatchError, match="the checkpoint has AdamW, this optimizer is SGD"
    ):
        checkpoint.load(adam, path)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_another_number_of_param_groups(tmp_path: Any, optimizer: str) -> None:
    """A one-group checkpoint into a two-group optimizer: refused once it holds step counts
    (AdamW after a step), loaded with a warning without them (SGD); as the docs say."""
    model, opt = cases.build("fp32", stage=1, optimizer=optimizer)
    cases.train(model, opt, range(2))
    path = str(tmp_path / "ckpt")
    checkpoint.save(opt, path)
    plan = dtypeplan.resolve(cases.config("fp32", stage=1, optimizer=optimizer))
    two = make_model(4)
    layers = list(two.parameters())
    grouped = plan.build([{"params": layers[:2]}, {"params": layers[2:], "lr": 0.5}])
    before = [p.detach().clone() for p in two.parameters()]
    if optimizer == "adamw":
        with pytest.raises(CheckpointMismatchError, match="the checkpoint has 1 param groups"):
            checkpoint.load(grouped, path)
        assert all(torch.equal(a, b) for a, b in zip(before, two.parameters(), strict=True))
    else:
        with pytest.warns(UserWarning, match="keeping the optimizer's hyperparameters"):
            checkpoint.load(grouped, path)
        assert grouped.param_groups[1]["lr"] == 0.5
    doc = " ".join((checkpoint.__doc__ or "").split())
    assert "another number of param groups once it holds per-group scalar states" in doc
    assert "loads into another number of groups with a warning" in doc


def test_fp32_checkpoint_resumes_in_bf16(trained: tuple[str, Any, Any]) -> None:
    """Masters are fp32 either way, so a change of parameter dtype is allowed."""
    path, model, opt = trained
    masters = cases.snapshot(opt)["masters"]
    bf16_model, bf16 = cases.build("bf16", stage=2, seed=6)
    checkpoint.load(bf16, path)
    assert all(p.dtype == torch.bfloat16 for p in bf16_model.parameters())
    for param, master in zip(bf16_model.parameters(), masters, strict=True):
        assert torch.equal(param, master.to(torch.bfloat16))
    for mine, ref in zip(cases.snapshot(bf16)["masters"], masters, strict=True):
        assert torch.equal(mine, ref)


def test_hyperparameters_are_restored(trained: tuple[str, Any, Any]) -> None:
    path, _model, opt = trained
    opt.param_groups[0]["lr"] = 0.123
    checkpoint.save(opt, path)
    fresh = _load_fresh(path)
    assert fresh.param_groups[0]["lr"] == 0.123
    assert isinstance(fresh.param_groups[0]["weight_decay"], float)


def test_load_before_any_step_clears_optimizer_state(tmp_path: Any) -> None:
    model, opt = cases.build("fp32", stage=1)
    path = str(tmp_path / "fresh")
    checkpoint.save(opt, path)
    trained_model, trained_opt = cases.build("fp32", stage=1, seed=3)
    cases.train(trained_model, trained_opt, range(2))
    checkpoint.load(trained_opt, path)
    state = cases.snapshot(trained_opt)
    assert state["step"] == 0 and not state["states"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(trained_model.parameters(), model.parameters(), strict=True)
    )


def test_report_timings(spawned: Any, one: Any) -> None:
    # Not an assertion on speed: the numbers go to the log (-rA) for the suite's time budget.
    print("checkpoint test groups:", {k: f"{v:.1f} s" for k, v in TIMINGS.items()})


def test_zero3_checkpoint_resumes_at_zero3_and_at_zero1(tmp_path: Any) -> None:
    results = spawn(cases.zero3_round_trip, 2, str(tmp_path / "ckpt"))[0]
    _check_zero3_bf16_master_conversions(results["bf16_masters"])
    # issue 14 C4: a ZeRO-3 save and load gather nothing (each rank writes its local shards)
    assert results["gathered"] == [0.0], results["gathered"]
    expected = results["uninterrupted"][3:]
    for name in ("resumed_zero3", "resumed_zero1"):
        for got, want in zip(results[name], expected, strict=True):
            # bf16 forward passes: the gradient norms agree to bf16-model noise.
            assert abs(got - want) <= 1e-3 * want, (name, results[name], expected)


def _check_zero3_bf16_master_conversions(got: dict[str, Any]) -> None:
    """ZeRO-3 bf16 masters convert as at stages 0-2 (see the bf16-master conversion test).

    Kahan bf16 -> fp32 and -> another stage with Kahan: exact (the masters are stored as the
    fp32 values they stand for, compensation included; the moments as fp32 values of bf16
    numbers). fp32 -> bf16 to nearest: each master rounded once, to the nearest bf16.
    """
    saved = got["saved"]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in saved["masters"]), (
        "the Kahan compensation was not folded into the saved ZeRO-3 masters"
    )
    assert not any(k.endswith(".kahan_compensation") for k in saved["states"])
    for name in ("as_fp32", "as_zero1_kahan"):
        loaded = got[name]
        for mine, ref in zip(loaded["masters"], saved["masters"], strict=True):
            assert torch.equal(mine, ref), name
        assert loaded["states"].keys() == saved["states"].keys(), name
        for key, value in saved["states"].items():
            assert torch.equal(loaded["states"][key], value), (name, key)
    for mine, ref in zip(got["as_nearest"]["masters"], got["trained_fp32"]["masters"], strict=True):
        assert torch.equal(mine, ref.to(torch.bfloat16).float())
    for key, value in got["trained_fp32"]["states"].items():
        # fp32 moments stay fp32 in a bf16-master optimizer without bf16_optimizer_states.
        assert torch.equal(got["as_nearest"]["states"][key], value), key
    assert got["nearest_shard_dtypes"] == ["torch.bfloat16"]
    # Across world sizes: the 2-rank ZeRO-3 checkpoint on one process (the flat sharded
    # optimizer that one process runs for the same plan), the same masters bit for bit.
    _model, one = _build_bf16(3, bf16={"bf16_optimizer_states": True}, **_KAHAN)
    checkpoint.load(one, got["path"])
    alone = cases.snapshot(one)
    for mine, ref in zip(alone["masters"], saved["masters"], strict=True):
        assert torch.equal(mine, ref)
    for key, value in saved["states"].items():
        assert torch.equal(alone["states"][key], value), key


_KAHAN: dict[str, Any] = {"master_weights": {"dtype": "bf16", "rounding": "kahan"}}


# --- issue 12, item 4: a load validates everything before it changes anything ----------------
def _edit_manifest(edit: Any) -> Any:
    def damage(path: str, snapshot: str) -> None:
        where = os.path.join(snapshot, "manifest.json")
        with open(where) as handle:
            manifest = json.load(handle)
        edit(manifest)
        with open(where, "w") as handle:
            json.dump(manifest, handle)

    return damage


def _flip_byte(path: str, snapshot: str) -> None:
    data = os.path.join(snapshot, "__0_0.distcp")
    with open(data, "r+b") as handle:
        handle.seek(os.path.getsize(data) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))


CORRUPT_MANIFESTS = {
    "lr-boom": (_edit_manifest(lambda m: m["param_groups"][0].update(lr="boom")), "lr"),
    "weight-decay-list": (
        _edit_manifest(lambda m: m["param_groups"][0].update(weight_decay=[0.1])),
        "weight_decay",
    ),
    "lr-nan": (
        _edit_manifest(lambda m: m["param_groups"][0].update(lr=float("nan"))),
        "param_groups",
    ),
    "scaler-no-scale": (_edit_manifest(lambda m: m["scalars"]["scaler"].pop("scale")), "scale"),
    "scaler-nan": (
        _edit_manifest(lambda m: m["scalars"]["scaler"].update(scale=float("nan"))),
        "scale",
    ),
    "loss-scale-inf": (
        _edit_manifest(lambda m: m["scalars"].update(loss_scale=float("inf"))),
        "loss_scale",
    ),
    "negative-step": (_edit_manifest(lambda m: m["scalars"].update(step=-1)), "step"),
    "bool-step": (_edit_manifest(lambda m: m["scalars"].update(step=True)), "step"),
    "world-size-0": (_edit_manifest(lambda m: m.update(world_size=0)), "world_size"),
    "negative-dim": (_edit_manifest(lambda m: m["shapes"][0].__setitem__(0, -3)), "shapes"),
    "duplicate-state": (
        _edit_manifest(lambda m: m["states"].append("exp_avg")),
        "states",
    ),
    "file-escapes": (
        _edit_manifest(lambda m: m["files"].update({"../x": 1})),
        "file entry",
    ),
    "digest-missing-file": (
        _edit_manifest(lambda m: m["digests"]["files"].pop(".metadata")),
        "digests",
    ),
    "flipped-byte": (_flip_byte, "sha256 differs"),
}


def _state_copy(opt: dtypeplan.MixedPrecisionOptimizer) -> Any:
    return copy.deepcopy(
        (opt.state_dict(), [p.detach().clone() for g in opt.param_groups for p in g["params"]])
    )


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes(a), _bytes(b))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_bitwise_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("case", sorted(CORRUPT_MANIFESTS))
def test_failed_load_leaves_the_optimizer_bitwise_unchanged(
    trained: tuple[str, Any, Any], case: str
) -> None:
    path, model, opt = trained
    damage, expected = CORRUPT_MANIFESTS[case]
    damage(path, _snapshot_dir(path))
    cases.train(model, opt, range(2, 3))  # the live state now differs from the checkpoint
    before = _state_copy(opt)
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load(opt, path)
    assert _bitwise_equal(_state_copy(opt), before)
    cases.train(model, opt, range(3, 4))  # and it still trains


def test_flipped_byte_passes_size_checks_without_verify(trained: tuple[str, Any, Any]) -> None:
    # The opt-out skips the digest; the size check alone cannot see a flipped byte.
    path, _model, _opt = trained
    snapshot = _snapshot_dir(path)
    with open(os.path.join(snapshot, "manifest.json")) as handle:
        manifest = json.load(handle)
    assert manifest["digests"]["algorithm"] == "sha256"
    assert set(manifest["digests"]["files"]) == set(manifest["files"])
    _model2, fresh = cases.build("fp32", stage=0, seed=4)
    checkpoint.load(fresh, path, verify=False)


def test_checkpoint_without_digests_still_loads(trained: tuple[str, Any, Any]) -> None:
    # Checkpoints written before digests were recorded: sizes are checked, nothing else.
    path, _model, _opt = trained
    _edit_manifest(lambda m: m.pop("digests"))(path, _snapshot_dir(path))
    _load_fresh(path)


def _build_bf16(stage: int, **blocks: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    config: dict[str, Any] = {
        "bf16": {"enabled": True, **blocks.pop("bf16", {})},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        **blocks,
    }
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(0))
    return model, plan.build(model.parameters())


def test_bf16_master_checkpoints_convert_to_fp32_masters_and_back(tmp_path: Any) -> None:
    """bf16 masters (Kahan, bf16 moments) -> fp32 masters -> bf16 masters (nearest).

    A checkpoint holds every master and state as fp32, the masters as the values they stand
    for: Kahan-compensated bf16 masters are saved as weights + compensation, so bf16 -> fp32 is
    exact for the masters (the compensation is not lost) and for the moments. fp32 -> bf16
    rounds each master and moment to nearest: at most 2**-9 relative (Kahan masters would keep
    the rounding error as their compensation instead).
    """
    kahan = {"master_weights": {"dtype": "bf16", "rounding": "kahan"}}
    model, bf16_opt = _build_bf16(1, bf16={"bf16_optimizer_states": True}, **kahan)
    cases.train(model, bf16_opt, range(3))
    saved = cases.snapshot(bf16_opt)
    assert not any(k.endswith(".kahan_compensation") for k in saved["states"])
    # The saved masters carry the compensation: not all of them are bf16 values.
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in saved["masters"]), (
        "the Kahan compensation was not folded into the saved masters"
    )
    checkpoint.save(bf16_opt, str(tmp_path / "bf16"))

    # The same rounding reloads bitwise, compensation included, at another stage.
    _m, same = _build_bf16(0, bf16={"bf16_optimizer_states": True}, **kahan)
    checkpoint.load(same, str(tmp_path / "bf16"))
    again = cases.snapshot(same)
    assert all(torch.equal(a, b) for a, b in zip(again["masters"], saved["masters"], strict=True))
    assert all(torch.equal(again["states"][k], v) for k, v in saved["states"].items())

    fp32_model, fp32_opt = _build_bf16(2)
    checkpoint.load(fp32_opt, str(tmp_path / "bf16"))
    loaded = cases.snapshot(fp32_opt)
    assert all(torch.equal(a, b) for a, b in zip(loaded["masters"], saved["masters"], strict=True))
    for key, value in loaded["states"].items():
        assert value.dtype == torch.float32 and torch.equal(value, saved["states"][key]), key
    cases.train(fp32_model, fp32_opt, range(3, 5))
    trained = cases.snapshot(fp32_opt)
    checkpoint.save(fp32_opt, str(tmp_path / "fp32"))

    nearest_model, nearest = _build_bf16(1, master_weights={"dtype": "bf16"})
    checkpoint.load(nearest, str(tmp_path / "fp32"))
    back = cases.snapshot(nearest)
    for mine, ref, param in zip(
        back["masters"], trained["masters"], nearest_model.parameters(), strict=True
    ):
        assert torch.equal(mine, ref.to(torch.bfloat16).float())
        assert torch.equal(param.float(), mine)
    for key, value in back["states"].items():
        # fp32 moments stay fp32 in a bf16-master optimizer without bf16_optimizer_states.
        assert torch.equal(value, trained["states"][key]), key
    cases.train(nearest_model, nearest, range(5, 6))


@pytest.mark.parametrize(
    "key",
    [exact_resume.skipped_step_key(*case) for case in exact_resume.HYBRID_SKIPPED_STEP_CASES],
)
def test_hybrid_resume_after_skipped_steps_is_bitwise(
    spawned: list[dict[str, Any]], key: str
) -> None:
    """Issue 29 item 4 on 2 x 2 hybrid ZeRO-2 (4 ranks, two shard groups of 2): a head that
    skips every other step and two NaN steps every parameter skips, resumed through
    dtypeplan.checkpoint into another init, train on bitwise as the uninterrupted run, for
    every master rounding (stochastic with AdamW: 3.9e-3 off before the hashed noise; with
    SGD: a build-seeded generator that no checkpoint held)."""
    for rank in spawned:
        result = _ok(rank["skipped"][key])
        assert result["same_run"], (rank["rank"], key, result)
        assert result["skipped"] == (1, 1, 2), (rank["rank"], key, result)
