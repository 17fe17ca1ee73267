"""``dtypeplan plan``: the command line's planning subcommand (its arguments are in ``cli.py``).

Exit codes: 0 some combination fits, 1 none does (the closest are shown), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["EXIT_FITS", "EXIT_INPUT", "EXIT_NONE_FITS", "run"]

EXIT_FITS = 0
EXIT_NONE_FITS = 1
EXIT_INPUT = 2


def run(args: argparse.Namespace) -> int:
    """Plan for ``args`` (see ``cli.py``'s ``plan`` parser) and print the answer."""
    from dtypeplan.planner import Fleet, parse_bandwidth, parse_size, plan_for
    from dtypeplan.planner.enumeration import stderr_progress
    from dtypeplan.planner.report import as_json, describe, plot_front, write_config

    started = time.perf_counter()
    try:
        if (args.model is None) == (args.params is None):
            raise ValueError(
                "give the model as --model CONFIG (a config.json or its "
                "directory) or its size as --params N, one of them"
            )
        fleet = Fleet(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory=parse_size(args.gpu_memory),
            host_memory=parse_size(args.host_memory) if args.host_memory else None,
            intra_node_bandwidth=parse_bandwidth(args.intra_node),
            inter_node_bandwidth=parse_bandwidth(args.inter_node),
            host_link_bandwidth=parse_bandwidth(args.host_link),
            gpu_flops=float(args.gpu_flops),
            native_mxfp8=args.mxfp8,
        )
        planning = plan_for(
            args.model if args.model is not None else args.params,
            fleet,
            optimizer=args.optimizer,
            micro_batch=args.batch,
            seq=args.seq,
            micro_batches=args.micro_batches,
            recompute=args.recompute,
            objective=args.objective,
            max_drift=args.max_drift,
            rules=args.rules,
            progress=None if args.quiet else stderr_progress,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INPUT
    if args.json:
        print(json.dumps(as_json(planning, args.top), indent=2))
    else:
        print(describe(planning, args.top))
    if planning.ok_points == 0:
        print(_no_ok_combination(planning.optimizer, args.rules), file=sys.stderr)
        return EXIT_NONE_FITS
    if not planning.fitting:
        return EXIT_NONE_FITS
    if args.write:
        write_config(planning, args.write)
        print(f"wrote {args.write}: the config of #1 (dtypeplan check {args.write} explains it)")
    if args.plot:
        try:
            plot_front(planning, args.plot)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_INPUT
        print(f"drew {args.plot}")
    if not args.quiet:
        print(f"planned in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return EXIT_FITS


def _no_ok_combination(optimizer: str, rules: str | None) -> str:
    from dtypeplan._api import resolve

    plan = resolve({"optimizer": {"type": optimizer}}, rules=rules)
    return (
        f"the table has no OK combination for optimizer {optimizer}: {plan.rule_id}: {plan.reason}"
    )
