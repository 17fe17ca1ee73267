"""The ``dtypeplan`` command line: ``check``, ``table``, ``lint``, ``demo``, ``docs``,
``run`` and ``plan``.

Exit codes: 0 the config is OK (or the command succeeded), 1 the combination is NotSupported
(``demo``: the config is not OK), 2 a bad config or rules file, an Error combination, or a
usage error, 3 a demo rank failed, 141 the reader of the output closed it early (``check``
exits with its verdict then, and prints no traceback either).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dtypeplan.errors import NotSupportedError, PrecisionConfigError, RulesError

if TYPE_CHECKING:
    from dtypeplan.resolver import PrecisionPlan

__all__ = ["main", "parse_count"]

EXIT_OK = 0
EXIT_NOT_SUPPORTED = 1
EXIT_ERROR = 2
EXIT_RANK_FAILED = 3
EXIT_READER_GONE = 141
"""128 + SIGPIPE: what a shell reports for a tool that the closed reader of its output
stopped (``check`` keeps its verdict instead)."""

DEFAULT_PARAMS = 1_000_000_000
DEFAULT_WORLD_SIZE = 8

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"7B"``, ``"1.3b"``, ``"125M"``, ``"7e9"`` or ``"7_000_000_000"`` as an int."""
    match = re.fullmatch(
        r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower()
    )
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count (examples: 125M, 1.3B, 7e9, 1000000)"
        )
    value = float(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2)]
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _positive(text: str) -> int:
    value = parse_count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _import_modules(names: Sequence[str]) -> None:
    """Import the modules that register a custom rules file's implementations."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise RulesError(f"cannot import {name!r} (--import): {exc}") from None


# --- commands ----------------------------------------------------------------------------------
_PRECISION_AUTO = ("bf16.enabled", "fp16.enabled")
_CHOICES = ("fp32", "fp16", "bf16")


def _auto_fill(text: str) -> tuple[str, Any]:
    """``--auto PATH=VALUE``: VALUE is read as JSON (true, 1.0, [0.9, 0.95]), else as a string."""
    path, sep, value = text.partition("=")
    if not sep or not path.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PATH=VALUE (example: --auto bf16.enabled=true)"
        )
    try:
        return path.strip(), json.loads(value)
    except json.JSONDecodeError:
        return path.strip(), value


def _precision_choices(
    plan: PrecisionPlan, fills: dict[str, Any]
) -> list[tuple[str, dict[str, bool]]]:
    """For "auto" precision keys nothing filled: the fills that give fp32, fp16 and bf16, each
    consistent with the precision keys ``--auto`` did fill (``--auto bf16.enabled=true`` leaves
    one choice, bf16)."""
    unfilled = [
        a.path for a in plan.auto_values if a.path in _PRECISION_AUTO and a.source != "auto="
    ]
    if not unfilled:
        return []
    choices = []
    for choice in _CHOICES:
        wanted = {path: path.startswith(choice) for path in _PRECISION_AUTO}
        if any(bool(fills[path]) != wanted[path] for path in _PRECISION_AUTO if path in fills):
            continue
        choices.append((choice, {path: wanted[path] for path in unfilled}))
    return choices


def _shown_precision(plan: PrecisionPlan) -> str:
    """What a plan's parameters really are, for its heading."""
    from dtypeplan._dtypes import dtype_name

    return dtype_name(plan.param_dtype)


def _world_size(plan: PrecisionPlan, given: int | None) -> int:
    """The data-parallel world of the figures: ``--world-size``, which the shard group size
    must divide (an error naming both numbers), else 8, or two shard groups where the shard
    group size does not divide 8."""
    from dtypeplan.comm._groups import check_shard_group_size

    if given is not None:
        check_shard_group_size(plan.shard_group_size, given)
        return given
    size = plan.shard_group_size
    if size is None or DEFAULT_WORLD_SIZE % size == 0 and size < DEFAULT_WORLD_SIZE:
        return DEFAULT_WORLD_SIZE
    return 2 * size


def _print_plan(plan: PrecisionPlan, args: argparse.Namespace) -> dict[str, Any]:
    from dtypeplan import Status
    from dtypeplan.report import memory_layout, memory_report

    args = argparse.Namespace(**{**vars(args), "world_size": _world_size(plan, args.world_size)})
    memory, no_memory = None, "the combination is an Error"
    traffic = None
    if plan.status != Status.ERROR:
        try:
            traffic = plan.traffic(args.params, args.world_size)
            memory = plan.memory(args.params, args.world_size)
        except NotSupportedError as exc:  # offload: no device figure would be true
            no_memory = str(exc)
        except PrecisionConfigError as exc:  # the fp8 all-gather: the figures need the model
            no_memory = str(exc)
    data = plan.to_dict()
    data["memory"] = (
        None
        if memory is None
        else {
            "num_params": args.params,
            "world_size": args.world_size,
            "bytes_per_rank": memory,
            "bytes_per_param": {
                k: (v / args.params if args.params else None) for k, v in memory.items()
            },
        }
    )
    data["traffic"] = None if traffic is None else traffic.to_dict()
    steps = plan.accumulation_steps(args.world_size)
    data["micro_batches_per_step"] = None if steps is None else steps.micro_batches
    data["batch_size_mismatch"] = plan.batch_size_mismatch(args.world_size)
    if not args.json:
        print(plan.explain())
        print()
        counted = "not counted: the loop decides" if steps is None else steps.micro_batches
        print(f"micro-batches per step on {args.world_size} data-parallel ranks: {counted}")
        if data["batch_size_mismatch"]:
            print(f"warning: {data['batch_size_mismatch']}")
        if memory is None:
            print(f"memory: not estimated, {no_memory}")
        else:
            if plan.status == Status.NOT_SUPPORTED:
                print("(not supported: the figures are what the plan would take)")
            layout = memory_layout(plan, args.world_size)
            print(memory_report(memory, args.params, args.world_size, layout=layout))
        if traffic is not None:
            print(traffic.report())
    return data


def _exit_code(plan: PrecisionPlan) -> int:
    from dtypeplan import Status

    if plan.status == Status.OK:
        return EXIT_OK
    return EXIT_NOT_SUPPORTED if plan.status == Status.NOT_SUPPORTED else EXIT_ERROR


def _cmd_check(args: argparse.Namespace) -> int:
    """Resolve, print, and exit with the verdict: that of the plan, or with unfilled "auto"
    precision keys the worst of the choices shown. The verdict stands when the reader of the
    output closes it early (``check ... | head``): the rest goes nowhere, quietly."""
    from dtypeplan import resolve

    fills = dict(args.auto)
    plan = resolve(
        args.config,
        pipeline_parallel=args.pipeline,
        rules=args.rules,
        auto=fills,
        strict=args.strict,
    )
    # The precision keys are "auto" and nothing fills them: the run's dtypes are the
    # launcher's choice, so show the plan of each (the exit code is the worst of them).
    choices = [
        (
            choice,
            extra,
            resolve(
                args.config,
                pipeline_parallel=args.pipeline,
                rules=args.rules,
                auto={**fills, **extra},
                strict=args.strict,
            ),
        )
        for choice, extra in _precision_choices(plan, fills)
    ]
    verdict = max(_exit_code(p) for p in [c[2] for c in choices] or [plan])
    try:
        _print_check(plan, choices, args)
        sys.stdout.flush()
    except BrokenPipeError:
        _output_closed()
    return verdict


def _print_check(
    plan: PrecisionPlan,
    choices: list[tuple[str, dict[str, bool], PrecisionPlan]],
    args: argparse.Namespace,
) -> None:
    if not choices:
        data = _print_plan(plan, args)
        if args.json:
            print(json.dumps(data, indent=2))
        return
    results = []
    for choice, extra, choice_plan in choices:
        setting = " ".join(f"--auto {k}={str(v).lower()}" for k, v in extra.items())
        shown = _shown_precision(choice_plan)
        if not args.json:
            print(f"=== {shown} parameters ({setting}): {choice_plan.status.value} ===")
        results.append(
            {
                "choice": choice,
                "param_dtype": shown,
                "auto": extra,
                "plan": _print_plan(choice_plan, args),
            }
        )
        if not args.json:
            print()
    if args.json:
        print(json.dumps({"auto_choices": results}, indent=2))
    else:
        print(
            'the precision keys are "auto": each choice is shown above; without --auto, '
            "resolve() takes the HF Trainer default (fp32). The exit code is the worst of them."
        )


def _output_closed() -> None:
    """The reader of stdout went away (``| head``): what is left to print, and the
    interpreter's flush at exit, go to the null device instead of raising BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file stream
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _cmd_table(args: argparse.Namespace) -> int:
    from dtypeplan import load_rules
    from dtypeplan.table import render_markdown

    print(render_markdown(load_rules(args.rules)), end="")
    return EXIT_OK


def _cmd_lint(args: argparse.Namespace) -> int:
    from dtypeplan import load_rules
    from dtypeplan.resolver import COMBINATIONS

    table = load_rules(args.rules)
    print(
        f"ok: {len(table.gates)} gates and {len(table.grid)} rules decide each of "
        f"{COMBINATIONS} combinations once; every OK rule stays inside what its "
        "implementation declares it serves"
    )
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    from dtypeplan import load_rules
    from dtypeplan.resolver._diff import differences, verdict_regions

    old, new = (None if path == "shipped" else path for path in (args.old, args.new))
    found = differences(verdict_regions(load_rules(old)), verdict_regions(load_rules(new)))
    for difference in found:
        print(difference.text())
    total = sum(d.combinations for d in found)
    print(f"{len(found)} boxes, {total} combinations decided otherwise" if found else "same")
    return EXIT_NOT_SUPPORTED if found else EXIT_OK


def _cmd_docs(args: argparse.Namespace) -> int:
    from dtypeplan.docs_pages import run

    return run(args.root, write_pages=args.write)


def _cmd_demo(args: argparse.Namespace) -> int:
    from dtypeplan.demo import run_demo

    return run_demo(
        config=args.config,
        world_size=args.world_size,
        steps=args.steps,
        micro_batches=args.micro_batches,
    )


_RANK_MODULE = "dtypeplan.integrations.hf_trainer_run"


def _cmd_plan(args: argparse.Namespace) -> int:
    from dtypeplan.planner.command import run

    return run(args)


def _cmd_run(args: argparse.Namespace) -> int:
    """``dtypeplan run [torchrun options] SCRIPT [ARGS]``: torchrun, each rank running SCRIPT
    unedited with ``transformers.Trainer`` on dtypeplan (``--deepspeed CONFIG`` its config).
    The exit code is torchrun's."""
    import subprocess

    from torch.distributed.run import get_args_parser

    argv = list(args.torchrun_argv)
    parser = get_args_parser()
    parser.prog = "dtypeplan run"
    parser.usage = "dtypeplan run [torchrun options] SCRIPT [SCRIPT ARGS, e.g. --deepspeed ds.json]"
    parser.description = (
        "torchrun with these options, each rank running SCRIPT (or -m MODULE) unedited with "
        "transformers.Trainer as dtypeplan's DtypeplanTrainer and TrainingArguments' "
        "--deepspeed CONFIG as its dtypeplan config (DeepSpeed is not enabled). The exit code "
        "is torchrun's. torchrun's options:"
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return EXIT_OK if argv else EXIT_ERROR
    try:
        parsed = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    if parsed.no_python:
        print("error: dtypeplan run: --no-python runs no Python script to start", file=sys.stderr)
        return EXIT_ERROR
    script_at = len(argv) - 1 - len(parsed.training_script_args)
    options = [a for a in argv[:script_at] if a not in ("-m", "--module")]
    rank = ["-m", _RANK_MODULE, *(["-m"] if parsed.module else []), parsed.training_script]
    command = [sys.executable, "-m", "torch.distributed.run", *options, *rank]
    try:
        return subprocess.call([*command, *parsed.training_script_args])
    except KeyboardInterrupt:
        return 130


# --- parser ------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtypeplan",
        description="Explicit mixed-precision plans for distributed training.",
        epilog="exit codes: 0 OK, 1 NotSupported, 2 Error or invalid input, 3 a demo rank failed",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_import(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--import",
            dest="imports",
            action="append",
            default=[],
            metavar="MODULE",
            help="import MODULE first, so that the implementations it registers are known "
            "(repeatable)",
        )

    check = commands.add_parser(
        "check",
        help="resolve a config: explain the plan and predict memory",
        description="Resolve CONFIG, print plan.explain() and the predicted bytes per rank. "
        "Exit 0 for OK, 1 for NotSupported, 2 for Error or an invalid config. When bf16/fp16 "
        '"enabled" are "auto" and no --auto fills them, the plan of each choice (fp32, fp16, '
        "bf16) is printed and the exit code is the worst of theirs.",
    )
    check.add_argument("config", metavar="CONFIG", help="a DeepSpeed-style .json or .yaml config")
    check.add_argument("--pipeline", action="store_true", help="the run uses pipeline parallelism")
    check.add_argument(
        "--world-size",
        type=_positive,
        default=None,
        metavar="N",
        help="data-parallel ranks for the memory and traffic figures; a shard_group_size "
        f"must divide it (default {DEFAULT_WORLD_SIZE}, or two shard groups where the shard "
        f"group size does not divide {DEFAULT_WORLD_SIZE})",
    )
    check.add_argument(
        "--params",
        type=parse_count,
        default=DEFAULT_PARAMS,
        metavar="N",
        help="model parameters for the memory and traffic figures, e.g. 125M, 7B (default 1B)",
    )
    check.add_argument("--rules", metavar="FILE", help="a rules file instead of the shipped one")
    check.add_argument(
        "--json", action="store_true", help="print plan.to_dict() and memory as JSON"
    )
    check.add_argument(
        "--auto",
        type=_auto_fill,
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help='fill an "auto" value of the config, e.g. --auto bf16.enabled=true --auto '
        "gradient_clipping=1.0 (VALUE is JSON; repeatable). Unfilled ones take the HF "
        'Trainer defaults; if bf16/fp16 "enabled" stay "auto", the plan of each choice '
        "(fp32, fp16, bf16) is shown",
    )
    check.add_argument(
        "--strict",
        action="store_true",
        help="unknown keys anywhere are errors (default: an unknown top-level key is a warning)",
    )
    add_import(check)
    check.set_defaults(handler=_cmd_check)

    table = commands.add_parser(
        "table",
        help="print the rules table as markdown",
        description="Print every rule, then the status of each parameter dtype x accumulation "
        "dtype x ZeRO stage x pipeline cell, a grid for each feature with OK cells, and each "
        "feature value's deciding rules, as markdown.",
    )
    table.add_argument("--rules", metavar="FILE", help="a rules file instead of the shipped one")
    add_import(table)
    table.set_defaults(handler=_cmd_table)

    lint = commands.add_parser(
        "lint",
        help="check a rules file",
        description="Check that every combination past the gates is matched by exactly one "
        "rule, that every gate and rule decides something, that every implementation is "
        "registered, and that every OK rule stays inside what its implementation declares it "
        "serves. Exit 0 if so, else 2 with file:line.",
    )
    lint.add_argument("rules", nargs="?", metavar="RULES", help="default: the shipped rules file")
    add_import(lint)
    lint.set_defaults(handler=_cmd_lint)

    diff = commands.add_parser(
        "diff",
        help="the combinations two rules files decide differently",
        description="Print each box of combinations whose verdict (status and implementation) "
        "differs between OLD and NEW, with the rule deciding on each side: what an edit "
        "changes, before anything runs. Exit 0 when they decide alike, 1 when they differ, 2 "
        "for a file that does not load.",
    )
    diff.add_argument("old", metavar="OLD", help="a rules file (the shipped one: 'shipped')")
    diff.add_argument("new", metavar="NEW", help="a rules file (or 'shipped')")
    add_import(diff)
    diff.set_defaults(handler=_cmd_diff)

    demo = commands.add_parser(
        "demo",
        help="train a small model on local CPU ranks",
        description="Train a small MLP on WORLD_SIZE spawned CPU ranks with a dtypeplan "
        "optimizer, printing the plan, one line per step and the memory per rank. Default "
        "config: bf16 parameters, fp32 gradient accumulation, AdamW, clipping, ZeRO-1.",
    )
    demo.add_argument("--config", metavar="FILE", help="a config instead of the default one")
    demo.add_argument("--world-size", type=_positive, default=2, metavar="N", help="default 2")
    demo.add_argument("--steps", type=_positive, default=20, metavar="N", help="default 20")
    demo.add_argument(
        "--micro-batches",
        type=_positive,
        default=4,
        metavar="N",
        help="micro-batches accumulated per step (default 4)",
    )
    demo.set_defaults(handler=_cmd_demo, imports=[])

    docs = commands.add_parser(
        "docs",
        help="write or check the generated pages of docs/ (docs/reference/), the figures of "
        "the hand-written pages and the schemas' generated enums",
    )
    mode = docs.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the pages that are stale")
    mode.add_argument("--check", action="store_true", help="exit 2 when a page is stale")
    docs.add_argument("--root", default=".", help="the repository root (default: .)")
    docs.set_defaults(handler=_cmd_docs, imports=[])
    run = commands.add_parser(
        "run",
        help="torchrun an HF Trainer script, unedited, on dtypeplan (--deepspeed CONFIG)",
        description="dtypeplan run [torchrun options] SCRIPT [ARGS]: torchrun with the same "
        "options, each rank running SCRIPT (or -m MODULE) unedited with transformers.Trainer "
        "as dtypeplan.integrations.DtypeplanTrainer and TrainingArguments' --deepspeed CONFIG "
        "as its dtypeplan config (DeepSpeed is not enabled). The exit code is torchrun's.",
        prefix_chars="\0",  # every argument is torchrun's or the script's
        add_help=False,
    )
    run.add_argument("torchrun_argv", nargs=argparse.REMAINDER)
    run.set_defaults(handler=_cmd_run, imports=[])
    _add_plan(commands)
    return parser


def _add_plan(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="the table's OK combinations that fit a model on a fleet, ranked",
        description="List every OK combination of the table that fits MODEL on the fleet, "
        "with device and host bytes per GPU, traffic within and across nodes, modelled step "
        "time and expected drift, ranked by --objective with the Pareto front marked. Exit 0 "
        "when some combination fits, 1 when none does (the closest are shown), 2 on bad input.",
    )
    plan.add_argument(
        "--model", metavar="CONFIG", help="a transformers config.json or its directory"
    )
    plan.add_argument(
        "--params",
        type=_positive,
        metavar="N",
        help="a parameter count instead of --model (no activations)",
    )
    plan.add_argument("--gpus", type=_positive, required=True, metavar="N")
    plan.add_argument("--gpus-per-node", type=_positive, default=8, metavar="G", help="default 8")
    plan.add_argument("--gpu-memory", required=True, metavar="SIZE", help="e.g. 80GB")
    plan.add_argument(
        "--host-memory", metavar="SIZE", help="per node, e.g. 2TB (default: not checked)"
    )
    plan.add_argument(
        "--intra-node",
        default="450GB/s",
        metavar="BW",
        help="per GPU, each way (default 450GB/s: H100 NVLink)",
    )
    plan.add_argument(
        "--inter-node",
        default="50GB/s",
        metavar="BW",
        help="per GPU, each way (default 50GB/s: a 400Gb/s NIC per GPU)",
    )
    plan.add_argument(
        "--host-link",
        default="25GB/s",
        metavar="BW",
        help="GPU to host memory (default 25GB/s: PCIe 4 x16)",
    )
    plan.add_argument(
        "--gpu-flops",
        default="400e12",
        metavar="FLOPS",
        help="sustained 16-bit matmul flops per GPU (default 400e12)",
    )
    plan.add_argument(
        "--mxfp8",
        action="store_true",
        help="the GPUs run MXFP8 natively (SM100+); without it the mxfp8 recipe is left out",
    )
    plan.add_argument(
        "--optimizer", default="AdamW", help="a torch.optim class name (default AdamW)"
    )
    plan.add_argument(
        "--batch",
        type=_positive,
        default=1,
        metavar="B",
        help="sequences per micro-batch per GPU (default 1)",
    )
    plan.add_argument(
        "--seq",
        type=_positive,
        default=2048,
        metavar="S",
        help="tokens per sequence (default 2048)",
    )
    plan.add_argument(
        "--micro-batches",
        type=_positive,
        default=1,
        metavar="K",
        help="micro-batches per step (default 1)",
    )
    plan.add_argument(
        "--recompute",
        choices=("auto", "none", "selective", "full"),
        default="auto",
        help="activation recomputation (default auto: the least that fits, per combination)",
    )
    plan.add_argument(
        "--objective",
        choices=("memory", "time", "fidelity"),
        default="time",
        help="what to rank by (default time)",
    )
    plan.add_argument(
        "--max-drift",
        type=float,
        metavar="X",
        help="the largest expected relative loss deviation accepted (e.g. 1e-3)",
    )
    plan.add_argument(
        "--top", type=_positive, default=10, metavar="K", help="rows shown (default 10)"
    )
    plan.add_argument("--write", metavar="CONFIG.json", help="write #1's ds_config here")
    plan.add_argument("--plot", metavar="FRONT.png", help="draw the Pareto front (matplotlib)")
    plan.add_argument("--json", action="store_true", help="print the top rows as JSON")
    plan.add_argument("--quiet", action="store_true", help="no progress line")
    plan.add_argument("--rules", metavar="RULES", help="a rules file instead of the shipped one")
    plan.set_defaults(handler=_cmd_plan, imports=[])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    try:
        _import_modules(args.imports)
        code = args.handler(args)
        sys.stdout.flush()
        return code
    except (PrecisionConfigError, RulesError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # the reader of the output left early (`dtypeplan table | head`)
        _output_closed()
        return EXIT_READER_GONE
