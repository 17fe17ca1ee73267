"""A checkpoint from elsewhere runs no code (issue 35): DCP's ``.metadata`` is parsed by
``dtypeplan.checkpoint._metadata``'s restricted unpickler, never by plain ``pickle``.

Hostile ``.metadata`` files (payloads through ``open``, ``os.system``, ``eval`` and
``torch.save``, alone or hidden inside real metadata, with a manifest rewritten to agree) are
refused on 1 rank here and on 2 spawned ranks (``tests/workers/checkpoint_trust.py``), with
and without ``verify``; no payload runs, no data file is read, the optimizer is unchanged.
Crafted pickles that use only admitted globals but try to reach further (dotted names, setting
a class's attributes, persistent ids, extension codes) and metadata that points outside the
snapshot are refused too. Every checkpoint this suite writes (ZeRO 0-3, bf16 / fp16, int8 /
fp8 codes) parses to what plain pickle gives, and a checkpoint written before the change
(``tests/data/checkpoints/before-trust-bf16-int8-fp8-zero1``, saved by commit 742aa10 with
the config below, trained 3 steps) still loads.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.checkpoint import CheckpointError, _directory, _metadata
from dtypeplan.launch import spawn
from tests._helpers import make_model
from tests.workers import checkpoint as cases
from tests.workers import checkpoint_trust as trust

BEFORE = os.path.join(
    os.path.dirname(__file__), "data", "checkpoints", "before-trust-bf16-int8-fp8-zero1"
)
BEFORE_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": True},
    "optimizer_states": {"exp_avg": "int8", "exp_avg_sq": "fp8"},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 300},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


@pytest.fixture
def saved(tmp_path: Any) -> tuple[str, dtypeplan.MixedPrecisionOptimizer, bytes]:
    model, opt = cases.build("fp32", stage=1)
    cases.train(model, opt, range(2))
    path = str(tmp_path / "ckpt")
    checkpoint.save(opt, path)
    with open(os.path.join(trust.snapshot_dir(path), ".metadata"), "rb") as handle:
        return path, opt, handle.read()


class _Reads:
    """Records every data file a load reads (hashing, DCP's read_data, torch.load)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> _Reads:
        def record(name: str) -> Any:
            def fail(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                raise AssertionError(f"{name} called")

            return fail

        self._patches = [
            mock.patch.object(_directory, "_digest", record("digest")),
            mock.patch.object(FileSystemReader, "read_data", record("read_data")),
            mock.patch.object(torch, "load", record("torch.load")),
        ]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for patch in self._patches:
            patch.stop()


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("nested", [False, True], ids=["bare", "nested"])
@pytest.mark.parametrize("name", ["open", "os.system", "eval", "torch.save"])
def test_payload_is_refused_on_one_rank(
    saved: tuple[str, Any, bytes], tmp_path: Any, name: str, nested: bool, verify: bool
) -> None:
    path, opt, original = saved
    payload, refused, marker = trust.payloads(str(tmp_path / "markers"))[name]
    trust.plant(path, trust.hostile(original, payload, nested))
    before = cases.snapshot(opt)
    with _Reads() as reads, pytest.raises(CheckpointError) as raised:
        checkpoint.load(opt, path, verify=verify)
    message = str(raised.value)
    assert f"names the global {refused}," in message and ".metadata" in message, message
    assert not os.path.exists(marker), "the payload ran"
    assert reads.calls == [], f"read a data file before refusing: {reads.calls}"
    after = cases.snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(before["masters"], after["masters"], strict=True))


def test_payloads_are_refused_on_two_ranks(tmp_path: Any) -> None:
    results = spawn(trust.trust_group, 2, str(tmp_path), timeout_s=240)
    for rank, result in enumerate(results):
        loads = result["loads"]
        assert len(loads) == 16
        for key, got in loads.items():
            assert not got["ran"], f"rank {rank} {key}: the payload ran"
            assert not got["ok"] and got["type"] == "CheckpointError", (rank, key, got)
            assert f"names the global {got['refused']}," in got["message"], (rank, key, got)
        assert result["unchanged"], f"rank {rank}: a refused load changed the optimizer"
        assert result["clean"]["ok"], result["clean"]


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


_DCP = "torch.distributed.checkpoint.metadata"
CRAFTED: dict[str, tuple[bytes, str]] = {
    # An attribute of an admitted class, by a dotted name.
    "dotted-name": (_global(_DCP, "Metadata.__init__") + b".", "global " + _DCP + ".Metadata"),
    # A module the metadata module imports, reached through it.
    "module-attribute": (_global(_DCP, "os") + b".", f"global {_DCP}.os,"),
    "builtins-getattr": (_global("builtins", "getattr") + b".", "global builtins.getattr,"),
    # BUILD on an admitted class itself would set its attributes for the whole process.
    "build-on-a-class": (_global(_DCP, "Metadata") + b"(N(Vpwned\nI1\ndtb.", "sets the state"),
    # REDUCE of something admitted that is not a class (a dtype).
    "call-a-dtype": (_global("torch", "float32") + b"(tR.", "calls a dtype"),
    "persistent-id": (b"\x80\x02K\x01Q.", "persistent id"),
    "extension-code": (b"\x80\x02\x82\x01.", "extension code"),
    "not-a-pickle": (b"\x00\x01garbage", "not valid DCP metadata"),
    "not-metadata": (pickle.dumps({"state_dict_metadata": {}}), "not DCP Metadata"),
    "a-layout-name": (
        _global("torch.serialization", "_get_layout") + b"(Vos.system\ntR.",
        "not one of torch's layouts",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_pickles_are_refused(saved: tuple[str, Any, bytes], case: str) -> None:
    path, opt, _original = saved
    data, expected = CRAFTED[case]
    trust.plant(path, data)
    with _Reads() as reads, pytest.raises(CheckpointError, match=expected):
        checkpoint.load(opt, path)
    assert reads.calls == []
    assert not hasattr(_metadata.ADMITTED[(_DCP, "Metadata")], "pwned")


def _edited(original: bytes, edit: Any) -> bytes:
    metadata = pickle.loads(original)  # our own checkpoint: trusted here
    edit(metadata)
    return pickle.dumps(metadata)


def _first_item(metadata: Any) -> Any:
    return next(iter(metadata.storage_data.values()))


OUTSIDE: dict[str, tuple[Any, str]] = {
    "escaping-path": (
        lambda m: setattr(_first_item(m), "relative_path", "../../etc/passwd"),
        "not a data file the manifest lists",
    ),
    "absolute-path": (
        lambda m: setattr(_first_item(m), "relative_path", "/dev/zero"),
        "not a data file the manifest lists",
    ),
    "metadata-as-data": (
        lambda m: setattr(_first_item(m), "relative_path", ".metadata"),
        "not a data file the manifest lists",
    ),
    "past-the-end": (lambda m: setattr(_first_item(m), "offset", 2**40), "is not inside"),
    "negative-length": (lambda m: setattr(_first_item(m), "length", -1), "is not inside"),
    "stream-transform": (
        lambda m: setattr(_first_item(m), "transform_descriptors", ["stream.zstd"]),
        "stream transforms",
    ),
    "bad-entry": (
        lambda m: m.state_dict_metadata.update({"param.0.master": "x"}),
        "not a valid tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(OUTSIDE))
def test_metadata_pointing_outside_the_snapshot_is_refused(
    saved: tuple[str, Any, bytes], case: str
) -> None:
    path, opt, original = saved
    edit, expected = OUTSIDE[case]
    trust.plant(path, _edited(original, edit))
    with _Reads() as reads, pytest.raises(CheckpointError, match=expected):
        checkpoint.load(opt, path, verify=False)
    assert reads.calls == []


def test_digest_covers_the_bytes_parsed(saved: tuple[str, Any, bytes]) -> None:
    # verify=True checks the sha256 of the very bytes the unpickler reads.
    path, opt, original = saved
    with open(os.path.join(trust.snapshot_dir(path), ".metadata"), "r+b") as handle:
        handle.seek(len(original) // 2)
        byte = handle.read(1)
        handle.seek(len(original) // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"\.metadata: its sha256 differs"):
        checkpoint.load(opt, path)


CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-zero0": {"zero_optimization": {"stage": 0}},
    "bf16-zero1-buckets": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "fp16-zero2": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "bf16-zero3": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}},
    "int8-fp8-zero2": {
        "optimizer_states": {"exp_avg": "int8", "exp_avg_sq": "fp8"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 300},
    },
    "kahan-bf16-zero1": {
        "bf16": {"enabled": True},
        "master_weights": {"dtype": "bf16", "rounding": "kahan"},
        "zero_optimization": {"stage": 1},
    },
}


def _build(config: dict[str, Any], seed: int = 0) -> tuple[torch.nn.Module, Any]:
    # The committed checkpoint was written when an absent weight_decay read as torch's 0.01.
    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    plan = dtypeplan.resolve({**config, "optimizer": adamw})
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(seed))
    return model, plan.build(model.parameters())


class _Globals(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.found: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.found.add((module, name))
        return super().find_class(module, name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoints_this_suite_writes_parse_as_plain_pickle_does(tmp_path: Any, name: str) -> None:
    model, opt = _build(CONFIGS[name])
    cases.train(model, opt, range(2))
    path = str(tmp_path / "ckpt")
    checkpoint.save(opt, path)
    snapshot = trust.snapshot_dir(path)
    with open(os.path.join(snapshot, ".metadata"), "rb") as handle:
        data = handle.read()
    plain = _Globals(data)
    expected = plain.load()  # our own checkpoint, just written: trusted here
    assert plain.found <= set(_metadata.ADMITTED), plain.found - set(_metadata.ADMITTED)
    manifest = _directory.open_snapshot(path)[1]
    assert _metadata.read_metadata(snapshot, manifest, verify=True) == expected
    _model, fresh = _build(CONFIGS[name], seed=5)
    checkpoint.load(fresh, path)
    want, got = cases.snapshot(opt), cases.snapshot(fresh)
    assert got["step"] == want["step"]
    for a, b in zip(want["masters"], got["masters"], strict=True):
        assert torch.equal(a, b)


def test_checkpoint_written_before_the_change_loads(tmp_path: Any) -> None:
    path = str(tmp_path / "before")
    shutil.copytree(BEFORE, path)
    model, reference = _build(BEFORE_CONFIG)
    cases.train(model, reference, range(3))
    _model, opt = _build(BEFORE_CONFIG, seed=5)
    checkpoint.load(opt, path)
    want, got = cases.snapshot(reference), cases.snapshot(opt)
    assert got["step"] == want["step"] == 3
    for a, b in zip(want["masters"], got["masters"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert want["states"].keys() == got["states"].keys()
    for key, value in want["states"].items():
        torch.testing.assert_close(got["states"][key], value, rtol=0.15, atol=1e-3)
    # And the data files were read through torch.load(weights_only=True) only.
    real = torch.load
    seen: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    with mock.patch.object(torch, "load", spy):
        checkpoint.load(opt, path)
    assert seen and all(flag is True for flag in seen)
