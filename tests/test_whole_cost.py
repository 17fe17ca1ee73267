"""plan.memory() and plan.traffic() of the owners' whole-tensor layout (Muon, Adafactor,
DeepSpeed's Muon), against what the ranks really hold and send.

Spawned on gloo, each case trains a small model three steps. The second step's collectives are
counted from the ops themselves (a dispatch mode sees every c10d and functional collective, as
FSDP2, DTensor and the optimizer's own ``dist.reduce`` / ``dist.broadcast`` run them), each
counted as ``CommStats`` counts them: a ring all-gather or reduce-scatter of ``n`` bytes over
``g`` ranks ``n * (g - 1) // g``, an all-reduce twice that, a reduce to one rank and a
broadcast from one rank as their ring sends them, ``n * (g - 1) // g``. Any other collective
fails the case. At the third step's accumulation boundary (after backward, before ``step()``)
each rank's ``optimizer.held_tensors()`` is measured: the largest rank's figures are
``plan.memory()``'s, byte for byte.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.launch import spawn
from dtypeplan.muon import MuonWithAuxAdamW
from dtypeplan.optimizers.whole.low_precision import SIGNED
from dtypeplan.optimizers.whole.owners import assign_owners
from dtypeplan.resolver import _optimizer_kind as kinds
from dtypeplan.resolver._optimizer_kind import SIGNED_WHOLE_STATES, whole_states
from dtypeplan.resolver._owners import owner_ranks

VOCAB, TOKENS = 16, 3


class Net(torch.nn.Module):
    """An embedding and two linear layers; ``widths``' first entry is the embedding's width.
    DeepSpeed's Muon gives ``embed`` to AdamW by its name, the matrices to Muon."""

    def __init__(self, widths: list[int], bias: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, widths[0])
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b, bias=bias) for a, b in itertools.pairwise(widths)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _plan(case: dict[str, Any]) -> dtypeplan.PrecisionPlan:
    plan = dtypeplan.resolve(case["config"])
    if case.get("torch_muon"):
        plan = plan.with_optimizer(torch.optim.Muon, {"lr": 0.02})
    assert plan.status == "OK" and plan.implementation == "whole", plan.explain()
    return plan


def _ring(nbytes: int, group: int) -> int:
    return nbytes * (group - 1) // group


def _ranks_of(name: str, args: Any) -> tuple[int, ...]:
    """The global ranks of the group a collective runs on (a c10d op's process group
    argument; a functional collective's group name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if name.startswith("_c10d_functional"):
        group = _resolve_process_group(args[2])
    else:
        boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
        group = dist.ProcessGroup.unbox(boxed)
    return tuple(dist.get_process_group_ranks(group))


def _counting(sent: dict[str, int], shard_group_size: int | None) -> Any:
    """Counts each collective's bytes by op, over its group's ranks; a collective on a replica
    group (across the shard groups) as ``across <op>``, the rest (the shard group, the whole
    group) as ``<op>``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rank, world = dist.get_rank(), dist.get_world_size()
    size = shard_group_size or world
    shard = tuple(range(rank - rank % size, rank - rank % size + size))

    def nbytes(tensors: Any) -> int:
        if torch.is_tensor(tensors):
            return tensors.numel() * tensors.element_size()
        return sum(t.numel() * t.element_size() for t in tensors)

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            name = str(func)
            counted = name.startswith(("c10d.", "_c10d_functional.all_gather_into_tensor"))
            ranks = _ranks_of(name, args) if counted else ()
            g = len(ranks)
            level = "" if len(ranks) == world or ranks == shard else "across "
            if name.startswith("c10d.allreduce_"):
                sent[level + "all_reduce"] += 2 * _ring(nbytes(args[0]), g)
            elif name.startswith(("c10d.reduce_.", "c10d.broadcast_.")):
                sent[level + name.split(".")[1].rstrip("_")] += _ring(nbytes(args[0]), g)
            elif name.startswith("c10d._allgather_base_"):
                sent[level + "all_gather"] += _ring(nbytes(args[0]), g)
            elif name.startswith("c10d._reduce_scatter_base_"):
                sent[level + "reduce_scatter"] += _ring(nbytes(args[1]), g)
            elif name.startswith("_c10d_functional.all_gather_into_tensor"):
                sent[level + "all_gather"] += _ring(nbytes(args[0]) * args[1], g)
            elif func.namespace in ("c10d", "_c10d_functional") and not name.startswith(
                ("_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd")
            ):
                sent[f"uncounted {name}"] += 1
            return func(*args, **(kwargs or {}))

    return Counting()


def cost_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    plan = _plan(case)
    net = Net(case["widths"], case["bias"])
    shapes = {name: tuple(p.shape) for name, p in net.named_parameters()}
    model = plan.prepare_model(net)
    optimizer = plan.build(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    sent: dict[str, int] = defaultdict(int)

    def step() -> dict[str, int]:
        for _ in range(case["micro_batches"]):
            tokens = torch.randint(VOCAB, (4, TOKENS), generator=generator)
            optimizer.backward(model(tokens).float().square().mean())
        held = optimizer.held_tensors().nbytes()
        optimizer.step()
        optimizer.zero_grad()
        return held

    step()  # the states are built lazily by the first step
    zero = case["config"]["zero_optimization"]
    with _counting(sent, zero.get("shard_group_size")):
        step()
    return {
        "sent": dict(sent),
        "held": step(),
        "shapes": shapes,
        "owners": list(optimizer.owners.ranks) if optimizer.owners is not None else None,
    }


def cost_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [cost_case(rank, world, case) for case in cases]


def _case(
    optimizer: str,
    stage: int,
    *,
    params: str = "bf16",
    master: dict[str, str] | None = None,
    states: bool = False,
    micro_batches: int = 2,
    widths: list[int] | None = None,
    shard_group_size: int | None = None,
) -> dict[str, Any]:
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if shard_group_size is not None:
        config["zero_optimization"]["shard_group_size"] = shard_group_size
    if params == "bf16":
        config["bf16"] = {"enabled": True, "bf16_optimizer_states": states}
    if master is not None:
        config["master_weights"] = master
    torch_muon = optimizer == "torch.optim.Muon"
    if not torch_muon:
        config["optimizer"] = {"type": optimizer, "params": {"lr": 1e-3}}
    return {
        "config": config,
        "torch_muon": torch_muon,
        "bias": not torch_muon,  # torch's Muon takes 2-D parameters only
        "widths": widths or [8, 12, 8],
        "micro_batches": micro_batches,
    }


OPTIMIZERS = ("Adafactor", "torch.optim.Muon", "Muon")


def _default_cases() -> list[dict[str, Any]]:
    cases = [_case(o, stage) for o, stage in itertools.product(OPTIMIZERS, (0, 1, 2, 3))]
    cases += [
        _case("Adafactor", 1, params="fp32", micro_batches=1),
        _case("Muon", 2, master={"dtype": "bf16", "rounding": "kahan"}),
        _case("Adafactor", 2, master={"dtype": "bf16", "rounding": "stochastic"}, states=True),
        _case("torch.optim.Muon", 1, states=True, micro_batches=3),
        # FSDP2's shards of a first dimension the ranks do not divide (5 rows on 2 ranks).
        _case("Adafactor", 3, widths=[8, 5, 8]),
    ]
    return cases


def _check(case: dict[str, Any], results: list[dict[str, Any]], world: int) -> None:
    plan = _plan(case)
    shapes = results[0]["shapes"]
    numels = [torch.Size(s).numel() for s in shapes.values()]
    n = sum(numels)
    predicted = plan.memory(n, world, param_shapes=shapes)
    held = [dict(r["held"]) for r in results]
    largest = max(held, key=lambda figures: figures["total"])
    assert predicted == largest, (case, predicted, held)
    assert all(figures["total"] <= predicted["total"] for figures in held)
    uneven = any(s and s[0] % world for s in shapes.values())
    if plan.zero_stage == 3 and uneven:
        return  # FSDP2 pads each collective of an uneven shard: traffic() counts unpadded sizes
    traffic = plan.traffic(n, world, micro_batches=case["micro_batches"], param_numels=numels)
    across: dict[str, list[int]] = defaultdict(list)
    for result in results:
        within = {op: b for op, b in result["sent"].items() if not op.startswith("across ")}
        assert within == dict(traffic.within), (case, result["sent"], traffic.within)
        for op, sent in result["sent"].items():
            if op.startswith("across "):
                across[op.removeprefix("across ")].append(sent)
    # Across the shard groups only the owners of a parameter sum it: the busiest rank's bytes.
    assert {op: max(sent) for op, sent in across.items()} == dict(traffic.across), (
        case,
        dict(across),
        traffic.across,
    )


def _deepspeed_muon_at_zero3(case: dict[str, Any]) -> bool:
    """DeepSpeed's Muon at ZeRO-3, where FSDP2 replaces the parameters that ``prepare_model``
    tagged ``use_muon``: the tags must reach the sharded ones (they were lost once, and
    ``embed.weight`` took Muon's momentum, not AdamW's two moments)."""
    optimizer = case["config"].get("optimizer", {}).get("type")
    return optimizer == "Muon" and case["config"]["zero_optimization"]["stage"] == 3


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    cases = _default_cases()
    per_rank = spawn(cost_cases, 2, cases, timeout_s=300)
    return [(case, list(results)) for case, *results in zip(cases, *per_rank, strict=True)]


def test_memory_and_traffic_equal_what_two_ranks_hold_and_send(two_ranks: Any) -> None:
    for case, results in two_ranks:
        if not _deepspeed_muon_at_zero3(case):
            _check(case, results, 2)


def test_deepspeed_muon_at_zero3_keeps_adamw_for_the_embedding(two_ranks: Any) -> None:
    for case, results in two_ranks:
        if _deepspeed_muon_at_zero3(case):
            _check(case, results, 2)


def _slow_cases() -> list[dict[str, Any]]:
    """4 ranks: first dimensions divisible by 4 (FSDP2's collectives unpadded), each class at
    each stage, a whole and a sharded accumulator, bf16 and fp32 parameters."""
    widths = [8, 16, 12, 8]
    cases = [
        _case(o, stage, micro_batches=3, widths=widths)
        for o, stage in itertools.product(OPTIMIZERS, (0, 1, 2, 3))
    ]
    cases += [
        _case("Adafactor", stage, params="fp32", widths=widths, states=False) for stage in (1, 2, 3)
    ]
    cases.append(_case("Muon", 1, master={"dtype": "bf16", "rounding": "kahan"}, widths=widths))
    return cases


@pytest.mark.slow
def test_memory_and_traffic_equal_what_four_ranks_hold_and_send() -> None:
    cases = _slow_cases()
    per_rank = spawn(cost_cases, 4, cases, timeout_s=600)
    for case, *results in zip(cases, *per_rank, strict=True):
        if not _deepspeed_muon_at_zero3(case):
            _check(case, list(results), 4)


def _shard_group_cases() -> list[dict[str, Any]]:
    """Shard groups of 2 on 4 ranks (first dimensions divisible by 2: FSDP2's HSDP shards
    unpadded): each class at ZeRO 1 to 3, a whole and a sharded accumulator, 16-bit masters."""
    widths = [8, 16, 12, 8]
    cases = [
        _case(o, stage, micro_batches=3, widths=widths, shard_group_size=2)
        for o, stage in itertools.product(OPTIMIZERS, (1, 2, 3))
    ]
    cases.append(
        _case("Adafactor", 1, params="fp32", micro_batches=1, widths=widths, shard_group_size=2)
    )
    cases.append(
        _case(
            "Muon",
            2,
            master={"dtype": "bf16", "rounding": "kahan"},
            widths=widths,
            shard_group_size=2,
        )
    )
    return cases


@pytest.mark.slow
def test_memory_and_traffic_in_shard_groups_equal_what_four_ranks_hold_and_send() -> None:
    """Each parameter owned in each shard group: the reduce to the owner and the broadcast
    back within the group, the owners' sum across (ZeRO-3: FSDP2's HSDP all-reduce). A 4-rank
    group costs most of its time in starting (the cases take seconds): slow, with the model's
    shape checked in the default run below."""
    cases = _shard_group_cases()
    per_rank = spawn(cost_cases, 4, cases, timeout_s=400)
    for case, *results in zip(cases, *per_rank, strict=True):
        _check(case, list(results), 4)
        assert any(r["sent"].get("across all_reduce") for r in results), case


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_groups_cost_what_the_flat_layout_on_one_group_does(stage: int) -> None:
    """In shard groups of S each rank holds and sends within its group what the flat layout on
    S ranks would (the flags and the norm still span the W ranks); across, the owners' sum of
    each parameter (ZeRO 1-2: the busiest owner's) or FSDP2's HSDP all-reduce (ZeRO-3)."""
    shapes = {"embed.weight": (16, 8), "a.weight": (16, 8), "a.bias": (16,), "b.weight": (4, 16)}
    numels = [torch.Size(s).numel() for s in shapes.values()]
    n, k = sum(numels), 3
    flat = _owner_plan("Muon", stage)
    grouped = dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "shard_group_size": 2},
            "optimizer": {"type": "Muon", "params": {"lr": 1e-3}},
        }
    )
    assert grouped.memory(n, 8, param_shapes=shapes) == flat.memory(n, 2, param_shapes=shapes)
    on_two = flat.traffic(n, 2, micro_batches=k, param_numels=numels)
    traffic = grouped.traffic(n, 8, micro_batches=k, param_numels=numels)
    assert traffic.shard_group_size == 2 and traffic.hybrid
    flags_and_norm = 2 * _ring(4 * len(numels), 8) + 2 * _ring(4, 8)
    assert traffic.within["all_reduce"] == flags_and_norm
    assert {op: b for op, b in traffic.within.items() if op != "all_reduce"} == {
        op: b for op, b in on_two.within.items() if op != "all_reduce"
    }
    if stage < 3:
        owners = owner_ranks(numels, 2)
        busiest = max(
            sum(2 * _ring(4 * m, 4) for o, m in zip(owners, numels, strict=True) if o == r)
            for r in (0, 1)
        )
        assert dict(traffic.across) == {"all_reduce": busiest}
    else:
        assert dict(traffic.across) == {"all_reduce": k * 2 * _ring(4 * n // 2, 4)}
    with pytest.raises(NotSupportedError, match="across_groups bf16"):
        dtypeplan.resolve(
            {
                "zero_optimization": {"stage": stage, "shard_group_size": 2},
                "communication_data_type_across_groups": "bf16",
                "optimizer": {"type": "Muon"},
            }
        ).traffic(n, 8, param_numels=numels)


# --- one process: the model's facts against torch's own ---------------------------------------
def _least_loaded_first(sizes: list[int], world: int) -> tuple[int, ...]:
    """The rule as written (a scan of every rank per parameter), apart from the heap."""
    owned = [0] * world
    ranks = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (owned[r], r))
        ranks[index] = rank
        owned[rank] += sizes[index]
    return tuple(ranks)


def test_the_owners_are_the_largest_first_rule() -> None:
    """resolver/_owners.py's heap (which optimizers/whole/owners.py uses too) assigns as the
    rule's scan does, ties and empty ranks included."""
    rng = random.Random(0)
    for _ in range(300):
        sizes = [
            rng.choice([1, 3, 64, 64, 4096, rng.randrange(1, 5000)])
            for _ in range(rng.randrange(0, 40))
        ]
        world = rng.randrange(1, 9)
        expected = _least_loaded_first(sizes, world)
        assert owner_ranks(sizes, world) == expected, (sizes, world)
        assert assign_owners(sizes, world).ranks == expected, (sizes, world)


def test_signed_states_are_the_optimizers() -> None:
    assert SIGNED_WHOLE_STATES == SIGNED


@pytest.mark.parametrize("torch_class", [torch.optim.Adafactor, torch.optim.Muon, MuonWithAuxAdamW])
def test_whole_states_are_the_states_torch_creates(torch_class: type) -> None:
    """Each shape's states, by name and size, and the bytes of the 0-dim ones, as one real step
    of the class creates them."""
    shapes = [(5, 3), (3, 7), (7,), (2, 3, 4), ()]
    if torch_class is torch.optim.Muon:
        shapes = [(5, 3), (3, 7)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    muon = [len(s) == 2 and i != 0 for i, s in enumerate(shapes)]  # the first: an "embed"
    for param, tag in zip(params, muon, strict=True):
        param.use_muon = tag  # type: ignore[attr-defined]
        param.grad = torch.randn_like(param)
    optimizer = torch_class(params, lr=1e-3)
    optimizer.step()
    for param, shape, tag in zip(params, shapes, muon, strict=True):
        state = optimizer.state[param]
        expected = whole_states(torch_class, shape, tag)
        per_element = {k: v.numel() for k, v in state.items() if torch.is_tensor(v) and v.dim()}
        scalars = sum(
            v.numel() * v.element_size()
            for v in state.values()
            if torch.is_tensor(v) and not v.dim()
        )
        assert per_element == dict(expected.values), (torch_class, shape)
        assert scalars == expected.scalar_bytes, (torch_class, shape)


def _owner_plan(optimizer: str = "Adafactor", stage: int = 2) -> dtypeplan.PrecisionPlan:
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    return dtypeplan.resolve({**config, "optimizer": {"type": optimizer, "params": {"lr": 1e-3}}})


def test_the_figures_need_the_models_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the shapes (memory) or the sizes (traffic) no figure would be true: the error
    names the argument; DeepSpeed's Muon needs the names too; a shape torch's Muon refuses and
    a registered class whose states are unknown are NotSupported."""
    plan = _owner_plan()
    with pytest.raises(PrecisionConfigError, match="param_shapes"):
        plan.memory(100, 2)
    with pytest.raises(PrecisionConfigError, match="param_numels"):
        plan.traffic(100, 2)
    with pytest.raises(ValueError, match="num_params"):
        plan.memory(99, 2, param_shapes=[(10, 10)])
    with pytest.raises(PrecisionConfigError, match="by name"):
        _owner_plan("Muon").memory(100, 2, param_shapes=[(10, 10)])
    named = _owner_plan("Muon").memory(100, 2, param_shapes={"embed.weight": (10, 10)})
    assert named["optimizer_states"] == 2 * 4 * 100 + 4  # AdamW for the embedding
    torch_muon = plan.with_optimizer(torch.optim.Muon, {"lr": 0.02})
    with pytest.raises(NotSupportedError, match="2-D"):
        torch_muon.memory(110, 2, param_shapes=[(10, 10), (10,)])

    class Mine(torch.optim.SGD):
        pass

    monkeypatch.setattr(kinds, "_REGISTERED", dict(kinds._REGISTERED))  # restored after
    dtypeplan.register_optimizer(Mine, kind="whole")
    with pytest.raises(NotSupportedError, match="not known"):
        plan.with_optimizer(Mine, {"lr": 0.1}).memory(100, 2, param_shapes=[(10, 10)])


def test_the_flat_layouts_figures_are_not_given_for_an_owner_plan() -> None:
    """Before, plan.traffic() answered an owner plan with the flat layout's reduce-scatter and
    all-gather: now its own collectives (a reduce to each owner, a broadcast back)."""
    plan = _owner_plan(stage=1)
    traffic = plan.traffic(300, 4, param_numels=[100, 200])
    assert set(traffic.within) == {"all_reduce", "reduce", "broadcast"}
    assert traffic.within["broadcast"] == 2 * 300 * 3 // 4


# --- the planner ---------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["Muon", pytest.param("Adafactor", marks=pytest.mark.slow)])
def test_the_planner_costs_the_owners_layout_as_the_plans_do(optimizer: str) -> None:
    """DeepSpeed's Muon and Adafactor on GPT-2 (its shapes from the config's formula, checked
    against the class in tests/test_planner.py) on 16 GPUs: every combination's memory and
    traffic equal plan.memory() / plan.traffic() of the config the planner writes; ZeRO-3's
    figures are the owners' (each rank holds its whole masters and states), not ZeRO's 1/W."""
    from dtypeplan.planner import Fleet, plan_for
    from tests.test_planner import GPT2

    fleet = Fleet(gpus=16, gpu_memory=24e9, gpus_per_node=8)
    planning = plan_for(GPT2, fleet, optimizer=optimizer, seq=256, micro_batches=2, resolve_top=1)
    sizes = planning.sizes
    everything = [*planning.fitting, *planning.rejected]
    assert {0, 1, 3} <= {c.values["stage"] for c in everything}  # 2 costs as 1 sharded
    for candidate in everything:
        plan = dtypeplan.resolve(planning.config(candidate))
        assert plan.status == "OK" and plan.implementation == "whole", candidate.values
        memory = plan.memory(sizes.num_params, 16, param_shapes=sizes.named_shapes)
        assert memory == dict(candidate.memory), candidate.values
        traffic = plan.traffic(sizes.num_params, 16, param_numels=sizes.param_numels)
        assert traffic == candidate.traffic, candidate.values
