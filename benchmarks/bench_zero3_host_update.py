"""ZeRO-3 with the optimizer offloaded: the host update against torch's fused CPU AdamW.

    python3 -m benchmarks.bench_zero3_host_update [--hidden 512] [--blocks 2] [--steps 7]
                                                  [--dry-run]

One process, a 1-rank gloo group (FSDP2 needs one), ZeRO-3 with ``offload_optimizer: cpu``
alone (``dtypeplan/optimizers/fsdp2/host_update.py``): bf16 parameters, fp32 accumulation,
fp32 host masters, AdamW, no clipping. The model is ``--blocks`` blocks of Linear layers
(``benchmarks/gpu/bench_engine_step.py``'s ``Block``, 12 ``hidden**2`` parameters each).

Timed, median of ``--steps`` after one warm-up step, at ``torch.get_num_threads()`` threads:

* ``dtypeplan host update``: ``HostUpdate.step`` (every reduced gradient shard copied into a
  pinned-or-not host slot, the fused CPU AdamW call on its fp32 host master, the master copied
  back into FSDP2's shard), inside ``opt.step()``;
* ``of which the fused AdamW calls``: the kernel calls alone (one per local shard), the rest
  of the host update being its copies;
* ``dtypeplan opt.step()``: the whole step (the summary all-reduce on one rank is trivial);
* ``torch fused AdamW``: ``torch.optim.AdamW(fused=True)`` stepping fp32 CPU tensors shaped
  like the shards, given the same gradients as dtypeplan each step: the peer the host update
  is measured against (DeepSpeedCPUAdam is not installed here; the ZeRO 1-2 offload was 1.00x
  of it in benchmarks/bench_precision_peers.py).

The peer's parameters after the run must equal dtypeplan's host masters bit for bit (the same
fused kernel on the same fp32 values). On the CPU the "device" is the host: the host update's
copies (gradient down, master up) are memory copies on the same cores, what the ratio
includes beyond the kernel. ``--dry-run``: tiny sizes. Writes
``results/zero3_host_update-<date>.json/.md`` and prints one JSON line last.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from benchmarks._common import base_parser, environment, finish, format_table, write_result
from benchmarks.gpu.bench_engine_step import Block
from dtypeplan.optimizers.fsdp2.host_update import HostUpdate
from dtypeplan.optimizers.kernels.torch_adam import FlatAdamUpdate

LR, WEIGHT_DECAY = 1e-3, 0.01


def _config() -> dict[str, Any]:
    return {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": "fp32",
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: Any) -> dict[str, Any]:
    plan = dtypeplan.resolve(_config())
    assert plan.status == "OK" and plan.rule_id == "zero3-offload-optimizer", plan.explain()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(args.hidden, 4) for _ in range(args.blocks)))
    model = plan.prepare_model(model)
    opt = plan.build(model.parameters())
    assert opt.host_update is not None
    masters = [m for group in opt.host_update.masters for m in group]
    peer_params = [m.detach().clone() for m in masters]
    peer = torch.optim.AdamW(peer_params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    update_s: list[float] = []
    kernel_s: list[float] = []
    real_step, real_bucket = HostUpdate.step, FlatAdamUpdate.bucket

    def timed(self: HostUpdate, *a: Any, **k: Any) -> None:
        kernel_s.append(0.0)
        begin = time.perf_counter()
        real_step(self, *a, **k)
        update_s.append(time.perf_counter() - begin)

    def timed_bucket(self: FlatAdamUpdate, *a: Any, **k: Any) -> None:
        begin = time.perf_counter()
        real_bucket(self, *a, **k)
        kernel_s[-1] += time.perf_counter() - begin

    step_s, peer_s = [], []
    HostUpdate.step = timed  # type: ignore[method-assign]
    FlatAdamUpdate.bucket = timed_bucket  # type: ignore[method-assign]
    try:
        for _ in range(args.steps + 1):
            opt.backward(model(x.bfloat16()).float().square().mean())
            grads = [p.grad.to_local().detach().float().clone() for p in model.parameters()]
            begin = time.perf_counter()
            opt.step()
            step_s.append(time.perf_counter() - begin)
            opt.zero_grad()
            for param, grad in zip(peer_params, grads, strict=True):
                param.grad = grad
            begin = time.perf_counter()
            peer.step()
            peer_s.append(time.perf_counter() - begin)
            peer.zero_grad()
    finally:
        HostUpdate.step = real_step  # type: ignore[method-assign]
        FlatAdamUpdate.bucket = real_bucket  # type: ignore[method-assign]
    same = all(torch.equal(a, b) for a, b in zip(masters, peer_params, strict=True))
    return {
        "num_params": sum(m.numel() for m in masters),
        "host_update_s": statistics.median(update_s[1:]),
        "host_kernel_s": statistics.median(kernel_s[1:]),
        "step_s": statistics.median(step_s[1:]),
        "peer_s": statistics.median(peer_s[1:]),
        "bitwise_equal": same,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (logic only)")
    args = parser.parse_args()
    args.hidden = args.hidden or (64 if args.dry_run else 512)
    if args.dry_run:
        args.steps = 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    ratio = result["host_update_s"] / result["peer_s"]
    rows = [
        {"run": "torch fused AdamW (peer)", "ms": result["peer_s"] * 1e3, "x peer": 1.0},
        {"run": "dtypeplan host update", "ms": result["host_update_s"] * 1e3, "x peer": ratio},
        {
            "run": "  of which the fused AdamW calls",
            "ms": result["host_kernel_s"] * 1e3,
            "x peer": result["host_kernel_s"] / result["peer_s"],
        },
        {
            "run": "dtypeplan opt.step()",
            "ms": result["step_s"] * 1e3,
            "x peer": result["step_s"] / result["peer_s"],
        },
    ]
    table = format_table(rows, formats={"ms": "{:.2f}", "x peer": "{:.2f}"})
    print(table)
    summary = {"ok": result["bitwise_equal"], "host_update_over_peer": ratio, **result}
    if not args.no_write:
        name = "zero3_host_update" + ("_dryrun" if args.dry_run else "")
        write_result(
            name,
            out=args.out,
            env=environment(),
            config={
                "hidden": args.hidden,
                "blocks": args.blocks,
                "tokens": args.tokens,
                "steps": args.steps,
                "num_params": result["num_params"],
                "torch_threads": torch.get_num_threads(),
                "dtypeplan_config": _config(),
            },
            sections=[("the update, median of the timed steps", table)],
            data=summary,
            notes=[
                "dtypeplan's host masters after the run equal the peer's parameters bit for "
                f"bit: {result['bitwise_equal']} (the same fused kernel on the same values).",
                "On the CPU the host is the device: the host update's gradient and master "
                "copies are memory copies on the same cores and count in its time.",
            ],
        )
    finish(summary)


if __name__ == "__main__":
    main()
