"""The framework recipes under the launchers users type, not our spawn harness.

Each launcher starts 2 CPU processes of a script in ``tests/launched/`` (gloo): the recipe
trains, a fresh launch resumes from the framework's own checkpoint bitwise, and the weights
written load back with the framework's usual call as the fp32 masters. The data each rank saw
is checked too: a run that the framework took for one process would train both ranks on the
same batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._helpers import full_matrices, full_only

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 420


def launch_env() -> dict[str, str]:
    """The environment of a launched run: this checkout first on the path (the scripts import
    ``tests.workers``), one thread per rank, and no accelerator settings of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def run_launcher(command: list[str], cwd: Path) -> None:
    done = subprocess.run(
        command, cwd=cwd, env=launch_env(), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited {done.returncode}\n{done.stdout[-4000:]}\n"
            f"{done.stderr[-8000:]}"
        )


def torchrun(script: str, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(ROOT / "tests" / "launched" / script), *args,
    ]  # fmt: skip


def accelerate_launch(script: str, *args: str) -> list[str]:
    # Accelerate's launcher starts several local processes through torchrun with --multi_gpu;
    # its --cpu flag starts one (several CPU processes are its mpirun path).
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--main_process_ip", "127.0.0.1", "--main_process_port",
        str(_free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
        str(ROOT / "tests" / "launched" / script), *args,
    ]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_facts(out: Path, phase: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{phase}.{rank}.json").read_text()) for rank in (0, 1)]


def assert_fp32_weights(directory: Path, masters: dict[str, list[int]]) -> None:
    """``from_pretrained(dir)`` with no dtype argument gives the fp32 masters, bit for bit."""
    import transformers

    assert json.loads((directory / "config.json").read_text())["dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    loaded = dict(model.named_parameters(remove_duplicate=False))
    assert {str(p.dtype) for p in loaded.values()} == {"torch.float32"}
    for name, bits in masters.items():
        got = loaded[name].detach().contiguous().view(torch.int32).flatten().tolist()
        assert got == bits, name


ACCELERATE_CASES = [
    pytest.param(launcher, stage, id=f"{launcher}-zero{stage}", marks=() if (launcher, stage) in (
        ("torchrun", 1), ("accelerate", 3)) else full_only("each launcher at one stage"))
    for launcher in ("torchrun", "accelerate") for stage in (1, 3)
]  # fmt: skip


@pytest.mark.parametrize(("launcher", "stage"), ACCELERATE_CASES)
@pytest.mark.slow
def test_accelerate_recipe_under_its_launcher(launcher: str, stage: int, tmp_path: Path) -> None:
    start = torchrun if launcher == "torchrun" else accelerate_launch
    for phase in ("full", "resume"):
        run_launcher(start("accelerate_recipe.py", str(stage), str(tmp_path), phase), ROOT)
    full, resumed = rank_facts(tmp_path, "full"), rank_facts(tmp_path, "resume")
    for facts in full:
        assert facts["num_processes"] == 2 and facts["world_size"] == 2
        assert facts["distributed_type"] == "DistributedType.MULTI_CPU"
        # mixed_precision="bf16" filled the all-"auto" precision keys; no fp32 run.
        assert facts["plan_param_dtype"] == "torch.bfloat16"
        # At ZeRO-3 the parameters are FSDP2's fp32 shards, gathered in bf16 for compute.
        assert facts["param_dtypes"] == ["torch.float32" if stage == 3 else "torch.bfloat16"]
        assert facts["plan_lr"] == 3e-3
    assert full[0]["seen"] != full[1]["seen"], "both ranks trained on the same batches"
    assert full[0]["masters"] == full[1]["masters"]
    assert resumed[0]["masters"] == full[0]["masters"], "resume is not bitwise"
    assert_fp32_weights(tmp_path / "weights-full" / "pretrained", full[0]["masters"])
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "weights-full" / "save_model" / "model.safetensors")
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.contiguous().view(torch.int32).flatten().tolist() == full[0]["masters"][name]


def lightning_own(script: str, *args: str) -> list[str]:
    """``python script.py``: Lightning starts the other process itself."""
    return [sys.executable, str(ROOT / "tests" / "launched" / script), *args]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_lightning_recipe_under_its_launcher(launcher: str, stage: int, tmp_path: Path) -> None:
    if not full_matrices() and (launcher, stage) not in (("python", 3), ("torchrun", 1)):
        pytest.skip("CI runs each launcher at one stage; DTYPEPLAN_FULL_MATRICES=1 runs all four")
    start = lightning_own if launcher == "python" else torchrun
    for phase in ("straight", "first", "resume"):
        run_launcher(start("lightning_recipe.py", launcher, str(stage), str(tmp_path), phase), ROOT)
    straight, first = rank_facts(tmp_path, "straight"), rank_facts(tmp_path, "first")
    resumed = rank_facts(tmp_path, "resume")
    for facts in straight:
        assert facts["world_size"] == 2 and facts["global_step"] == 4
        assert facts["plan_param_dtype"] == "torch.bfloat16"  # from precision="bf16-true"
        assert facts["explained_lr"] == 3e-3  # configure_optimizers', not the config's "auto"
        assert (facts["launcher_env"]["TORCHELASTIC_RUN_ID"] is not None) == (
            launcher == "torchrun"
        )
    assert [f["sampler"] for f in straight] == [
        ["DistributedSampler", 2, 0],
        ["DistributedSampler", 2, 1],
    ], "the data is not split between the ranks"
    assert resumed[0]["global_step"] == 4 and first[0]["global_step"] == 2
    assert resumed[0]["masters"] == straight[0]["masters"], "resume is not bitwise"
    from tests.launched.lightning_recipe import TinyLM

    loaded = TinyLM.load_from_checkpoint(tmp_path / "straight.ckpt", map_location="cpu")
    params = dict(loaded.named_parameters(remove_duplicate=False))
    assert {str(p.dtype) for p in params.values()} == {"torch.float32"}
    for name, bits in straight[0]["masters"].items():
        assert params[name].detach().contiguous().view(torch.int32).flatten().tolist() == bits
