"""``dtypeplan lint --prove`` (issue 43, item 3): a rules file proven the way the shipped table is,
each OK rule's sample point trained against fp32 ``torch.optim`` (dtypeplan/prove.py).

The default run proves two edits of the shipped file (a spawned group of 1 rank and one of 2 for
all their points): a refused combination let through its gate and sent to an implementation
that really serves it passes; an OK claim whose implementation declares it but does not compute
it fails, its error above the bound. The slow run proves the shipped table through the command
line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import dtypeplan
from dtypeplan import cli
from dtypeplan.prove import FLOOR, Outcome, bound, prove
from dtypeplan.resolver._rules import default_rules_path
from tests._helpers import full_matrices

IMPLEMENTATIONS = "tests.workers.prove_implementations"
OVERCLAIMED = "user-shaped-zero1"


class _Plain(yaml.SafeDumper):
    """Writes a value held twice twice (a rules file refuses YAML anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _edited(tmp_path: Path) -> Path:
    """The shipped table with two combinations opened for the user's implementations
    (tests/workers/prove_implementations.py), as docs/truth-table.md adds one: the gate that
    refuses each lets it through (``unless``), and a rule of the grid sends it there. bf16
    states under bf16 autocast at ZeRO-1 go to ``sharded-autocast-states`` with the rest of
    ZeRO-1; a shaped optimizer (Muon, Adafactor) at ZeRO-1 to ``sharded-shaped``, by a new
    rule that takes ZeRO-1 from the shipped ``whole-tensor`` rule."""
    from tests.workers import prove_implementations as user

    with open(default_rules_path(), encoding="utf-8") as handle:
        document = yaml.safe_load(handle)
    gates = {gate["id"]: gate for gate in document["gates"]}
    gates["autocast-optimizer-states"]["unless"] = {
        "stage": 1,
        "autocast": "bf16",
        "states": "bf16",
    }
    (zero1,) = [rule for rule in document["rules"] if rule["id"] == "zero1"]
    zero1["implementation"] = "sharded-autocast-states"
    # The shipped whole-tensor rule keeps ZeRO 0, 2 and 3; the new rule takes ZeRO-1.
    (whole,) = [rule for rule in document["rules"] if rule["id"] == "whole-tensor"]
    whole["when"]["stage"] = [0, 2, 3]
    document["rules"].append(
        {"id": OVERCLAIMED, "when": user.SHAPED, "status": "OK",
         "implementation": "sharded-shaped", "reason": "A shaped optimizer at ZeRO-1 (claimed)."}
    )  # fmt: skip
    path = tmp_path / "edited_rules.yaml"
    path.write_text(yaml.dump(document, Dumper=_Plain, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.slow
def test_an_added_combination_passes_and_an_overclaim_fails(tmp_path: Path) -> None:
    rules = _edited(tmp_path)
    # Well formed, every claim inside a declaration: the loader cannot tell the two apart.
    dtypeplan.load_rules(str(rules))
    outcomes = prove(
        str(rules), imports=[IMPLEMENTATIONS], only=["zero1", OVERCLAIMED], each_value=False
    )
    print("", *(o.line() for o in outcomes), sep="\n")
    first, served, overclaimed = outcomes
    assert (first.rule_id, first.added, first.result) == ("zero1", False, "passed"), first.line()
    # ZeRO-1's first point is the shipped one; the point it adds is the new combination.
    assert (served.rule_id, served.added) == ("zero1", True), served.line()
    assert "autocast=bf16" in served.point and "states=bf16" in served.point, served.line()
    assert served.result == "passed" and set(served.runs) == {1, 2}, served.line()
    # The shipped table runs the point too (whole-tensor): what differs is the implementation.
    assert (overclaimed.rule_id, overclaimed.added) == (OVERCLAIMED, False), overclaimed.line()
    assert overclaimed.result == "failed", overclaimed.line()
    assert overclaimed.error is not None and overclaimed.bound is not None
    assert overclaimed.error > 10 * overclaimed.bound, overclaimed.line()


def test_the_bound_follows_the_dtypes() -> None:
    fp32 = dtypeplan.resolve({"zero_optimization": {"stage": 1}})
    assert bound(fp32) == FLOOR
    bf16 = dtypeplan.resolve({"bf16": {"enabled": True}})
    states = dtypeplan.resolve({"optimizer_states": "bf16"})
    int8 = dtypeplan.resolve({"optimizer_states": "int8"})
    assert FLOOR < bound(states) < bound(int8)
    assert bound(states) < bound(bf16)
    assert bound(bf16, steps=6) == pytest.approx(2 * bound(bf16, steps=3))


def test_lint_prove_reports_each_rule_and_fails_on_a_failed_proof(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line's lines and exit code, the training replaced by given outcomes (the
    test above trains)."""
    import dtypeplan.prove as module

    given = [
        Outcome("a", "params=fp32", "passed", 1e-7, 1e-5),
        Outcome("b", "params=bf16", "skipped", detail="fp8 execution native needs a GPU"),
    ]
    monkeypatch.setattr(module, "prove", lambda *args, **kwargs: given)
    assert cli.main(["lint", "--prove"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "PASSED  a  [params=fp32] max error 1.00e-07 vs bound 1.00e-05" in out
    assert "SKIPPED b  [params=bf16] (fp8 execution native needs a GPU)" in out
    assert "2 points of 2 OK rules: 1 passed, 0 failed, 1 skipped" in out
    given.append(Outcome("c", "params=fp32", "failed", 3e-3, 1e-5, "2 ranks: error"))
    assert cli.main(["lint", "--prove"]) == cli.EXIT_NOT_SUPPORTED
    assert "FAILED  c" in capsys.readouterr().out


@pytest.mark.slow
def test_lint_prove_on_the_shipped_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Every OK rule of the shipped table, a point for each value it matches: none fails (on
    this CPU machine fp8's native execution is the one skipped). Whole under
    DTYPEPLAN_FULL_MATRICES=1 (about 2.5 minutes); CI proves each rule's first point."""
    from dtypeplan.prove import prove

    full = full_matrices()
    ok = {rule.id for rule in dtypeplan.load_rules().rules if rule.status == "OK"}
    outcomes = prove(None, only=ok, each_value=full, progress=print)
    assert {outcome.rule_id for outcome in outcomes} == ok
    if full:
        assert len(outcomes) > 5 * len(ok), "a point for each value"
    assert not [o for o in outcomes if o.result == "failed"], [
        o for o in outcomes if o.result == "failed"
    ]
