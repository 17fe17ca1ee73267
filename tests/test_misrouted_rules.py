"""A rules file that routes ZeRO-3 to an implementation that does not serve it (issue 47) is
refused on load; a model ZeRO-3 sharded and built by another plan is refused at build, saying
why; and a collective that cannot start on a rank's own tensors blames no peer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dtypeplan
from dtypeplan.comm import Communicator
from dtypeplan.comm._collectives import CollectiveError
from dtypeplan.launch import spawn
from dtypeplan.resolver._rules import default_rules_path
from tests.workers.misrouted_rules import prepare_with_one_build_with_other


def _zero3_to_sharded(tmp_path: Path) -> Path:
    text = Path(default_rules_path()).read_text()
    rule = text.index("  - id: zero3\n")
    at = text.index("implementation: fsdp2", rule)
    path = tmp_path / "misrouted.yaml"
    path.write_text(
        text[:at] + "implementation: sharded" + text[at + len("implementation: fsdp2") :]
    )
    return path


def test_zero3_routed_to_the_flat_engine_is_refused_on_load(tmp_path: Path) -> None:
    with pytest.raises(dtypeplan.RulesError) as info:
        dtypeplan.load_rules(_zero3_to_sharded(tmp_path))
    message = str(info.value)
    assert "misrouted.yaml:" in message and "rule 'zero3'" in message, message
    assert "'sharded'" in message and "only without a process group" in message, message


@pytest.mark.slow
def test_sharded_parameters_built_by_a_whole_tensor_implementation_say_why() -> None:
    for result in spawn(prepare_with_one_build_with_other, 2, 2, timeout_s=300):
        assert result["raised"] == "OptimizerUsageError", result
        message = result["message"]
        assert "DTensors" in message and "ShardedOptimizer" in message, message
        assert "precision_rules.yaml:" in message and "same plan" in message, message
        assert "peer" not in message, message


def test_a_collective_that_cannot_start_here_blames_no_peer() -> None:
    comm = Communicator()
    with pytest.raises(CollectiveError) as info:
        with comm._guard("broadcast", 64, torch.float32):
            raise NotImplementedError(
                "Operator c10d.broadcast_.default does not have a sharding strategy registered."
            )
    message = str(info.value)
    assert "broadcast of 64 fp32 elements could not start" in message, message
    assert "no peer failed" in message and "probably died" not in message, message
    assert isinstance(info.value.__cause__, NotImplementedError)
