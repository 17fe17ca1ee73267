"""Hostile config and rules input: each case fails quickly with the documented error.

Issue 12, items 1-3. Before ``dtypeplan.resolver._input`` these escaped as ``RecursionError``,
``ValueError`` (Python's 4300-digit limit), ``MemoryError`` (``/dev/zero``), hung forever (a
FIFO), or grew without bound (a YAML billion laughs formatted by jsonschema); duplicate config
keys were silently overwritten and NaN / Infinity passed the schema.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import dtypeplan
from dtypeplan import PrecisionConfigError, RulesError
from dtypeplan.cli import main
from dtypeplan.optimizers.grads.loss_scaler import LossScaler
from dtypeplan.resolver._config import LossScaleConfig
from dtypeplan.resolver._rules import load_rules

DEEP = 100_000
# Each hostile case must fail well within this; the old failures took seconds to forever.
QUICK_S = 5.0


def _billion_laughs(levels: int = 9) -> str:
    """YAML whose aliases expand to 9**levels values; the anchors sit under ``key``."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "\n".join(lines)


def _indent(text: str, spaces: int) -> str:
    return "".join(" " * spaces + line + "\n" for line in text.splitlines())


# A deep flow-style YAML document is refused by PyYAML itself from 6.0.4 on ("exceeded maximum
# nesting depth", still at file:line), by dtypeplan's own depth check before that.
YAML_TOO_DEEP = "levels deep|maximum nesting depth"

CONFIG_FILES: dict[str, tuple[str, bytes, str]] = {
    "deep-json": ("c.json", b'{"bf16": ' + b"[" * DEEP + b"]" * DEEP + b"}", "levels deep"),
    "deep-yaml": ("c.yaml", b"bf16: " + b"[" * DEEP + b"]" * DEEP + b"\n", YAML_TOO_DEEP),
    "deep-yaml-block": (
        "c.yaml",
        "".join(" " * i + "- \n" for i in range(0, 2 * 200, 2)).encode(),
        "levels deep",
    ),
    "long-int-json": ("c.json", b'{"train_batch_size": ' + b"9" * 5000 + b"}", "digits"),
    "long-int-yaml": ("c.yaml", b"train_batch_size: " + b"9" * 5000 + b"\n", "digits"),
    "duplicate-json": (
        "c.json",
        b'{"bf16": {"enabled": true}, "bf16": {"enabled": false}}',
        "duplicate key 'bf16'",
    ),
    "duplicate-yaml": ("c.yaml", b"fp16:\n  enabled: true\n  enabled: false\n", "c.yaml:3"),
    "not-utf8": ("c.json", b'{"bf16": {"enabled": true}, "x": "\xe9"}', "not UTF-8"),
    "laughs-zero": (
        "c.yaml",
        ("zero_optimization:\n  stage: 1\n  x:\n" + _indent(_billion_laughs(), 4)).encode(),
        "aliases",
    ),
    "laughs-bf16": (
        "c.yaml",
        (_billion_laughs() + "\nbf16:\n  enabled: *a8\n").encode(),
        "aliases",
    ),
    "nan-loss-scale": ("c.json", b'{"fp16": {"enabled": true, "loss_scale": NaN}}', "finite"),
    "inf-loss-scale": (
        "c.json",
        b'{"fp16": {"enabled": true, "loss_scale": Infinity}}',
        "finite",
    ),
    "overflow-min-scale": (
        "c.json",
        b'{"fp16": {"enabled": true, "min_loss_scale": 1e400}}',
        "finite",
    ),
    "nan-lr-yaml": ("c.yaml", b"optimizer: {type: AdamW, params: {lr: .nan}}\n", "finite"),
}


def _quick(call: Callable[[], Any], error: type[Exception], match: str) -> Exception:
    start = time.monotonic()
    with pytest.raises(error, match=match) as caught:
        call()
    assert time.monotonic() - start < QUICK_S
    return caught.value


@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_hostile_config_file_is_a_config_error(tmp_path: Path, case: str) -> None:
    name, content, match = CONFIG_FILES[case]
    path = tmp_path / name
    path.write_bytes(content)
    error = _quick(lambda: dtypeplan.resolve(str(path)), PrecisionConfigError, match)
    assert len(str(error)) < 400


def test_config_laughs_error_is_short_under_the_node_limit(tmp_path: Path) -> None:
    # Under the value limit (9**4 values) the aliases expand; the message quoting the
    # offending value must still be short.
    path = tmp_path / "c.yaml"
    path.write_text("wandb:\n" + _indent(_billion_laughs(4), 2) + "bf16:\n  enabled: *a3\n")
    error = _quick(lambda: dtypeplan.resolve(str(path)), PrecisionConfigError, "bf16.enabled")
    assert len(str(error)) < 400


SPECIAL_PATHS: dict[str, Callable[[Path], str]] = {
    "dev-zero": lambda _tmp: "/dev/zero",
    "directory": lambda tmp: str(tmp),
    "fifo": lambda tmp: (os.mkfifo(tmp / "fifo.json"), str(tmp / "fifo.json"))[1],
}


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and /dev/zero are POSIX")
@pytest.mark.parametrize("case", sorted(SPECIAL_PATHS))
def test_config_path_that_is_not_a_regular_file(tmp_path: Path, case: str) -> None:
    path = SPECIAL_PATHS[case](tmp_path)
    _quick(lambda: dtypeplan.resolve(path), PrecisionConfigError, "not a regular file")


def _deep_dict(depth: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


def _cyclic() -> dict[str, Any]:
    config: dict[str, Any] = {}
    config["bf16"] = config
    return config


def _shared_laughs() -> dict[str, Any]:
    value: list[Any] = ["lol"]
    for _ in range(40):
        value = [value, value]
    return {"zero_optimization": {"stage": 1, "x": value}}


DICT_CONFIGS: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "deep": (lambda: _deep_dict(DEEP), "levels deep"),
    "cyclic": (_cyclic, "levels deep"),
    "shared-laughs": (_shared_laughs, "more than"),
    "long-int": (lambda: {"train_batch_size": 10**5000}, "digits"),
    "nan-loss-scale": (lambda: {"fp16": {"enabled": True, "loss_scale": math.nan}}, "finite"),
    "inf-loss-scale": (lambda: {"fp16": {"enabled": True, "loss_scale": math.inf}}, "finite"),
    "nan-min-scale": (lambda: {"fp16": {"enabled": True, "min_loss_scale": math.nan}}, "finite"),
    "inf-clipping": (lambda: {"gradient_clipping": math.inf}, "finite"),
    "nan-beta": (
        lambda: {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, math.nan]}}},
        r"betas\[1\]: must be a finite",
    ),
    "inf-lr": (lambda: {"optimizer": {"type": "SGD", "params": {"lr": math.inf}}}, "finite"),
    "nan-eps": (lambda: {"optimizer": {"type": "Adam", "params": {"eps": math.nan}}}, "finite"),
    "inf-weight-decay": (
        lambda: {"optimizer": {"type": "AdamW", "params": {"weight_decay": -math.inf}}},
        "finite",
    ),
    "inf-bucket": (lambda: {"zero_optimization": {"reduce_bucket_size": math.inf}}, "finite"),
    "zero-timeout": (lambda: {"collective_timeout_s": 0}, "collective_timeout_s"),
    "nan-timeout": (lambda: {"collective_timeout_s": math.nan}, "finite"),
}


@pytest.mark.parametrize("case", sorted(DICT_CONFIGS))
def test_hostile_dict_config_is_a_config_error(case: str) -> None:
    build, match = DICT_CONFIGS[case]
    config = build()
    _quick(lambda: dtypeplan.resolve(config), PrecisionConfigError, match)


def test_collective_timeout_is_carried_by_the_plan() -> None:
    assert dtypeplan.resolve({}).collective_timeout_s == 600.0
    assert dtypeplan.resolve({"collective_timeout_s": 42.5}).collective_timeout_s == 42.5


@pytest.mark.parametrize(
    "fields",
    [{"loss_scale": math.inf}, {"loss_scale": math.nan}, {"min_loss_scale": math.nan}],
)
def test_loss_scaler_refuses_non_finite_settings(fields: dict[str, float]) -> None:
    with pytest.raises(PrecisionConfigError, match="finite"):
        LossScaler(LossScaleConfig(**fields))


RULES_FILES: dict[str, tuple[bytes, str]] = {
    "deep": (b"version: 1\nrules: " + b"[" * DEEP + b"]" * DEEP + b"\n", YAML_TOO_DEEP),
    "long-int": (b"version: " + b"9" * 5000 + b"\n", "digits"),
    "not-utf8": (b"version: 1\n# \xff\n", r"rules\.yaml:2: .*not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(RULES_FILES))
def test_hostile_rules_file_is_a_rules_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    content, match = RULES_FILES[case]
    path = tmp_path / "rules.yaml"
    path.write_bytes(content)
    _quick(lambda: load_rules(path), RulesError, match)
    assert main(["lint", str(path)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "rules.yaml" in captured.err


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and /dev/zero are POSIX")
@pytest.mark.parametrize("case", sorted(SPECIAL_PATHS))
def test_rules_path_that_is_not_a_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    path = SPECIAL_PATHS[case](tmp_path)
    _quick(lambda: load_rules(path), RulesError, "not a regular file")
    assert main(["lint", path]) == 2
    captured = capsys.readouterr()
    assert "not a regular file" in captured.err
    assert "Traceback" not in captured.err
