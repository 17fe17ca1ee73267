"""The config boundary: every key of API.md, the three input forms, and every kind of mistake.

A mistake must come back as ``PrecisionConfigError`` whose ``.path`` is the JSON path of the
bad value and whose message names that path (and, for a misspelt key, the closest known key).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import dtypeplan
from dtypeplan import PrecisionConfigError
from dtypeplan._dtypes import DTYPE_NAMES

# Every key that API.md lists as mattering, each set to a non-default value.
FULL_FP16_CONFIG: dict[str, Any] = {
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "min_loss_scale": 0.5,
    },
    "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": True},
    "communication_data_type": "bf16",
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}},
    "gradient_clipping": 1.5,
}

# Megatron-DeepSpeed's examples_deepspeed/ds_config_gpt_TEMPLATE.json and the ds_config that its
# pretrain_llama2_distributed.sh writes, with the shell placeholders filled in.
MEGATRON_DS_CONFIG: dict[str, Any] = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 1},
    "bf16": {"enabled": True},
    "wall_clock_breakdown": False,
}
MEGATRON_GPT_TEMPLATE: dict[str, Any] = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 8,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 0},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 11,
    },
    "bf16": {"enabled": False},
    "wall_clock_breakdown": False,
}


def _write(tmp_path: Path, name: str, document: Any) -> Path:
    path = tmp_path / name
    if name.endswith((".yaml", ".yml")):
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    else:
        path.write_text(json.dumps(document, indent=2))
    return path


def _error(config: Any) -> PrecisionConfigError:
    with pytest.raises(PrecisionConfigError) as info:
        dtypeplan.resolve(config)
    return info.value


# --- input forms -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["config.json", "config.yaml", "config.yml"])
def test_file_inputs_resolve_like_the_dict(tmp_path: Path, name: str) -> None:
    expected = dtypeplan.resolve(FULL_FP16_CONFIG).to_dict()
    path = _write(tmp_path, name, FULL_FP16_CONFIG)
    assert dtypeplan.resolve(path).to_dict() == expected
    assert dtypeplan.resolve(str(path)).to_dict() == expected


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(PrecisionConfigError, match="cannot read"):
        dtypeplan.resolve(tmp_path / "absent.json")


@pytest.mark.parametrize(
    ("name", "text"),
    [("bad.json", '{"bf16": {"enabled": true},}'), ("bad.yaml", "bf16: {enabled: true\n")],
)
def test_unparsable_file_is_a_config_error(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PrecisionConfigError, match=name):
        dtypeplan.resolve(path)


def test_yaml_config_never_constructs_objects(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "config.yaml"
    path.write_text(f'bf16: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(PrecisionConfigError):
        dtypeplan.resolve(path)
    assert not marker.exists()


@pytest.mark.parametrize("document", [[], "bf16", 3, None])
def test_a_config_must_be_a_mapping(tmp_path: Path, document: Any) -> None:
    assert _error(document).path == "$"
    path = _write(tmp_path, "config.json", document)
    assert _error(path).path == "$"


# --- every key of API.md ---------------------------------------------------------------------
def test_every_documented_key_reaches_the_plan() -> None:
    plan = dtypeplan.resolve(FULL_FP16_CONFIG)
    assert plan.status == "OK" and plan.implementation == "sharded"
    assert plan.param_dtype == torch.float16
    assert plan.grad_accum_dtype == torch.float32
    assert plan.accumulator_sharded is True
    assert plan.comm_dtype == torch.bfloat16
    assert plan.zero_stage == 1
    assert plan.gradient_clipping == 1.5
    scaling = plan.loss_scaling
    assert (scaling.loss_scale, scaling.initial_scale_power, scaling.loss_scale_window) == (
        0,
        12,
        500,
    )
    assert (scaling.hysteresis, scaling.min_loss_scale) == (3, 0.5)
    assert plan.optimizer.type == "SGD"
    assert plan.optimizer.params == {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    assert plan.origins["grad_accum_dtype"] == "$.gradient_accumulation_dtype.dtype"
    assert plan.origins["comm_dtype"] == "$.communication_data_type"
    text = plan.explain()
    assert "dynamic from 2**12, window 500, hysteresis 3, min 0.5" in text
    assert "global L2 norm 1.5" in text and "SGD" in text


def test_static_loss_scale() -> None:
    plan = dtypeplan.resolve({"fp16": {"enabled": True, "loss_scale": 128}})
    assert plan.loss_scaling.loss_scale == 128
    assert "static 128" in plan.explain()


@pytest.mark.parametrize(
    ("bf16", "fp16", "dtype"),
    [
        (None, None, torch.float32),
        (False, False, torch.float32),
        (True, None, torch.bfloat16),
        (True, False, torch.bfloat16),
        (None, True, torch.float16),
        (False, True, torch.float16),
    ],
)
def test_param_dtype_from_enabled_flags(
    bf16: bool | None, fp16: bool | None, dtype: torch.dtype
) -> None:
    config: dict[str, Any] = {}
    if bf16 is not None:
        config["bf16"] = {"enabled": bf16}
    if fp16 is not None:
        config["fp16"] = {"enabled": fp16}
    plan = dtypeplan.resolve(config)
    assert plan.param_dtype == dtype and plan.master_dtype == torch.float32
    assert plan.status == "OK"


def test_both_16_bit_modes_are_an_error_plan_not_an_exception() -> None:
    plan = dtypeplan.resolve({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert plan.status == "Error" and plan.implementation is None
    assert "bf16" in plan.reason and "fp16" in plan.reason


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_accumulation_dtype_as_string(dtype: str) -> None:
    plan = dtypeplan.resolve({"bf16": {"enabled": True}, "gradient_accumulation_dtype": dtype})
    assert (
        plan.grad_accum_dtype
        == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    )
    assert plan.origins["grad_accum_dtype"] == "$.gradient_accumulation_dtype"
    # The string form leaves sharding to the stage's default (stage 0: whole).
    assert plan.accumulator_sharded is False


@pytest.mark.parametrize(("stage", "sharded"), [(1, True), (1, False), (2, True), (0, False)])
def test_accumulation_dtype_as_mapping(stage: int, sharded: bool) -> None:
    plan = dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
            "gradient_accumulation_dtype": {"dtype": "bf16", "sharded": sharded},
        }
    )
    assert plan.status == "OK"
    assert plan.grad_accum_dtype == torch.bfloat16
    assert plan.accumulator_sharded is sharded
    assert plan.origins["accumulator_sharded"] == "$.gradient_accumulation_dtype.sharded"


def test_accumulation_mapping_without_sharded_uses_the_stage_default() -> None:
    for stage, sharded in [(0, False), (1, False), (2, True), (3, True)]:
        plan = dtypeplan.resolve(
            {
                "zero_optimization": {"stage": stage},
                "gradient_accumulation_dtype": {"dtype": "fp32"},
            }
        )
        assert plan.accumulator_sharded is sharded, stage


def test_data_types_alias() -> None:
    plan = dtypeplan.resolve(
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    )
    assert plan.grad_accum_dtype == torch.bfloat16
    assert plan.origins["grad_accum_dtype"] == "$.data_types.grad_accum_dtype"


@pytest.mark.parametrize(
    "spelling", ["fp16", {"dtype": "fp16"}, {"dtype": "fp16", "sharded": False}]
)
def test_data_types_alias_agreeing_with_the_key(spelling: Any) -> None:
    plan = dtypeplan.resolve(
        {
            "fp16": {"enabled": True},
            "gradient_accumulation_dtype": spelling,
            "data_types": {"grad_accum_dtype": "fp16"},
        }
    )
    assert plan.grad_accum_dtype == torch.float16


@pytest.mark.parametrize(
    "spelling", ["fp32", {"dtype": "fp32"}, {"dtype": "fp32", "sharded": True}]
)
def test_data_types_alias_contradicting_the_key(spelling: Any) -> None:
    error = _error(
        {
            "zero_optimization": {"stage": 1},
            "gradient_accumulation_dtype": spelling,
            "data_types": {"grad_accum_dtype": "bf16"},
        }
    )
    assert error.path == "$.data_types.grad_accum_dtype"
    assert "$.data_types.grad_accum_dtype" in str(error)
    assert "'bf16'" in str(error) and "'fp32'" in str(error)


@pytest.mark.parametrize(("value", "expected"), [(None, torch.float32), ("fp16", torch.float16)])
def test_communication_data_type(value: str | None, expected: torch.dtype) -> None:
    plan = dtypeplan.resolve({"communication_data_type": value})
    assert plan.comm_dtype == expected


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("AdamW", "AdamW"),
        ("adamw", "AdamW"),
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        ("Adam", "AdamW"),
        ("adam", "AdamW"),
        ("SGD", "SGD"),
        ("sgd", "SGD"),
    ],
)
def test_optimizer_types(spelling: str, canonical: str) -> None:
    plan = dtypeplan.resolve({"optimizer": {"type": spelling, "params": {"lr": 0.01}}})
    assert plan.optimizer.type == canonical
    assert plan.optimizer.torch_class.__name__ == canonical
    if spelling.lower() == "adam":
        assert any("adam_w_mode" in w for w in plan.config_warnings)


def test_adam_type_runs_adamw_with_adams_default_weight_decay() -> None:
    """DeepSpeed's FusedAdam and torch.optim.Adam decay nothing by default; torch.optim.AdamW,
    which type "Adam" runs, would fill in 0.01 for an absent key."""
    plan = dtypeplan.resolve({"optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    assert dict(plan.optimizer.params) == {"lr": 0.01, "weight_decay": 0.0}
    given = {"optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}}
    assert dtypeplan.resolve(given).optimizer.params["weight_decay"] == 0.1


@pytest.mark.parametrize("spelling", ["AdamW", "Adam"])
def test_adamw_without_weight_decay_takes_deepspeeds_default(spelling: str) -> None:
    """DeepSpeed runs type "AdamW" (and "Adam" in AdamW mode) on its FusedAdam, whose weight
    decay defaults to 0; only with torch_adam does it run torch.optim.AdamW and its 0.01."""
    plan = dtypeplan.resolve({"optimizer": {"type": spelling, "params": {"lr": 0.01}}})
    assert plan.optimizer.type == "AdamW"
    assert plan.optimizer.params["weight_decay"] == 0.0
    assert any("FusedAdam" in w for w in plan.config_warnings)
    torch_adam = {"optimizer": {"type": spelling, "params": {"lr": 0.01, "torch_adam": True}}}
    plan = dtypeplan.resolve(torch_adam)
    assert "weight_decay" not in plan.optimizer.params
    built = plan.build(torch.nn.Linear(2, 2).parameters())
    assert built.param_groups[0]["weight_decay"] == 0.01


def test_adam_with_adam_w_mode_false_is_torch_adam() -> None:
    config = {"optimizer": {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}}}
    plan = dtypeplan.resolve(config)
    assert plan.optimizer.type == "Adam" and dict(plan.optimizer.params) == {"lr": 0.01}


def test_adam_bias_correction_false_is_refused_with_the_reason() -> None:
    config = {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}
    error = _error(config)
    assert error.path == "$.optimizer.params.bias_correction"
    assert "bias correction" in str(error)


def test_optimizer_betas_list_becomes_a_tuple() -> None:
    plan = dtypeplan.resolve({"optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.95]}}})
    assert plan.optimizer.params["betas"] == (0.8, 0.95)
    assert plan.to_dict()["optimizer"]["params"]["betas"] == [0.8, 0.95]


def test_defaults_when_silent() -> None:
    plan = dtypeplan.resolve({})
    assert plan.status == "OK" and plan.implementation == "replicated"
    assert plan.zero_stage == 0 and plan.gradient_clipping == 0
    assert plan.optimizer.type == "AdamW"
    assert (plan.param_dtype, plan.grad_accum_dtype, plan.comm_dtype) == (torch.float32,) * 3
    bf16 = dtypeplan.resolve({"bf16": {"enabled": True}})
    # precision_rules.yaml: bf16 parameters sum their gradients in fp32.
    assert bf16.grad_accum_dtype == torch.float32 and bf16.comm_dtype == torch.float32
    fp16 = dtypeplan.resolve({"fp16": {"enabled": True}})
    assert fp16.grad_accum_dtype == torch.float16


# --- misspelt and unknown keys ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "path", "suggestion"),
    [
        ({"bf16": {"enabeld": True}}, "$.bf16.enabeld", "enabled"),
        (
            {"fp16": {"enabled": True, "loss_scale_windw": 10}},
            "$.fp16.loss_scale_windw",
            "loss_scale_window",
        ),
        ({"zero_optimization": {"stgae": 2}}, "$.zero_optimization.stgae", "stage"),
        (
            {"data_types": {"grad_acum_dtype": "fp32"}},
            "$.data_types.grad_acum_dtype",
            "grad_accum_dtype",
        ),
        (
            {"gradient_accumulation_dtype": {"dtype": "fp32", "shardd": True}},
            "$.gradient_accumulation_dtype.shardd",
            "sharded",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
            "$.optimizer.params.weight_decy",
            "weight_decay",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}},
            "$.optimizer.params.momentun",
            "momentum",
        ),
    ],
)
def test_misspelt_key_names_the_path_and_the_closest_key(
    config: dict[str, Any], path: str, suggestion: str
) -> None:
    error = _error(config)
    assert error.path == path
    assert path in str(error)
    assert f"did you mean {suggestion!r}" in str(error)


TOP_LEVEL_TYPOS = [
    ({"zero_optimizaton": {"stage": 1}}, "zero_optimizaton", "zero_optimization"),
    (
        {"gradient_acumulation_dtype": "fp32"},
        "gradient_acumulation_dtype",
        "gradient_accumulation_dtype",
    ),
    ({"communication_data_typ": "fp32"}, "communication_data_typ", "communication_data_type"),
    ({"gradient_clip": 1.0}, "gradient_clip", "gradient_clipping"),
    ({"trian_batch_size": 8}, "trian_batch_size", "train_batch_size"),
]


@pytest.mark.parametrize(("config", "key", "suggestion"), TOP_LEVEL_TYPOS)
def test_misspelt_top_level_key_warns_like_deepspeed_and_fails_under_strict(
    config: dict[str, Any], key: str, suggestion: str
) -> None:
    # DeepSpeed ignores unknown top-level keys; dtypeplan resolves, and explain() says so.
    plan, bare = dtypeplan.resolve(config).to_dict(), dtypeplan.resolve({}).to_dict()
    assert len(plan.pop("config_warnings")) == 1 and bare.pop("config_warnings") == []
    plan.pop("ignored_keys"), bare.pop("ignored_keys")
    assert plan == bare
    text = dtypeplan.resolve(config).explain()
    assert repr(key) in text and f"did you mean {suggestion!r}" in text
    with pytest.raises(PrecisionConfigError, match=f"did you mean {suggestion!r}") as info:
        dtypeplan.resolve(config, strict=True)
    assert info.value.path == f"$.{key}"


def test_unknown_top_level_key_without_a_close_match_says_where_keys_are_listed() -> None:
    with pytest.raises(PrecisionConfigError, match="config.schema.json"):
        dtypeplan.resolve({"qqqqqqqqqqqqqqqqqqqqqq": 1}, strict=True)
    error = _error({"zero_optimization": {"qqqqqqqqqqqqqqqqqqqq": 1}})
    assert error.path == "$.zero_optimization.qqqqqqqqqqqqqqqqqqqq"
    assert "_deepspeed_keys.py" in str(error) and "overlap_comm" not in str(error)


def test_misspelt_key_in_accumulation_mapping_without_dtype() -> None:
    error = _error({"gradient_accumulation_dtype": {"dtpye": "fp32"}})
    assert error.path == "$.gradient_accumulation_dtype.dtpye"
    assert "did you mean 'dtype'" in str(error)


def test_unknown_key_without_a_close_match_lists_the_known_keys() -> None:
    error = _error({"bf16": {"enabled": True, "xyzzy": 1}})
    assert error.path == "$.bf16.xyzzy"
    assert "'xyzzy'" in str(error) and "enabled" in str(error)


# --- wrong types and values ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"bf16": True}, "$.bf16"),
        ({"bf16": {"enabled": "yes"}}, "$.bf16.enabled"),
        ({"bf16": {"enabled": 1}}, "$.bf16.enabled"),
        ({"fp16": {"enabled": None}}, "$.fp16.enabled"),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, "$.fp16.loss_scale"),
        ({"fp16": {"enabled": True, "loss_scale": "dynamic"}}, "$.fp16.loss_scale"),
        ({"fp16": {"enabled": True, "initial_scale_power": 1.5}}, "$.fp16.initial_scale_power"),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "$.fp16.loss_scale_window"),
        ({"fp16": {"enabled": True, "hysteresis": "2"}}, "$.fp16.hysteresis"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "$.fp16.min_loss_scale"),
        ({"gradient_accumulation_dtype": "fp8"}, "$.gradient_accumulation_dtype"),
        ({"gradient_accumulation_dtype": "float32"}, "$.gradient_accumulation_dtype"),
        ({"gradient_accumulation_dtype": 32}, "$.gradient_accumulation_dtype"),
        ({"gradient_accumulation_dtype": {"dtype": "fp64"}}, "$.gradient_accumulation_dtype.dtype"),
        (
            {"gradient_accumulation_dtype": {"dtype": "fp32", "sharded": "yes"}},
            "$.gradient_accumulation_dtype.sharded",
        ),
        ({"gradient_accumulation_dtype": {"sharded": True}}, "$.gradient_accumulation_dtype"),
        ({"data_types": {"grad_accum_dtype": "fp8"}}, "$.data_types.grad_accum_dtype"),
        ({"data_types": []}, "$.data_types"),
        ({"communication_data_type": "int8"}, "$.communication_data_type"),
        ({"communication_data_type": ["fp32"]}, "$.communication_data_type"),
        ({"zero_optimization": {"stage": 4}}, "$.zero_optimization.stage"),
        ({"zero_optimization": {"stage": "1"}}, "$.zero_optimization.stage"),
        ({"zero_optimization": {"stage": True}}, "$.zero_optimization.stage"),
        ({"zero_optimization": 1}, "$.zero_optimization"),
        ({"optimizer": {"type": "Lionn"}}, "$.optimizer.type"),
        ({"optimizer": {"type": "rmsprop"}}, "$.optimizer.type"),
        ({"optimizer": {"params": {"lr": 0.1}}}, "$.optimizer"),
        ({"optimizer": {"type": "AdamW", "params": [0.1]}}, "$.optimizer.params"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1.0}}}, "$.optimizer.params"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "$.optimizer.params"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [1.5, 0.9]}}}, "$.optimizer.params"),
        ({"gradient_accumulation_steps": 0}, "$.gradient_accumulation_steps"),
        ({"gradient_allreduce_op": "sum"}, "$.gradient_allreduce_op"),
        ({"scheduler": {"type": "WarmupLRR"}}, "$.scheduler.type"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
            "$.scheduler.params.warmup_num_step",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "$.zero_optimization.offload_optimizer.device",
        ),
        (
            # foreach/fused are torch's choices of an implementation, accepted and left to
            # dtypeplan as build and wrap do; capturable is not.
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "capturable": True}}},
            "$.optimizer.params.capturable",
        ),
        ({"gradient_clipping": -1.0}, "$.gradient_clipping"),
        ({"gradient_clipping": "1.0"}, "$.gradient_clipping"),
        ({"gradient_clipping": True}, "$.gradient_clipping"),
    ],
)
def test_bad_value_names_its_json_path(config: dict[str, Any], path: str) -> None:
    error = _error(config)
    assert error.path == path
    assert path in str(error)


def test_bad_value_in_a_file_names_its_json_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "config.yaml", {"zero_optimization": {"stage": 7}})
    assert _error(path).path == "$.zero_optimization.stage"


def test_integral_float_stage_gives_an_int_stage() -> None:
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 1.0}})
    assert type(plan.zero_stage) is int


def test_infinite_bucket_size_is_a_config_error() -> None:
    error = _error({"zero_optimization": {"reduce_bucket_size": math.inf}})
    assert error.path == "$.zero_optimization.reduce_bucket_size"


def test_yaml_config_with_integer_key_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("1: one\nfoo: bar\n")
    assert _error(path).path.startswith("$")


# --- ignored DeepSpeed keys ------------------------------------------------------------------
IGNORED = {
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "allgather_bucket_size": 5e8,
    },
    "bf16": {"enabled": True, "immediate_grad_update": True},
}
IGNORED_PATHS = [
    "$.steps_per_print",
    "$.wall_clock_breakdown",
    "$.zero_optimization.contiguous_gradients",
    "$.zero_optimization.allgather_bucket_size",
    "$.bf16.immediate_grad_update",
]


def test_ignored_keys_are_accepted_listed_and_change_nothing() -> None:
    plan = dtypeplan.resolve(IGNORED)
    assert sorted(plan.ignored_keys) == sorted(IGNORED_PATHS)
    text = plan.explain()
    assert "ignored" in text
    for path in IGNORED_PATHS:
        assert path in text
    bare = dtypeplan.resolve({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    assert bare.ignored_keys == ()
    with_keys, without = plan.to_dict(), bare.to_dict()
    for data in (with_keys, without):
        data.pop("ignored_keys")
    assert with_keys == without


@pytest.mark.parametrize(
    ("zero", "stated", "ignored"),
    [
        # ZeRO-3: every ZeRO setting DeepSpeed reads for memory or overlap is a difference.
        (
            {
                "stage": 3,
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 0,
                "stage3_gather_16bit_weights_on_model_save": True,
                "sub_group_size": 1e9,
                "overlap_comm": False,
                "offload_param": {"device": "cpu", "pin_memory": False},
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
            },
            [
                "max_live_parameters", "max_reuse_distance", "param_persistence_threshold",
                "prefetch_bucket_size", "gather_16bit_weights_on_model_save", "sub_group_size",
                "overlap_comm", "offload_param.pin_memory", "offload_optimizer.pin_memory",
            ],
            [],
        ),
        # Below ZeRO-3 DeepSpeed reads none of the stage-3 keys: ignored, as DeepSpeed does.
        (
            {"stage": 2, "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9,
             "overlap_comm": True},
            ["overlap_comm"],
            ["$.zero_optimization.stage3_max_live_parameters",
             "$.zero_optimization.sub_group_size"],
        ),
    ],
)  # fmt: skip
def test_zero_memory_keys_are_differences_never_silently_ignored(
    zero: dict[str, Any], stated: list[str], ignored: list[str]
) -> None:
    plan = dtypeplan.resolve({"zero_optimization": zero})
    lines = [d for d in plan.deepspeed_differences if d.startswith("zero_optimization.")]
    assert sorted(d.split(" = ")[0].removeprefix("zero_optimization.") for d in lines) == sorted(
        stated
    ), lines
    assert sorted(plan.ignored_keys) == sorted(ignored)
    assert any("overlap_comm = " in d and "always overlaps" in d for d in lines)


def test_offload_is_parsed_never_ignored() -> None:
    plan = dtypeplan.resolve(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    )
    assert plan.ignored_keys == ()
    config = dtypeplan.resolver.load_config(
        {"zero_optimization": {"stage": 2, "cpu_offload": True}}
    )
    assert config.offload_optimizer == "cpu"
    # The table decides it: the offload cell runs it (never OK as if it were not there).
    assert plan.status == "OK" and plan.rule_id == "zero2"
    assert plan.offload_optimizer == "cpu"


@pytest.mark.parametrize("name", ["ds_config.json", "ds_config.yaml"])
def test_megatron_deepspeed_config_resolves(tmp_path: Path, name: str) -> None:
    plan = dtypeplan.resolve(_write(tmp_path, name, MEGATRON_DS_CONFIG))
    assert plan.status == "OK" and plan.implementation == "sharded" and plan.rule_id == "zero1"
    assert plan.param_dtype == torch.bfloat16 and plan.grad_accum_dtype == torch.float32
    assert plan.zero_stage == 1 and plan.accumulator_sharded is False
    assert set(plan.ignored_keys) == {"$.steps_per_print", "$.wall_clock_breakdown"}
    # The batch sizes are read: at build they tell the micro-batches per step.
    assert plan.train_batch_size == 256 and plan.train_micro_batch_size_per_gpu == 4
    assert "$.wall_clock_breakdown" in plan.explain()


def test_megatron_gpt_template_resolves(tmp_path: Path) -> None:
    plan = dtypeplan.resolve(_write(tmp_path, "ds_config_gpt.json", MEGATRON_GPT_TEMPLATE))
    assert plan.status == "OK" and plan.implementation == "replicated"
    assert plan.param_dtype == torch.float16 and plan.grad_accum_dtype == torch.float16
    assert plan.gradient_clipping == 1.0
    assert plan.loss_scaling.initial_scale_power == 11
    assert plan.loss_scaling.loss_scale_window == 500
    assert "$.wall_clock_breakdown" in plan.ignored_keys
    # DeepSpeed 0.19.8 removed curriculum_learning (DeepSpeedConfigError); so does dtypeplan.
    with pytest.raises(PrecisionConfigError, match="removed 'curriculum_learning' too"):
        dtypeplan.resolve({**MEGATRON_GPT_TEMPLATE, "curriculum_learning": {"enabled": False}})


@pytest.mark.parametrize("path", ["\x00", "no/such/file.json"])
def test_unreadable_config_path_is_a_config_error(path: str) -> None:
    # Found by the thorough hypothesis profile: a NUL byte made open() raise ValueError.
    with pytest.raises(dtypeplan.PrecisionConfigError, match="cannot read config file"):
        dtypeplan.resolve(path)


def test_binary_config_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(dtypeplan.PrecisionConfigError, match="cannot read config file"):
        dtypeplan.resolve(path)


# --- settings that change numbers or memory: parsed, never ignored ---------------------------
@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "master_weights_dtype",
            "bf16",
        ),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "master_weights_dtype",
            "fp16",
        ),
        (
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "optimizer_states_dtype",
            "bf16",
        ),
        (
            {"bfloat16": {"enabled": True, "bf16_optimizer_states": True}},
            "optimizer_states_dtype",
            "bf16",
        ),
        ({"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}, "autocast", "bf16"),
        ({"fp16": {"enabled": True}, "torch_autocast": {"enabled": True}}, "autocast", "fp16"),
        ({"torch_autocast": {"enabled": False, "dtype": "fp16"}}, "autocast", "none"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            "offload_optimizer",
            "nvme",
        ),
        ({"zero_optimization": {"cpu_offload": True}}, "offload_optimizer", "cpu"),
        ({"zero_optimization": {"cpu_offload_param": True}}, "offload_param", "cpu"),
        (
            {"zero_optimization": {"zero_quantized_weights": True}},
            "quantized_communication",
            "weights",
        ),
        (
            {
                "zero_optimization": {
                    "zero_quantized_weights": True,
                    "zero_quantized_gradients": True,
                }
            },
            "quantized_communication",
            "both",
        ),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "hierarchical_partitioning", True),
        ({"prescale_gradients": True}, "gradient_prescaling", "prescale"),
        ({"gradient_predivide_factor": 8.0}, "gradient_prescaling", "predivide"),
        ({"fp8": {"enabled": True}}, "fp8", True),
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps", 4),
        (
            {
                "bf16": {"enabled": True},
                "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                "optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": False}},
            },
            "optimizer_states_dtype",
            "bf16",
        ),
    ],
)
def test_number_changing_settings_are_parsed(
    config: dict[str, Any], field: str, value: Any
) -> None:
    parsed = dtypeplan.resolver.load_config(config)
    assert getattr(parsed, field) == value
    assert parsed.ignored_keys == ()


def test_stage3_alias_and_plain_name_are_one_setting() -> None:
    plain = {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 10}}
    alias = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10}}
    plain_plan, alias_plan = dtypeplan.resolve(plain).to_dict(), dtypeplan.resolve(alias).to_dict()
    # A key with which DeepSpeed changes memory: stated as a difference, not "ignored".
    assert plain_plan["ignored_keys"] == alias_plan["ignored_keys"] == []
    assert any(
        d.startswith("zero_optimization.prefetch_bucket_size = 10:")
        for d in plain_plan["deepspeed_differences"]
    )
    assert plain_plan == alias_plan
    both = {"zero_optimization": {"prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 20}}
    error = _error(both)
    assert error.path == "$.zero_optimization.stage3_prefetch_bucket_size"


def test_legacy_bfloat16_block_is_bf16_unless_bf16_is_given() -> None:
    assert dtypeplan.resolve({"bfloat16": {"enabled": True}}).param_dtype == torch.bfloat16
    plan = dtypeplan.resolve({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})
    assert plan.param_dtype == torch.float32
    assert any("$.bfloat16 is not read" in w for w in plan.config_warnings)


@pytest.mark.parametrize(
    "key", ["quantize_training", "compression_training", "sparse_attention", "amp", "elasticity"]
)
def test_blocks_deepspeed_removed_are_refused(key: str) -> None:
    error = _error({key: {"enabled": False}})
    assert error.path == f"$.{key}" and "DeepSpeed 0.19.8 removed" in str(error)
    error = _error({"zero_optimization": {"mics_shard_size": 4}})
    assert error.path == "$.zero_optimization.mics_shard_size"


def test_data_types_param_dtype_must_match_the_enabled_mode() -> None:
    assert dtypeplan.resolve({"bf16": {"enabled": True}, "data_types": {"param_dtype": "bfloat16"}})
    error = _error({"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}})
    assert error.path == "$.data_types.param_dtype"


def test_model_side_settings_warn_and_are_not_ignored() -> None:
    plan = dtypeplan.resolve({"activation_checkpointing": {"partition_activations": True}})
    assert plan.ignored_keys == ()
    assert any("$.activation_checkpointing" in w for w in plan.config_warnings)
    off = dtypeplan.resolve({"compile": {"enabled": False}})
    assert off.config_warnings == ()


# --- master weights ----------------------------------------------------------------------------
def test_master_weights_block_and_its_deepspeed_alias() -> None:
    def master(config: dict) -> tuple[str, object, str]:
        plan = dtypeplan.resolve({"bf16": {"enabled": True}, **config})
        return DTYPE_NAMES[plan.master_dtype], plan.status, plan.master_rounding

    assert master({}) == ("fp32", "OK", "nearest")
    assert master({"master_weights": {"dtype": "bf16"}}) == ("bf16", "OK", "nearest")
    for rounding in ("nearest", "stochastic", "kahan"):
        block = {"dtype": "bf16", "rounding": rounding}
        assert master({"master_weights": block}) == ("bf16", "OK", rounding)
    alias = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    assert master(alias) == ("bf16", "OK", "nearest")
    both = {**alias, "master_weights": {"dtype": "bf16", "rounding": "kahan"}}
    assert master(both) == ("bf16", "OK", "kahan")


def test_master_weights_contradictions_are_refused() -> None:
    alias = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    with pytest.raises(PrecisionConfigError, match=r"\$.master_weights asks for fp32"):
        dtypeplan.resolve({**alias, "master_weights": {"dtype": "fp32"}})
    with pytest.raises(PrecisionConfigError, match=r"\$.master_weights.rounding: fp32"):
        dtypeplan.resolve({"master_weights": {"dtype": "fp32", "rounding": "kahan"}})
    with pytest.raises(PrecisionConfigError, match="master_weights"):
        dtypeplan.resolve({"master_weights": {"dtype": "bf16", "rounding": "up"}})
    # bf16 masters of fp32 parameters: the table's Error, with its reason.
    plan = dtypeplan.resolve({"master_weights": {"dtype": "bf16", "rounding": "stochastic"}})
    assert plan.status == "Error" and plan.rule_id == "master-weights-below-params"


# --- the layout: shard groups and the wire across them (issue 22) ----------------------------
def _layout(stage: int = 2, **zero: Any) -> dict[str, Any]:
    return {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero}}


def test_shard_group_size_and_wire_across_reach_the_plan() -> None:
    config = _layout(2, shard_group_size=8)
    config["communication_data_type_across_groups"] = "int8"
    plan = dtypeplan.resolve(config)
    assert (plan.status, plan.rule_id) == ("OK", "zero2")
    assert plan.shard_group_size == 8 and plan.wire_across_groups == "int8"
    assert plan.origins["shard_group_size"] == "$.zero_optimization.shard_group_size"
    assert plan.origins["wire_across_groups"] == "$.communication_data_type_across_groups"
    assert plan.to_dict()["shard_group_size"] == 8
    assert plan.to_dict()["wire_across_groups"] == "int8"
    text = plan.explain()
    assert "shard groups" in text and "wire across groups     int8" in text
    flat = dtypeplan.resolve(_layout(2))
    assert flat.shard_group_size is None and flat.wire_across_groups is None
    assert flat.digest() != plan.digest()  # ranks that disagree on the layout are caught


@pytest.mark.parametrize(
    "stage, wire, status, rule",
    [
        (0, None, "Error", "stage0-shard-groups"),
        (0, "int8", "Error", "stage0-shard-groups"),
        (1, "fp8", "OK", "zero1"),
        (1, None, "OK", "zero1"),
        (2, "bf16", "OK", "zero2"),
        (3, None, "OK", "zero3"),
        # ZeRO-3 (FSDP2's HSDP) reduces across the groups in communication_data_type (fp32
        # here) and nothing else: build refuses any other wire, so the table must too.
        (3, "fp32", "OK", "zero3"),
        (3, "fp16", "NotSupported", "zero3-wire-across"),
        (3, "bf16", "NotSupported", "zero3-wire-across"),
        (3, "int8", "NotSupported", "zero3-wire-across"),
        (3, "fp8", "NotSupported", "zero3-wire-across"),
    ],
)
def test_the_table_decides_each_layout(
    stage: int, wire: str | None, status: str, rule: str
) -> None:
    config = _layout(stage, shard_group_size=2)
    config["communication_data_type_across_groups"] = wire
    plan = dtypeplan.resolve(config)
    assert (plan.status, plan.rule_id) == (status, rule), plan.reason


@pytest.mark.parametrize("comm", ["fp32", "bf16", "fp16"])
def test_zero3_table_agrees_with_what_hsdp_runs(comm: str) -> None:
    """At ZeRO-3 the table says OK exactly where FSDP2's HSDP can run the wire across
    (``check_wire_across_groups``, which build calls): a plan that is OK must not be refused by
    build, nor a plan that build runs be refused by the table."""
    from dtypeplan.comm._groups import HybridGroups
    from dtypeplan.errors import NotSupportedError
    from dtypeplan.optimizers.fsdp2.sharding import check_wire_across_groups

    layout = HybridGroups(2, 2, 0, 0, (0, 1), (0, 2), None, None)
    for wire in (None, "fp32", "bf16", "fp16", "int8", "fp8"):
        config = _layout(3, shard_group_size=2)
        if comm == "fp16":
            config = {"fp16": {"enabled": True}, "zero_optimization": config["zero_optimization"]}
        config["communication_data_type"] = comm
        config["communication_data_type_across_groups"] = wire
        plan = dtypeplan.resolve(config)
        try:
            check_wire_across_groups(plan, layout)
            runs = True
        except NotSupportedError:
            runs = False
        assert (plan.status == "OK") == runs, (comm, wire, plan.status, plan.rule_id)
        assert runs == (wire in (None, comm)), (comm, wire)


def test_offload_with_shard_groups_is_ok() -> None:
    """Proven by tests/test_hybrid.py's slow parity run and test_memory's hybrid figures."""
    config = _layout(2, shard_group_size=2, offload_optimizer={"device": "cpu"})
    plan = dtypeplan.resolve(config)
    assert (plan.status, plan.rule_id) == ("OK", "zero2")
    assert plan.implementation == "sharded" and plan.shard_group_size == 2


def test_a_wire_across_without_shard_groups_is_refused() -> None:
    config = _layout(2)
    config["communication_data_type_across_groups"] = "int8"
    with pytest.raises(PrecisionConfigError, match="shard_group_size is not set"):
        dtypeplan.resolve(config)


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "8", "all"])
def test_a_bad_shard_group_size_is_refused(size: Any) -> None:
    with pytest.raises(PrecisionConfigError, match="shard_group_size"):
        dtypeplan.resolve(_layout(2, shard_group_size=size))


def test_a_bad_wire_across_is_refused() -> None:
    config = _layout(2, shard_group_size=2)
    config["communication_data_type_across_groups"] = "int4"
    with pytest.raises(PrecisionConfigError, match="communication_data_type_across_groups"):
        dtypeplan.resolve(config)


def test_auto_shard_group_size_is_the_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _layout(2, shard_group_size="auto")
    config["communication_data_type_across_groups"] = "bf16"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "32")
    plan = dtypeplan.resolve(config)
    assert plan.shard_group_size == 8 and plan.wire_across_groups == "bf16"
    assert "LOCAL_WORLD_SIZE" in plan.origins["shard_group_size"]
    # One node: the flat layout, and the wire across (no such link) dropped with a warning.
    monkeypatch.setenv("WORLD_SIZE", "8")
    plan = dtypeplan.resolve(config)
    assert plan.shard_group_size is None and plan.wire_across_groups is None
    assert any("is not used" in w for w in plan.config_warnings)
    # Not under torchrun: flat, saying why.
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    plan = dtypeplan.resolve(_layout(2, shard_group_size="auto"))
    assert plan.status == "OK" and plan.shard_group_size is None
    assert any("LOCAL_WORLD_SIZE is not set" in w for w in plan.config_warnings)
    # The caller's fill wins over the environment.
    plan = dtypeplan.resolve(
        _layout(2, shard_group_size="auto"), auto={"zero_optimization.shard_group_size": 4}
    )
    assert plan.shard_group_size == 4


def test_qgz_with_shard_groups_is_the_int8_wire_across() -> None:
    plan = dtypeplan.resolve(_layout(2, shard_group_size=4, zero_quantized_gradients=True))
    assert (plan.status, plan.rule_id) == ("OK", "zero2")
    assert plan.wire_across_groups == "int8" and plan.quantized_communication == "none"
    assert plan.origins["wire_across_groups"] == "$.zero_optimization.zero_quantized_gradients"
    assert any("qgZ" in w for w in plan.config_warnings)
    config = _layout(2, shard_group_size=4, zero_quantized_gradients=True)
    config["communication_data_type_across_groups"] = "fp8"
    # Two wires across the groups: an Error plan (resolve is total), refused at build.
    both = dtypeplan.resolve(config)
    assert (both.status, both.rule_id) == ("Error", "quantized-gradients-and-wire-across")
    assert "two wires" in both.reason and both.wire_across_groups == "fp8"
    with pytest.raises(PrecisionConfigError, match="two wires"):
        both.build(torch.nn.Linear(2, 2).parameters())
    # Without shard groups there is no link across: qgZ stays NotSupported, pointing there.
    flat = dtypeplan.resolve(_layout(2, zero_quantized_gradients=True))
    assert flat.status == "NotSupported" and "shard_group_size" in flat.reason
    qwz = dtypeplan.resolve(_layout(2, shard_group_size=4, zero_quantized_weights=True))
    assert qwz.status == "NotSupported" and qwz.rule_id == "quantized-communication"


def test_deepspeed_hierarchical_keys_point_to_shard_group_size() -> None:
    hpz = dtypeplan.resolve(_layout(3, zero_hpz_partition_size=8))
    assert hpz.status == "OK" and hpz.hpz_partition_size == 8, hpz.reason
    assert "reshard_after_forward" in hpz.reason
    # hpZ and MiCS / HSDP shard groups: one or the other.
    both = dtypeplan.resolve(_layout(3, zero_hpz_partition_size=8, shard_group_size=8))
    assert (both.status, both.rule_id) == ("NotSupported", "hierarchical-partitioning")
    assert "with shard groups the gathers already stay inside the group" in both.reason
    with pytest.raises(PrecisionConfigError, match="mics_shard_size.*shard_group_size"):
        dtypeplan.resolve(_layout(3, mics_shard_size=8))
