"""The HF Trainer under the real launcher (issue 27): ``torchrun`` and ``dtypeplan run``.

Every run is a subprocess (``sys.executable -m torch.distributed.run --standalone`` or
``python -m dtypeplan run``) of 2 gloo CPU ranks with the repository first on PYTHONPATH, on
a tiny GPT-2 built from a config (no hub download), bf16:

* the recipe (``DtypeplanTrainer(..., dtypeplan_config=...)``, tests/workers/
  trainer_torchrun.py) at ZeRO 1 and 3: trains as the plain Trainer does (losses, masters,
  Adam moment within bf16's bound, every step clipped with the optimizer's norm logged),
  resumes bitwise from the Trainer's own checkpoint (``resume_from_checkpoint``), and the
  weights it saves (final and in the checkpoint) load with ``from_pretrained(dir)``, no dtype
  argument, as the fp32 masters;
* tests/data/hf_scripts/run_clm.py, a run_clm.py-shaped script written for the plain
  Trainer, unedited, under ``dtypeplan run --nproc_per_node 2 run_clm.py --deepspeed CFG``:
  with the HF docs' ds_config_zero2.json as it is (the default run's one case), and at ZeRO
  1 and 3 trained, resumed from its checkpoint with ``--resume_from_checkpoint`` bitwise,
  weights in fp32.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._helpers import assert_framework_case, full_only
from tests.workers.integrations import MAX_GRAD_NORM, SAVE_AT, hf_config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "data" / "hf_scripts" / "run_clm.py"
HF_ZERO2 = REPO / "tests" / "data" / "deepspeed_configs" / "hf_transformers__ds_config_zero2.json"
HF_DOCS_ZERO3 = REPO / "tests" / "data" / "hf_docs" / "ds_config_zero3.json"
"""The HF docs' ZeRO-3 file (offload_param and offload_optimizer cpu; tests/data/hf_docs/)."""
TIMEOUT_S = 600
OVERRIDES = (
    "vocab_size=128,n_positions=32,n_embd=32,n_layer=2,n_head=2,"
    "embd_pdrop=0,resid_pdrop=0,attn_pdrop=0"
)
"""The workers' tiny GPT-2 (tests/workers/real_models.build_model), no dropout."""
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


def _env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (in CI the package is installed
    editable from the clone, which is the same tree), one thread per rank, and no launcher
    variables left over from a harness that ran earlier in this process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def _launch(command: list[str], log: Path) -> None:
    with open(log, "w", encoding="utf-8") as handle:
        done = subprocess.run(
            command, cwd=REPO, env=_env(), stdout=handle, stderr=subprocess.STDOUT,
            timeout=TIMEOUT_S, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        tail = log.read_text(encoding="utf-8")[-6000:]
        raise AssertionError(f"{command[:6]}... exited {done.returncode}:\n{tail}")


# --- the recipe under torchrun ----------------------------------------------------------------


def _recipe_under_torchrun(root: Path, stage: int, dtype: str) -> list[dict[str, Any]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*torchrun, "--nproc_per_node", "2", "-m", "tests.workers.trainer_torchrun"]
    _launch([*command, str(root), str(stage), dtype], root / "torchrun.log")
    results = []
    for rank in range(2):
        with open(root / f"result.{rank}.pkl", "rb") as handle:
            status, value = pickle.load(handle)
        assert status == "ok", f"rank {rank}:\n{value}"
        results.append(value)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_trainer_recipe_under_torchrun(tmp_path: Path, stage: int) -> None:
    results = _recipe_under_torchrun(tmp_path, stage, "bf16")
    case = f"trainer-stage{stage}-bf16"
    assert_framework_case(results, case, MAX_GRAD_NORM)
    for rank, got in enumerate(results):
        assert got["plan"]["stage"] == stage and got["plan"]["param_dtype"] == "torch.bfloat16"
        # from_pretrained(dir), no dtype argument: the fp32 masters, final and checkpoint
        assert got["saved_weights"]["loaded_dtypes"] == ["torch.float32"], (rank, got)
        checkpoint = got["checkpoint_weights"]
        assert checkpoint["loaded_dtypes"] == checkpoint["stored_dtypes"] == ["torch.float32"]
        assert checkpoint["names"] == got["expected_names"]
    got = results[0]
    worst_loss = max(
        abs(a - b) / abs(b) for a, b in zip(got["losses"], got["ref_losses"], strict=True)
    )
    print(
        f"torchrun ZeRO-{stage} bf16: {len(got['losses'])} micro-batch losses, worst relative "
        f"difference to the plain Trainer {worst_loss:.2e}, master_rel {got['master_rel']:.2e},"
        f" exp_avg_rel {got['exp_avg_rel']:.2e}, logged norms {got['logged_norms']}; resumed "
        f"{len(got['resumed_losses'])} losses bitwise, masters bitwise; saved "
        f"{len(got['saved_weights']['names'])} weights loaded as "
        f"{got['saved_weights']['loaded_dtypes']} (checkpoint "
        f"{got['checkpoint_weights']['loaded_dtypes']})"
    )


# --- run_clm.py, unedited, under `dtypeplan run` ------------------------------------------------


def _run_clm(output: Path, config: Path, steps: int, *extra: str) -> None:
    command = [sys.executable, "-m", "dtypeplan", "run", "--standalone", "--nproc_per_node", "2"]
    arguments = [
        str(SCRIPT), "--deepspeed", str(config), "--model_type", "gpt2",
        "--config_overrides", OVERRIDES, "--do_train", "--output_dir", str(output),
        "--max_steps", str(steps), "--save_steps", str(SAVE_AT), "--logging_steps", "1",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--learning_rate", "3e-3", "--warmup_steps", "2", "--max_grad_norm", str(MAX_GRAD_NORM),
        "--bf16", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_num_workers", "0", *extra,
    ]  # fmt: skip
    output.mkdir(parents=True, exist_ok=True)
    _launch([*command, *arguments], output.parent / f"{output.name}.log")


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _plan_in(checkpoint: Path) -> dict[str, Any]:
    """The plan recorded in the dtypeplan optimizer snapshot of a Trainer checkpoint."""
    (manifest,) = (checkpoint / "dtypeplan_optimizer").glob("snapshot-*/manifest.json")
    plan: dict[str, Any] = json.loads(manifest.read_text(encoding="utf-8"))["plan"]
    return plan


def _steps(output: Path) -> list[dict[str, Any]]:
    state = json.loads((output / "trainer_state.json").read_text(encoding="utf-8"))
    return [e for e in state["log_history"] if "loss" in e]


def _assert_trained_fp32_out(output: Path, stage: int, steps: int) -> dict[str, Any]:
    """The script trained ``steps`` steps on dtypeplan at ``stage`` in bf16, clipping every
    step, and ``from_pretrained(output)`` (no dtype) gives the fp32 masters it wrote."""
    import transformers

    plan = _plan_in(output / f"checkpoint-{SAVE_AT}")
    assert (plan["zero_stage"], plan["param_dtype"]) == (stage, "bf16"), plan
    logged = _steps(output)
    assert [e["step"] for e in logged] == list(range(1, steps + 1)), logged
    assert all(e["grad_norm"] > MAX_GRAD_NORM for e in logged), logged
    stored = _weights(output)
    assert {str(t.dtype) for t in stored.values()} == {"torch.float32"}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(output))
    state = dict(model.named_parameters(remove_duplicate=False))
    assert {str(p.dtype) for p in state.values()} == {"torch.float32"}
    assert all(torch.equal(state[name].detach(), stored[name]) for name in stored)
    assert json.loads((output / "config.json").read_text(encoding="utf-8"))["dtype"] == "float32"
    # trained: every weight moved away from the script's seeded initialization
    transformers.set_seed(42)
    config = transformers.GPT2Config()
    config.update_from_string(OVERRIDES)
    start = dict(transformers.GPT2LMHeadModel(config).named_parameters())
    moved = [n for n in start if not torch.equal(start[n].detach(), state[n].detach())]
    assert moved == list(start), sorted(set(start) - set(moved))
    return {"losses": [e["loss"] for e in logged], "norms": [e["grad_norm"] for e in logged]}


@pytest.mark.slow
def test_dtypeplan_run_unedited_run_clm_hf_zero2(tmp_path: Path) -> None:
    """The default run's case: the HF docs' ds_config_zero2.json as it is (ZeRO-2, optimizer
    offloaded to the CPU, every value "auto" filled from the script's TrainingArguments)."""
    output = tmp_path / "zero2"
    _run_clm(output, HF_ZERO2, SAVE_AT + 1)
    figures = _assert_trained_fp32_out(output, 2, SAVE_AT + 1)
    print(f"dtypeplan run run_clm.py, HF ds_config_zero2.json: {figures}")
    args = torch.load(output / "training_args.bin", weights_only=False)
    # --deepspeed became the dtypeplan config; DeepSpeed was not enabled
    assert args.deepspeed is None and args.dtypeplan_config == str(HF_ZERO2)


@pytest.mark.slow
@full_only("test_dtypeplan_run_hf_docs_zero3_resumes_bitwise, the same file trained")
def test_dtypeplan_run_unedited_run_clm_hf_docs_zero3_offloaded(tmp_path: Path) -> None:
    """The HF docs' ds_config_zero3.json as it is: ZeRO-3 with the parameters and the optimizer
    offloaded to the host (the table's offload-zero3 rule), no bf16 block (the Trainer's
    --bf16 adds it, as Accelerate does for DeepSpeed), every "auto" filled; the weights it
    writes are the fp32 masters."""
    output = tmp_path / "zero3"
    _run_clm(output, HF_DOCS_ZERO3, SAVE_AT + 1)
    figures = _assert_trained_fp32_out(output, 3, SAVE_AT + 1)
    plan = _plan_in(output / f"checkpoint-{SAVE_AT}")
    assert (plan["rule_id"], plan["offload_param"], plan["offload_optimizer"]) == (
        "zero3-offload", "cpu", "cpu"
    ), plan  # fmt: skip
    print(f"dtypeplan run run_clm.py, HF docs ds_config_zero3.json: {figures}")


@pytest.mark.slow
def test_dtypeplan_run_hf_docs_zero3_resumes_bitwise(tmp_path: Path) -> None:
    """The HF docs' ZeRO-3 file, offloaded: resumed from its checkpoint, bitwise."""
    _resumes_bitwise(tmp_path, HF_DOCS_ZERO3, 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage",
    [1, pytest.param(3, marks=full_only("test_dtypeplan_run_hf_docs_zero3_resumes_bitwise"))],
)
def test_dtypeplan_run_unedited_run_clm_resumes_bitwise(tmp_path: Path, stage: int) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(hf_config(stage)), encoding="utf-8")
    _resumes_bitwise(tmp_path, config, stage)


def _resumes_bitwise(tmp_path: Path, config: Path, stage: int) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    steps = 2 * SAVE_AT
    _run_clm(full, config, steps)
    figures = _assert_trained_fp32_out(full, stage, steps)
    checkpoint = full / f"checkpoint-{SAVE_AT}"
    _run_clm(resumed, config, steps, "--resume_from_checkpoint", str(checkpoint))
    # The resumed run's log holds the checkpoint's steps 1..SAVE_AT, then its own.
    again = _steps(resumed)
    assert [e["step"] for e in again] == list(range(1, steps + 1)), again
    assert [e["loss"] for e in again] == figures["losses"], (again, figures)
    assert [e["grad_norm"] for e in again] == figures["norms"], (again, figures)
    ours, theirs = _weights(full), _weights(resumed)
    assert sorted(ours) == sorted(theirs)
    different = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not different, f"resume is not bitwise: {different}"
    print(
        f"dtypeplan run run_clm.py ZeRO-{stage} bf16: losses {figures['losses']}, norms "
        f"{figures['norms']}; resumed from checkpoint-{SAVE_AT}: {len(ours)} fp32 tensors of "
        "model.safetensors bitwise equal to the uninterrupted run's"
    )


def test_dtypeplan_run_is_torchrun_with_the_rank_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dtypeplan run`` passes torchrun's options through, starts the rank module, keeps the
    script's arguments as they are (``-m`` a module, ``--deepspeed`` the script's), and
    returns torchrun's exit code."""
    from dtypeplan import cli

    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda command: calls.append(command) or 7)
    script = ["train.py", "--deepspeed", "ds.json", "-m", "--bf16"]
    assert cli.main(["run", "--nproc_per_node", "2", "--standalone", *script]) == 7
    assert cli.main(["run", "--nnodes=1", "-m", "pkg.train", "--deepspeed", "ds.json"]) == 7
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    rank = ["-m", "dtypeplan.integrations.hf_trainer_run"]
    assert calls == [
        [*torchrun, "--nproc_per_node", "2", "--standalone", *rank, *script],
        [*torchrun, "--nnodes=1", *rank, "-m", "pkg.train", "--deepspeed", "ds.json"],
    ]
    assert cli.main(["run", "--no-python", "train.py"]) == cli.EXIT_ERROR
    assert cli.main(["run"]) == cli.EXIT_ERROR


@pytest.mark.slow
def test_use_for_unedited_scripts_in_a_fresh_process(tmp_path: Path) -> None:
    """What ``dtypeplan run`` does in a rank before the script (a subprocess: it changes
    transformers for the whole process): Trainer, Seq2SeqTrainer and classes defined later are
    DtypeplanTrainers; TrainingArguments' deepspeed (a dict, a JSON text) is the dtypeplan
    config and DeepSpeed is not enabled; a Trainer without one refuses, naming --deepspeed."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.workers.unedited_patch", str(tmp_path)], cwd=REPO,
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    stage1, auto = {"zero_optimization": {"stage": 1}}, {"bf16": {"enabled": "auto"}}
    assert facts == {
        "trainer": True, "seq2seq": True, "mine": True,
        "args": [None, stage1, None, auto, None],
        "deepspeed_enabled": False, "config": stage1, "refused": True,
    }  # fmt: skip
