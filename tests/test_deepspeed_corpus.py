"""Every real DeepSpeed config of ``tests/data/deepspeed_configs/`` against ``EXPECTED.json``.

EXPECTED.json records, per file, what DeepSpeed 0.19.8 does with it (``deepspeed_runs``: ``as_is``,
``after_hf_fill`` or ``no`` with ``why``) and how it reads it. Each file must:

- ``as_is`` / ``after_hf_fill``: resolve with DeepSpeed's reading (stage, offload devices,
  optimizer, scheduler, the HF fill of every ``"auto"``), each place where the plan does not do
  what DeepSpeed does stated by ``explain()``; or, for the few that DeepSpeed runs but dtypeplan
  cannot honour, be refused with a PrecisionConfigError that says why (``REFUSED_HERE``);
- ``no``: be refused with a PrecisionConfigError at the key EXPECTED.json's ``why`` names.

Until the rules table has dimensions for the new settings (offload, bf16 master weights,
autocast, ...), a plan for a file that uses them may be OK (saying that the table does not
decide them yet) or NotSupported.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan import PrecisionConfigError
from dtypeplan.resolver import load_config
from dtypeplan.resolver._config import DEEPSPEED_PRECISION_FIELDS

CORPUS = Path(__file__).parent / "data" / "deepspeed_configs"
EXPECTED: list[dict[str, Any]] = json.loads((CORPUS / "EXPECTED.json").read_text())
BY_FILE = {entry["file"]: entry for entry in EXPECTED}

# DeepSpeed refuses these; the JSON path dtypeplan's error must name (the key of ``why``).
REFUSED_BY_DEEPSPEED = {
    "bigscience_megatron_ds__ds_config_cl.json": "$.curriculum_learning",
    "dsexamples__MoQ_test.json": "$.quantize_training",
    "dsexamples__bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128.json": (
        "$.progressive_layer_drop"
    ),
    "dsexamples__BingBertSquad_1-bit_adam_nccl_deepspeed_onebitadam_bsz96_config.json": (
        "$.optimizer.type"
    ),
    "hf_transformers__ds_config_zero3.json": "$.zero_optimization.reduce_bucket_size",
    "megatron_ds__ds_zero_stage_1_config_baseline.json": "$.optimizer.params.max_grad_norm",
}
# DeepSpeed runs these, dtypeplan cannot give the same numbers: refused, saying why.
REFUSED_HERE = {
    # FusedAdam without bias correction; torch's Adam always corrects.
    "dsexamples__BingBertSquad_deepspeed_bsz24_config.json": (
        "$.optimizer.params.bias_correction",
        "bias correction",
    ),
    # ZenFlow's stale top-k updates.
    "dsexamples__DeepSpeed-ZenFlow_finetuning_zf_config.json": (
        "$.zero_optimization.zenflow",
        "ZenFlow",
    ),
}

# offload_optimizer cpu at ZeRO 1-3: run by the table's offload cells (the fp32 master shard and
# the states in host memory, stepped on the CPU; at ZeRO-3 FSDP2's shards stay on the device).
OK_WITH_OPTIMIZER_OFFLOAD = {
    "axolotl__zero2.json",
    "llamafactory__ds_z3_fp8_config.json",
    "deepspeed__megatron_gpt2_ds_config_func_bs4_zero2_offload.json",
    "fastchat__deepspeed_config_s2.json",
    "hf_accelerate__ds_config_zero2_model_only.json",
    "hf_transformers__ds_config_zero2.json",
    "llamafactory__ds_z2_offload_config.json",
}

# offload_param and offload_optimizer cpu at ZeRO-3: the table's offload-zero3 cells (FSDP2's
# CPUOffloadPolicy: shards, gradients and states in host memory, stepped on the CPU).
OK_WITH_ZERO3_OFFLOAD = {
    "alpaca__default_offload_opt_param.json",
    "axolotl__zero3_bf16_cpuoffload_all.json",
    "fastchat__deepspeed_config_s3.json",
    "hf_accelerate__zero_stage3_offload_config.json",
    "llamafactory__ds_z3_offload_config.json",
    "llava__zero3_offload.json",
}


# Keys that change numbers or memory (issue 11, item 4), never listed as ignored.
NUMBER_CHANGING = {
    "device",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
    "fp16_master_weights_and_grads",
    "torch_autocast",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_hpz_partition_size",
    "prescale_gradients",
    "gradient_predivide_factor",
    "fp8",
    "scheduler",
    "gradient_accumulation_steps",
}


def _document(name: str) -> dict[str, Any]:
    return json.loads((CORPUS / name).read_text())


def _has_new_settings(config: Any) -> bool:
    return any(getattr(config, name) != default for name, default, _ in DEEPSPEED_PRECISION_FIELDS)


def _outcome(name: str) -> str:
    entry = BY_FILE[name]
    if entry["deepspeed_runs"] == "no":
        return "refused (DeepSpeed refuses it too)"
    if name in REFUSED_HERE:
        return "refused (DeepSpeed runs it; dtypeplan cannot honour it)"
    config = load_config(CORPUS / name)
    plan = dtypeplan.resolve(CORPUS / name)
    how = "as is" if entry["deepspeed_runs"] == "as_is" else "after the HF fill"
    if plan.status != "OK":
        return f"{plan.status} ({how}; a setting the table does not run)"
    if name in OK_WITH_OPTIMIZER_OFFLOAD:
        return f"OK with the optimizer offloaded to the CPU ({how})"
    if name in OK_WITH_ZERO3_OFFLOAD:
        return f"OK at ZeRO-3 with parameters and optimizer offloaded to the CPU ({how})"
    if _has_new_settings(config):
        return f"OK with the table's missing settings stated ({how})"
    return f"OK ({how})"


def test_the_corpus_is_complete() -> None:
    files = sorted(p.name for p in CORPUS.glob("*.json") if p.name != "EXPECTED.json")
    assert files == sorted(BY_FILE)
    assert len(files) >= 30
    assert set(REFUSED_BY_DEEPSPEED) == {e["file"] for e in EXPECTED if e["deepspeed_runs"] == "no"}


@pytest.mark.parametrize("name", sorted(REFUSED_BY_DEEPSPEED))
def test_files_deepspeed_refuses_are_refused_with_the_reason(name: str) -> None:
    with pytest.raises(PrecisionConfigError) as info:
        dtypeplan.resolve(CORPUS / name)
    path = REFUSED_BY_DEEPSPEED[name]
    assert info.value.path == path
    key = path.rsplit(".", 1)[-1]
    assert (
        key in BY_FILE[name]["why"] or _document(name)["optimizer"]["type"] in BY_FILE[name]["why"]
    )
    assert path in str(info.value)


@pytest.mark.parametrize("name", sorted(REFUSED_HERE))
def test_files_dtypeplan_cannot_honour_are_refused_saying_why(name: str) -> None:
    path, reason = REFUSED_HERE[name]
    with pytest.raises(PrecisionConfigError, match=reason) as info:
        dtypeplan.resolve(CORPUS / name)
    assert info.value.path == path


RUNS = sorted(
    e["file"] for e in EXPECTED if e["deepspeed_runs"] != "no" and e["file"] not in REFUSED_HERE
)


def _deepspeed_optimizer(document: dict[str, Any]) -> str | None:
    block = document.get("optimizer")
    if block is None:
        return None
    kind = block["type"].lower()
    if kind == "adam" and block.get("params", {}).get("adam_w_mode", True):
        return "AdamW"  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    return {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}[kind]


@pytest.mark.parametrize("name", RUNS)
def test_files_deepspeed_runs_resolve_with_its_meaning_or_say_where_not(name: str) -> None:
    entry = BY_FILE[name]
    document = _document(name)
    config = load_config(CORPUS / name)
    plan = dtypeplan.resolve(CORPUS / name)
    text = plan.explain()

    # DeepSpeed's reading, parsed.
    assert config.offload_optimizer == entry["offload_optimizer"]
    assert config.offload_param == entry["offload_param"]
    assert plan.zero_stage == entry["zero_stage"]
    param = entry["param_dtype"]
    expected_param = "fp32" if param == "auto" else param  # HF default: bf16 and fp16 off
    assert (
        str(plan.param_dtype).removeprefix("torch.")
        == {
            "fp32": "float32",
            "fp16": "float16",
            "bf16": "bfloat16",
        }[expected_param]
    )
    assert (plan.scheduler or {}).get("type") == entry["scheduler_type"]
    if entry["optimizer_type"] is not None:
        assert plan.optimizer.type == _deepspeed_optimizer(document)

    # Every "auto" listed with the value used and its source.
    assert [a.path for a in plan.auto_values] == entry["auto_keys"] or sorted(
        a.path for a in plan.auto_values
    ) == sorted(entry["auto_keys"])
    for auto in plan.auto_values:
        assert auto.path in text and auto.source in text

    # Gradient clipping: DeepSpeed's effective value, or the difference stated.
    effective = entry["gradient_clipping_effective"]
    if plan.gradient_clipping != effective:
        assert entry["gradient_clipping"] is None and plan.gradient_clipping == 0
        assert "gradient clipping" in text and '"gradient_clipping": 1.0' in text
    # Accumulation and wire dtypes: DeepSpeed uses the model dtype unless told otherwise.
    accum_given = "grad_accum_dtype" in document.get("data_types", {})
    if expected_param != "fp32" and not accum_given and plan.grad_accum_dtype != plan.param_dtype:
        assert any(d.startswith("gradient accumulation") for d in plan.deepspeed_differences)
    if "communication_data_type" not in document and plan.comm_dtype != plan.param_dtype:
        assert any(d.startswith("wire dtype") for d in plan.deepspeed_differences)
    if entry["optimizer_type"] is None:
        assert any(d.startswith("no optimizer block") for d in plan.deepspeed_differences)

    # Status: NotSupported, with its reason, for a setting the table does not run yet (offload
    # beyond the CPU at ZeRO 1-2, bf16 master weights, ...: issue 13); never OK as if the setting
    # were not there.
    if name in OK_WITH_OPTIMIZER_OFFLOAD:
        assert plan.status == "OK", text
        assert plan.rule_id in ("zero1", "zero2", "zero3-offload-optimizer"), plan.rule_id
        assert plan.offload_optimizer == "cpu" and plan.offload_param == "none"
        assert plan.memory(10**6, 2)["host_total"] > 0
    elif name in OK_WITH_ZERO3_OFFLOAD:
        assert plan.status == "OK", text
        assert plan.rule_id == "zero3-offload", plan.rule_id
        assert (plan.offload_optimizer, plan.offload_param, plan.zero_stage) == ("cpu", "cpu", 3)
        figures = plan.memory(10**6, 2)
        assert figures["total"] == 0 and figures["host_params"] > 0
    elif _has_new_settings(config):
        assert plan.status == "NotSupported", text
        assert "not implemented yet" in plan.reason or "NotSupported" in text, text
    else:
        assert plan.status == "OK", text
    # Nothing that changes numbers or memory is listed as ignored.
    for path in plan.ignored_keys:
        assert path.rsplit(".", 1)[-1] not in NUMBER_CHANGING, path


def test_corpus_counts_by_outcome(capsys: pytest.CaptureFixture[str]) -> None:
    counts = Counter(_outcome(name) for name in sorted(BY_FILE))
    with capsys.disabled():
        print("\ncorpus outcomes:", json.dumps(dict(sorted(counts.items())), indent=1))
    assert sum(counts.values()) == len(BY_FILE)
    refused_here = counts["refused (DeepSpeed runs it; dtypeplan cannot honour it)"]
    assert refused_here == len(REFUSED_HERE)


def test_a_real_offload_file_trains_as_without_offload() -> None:
    """HF Transformers' ZeRO-2 offload file (after the HF fill) builds and trains; on one
    process its offloaded step gives bit for bit the parameters of the same file without
    offload_optimizer (same fused Adam kernel, on the host instead of beside the parameters)."""
    from tests._helpers import make_batch, make_model, mse

    name = "hf_transformers__ds_config_zero2.json"
    document = _document(name)
    assert document["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    without = json.loads(json.dumps(document))
    del without["zero_optimization"]["offload_optimizer"]
    finals, losses = [], []
    for config in (document, without):
        plan = dtypeplan.resolve(config, auto={"optimizer.params.lr": 1e-2})
        assert plan.status == "OK", plan.explain()
        model = plan.prepare_model(make_model(0))
        optimizer = plan.build(model.parameters())
        run = []
        for step in range(4):
            x, y = make_batch(step % 2, 16)
            loss = mse(model, x, y)
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            run.append(float(loss.detach()))
        losses.append(run)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert plan.offload_optimizer == "none"
    assert losses[0][-1] < losses[0][0], losses[0]
    assert losses[0] == losses[1]
    for offloaded, plain in zip(*finals, strict=True):
        assert torch.equal(offloaded, plain)


# Public files that give both batch sizes and no gradient_accumulation_steps, with DeepSpeed
# 0.19's count (train_batch // micro // ranks) at 1, 2 and 8 data-parallel ranks; None where
# DeepSpeed refuses the sizes (micro x count x ranks != train_batch).
_BATCH_FILES = {
    "bigscience_megatron_ds__ds_config_bf16.json": {1: 16, 2: 8, 8: 2},  # 16 / 1
    "deepspeed__hybrid_engine_config.json": {1: 16, 2: 8, 8: 2},  # 32 / 2
    "dsexamples__pipeline_parallelism_ds_config.json": {1: 32, 2: 16, 8: 4},  # 256 / 8
    "megatron_ds__universal_checkpointing_ds_config.json": {1: 1, 2: None, 8: None},  # 16 / 16
}


@pytest.mark.parametrize("name", sorted(_BATCH_FILES))
def test_public_batch_sizes_give_deepspeeds_micro_batches_per_step(name: str) -> None:
    plan = dtypeplan.resolve(CORPUS / name)
    for ranks, expected in _BATCH_FILES[name].items():
        found = plan.accumulation_steps(ranks)
        assert (found.micro_batches if found else None) == expected, (name, ranks)
        mismatch = plan.batch_size_mismatch(ranks)
        assert (mismatch is None) == (expected is not None), (name, ranks, mismatch)
