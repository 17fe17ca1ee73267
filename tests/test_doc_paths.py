"""Every repository path the prose names in backticks exists (DESIGN-REVIEW 3.5): in docs/*.md,
README.md and the docstrings of the package.

A backticked token is a path when it holds a ``/`` and ends in a source or data file's suffix
or in ``/`` (a folder); tokens with placeholders (``<file>``, ``{name}``, ``*``) are run
outputs or patterns, not paths. A path whose first part is a top-level entry of the repository
(``tests/parity.py``) must exist from the root; a shorter one (``update/pieces.py``, as a page
about the package or a module's docstring writes it) must be the end of a path that exists.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".toml", ".txt", ".cfg", ".sh")
_BACKTICKED = re.compile(r"(``|`)([^`\n]+?)\1")
_NOT_A_PATH = re.compile(r"[<>{}*$\s():=,]|://")

OTHER_PROJECTS = ("deepspeed/", "runtime/")
"""Paths in DeepSpeed's source tree (``deepspeed/runtime/lr_schedules.py``, its
``runtime/config.py``), which docstrings cite as the behaviour they follow."""


def _paths(text: str) -> Iterator[str]:
    for match in _BACKTICKED.finditer(text):
        token = match.group(2).strip().split(":", 1)[0]  # path:line
        if "/" in token and not _NOT_A_PATH.search(token) and token.endswith((*SUFFIXES, "/")):
            yield token


def _known() -> tuple[set[str], set[str]]:
    """Every file and folder of the repository (relative, ``/``-separated), and the top-level
    names."""
    skip = {".git", "__pycache__", "_build", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
    known: set[str] = set()
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if not skip.intersection(parts):
            known.add("/".join(parts))
    return known, {p for p in known if "/" not in p}


KNOWN, TOP = _known()


def _exists(token: str) -> bool:
    path = token.rstrip("/")
    if path.split("/", 1)[0] in TOP:
        return path in KNOWN
    return any(known == path or known.endswith("/" + path) for known in KNOWN)


def _docstrings(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _texts() -> Iterator[tuple[str, str]]:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if "_build" not in page.parts:
            yield str(page.relative_to(ROOT)), page.read_text(encoding="utf-8")
    for module in sorted((ROOT / "dtypeplan").rglob("*.py")):
        for doc in _docstrings(module):
            yield str(module.relative_to(ROOT)), doc


def test_every_backticked_path_exists() -> None:
    missing = sorted(
        {
            f"{where}: `{token}`"
            for where, text in _texts()
            for token in _paths(text)
            if not token.startswith(OTHER_PROJECTS) and not _exists(token)
        }
    )
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_path() -> None:
    text = "see ``tests/parity.py`` and `update/pieces.py` and `update/nowhere.py` and `<f>/x.py`"
    assert list(_paths(text)) == ["tests/parity.py", "update/pieces.py", "update/nowhere.py"]
    assert [_exists(t) for t in _paths(text)] == [False, True, False]
