"""The docs site: generated pages fresh, the site builds with warnings as errors, and every
```python block of docs/ is run, included from a tested file, or marked as run elsewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtypeplan import docs_pages
from dtypeplan.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_generated_pages_are_current() -> None:
    stale = docs_pages.stale(ROOT)
    assert not stale, f"stale generated pages {stale}: run python -m dtypeplan docs --write"


def test_docs_check_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["docs", "--check", "--root", str(ROOT)]) == 0
    assert main(["docs", "--check", "--root", str(tmp_path)]) == 2  # nothing written there
    assert "stale: docs/reference/config.md" in capsys.readouterr().err
    assert main(["docs", "--write", "--root", str(tmp_path)]) == 0
    assert main(["docs", "--check", "--root", str(tmp_path)]) == 0


def test_a_schema_key_without_description_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    schema = docs_pages._schema()
    del schema["properties"]["gradient_clipping"]["description"]
    monkeypatch.setattr(docs_pages, "_schema", lambda: schema)
    with pytest.raises(docs_pages.SchemaDescriptionError, match="gradient_clipping"):
        docs_pages.render_config_reference()


def test_config_reference_names_every_key_and_its_dimension() -> None:
    page = (DOCS / "reference" / "config.md").read_text()
    for key in docs_pages.config_keys():
        assert f"| `{key['path']}` |" in page, key["path"]
    assert re.search(r"\| `zero_optimization\.stage` \|[^\n]*\| `stage` \(", page)
    assert "ignored (accepted, changes nothing)" in page and "caller's" in page


def test_differences_page_has_every_row() -> None:
    from dtypeplan.resolver._differences import DIFFERENCES

    page = (DOCS / "reference" / "deepspeed-differences.md").read_text()
    assert all(f"| {row.point} |" in page for row in DIFFERENCES)


def test_sphinx_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "dummy"]
        + [str(DOCS), str(tmp_path / "build")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


FENCE = re.compile(r"^([ \t]*)```python[ \t]*$", re.MULTILINE)
RUN_BY = re.compile(r"<!-- run by (tests/\S+\.py) -->")
NOT_RUN = re.compile(r"<!-- not run: .+ -->")


def python_blocks() -> list[tuple[str, int, list[str]]]:
    """Each ```python block of docs/ as (page, line, the comment lines right above it)."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start())
            above: list[str] = []
            for previous in reversed(lines[:line]):
                stripped = previous.strip()
                if not stripped and not above:
                    continue
                if not stripped.startswith("<!--"):
                    break
                above.append(stripped)
            found.append((str(page.relative_to(ROOT)), line + 1, above))
    return found


def test_every_python_block_is_run_or_says_where() -> None:
    """A block without a skip comment is run by Sybil (docs/conftest.py); a skipped one names
    the test that runs it or says why it is not run."""
    blocks = python_blocks()
    assert len(blocks) >= 5
    for page, line, above in blocks:
        if not any("skip: next" in comment for comment in above):
            continue  # Sybil runs it
        where = f"{page}:{line}"
        run_by = [m.group(1) for c in above if (m := RUN_BY.search(c))]
        assert run_by or any(NOT_RUN.search(c) for c in above), (
            f"{where}: a skipped block must say <!-- run by tests/....py --> or "
            "<!-- not run: reason -->"
        )
        for test in run_by:
            assert (ROOT / test).exists(), f"{where}: {test} does not exist"


def test_pages_that_tests_read_keep_their_blocks() -> None:
    from tests._helpers import readme_recipe_blocks

    assert set(readme_recipe_blocks()) == {"trainer", "accelerate", "lightning"}
    for example, marker in (
        ("pipeline_zero.py", "pipeline"),
        ("checkpoint_resume.py", "checkpoint"),
    ):
        text = (ROOT / "examples" / example).read_text()
        assert f"[docs: {marker}]" in text and f"[docs: end {marker}]" in text
