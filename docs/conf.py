"""Sphinx configuration of dtypeplan's docs: MyST markdown pages, furo, autodoc of the public names.

Build with warnings as errors (what tests/test_docs.py and CI run):

    python -m sphinx -W -b html docs docs/_build/html

The pages are plain markdown that also reads on GitHub. Links to torch's docs (intersphinx)
need the network, so they are on only with DTYPEPLAN_DOCS_INTERSPHINX=1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "dtypeplan"
author = "dtypeplan developers"
copyright = "dtypeplan developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
if os.environ.get("DTYPEPLAN_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
    }

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "conftest.py"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "furo"
html_title = "dtypeplan"
