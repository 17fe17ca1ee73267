"""Bytes per parameter per rank, measured, for every precision mode at 1, 2, 4 and 8 ranks.

    python -m benchmarks.bench_memory [--quick] [--worlds 1,2,4,8]

Modes (those the rules table says OK; the others are listed as not measured, with the table's
reason): model dtype fp32/fp16/bf16 x accumulation dtype fp32/bf16 x ZeRO stage 0/1/2 x
whole/sharded accumulator; bf16 masters (nearest, stochastic, Kahan) and bf16 Adam moments at
ZeRO-1/2; and a representative set of the newer dimensions: int8 / fp8 / fp8-bf16 moments
with fp32 masters and int8 moments with stochastic bf16 masters at ZeRO-1/2/3, bf16 masters at
ZeRO-3 (FSDP2), ``torch_autocast`` bf16 at ZeRO-2/3 and ``offload_optimizer: cpu`` at ZeRO-1/2.
An MLP is trained for one step, then one more set of micro-batches is run and the optimizer's
memory is measured at that accumulation boundary (after backward, before ``step()``, with the
AdamW states already created).

Measured: the tensors ``opt.held_tensors()`` lists per component (the flat parameter buffer or
FSDP2's shards, the accumulator and reduction buffers, the master chunks, the inner
``torch.optim`` states: torchao's quantized ones by their codes and scales, any ``param.grad``),
then every other tensor reachable from the optimizer object (as "other"), counted once per
distinct storage (aliases such as fp32 master chunks that are views of the parameter buffer
count once), by its untyped storage's size, so the figure includes bucket padding. Components
that ``held_tensors().on_host`` names (offload) are host bytes, reported apart. Each row is set
next to ``plan.memory()`` (device keys and ``host_total``) and next to DeepSpeed's byte count
for its equivalent option, derived from DeepSpeed's source (see :func:`deepspeed_formula`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import dtypeplan
from benchmarks._common import (
    base_parser,
    environment,
    finish,
    format_table,
    save_figure,
    write_result,
)
from dtypeplan.launch import spawn
from dtypeplan.optimizers.grads.owned import OwnedGradient

WORLD_SIZES = (1, 2, 4, 8)
MICRO_BATCHES = 2
OWNERS = ("dtypeplan", "torch.optim")
"""Objects of these packages are searched for tensors through their ``__dict__``."""
CATEGORIES = ("params", "grads", "accumulator", "master", "optimizer_states", "other")
"""Device bytes; ``total`` is their sum."""
HOST_CATEGORIES = ("host_master", "host_optimizer_states")
"""Host bytes of an offloaded optimizer (``held_tensors().on_host``); ``host_total``."""


MASTERS = ("fp32", "bf16-nearest", "bf16-stochastic", "bf16-kahan")
STATES = ("fp32", "bf16")
LOW_BIT_STATES = ("int8", "fp8", "fp8/bf16")
"""torchao's blockwise codes, both moments, and fp8 first / bf16 second moment."""
LAYOUTS = ((1, False), (2, True), (3, True))
"""ZeRO-1 with a whole accumulator (DeepSpeed's), ZeRO-2 and ZeRO-3 (sharded)."""


def all_modes() -> list[dict[str, Any]]:
    """The 24 dtype modes (fp32 masters and states); bf16 parameters with a bf16 accumulator at
    ZeRO-1 (whole) and ZeRO-2 (sharded), DeepSpeed's layouts, for every other master x
    bf16/fp32 optimizer-state choice; then the newer dimensions, a representative set:
    int8 / fp8 / fp8-bf16 states with fp32 masters and int8 states with stochastic bf16 masters
    at ZeRO-1/2/3, bf16 masters at ZeRO-3 (FSDP2), ``torch_autocast`` bf16 at ZeRO-2/3, and
    ``offload_optimizer: cpu`` at ZeRO-1/2. Cells the table refuses are listed as not measured,
    with the table's reason."""
    modes = []
    for model in ("fp32", "fp16", "bf16"):
        for accum in ("fp32", "bf16"):
            for stage, sharded in ((0, False), (1, False), (1, True), (2, True)):
                modes.append({"model": model, "accum": accum, "stage": stage, "sharded": sharded})
    bf16 = {"model": "bf16", "accum": "bf16"}
    for stage, sharded in ((1, False), (2, True)):
        for master in MASTERS:
            for states in STATES:
                if (master, states) == ("fp32", "fp32"):
                    continue  # bf16/bf16 z1 whole and z2 shard above
                modes.append(
                    {**bf16, "stage": stage, "sharded": sharded, "master": master, "states": states}
                )
    for stage, sharded in LAYOUTS:
        for states in LOW_BIT_STATES:
            modes.append({**bf16, "stage": stage, "sharded": sharded, "states": states})
        modes.append(
            {**bf16, "stage": stage, "sharded": sharded, "master": "bf16-stochastic",
             "states": "int8"}
        )  # fmt: skip
    zero3 = {**bf16, "stage": 3, "sharded": True}
    modes.append(zero3)
    for master, states in (
        ("bf16-nearest", "bf16"),
        ("bf16-stochastic", "bf16"),
        ("bf16-kahan", "fp32"),
        ("bf16-kahan", "bf16"),
    ):
        modes.append({**zero3, "master": master, "states": states})
    for accum in ("fp32", "bf16"):
        for stage in (2, 3):
            modes.append(
                {"model": "fp32", "accum": accum, "stage": stage, "sharded": True,
                 "autocast": "bf16"}
            )  # fmt: skip
    for model, accum, stage, sharded in (
        ("bf16", "bf16", 1, False),
        ("bf16", "bf16", 2, True),
        ("bf16", "fp32", 1, False),
        ("fp32", "fp32", 2, True),
    ):
        modes.append(
            {"model": model, "accum": accum, "stage": stage, "sharded": sharded, "offload": True}
        )
    return modes


def mode_label(mode: dict[str, Any]) -> str:
    accumulator = "shard" if mode["sharded"] else "whole"
    model = f"autocast-{mode['autocast']}" if mode.get("autocast") else mode["model"]
    label = f"{model}/{mode['accum']} z{mode['stage']} {accumulator}"
    master, states = mode.get("master", "fp32"), mode.get("states", "fp32")
    if (master, states) != ("fp32", "fp32"):
        label += f" m={master} s={states}"
    if mode.get("offload"):
        label += " offload=cpu"
    return label


def mode_config(mode: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bf16": {"enabled": mode["model"] == "bf16"},
        "fp16": {"enabled": mode["model"] == "fp16"},
        "gradient_accumulation_dtype": {"dtype": mode["accum"], "sharded": mode["sharded"]},
        "zero_optimization": {"stage": mode["stage"]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    }
    states = mode.get("states", "fp32")
    if states == "bf16":
        config["bf16"]["bf16_optimizer_states"] = True
    elif states != "fp32":
        exp_avg, _, exp_avg_sq = states.partition("/")
        config["optimizer_states"] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq or exp_avg}
    master = mode.get("master", "fp32")
    if master != "fp32":
        dtype, rounding = master.split("-")
        config["master_weights"] = {"dtype": dtype, "rounding": rounding}
    if mode.get("autocast"):
        config["torch_autocast"] = {
            "enabled": True,
            "dtype": {"bf16": "bfloat16"}[mode["autocast"]],
        }
    if mode.get("offload"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


DEEPSPEED_SOURCE = "DeepSpeed master edaa722 (2026-08-22, 0.19.6.dev)"


def deepspeed_formula(mode: dict[str, Any], world: int) -> tuple[str, float, float] | None:
    """(name, device bytes, host bytes) per parameter per rank of what DeepSpeed would hold for
    ``mode``, or None where it has no equivalent option.

    Read from ``deepspeed/runtime/zero/stage_1_and_2.py`` (``DeepSpeedZeroOptimizer.__init__``:
    the master partition ``weights_partition = ...detach().clone().to(dtype=
    master_weights_and_grads_dtype)`` is always a copy, even of fp32 parameters;
    ``initialize_optimizer_states``: with ``cpu_offload`` a persistent gradient partition in the
    master dtype in host memory; ``copy_grads_in_partition``: without offload ZeRO-2's gradient
    partition ``grads_in_partition``), ``runtime/zero/stage3.py``
    (``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``: the master partition is the
    parameters' own partition when the dtypes match (bf16 masters of bf16 parameters; fp32
    parameters under ``torch_autocast``), else a clone; ``_setup_for_real_optimizer``: the
    gradient partition ``grad_partitions_flat_buffer`` in ``gradient_accumulation_dtype``, on
    the host with offload) and ``runtime/base_optimizer.py`` (``_configure_master_weights``: bf16
    masters with fp32 states assert ``offload_optimizer: cpu`` with DeepSpeedCPUAdam;
    ``bf16_optimizer_states`` requires bf16 masters). Moments fp32 (8/N), bf16 with
    ``bf16_optimizer_states`` (4/N). Buckets and other transient buffers are left out.

    Stage 0-2 (no offload), bf16 parameters: ZeRO-1 (bf16 params and whole grads, 12 B of fp32
    master + moments sharded) 4 + 12/N; BF16_Optimizer (+ a whole fp32 accumulator) 8 + 12/N;
    ZeRO-2 (fp32 gradient partition) 2 + 16/N; the ZeRO paper's P_os+g (16-bit gradient
    partition) 2 + 14/N. bf16 masters + bf16 states: ZeRO-1 4 + 6/N, ZeRO-2 2 + 8/N.
    bf16 masters with fp32 states (offload forced): device ZeRO-1 4, ZeRO-2 2; host 2/N bf16
    master + 2/N bf16 gradient partition + 2/N bf16 parameter staging buffer
    (``param_buffer_of_bit16_for_cpu_offload_groups``) + 8/N moments = 14/N.
    ZeRO-Offload with fp32 masters (``offload_optimizer: cpu``), bf16 parameters: device 2
    params (+ 2 whole grads at ZeRO-1); host 4/N master + 4/N fp32 gradient partition + 2/N
    staging buffer + 8/N moments + 2/N bf16 per-parameter accumulation buffers
    (``accumulated_grads_in_cpu``, made with more than one micro-batch, as here) = 20/N.
    ZeRO-3, bf16 parameters: fp32 masters 2/N params + 2/N bf16 grads + 4/N master + 8/N =
    16/N; bf16 masters + bf16 states 2/N + 2/N + 0 (aliased) + 4/N = 8/N; bf16 masters with
    fp32 states: device 2/N, host 2/N master clone + 2/N grads + 8/N = 12/N.
    ``torch_autocast`` (fp32 parameters, fp32 gradients): ZeRO-2 4 + 4/N + 4/N master clone +
    8/N = 4 + 16/N; ZeRO-3 4/N (the master) + 4/N + 8/N = 16/N. Compared with fp32
    accumulation (DeepSpeed's); with bf16 accumulation dtypeplan has no DeepSpeed equivalent.
    DeepSpeed rounds bf16 masters to nearest only: '(nearest)' marks its figure next to
    stochastic and Kahan rows. It has no int8 / fp8 optimizer states, and no fp32 masters with
    bf16 states (``bf16_optimizer_states requires bf16_master_weights_and_grads``).
    """
    if mode["model"] == "fp32" and mode.get("autocast"):
        if mode["accum"] != "fp32":
            return None
        if mode["stage"] == 2:
            return "autocast ZeRO-2 4+16/N", 4 + 16 / world, 0.0
        if mode["stage"] == 3:
            return "autocast ZeRO-3 16/N", 16 / world, 0.0
        return None
    if mode["model"] != "bf16":
        return None
    master, states = mode.get("master", "fp32"), mode.get("states", "fp32")
    if mode.get("offload"):
        if (master, states, mode["accum"]) != ("fp32", "fp32", "bf16"):
            return None
        if mode["stage"] == 1 and not mode["sharded"]:
            return "ZeRO-1 Offload 4; host 20/N", 4.0, 20 / world
        if mode["stage"] == 2:
            return "ZeRO-2 Offload 2; host 20/N", 2.0, 20 / world
        return None
    if states not in ("fp32", "bf16"):
        return None  # int8 / fp8: no DeepSpeed option
    if master != "fp32" and mode["accum"] != "bf16":
        return None
    if master != "fp32":
        note = "" if master == "bf16-nearest" else " (nearest)"
        whole_z1 = mode["stage"] == 1 and not mode["sharded"]
        if states == "bf16":
            if whole_z1:
                return f"ZeRO-1 bf16 master+states 4+6/N{note}", 4 + 6 / world, 0.0
            if mode["stage"] == 2:
                return f"ZeRO-2 bf16 master+states 2+8/N{note}", 2 + 8 / world, 0.0
            if mode["stage"] == 3:
                return f"ZeRO-3 bf16 master+states 8/N{note}", 8 / world, 0.0
            return None
        if whole_z1:
            return f"ZeRO-1 bf16 master, offload 4; host 14/N{note}", 4.0, 14 / world
        if mode["stage"] == 2:
            return f"ZeRO-2 bf16 master, offload 2; host 14/N{note}", 2.0, 14 / world
        if mode["stage"] == 3:
            return f"ZeRO-3 bf16 master, offload 2/N; host 12/N{note}", 2 / world, 12 / world
        return None
    if states != "fp32":
        return None
    key = (mode["accum"], mode["stage"], mode["sharded"])
    if key == ("bf16", 1, False):
        return "ZeRO-1 4+12/N", 4 + 12 / world, 0.0
    if key == ("fp32", 1, False):
        return "BF16_Optimizer 8+12/N", 8 + 12 / world, 0.0
    if key == ("fp32", 2, True):
        return "ZeRO-2 2+16/N", 2 + 16 / world, 0.0
    if key == ("bf16", 2, True):
        return "ZeRO paper 2+14/N", 2 + 14 / world, 0.0
    if key == ("bf16", 3, True):
        return "ZeRO-3 16/N", 16 / world, 0.0
    return None


TORCHAO_SINGLE_DEVICE = {
    "int8": 2 + 2 + 2 * (1 + 4 / 256),
    "fp8": 2 + 2 + 2 * (1 + 4 / 256),
    "fp8/bf16": 2 + 2 + (1 + 4 / 256) + 2,
}
"""torchao's single-device figure for bf16 parameters (the masters), their bf16 ``.grad`` and
its quantized moments (``torchao.optim.AdamW8bit`` / ``AdamWFp8``: 1 byte a value + an fp32
scale per 256-value block; a bf16 second moment for fp8/bf16 has no torchao class, counted as
2 B). Set next to the int8 / fp8 rows, for which DeepSpeed has no option."""


def make_model(widths: list[int], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _reachable_tensors(root: object) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from ``root`` through containers and the
    ``__dict__`` of dtypeplan and torch.optim objects."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("opt", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if is_traceable_wrapper_subclass(obj):
            # A quantized optimizer state (torchao): its bytes are the tensors inside it.
            names, _ = obj.__tensor_flatten__()
            stack += [(f"{path}.{name}", getattr(obj, name)) for name in names]
            continue
        if isinstance(obj, torch.Tensor):
            yield path, obj
            if obj.grad is not None:
                stack.append((path + ".grad", obj.grad))
            continue
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            stack += [(f"{path}.key", k) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(OWNERS):
            stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensor``: its own, or those of the tensors a wrapper subclass
    (FSDP2's DTensor, torchao's quantized states) is made of."""
    if isinstance(tensor, OwnedGradient):
        return  # the placeholder in .grad of a gradient the optimizer holds: no storage
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    else:
        yield tensor.untyped_storage()


def measure(opt: Any, model: torch.nn.Module) -> dict[str, int]:
    """Bytes per category of every distinct storage the optimizer (and the model) holds: the
    device categories and ``total``, then the host ones (offload) and ``host_total``."""
    by_storage: dict[int, tuple[str, int]] = {}

    def claim(tensor: torch.Tensor, category: str) -> None:
        for storage in _storages(tensor):
            if storage.nbytes():
                by_storage.setdefault(storage.data_ptr(), (category, storage.nbytes()))

    # The optimizer's own account first, in plan.memory()'s order, so an alias counts where it
    # lives (fp32 masters are views of the parameters' buffer); the model's parameters are
    # views of those buffers (FSDP2's: DTensors over the shards). Whatever else is reachable
    # is "other".
    held = opt.held_tensors()
    for component, tensors in held.items():
        category = f"host_{component}" if component in held.on_host else component
        for tensor in tensors:
            claim(tensor, category)
    for param in model.parameters():
        claim(param.detach(), "params")
    for _path, tensor in _reachable_tensors(opt):
        claim(tensor, "other")
    totals = dict.fromkeys(CATEGORIES + HOST_CATEGORIES, 0)
    for category, nbytes in by_storage.values():
        totals[category] += nbytes
    totals["total"] = sum(totals[c] for c in CATEGORIES)
    totals["host_total"] = sum(totals[c] for c in HOST_CATEGORIES)
    return totals


def run_mode(mode: dict[str, Any], widths: list[int], world: int, rank: int) -> dict[str, Any]:
    plan = dtypeplan.resolve(mode_config(mode))
    if plan.status != "OK":
        return {"status": str(plan.status), "reason": plan.reason}
    model = make_model(widths)
    param_numels = [p.numel() for p in model.parameters()]
    num_params = sum(param_numels)
    # ZeRO-3 shards the model with FSDP2 here; torch_autocast installs its forward context.
    model = plan.prepare_model(model)
    opt = plan.build(model.parameters())
    dtype = plan.param_dtype
    generator = torch.Generator().manual_seed(rank)

    def micro_step() -> None:
        x = torch.randn(8, widths[0], generator=generator).to(dtype)
        loss = model(x).float().pow(2).mean() / MICRO_BATCHES
        opt.backward(loss)

    for _ in range(MICRO_BATCHES):
        micro_step()
    opt.step()
    opt.zero_grad()
    for _ in range(MICRO_BATCHES):
        micro_step()
    measured = measure(opt, model)
    # The sizes: int8 / fp8 moments pad each parameter to whole blocks, which this counts.
    predicted = plan.memory(num_params, world, param_numels=param_numels)
    padded = sum(buffer.numel() for buffer in opt.held_tensors().params)
    return {
        "status": "OK",
        "num_params": num_params,
        "padded_numel": padded,
        "measured": measured,
        "predicted": predicted,
        "implementation": plan.implementation,
    }


def _rank_worker(
    rank: int, world: int, modes: list[dict[str, Any]], widths: list[int]
) -> list[Any]:
    return [run_mode(mode, widths, world, rank) for mode in modes]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--worlds",
        default=",".join(map(str, WORLD_SIZES)),
        help="comma-separated world sizes (default %(default)s; 8 ranks take ~2 min on 2 cores)",
    )
    args = parser.parse_args(argv)
    worlds = tuple(int(w) for w in args.worlds.split(","))
    widths = [128, 256, 256, 128] if args.quick else [512, 1024, 1024, 512]
    modes = all_modes()
    env = environment()
    per_world: dict[int, list[Any]] = {}
    for world in worlds:
        if world == 1:
            per_world[world] = _rank_worker(0, 1, modes, widths)
        else:
            results = spawn(_rank_worker, world, modes, widths, timeout_s=900)
            # Ranks differ only by the padding they do not hold; report the largest rank.
            per_world[world] = [
                max(by_rank, key=lambda r: r.get("measured", {}).get("total", 0))
                for by_rank in zip(*results, strict=True)
            ]

    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    num_params = 0
    for index, mode in enumerate(modes):
        for world in worlds:
            result = per_world[world][index]
            if result["status"] != "OK":
                if world == worlds[0]:
                    reason = result["reason"].strip()
                    skipped.append(f"{mode_label(mode)}: {result['status']} ({reason})")
                continue
            num_params = result["num_params"]
            n = num_params
            measured, predicted = result["measured"], result["predicted"]
            ds = deepspeed_formula(mode, world)
            if ds is None and mode.get("states") in TORCHAO_SINGLE_DEVICE:
                torchao = TORCHAO_SINGLE_DEVICE[mode["states"]]
                ds_name = f"none (torchao, 1 device: {torchao:.2f})"
            else:
                ds_name = ds[0] if ds else None
            rows.append(
                {
                    "mode": mode_label(mode),
                    "N": world,
                    "measured B/param": measured["total"] / n,
                    "plan.memory B/param": predicted["total"] / n,
                    "measured/plan": measured["total"] / predicted["total"],
                    "host measured": measured["host_total"] / n,
                    "host plan": predicted["host_total"] / n,
                    "params": measured["params"] / n,
                    "grads": measured["grads"] / n,
                    "accum": measured["accumulator"] / n,
                    "master": measured["master"] / n,
                    "states": measured["optimizer_states"] / n,
                    "other": measured["other"] / n,
                    "DeepSpeed": ds_name,
                    "DeepSpeed B/param": ds[1] if ds else None,
                    "DeepSpeed host": ds[2] if ds else None,
                    "_mode": mode,
                    "_measured": measured,
                    "_predicted": predicted,
                    "_padded_numel": result["padded_numel"],
                }
            )
    columns = [c for c in rows[0] if not c.startswith("_")]
    table = format_table(rows, columns)
    print(f"model: MLP {widths}, {num_params} parameters, AdamW; bytes per parameter per rank")
    print(table)

    worst = max(abs(r["measured/plan"] - 1.0) for r in rows)
    ds_rows = [r for r in rows if r["DeepSpeed B/param"] is not None]
    savings = {
        f"{r['mode']} N={r['N']}": round(r["DeepSpeed B/param"] - r["measured B/param"], 3)
        for r in ds_rows
    }
    summary = {
        "benchmark": "memory",
        "num_params": num_params,
        "modes": len(modes) - len(skipped),
        "max_abs_measured_over_plan_minus_1": round(worst, 5),
        "bf16_fp32accum_z1_whole_N4_B_per_param": next(
            (
                r["measured B/param"]
                for r in rows
                if r["mode"] == "bf16/fp32 z1 whole" and r["N"] == 4
            ),
            None,
        ),
        "deepspeed_minus_measured_B_per_param": savings,
    }
    if not args.no_write:
        stem_path = args.out
        plot = _plot(rows, worlds, stem_path, env["date"])
        notes = [
            "Measured = distinct storages reachable from the optimizer at the accumulation "
            "boundary of the 2nd step (Adam states exist), so bucket padding is included; "
            "plan.memory() leaves bucket padding out and is given the parameter sizes "
            "(param_numels), so it counts the per-parameter block padding of int8 / fp8 moments.",
            "Rows report the rank with the most bytes (ranks differ only by padding).",
            "Offload rows: 'measured B/param' and 'plan.memory B/param' are device bytes; "
            "'host measured' / 'host plan' the host bytes (held_tensors().on_host; "
            "plan.memory()'s host_total). DeepSpeed's figures are split the same way "
            "('DeepSpeed B/param' device, 'DeepSpeed host').",
            "DeepSpeed figures are formulas, not measurements, derived from the source of "
            f"{DEEPSPEED_SOURCE}: deepspeed/runtime/zero/stage_1_and_2.py "
            "(DeepSpeedZeroOptimizer.__init__: the master partition is always a clone in "
            "master_weights_and_grads_dtype, with cpu_offload a bit16 staging buffer of the "
            "partition in host memory; initialize_optimizer_states: with cpu_offload a "
            "persistent gradient partition in the master dtype on the host; "
            "async_accumulate_grad_in_cpu_via_gpu: with more than one micro-batch, per-parameter "
            "host accumulation buffers in the parameter dtype; copy_grads_in_partition: ZeRO-2's "
            "device gradient partition), deepspeed/runtime/zero/stage3.py "
            "(DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions: the master partition is the "
            "parameters' own partition when the dtypes match, as for bf16 masters or fp32 "
            "parameters under torch_autocast, else a clone; _setup_for_real_optimizer: the "
            "gradient partition grad_partitions_flat_buffer in gradient_accumulation_dtype, on "
            "the host with offload) and deepspeed/runtime/base_optimizer.py "
            "(_configure_master_weights: bf16 masters with fp32 states assert offload_optimizer "
            "cpu + DeepSpeedCPUAdam; bf16_optimizer_states requires bf16 masters). Buckets and "
            "other transient buffers are left out, as plan.memory() leaves them out.",
            "Formulas (bf16 parameters unless said): ZeRO-1 4+12/N (bf16 params and whole "
            "grads), BF16_Optimizer 8+12/N (+ whole fp32 accumulator), ZeRO-2 2+16/N (fp32 "
            "gradient partition), the ZeRO paper's P_os+g 2+14/N next to bf16 accumulation at "
            "stage 2, ZeRO-3 16/N (2 params + 2 grads + 4 master + 8 moments, over N). "
            "bf16 masters + bf16 states: ZeRO-1 4+6/N, ZeRO-2 2+8/N, ZeRO-3 8/N (the master is "
            "the parameters' partition). bf16 masters with fp32 states force offload: device "
            "ZeRO-1 4, ZeRO-2 2, ZeRO-3 2/N; host 2/N master + 2/N bf16 gradient partition "
            "+ 2/N bf16 staging buffer + 8/N moments = 14/N at ZeRO-1/2 (12/N at ZeRO-3, no "
            "staging buffer). ZeRO-Offload with fp32 masters: device ZeRO-1 4 (params + whole "
            "grads), ZeRO-2 2; host 4/N master + 4/N fp32 gradient partition + 2/N staging + "
            "8/N moments + 2/N accumulation buffers = 20/N (18/N with one micro-batch). "
            "torch_autocast (fp32 params and grads): ZeRO-2 4+16/N (a 4/N master clone), "
            "ZeRO-3 16/N (master aliased), compared with fp32 accumulation only. DeepSpeed "
            "rounds bf16 masters to nearest only: '(nearest)' marks its figure next to "
            "stochastic and Kahan rows. It has no int8 / fp8 optimizer states ('none'; set "
            "beside torchao's single-device AdamW8bit / AdamWFp8 figure: bf16 params + bf16 "
            "grads + 1 B a value and an fp32 scale per 256 for each moment) and no fp32 masters "
            "with bf16 states.",
            "Changed from the 2026-11-29 / first 2026-12-01 run: DeepSpeed's bf16-master rows "
            "with fp32 states are now split into device and host bytes and count DeepSpeed's "
            "bf16 staging buffer (param_buffer_of_bit16_for_cpu_offload_groups, 2/N) that the "
            "earlier "
            "device + host figure 4+12/N / 2+12/N left out.",
            *[f"not measured: {s}" for s in skipped],
        ]
        write_result(
            "memory",
            out=args.out,
            env=env,
            config={
                "model": f"MLP {widths}",
                "num_params": num_params,
                "optimizer": "AdamW",
                "micro_batches": MICRO_BATCHES,
                "world_sizes": list(worlds),
                "quick": args.quick,
            },
            sections=[
                ("Bytes per parameter per rank", table),
                ("Plot", f"![bytes per param]({plot.name})"),
            ],
            data={"rows": [_jsonable_row(r) for r in rows], "skipped": skipped, "summary": summary},
            notes=notes,
        )
    finish(summary)
    return summary


def _jsonable_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if not k.startswith("_")}
    out.update(
        mode=row["_mode"],
        measured_bytes=row["_measured"],
        predicted_bytes=row["_predicted"],
        padded_numel=row["_padded_numel"],
        label=row["mode"],
    )
    return out


def _plot(rows: list[dict[str, Any]], worlds: tuple[int, ...], out: Path, date: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(10, 0.6 * len(labels)), 5.5))
    width = 0.8 / len(worlds)
    for k, world in enumerate(worlds):
        xs, measured, host, predicted, ds_x, ds_y = [], [], [], [], [], []
        for i, label in enumerate(labels):
            row = next((r for r in rows if r["mode"] == label and r["N"] == world), None)
            if row is None:
                continue
            x = i + (k - (len(worlds) - 1) / 2) * width
            xs.append(x)
            measured.append(row["measured B/param"])
            host.append(row["host measured"])
            predicted.append(row["plan.memory B/param"] + row["host plan"])
            if row["DeepSpeed B/param"] is not None:
                ds_x.append(x)
                ds_y.append(row["DeepSpeed B/param"] + row["DeepSpeed host"])
        bars = ax.bar(xs, measured, width, label=f"measured N={world}")
        ax.bar(
            xs,
            host,
            width,
            bottom=measured,
            color=bars.patches[0].get_facecolor() if bars.patches else None,
            alpha=0.35,
            hatch="//",
            label="host (offload)" if k == 0 else None,
        )
        ax.scatter(
            xs,
            predicted,
            marker="_",
            s=120,
            color="black",
            label="plan.memory() (device + host)" if k == 0 else None,
            zorder=3,
        )
        ax.scatter(
            ds_x,
            ds_y,
            marker="x",
            color="red",
            label="DeepSpeed formula (device + host)" if k == 0 else None,
            zorder=3,
        )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("bytes per parameter per rank")
    ax.set_title(
        "Optimizer memory at the accumulation boundary (model/accum dtype, ZeRO stage, "
        "accumulator; m = masters, s = Adam moments)"
    )
    ax.set_ylim(
        0,
        1.2
        * max(
            max(r["measured B/param"] + r["host measured"] for r in rows),
            max((r["DeepSpeed B/param"] or 0) + (r["DeepSpeed host"] or 0) for r in rows),
        ),
    )
    ax.legend(fontsize=8, ncol=5, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, out, "memory", date)


if __name__ == "__main__":
    main()
