"""The README's recipe for each training framework runs as it is on 2 gloo ranks (issue 20).

Each ```python block under "## Training frameworks" (### HF Trainer, ### Accelerate,
### Lightning) is read from README.md and executed on both ranks with the names it uses
(``model``, ``args``, ``train_dataset``, ``loader``, ``module``: a tiny GPT-2 and token data)
and the HF docs' ds_config_zero2.json as ``ds_config.json`` (ZeRO-2, optimizer offload, every
value "auto"). Then: the optimizer stepped 4 times at ZeRO-2, the Trainer wrote every weight
in fp32, Accelerate's checkpoint holds the dtypeplan optimizer directory.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from dtypeplan.launch import spawn  # noqa: E402
from tests.workers.integrations import readme_recipes  # noqa: E402

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
HEADINGS = {
    "trainer": "### HF Trainer",
    "accelerate": "### Accelerate",
    "lightning": "### Lightning",
}


def recipe_blocks() -> dict[str, str]:
    """The first ```python block under each framework's heading of "## Training frameworks"."""
    with open(README, encoding="utf-8") as handle:
        text = handle.read()
    section = text.split("## Training frameworks\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, str] = {}
    for framework, heading in HEADINGS.items():
        part = section.split(heading + "\n", 1)[1]
        found = re.search(r"```python\n(.*?)```", part, re.DOTALL)
        assert found, f"README: no python block under {heading}"
        blocks[framework] = found.group(1)
    return blocks


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("recipes"))
    return spawn(readme_recipes, 2, root, recipe_blocks(), timeout_s=600)


@pytest.mark.parametrize("framework", sorted(HEADINGS))
def test_readme_recipe_runs_on_two_ranks(results: list[dict[str, Any]], framework: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[framework]
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert got["stage"] == 2 and got["steps"] == 4 and got["clip"], got
    first = results[0][framework]
    if framework == "trainer":
        assert first["weights"] >= 28 and first["dtypes"] == ["torch.float32"], first
    if framework == "accelerate":
        assert "dtypeplan_optimizer" in first["checkpoint"], first
    if framework == "lightning":
        assert first["global_step"] == 4, first


def test_integrations_import_their_frameworks_lazily() -> None:
    # A fresh interpreter: this one has imported the frameworks already.
    import subprocess
    import sys

    code = (
        "import sys, dtypeplan.integrations as i\n"
        "frameworks = ('transformers', 'accelerate', 'lightning')\n"
        "assert not [m for m in frameworks if m in sys.modules], 'imported eagerly'\n"
        "for name in i.__all__:\n"
        "    assert getattr(i, name).__name__ == name\n"
        "assert all(m in sys.modules for m in frameworks)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
