"""The config's ``optimizer.type``: every name ``build(optimizer=...)`` takes.

Every ``torch.optim`` class by its exact name (as DeepSpeed looks it up), DeepSpeed's own names
in any case; the elementwise ones train as ``build(optimizer=cls)`` does, bit for bit, the
shaped ones (and DeepSpeed's optimizers that torch lacks) resolve NotSupported with their own
reason, so ``dtypeplan check`` exits 1; any other name is a config error naming the valid ones
(exit 2). The schema lists the same names as ``resolver/_optimizer_kind.py``.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtypeplan
from dtypeplan.cli import EXIT_ERROR, EXIT_NOT_SUPPORTED, EXIT_OK, main
from dtypeplan.muon import MuonWithAuxAdamW
from dtypeplan.resolver import _deepspeed_keys as ds_keys
from dtypeplan.resolver._config import config_schema
from dtypeplan.resolver._optimizer_kind import (
    DEEPSPEED_ONLY,
    ELEMENTWISE,
    TORCH_OPTIMIZER_NAMES,
    any_case_pattern,
)
from tests._helpers import make_batch, make_model, mse

TORCH_CLASSES = sorted(
    name
    for name, value in vars(torch.optim).items()
    if inspect.isclass(value)
    and issubclass(value, torch.optim.Optimizer)
    and value is not torch.optim.Optimizer
)
ELEMENTWISE_NAMES = sorted(cls.__name__ for cls in ELEMENTWISE)
# Hyperparameters away from torch's defaults where a class has them, so that a dropped one shows.
HYPER: dict[str, dict[str, Any]] = {
    "SGD": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adam": {"lr": 0.01, "betas": (0.8, 0.95), "amsgrad": True, "adam_w_mode": False},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "Adamax": {"lr": 0.01, "weight_decay": 0.01},
    "Adagrad": {"lr": 0.05, "lr_decay": 0.01},
    "Adadelta": {"lr": 0.5, "rho": 0.8},
    "RMSprop": {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "centered": True},
    "NAdam": {"lr": 0.01, "momentum_decay": 0.005},
    "RAdam": {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.01},
    "Rprop": {"lr": 0.01, "etas": (0.4, 1.3)},
    "ASGD": {"lr": 0.01, "lambd": 0.001, "t0": 2.0},
}


def _resolve(name: str, params: dict[str, Any] | None = None) -> dtypeplan.PrecisionPlan:
    block: dict[str, Any] = {"type": name}
    if params is not None:
        block["params"] = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
    return dtypeplan.resolve({"optimizer": block})


def _check(tmp_path: Path, name: str) -> int:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"optimizer": {"type": name}}))
    return main(["check", str(config)])


def test_the_names_are_torchs_classes() -> None:
    """A torch that adds an optimizer class fails here: decide its kind and list it."""
    assert sorted(TORCH_OPTIMIZER_NAMES) == TORCH_CLASSES
    assert set(ELEMENTWISE_NAMES) == set(HYPER)


def test_the_schema_lists_the_same_names() -> None:
    node = config_schema()["properties"]["optimizer"]["properties"]["type"]
    enum, pattern = (branch for branch in node["anyOf"])
    assert enum["enum"] == list(TORCH_OPTIMIZER_NAMES)
    assert pattern["pattern"] == any_case_pattern()


def test_every_deepspeed_optimizer_name_is_read() -> None:
    """DeepSpeed 0.19.8's own names (its DEEPSPEED_OPTIMIZERS) each give a torch class or a
    reason; none is an unknown name."""
    for name in ds_keys.DEEPSPEED_OPTIMIZERS:
        plan = _resolve(name)
        assert plan.status in ("OK", "NotSupported"), name
        assert (plan.status == "OK") == (name in ("adam", "adamw", "adagrad", "lion", "muon")), name
    assert set(DEEPSPEED_ONLY) <= set(ds_keys.DEEPSPEED_OPTIMIZERS)


@pytest.mark.parametrize("name", TORCH_CLASSES)
def test_every_torch_class_by_name(name: str, tmp_path: Path) -> None:
    plan = _resolve(name)
    # "Adam" is DeepSpeed's: AdamW unless adam_w_mode is false (test_config.py).
    expected = "AdamW" if name == "Adam" else name
    # "Muon" is DeepSpeed's too: its MuonWithAuxAdam (torch.optim.Muon is passed to build).
    torch_class = MuonWithAuxAdamW if name == "Muon" else getattr(torch.optim, expected)
    assert plan.optimizer.type == expected and plan.optimizer.torch_class is torch_class
    if torch_class in ELEMENTWISE:
        assert plan.status == "OK" and plan.optimizer_kind == "elementwise"
        assert _check(tmp_path, name) == EXIT_OK
        return
    if name in ("Adafactor", "Muon"):  # run whole (tests/test_whole_tensor.py)
        assert plan.status == "OK" and plan.rule_id == "whole-tensor"
        assert plan.optimizer_kind == "shaped" and plan.param_access == "owner"
        # Their states and the owners' balance follow each parameter's shape: a count alone
        # is refused, naming the argument that gives the shapes.
        with pytest.raises(dtypeplan.PrecisionConfigError, match="param_shapes"):
            plan.memory(1000, 2)
        assert _check(tmp_path, name) == EXIT_OK
        return
    assert plan.status == "NotSupported" and plan.optimizer_kind == "shaped"
    assert plan.rule_id == "shaped-optimizer"
    assert f"{name} is shaped: " in plan.explain()
    with pytest.raises(dtypeplan.NotSupportedError, match="each parameter's shape"):
        plan.build(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(dtypeplan.NotSupportedError, match=f"{name} is shaped"):
        plan.memory(1000, 2)
    assert _check(tmp_path, name) == EXIT_NOT_SUPPORTED


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [("adagrad", "Adagrad"), ("ADAMW", "AdamW"), ("adam", "AdamW"), ("Sgd", "SGD")],
)
def test_deepspeeds_names_in_any_case(spelling: str, canonical: str) -> None:
    plan = _resolve(spelling)
    assert plan.status == "OK" and plan.optimizer.type == canonical


@pytest.mark.parametrize("key", sorted(DEEPSPEED_ONLY))
def test_deepspeeds_own_optimizers_are_not_supported_with_their_reason(
    key: str, tmp_path: Path
) -> None:
    shown, reason = DEEPSPEED_ONLY[key]
    for spelling in (shown, key, key.upper()):
        # DeepSpeed's own params (Lamb's max_coeff...) are DeepSpeed's business: not refused.
        plan = _resolve(spelling, {"lr": 1e-3, "max_coeff": 0.3, "freeze_step": 10})
        assert plan.status == "NotSupported" and plan.optimizer.type == shown
        assert f"{shown} is shaped: {reason}" in plan.explain()
        with pytest.raises(dtypeplan.NotSupportedError, match=re.escape(reason[:40])):
            plan.optimizer.torch_class  # noqa: B018 - the property raises
    assert _check(tmp_path, shown) == EXIT_NOT_SUPPORTED


@pytest.mark.parametrize(
    ("name", "hint"), [("rmsprop", "did you mean 'RMSprop'?"), ("AdamWW", "'AdamW'"), ("x", "")]
)
def test_an_unknown_name_is_an_error_listing_the_valid_ones(
    name: str, hint: str, tmp_path: Path
) -> None:
    with pytest.raises(dtypeplan.PrecisionConfigError) as info:
        _resolve(name)
    message = str(info.value)
    assert info.value.path == "$.optimizer.type" and hint in message
    assert all(valid in message for valid in (*TORCH_CLASSES, "Lamb", "Lion", "MuSGD"))
    assert _check(tmp_path, name) == EXIT_ERROR


@pytest.mark.parametrize("name", ["OnebitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_the_one_bit_optimizers_deepspeed_removed_are_refused(name: str) -> None:
    with pytest.raises(dtypeplan.PrecisionConfigError, match="removed its 1-bit") as info:
        _resolve(name)
    assert info.value.path == "$.optimizer.type"


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(st.text(max_size=12))
def test_any_name_resolves_or_is_refused_at_its_path(name: str) -> None:
    try:
        plan = _resolve(name)
    except dtypeplan.PrecisionConfigError as error:
        assert error.path in ("$.optimizer.type", "$.optimizer.params"), error
        return
    assert plan.status in ("OK", "NotSupported")
    assert plan.optimizer.kind == plan.optimizer_kind


def test_torchs_argument_names_are_checked_for_every_class() -> None:
    with pytest.raises(dtypeplan.PrecisionConfigError, match="did you mean 'centered'"):
        _resolve("RMSprop", {"centred": True})
    with pytest.raises(dtypeplan.PrecisionConfigError, match="unknown Adafactor argument"):
        _resolve("Adafactor", {"momentum": 0.9})
    # DeepSpeed reads "muon" as its own MuonWithAuxAdam (dtypeplan/muon.py), its params checked.
    assert _resolve("muon", {"lr": 0.02, "muon_lr": 0.02, "adam_lr": 3e-4}).status == "OK"
    with pytest.raises(dtypeplan.PrecisionConfigError, match="unknown MuonWithAuxAdamW"):
        _resolve("muon", {"lr": 0.02, "adam_w_mode": True})
    with pytest.raises(dtypeplan.PrecisionConfigError, match="'gram' variant"):
        _resolve("muon", {"ns_method": "gram"})


def _train(optimizer: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    for step in range(steps):
        x, y = make_batch(step, 8)
        loss = mse(model, x, y)
        if isinstance(optimizer, dtypeplan.MixedPrecisionOptimizer):
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("name", ELEMENTWISE_NAMES)
def test_a_config_name_trains_as_build_with_the_class(name: str) -> None:
    """``{"type": "RMSprop", "params": {...}}`` is ``build(optimizer=torch.optim.RMSprop,
    ...)``: the same master weights bit for bit; and plain torch's within fp32 rounding."""
    hyper = HYPER[name]
    torch_hyper = {k: v for k, v in hyper.items() if k != "adam_w_mode"}
    torch_class = getattr(torch.optim, name)
    by_name = make_model(0)
    optimizer = _resolve(name, hyper).build(by_name.parameters())
    assert type(optimizer.inner) is torch_class  # type: ignore[attr-defined]
    by_class = make_model(0)
    other = dtypeplan.resolve({}).build(by_class.parameters(), optimizer=torch_class, **torch_hyper)
    plain = make_model(0)
    reference = torch_class(plain.parameters(), **torch_hyper)
    for opt, model in ((optimizer, by_name), (other, by_class), (reference, plain)):
        _train(opt, model, 4)
    triples = zip(by_name.parameters(), by_class.parameters(), plain.parameters(), strict=True)
    for a, b, c in triples:
        assert torch.equal(a, b), name
        # A few fp32 roundings per step apart (flat foreach against per-tensor update order).
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
