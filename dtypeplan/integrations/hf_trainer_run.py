"""Run an HF Trainer script, unedited, on dtypeplan, in every rank:
``python -m dtypeplan.integrations.hf_trainer_run [--rules RULES] [-m] SCRIPT [ARGS...]``.

``dtypeplan run`` (the command line) starts this module in each rank process under torchrun;
other launchers (``srun``, ``mpirun``, a cluster's own) can start it directly. It calls
:func:`dtypeplan.integrations.hf_trainer.use_for_unedited_scripts` (``transformers.Trainer``
is ``DtypeplanTrainer``; ``--deepspeed CONFIG`` is the dtypeplan config, DeepSpeed is not
enabled; ``--rules RULES``: the rules file the config is resolved with), then runs SCRIPT as
``python SCRIPT ARGS...`` would (``runpy``, ``__name__`` is ``"__main__"``, ``sys.argv`` is
``[SCRIPT, *ARGS]``, the script's folder first on ``sys.path``); with ``-m``, SCRIPT is a
module name, run as ``python -m``.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = (
    "usage: python -m dtypeplan.integrations.hf_trainer_run [--rules RULES] [-m] SCRIPT [ARGS...]"
)


def main(argv: Sequence[str] | None = None) -> None:
    """Run SCRIPT with the HF Trainer on dtypeplan (``argv``: ``[--rules RULES] [-m] SCRIPT
    ARGS...``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    rules, args = _rules_option(args)
    module = bool(args) and args[0] in ("-m", "--module")
    if module:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if args else 2)
    from dtypeplan.integrations.hf_trainer import use_for_unedited_scripts

    use_for_unedited_scripts(rules)
    target, rest = args[0], args[1:]
    sys.argv = [target, *rest]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` has it
        runpy.run_path(target, run_name="__main__")
    _close_process_group()


def _rules_option(args: list[str]) -> tuple[str | None, list[str]]:
    """A leading ``--rules RULES`` (or ``--rules=RULES``) and the arguments after it."""
    if args and args[0].startswith("--rules="):
        return args[0].partition("=")[2], args[1:]
    if args and args[0] == "--rules":
        if len(args) < 2:
            print(f"--rules needs a file\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        return args[1], args[2:]
    return None, args


def _close_process_group() -> None:
    """After a script that returned, the process group the Trainer opened is closed as
    dtypeplan.launch closes its own (a barrier, then destroy_process_group): HF scripts leave
    it open, and gloo's teardown at interpreter exit aborted a rank now and then ("terminate
    called without an active exception") after the run had finished and saved. Not after a
    failure: a barrier there would wait for ranks that may never come."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
