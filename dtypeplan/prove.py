"""Proving a rules file the way the shipped table is proven (``dtypeplan lint --prove [RULES]``).

The loader proves a rules file well formed: every point decided by one rule, every
implementation registered. It cannot prove that an OK rule's implementation computes what the
rule claims. :func:`prove` does, by training: for each OK rule it finds points the rule decides
(:func:`sample`: its first point, one for each value it matches, and in a file other than the
shipped one the first point the file adds), resolves the config written for each with the
rules file, builds the plan's optimizer and trains a small model :data:`STEPS` steps on one
process and on 2 gloo ranks (CPU), against plain fp32 ``torch.optim`` (the plan's optimizer
class and hyperparameters) on the whole batch. A point passes when every step's loss and the
final master weights are within the bound of the plan's dtypes (:func:`bound`) on both; it is
skipped, not passed, where this machine cannot run it (:data:`NEEDS`).

Both runs are spawned process groups (``dtypeplan.launch.spawn``, one of 1 rank, one of 2), so
that implementations which need a process group (FSDP2) run in "one process" too; the modules
given as ``imports`` are imported in every rank first (the implementations a user's rules file
names are registered there).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import itertools
import math
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dtypeplan.resolver import PrecisionPlan, Rule, RuleTable, Status
from dtypeplan.resolver._dimensions import CORE_DIMENSIONS, DIMENSIONS, config_for, value_text

__all__ = ["NEEDS", "Outcome", "Sample", "bound", "prove", "sample", "summary"]

STEPS = 3
LR = 1e-2
WEIGHT_RMS = 0.3
"""The model's weights are N(0, WEIGHT_RMS**2): what the update-side bound is relative to."""
WIDTHS = (32, 64, 64, 32)
"""The MLP's layer widths: multiples of 32, so that fp8 compute (MXFP8 too) converts every
layer."""
MICRO_BATCHES, PER_MICRO_BATCH = 2, 32
"""32 rows a micro-batch: MXFP8 scales the weight gradient per 32 tokens."""
RANKS = (1, 2)
MAX_TRIES = 5000
"""How many points of a rule's box are tried for one that the rule decides (the table's lookup)
and that the config written for it reaches on this machine."""
COVER_TRIES = 3000
"""The same, for a point with a given value of one dimension (see :func:`sample`)."""

NEEDS: dict[tuple[str, Any], str] = {
    ("fp8_execution", "native"): "fp8 execution native needs a device with the recipe's fp8 "
    "kernels (SM89+, MXFP8 SM100+); the proof runs on CPU",
    ("offload_optimizer", "nvme"): "offload to nvme needs an NVMe path",
    ("offload_param", "nvme"): "offload to nvme needs an NVMe path",
}
"""(dimension, value) -> why this machine cannot train a point with it: the search passes such
points by, and a rule with no other point is skipped with the reason."""

GROUP_NEEDS: dict[tuple[str, Any], tuple[int, str]] = {
    ("hierarchical_partitioning", True): (2, "hpZ's secondary groups need 2 ranks or more"),
}
"""(dimension, value) -> the fewest ranks a point with it runs on, and why: a run on fewer is
skipped (the others prove the rule)."""

# --- the bound ------------------------------------------------------------------------------
FLOOR = 1e-5
"""fp32 throughout: the same math in another order (flat chunks, sums across ranks, fused
kernels); the suite's fp32 parity bound."""
UNIT_ROUNDOFF = {
    torch.float32: 0.0,
    torch.bfloat16: 2.0**-9,
    torch.float16: 2.0**-11,
}
E4M3 = 2.0**-4  # 3 mantissa bits: fp8 compute operands, fp8 states, an fp8 wire
FP8_COMPUTE = E4M3 / math.sqrt(WIDTHS[0])
"""fp8 compute rounds each matmul operand to e4m3 (2**-4, relative); a dot product of K such
products (K >= WIDTHS[0] here) sums independent roundings, its relative error shrinking as
1/sqrt(K)."""
INT8_WIRE = 2.0**-8  # blockwise absmax int8 codes: half a step of 1/127 of the block's absmax
STATE_EPS = {"fp32": 0.0, "bf16": 2.0**-9, "fp16": 2.0**-11, "fp8": E4M3}
"""Per stored moment, relative; int8 is torchao's dynamic tree map (half the widest gap between
neighbouring codes above 1e-2 of the block's absmax): 12.3% signed, 6.6% unsigned."""
INT8_STATE_EPS = {"signed": 0.123, "unsigned": 0.066}
GRADIENT_GAIN = 4.0
"""A relative gradient error's effect on the result per step, over the unit roundoff. Adam's
first steps are close to ``lr * sign(g)``, so an element whose gradient a rounding flips moves
by 2 lr, whatever the rounding's size. Measured on this model (AdamW, lr 1e-2, 3 steps): bf16
autocast (2**-9 on the gradient side) 3.8e-3, a gain of 0.65; 4 leaves a factor of 6 for other
draws. With bf16 parameters that is 2.3e-2 over 3 steps, the suite's low-precision bound."""
UPDATE_GAIN = 2 * LR / WEIGHT_RMS
"""A relative error of a stored moment moves a weight by at most lr * eps * |u|, |u| <= 2, over
the weights' RMS (tests/test_optimizer_states.py's derivation)."""


def bound(plan: PrecisionPlan, steps: int = STEPS) -> float:
    """The largest relative error (each step's loss, the final masters) a correct
    implementation of ``plan`` shows against fp32 ``torch.optim`` after ``steps`` steps.

    Per step: the gradient side (the compute dtype, fp8 compute, the accumulator, the wire,
    quantized or across shard groups) times :data:`GRADIENT_GAIN`; the stored moments and the
    update's own arithmetic (Muon's bf16 Newton-Schulz) times :data:`UPDATE_GAIN`; a 16-bit
    master's rounding (twice the unit roundoff: stochastic rounding moves an element by up to
    one ulp). At least :data:`FLOOR`."""
    compute = plan.autocast_dtype if plan.autocast_dtype is not None else plan.param_dtype
    gradient = [
        UNIT_ROUNDOFF[compute],
        UNIT_ROUNDOFF[plan.grad_accum_dtype],
        UNIT_ROUNDOFF[plan.comm_dtype],
        FP8_COMPUTE if plan.fp8 else 0.0,
        INT8_WIRE if plan.quantized_communication != "none" else 0.0,
        _wire_eps(plan.wire_across_groups),
    ]
    states = [
        _state_eps(plan.exp_avg_dtype, signed=True),
        _state_eps(plan.exp_avg_sq_dtype, signed=False),
        UNIT_ROUNDOFF[plan.optimizer.update_dtype],
    ]
    master = 2 * UNIT_ROUNDOFF[plan.master_dtype]
    per_step = GRADIENT_GAIN * sum(gradient) + UPDATE_GAIN * sum(states) + master
    return max(FLOOR, steps * per_step)


def _wire_eps(wire: str | None) -> float:
    if wire in (None, "fp32"):
        return 0.0
    return {"bf16": 2.0**-9, "fp16": 2.0**-11, "fp8": E4M3, "int8": INT8_WIRE}[wire]


def _state_eps(dtype: str, *, signed: bool) -> float:
    if dtype == "int8":
        return INT8_STATE_EPS["signed" if signed else "unsigned"]
    return STATE_EPS[dtype]


# --- a rule's sample point ------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """A point an OK rule decides, and the config that selects it."""

    rule_id: str
    point: dict[str, Any]
    config: dict[str, Any]
    pipeline: bool
    skip: str | None = None
    """Why this machine cannot train it (None: it can)."""
    added: bool = False
    """A point the shipped table does not run: a combination the rules file adds."""

    def too_few(self, world: int) -> str | None:
        """Why a group of ``world`` ranks cannot run this point (None: it can)."""
        for (name, value), (fewest, why) in GROUP_NEEDS.items():
            if self.point.get(name) == value and world < fewest:
                return why
        return None

    def text(self) -> str:
        """The point as ``dim=value``: the core dimensions, and the features in use."""
        shown = [
            f"{name}={value_text(value)}"
            for name, value in self.point.items()
            if _means(name, self.point)
            and (name in CORE_DIMENSIONS or value != DIMENSIONS[name].default_value)
        ]
        return " ".join(shown)


def _decides(rule: Rule, decided_id: str) -> bool:
    """Whether a lookup's rule id is ``rule``'s own decision (itself, or its deferral)."""
    return decided_id == rule.id or decided_id.startswith(f"{rule.id}+")


def _candidates(rule: Rule, fixed: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """The points of ``rule``'s box (``fixed``: those with these values), fewest dimensions off
    their first value first (values in the dimension's order, those of :data:`NEEDS` last)."""
    fixed = fixed or {}
    # The values this machine cannot train last (fp8 execution native: emulated first).
    choices = [
        [fixed[name]] if name in fixed else _runnable_first(name, rule.matched_values(name))
        for name in DIMENSIONS
    ]
    names = list(DIMENSIONS)
    first = {name: values[0] for name, values in zip(names, choices, strict=True)}
    varied = [i for i, values in enumerate(choices) if len(values) > 1]
    for count in range(len(varied) + 1):
        for positions in itertools.combinations(varied, count):
            for values in itertools.product(*(choices[i][1:] for i in positions)):
                yield {**first, **{names[i]: v for i, v in zip(positions, values, strict=True)}}


def _runnable_first(name: str, values: list[Any]) -> list[Any]:
    return sorted(values, key=lambda value: (name, value) in NEEDS)


def _means(name: str, point: dict[str, Any]) -> bool:
    """Whether dimension ``name`` means something at ``point`` (fp8's own dimensions only
    with fp8 on)."""
    return all(point[other] == value for other, value in DIMENSIONS[name].requires.items())


def config_of(point: dict[str, Any]) -> dict[str, Any]:
    """The config a user writes for ``point``, with what the proof needs: the optimizer at
    :data:`LR`, small buckets (the model spans several), shard groups of one rank (two groups
    on two ranks, so the wire across them carries the sums), an fp16 loss scale that does not
    overflow in the first steps (a skipped step is correct, but another trajectory)."""
    chosen = {
        name: value
        for name, value in point.items()
        if name != "pipeline"
        and _means(name, point)
        and (name in CORE_DIMENSIONS or value != DIMENSIONS[name].default_value)
    }
    config = config_for(chosen)
    optimizer = config.get("optimizer", {"type": "AdamW"})
    config["optimizer"] = {"type": optimizer["type"], "params": {"lr": LR}}
    zero = config.setdefault("zero_optimization", {})
    zero["reduce_bucket_size"] = 700
    if zero.get("shard_group_size"):
        zero["shard_group_size"] = 1
    if zero.get("zero_hpz_partition_size", 1) > 1:
        zero["zero_hpz_partition_size"] = 2  # the two-rank group (config_for writes a node's 8)
    if point["params"] == "fp16" or point.get("autocast") == "fp16":
        config["fp16"] = {**config.get("fp16", {}), "initial_scale_power": 4}
    return config


def sample(
    table: RuleTable,
    rule: Rule,
    resolve: Callable[[dict[str, Any], bool], PrecisionPlan],
    baseline: RuleTable | None = None,
    *,
    each_value: bool = True,
) -> list[Sample]:
    """The points of OK ``rule`` to train (``resolve(config, pipeline)`` resolves with the same
    rules file), each decided OK by it and with a config that resolves to it here: its first
    point; with ``each_value``, the first point with each value the rule matches that no
    point before has (a rule of the grid spans many cells: each master, states, autocast,
    layout ... value is trained at least once, not each combination of them); and, given
    ``baseline`` (the shipped table), the first point that ``baseline`` does not run (a
    combination the file adds: where a broad rule took over a narrowed refusal, its other
    points would not reach it). A point this machine cannot train comes back skipped with the
    reason."""
    first = _search(table, rule, resolve)
    assert first is not None, "the first search takes any point"
    chosen = [first]
    for name in DIMENSIONS if each_value else ():
        for value in rule.matched_values(name):
            if any(one.point.get(name) == value for one in chosen):
                continue
            found = _search(
                table, rule, resolve, functools.partial(_means, name), {name: value}, COVER_TRIES
            )
            if found is not None and all(found.point != one.point for one in chosen):
                chosen.append(found)
    if baseline is None:
        return chosen
    added = _search(table, rule, resolve, lambda point: baseline.lookup(point).status != Status.OK)
    if added is None:
        return chosen
    same = [i for i, one in enumerate(chosen) if one.point == added.point]
    if same:
        chosen[same[0]] = dataclasses.replace(chosen[same[0]], added=True)
        return chosen
    return [*chosen, dataclasses.replace(added, added=True)]


def _search(
    table: RuleTable,
    rule: Rule,
    resolve: Callable[[dict[str, Any], bool], PrecisionPlan],
    wanted: Callable[[dict[str, Any]], bool] | None = None,
    fixed: dict[str, Any] | None = None,
    tries_at_most: int = MAX_TRIES,
) -> Sample | None:
    """The first point of ``rule``'s box (:func:`_candidates`) that is ``wanted``, decided OK
    by the rule and resolved to it here; skipped with the reason where only points this machine
    cannot train are; None where none is ``wanted`` (a search for any point says so, skipped)."""
    reason = None
    first: dict[str, Any] | None = None
    for tries, point in enumerate(_candidates(rule, fixed)):
        if tries >= tries_at_most:
            break
        decided = table.lookup(point)
        if decided.status != Status.OK or not _decides(rule, decided.id):
            continue  # another rule's point, or a deferral that refuses it
        if wanted is not None and not wanted(point):
            continue
        first = first or point
        needs = [NEEDS[(n, v)] for n, v in point.items() if (n, v) in NEEDS and _means(n, point)]
        if needs:
            reason = reason or "; ".join(needs)
            continue
        config = config_of(point)
        plan = resolve(config, point["pipeline"])
        if plan.status == Status.OK and _decides(rule, plan.rule_id):
            return Sample(rule.id, point, config, point["pipeline"])
        shown = Sample(rule.id, point, {}, False).text()
        reason = reason or f"the config of [{shown}] resolves to {plan.rule_id} here"
    if first is not None:
        return Sample(rule.id, first, {}, first["pipeline"], skip=reason)
    if wanted is not None:
        return None
    reason = f"none of the first {MAX_TRIES} points of its box is an OK point it decides"
    return Sample(rule.id, {}, {}, False, skip=reason)


# --- training -------------------------------------------------------------------------------
def _model(seed: int) -> torch.nn.Module:
    """A tanh MLP of :data:`WIDTHS` with seeded N(0, WEIGHT_RMS**2) weights, the same on every
    rank."""
    generator = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for width_in, width_out in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_RMS)
    return model


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(size, WIDTHS[0], generator=generator),
        torch.randn(size, WIDTHS[-1], generator=generator),
    )


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def train(sample: Sample, rules: str | None, rank: int, world: int) -> dict[str, Any]:
    """:data:`STEPS` steps of ``sample``'s plan on this rank's slice of each batch, in
    micro-batches, against the plan's ``torch.optim`` class in fp32 on the whole batch: the
    largest relative error (a step's loss, the final masters) and the plan's bound."""
    import torch.distributed as dist

    from dtypeplan import resolve

    plan = resolve(sample.config, pipeline_parallel=sample.pipeline, rules=rules)
    reference = _model(0)
    model = plan.prepare_model(copy.deepcopy(reference))
    optimizer: Any = plan.build(model.parameters())
    plan = optimizer.plan
    ref_opt = plan.optimizer.torch_class(reference.parameters(), **plan.optimizer.params)
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(step, world * MICRO_BATCHES * PER_MICRO_BATCH)
        ref_opt.zero_grad()
        ref_loss = _loss(reference, x, y)
        ref_loss.backward()
        ref_opt.step()
        optimizer.zero_grad()
        total = torch.zeros(())
        pieces = zip(
            x.chunk(world)[rank].chunk(MICRO_BATCHES),
            y.chunk(world)[rank].chunk(MICRO_BATCHES),
            strict=True,
        )
        for xm, ym in pieces:
            loss = _loss(model, xm, ym) / MICRO_BATCHES
            optimizer.backward(loss)
            total += loss.detach().float()
        optimizer.step()
        if dist.is_initialized():
            dist.all_reduce(total)
        mine = float(total) / world
        expected = float(ref_loss.detach())
        worst = max(worst, abs(mine - expected) / abs(expected))
    state = optimizer.full_state()  # collective at ZeRO 1-3
    diff = size = 0.0
    for i, param in enumerate(reference.parameters()):
        diff += float((state[f"param.{i}.master"].float() - param.detach()).square().sum())
        size += float(param.detach().square().sum())
    worst = max(worst, math.sqrt(diff / size))
    return {
        "rule": plan.rule_id,
        "error": worst,
        "bound": bound(plan),
        "skipped_steps": optimizer.skipped_steps,
    }


def run_group(
    rank: int,
    world: int,
    samples: Sequence[Sample],
    rules: str | None,
    imports: Sequence[str],
    progress: bool,
) -> list[dict[str, Any]]:
    """Every sample on this rank of a spawned group (``dtypeplan.launch.spawn``): the modules
    ``imports`` first, then each sample's :func:`train` result, or its error as text (one
    failure hides no other)."""
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    for name in imports:
        importlib.import_module(name)
    results = []
    for index, one in enumerate(samples, 1):
        try:
            result = train(one, rules, rank, world)
        except Exception as exc:  # noqa: BLE001 - the rule's result
            result = {"raised": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        results.append(result)
        if progress and rank == 0:
            shown = (
                result.get("raised") or f"error {result['error']:.1e}, bound {result['bound']:.1e}"
            )
            where = f"{world} rank{'s' if world > 1 else ''}"
            rule = f"{one.rule_id}{' (added)' if one.added else ''}"
            print(f"  [{index}/{len(samples)}] {rule} on {where}: {shown}", flush=True)
        if dist.is_initialized():
            dist.barrier()
    return results


# --- the proof of a rules file --------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """One OK rule's proof."""

    rule_id: str
    point: str
    result: str
    """``"passed"``, ``"failed"`` or ``"skipped"``."""
    error: float | None = None
    """The largest relative error over the runs (None: nothing trained)."""
    bound: float | None = None
    detail: str = ""
    runs: dict[int, str] = field(default_factory=dict)
    """Ranks -> that run's result, as text."""
    added: bool = False
    """The point is one the shipped table does not run (see :func:`sample`)."""

    def line(self) -> str:
        figures = (
            ""
            if self.error is None or self.bound is None
            else f" max error {self.error:.2e} vs bound {self.bound:.2e}"
        )
        detail = f" ({self.detail})" if self.detail else ""
        added = " (added)" if self.added else ""
        return f"{self.result.upper():7} {self.rule_id}{added}  [{self.point}]{figures}{detail}"


def _judge(one: Sample, results: dict[int, dict[str, Any]]) -> Outcome:
    """The outcome of ``one`` from each run's result (ranks -> rank 0's result)."""
    problems: list[str] = []
    runs: dict[int, str] = {}
    trained: list[dict[str, Any]] = []
    for ranks, result in sorted(results.items()):
        where = f"{ranks} rank{'s' if ranks > 1 else ''}"
        if "skipped" in result:
            runs[ranks] = f"skipped: {result['skipped']}"
            continue
        if "raised" in result:
            runs[ranks] = f"raised {result['raised']}"
            problems.append(f"{where} raised {result['raised']}")
            continue
        trained.append(result)
        within = result["error"] <= result["bound"]
        runs[ranks] = f"error {result['error']:.2e} {'<=' if within else '>'} {result['bound']:.2e}"
        if not within:
            problems.append(f"{where}: {runs[ranks]}")
        if result["skipped_steps"]:
            problems.append(f"{where} skipped {result['skipped_steps']} step(s)")
    error = max((r["error"] for r in trained), default=None)
    limit = max((r["bound"] for r in trained), default=None)
    verdict = "failed" if problems else "passed" if trained else "skipped"
    notes = problems or [
        f"{ranks} rank{'s' if ranks > 1 else ''} {text}"
        for ranks, text in runs.items()
        if "skipped" in text
    ]
    return Outcome(
        one.rule_id, one.text(), verdict, error, limit, "; ".join(notes), runs, one.added
    )


def prove(
    rules: str | os.PathLike[str] | None = None,
    *,
    imports: Sequence[str] = (),
    only: Collection[str] | None = None,
    each_value: bool = True,
    ranks: Sequence[int] = RANKS,
    progress: Callable[[str], None] | None = None,
    timeout_s: float = 3000.0,
) -> list[Outcome]:
    """Prove every OK rule of the rules file ``rules`` (None: the shipped one), in the file's
    order (``only``: the OK rules of these ids): one :class:`Outcome` per point of
    :func:`sample` (``each_value``: its points for each value, else the first alone; a file
    other than the shipped one is compared with it, so that a combination it adds is trained
    too). ``imports``: modules that register the
    implementations it names (imported here and in every rank); ``progress`` receives a line as
    each stage starts (rank 0 of each group prints one per point)."""
    from dtypeplan import load_rules, resolve
    from dtypeplan.resolver._rules import default_rules_path

    for name in imports:
        importlib.import_module(name)
    path = None if rules is None else os.fspath(rules)
    table = load_rules(path)
    shipped = path is None or os.path.samefile(path, default_rules_path())
    baseline = None if shipped else load_rules(None)
    ok = [r for r in table.rules if r.status == Status.OK and (only is None or r.id in only)]
    missing = set(only or ()) - {rule.id for rule in ok}
    if missing:
        raise ValueError(f"{sorted(missing)}: no OK rule of {table.path} has these ids")
    say = progress or (lambda line: None)
    say(f"finding the points of {len(ok)} OK rules")
    samples = [
        one
        for rule in ok
        for one in sample(
            table, rule, lambda c, p: resolve(c, p, path), baseline, each_value=each_value
        )
    ]
    results = _train(samples, path, imports, ranks, say, progress is not None, timeout_s)
    return [
        Outcome(one.rule_id, one.text(), "skipped", detail=one.skip or "", added=one.added)
        if one.skip is not None
        else _judge(one, results[index])
        for index, one in enumerate(samples)
    ]


def _train(
    samples: Sequence[Sample],
    path: str | None,
    imports: Sequence[str],
    ranks: Sequence[int],
    say: Callable[[str], None],
    progress: bool,
    timeout_s: float,
) -> dict[int, dict[int, dict[str, Any]]]:
    """Each runnable sample's result on each group size: sample index -> ranks -> rank 0's
    result (``{"skipped": why}`` where the group is too small for it)."""
    from dtypeplan.launch import spawn

    results: dict[int, dict[int, dict[str, Any]]] = {}
    for world in ranks:
        group = []
        for index, one in enumerate(samples):
            if one.skip is not None:
                continue
            why = one.too_few(world)
            if why is None:
                group.append(index)
            else:
                results.setdefault(index, {})[world] = {"skipped": why}
        say(f"training {len(group)} points on {world} gloo rank{'s' if world > 1 else ''}")
        chosen = [samples[index] for index in group]
        per_rank = spawn(
            run_group, world, chosen, path, list(imports), progress, timeout_s=timeout_s
        )
        for index, result in zip(group, per_rank[0], strict=True):
            results.setdefault(index, {})[world] = result
    return results


def summary(outcomes: Sequence[Outcome]) -> str:
    """``N points of M OK rules: P passed, F failed, S skipped``."""
    counts = {
        name: sum(o.result == name for o in outcomes) for name in ("passed", "failed", "skipped")
    }
    rules = len({o.rule_id for o in outcomes})
    shown = ", ".join(f"{n} {name}" for name, n in counts.items())
    return f"{len(outcomes)} points of {rules} OK rules: {shown}"
