"""Every precision cell's optimizer step against the library a user would pick for that cell.

    python -m benchmarks.bench_precision_peers [--quick] [--cells NAME,...] [--threads N]
        [--profile]

One process, ``--layers`` x (``--width``, ``--width``) parameters (4 x 2048^2 = 16.8 M by
default), AdamW without clipping, fixed gradients. For each precision cell (parameter dtype /
master weights / optimizer states) dtypeplan's ``opt.step()`` is timed next to its peer:

* fp32 / fp32 / fp32: ``torch.optim.AdamW(fused=True)`` on fp32;
* bf16 / fp32 / fp32: the same (fp32 masters and moments, bf16 parameters);
* bf16 / bf16 nearest / bf16 (bf16 accumulator): ``torch.optim.AdamW(fused=True)`` on bf16
  parameters, which gives the same bits; also run with an fp32 accumulator;
* fp32 / - / bf16: ``torch.optim.AdamW(fused=True)`` on fp32 (which moves more bytes);
* bf16 / bf16 stochastic / bf16 and bf16 / bf16 kahan / bf16: torchao
  ``_AdamW(bf16_stochastic_round=True)``, compiled;
* fp32 / - / fp8: torchao ``AdamWFp8``, compiled;
* fp32 / - / int8: torchao ``AdamW8bit``, compiled, and bitsandbytes ``AdamW8bit``;
* fp32 offloaded (ZeRO-1): DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode=True``), the host
  step ZeRO-Offload runs (see below).

The offloaded cell, like for like. ``DeepSpeedCPUAdam.step()`` updates fp32 parameters in place
from their fp32 ``.grad`` on the host (AVX-512 / AVX2 C++ with OpenMP, JIT-built at first use):
it reads the gradient and reads and writes parameter and both moments, 28 B/param; in
ZeRO-Offload the engine around it copies gradients down and parameters up and computes the norm
on the device. dtypeplan's ``opt.step()`` on one CPU process does the whole optimizer step: it
takes the hand-set ``.grad`` into its fp32 accumulator, computes the gradient norm and
non-finite check (``opt.grad_norm``), and runs the host step (``buffers/host_offload.py``): torch's
fused AdamW on the host master chunks and states, writing the parameters in the same pass (a
separate buffer: offloaded masters never alias the parameters; 32 B/param). Rows: ``dtypeplan
...`` is the whole ``opt.step()``, ``(host step)`` only ``HostOffload.step`` (timed by a wrapper
inside the same steps). The ``[staged, as on an accelerator]`` case runs the accelerator's
pipeline on the CPU (gradient slots, copies, upload; there those copies are DMA, here memcpy),
and its ``(host update)`` row times only the update of the master chunks
(``FlatAdamUpdate.bucket``, 28 B/param): the host's own work on an accelerator for fp32
parameters, DeepSpeedCPUAdam's job exactly. DeepSpeed's OpenMP threads follow ``--threads``
(``OMP_NUM_THREADS`` is set before its op loads; ``omp_threads`` in the config is what the
OpenMP runtime reports). ``--profile`` adds torch.profiler's self CPU time per step by op for
the offloaded case (where dtypeplan's time goes). After the run the largest difference of the
offloaded case's parameters from DeepSpeedCPUAdam's (the same steps on the same gradients) is
noted.

A peer that is not installed (bitsandbytes, DeepSpeed) is left out with a note; torchao is a
dependency. All cases are built first and then timed in interleaved rounds (one step of every
case per round), so that a change of load on the machine hits every case alike. Before every
timed step the case gets a fresh copy of the fixed gradients (untimed); after it, the copy is
compared with the source: a case that wrote into its input gradients is flagged in the table
(``grads kept``), and the shared source is checked at the end of every round, so a change is
pinned on the case that made it.

Two rows per case. ``hand-set`` (the rows without a suffix): the gradients are set by hand
into ``.grad`` and only ``step()`` is timed, so dtypeplan's step also takes ``.grad`` into its
accumulator and takes the gradient norm (``opt.grad_norm``), which in training the backward
does. ``(as in training)``: the gradient arrives through a backward, for dtypeplan and its peer
alike, and ``backward + step()`` is timed: the loss is ``sum((p * g).sum())`` over the
parameters with ``g`` a fresh copy of the fixed gradients in the parameter's dtype, whose
gradient is exactly ``g`` (checked once per dtype before timing); dtypeplan runs
``opt.backward(loss, last_micro_batch=True)`` (its hooks take each gradient into the
accumulator and the boundary backward takes the chunk norms), the peer ``loss.backward()``.
The forward is untimed. ``x peer`` compares like with like (a training row with the peer's
training row).

Columns: ``ms`` (median ms of ``step()``, or of ``backward + step()``), ``x peer`` (ms over
the first peer's median for the cell in the same mode), ``B/param`` (bytes a step must move:
read the gradient, read and write the master and each moment, write a 16-bit parameter that is
not the master; int8 / fp8 blocks of 256 carry a 4-byte scale each), ``x floor`` (ms over
``numel * B/param / copy bandwidth``, the copy timed in the same rounds).
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import dtypeplan
from benchmarks._common import (
    base_parser,
    environment,
    finish,
    format_table,
    save_figure,
    write_result,
)
from benchmarks._optimizer_step import BETAS, EPS, LR, WEIGHT_DECAY, time_steps

CPU = torch.device("cpu")
BLOCK_SCALE = 4 / 256
"""Bytes per value of the fp32 scale that torchao's int8 / fp8 blocks (256 values) carry."""
STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + BLOCK_SCALE, "fp8": 1 + BLOCK_SCALE}
HYPER = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One precision cell: its dtypeplan config and the peers that do the same job."""

    name: str
    config: dict[str, Any]
    peers: tuple[str, ...]


def _config(**extra: Any) -> dict[str, Any]:
    hyper = {**HYPER, "betas": list(BETAS)}
    return {"optimizer": {"type": "AdamW", "params": hyper}, "gradient_clipping": 0.0, **extra}


_BF16 = {"enabled": True}
_BF16_STATES = {"enabled": True, "bf16_optimizer_states": True}
CELLS = [
    Cell(name="fp32 / fp32 / fp32", config=_config(), peers=("torch fused fp32",)),
    Cell(name="bf16 / fp32 / fp32", config=_config(bf16=_BF16), peers=("torch fused fp32",)),
    Cell(
        name="bf16 / bf16 nearest / bf16",
        config=_config(
            bf16=_BF16_STATES,
            master_weights={"dtype": "bf16", "rounding": "nearest"},
            gradient_accumulation_dtype="bf16",
        ),
        peers=("torch fused bf16",),
    ),
    Cell(
        name="bf16 / bf16 nearest / bf16 (fp32 accumulator)",
        config=_config(bf16=_BF16_STATES, master_weights={"dtype": "bf16", "rounding": "nearest"}),
        peers=("torch fused bf16",),
    ),
    Cell(
        name="fp32 / - / bf16",
        config=_config(optimizer_states="bf16"),
        peers=("torch fused fp32",),
    ),
    Cell(
        name="bf16 / bf16 stochastic / bf16",
        config=_config(
            bf16=_BF16_STATES, master_weights={"dtype": "bf16", "rounding": "stochastic"}
        ),
        peers=("torchao AdamW bf16 stochastic",),
    ),
    Cell(
        name="bf16 / bf16 kahan / bf16",
        config=_config(bf16=_BF16_STATES, master_weights={"dtype": "bf16", "rounding": "kahan"}),
        peers=("torchao AdamW bf16 stochastic",),
    ),
    Cell(
        name="fp32 / - / fp8", config=_config(optimizer_states="fp8"), peers=("torchao AdamWFp8",)
    ),
    Cell(
        name="fp32 / - / int8",
        config=_config(optimizer_states="int8"),
        peers=("torchao AdamW8bit", "bitsandbytes AdamW8bit"),
    ),
    Cell(
        name="fp32 offloaded (ZeRO-1)",
        config=_config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}),
        peers=("DeepSpeedCPUAdam",),
    ),
]


@dataclass
class Case:
    """One optimizer over its own copy of the parameters, ready to step on fixed gradients."""

    name: str
    params: list[torch.Tensor]
    step: Callable[[], Any]
    zero_grad: Callable[[], None]
    bytes_per_param: float
    grads_kept: bool = True
    parts: dict[str, list[float]] | None = None
    """Milliseconds of named parts of each step (timed inside it), where the case has any."""
    backward: Callable[[torch.Tensor], None] | None = None
    """Timed as in training: runs the backward of a loss whose gradient is the fixed gradients
    (timed with ``step``). None: the gradients are set by hand into ``.grad``."""


TRAINING = " (as in training)"
"""Suffix of a case whose gradients arrive through a backward (timed: backward + step)."""


def _params(shapes: list[torch.Size], dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(dtype))
        for shape in shapes
    ]


STAGED = " [staged, as on an accelerator]"
"""Suffix of the offloaded case run through the accelerator's pipeline (``HostOffload.staged``)."""


def dtypeplan_case(
    cell: Cell, shapes: list[torch.Size], staged: bool = False, training: bool = False
) -> Case:
    plan = dtypeplan.resolve(cell.config)
    params = _params(shapes, torch.float32)
    opt = plan.build(params)
    states = [plan.exp_avg_dtype, plan.exp_avg_sq_dtype]
    state_bytes = sum(STATE_BYTES[_state_name(s)] for s in states)
    master = plan.master_dtype.itemsize
    kahan = 2 * 2 if plan.master_rounding == "kahan" else 0
    param_write = plan.param_dtype.itemsize if plan.param_dtype != plan.master_dtype else 0
    accumulate = plan.grad_accum_dtype.itemsize
    case = Case(
        name=f"dtypeplan {cell.name}",
        params=params,
        step=opt.step,
        zero_grad=opt.zero_grad,
        bytes_per_param=accumulate + 2 * master + kahan + 2 * state_bytes + param_write,
    )
    if training:
        case.name += TRAINING
        case.backward = lambda loss: opt.backward(loss, last_micro_batch=True)
    offload = getattr(opt, "offload", None)
    if offload is not None:
        # Offloaded masters never alias the parameters: the host step writes them (4 B/param).
        case.bytes_per_param += 4
        case.parts = {"host step": []}
        _time_part(offload, "step", case.parts["host step"])
        if staged:
            # The accelerator's pipeline: its copies are DMA there, so the host's own work is
            # the update of the master chunks (``FlatAdamUpdate.bucket``), DeepSpeedCPUAdam's job.
            offload.staged = True
            case.name += STAGED
            case.parts["host update"] = []
            update = opt._adam_update  # type: ignore[attr-defined]
            _time_part(update, "bucket", case.parts["host update"])
    return case


def _time_part(owner: Any, method: str, into: list[float]) -> None:
    """Wrap ``owner.method`` so that every call appends its wall milliseconds to ``into``."""
    import time

    inner = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - begin) * 1e3)

    setattr(owner, method, timed)


def _state_name(dtype: Any) -> str:
    """The plan names a moment's storage as a torch dtype (fp32, bf16) or a string (int8, fp8)."""
    if isinstance(dtype, torch.dtype):
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    return str(dtype)


def _peer_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    """The peer by name over ``params``, or None where its library is not installed."""
    if name.startswith("torch fused"):
        return torch.optim.AdamW(params, **HYPER, fused=True)
    if name.startswith("torchao"):
        from torchao.optim import AdamW8bit, AdamWFp8, _AdamW

        if name == "torchao AdamW8bit":
            return AdamW8bit(params, **HYPER)  # type: ignore[no-any-return]
        if name == "torchao AdamWFp8":
            return AdamWFp8(params, **HYPER)  # type: ignore[no-any-return]
        return _AdamW(params, **HYPER, bf16_stochastic_round=True)  # type: ignore[no-any-return]
    if name == "bitsandbytes AdamW8bit":
        try:
            import bitsandbytes
        except ImportError:
            return None
        return bitsandbytes.optim.AdamW8bit(params, **HYPER)  # type: ignore[no-any-return]
    if name == "DeepSpeedCPUAdam":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception:  # ImportError, or its op failing to build without a compiler
            return None
        return DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True)  # type: ignore[no-any-return]
    raise ValueError(f"unknown peer {name!r}")


PEER_BYTES = {
    "torch fused fp32": 4 + 8 + 16,
    "torch fused bf16": 2 + 4 + 8,
    "torchao AdamW bf16 stochastic": 2 + 4 + 8,
    "torchao AdamWFp8": 4 + 8 + 4 * STATE_BYTES["fp8"],
    "torchao AdamW8bit": 4 + 8 + 4 * STATE_BYTES["int8"],
    "bitsandbytes AdamW8bit": 4 + 8 + 4 * STATE_BYTES["int8"],
    "DeepSpeedCPUAdam": 4 + 8 + 16,
}
PART_BYTES = {"host update": 4 + 8 + 16}
"""The master chunks' update alone: read the gradient, read and write master and moments."""
PEER_PARAM_DTYPE = {
    "torch fused bf16": torch.bfloat16,
    "torchao AdamW bf16 stochastic": torch.bfloat16,
}


def peer_case(name: str, shapes: list[torch.Size], training: bool = False) -> Case | None:
    params = _params(shapes, PEER_PARAM_DTYPE.get(name, torch.float32))
    opt = _peer_optimizer(name, params)
    if opt is None:
        return None
    return Case(
        name=name + (TRAINING if training else ""),
        params=params,
        step=opt.step,
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        bytes_per_param=PEER_BYTES[name],
        backward=(lambda loss: loss.backward()) if training else None,
    )


def linear_loss(params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """``sum((p * g).sum())``: its gradient with respect to each ``p`` is exactly ``g`` (the
    backward of a sum is ones, times ``g``: no rounding, in any dtype)."""
    return torch.stack([(p * g).sum().float() for p, g in zip(params, grads, strict=True)]).sum()


def check_linear_loss(grads: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Raise unless the backward of :func:`linear_loss` gives exactly ``grads`` in ``dtype``."""
    params = [torch.zeros(g.shape, dtype=dtype, requires_grad=True) for g in grads]
    wanted = [g.to(dtype) for g in grads]
    linear_loss(params, wanted).backward()
    for param, grad in zip(params, wanted, strict=True):
        if param.grad is None or not torch.equal(param.grad, grad):
            raise RuntimeError(f"the training loss's gradient is not the fixed gradient ({dtype})")


def _stepper(
    case: Case, grads: list[torch.Tensor], given: list[torch.Tensor]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The untimed ``prepare`` (fresh copies of ``grads`` into ``given``, and ``.grad`` or the
    loss) and the timed ``step`` (backward where the case has one, then ``step()``)."""
    loss: list[torch.Tensor] = []

    def prepare() -> None:
        case.zero_grad()
        given.clear()
        loss.clear()
        for param, grad in zip(case.params, grads, strict=True):
            given.append(grad.to(param.dtype, copy=True))
            if case.backward is None:
                param.grad = given[-1]
        if case.backward is not None:
            with torch.enable_grad():
                loss.append(linear_loss(case.params, given))

    def step() -> None:
        if case.backward is not None:
            case.backward(loss.pop())
        case.step()

    return prepare, step


def run_case(case: Case, grads: list[torch.Tensor], iters: int, clock: Any) -> list[float]:
    """``iters`` timed steps of ``case``, each on a fresh copy of ``grads``; flags the case if
    it wrote into the copy it was given."""
    given: list[torch.Tensor] = []
    prepare, step = _stepper(case, grads, given)
    times: list[float] = []
    for _ in range(iters):
        parts = list((case.parts or {}).values())
        before = [len(part) for part in parts]
        times += time_steps(prepare, step, CPU, 1, clock=clock)
        for part, begin in zip(parts, before, strict=True):  # a part called per chunk: sum
            part[begin:] = [sum(part[begin:])]
        for param, copy, grad in zip(case.params, given, grads, strict=True):
            if not torch.equal(copy, grad.to(param.dtype)):
                case.grads_kept = False
    return times


def main() -> None:
    import time

    parser = base_parser(__doc__ or "")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cells", default="", help="comma-separated cell names (default all)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument(
        "--modes",
        default="hand-set,training",
        help="hand-set (.grad set by hand, step() timed) and/or training (backward + step())",
    )
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler breakdown of dtypeplan's steps"
    )
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.rounds, args.warmup = 2, 256, 3, 2
    # DeepSpeed's op reads it when its OpenMP runtime starts (before the op loads).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    clock = {"wall": time.perf_counter, "thread": time.thread_time}[args.clock]
    wanted = {c.strip() for c in args.cells.split(",") if c.strip()}
    cells = [cell for cell in CELLS if not wanted or cell.name in wanted]
    shapes = [torch.Size((args.width, args.width))] * args.layers
    numel = sum(s.numel() for s in shapes)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    source = [g.clone() for g in grads]

    env = environment()
    notes: list[str] = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"hand-set", "training"}:
        raise ValueError(f"--modes takes hand-set and/or training, not {args.modes!r}")
    suffixes = [TRAINING if mode == "training" else "" for mode in modes]
    if TRAINING in suffixes:
        for dtype in (torch.float32, torch.bfloat16):
            check_linear_loss(grads, dtype)
    cases: dict[str, Case] = {}
    for cell in cells:
        for suffix in suffixes:
            case = dtypeplan_case(cell, shapes, training=bool(suffix))
            cases[case.name] = case
            if case.parts and not suffix:  # offloaded: also through the accelerator's pipeline
                staged = dtypeplan_case(cell, shapes, staged=True)
                cases[staged.name] = staged
            for peer in cell.peers:
                if peer + suffix in cases:
                    continue
                built = peer_case(peer, shapes, training=bool(suffix))
                if built is None:
                    if not suffix:
                        notes.append(f"{peer}: not installed here, its rows are left out")
                else:
                    cases[built.name] = built
    print(
        f"{len(cases)} cases, {numel / 1e6:.1f} M parameters, {args.threads} thread(s)", flush=True
    )
    for case in cases.values():  # first steps make the states and compile the peers' kernels
        run_case(case, grads, args.warmup, clock)
        for part in (case.parts or {}).values():
            part.clear()
    times: dict[str, list[float]] = {name: [] for name in cases}
    copy_times: list[float] = []
    src = torch.empty(max(numel, 1 << 24)).normal_()
    dst = torch.empty_like(src)
    for round_index in range(args.rounds):
        copy_times += time_steps(lambda: None, lambda: dst.copy_(src), CPU, 1, clock=clock)
        for name, case in cases.items():
            times[name] += run_case(case, grads, 1, clock)
            if not all(torch.equal(g, s) for g, s in zip(grads, source, strict=True)):
                raise RuntimeError(
                    f"{name} changed the shared source gradients (round {round_index})"
                )
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
    copy_bps = 2 * src.numel() * src.element_size() / (statistics.median(copy_times) * 1e-3)

    rows: list[dict[str, Any]] = []
    for cell, suffix in ((cell, suffix) for cell in cells for suffix in suffixes):
        peers = [p + suffix for p in cell.peers if p + suffix in cases]
        mine = cases[f"dtypeplan {cell.name}{suffix}"]
        timed = []
        part_bytes: dict[str, float | None] = {}
        for variant in (mine, cases.get(f"dtypeplan {cell.name}{STAGED}") if not suffix else None):
            if variant is None:
                continue
            timed.append((variant.name, variant, times[variant.name]))
            for part_name, part_times in (variant.parts or {}).items():
                timed.append((f"{variant.name} ({part_name})", variant, part_times))
                part_bytes[f"{variant.name} ({part_name})"] = PART_BYTES.get(part_name)
        timed += [(p, cases[p], times[p]) for p in peers]
        peer_ms = statistics.median(times[peers[0]]) if peers else None
        for method, timed_case, case_times in timed:
            ms = statistics.median(case_times)
            nbytes = part_bytes.get(method) or timed_case.bytes_per_param
            floor_ms = numel * nbytes / copy_bps * 1e3
            # A part of a step against the peer's backward + step compares nothing.
            like = peer_ms and not (suffix and method in part_bytes)
            rows.append(
                {
                    "cell": cell.name,
                    "method": method,
                    "ms": round(ms, 2),
                    "x peer": round(ms / peer_ms, 2) if like and peer_ms else None,
                    "B/param": round(nbytes, 2),
                    "x floor": round(ms / floor_ms, 2),
                    "grads kept": timed_case.grads_kept,
                }
            )
        if "DeepSpeedCPUAdam" in peers and not suffix:
            ds_case = cases["DeepSpeedCPUAdam"]
            diff = max(
                (a - b).abs().max().item() for a, b in zip(mine.params, ds_case.params, strict=True)
            )
            notes.append(
                f"{cell.name}: after the same {args.warmup + args.rounds} steps on the same "
                f"gradients, dtypeplan's parameters differ from DeepSpeedCPUAdam's by at most "
                f"{diff:.3g} (different fp32 operation order; parameters ~0.02)"
            )
    sections = []
    profile = _profile(cases, grads) if args.profile else ""
    if profile:
        sections.append(("Where dtypeplan's step time goes (torch.profiler)", profile))
    columns = ["cell", "method", "ms", "x peer", "B/param", "x floor", "grads kept"]
    table = format_table(rows, columns)
    print(table)
    config = {
        **vars(args),
        "numel": numel,
        "copy_bytes_per_s": copy_bps,
        "omp_threads": _omp_threads(),
    }
    summary = {
        row["method"].removeprefix("dtypeplan "): row["x peer"]
        for row in rows
        if row["method"].startswith("dtypeplan")
    }
    if profile:
        print(profile)
    if not args.no_write:
        # A run of some cells, or at other thread counts, must not overwrite the full table.
        name = "precision_peers" + "".join(f"_{_slug(c.name)}" for c in cells if wanted)
        name += "" if len(modes) == 2 else f"_{modes[0]}"
        name += f"_t{args.threads}" if args.threads != 1 else ""
        parts = {c.name: c.parts for c in cases.values() if c.parts}
        out = write_result(
            name,
            out=args.out,
            env=env,
            config=config,
            sections=[("Step time by cell, against its peer", table), *sections],
            data={"rows": rows, "times_ms": times, "parts_ms": parts, "copy_ms": copy_times},
            notes=notes,
        )
        _plot(rows, args, env, name)
        print(f"wrote {out}.md", flush=True)
    finish({"x_peer": summary, "notes": notes})


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _omp_threads() -> int | None:
    """Threads the process's OpenMP runtime (shared by torch and DeepSpeed's op) will use."""
    import ctypes

    try:
        return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())
    except OSError:
        return None


def _profile(cases: dict[str, Case], grads: list[torch.Tensor]) -> str:
    """Self CPU ms per step by op (top 12) of each dtypeplan case, over 3 steps (as timed:
    ``step()``, or ``backward + step()`` as in training)."""
    from torch.profiler import ProfilerActivity, profile

    sections = []
    for case in cases.values():
        if not case.name.startswith("dtypeplan"):
            continue
        given: list[torch.Tensor] = []
        prepare, step = _stepper(case, grads, given)
        totals: dict[str, list[float]] = {}  # op -> [calls, self microseconds]
        for _ in range(3):
            prepare()
            with profile(activities=[ProfilerActivity.CPU]) as prof:  # the timed part alone
                step()
            for e in prof.key_averages():
                total = totals.setdefault(e.key, [0.0, 0.0])
                total[0] += e.count
                total[1] += e.self_cpu_time_total
        ranked = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)
        everything = sum(us for _, us in totals.values())
        timed = "backward + `opt.step()`" if case.backward else "`opt.step()` alone"
        lines = [f"{case.name}: {timed}, 3 steps, {everything / 3e3:.1f} ms / step", ""]
        lines += ["| op | calls / step | self ms / step | share |", "| --- | --- | --- | --- |"]
        for key, (calls, us) in ranked[:12]:
            lines.append(f"| {key} | {calls / 3:g} | {us / 3e3:.1f} | {us / everything:.0%} |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _plot(rows: list[dict[str, Any]], args: Any, env: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [
        r
        for r in rows
        if r["method"] in (f"dtypeplan {r['cell']}", f"dtypeplan {r['cell']}{TRAINING}")
        and r["x peer"] is not None
    ]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(mine) + 1.5))
    colors = ["tab:orange" if r["method"].endswith(TRAINING) else "tab:blue" for r in mine]
    ax.barh(
        [r["method"].removeprefix("dtypeplan ") for r in mine],
        [r["x peer"] for r in mine],
        color=colors,
    )
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("dtypeplan step time / peer step time (log; 1 = as fast as the peer)")
    ax.invert_yaxis()
    save_figure(fig, args.out, name, env["date"])


if __name__ == "__main__":
    main()
