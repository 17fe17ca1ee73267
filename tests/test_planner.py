"""dtypeplan.plan_for and ``dtypeplan plan``: the enumeration against the table, the sizes
against transformers, the model states against DeepSpeed's estimator, every figure against
plan.memory()/plan.traffic() and, on 2 gloo ranks, against what the ranks hold and send; the
chosen config resolves OK and trains."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.cli import main
from dtypeplan.launch import spawn
from dtypeplan.planner import Fleet, model_sizes, parse_bandwidth, parse_size, plan_for
from dtypeplan.planner.costs import Coster, Workload
from dtypeplan.planner.enumeration import choice_space, ok_points
from dtypeplan.planner.numerics import MEASURED, numerical_cost
from dtypeplan.planner.rank import pareto_front, ranked
from dtypeplan.resolver import DIMENSIONS
from tests._helpers import memory_mlp
from tests.workers.optimizer import memory_cases
from tests.workers.traffic import traffic_cases

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "data" / "models"
GPT2, LLAMA8B, LLAMA70B = MODELS / "gpt2-124m", MODELS / "llama-3-8b", MODELS / "llama-70b"
H100 = {"gpu_memory": 80e9, "gpus_per_node": 8, "host_memory": 2e12}
ADAMW = {"pipeline": False, "fp8_execution": "native", "optimizer": "elementwise",
         "state_kind": "moments"}  # fmt: skip


# --- the enumeration ----------------------------------------------------------------------------


def test_the_boxes_hold_exactly_the_ok_points_a_lookup_of_every_point_finds() -> None:
    """A sub-space of 12,288 points (every dimension varied), looked up one by one, against
    the boxes (the enumeration's shortcut: it looks up only the points whose values the table
    reads)."""
    table = dtypeplan.load_rules()
    narrow = {
        "params": ("fp32", "bf16"),
        "comm": ("bf16",),
        "reduction": ("collective",),
        "master": ("fp32", "bf16_kahan"),
        "states": ("fp32", "int8/fp32"),
        "shard_groups": ("flat", "hybrid_int8"),
        "autocast": ("none",),
        "quantized_communication": ("none",),
        "gradient_prescaling": ("none",),
        "fp8_recipe": ("tensorwise",),
    }
    space = choice_space(ADAMW, narrow)
    assert math.prod(len(v) for v in space.values()) == 12_288
    found = {}
    for box in ok_points(table, ADAMW, space):
        for point in box.points():
            key = tuple(sorted((n, str(v)) for n, v in point.items()))
            assert key not in found, "two boxes hold one point"
            found[key] = box.rule_id
    base = {name: dim.default_value for name, dim in DIMENSIONS.items()} | ADAMW
    expected = {}
    for values in itertools.product(*space.values()):
        point = base | dict(zip(space, values, strict=True))
        rule = table.lookup(point)
        if rule.status == "OK":
            key = tuple(sorted((n, str(v)) for n, v in zip(space, values, strict=True)))
            expected[key] = rule.id
    assert found == expected
    assert len(found) > 100


def test_a_lookup_that_reads_unseen_is_caught_not_planned_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Were the table to read a point in a way the recorder does not see, the boxes would be
    wrong: the sample check after the enumeration raises instead."""
    from dtypeplan.planner import enumeration

    monkeypatch.setattr(enumeration._ReadRecorder, "__getitem__", dict.__getitem__)
    space = choice_space(ADAMW, {"states": ("fp32", "bf16"), "master": ("fp32", "bf16_sr")})
    with pytest.raises(RuntimeError, match="disagrees with RuleTable.lookup"):
        ok_points(dtypeplan.load_rules(), ADAMW, space)


def test_every_optimizer_class_the_table_knows_is_planned_or_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = Fleet(gpus=8, gpu_memory=80e9)
    sgd = plan_for(GPT2, fleet, optimizer="SGD", seq=128)
    adam = plan_for(GPT2, fleet, optimizer="AdamW", seq=128)
    assert sgd.fitting and adam.fitting

    # Plain SGD keeps no state: its best model states are the parameters and accumulator only.
    def states(c: Any) -> int:
        return c.memory["optimizer_states"] + c.memory["host_optimizer_states"]

    assert max(states(c) for c in sgd.fitting) == 0
    assert min(states(c) for c in adam.fitting) > 0
    code = main(["plan", "--model", str(GPT2), "--gpus", "8", "--gpu-memory", "80GB",
                 "--optimizer", "LBFGS", "--quiet"])  # fmt: skip
    assert code == 1
    assert "no OK combination for optimizer LBFGS" in capsys.readouterr().err
    # Adafactor runs whole (optimizers/whole/): planned with the owners' layout, which needs
    # each parameter's shape (tests/test_whole_cost.py checks the figures).
    adafactor = plan_for(GPT2, fleet, optimizer="Adafactor", seq=128)
    assert adafactor.fitting and {c.implementation for c in adafactor.fitting} == {"whole"}
    with pytest.raises(ValueError, match="whole parameters"):
        plan_for(124_000_000, fleet, optimizer="Adafactor", seq=128)


# --- sizes --------------------------------------------------------------------------------------


def test_sizes_parse_as_people_write_them() -> None:
    assert parse_size("80GB") == 80e9
    assert parse_size("80 GiB") == 80 * 2**30
    assert parse_size("1TB") == 1e12
    assert parse_bandwidth("900GB/s") == 900e9
    assert parse_bandwidth("400Gb/s") == 50e9
    for bad in ("eighty GB", "-1GB", "80 GBs"):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in ("80", "80GB/s/s", "0GB/s"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


@pytest.mark.parametrize(
    "path, count",
    [(GPT2, 124_439_808), (LLAMA8B, 8_030_261_248), (LLAMA70B, 70_553_706_496)],
)
def test_the_formula_counts_the_published_parameter_counts(path: Path, count: int) -> None:
    assert model_sizes(path).num_params == count


def test_the_formula_and_the_class_built_on_the_meta_device_agree() -> None:
    """GPT-2 124M and a small Llama (GQA, untied): the same parameters in the same order, the
    same fp8 layers and the same largest block."""
    transformers = pytest.importorskip("transformers")
    small_llama = json.loads((LLAMA8B / "config.json").read_text()) | {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    for config in (json.loads((GPT2 / "config.json").read_text()), small_llama):
        formula = model_sizes(config)
        built = model_sizes(config, build=True)
        assert "meta device" in built.source and "formula" in formula.source
        assert formula.param_numels == built.param_numels
        assert formula.param_shapes == built.param_shapes
        assert formula.fp8_weights == built.fp8_weights
        assert formula.largest_block == built.largest_block
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**small_llama)
        )
    assert model_sizes(module).param_numels == model_sizes(small_llama).param_numels


# --- the world's estimators ---------------------------------------------------------------------


def _deepspeed_zero2_gpu(total_params: int, gpus: int) -> int:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs`` without offload
    (deepspeed/runtime/zero/stage_1_and_2.py): ``4 * N + int(16 * N / W)``."""
    return 4 * total_params + int(16 * total_params / gpus)


def _deepspeed_zero3_gpu(total_params: int, largest_layer: int, gpus: int) -> int:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` without offload
    (deepspeed/runtime/zero/stage3.py): ``4 * largest_layer + int(18 * N / W)``."""
    return 4 * largest_layer + int(18 * total_params / gpus)


FP32_ADAM = {  # DeepSpeed's "plain" mixed precision: bf16 params, fp32 masters and Adam states
    "bf16": {"enabled": True},
    "gradient_accumulation_dtype": "fp32",
    "optimizer": {"type": "AdamW"},
}


@pytest.mark.parametrize("path", [GPT2, LLAMA8B, LLAMA70B])
@pytest.mark.parametrize("gpus", [8, 128, 1024])
def test_model_states_equal_deepspeeds_estimator_term_by_term(path: Path, gpus: int) -> None:
    """The sharded terms are equal (16 bytes a parameter over W: fp32 master 4, Adam 8, the
    fp32 gradient partition 4); the replicated terms differ by what dtypeplan does not hold:
    ZeRO-2's full 16-bit gradient buffer (2N: dtypeplan's hooks consume .grad into the sharded
    accumulator) and at ZeRO-3 the separate 16-bit parameter shard (2N/W: FSDP2's fp32 shard is
    the master) and the largest layer's working copy (counted by the planner as two gathered
    blocks)."""
    sizes = model_sizes(path)
    n = sizes.num_params
    largest_module = max(sizes.param_numels)  # the embedding: DeepSpeed's largest_layer_params
    zero2 = dtypeplan.resolve({**FP32_ADAM, "zero_optimization": {"stage": 2}})
    zero3 = dtypeplan.resolve({**FP32_ADAM, "zero_optimization": {"stage": 3}})
    m2 = zero2.memory(n, gpus, param_numels=sizes.param_numels)
    m3 = zero3.memory(n, gpus, param_numels=sizes.param_numels)
    sharded2 = m2["accumulator"] + m2["master"] + m2["optimizer_states"]
    assert sharded2 == 16 * n // gpus or abs(sharded2 - 16 * n / gpus) <= 3
    assert m2["params"] == 2 * n
    assert _deepspeed_zero2_gpu(n, gpus) - m2["total"] == 2 * n + (int(16 * n / gpus) - sharded2)
    assert abs(m3["total"] - 16 * n / gpus) <= 3
    assert _deepspeed_zero3_gpu(n, largest_module, gpus) - m3["total"] == pytest.approx(
        4 * largest_module + 2 * n / gpus, abs=4
    )
    # The planner costs that combination with the same figures (its table rows keep one
    # combination per distinct cost: ZeRO-2 here has ZeRO-1's with a sharded accumulator).
    coster = Coster(Workload(sizes=sizes, seq=128), Fleet(gpus=gpus, **H100))
    for stage, memory in ((2, m2), (3, m3)):
        point = {n: d.default_value for n, d in DIMENSIONS.items()} | {
            "params": "bf16", "accum": "fp32", "comm": "fp32", "sharded": True, "stage": stage
        }  # fmt: skip
        assert coster.candidate(point, None, "", None).memory == memory


def test_fp32_adam_on_one_gpu_equals_accelerates_estimate_for_gpt2() -> None:
    """``accelerate estimate-memory`` needs the Hub; its functions, run on the model it builds
    (``AutoModel`` on the meta device), give fp32 Adam's training peak as 16 bytes a parameter
    for a model built in fp32, as plan.memory() does at ZeRO 0 on one GPU (docs/planning.md:
    for configs with ``torch_dtype: bfloat16`` it reads bf16 sizes as fp32 and says half)."""
    transformers = pytest.importorskip("transformers")
    estimate = pytest.importorskip("accelerate.commands.estimate")
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes

    with init_empty_weights():
        model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(GPT2))
    total, _ = calculate_maximum_sizes(model)
    n = sum(p.numel() for p in model.parameters())
    peak = max(estimate.estimate_training_usage(total, "float32").values())
    plan = dtypeplan.resolve({"optimizer": {"type": "AdamW"}})
    assert peak == plan.memory(n, 1)["total"] == 16 * n


# --- the planner's figures ----------------------------------------------------------------------


def test_every_figure_equals_the_resolved_plans() -> None:
    """A sample of 60 combinations across the ranking (not only the finalists that plan_for
    resolves): each resolves OK, and its memory and traffic equal plan.memory() /
    plan.traffic() of the config the planner writes."""
    fleet = Fleet(gpus=16, gpu_memory=24e9, gpus_per_node=8, host_memory=1e12)
    planning = plan_for(LLAMA8B, fleet, seq=512, micro_batches=2, resolve_top=3)
    assert planning.plans
    everything = [*planning.fitting, *planning.rejected]
    sample = everything[:: max(1, len(everything) // 60)]
    sizes = planning.sizes
    for candidate in sample:
        plan = dtypeplan.resolve(planning.config(candidate))
        assert plan.status == "OK", (candidate.values, plan.reason)
        fp8 = sizes.fp8_weights if plan.fp8 else None
        memory = plan.memory(sizes.num_params, 16, param_numels=sizes.param_numels,
                             fp8_weights=fp8)  # fmt: skip
        assert memory == dict(candidate.memory), candidate.values
        assert plan.traffic(sizes.num_params, 16, fp8_weights=fp8) == candidate.traffic
        assert plan.zero_stage == candidate.values["stage"]
        assert str(plan.param_dtype).endswith(
            {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[candidate.values["params"]]
        )


@pytest.fixture(scope="module")
def gpt2_on_two_nodes() -> Any:
    return plan_for(GPT2, Fleet(gpus=16, gpu_memory=16e9), seq=512, resolve_top=0)


def _costs(c: Any) -> tuple[float, float, float]:
    return (c.device_bytes, c.seconds, c.numerics.total + (1e-12 if c.numerics.unmeasured else 0))


def _dominates(a: Any, b: Any) -> bool:
    return all(x <= y for x, y in zip(_costs(a), _costs(b), strict=True)) and _costs(a) != _costs(b)


def test_the_front_is_every_combination_no_other_dominates(gpt2_on_two_nodes: Any) -> None:
    rows = list(gpt2_on_two_nodes.fitting)
    front = pareto_front(rows)
    marked = [c for c in rows if c.pareto]
    assert len(marked) == len(front) > 1
    marked_costs = {_costs(c) for c in marked}
    for c in marked:  # no combination dominates one on the front
        assert not any(_dominates(o, c) for o in rows)
    for c in rows:  # every other is dominated by one on the front, or costs what one does
        if not c.pareto:
            assert _costs(c) in marked_costs or any(_dominates(o, c) for o in marked)


def test_objectives_sort_by_their_cost(gpt2_on_two_nodes: Any) -> None:
    candidates = list(gpt2_on_two_nodes.fitting)
    assert [c.seconds for c in candidates] == sorted(c.seconds for c in candidates)
    by_memory = ranked(candidates, "memory")
    assert [c.device_bytes for c in by_memory] == sorted(c.device_bytes for c in by_memory)
    by_fidelity = ranked(candidates, "fidelity")
    measured = [c.numerics.total for c in by_fidelity if not c.numerics.unmeasured]
    assert measured == sorted(measured) and measured[0] == 0.0
    assert by_fidelity.index(next(c for c in by_fidelity if c.numerics.unmeasured)) > 0


def test_the_drift_figures_are_the_benchmarks() -> None:
    """Each figure copied into numerics.MEASURED is the worst |deviation| in its result file."""
    sources = {
        "master_tradeoff": ("variant", "deviation from fp32"),
        "wire_drift": ("wire across groups", "held-out loss rel deviation"),
        "fp8_fidelity": ("compute", "held-out deviation"),
    }
    names = {
        ("master", "fp32 masters of 16-bit params"): "fp32 masters",
        ("master", "bf16"): "bf16 nearest",
        ("master", "bf16_sr"): "bf16 stochastic",
        ("master", "bf16_kahan"): "bf16 kahan",
        ("states", "bf16"): "fp32 masters + bf16 states",
        ("states", "int8"): "fp32 masters + int8 states",
        ("states", "fp8"): "fp32 masters + fp8 states",
        ("states", "fp8/bf16"): "fp32 masters + fp8/bf16 states",
    }
    for (component, value), (figure, source) in MEASURED.items():
        bench = Path(source).name.split("-")[0]
        label, column = sources[bench]
        rows = json.loads((ROOT / source).read_text())["rows"]
        wanted = names.get((component, value), value)
        worst = max(abs(r[column]) for r in rows if r[label] == wanted)
        assert figure == pytest.approx(worst, rel=1e-3), (component, value)
    plain = dict.fromkeys(DIMENSIONS) | {n: d.default_value for n, d in DIMENSIONS.items()}
    assert numerical_cost(plain | {"accum": "fp32", "comm": "fp32"}).total == 0.0


# --- the command line ---------------------------------------------------------------------------


def test_plan_writes_a_config_that_resolves_ok_and_draws_the_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, png = tmp_path / "ds.json", tmp_path / "front.png"
    argv = ["plan", "--model", str(GPT2), "--gpus", "16", "--gpu-memory", "24GB", "--seq", "512",
            "--top", "5", "--write", str(config), "--quiet"]  # fmt: skip
    pytest.importorskip("matplotlib")
    assert main([*argv, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ranked by time" in out and "| 1 |" in out and "| 6 |" not in out
    plan = dtypeplan.resolve(str(config))
    assert plan.status == "OK"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_exits_1_with_the_closest_when_nothing_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", str(LLAMA70B), "--gpus", "1", "--gpu-memory", "24GB",
            "--host-memory", "256GB", "--quiet"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "no combination fits. The closest:" in out and "device" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpus", "8", "--gpu-memory", "80GB"],  # no model
        ["--params", "7B", "--model", str(GPT2), "--gpus", "8", "--gpu-memory", "80GB"],
        ["--params", "7B", "--gpus", "8", "--gpu-memory", "eighty"],
        ["--params", "7B", "--gpus", "12", "--gpu-memory", "80GB"],  # not whole nodes
        ["--params", "7B", "--gpus", "8", "--gpu-memory", "80GB", "--optimizer", "Adamm"],
        ["--model", "/nonexistent/config.json", "--gpus", "8", "--gpu-memory", "80GB"],
        ["--params", "7B", "--gpus", "8", "--gpu-memory", "80GB", "--inter-node", "50GB"],
    ],
)
def test_plan_exits_2_on_bad_input(argv: list[str]) -> None:
    assert main(["plan", *argv, "--quiet"]) == 2


def test_70b_on_1024_gpus_plans_in_seconds() -> None:
    """The issue's budget is 5 s; this bound (CPU time of the call, the machine shared) only
    catches a regression of an order of magnitude."""
    started = time.process_time()
    planning = plan_for(LLAMA70B, Fleet(gpus=1024, **H100), seq=4096)
    elapsed = time.process_time() - started
    assert planning.fitting and planning.ok_points > 100_000
    assert elapsed < 15, elapsed


# --- on 2 gloo ranks ----------------------------------------------------------------------------

WIDTH = 128


def train_case(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """A few steps of the chosen config on the memory tests' model: the losses."""
    torch.manual_seed(0)
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(memory_mlp(WIDTH))
    optimizer = plan.build(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(16, WIDTH, generator=generator)
    target = torch.randn(16, WIDTH, generator=generator) * 0.1
    losses = []
    for _ in range(8):
        loss = (model(x.to(plan.param_dtype)).float() - target).square().mean()
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"status": str(plan.status), "losses": losses}


def planned_cases(rank: int, world_size: int, configs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "memory": memory_cases(rank, world_size, configs, WIDTH),
        "traffic": traffic_cases(
            rank, world_size, [{"config": c, "micro_batches": 1, "width": WIDTH} for c in configs]
        ),
        "train": [train_case(rank, world_size, c) for c in configs],
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_chosen_configs_hold_send_and_train_as_planned(world: int) -> None:
    """The top combination of each objective for the memory tests' MLP on 2 and 4 ranks (ZeRO 0-2:
    what the flat engine runs on gloo): the bytes held at the accumulation boundary within
    10% of the planner's model states (bucket padding), the bytes each rank sends equal to the
    planner's traffic for the padded size, and a few steps that lower the loss."""
    with torch.device("meta"):
        model = memory_mlp(WIDTH)
    fleet = Fleet(gpus=world, gpu_memory=1e9, gpus_per_node=world)
    chosen = []
    for objective in ("time", "memory", "fidelity"):
        planning = plan_for(model, fleet, seq=16, objective=objective)
        best = next(
            c
            for c in planning.fitting
            if c.values["stage"] < 3 and c.values["offload_optimizer"] == "none"
            and not c.values["fp8"] and c.values["autocast"] == "none"
        )  # fmt: skip
        chosen.append((best, planning.config(best)))
    configs = [config for _, config in chosen]
    results = spawn(planned_cases, world, configs, timeout_s=600)
    for rank_result in results:
        for (candidate, config), memory, traffic, train in zip(
            chosen, rank_result["memory"], rank_result["traffic"], rank_result["train"],
            strict=True,
        ):  # fmt: skip
            predicted = dict(candidate.memory)
            plan = dtypeplan.resolve(config)
            sizes = [p.numel() for p in model.parameters()]
            assert plan.memory(sum(sizes), world, param_numels=sizes) == predicted, config
            for key in ("params", "accumulator", "master", "total"):
                measured = memory["at_boundary"][key]
                expected = predicted[key] - (predicted["optimizer_states"] if key == "total" else 0)
                assert abs(measured - expected) <= 0.1 * expected + 1024, (key, config)
            assert dict(plan.traffic(traffic["padded"], world).within) == traffic["bytes_sent"]
            assert plan.traffic(traffic["num_params"], world) == candidate.traffic
            assert train["status"] == "OK"
            assert train["losses"][-1] < train["losses"][0], (config, train["losses"])
