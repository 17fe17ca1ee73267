"""The committed DeepSpeed key list is what tools/deepspeed_keys.py reads from DeepSpeed itself."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)
def test_committed_key_list_matches_the_installed_deepspeed() -> None:
    import deepspeed

    from dtypeplan.resolver import _deepspeed_keys

    if deepspeed.__version__ != _deepspeed_keys.DEEPSPEED_VERSION:
        pytest.skip(
            f"the list is for DeepSpeed {_deepspeed_keys.DEEPSPEED_VERSION}, "
            f"{deepspeed.__version__} is installed"
        )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "deepspeed_keys.py")],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    committed = (ROOT / "dtypeplan" / "resolver" / "_deepspeed_keys.py").read_text()
    assert result.stdout == committed


def test_every_deepspeed_spelling_is_known_to_the_schema() -> None:
    from dtypeplan.resolver import _deepspeed_keys as ds
    from dtypeplan.resolver._config import config_schema

    schema = config_schema()
    top = set(schema["properties"])
    assert set(ds.TOP_LEVEL_KEYS) <= top
    assert not set(ds.REMOVED_TOP_LEVEL_KEYS) & top
    zero = set(schema["properties"]["zero_optimization"]["properties"])
    spellings = {
        n for name, aliases in ds.FIELDS["zero_optimization"].items() for n in (name, *aliases)
    }
    assert spellings | set(ds.DEPRECATED["zero_optimization"]) <= zero
    assert not set(ds.REMOVED_ZERO_KEYS) & zero
    bf16 = set(schema["$defs"]["bf16_block"]["properties"])
    assert set(ds.FIELDS["bf16"]) <= bf16
    assert set(ds.FIELDS["fp16"]) <= set(schema["properties"]["fp16"]["properties"])
    assert set(ds.FIELDS["data_types"]) <= set(schema["properties"]["data_types"]["properties"])
