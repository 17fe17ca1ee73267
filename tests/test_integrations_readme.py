"""The docs' recipe for each training framework runs as it is on 2 gloo ranks (issue 20).

The first ```python block under each of docs/frameworks.md's headings (## HF Trainer,
## Accelerate, ## Lightning) is read from the page and executed on both ranks with the names it uses
(``model``, ``args``, ``train_dataset``, ``loader``, ``module``: a tiny GPT-2 and token data)
and the HF docs' ds_config_zero2.json as ``ds_config.json`` (ZeRO-2, optimizer offload, every
value "auto"). Then: the optimizer stepped 4 times at ZeRO-2, the Trainer wrote every weight
in fp32, Accelerate's checkpoint holds the dtypeplan optimizer directory.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._helpers import README_FRAMEWORK_HEADINGS

HEADINGS = README_FRAMEWORK_HEADINGS


@pytest.mark.parametrize("framework", sorted(HEADINGS))
def test_readme_recipe_runs_on_two_ranks(
    integration_defaults: list[dict[str, Any]], framework: str
) -> None:
    results = [per_rank["readme"] for per_rank in integration_defaults]
    for rank, per_rank in enumerate(results):
        got = per_rank[framework]
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert got["stage"] == 2 and got["steps"] == 4 and got["clip"], got
    first = results[0][framework]
    if framework == "trainer":
        assert first["weights"] >= 28 and first["dtypes"] == ["torch.float32"], first
    if framework == "accelerate":
        assert "dtypeplan_optimizer" in first["checkpoint"], first
    if framework in ("accelerate", "lightning"):
        # The framework's own precision setting filled the all-"auto" precision keys.
        assert first["param_dtype"] == "torch.bfloat16", first
    if framework == "lightning":
        assert first["global_step"] == 4, first
        # explain() tells the optimizer configure_optimizers made (lr 3e-3 in the test's
        # module), not the config's "auto" lr (the HF default 5e-5), and no config scheduler.
        assert first["explained_lr"] == 3e-3 and first["explained_scheduler"] is None, first
        assert "not run under Lightning" in first["explain"], first


@pytest.mark.slow
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


def test_the_integrations_import_without_log_noise() -> None:
    """torchao (imported by transformers' Trainer and model modules, and for int8/fp8 states)
    logs lines on a CPU build that no user acts on: every rank printed them."""
    import subprocess
    import sys

    code = (
        "from dtypeplan.integrations import DtypeplanTrainer, DtypeplanAccelerator\n"
        "DtypeplanTrainer, DtypeplanAccelerator\n"
        "from dtypeplan._formats import torchao\n"
        "torchao()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stderr == "" and done.stdout == "", done.stderr
