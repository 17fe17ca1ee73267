"""The ``dtypeplan`` command line: exit codes, output, the markdown table and the demo."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dtypeplan
from dtypeplan.cli import main, parse_count
from dtypeplan.optimizers.contract import registry
from dtypeplan.report import format_bytes
from dtypeplan.resolver import DIMENSIONS, PARAMS, Rule
from dtypeplan.resolver._dimensions import FEATURE_DIMENSIONS, value_text
from dtypeplan.resolver._rules import default_rules_path
from dtypeplan.table import condition_text

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SHIPPED_RULES = Path(default_rules_path()).read_text()


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# A small complete rules file, so that the exit codes are tested against a fixed table while
# the shipped one grows. It keeps the shipped defaults.
def _feature_gates() -> str:
    """A gate per feature refusing every value but "not used" (a gate's unnamed dimensions
    take any value, so these take every point with a feature in use). fp8's own dimensions
    have none: the fp8 gate takes fp8 on, and without fp8 they mean nothing (a config without
    fp8 may hold any of their values; the grid's rules take every one)."""
    return "".join(
        f"  - id: t-feature-{name.replace('_', '-')}\n"
        f"    when: {{{name}: {{not: {value_text(dim.default_value)}}}}}\n"
        "    status: NotSupported\n"
        f"    reason: No {name} here.\n"
        for name, dim in FEATURE_DIMENSIONS.items()
        if not dim.requires
    )


# A small table of the shipped version, defaults and sets: the core contradictions, pipeline
# and ZeRO-3 refused, no feature, ZeRO-0 replicated and ZeRO-1/2 sharded.
TEST_RULES = (
    SHIPPED_RULES[: SHIPPED_RULES.index("\ngates:\n")]
    + textwrap.dedent(
        """
        gates:
          - id: t-both
            when: {params: fp16+bf16}
            status: Error
            reason: Both 16-bit modes.
          - id: t-stage0-sharded
            when: {stage: 0, sharded: true}
            status: Error
            reason: Nothing is sharded at stage 0.
          - id: t-stage2-whole
            when: {stage: 2, sharded: false}
            status: Error
            reason: Stage 2 shards the accumulator.
          - id: t-pipeline
            when: {pipeline: true}
            status: NotSupported
            reason: No pipeline here.
          - id: t-zero3
            when: {stage: 3}
            status: NotSupported
            reason: No ZeRO-3 here.
        """
    )
    + _feature_gates()
    + textwrap.dedent(
        """
        rules:
          - id: t-ok
            when: {stage: 0}
            status: OK
            implementation: replicated
            reason: Fine.
          - id: t-sharded
            when: {stage: [1, 2]}
            status: OK
            implementation: sharded
            reason: Fine too.
        """
    )
)


def _line_of(text: str, needle: str) -> int:
    """1-based line of the first line of ``text`` containing ``needle``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


# --- check -----------------------------------------------------------------------------------
def test_check_ok_prints_plan_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    config = EXAMPLES / "ds_config_bf16_zero1.json"
    code = main(["check", str(config), "--params", "7B", "--world-size", "8"])
    out = capsys.readouterr().out
    assert code == 0
    plan = dtypeplan.resolve(config)
    assert out.startswith(plan.explain())
    memory = plan.memory(7 * 10**9, 8)
    assert "7,000,000,000 parameters, 8 ranks" in out
    table = out[out.index("memory per rank") :].splitlines()
    assert "(nothing in host memory)" in table[0]
    assert table[1].split()[:2] == ["component", "held"]
    held = {line.split()[0]: line.split()[1] for line in table[2:]}
    assert held["params"] == "whole" and held["master"] == held["optimizer_states"] == "1/8"
    for key, value in memory.items():
        if key.startswith("host_"):
            assert value == 0 and key not in held
            continue
        row = next(line for line in table if line.strip().startswith(key + " "))
        assert f"{value:,}" in row
        assert format_bytes(value) in row
        assert f"{value / 7e9:.2f}" in row


def test_check_fp16_example_is_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(EXAMPLES / "ds_config_fp16.json")]) == 0
    assert "loss scaling" in capsys.readouterr().out


def test_check_yaml_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path / "c.yaml", "bf16:\n  enabled: true\nzero_optimization:\n  stage: 2\n")
    assert main(["check", str(config)]) == 0
    assert "rule: zero2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("config", "pipeline", "rule"),
    [
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, False, "t-zero3"),
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, True, "t-pipeline"),
    ],
)
def test_check_not_supported_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict, pipeline: bool, rule: str
) -> None:
    rules = _write(tmp_path / "rules.yaml", TEST_RULES)
    argv = ["check", str(_write(tmp_path / "c.json", config)), "--rules", str(rules)]
    assert main(argv + ["--pipeline"] * pipeline) == 1
    out = capsys.readouterr().out
    assert "status: NotSupported" in out
    assert f"rule: {rule} " in out
    assert "nearest supported configs:" in out and "-> OK (sharded, rule t-sharded)" in out
    assert "fp8" not in out[out.index("nearest supported configs:") :].split("\n\n")[0]
    assert "memory per rank" in out


def test_check_error_plan_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path / "c.json", {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert main(["check", str(config)]) == 2
    out = capsys.readouterr().out
    assert "status: Error" in out and "rule: fp16-and-bf16" in out
    assert "memory per rank" not in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({"bf16": {"enabeld": True}}, "$.bf16.enabeld"),
        ({"zero_optimization": {"stage": "one"}}, "$.zero_optimization.stage"),
        ("{not json", "not valid JSON"),
        (None, "cannot read config file"),
    ],
)
def test_check_bad_config_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, expected: str
) -> None:
    path = tmp_path / "c.json"
    if content is not None:
        _write(path, content)
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ")
    assert expected in captured.err
    assert "Traceback" not in captured.err


def test_check_bad_rules_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = _write(tmp_path / "rules.yaml", SHIPPED_RULES.replace("status: OK", "status: Fine", 1))
    config = EXAMPLES / "ds_config_bf16_zero1.json"
    assert main(["check", str(config), "--rules", str(rules)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {rules}:{_line_of(SHIPPED_RULES, 'status: OK')}: ")


def test_check_json(capsys: pytest.CaptureFixture[str]) -> None:
    config = EXAMPLES / "ds_config_bf16_zero1.json"
    assert main(["check", str(config), "--json", "--params", "125M", "--world-size", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = dtypeplan.resolve(config)
    memory = data.pop("memory")
    assert data.pop("traffic") == plan.traffic(125_000_000, 4).to_dict()
    # The example gives micro-batch size and steps, so DeepSpeed's batch holds on any ranks.
    assert data.pop("micro_batches_per_step") == 4
    assert data.pop("batch_size_mismatch") is None
    assert data == json.loads(json.dumps(plan.to_dict()))
    assert memory["num_params"] == 125_000_000 and memory["world_size"] == 4
    assert memory["bytes_per_rank"] == plan.memory(125_000_000, 4)
    assert memory["bytes_per_param"]["total"] == pytest.approx(
        plan.memory(125_000_000, 4)["total"] / 125_000_000
    )


def test_check_json_not_supported_and_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = str(_write(tmp_path / "rules.yaml", TEST_RULES))
    stage3 = _write(tmp_path / "a.json", {"zero_optimization": {"stage": 3}})
    assert main(["check", str(stage3), "--json", "--rules", rules]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "NotSupported" and data["memory"]["bytes_per_rank"]["total"] > 0
    both = _write(tmp_path / "b.json", {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert main(["check", str(both), "--json", "--rules", rules]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "Error" and data["memory"] is None


# --- DeepSpeed configs: --auto, --strict, a plan per precision choice ------------------------
HF_AUTO = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2},
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_check_unfilled_precision_auto_shows_each_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "hf.json", HF_AUTO)
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    for choice, dtype in (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16")):
        header = next(
            line for line in out.splitlines() if line.startswith(f"=== {choice} parameters (")
        )
        block = out.split(header, 1)[1].split("===", 1)[0]
        assert f"parameters             {dtype}" in block
    assert "--auto bf16.enabled=true --auto fp16.enabled=false" in out
    assert main(["check", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    choices = [c["plan"]["param_dtype"] for c in data["auto_choices"]]
    assert choices == ["fp32", "fp16", "bf16"]
    assert [c["param_dtype"] for c in data["auto_choices"]] == choices


def test_check_one_precision_key_filled_shows_the_choice_it_leaves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--auto bf16.enabled=true`` with fp16 still "auto": one plan, headed bf16, OK."""
    config = _write(tmp_path / "hf.json", HF_AUTO)
    assert main(["check", str(config), "--auto", "bf16.enabled=true"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("===")]
    assert headers == ["=== bf16 parameters (--auto fp16.enabled=false): OK ==="]
    assert "status: Error" not in out


def test_check_exits_non_zero_when_any_shown_choice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each choice of an unfilled "auto" is shown with its status; the exit code is the worst
    of them: bf16 stochastic-rounding masters are OK over bf16 parameters only."""
    masters = {"master_weights": {"dtype": "bf16", "rounding": "stochastic"}}
    config = _write(tmp_path / "hf.json", {**HF_AUTO, **masters})
    assert main(["check", str(config)]) == 2
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("===")]
    assert [h.rsplit(": ", 1)[1] for h in headers] == ["Error ===", "Error ===", "OK ==="]
    assert main(["check", str(config), "--auto", "bf16.enabled=true"]) == 0


def test_check_auto_fills_and_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "hf.json", HF_AUTO)
    argv = ["check", str(config), "--auto", "bf16.enabled=true", "--auto", "fp16.enabled=false"]
    assert main([*argv, "--auto", "gradient_clipping=0.5"]) == 0
    out = capsys.readouterr().out
    assert "===" not in out and "parameters             bf16" in out
    assert "gradient_clipping = 0.5  <- auto=" in out
    assert "train_micro_batch_size_per_gpu = 8  <- HF TrainingArguments" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--auto", "gradient_clipping"], "PATH=VALUE"),
        (["--auto", "bf16.enabld=true"], "did you mean 'bf16.enabled'"),
    ],
)
def test_check_bad_auto_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    config = _write(tmp_path / "hf.json", HF_AUTO)
    assert main(["check", str(config), *extra]) == 2
    assert message in capsys.readouterr().err


def test_check_states_the_deepspeed_differences_and_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "ds.json", {"bf16": {"enabled": True}, "log": {"x": 1}})
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "differences from DeepSpeed" in out
    for point in ("gradient accumulation:", "wire dtype:", "gradient clipping:", "no optimizer"):
        assert point in out
    assert "unknown top-level key 'log'" in out
    assert main(["check", str(config), "--strict"]) == 2
    assert "$.log" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7B", 7 * 10**9),
        ("1.3b", 1_300_000_000),
        ("125M", 125_000_000),
        ("7e9", 7 * 10**9),
        ("1_000", 1000),
        ("0", 0),
    ],
)
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


def test_bad_count_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(EXAMPLES / "ds_config_bf16_zero1.json")
    assert main(["check", config, "--params", "lots"]) == 2
    assert main(["check", config, "--world-size", "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err


# --- table -----------------------------------------------------------------------------------
def _table_rows(out: str, header_start: str) -> list[list[str]]:
    """Body rows (cells split) of the markdown table whose header starts with ``header_start``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\x00").split("|")]
        rows.append([c.replace("\x00", "|") for c in cells])
    return rows


def _implementation_cell(rule: Rule) -> str:
    single = rule.single_process_implementation
    if single is None or single == rule.implementation:
        return rule.implementation or "-"
    return f"{rule.implementation} ({single} without torch.distributed)"


def test_table_has_one_row_per_gate_and_rule_in_file_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["table"]) == 0
    out = capsys.readouterr().out
    table = dtypeplan.load_rules()
    gates = _table_rows(out, "| # | id |")
    assert [row[1] for row in gates] == [f"`{gate.id}`" for gate in table.gates]
    for row, gate in zip(gates, table.gates, strict=True):
        assert row[2] == condition_text(gate) and row[-1] == gate.reason
    rows = _table_rows(out, "| id |")
    assert len(rows) == len(table.grid)
    for row, rule in zip(rows, table.grid, strict=True):
        assert row == [
            f"`{rule.id}`",
            condition_text(rule),
            rule.status,
            _implementation_cell(rule),
            rule.reason,
        ]


def test_table_condition_names_features_only_where_a_rule_sets_them_apart() -> None:
    table = dtypeplan.load_rules()
    zero1 = next(rule for rule in table.rules if rule.id == "zero1")
    # Every feature pinned to "not used": summed up once; a core dimension the grid rule does
    # not name (any value) is not spelled out.
    text = condition_text(zero1)
    assert text.startswith("stage=1, "), text
    assert "offload_optimizer=none|cpu" in text and "params=" not in text
    offload = next(rule for rule in table.rules if rule.id == "zero3-offload-optimizer")
    text = condition_text(offload)
    assert "offload_optimizer=cpu" in text and "offload_optimizer=none" not in text
    # A gate names only what it refuses.
    assert condition_text(table.rules[0]) == "params=fp16+bf16"
    # Nothing is lost: the short text and the full one name the same non-default values.
    for rule in table.rules:
        for part in rule.when_text().split(", "):
            name, values = part.split("=", 1)
            dim = DIMENSIONS[name]
            pinned_unused = name in FEATURE_DIMENSIONS and values == value_text(dim.default_value)
            assert (part in condition_text(rule)) != pinned_unused, (rule.id, part)


def test_table_grid_matches_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["table"]) == 0
    rows = _table_rows(capsys.readouterr().out, "| params |")
    assert len(rows) == 9 and all(len(row) == 2 + 8 for row in rows)
    cells = list(itertools.product(range(4), (False, True)))
    for row in rows:
        params, accum = row[0], row[1]
        for column, (stage, pipeline) in enumerate(cells, 2):
            config = {
                **PARAMS.config_for(params),
                "gradient_accumulation_dtype": accum,
                "zero_optimization": {"stage": stage},
            }
            expected = str(dtypeplan.resolve(config, pipeline_parallel=pipeline).status)
            assert row[column].strip("*") == expected, (params, accum, stage, pipeline)
    assert [(r[0], r[1]) for r in rows] == list(
        itertools.product(("fp32", "fp16", "bf16"), repeat=2)
    )


def test_table_feature_grid_matches_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    """The master-weights grid: each cell is resolve's status for a config a user writes, and
    every (parameter dtype, value) pair that is not an Error everywhere has exactly one row."""
    assert main(["table"]) == 0
    rows = _table_rows(capsys.readouterr().out, "| params | master weights |")
    master = DIMENSIONS["master"]
    cells = list(itertools.product(range(4), (False, True)))
    seen = []
    for row in rows:
        for params, value in itertools.product(row[0].split(", "), row[1].split(", ")):
            seen.append((params, value))
            expected = []
            for stage, pipeline in cells:
                config = master.config_for(value)
                for block, keys in PARAMS.config_for(params).items():
                    config.setdefault(block, {}).update(keys)
                config["zero_optimization"] = {"stage": stage}
                expected.append(str(dtypeplan.resolve(config, pipeline_parallel=pipeline).status))
            assert [cell.strip("*") for cell in row[2:]] == expected, (params, value)
            assert set(expected) != {"Error"}  # rows that are an Error everywhere are left out
    assert len(seen) == len(set(seen))
    assert {("bf16", "bf16"), ("bf16", "bf16_sr"), ("bf16", "bf16_kahan"), ("fp16", "fp16")} == set(
        seen
    )


def test_table_grid_applies_the_rules_file_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A rules file whose default shards the accumulator at stage 0: every stage-0 cell of the
    # grid must then be the stage0-sharded-accumulator Error, which only the defaults reach.
    text = SHIPPED_RULES.replace(
        "  accumulator_sharded:\n    0: false", "  accumulator_sharded:\n    0: true"
    )
    assert text != SHIPPED_RULES
    rules = _write(tmp_path / "rules.yaml", text)
    assert main(["table", "--rules", str(rules)]) == 0
    rows = _table_rows(capsys.readouterr().out, "| params |")
    assert {row[2] for row in rows} == {"Error"} and {row[3] for row in rows} == {"Error"}
    assert {row[4].strip("*") for row in rows} == {"OK"}


def test_table_has_no_readme_option(capsys: pytest.CaptureFixture[str]) -> None:
    """The README block code is gone (rules v2): the table lives in docs/reference/
    truth-table.md, which tests/test_docs.py keeps fresh."""
    assert main(["table", "--readme"]) == 2
    assert "--readme" in capsys.readouterr().err


# --- lint ------------------------------------------------------------------------------------
def test_lint_shipped_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint"]) == 0
    combinations = math.prod(len(dim.values) for dim in DIMENSIONS.values())
    table = dtypeplan.load_rules()
    assert capsys.readouterr().out == (
        f"ok: {len(table.gates)} gates and {len(table.grid)} rules decide each of "
        f"{combinations} combinations once; every OK rule stays inside what its "
        "implementation declares it serves\n"
    )


def _break_gap(text: str) -> tuple[str, str]:
    start = text.index("  - id: zero3\n")
    return text[:start], "rules:"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: (t.replace("id: zero2\n", "id: zero2\n    weird: 1\n"), "weird: 1"),
            "unknown key 'weird'",
        ),
        (
            lambda t: (
                t.replace("implementation: sharded", "implementation: nowhere", 1),
                "implementation: nowhere",
            ),
            "not registered",
        ),
        (_break_gap, "matched by no gate and no rule"),
        (
            lambda t: (
                t.replace("status: Error", "status: Error: yes", 1),
                "status: Error: yes",
            ),
            "not valid YAML",
        ),
        (
            lambda t: (
                t.replace("reason: >", "reason: !!python/object:os.system >", 1),
                "!!python/object",
            ),
            "not allowed",
        ),
    ],
    ids=["unknown-key", "unknown-implementation", "gap", "yaml-syntax", "python-tag"],
)
def test_lint_broken_rules_exits_2_with_file_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit, expected: str
) -> None:
    text, needle = edit(SHIPPED_RULES)
    assert text != SHIPPED_RULES
    path = _write(tmp_path / "rules.yaml", text)
    assert main(["lint", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    line = _line_of(text, needle)
    assert captured.err.startswith(f"error: {path}:"), captured.err
    reported = int(captured.err.split(":")[2])
    assert reported == line, captured.err
    assert expected in captured.err
    assert "Traceback" not in captured.err


def test_lint_import_registers_user_implementations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_SERVES", dict(registry._SERVES))
    module = "dtypeplan_cli_test_impl"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            import dtypeplan
            from dtypeplan.optimizers.contract.served import SHARDED
            from dtypeplan.optimizers.flat import ShardedOptimizer

            @dtypeplan.register("cli-test-zero1", serves=SHARDED)
            class MyZero1(ShardedOptimizer):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    text = SHIPPED_RULES.replace(
        "status: OK\n    implementation: sharded",
        "status: OK\n    implementation: cli-test-zero1",
        1,
    )
    assert text != SHIPPED_RULES
    rules = _write(tmp_path / "rules.yaml", text)
    assert main(["lint", str(rules)]) == 2
    assert "'cli-test-zero1', which is not registered" in capsys.readouterr().err
    try:
        assert main(["lint", str(rules), "--import", module]) == 0
        assert capsys.readouterr().out.startswith("ok: ")
    finally:
        sys.modules.pop(module, None)
    assert main(["lint", "--import", "no_such_module_dtypeplan"]) == 2
    assert "cannot import 'no_such_module_dtypeplan'" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0
    assert "check" in capsys.readouterr().out


# --- demo ------------------------------------------------------------------------------------
def _run_module(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "dtypeplan", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_runs_on_two_ranks() -> None:
    result = _run_module("demo", "--steps", "3", "--world-size", "2", "--micro-batches", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    lines = out.splitlines()
    # The config it demonstrates first, then its plan.
    assert lines[0] == "config:" and '"bf16": {"enabled": true}' in out
    assert next(line for line in lines if line.startswith("status: ")).startswith(
        "status: OK (implementation "
    )
    assert "shard_group_size" not in out, "the reason of features the demo does not use"
    assert "parameters             bf16" in out and "gradient accumulation  fp32" in out
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/3", "2/3", "3/3"]
    for line in progress:
        for field in ("loss", "grad norm", "ms/step"):
            assert field in line
        # bf16: no loss scaling, so no loss-scale or skipped-step columns.
        assert "loss scale" not in line and "skipped" not in line
    assert "loss: first " in out
    memory = out[out.index("memory per rank") :].splitlines()
    assert "rank 0 measured" in memory[1] and "rank 1 measured" in memory[1]
    assert [row.split()[0] for row in memory[2:8]] == [
        "params",
        "grads",
        "accumulator",
        "master",
        "optimizer_states",
        "total",
    ]
    assert [row.split()[1] for row in memory[2:7]] == ["whole", "-", "whole", "1/2", "1/2"]
    assert not [row for row in memory if row.strip().startswith("host_")]
    total_row = memory[7].split()
    predicted, rank0, rank1 = (int(total_row[i].replace(",", "")) for i in (1, -2, -1))
    # Measured bytes exceed the byte model only by bucket padding and step counters.
    assert predicted <= rank0 <= predicted * 1.05 and predicted <= rank1 <= predicted * 1.05


def test_demo_with_a_config_that_is_not_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Runs in-process: a plan that is not OK stops before any rank is started.
    config = _write(tmp_path / "c.json", {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert main(["demo", "--config", str(config)]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"config ({config}):\n")
    assert "\nstatus: Error" in captured.out
    assert "nearest supported configs:" in captured.out
    bad = _write(tmp_path / "bad.json", {"bf16": {"enabled": "yes"}})
    assert main(["demo", "--config", str(bad)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_check_shows_the_traffic_and_refuses_a_shard_group_size_the_world_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "shard_group_size": 8},
        "communication_data_type_across_groups": "int8",
    }
    path = str(_write(tmp_path / "hybrid.json", config))
    assert main(["check", path, "--world-size", "64", "--params", "7B"]) == 0
    out = capsys.readouterr().out
    assert "8 shard groups of 8" in out and "across groups" in out
    assert main(["check", path, "--world-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["traffic"]["shard_group_size"] == 8 and data["traffic"]["across_bytes"] > 0
    assert main(["check", path]) == 0  # no world given: two groups of 8
    assert "2 shard groups of 8" in capsys.readouterr().out
    assert main(["check", path, "--world-size", "12"]) == 2
    err = capsys.readouterr().err
    assert "shard_group_size 8 does not divide the data-parallel world size 12" in err


def test_help_answers_without_importing_torch() -> None:
    """``dtypeplan --help`` is read before anything is resolved: it must not wait for torch."""
    import subprocess
    import sys

    probe = (
        "import sys, contextlib, io\n"
        "from dtypeplan.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "import dtypeplan\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# --- output into a closed pipe (issue 47: `check ... | head`) ---------------------------------
def _run_into_closed_pipe(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """``python -m dtypeplan ARGV`` writing into a pipe whose reader is gone already, as
    ``| head`` leaves it once it has its lines: every write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        return subprocess.run(
            [sys.executable, "-m", "dtypeplan", *argv],
            cwd=ROOT,
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.slow
def test_check_into_a_closed_pipe_exits_quietly_with_its_verdict(tmp_path: Path) -> None:
    ok = _write(tmp_path / "ok.json", {"bf16": {"enabled": True}})
    error = _write(tmp_path / "error.json", {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    refused = _write(
        tmp_path / "auto.json",
        {**HF_AUTO, "master_weights": {"dtype": "bf16", "rounding": "stochastic"}},
    )
    for argv, verdict in (
        (["check", str(ok)], 0),
        (["check", str(ok), "--json"], 0),
        (["check", str(error)], 2),
        (["check", str(refused)], 2),  # "auto" precision: a plan per choice, the worst
        (["table"], 141),  # 128 + SIGPIPE, as a shell reports a tool the reader stopped
    ):
        result = _run_into_closed_pipe(*argv)
        assert result.stderr == b"", (argv, result.stderr.decode()[-2000:])
        assert result.returncode == verdict, argv


def test_check_help_states_the_exit_codes_the_code_returns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The exit codes /work/shared/API.md gives (0 OK, 1 NotSupported, 2 Error), and for
    unfilled "auto" precision keys the worst of the choices shown (as
    test_check_exits_non_zero_when_any_shown_choice_is_refused checks)."""
    assert main(["check", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit 0 for OK, 1 for NotSupported, 2 for Error or an invalid config" in text
    assert "the exit code is the worst of theirs" in text
    assert "HF default" not in text


def test_diff_names_the_combinations_an_edit_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diff", "shipped", "shipped"]) == 0
    assert capsys.readouterr().out == "same\n"
    shipped = Path(default_rules_path()).read_text()
    start = shipped.index("  - id: zero3-wire-across")
    end = shipped.index("  - id: zero3-fp32-sum")
    edited = tmp_path / "edited.yaml"
    # Refuse plain shard groups (HSDP) at ZeRO-3 too: one gate widened.
    edited.write_text(
        shipped[:start]
        + shipped[start:end].replace(
            "{stage: 3, shard_groups: wire_across}", "{stage: 3, shard_groups: shard_groups_any}"
        )
        + shipped[end:]
    )
    assert main(["diff", "shipped", str(edited)]) == 1
    out = capsys.readouterr().out
    assert "-> NotSupported [zero3-wire-across]" in out and "OK fsdp2" in out, out
    assert out.splitlines()[-1].endswith("combinations decided otherwise"), out
