"""Property tests of ``resolve`` over the whole configuration space.

Configs are drawn on every dimension of the table (parameter dtype including both 16-bit modes,
accumulation dtype and its three spellings or unset, sharded or unset, stage or unset, pipeline,
wire dtype or unset, reduction method) and on the settings that do not pick a rule (optimizer,
clipping, loss scaling, bucket size). Example counts come from the hypothesis profile that
``tests/conftest.py`` loads (``DTYPEPLAN_HYPOTHESIS_PROFILE=thorough`` for the long run).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dtypeplan
from dtypeplan import NotSupportedError, PrecisionConfigError, PrecisionPlan
from dtypeplan.resolver import DIMENSIONS, DTYPES, PARAMS, STAGE
from dtypeplan.resolver._dimensions import FEATURES_UNUSED, WIRES_ACROSS, shard_groups_value

DTYPE_NAMES = list(DTYPES)
REDUCTIONS = ["collective", "fp32_sum"]
# The dimensions that configs() and point_of() know how to write and read.
KNOWN_DIMENSIONS = {"params", "accum", "sharded", "stage", "pipeline", "comm", "reduction"} | set(
    FEATURES_UNUSED
)
# configs() draws no DeepSpeed feature (point_of() puts each at its "not used" value); their
# config keys are read by the config side of issue 11, and drawing them belongs with it.
MEMORY_KEYS = {"params", "grads", "accumulator", "master", "optimizer_states", "total"}
HOST_MEMORY_KEYS = {
    "host_params",
    "host_accumulator",
    "host_master",
    "host_optimizer_states",
    "host_total",
}
TABLE = dtypeplan.load_rules()
EXAMPLES = settings.default.max_examples
# Building an optimizer costs ~10x a resolve; a quarter of the profile keeps the ci run short.
BUILD_EXAMPLES = max(20, EXAMPLES // 4)


# --- strategies ------------------------------------------------------------------------------
@st.composite
def optimizers(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["AdamW", "Adam", "SGD", "adamw", "sgd"]))
    params: dict[str, Any] = {"lr": draw(st.sampled_from([1e-3, 1e-2, 0.1]))}
    if draw(st.booleans()):
        params["weight_decay"] = draw(st.sampled_from([0.0, 0.01, 0.1]))
    if kind.lower() == "sgd":
        if draw(st.booleans()):
            params["momentum"] = draw(st.sampled_from([0.0, 0.9]))
    else:
        if draw(st.booleans()):
            params["betas"] = draw(st.sampled_from([[0.9, 0.999], [0.8, 0.95]]))
        if draw(st.booleans()):
            params["amsgrad"] = draw(st.booleans())
    return {"type": kind, "params": params}


@st.composite
def configs(draw: st.DrawFn, point: dict[str, Any] | None = None) -> dict[str, Any]:
    """A schema-valid config anywhere in the configuration space, or at ``point`` if given.

    At a given point a dimension is still left unset (or spelled another way) where the
    table's default gives the same value, so defaults are exercised there too.
    """
    defaults = TABLE.defaults
    config: dict[str, Any] = {}
    model = point["params"] if point else draw(st.sampled_from(PARAMS.values))
    bf16, fp16 = "bf16" in model, "fp16" in model
    # fp32 is spelled both by leaving the sections out and by enabled: false.
    if bf16 or draw(st.booleans()):
        config["bf16"] = {"enabled": bf16}
    if fp16 or draw(st.booleans()):
        section: dict[str, Any] = {"enabled": fp16}
        if draw(st.booleans()):
            section["loss_scale"] = draw(st.sampled_from([0, 0, 128.0]))
            section["initial_scale_power"] = draw(st.integers(0, 20))
            section["loss_scale_window"] = draw(st.integers(1, 2000))
            section["hysteresis"] = draw(st.integers(1, 4))
            section["min_loss_scale"] = draw(st.sampled_from([1, 0.25]))
        config["fp16"] = section

    if point is None:
        stage = draw(st.none() | st.sampled_from(STAGE.values))
        accum = draw(st.none() | st.sampled_from(DTYPE_NAMES))
        # sharded can only be written in the mapping form, which requires a dtype.
        sharded = draw(st.none() | st.booleans()) if accum is not None else None
        comm = draw(st.sampled_from([None, "unset", *DTYPE_NAMES]))
    else:
        stage = point["stage"] if point["stage"] != 0 or draw(st.booleans()) else None
        default_accum = defaults.grad_accum_dtype["fp16" if model == "fp16+bf16" else model]
        default_sharded = defaults.accumulator_sharded[point["stage"]]
        explicit_sharded = point["sharded"] != default_sharded or draw(st.booleans())
        explicit_accum = explicit_sharded or point["accum"] != default_accum or draw(st.booleans())
        accum = point["accum"] if explicit_accum else None
        sharded = point["sharded"] if explicit_sharded else None
        if point["comm"] == point["accum"]:
            comm = draw(st.sampled_from([None, "unset", point["comm"]]))
        else:
            comm = point["comm"]

    if accum is not None:
        spelling = (
            "mapping"
            if sharded is not None
            else draw(st.sampled_from(["string", "mapping", "alias", "both"]))
        )
        if spelling == "mapping":
            value: dict[str, Any] = {"dtype": accum}
            if sharded is not None:
                value["sharded"] = sharded
            config["gradient_accumulation_dtype"] = value
        if spelling in ("string", "both"):
            config["gradient_accumulation_dtype"] = accum
        if spelling in ("alias", "both"):
            config["data_types"] = {"grad_accum_dtype": accum}
        if sharded is not None and draw(st.booleans()):
            config["data_types"] = {"grad_accum_dtype": accum}

    if stage is not None:
        config["zero_optimization"] = {"stage": stage}
    elif draw(st.booleans()):
        config["zero_optimization"] = {}
    if draw(st.booleans()):
        config.setdefault("zero_optimization", {})["reduce_bucket_size"] = draw(st.integers(1, 64))

    if comm != "unset":
        config["communication_data_type"] = comm
    reduction = point.get("reduction", "collective") if point else None
    if reduction is None or reduction == "collective":
        if draw(st.booleans()):
            config["communication_reduction"] = reduction or draw(st.sampled_from(REDUCTIONS))
    else:
        config["communication_reduction"] = reduction
    if draw(st.booleans()):
        config["optimizer"] = draw(optimizers())
    clip = draw(st.sampled_from([None, 0.0, 0.5, 1.0, 1e-3]))
    if clip is not None:
        config["gradient_clipping"] = clip
    if draw(st.booleans()):
        config["check_nonfinite"] = draw(st.booleans())
    if draw(st.booleans()):
        config["train_batch_size"] = draw(st.integers(1, 1024))
        config["steps_per_print"] = draw(st.integers(1, 100))
    if point is None and draw(st.booleans()):
        # The layout (issue 22): shard groups of any size, with or without a wire across.
        zero = config.setdefault("zero_optimization", {})
        zero["shard_group_size"] = draw(st.integers(1, 16))
        wire = draw(st.sampled_from([None, "unset", *WIRES_ACROSS]))
        if wire != "unset":
            config["communication_data_type_across_groups"] = wire
    if point is None and draw(st.booleans()):
        # ZeRO++ qwZ / qgZ, with or without the layout: qgZ with shard groups is the int8 wire
        # across them, and beside another wire across a contradiction (an Error plan).
        zero = config.setdefault("zero_optimization", {})
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            if draw(st.booleans()):
                zero[key] = draw(st.booleans())
    return config


def at_point(point: dict[str, Any]) -> st.SearchStrategy[tuple[dict[str, Any], bool]]:
    return st.tuples(configs(point), st.just(point["pipeline"]))


# Drawing configs() and filtering for a status would throw most early (near-minimal) examples
# away, so the tests of non-OK plans draw one of the table's non-OK points and a config there.
NOT_OK_POINTS = [p for p in TABLE.points() if TABLE.lookup(p).status != "OK"]
OK_POINTS = [p for p in TABLE.points() if TABLE.lookup(p).status == "OK"]
unsupported = st.sampled_from(NOT_OK_POINTS).flatmap(at_point)
# ZeRO-3 (FSDP2) shards parameters over a process group, so it cannot build in a bare single
# process; test_zero3_builds_in_a_single_process states that gap on its own.
supported = st.sampled_from([p for p in OK_POINTS if p["stage"] < 3]).flatmap(at_point)
unsupported_one_mode = st.sampled_from(
    [p for p in NOT_OK_POINTS if p["params"] != "fp16+bf16"]
).flatmap(at_point)


def point_of(config: dict[str, Any], pipeline: bool) -> dict[str, Any]:
    """The table point of ``config``, worked out from the config and the shipped defaults."""
    defaults = TABLE.defaults
    bf16 = config.get("bf16", {}).get("enabled", False)
    fp16 = config.get("fp16", {}).get("enabled", False)
    model = "fp16+bf16" if bf16 and fp16 else "bf16" if bf16 else "fp16" if fp16 else "fp32"
    accum_value = config.get("gradient_accumulation_dtype")
    accum = accum_value["dtype"] if isinstance(accum_value, dict) else accum_value
    accum = accum or config.get("data_types", {}).get("grad_accum_dtype")
    accum = accum or defaults.grad_accum_dtype["fp16" if model == "fp16+bf16" else model]
    stage = config.get("zero_optimization", {}).get("stage", 0)
    sharded = accum_value.get("sharded") if isinstance(accum_value, dict) else None
    if sharded is None:
        sharded = defaults.accumulator_sharded[stage]
    assert defaults.communication_data_type == "accum"
    comm = config.get("communication_data_type") or accum
    across, quantized = wire_across_and_quantized(config)
    point = {
        "params": model,
        "accum": accum,
        "sharded": sharded,
        "stage": stage,
        "pipeline": pipeline,
        "comm": comm,
        "reduction": config.get("communication_reduction", "collective"),
        **FEATURES_UNUSED,  # configs() draws no DeepSpeed feature but the layout and ZeRO++
        # A wire across named as the communication dtype is no other wire: plain hybrid.
        "shard_groups": shard_groups_value(
            config.get("zero_optimization", {}).get("shard_group_size"),
            None if across == comm else across,
        ),
        "quantized_communication": quantized,
    }
    return {dim: point[dim] for dim in DIMENSIONS}


def wire_across_and_quantized(config: dict[str, Any]) -> tuple[str | None, str]:
    """The wire across the shard groups and the ``quantized_communication`` value: qgZ with
    shard groups and no other wire across is the int8 wire (and no longer quantized
    communication); beside another wire both stay."""
    zero = config.get("zero_optimization", {})
    across = config.get("communication_data_type_across_groups")
    weights = bool(zero.get("zero_quantized_weights"))
    gradients = bool(zero.get("zero_quantized_gradients"))
    if gradients and zero.get("shard_group_size") is not None and across in (None, "int8"):
        across, gradients = "int8", False
    kinds = [kind for kind, on in (("weights", weights), ("gradients", gradients)) if on]
    return across, "both" if len(kinds) == 2 else kinds[0] if kinds else "none"


def tiny_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False)
    ).to(dtype)


def prepare(plan: PrecisionPlan, model: torch.nn.Module) -> torch.nn.Module:
    """``plan.prepare_model(model)`` where the plan has it (ZeRO-3 shards the model there)."""
    prepare_model = getattr(plan, "prepare_model", None)
    return prepare_model(model) if prepare_model is not None else model


# --- totality, uniqueness, determinism -------------------------------------------------------
def test_strategies_cover_every_dimension() -> None:
    assert set(DIMENSIONS) <= KNOWN_DIMENSIONS, "teach configs() and point_of() the new dimension"


@given(config=configs(), pipeline=st.booleans())
def test_resolve_is_total_and_one_rule_decides(config: dict[str, Any], pipeline: bool) -> None:
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    point = point_of(config, pipeline)
    # The first gate that holds the point decides, else the one grid rule that matches it.
    gates = [gate for gate in TABLE.gates if gate.matches(point)]
    matching = [rule for rule in TABLE.grid if rule.matches(point)]
    assert gates or len(matching) == 1, (point, [r.id for r in matching])
    first = gates[0] if gates else matching[0]
    rule = TABLE.lookup(point)
    # A deferring gate: the decision of the point it defers to, named after both.
    assert rule.id == first.id or rule.decided_by[:1] == (first.id,), (rule.id, first.id)
    assert plan.rule_id == rule.id
    assert plan.status == rule.status
    assert plan.implementation == (rule.implementation if rule.status == "OK" else None)
    assert plan.grad_accum_dtype == DTYPES[point["accum"]]
    assert plan.comm_dtype == DTYPES[point["comm"]]
    assert plan.accumulator_sharded is point["sharded"]
    assert plan.zero_stage == point["stage"] and plan.pipeline_parallel is pipeline
    assert plan.master_dtype == torch.float32
    layout = config.get("zero_optimization", {}).get("shard_group_size")
    assert plan.shard_group_size == layout
    assert plan.wire_across_groups == wire_across_and_quantized(config)[0]
    assert plan.quantized_communication == point["quantized_communication"]
    if layout is not None and point["stage"] == 0:
        # Nothing to shard (or a worse error first); qwZ / qgZ decide their own refusal.
        assert plan.status == "Error" or point["quantized_communication"] != "none"
    if point["quantized_communication"] in ("gradients", "both") and layout is not None:
        # qgZ beside another wire across the groups: the contradiction, as a plan.
        assert plan.status == "Error", plan.rule_id
    if point["shard_groups"].startswith("hybrid_") and plan.rule_id.startswith("zero3"):
        # FSDP2's HSDP reduces across the groups in communication_data_type only.
        assert plan.status == "NotSupported"
    if point["params"] != "fp16+bf16":
        assert plan.param_dtype == DTYPES[point["params"]]
    assert (plan.alternatives == ()) == (plan.status == "OK")


@given(config=configs(), pipeline=st.booleans())
def test_resolve_is_deterministic_and_serializable(config: dict[str, Any], pipeline: bool) -> None:
    original = copy.deepcopy(config)
    first = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    assert config == original, "resolve must not modify its input"
    second = dtypeplan.resolve(copy.deepcopy(config), pipeline_parallel=pipeline)
    data = first.to_dict()
    assert data == second.to_dict()
    assert first.explain() == second.explain()
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text) == data
    assert data["status"] in ("OK", "NotSupported", "Error")
    assert isinstance(first.explain(), str)


# --- build -----------------------------------------------------------------------------------
@settings(max_examples=BUILD_EXAMPLES)
@given(case=supported, micro_batches=st.integers(1, 3))
def test_ok_plans_build_and_step(case: tuple[dict[str, Any], bool], micro_batches: int) -> None:
    config, pipeline = case
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    assert plan.status == "OK"
    model = prepare(plan, tiny_model())
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = plan.build(model.parameters())
    assert isinstance(optimizer, dtypeplan.MixedPrecisionOptimizer)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert all(p.dtype == plan.param_dtype for p in model.parameters())
    torch.manual_seed(1)
    for _ in range(micro_batches):
        x = torch.randn(5, 4, dtype=plan.param_dtype)
        loss = model(x).float().square().mean() / micro_batches
        optimizer.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.dtype == plan.param_dtype for p in model.parameters())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    state = optimizer.full_state()
    masters = [state[f"param.{i}.master"] for i in range(len(initial))]
    assert all(m.dtype == torch.float32 for m in masters)
    if optimizer.skipped_steps == 0:
        assert any(not torch.equal(m, p0) for m, p0 in zip(masters, initial, strict=True))
    else:
        assert plan.param_dtype == torch.float16 and optimizer.skipped_steps == 1


ZERO3_OK_POINTS = [p for p in OK_POINTS if p["stage"] == 3]


@pytest.mark.skipif(not ZERO3_OK_POINTS, reason="the table has no OK ZeRO-3 cell")
def test_zero3_builds_in_a_single_process() -> None:
    point = ZERO3_OK_POINTS[0]
    config = {
        "zero_optimization": {"stage": 3},
        "gradient_accumulation_dtype": {"dtype": point["accum"], "sharded": True},
        "communication_data_type": point["comm"],
        "communication_reduction": point.get("reduction", "collective"),
    }
    plan = dtypeplan.resolve(config, pipeline_parallel=point["pipeline"])
    assert plan.status == "OK"
    model = prepare(plan, tiny_model())
    optimizer = plan.build(model.parameters())
    optimizer.backward(model(torch.randn(5, 4)).square().mean())
    optimizer.step()


@settings(max_examples=BUILD_EXAMPLES)
@given(case=unsupported)
def test_plans_that_are_not_ok_refuse_to_build(case: tuple[dict[str, Any], bool]) -> None:
    config, pipeline = case
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    assert plan.status != "OK"
    model = tiny_model()
    expected = NotSupportedError if plan.status == "NotSupported" else PrecisionConfigError
    with pytest.raises(expected) as info:
        plan.build(model.parameters())
    assert type(info.value) is expected
    assert plan.reason in str(info.value)
    # A refused build leaves the model alone.
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --- alternatives ----------------------------------------------------------------------------
def _parse(value: str) -> Any:
    if value in ("true", "True"):
        return True
    if value in ("false", "False"):
        return False
    return int(value) if value.isdigit() else value


def apply_alternative(
    config: dict[str, Any], pipeline: bool, plan: PrecisionPlan, changes: tuple[str, ...]
) -> tuple[dict[str, Any], bool]:
    """``config`` with the settings of one alternative written into it, as a user would."""
    config = copy.deepcopy(config)
    for change in changes:
        for assignment in change.split(", "):
            key, _, raw = assignment.partition("=")
            value = _parse(raw)
            section, _, leaf = key.partition(".")
            if key == "pipeline_parallel":
                pipeline = value
            elif section == "gradient_accumulation_dtype":
                # One setting with two spellings: move it to the mapping form, which can hold
                # both fields; a dtype the config left to the table keeps the plan's value.
                current = config.pop("gradient_accumulation_dtype", None)
                alias = config.pop("data_types", {}).get("grad_accum_dtype")
                if not isinstance(current, dict):
                    current = {"dtype": current or alias}
                if current["dtype"] is None:
                    current["dtype"] = {v: k for k, v in DTYPES.items()}[plan.grad_accum_dtype]
                current[leaf] = value
                config["gradient_accumulation_dtype"] = current
            elif leaf:
                config.setdefault(section, {})[leaf] = value
            else:
                config[key] = value
    return config, pipeline


def _check_alternatives(config: dict[str, Any], pipeline: bool) -> None:
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    assert plan.status != "OK"
    assert plan.alternatives, plan.explain()
    text = plan.explain()
    # "Nearest": no OK point of a single parameter dtype is fewer settings away.
    point = point_of(config, pipeline)
    nearest = min(
        sum(candidate[dim] != point[dim] for dim in DIMENSIONS)
        for candidate in OK_POINTS
        if candidate["params"] != "fp16+bf16"
    )
    for alternative in plan.alternatives:
        assert len(alternative.changes) == nearest, (alternative, nearest)
        for change in alternative.changes:
            assert change in text
        changed, changed_pipeline = apply_alternative(config, pipeline, plan, alternative.changes)
        fixed = dtypeplan.resolve(changed, pipeline_parallel=changed_pipeline)
        assert fixed.status == "OK", (alternative, changed, changed_pipeline)
        assert fixed.rule_id == alternative.rule_id
        assert fixed.implementation == alternative.implementation


@given(case=unsupported_one_mode)
def test_alternatives_resolve_to_ok_when_applied(case: tuple[dict[str, Any], bool]) -> None:
    config, pipeline = case
    _check_alternatives(config, pipeline)


def test_alternatives_for_both_16_bit_modes_resolve_to_ok() -> None:
    _check_alternatives({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, False)


# --- memory ----------------------------------------------------------------------------------
@given(
    config=configs(),
    pipeline=st.booleans(),
    num_params=st.integers(0, 10**12),
    world_size=st.integers(1, 1024),
)
def test_memory_keys_and_total(
    config: dict[str, Any], pipeline: bool, num_params: int, world_size: int
) -> None:
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    # A shard group size must divide the world (refused otherwise: test_traffic.py).
    fewest = plan.shard_group_size or 1
    world_size *= fewest
    figures = plan.memory(num_params, world_size)
    assert set(figures) == MEMORY_KEYS | HOST_MEMORY_KEYS
    assert all(isinstance(v, int) and v >= 0 for v in figures.values())
    device = {k: v for k, v in figures.items() if k in MEMORY_KEYS}
    assert figures["total"] == sum(v for k, v in device.items() if k != "total")
    # Nothing is offloaded in these configs: no host bytes.
    assert all(figures[k] == 0 for k in HOST_MEMORY_KEYS)
    # More ranks never cost a rank more memory.
    assert figures["total"] <= plan.memory(num_params, fewest)["total"]
    assert plan.memory(0, world_size)["total"] == 0


def _bf16_plan(stage: int, sharded: bool | None = None, optimizer: str = "AdamW") -> PrecisionPlan:
    accum: dict[str, Any] = {"dtype": "bf16"}
    if sharded is not None:
        accum["sharded"] = sharded
    return dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "gradient_accumulation_dtype": accum,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        }
    )


@pytest.mark.parametrize("world_size", [1, 4, 64])
def test_memory_anchor_stage0(world_size: int) -> None:
    n = 1_000_000
    figures = _bf16_plan(0).memory(n, world_size)
    assert figures["total"] == 16 * n
    assert (figures["params"], figures["accumulator"]) == (2 * n, 2 * n)
    assert figures["master"] + figures["optimizer_states"] == 12 * n


def test_memory_anchor_stage1_sharded() -> None:
    n, w = 4_000_000, 4
    figures = _bf16_plan(1, sharded=True).memory(n, w)
    assert figures["params"] == 2 * n
    assert figures["accumulator"] == 2 * n // w
    assert figures["master"] + figures["optimizer_states"] == 12 * n // w
    assert figures["total"] == 2 * n + 2 * n // w + 12 * n // w


def test_memory_anchor_stage1_whole_accumulator() -> None:
    n, w = 4_000_000, 4
    assert _bf16_plan(1).memory(n, w)["total"] == 2 * n + 2 * n + 12 * n // w


def test_memory_sgd_without_momentum_has_no_state() -> None:
    assert _bf16_plan(0, optimizer="SGD").memory(1000, 1)["optimizer_states"] == 0


@pytest.mark.parametrize("params", ["bf16", "fp32"])
def test_memory_anchor_offloaded_optimizer(params: str) -> None:
    """ZeRO-Offload: the device keeps parameters and accumulator, the host this rank's fp32
    master shard (fp32 parameters get a host copy too) and its 8 bytes of Adam states."""
    n, w = 4_000_000, 4
    plan = dtypeplan.resolve(
        {
            **({"bf16": {"enabled": True}} if params == "bf16" else {}),
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        }
    )
    assert plan.status == "OK", plan.explain()
    figures = plan.memory(n, w)
    p = 2 if params == "bf16" else 4
    assert (figures["master"], figures["optimizer_states"]) == (0, 0)
    assert figures["total"] == p * n + 4 * n // w  # bf16 sums in fp32
    assert (figures["host_master"], figures["host_optimizer_states"]) == (4 * n // w, 8 * n // w)
    assert figures["host_total"] == 12 * n // w


# --- arbitrary input -------------------------------------------------------------------------
KNOWN_TOP_KEYS = [
    "bf16",
    "fp16",
    "gradient_accumulation_dtype",
    "data_types",
    "communication_data_type",
    "communication_reduction",
    "zero_optimization",
    "optimizer",
    "gradient_clipping",
    "check_nonfinite",
    "train_batch_size",
    "steps_per_print",
    "wall_clock_breakdown",
]
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from([*DTYPE_NAMES, "AdamW", "SGD", 0, 1, 2, 3, True, False])
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(max_size=8)
            | st.sampled_from(["enabled", "stage", "dtype", "type", "params", "lr", "sharded"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)
json_configs = st.dictionaries(
    st.sampled_from(KNOWN_TOP_KEYS) | st.text(max_size=12), json_values, max_size=5
)


def _resolve_or_config_error(config: Any, pipeline: bool = False) -> None:
    try:
        plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    except PrecisionConfigError as error:
        assert isinstance(error.path, str) and error.path.startswith("$"), error.path
        if error.path != "$":
            assert error.path in str(error)
        return
    json.dumps(plan.to_dict())


@given(config=json_configs | json_values)
def test_arbitrary_json_resolves_or_raises_config_error(config: Any) -> None:
    _resolve_or_config_error(config)


def _paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found: list[tuple[Any, ...]] = []
    if isinstance(document, dict):
        for key, value in document.items():
            found.append((*prefix, key))
            found.extend(_paths(value, (*prefix, key)))
    return found


@given(data=st.data(), config=configs(), pipeline=st.booleans())
def test_mutated_configs_resolve_or_raise_config_error(
    data: st.DataObject, config: dict[str, Any], pipeline: bool
) -> None:
    paths = _paths(config)
    assume(paths)
    path = data.draw(st.sampled_from(paths))
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    action = data.draw(st.sampled_from(["replace", "delete", "sibling"]))
    if action == "replace":
        parent[path[-1]] = data.draw(json_values)
    elif action == "delete":
        del parent[path[-1]]
    else:
        parent[data.draw(st.text(min_size=1, max_size=12))] = data.draw(json_values)
    _resolve_or_config_error(config, pipeline)
