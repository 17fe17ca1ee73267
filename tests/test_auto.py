"""``"auto"`` values: the caller's fills, the HF Trainer defaults, and ``auto_values_from``."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dtypeplan
from dtypeplan import PrecisionConfigError
from dtypeplan.resolver import _hf_auto_defaults as hf
from dtypeplan.resolver._auto import auto_paths

CONFIGS = Path(__file__).parent / "data" / "deepspeed_configs"

HF_STYLE: dict[str, Any] = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_unfilled_auto_takes_the_hf_defaults_and_explain_lists_each() -> None:
    plan = dtypeplan.resolve(HF_STYLE)
    assert plan.param_dtype == torch.float32  # HF: bf16 and fp16 off by default
    assert plan.gradient_clipping == hf.HF_AUTO_FILLS["gradient_clipping"][0] == 1.0
    assert plan.optimizer.params["lr"] == 5e-5 and plan.optimizer.params["betas"] == (0.9, 0.999)
    assert plan.gradient_accumulation_steps == 1
    assert plan.reduce_bucket_size is None  # hidden_size**2 under HF: unknown here
    text = plan.explain()
    assert [a.path for a in plan.auto_values] == auto_paths(HF_STYLE)
    for auto in plan.auto_values:
        assert auto.path in text and auto.source in text
    assert "HF TrainingArguments.max_grad_norm default" in text
    # The Trainer fills max(1, warmup_steps): 1 under its default warmup_steps 0, which
    # DeepSpeed 0.19.8's WarmupLR takes (W = max(2, 1)); the scheduler builds.
    assert dict(plan.scheduler["params"])["warmup_num_steps"] == 1
    assert not any("warmup_num_steps" in w for w in plan.config_warnings)


def test_caller_fills_win_and_are_named_as_such() -> None:
    fills = {"bf16.enabled": True, "fp16.enabled": False, "gradient_clipping": 0.5}
    fills |= {"optimizer.params.lr": 3e-4, "scheduler.params.warmup_num_steps": 10}
    plan = dtypeplan.resolve(HF_STYLE, auto=fills)
    assert plan.param_dtype == torch.bfloat16 and plan.gradient_clipping == 0.5
    assert plan.optimizer.params["lr"] == 3e-4
    assert dict(plan.scheduler["params"])["warmup_num_steps"] == 10
    sources = {a.path: a.source for a in plan.auto_values}
    assert all(sources[path] == "auto=" for path in fills)
    assert not any("warmup_num_steps" in w for w in plan.config_warnings)


def test_filling_an_explicit_key_with_another_value_is_an_error_naming_it() -> None:
    config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0}
    with pytest.raises(PrecisionConfigError, match="gradient_clipping") as info:
        dtypeplan.resolve(config, auto={"gradient_clipping": 2.0})
    assert info.value.path == "$.gradient_clipping"
    with pytest.raises(PrecisionConfigError, match="bf16.enabled"):
        dtypeplan.resolve(config, auto={"bf16.enabled": False})
    # The same value is no fill at all (the HF Trainer accepts matching values too).
    assert dtypeplan.resolve(config, auto={"gradient_clipping": 1}).gradient_clipping == 1.0


def test_a_fill_for_a_path_nobody_fills_is_an_error_with_the_closest_path() -> None:
    with pytest.raises(PrecisionConfigError, match="did you mean 'gradient_clipping'"):
        dtypeplan.resolve({"gradient_clipping": "auto"}, auto={"gradient_cliping": 1.0})
    # Paths the HF integration fills are accepted even where the config lacks them.
    dtypeplan.resolve({}, auto={"optimizer.params.lr": 1e-4, "bf16.enabled": True})


def test_a_bad_fill_value_is_reported_at_its_path() -> None:
    with pytest.raises(PrecisionConfigError) as info:
        dtypeplan.resolve({"bf16": {"enabled": "auto"}}, auto={"bf16.enabled": "yes"})
    assert info.value.path == "$.bf16.enabled"


def test_auto_inside_deepspeed_blocks_that_hf_does_not_fill_keeps_the_default() -> None:
    config = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}}
    plan = dtypeplan.resolve(config)
    (auto,) = plan.auto_values
    assert auto.path == "zero_optimization.stage3_max_live_parameters" and auto.value is None
    assert "default applies" in plan.explain()


TRAINING_ARGS = {
    "bf16": True,
    "bf16_full_eval": False,
    "fp16": False,
    "fp16_full_eval": False,
    "max_grad_norm": 0.7,
    "learning_rate": 2e-4,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-6,
    "weight_decay": 0.1,
    "gradient_accumulation_steps": 4,
    "per_device_train_batch_size": 2,
    "warmup_steps": 0.1,
    "max_steps": 1000,
}


def test_auto_values_from_a_namespace() -> None:
    values = dtypeplan.auto_values_from(SimpleNamespace(**TRAINING_ARGS))
    assert values["bf16.enabled"] is True and values["fp16.enabled"] is False
    assert values["gradient_clipping"] == 0.7
    assert values["optimizer.params.betas"] == [0.9, 0.95]
    assert values["scheduler.params.warmup_num_steps"] == math.ceil(0.1 * 1000)
    assert values["scheduler.params.total_num_steps"] == 1000
    plan = dtypeplan.resolve(HF_STYLE, auto=values)
    assert plan.param_dtype == torch.bfloat16 and plan.gradient_clipping == 0.7
    assert plan.gradient_accumulation_steps == 4
    assert dtypeplan.auto_values_from(object()) == {}


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_auto_values_from_real_training_arguments(tmp_path: Path) -> None:
    import dataclasses

    from transformers import TrainingArguments

    overrides = {"output_dir": str(tmp_path), "max_grad_norm": 0.5, "learning_rate": 1e-4}
    overrides["warmup_steps"] = 10
    try:
        args = TrainingArguments(**overrides)
    except ImportError:
        # TrainingArguments.__post_init__ needs accelerate; without it, the same class with its
        # declared field defaults (the attributes the Trainer's fill reads).
        args = object.__new__(TrainingArguments)
        for field in dataclasses.fields(TrainingArguments):
            if field.default is not dataclasses.MISSING:
                object.__setattr__(args, field.name, field.default)
        for name, value in overrides.items():
            object.__setattr__(args, name, value)
    values = dtypeplan.auto_values_from(args)
    assert values["gradient_clipping"] == 0.5 and values["optimizer.params.lr"] == 1e-4
    # With its defaults otherwise, the fill equals the table in _hf_auto_defaults.py.
    for path in (
        "bf16.enabled",
        "fp16.enabled",
        "optimizer.params.eps",
        "gradient_accumulation_steps",
    ):
        assert values[path] == hf.HF_AUTO_FILLS[path][0]
    assert dtypeplan.resolve(HF_STYLE, auto=values).gradient_clipping == 0.5
    with pytest.raises(PrecisionConfigError, match="warmup_num_steps"):
        dtypeplan.resolve(HF_STYLE, auto={**values, "scheduler.params.warmup_num_steps": 0})


# --- every fill of a schema-valid config resolves or is refused clearly -----------------------
AUTO_TARGETS = [
    "bf16.enabled",
    "fp16.enabled",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.warmup_max_lr",
    "gradient_accumulation_steps",
    "zero_optimization.reduce_bucket_size",
]
FILL_VALUES = st.one_of(
    st.booleans(),
    st.integers(-2, 10**9),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.floats(0, 1), max_size=3),
    st.sampled_from(["auto", "bf16", "", "1e-4"]),
    st.none(),
)


def _set(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        document = document.setdefault(part, {})
    document[last] = value


@given(
    chosen=st.lists(st.sampled_from(AUTO_TARGETS), unique=True),
    fills=st.dictionaries(st.sampled_from(AUTO_TARGETS), FILL_VALUES, max_size=6),
    stage=st.sampled_from([0, 1, 2, 3]),
)
def test_every_auto_fill_resolves_or_raises_a_config_error(
    chosen: list[str], fills: dict[str, Any], stage: int
) -> None:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    }
    for path in chosen:
        _set(config, path, "auto")
    before = copy.deepcopy(config)
    try:
        plan = dtypeplan.resolve(config, auto=fills)
    except PrecisionConfigError as error:
        assert error.path.startswith("$")
        return
    assert config == before  # the caller's dict is not filled in place
    text = plan.explain()
    assert sorted(a.path for a in plan.auto_values) == sorted(chosen)
    for path in chosen:
        assert path in text


def _docs_config(scheduler: str) -> dict[str, Any]:
    """The HF docs' ds_config_zero2.json, with its scheduler block given ``scheduler``'s type
    (WarmupDecayLR needs the run's total_num_steps, as the docs' variant has it)."""
    config = json.loads((CONFIGS / "hf_transformers__ds_config_zero2.json").read_text())
    if scheduler != "WarmupLR":
        config["scheduler"] = {"type": scheduler, "params": {**config["scheduler"]["params"]}}
        config["scheduler"]["params"]["total_num_steps"] = "auto"
    return config


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR"])
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_the_docs_config_resolves_with_default_training_arguments(
    scheduler: str, tmp_path: Path
) -> None:
    """Default TrainingArguments (warmup_steps 0, epoch-based: max_steps -1) and the number of
    training steps the Trainer computed: the scheduler builds as the Trainer's fill makes
    DeepSpeed 0.19.8 build it (warmup_num_steps max(1, 0), total_num_steps the step count)."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True)
    assert args.warmup_steps == 0 and args.max_steps == -1
    values = dtypeplan.auto_values_from(args, num_training_steps=37)
    assert values["scheduler.params.warmup_num_steps"] == 1
    assert values["scheduler.params.total_num_steps"] == 37
    plan = dtypeplan.resolve(_docs_config(scheduler), auto=values)
    assert not plan.config_warnings
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    built = plan.build_scheduler(optimizer)
    assert type(built).__name__ == scheduler
    lrs = []
    for _ in range(40):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        built.step()
    lr = args.learning_rate
    # lrs[k] is the lr of iteration t = k - 1 (k = 0: set at construction, warmup_min_lr).
    # W = max(2, 1): log(t + 1) / log(2) is 0 at t = 0 and 1 at t = 1.
    assert lrs[0] == lrs[1] == 0.0 and lrs[2] == pytest.approx(lr, rel=1e-12)
    if scheduler == "WarmupDecayLR":  # then linear to 0 at t = total_num_steps
        assert lrs[21] == pytest.approx(lr * (37 - 20) / (37 - 2), rel=1e-12)
        assert lrs[38] == 0.0 and lrs[39] == 0.0
    else:
        assert lrs[39] == pytest.approx(lr, rel=1e-12)


def test_auto_values_from_warmup_fills_as_the_trainer() -> None:
    """max(1, get_warmup_steps(num_training_steps)); a ratio needs the step count."""
    fill = "scheduler.params.warmup_num_steps"
    epochs = {"max_steps": -1}
    assert dtypeplan.auto_values_from(SimpleNamespace(warmup_steps=0, **epochs))[fill] == 1
    assert dtypeplan.auto_values_from(SimpleNamespace(warmup_steps=7, **epochs))[fill] == 7
    ratio = SimpleNamespace(warmup_steps=0.1, **epochs)
    assert dtypeplan.auto_values_from(ratio, num_training_steps=95)[fill] == 10
    assert dtypeplan.auto_values_from(SimpleNamespace(warmup_steps=0.001), 95)[fill] == 1
    with pytest.raises(PrecisionConfigError, match="num_training_steps"):
        dtypeplan.auto_values_from(ratio)
    with pytest.raises(PrecisionConfigError, match="positive integer"):
        dtypeplan.auto_values_from(ratio, num_training_steps=0)
    # num_training_steps wins over max_steps (the Trainer's count is the one used)
    values = dtypeplan.auto_values_from(SimpleNamespace(max_steps=50), num_training_steps=40)
    assert values["scheduler.params.total_num_steps"] == 40


def test_an_explicit_zero_warmup_is_refused_as_deepspeed_does() -> None:
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}
    with pytest.raises(PrecisionConfigError, match="warmup_num_steps must be a positive integer"):
        dtypeplan.resolve(config)
