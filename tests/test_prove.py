"""``dtypeplan lint --prove`` (issue 43, item 3): a rules file proven the way the shipped table is,
each OK rule's sample point trained against fp32 ``torch.optim`` (dtypeplan/prove.py).

The default run proves two edits of the shipped file, one rule each (a spawned group of 1 rank
and one of 2 for both): a NotSupported cell turned OK and sent to an implementation that really
serves it passes; an OK claim the implementation does not compute fails, with its error above
the bound. The slow run proves the shipped table through the command line.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

import dtypeplan
from dtypeplan import cli
from dtypeplan.prove import FLOOR, Outcome, bound, prove
from dtypeplan.resolver._rules import default_rules_path

SERVED = "autocast-optimizer-states-zero1"
"""torch_autocast with bf16 optimizer states at ZeRO-1: NotSupported in the shipped table (no
parity test when it was written), computed by the sharded optimizer as any other states cell."""
OVERCLAIMED = "adafactor-zero1"
"""Adafactor (a shaped optimizer) at ZeRO-1 sent to the sharded optimizer, which hands it flat
buffers: it runs unfactored, 0.3% off torch's Adafactor (issue 43)."""


class _Plain(yaml.SafeDumper):
    """Writes a value held twice twice (a rules file refuses YAML anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _shipped() -> dict[str, Any]:
    with open(default_rules_path(), encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _carve(
    document: dict[str, Any], refusal: str, new: dict[str, Any], apart: dict[str, Any]
) -> None:
    """Give the box ``apart`` (one value per dimension) of the NotSupported rule ``refusal`` to
    the OK rule ``new``: the refusal keeps the rest of its box, as one rule per dimension of
    ``apart`` (that dimension's other values, the earlier ones at ``apart``'s)."""
    rules = document["rules"]
    (old,) = [r for r in rules if r["id"] == refusal]
    pieces, fixed = [], {}
    for name, value in apart.items():
        values = old["when"].get(name, _all(name))
        rest = {**copy.deepcopy(old), "id": f"{refusal}-not-{name}"}
        rest["when"] = {**old["when"], **fixed, name: [v for v in values if v != value]}
        pieces.append(rest)
        fixed[name] = value
    index = rules.index(old)
    rules[index : index + 1] = [*pieces, {**new, "when": {**old["when"], **apart}}]


def _all(name: str) -> list[Any]:
    from dtypeplan.resolver._dimensions import DIMENSIONS

    return list(DIMENSIONS[name].values)


def _edited(tmp_path: Path) -> Path:
    document = _shipped()
    _carve(
        document,
        "autocast-optimizer-states-bf16",
        {"id": SERVED, "status": "OK", "implementation": "sharded", "reason": "proven here"},
        {"stage": 1},
    )
    _carve(
        document,
        "shaped-optimizer",
        {"id": OVERCLAIMED, "status": "OK", "implementation": "sharded", "reason": "claimed"},
        {"params": "fp32", "stage": 1},
    )
    path = tmp_path / "edited_rules.yaml"
    path.write_text(yaml.dump(document, Dumper=_Plain, sort_keys=False), encoding="utf-8")
    return path


def test_an_added_combination_passes_and_an_overclaim_fails(tmp_path: Path) -> None:
    rules = _edited(tmp_path)
    assert dtypeplan.load_rules(str(rules))  # well formed: the loader cannot tell them apart
    outcomes = {o.rule_id: o for o in prove(str(rules), only=[SERVED, OVERCLAIMED])}
    assert len(outcomes) == 2, "each rule is new: its first point is the one it adds"
    served, overclaimed = outcomes[SERVED], outcomes[OVERCLAIMED]
    assert served.added and overclaimed.added
    print(f"\n{served.line()}\n{overclaimed.line()}")
    assert served.result == "passed", served.line()
    assert set(served.runs) == {1, 2} and "autocast=" in served.point and "states=" in served.point
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
    assert cli.main(["lint", "--prove"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    print(out)
    lines = [line for line in out.splitlines() if line.startswith(("PASSED", "FAILED", "SKIPPED"))]
    ok = [r for r in dtypeplan.load_rules().rules if r.status == "OK"]
    assert len(lines) == len(ok)
    assert not [line for line in lines if line.startswith("FAILED")]
