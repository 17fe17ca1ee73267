"""Bytes on the wire per step per rank, counted at the collectives, against theory.

    python -m benchmarks.bench_comm [--quick]

A bf16 MLP with an fp32 accumulator is trained on 2 and 4 gloo ranks for every communication
dtype (fp32, bf16, fp16; the 16-bit ones both as a plain collective and as ``fp32_sum``), ZeRO
stage 0/1/2 with a whole or sharded accumulator, and 1 or 4 micro-batches per step, with the
default bucket size and with small buckets (more padding).

Two counts of one step (all micro-batches' backward and ``step()``):

* ``opt.comm.stats`` (``CommStats``, reset right before the step), and
* an independent count: the flat collectives of ``torch.distributed`` that the Communicator
  calls are wrapped in the rank process, and every call records the dtype and size of the
  tensor it was handed; bytes are then counted with the ring formula ((N-1)/N of the buffer for
  a reduce-scatter, all-gather or all-to-all, twice that for an all-reduce).

Theory per step per rank, for n parameters, N ranks, wire bytes c, parameter bytes p and m
micro-batches: stage 0 all-reduce 2 (N-1)/N n c; stage 1 with a whole accumulator one
reduce-scatter (N-1)/N n c plus one all-gather (N-1)/N n p; a sharded accumulator
reduce-scatters once per micro-batch, m (N-1)/N n c, plus the all-gather. The ratio
measured/theory exceeds 1 only by bucket padding, reported as padded/n.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
import dtypeplan.comm._collectives as collectives
from benchmarks._common import base_parser, environment, finish, format_table, write_result
from benchmarks.bench_memory import make_model
from dtypeplan.launch import spawn

WIRES = (
    ("fp32", "collective"),
    ("bf16", "collective"),
    ("bf16", "fp32_sum"),
    ("fp16", "collective"),
    ("fp16", "fp32_sum"),
)
STAGES = ((0, False), (1, False), (1, True), (2, True))
MICRO_BATCHES = (1, 4)
SMALL_BUCKET = 1 << 16
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def all_cases() -> list[dict[str, Any]]:
    cases = []
    for wire, method in WIRES:
        for stage, sharded in STAGES:
            for micro in MICRO_BATCHES:
                for bucket in (None, SMALL_BUCKET):
                    if bucket is not None and (wire, method) != ("bf16", "collective"):
                        continue
                    cases.append(
                        {
                            "wire": wire,
                            "method": method,
                            "stage": stage,
                            "sharded": sharded,
                            "micro": micro,
                            "bucket": bucket,
                        }
                    )
    return cases


def case_config(case: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case["stage"]}
    if case["bucket"] is not None:
        zero["reduce_bucket_size"] = case["bucket"]
    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": case["sharded"]},
        "communication_data_type": case["wire"],
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if case["method"] != "collective":
        config["communication_reduction"] = case["method"]
    return config


def theory_bytes(case: dict[str, Any], n: int, world: int) -> int:
    """Bytes one rank sends in one step by the ring count, for ``n`` elements."""
    wire, param = ITEMSIZE[case["wire"]], 2
    ring = (world - 1) / world
    if case["stage"] == 0:
        return round(2 * ring * n * wire)
    reduce_scatters = case["micro"] if case["sharded"] else 1
    return round(reduce_scatters * ring * n * wire + ring * n * param)


class _Interceptor:
    """Wraps the torch.distributed collectives the Communicator calls; counts what they carry."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.dtypes: dict[str, set[str]] = defaultdict(set)
        self.scalar_bytes = 0
        self.enabled = False
        self._saved: dict[tuple[Any, str], Any] = {}

    def _wrap(self, owner: Any, name: str, op: str, which: int, factor: int) -> None:
        original = getattr(owner, name)
        self._saved[(owner, name)] = original

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.enabled:
                tensor = args[which]
                nbytes = tensor.numel() * tensor.element_size()
                # Buckets hold at least 64 * N elements; anything smaller is the norm scalar.
                if op == "all_reduce" and tensor.numel() < 64:
                    self.scalar_bytes += factor * nbytes * (self.world - 1) // self.world
                else:
                    self.calls[op] += 1
                    self.bytes[op] += factor * nbytes * (self.world - 1) // self.world
                    self.dtypes[op].add(str(tensor.dtype).removeprefix("torch."))
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    def install(self) -> None:
        # Arguments: all_reduce(tensor), all_to_all_single(output, input),
        # reduce_scatter(output, input), all_gather(output, input); count the full buffer.
        self._wrap(dist, "all_reduce", "all_reduce", 0, 2)
        self._wrap(dist, "all_to_all_single", "all_to_all", 1, 1)
        self._wrap(collectives, "_reduce_scatter_flat", "reduce_scatter", 1, 1)
        self._wrap(collectives, "_all_gather_flat", "all_gather", 0, 1)

    def uninstall(self) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.dtypes.clear()
        self.scalar_bytes = 0


def run_case(
    case: dict[str, Any], widths: list[int], rank: int, world: int, spy: _Interceptor
) -> dict[str, Any]:
    plan = dtypeplan.resolve(case_config(case))
    if plan.status != "OK":
        return {"status": str(plan.status), "reason": plan.reason}
    model = copy.deepcopy(make_model(widths))
    n = sum(p.numel() for p in model.parameters())
    opt = plan.build(model.parameters())
    generator = torch.Generator().manual_seed(rank)

    def one_step() -> None:
        for _ in range(case["micro"]):
            x = torch.randn(8, widths[0], generator=generator).to(torch.bfloat16)
            opt.backward(model(x).float().pow(2).mean() / case["micro"])
        opt.step()
        opt.zero_grad()

    one_step()  # warm-up: lazily built state must not be counted
    opt.comm.stats.reset()
    spy.reset()
    spy.enabled = True
    one_step()
    spy.enabled = False
    stats = opt.comm.stats
    return {
        "status": "OK",
        "n": n,
        "padded": sum(s.flat.numel for s in opt.groups),
        "buckets": sum(len(s.flat.buckets) for s in opt.groups),
        "stats_bytes": stats.total_bytes,
        "stats_calls": dict(stats.calls),
        "stats_by_op": dict(stats.bytes_sent),
        "spy_bytes": sum(spy.bytes.values()),
        "spy_calls": dict(spy.calls),
        "spy_dtypes": {k: sorted(v) for k, v in spy.dtypes.items()},
        "scalar_bytes": spy.scalar_bytes,
    }


def _rank_worker(
    rank: int, world: int, cases: list[dict[str, Any]], widths: list[int]
) -> list[dict[str, Any]]:
    spy = _Interceptor(world)
    spy.install()
    try:
        return [run_case(case, widths, rank, world, spy) for case in cases]
    finally:
        spy.uninstall()


def _label(case: dict[str, Any]) -> str:
    acc = "shard" if case["sharded"] else "whole"
    bucket = "default" if case["bucket"] is None else str(case["bucket"])
    return f"z{case['stage']} {acc} {case['wire']}/{case['method']} m={case['micro']} b={bucket}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    # Widths that are not multiples of 64 leave padding to report.
    widths = [127, 500, 250, 125] if args.quick else [255, 1000, 500, 250]
    worlds = (2,) if args.quick else (2, 4)
    cases = all_cases()
    env = environment()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for world in worlds:
        per_rank = spawn(_rank_worker, world, cases, widths, timeout_s=900)
        for index, case in enumerate(cases):
            results = [r[index] for r in per_rank]
            first = results[0]
            if first["status"] != "OK":
                skipped.append(f"N={world} {_label(case)}: {first['status']}")
                continue
            n, padded = first["n"], first["padded"]
            theory = theory_bytes(case, n, world)
            theory_padded = theory_bytes(case, padded, world)
            stats_bytes = max(r["stats_bytes"] for r in results)
            spy_bytes = max(r["spy_bytes"] for r in results)
            calls = first["stats_calls"]
            rows.append(
                {
                    "N": world,
                    "stage": case["stage"],
                    "accum": "sharded" if case["sharded"] else "whole",
                    "wire": case["wire"],
                    "method": case["method"],
                    "micro": case["micro"],
                    "bucket": "default" if case["bucket"] is None else case["bucket"],
                    "buckets": first["buckets"],
                    "calls": " ".join(f"{k}:{v}" for k, v in sorted(calls.items())),
                    "wire dtypes": " ".join(
                        f"{k}:{'/'.join(v)}" for k, v in sorted(first["spy_dtypes"].items())
                    ),
                    "theory MB": theory / 1e6,
                    "stats MB": stats_bytes / 1e6,
                    "stats/theory": stats_bytes / theory,
                    "intercepted/theory": spy_bytes / theory,
                    "padding": padded / n,
                    "stats/theory(padded)": stats_bytes / theory_padded,
                    "scalar B": max(r["scalar_bytes"] for r in results),
                }
            )
    columns = list(rows[0])
    ratio = "{:.5f}"
    table = format_table(
        rows,
        columns,
        formats={
            "stats/theory": ratio,
            "intercepted/theory": ratio,
            "padding": ratio,
            "stats/theory(padded)": ratio,
        },
    )
    print(
        f"model: bf16 MLP {widths}, {first['n']} parameters, "
        "fp32 accumulation; bytes sent per rank in one step"
    )
    print(table)
    exact = [abs(r["stats/theory(padded)"] - 1.0) < 1e-4 for r in rows]
    agree = [abs(r["intercepted/theory"] - r["stats/theory"]) < 1e-4 for r in rows]
    summary = {
        "benchmark": "comm",
        "cases": len(rows),
        "num_params": first["n"],
        "all_exact_after_padding": all(exact),
        "stats_agree_with_intercepted": all(agree),
        "max_stats_over_theory": round(max(r["stats/theory"] for r in rows), 5),
        "max_padding": round(max(r["padding"] for r in rows), 5),
        "scalar_bytes_per_step_max": max(r["scalar B"] for r in rows),
    }
    if not args.no_write:
        notes = [
            "theory counts the unpadded parameters; stats/theory(padded) uses the padded "
            "buffer and must be exactly 1.",
            "intercepted = sizes of the tensors handed to torch.distributed, counted with the "
            "same ring formula; it agrees with CommStats in every row "
            f"({all(agree)}).",
            "scalar B: the one-element all-reduce of the squared gradient norm per step, "
            "which CommStats does not count (4 bytes of fp32 per step).",
            "Bytes are the ring algorithm's count (what NCCL's ring sends); gloo's actual "
            "algorithm on CPU may send more or less, which this does not measure.",
            *skipped,
        ]
        write_result(
            "comm",
            out=args.out,
            env=env,
            config={
                "model": f"bf16 MLP {widths}",
                "num_params": first["n"],
                "accumulation": "fp32",
                "world_sizes": list(worlds),
                "small_bucket": SMALL_BUCKET,
                "quick": args.quick,
            },
            sections=[("Bytes sent per rank per step", table)],
            data={"rows": rows, "summary": summary, "skipped": skipped},
            notes=notes,
        )
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
