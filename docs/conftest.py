"""pytest runs the single-process ```python blocks of docs/*.md with Sybil.

A block runs unless a ``<!-- skip: next -->`` comment precedes it; ``tests/test_docs.py`` checks
that each skipped block says which test runs it (``<!-- run by tests/... -->``) or why it is not
run (``<!-- not run: ... -->``). Setup a reader need not see sits in
``<!-- invisible-code-block: python ... -->`` comments. Each page's blocks share one namespace.
"""

from __future__ import annotations

import os

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

# The one-pass host update runs eagerly, as in tests/conftest.py (same bits, no compile time).
os.environ.setdefault("DTYPEPLAN_EAGER_UPDATE", "1")

pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["*.md"],
).pytest()
