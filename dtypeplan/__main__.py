"""``python -m dtypeplan``: the command line (see :mod:`dtypeplan.cli`)."""

import sys

from dtypeplan.cli import main

# Guarded: the demo's spawned ranks re-import the main module.
if __name__ == "__main__":
    sys.exit(main())
