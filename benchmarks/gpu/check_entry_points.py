"""Each entry point ``run_all.sh`` runs imports and parses its arguments, in one process.

    python3 -m benchmarks.gpu.check_entry_points "MODULE ARG ..." ...

Each argument is a module and the arguments ``run_all.sh`` gives it; the module's ``main()`` is
called with them and ``--check-args`` (``benchmarks/_common.py``: parse, print, exit 0), with
``sys.argv`` standing for the command line. Prints one line per module; exits 1 if any failed.
"""

from __future__ import annotations

import importlib
import shlex
import sys
import traceback
from unittest import mock


def check(command: str) -> str | None:
    """None where ``command``'s module parsed its arguments; else why not."""
    module_name, *args = shlex.split(command)
    try:
        module = importlib.import_module(module_name)
        with mock.patch.object(sys, "argv", [module_name, *args, "--check-args"]):
            module.main()
    except SystemExit as exit_:
        if exit_.code in (0, None):
            return None
        return f"exit {exit_.code}"
    except Exception:  # noqa: BLE001 - reported per module
        return traceback.format_exc(limit=-3)
    return "main() returned without parsing (no --check-args in its parser)"


def main(argv: list[str] | None = None) -> int:
    failed = 0
    for command in argv if argv is not None else sys.argv[1:]:
        problem = check(command)
        print(f"{'ok    ' if problem is None else 'FAILED'} {command}", flush=True)
        if problem is not None:
            failed += 1
            print(problem, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
