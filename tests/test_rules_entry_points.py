"""A user's rules file reaches every entry point that makes a plan (issue 43, item 5).

The user's file here is the shipped table with ZeRO-1 (its whole accumulator, the default)
refused by a gate of the user's own, ``user-refuses-zero1``; ZeRO-1 fp32 is OK in the shipped
table. Each entry point
is given the file the way a user gives it (``resolve(rules=)``; ``dtypeplan check / table /
run --rules``; ``DtypeplanTrainer(dtypeplan_rules=)``; ``DtypeplanAccelerator.resolve(config,
rules=)``; ``DtypeplanStrategy(config, rules=)``) and must refuse a ZeRO-1 config, naming the
user's rule and file. The frameworks and ``dtypeplan run``'s rank module (running
tests/data/hf_scripts/run_clm.py unedited) run on one spawned gloo rank in one group (importing
them costs more than the runs); the slow run also starts ``dtypeplan run`` itself, a real
torchrun of one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import dtypeplan
from dtypeplan import cli
from dtypeplan.launch import spawn
from dtypeplan.resolver._rules import default_rules_path
from tests.workers.entry_points import CONFIG, ENTRY_POINTS, refusals

REPO = Path(__file__).resolve().parents[1]
USER_RULE = "user-refuses-zero1"
REASON = "This team does not run ZeRO-1 (the user's rules file). Use zero_optimization.stage 2."


def refusing_rules(directory: Path) -> Path:
    """The shipped rules file with ZeRO-1's whole accumulator refused by :data:`USER_RULE`."""
    with open(default_rules_path(), encoding="utf-8") as handle:
        document = yaml.safe_load(handle)
    # The first gate that matches decides; ZeRO-1 with a sharded accumulator stays, so that the
    # grid's ZeRO-1 rule still decides something (a rule that decides nothing is refused).
    gate = {"id": USER_RULE, "when": {"stage": 1, "sharded": False}, "status": "NotSupported"}
    document["gates"].insert(0, {**gate, "fix": "zero_optimization.stage 2", "reason": REASON})
    path = directory / "team_rules.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def _refused_by_the_users_rule(message: str, rules: Path) -> None:
    assert USER_RULE in message and rules.name in message, message


def test_resolve_and_the_command_line_take_the_users_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = refusing_rules(tmp_path)
    assert dtypeplan.resolve(CONFIG).status == "OK"  # the shipped table runs it
    plan = dtypeplan.resolve(CONFIG, rules=str(rules))
    assert (plan.status, plan.rule_id) == ("NotSupported", USER_RULE)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG), encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["check", str(config), "--rules", str(rules)]) == cli.EXIT_NOT_SUPPORTED
    assert USER_RULE in capsys.readouterr().out
    assert cli.main(["table", "--rules", str(rules)]) == cli.EXIT_OK
    assert USER_RULE in capsys.readouterr().out
    assert cli.main(["lint", str(rules)]) == cli.EXIT_OK


@pytest.mark.slow
def test_each_framework_refuses_by_the_users_rule(tmp_path: Path) -> None:
    rules = refusing_rules(tmp_path)
    (got,) = spawn(refusals, 1, str(tmp_path), str(rules), timeout_s=600)
    assert set(got) == set(ENTRY_POINTS)
    for name, outcome in got.items():
        assert outcome["raised"] == "NotSupportedError", (name, outcome)
        _refused_by_the_users_rule(outcome["message"], rules)


def test_dtypeplan_run_passes_the_rules_to_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--rules`` is dtypeplan's among torchrun's options (checked once, then passed to the
    rank module as an absolute path); after the script it is the script's own."""
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda command: calls.append(command) or 0)
    shipped = default_rules_path()
    relative = os.path.relpath(shipped)
    script = ["train.py", "--deepspeed", "ds.json", "--rules", "mine"]
    assert cli.main(["run", "--nproc_per_node", "2", "--rules", relative, *script]) == 0
    assert cli.main(["run", f"--rules={shipped}", "-m", "pkg.train"]) == 0
    assert cli.main(["run", "--nproc_per_node", "2", *script]) == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    rank = ["-m", "dtypeplan.integrations.hf_trainer_run"]
    assert calls == [
        [*torchrun, "--nproc_per_node", "2", *rank, "--rules", shipped, *script],
        [*torchrun, *rank, "--rules", shipped, "-m", "pkg.train"],
        [*torchrun, "--nproc_per_node", "2", *rank, *script],
    ]
    assert cli.main(["run", "--rules", "/no/such/rules.yaml", *script]) == cli.EXIT_ERROR
    assert len(calls) == 3, "a rules file that does not load starts no rank"


def _env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "ACCELERATE_USE_CPU")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
def test_dtypeplan_run_refuses_by_the_users_rule(tmp_path: Path) -> None:
    """An unedited HF Trainer script under ``dtypeplan run --rules RULES``: the rank refuses
    the config by the user's rule, and torchrun's exit code says it failed."""
    rules = refusing_rules(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG), encoding="utf-8")
    command = [
        sys.executable, "-m", "dtypeplan", "run", "--rules", str(rules), "--standalone",
        "--nproc_per_node", "1", str(REPO / "tests" / "data" / "hf_scripts" / "run_clm.py"),
        "--deepspeed", str(config), "--model_type", "gpt2", "--config_overrides",
        "vocab_size=128,n_positions=32,n_embd=32,n_layer=2,n_head=2", "--do_train",
        "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--use_cpu",
        "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "NotSupportedError" in output, output[-4000:]
    _refused_by_the_users_rule(output, rules)
