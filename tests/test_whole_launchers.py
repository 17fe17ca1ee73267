"""The optimizers that need each parameter whole, under the launchers users type (issue 44).

tests/test_whole_frameworks.py reaches them through the spawn harness; here each framework is
started as its users start it, 2 gloo CPU ranks of a tiny GPT-2 in bf16:

* the HF Trainer: tests/data/hf_scripts/run_clm.py, unedited, under ``dtypeplan run
  --nproc_per_node 2 ... --deepspeed ds_config.json``, the config in DeepSpeed's format with
  ``"type": "Muon"`` (DeepSpeed's Muon: Muon on the hidden matrices, AdamW on the rest) or
  ``"type": "Adafactor"`` (torch's), and (``DTYPEPLAN_FULL_MATRICES=1``) the Trainer's own
  ``--optim adafactor`` (transformers' Adafactor) with no optimizer block; each at ZeRO-1 and
  ZeRO-3. The script runs under tests/launched/hf_rank_facts.py, which adds one callback that
  has each rank write what it holds when training ends (the Trainer logs and saves rank 0's);
* Lightning under its own launcher (``python lightning_recipe.py``: Lightning starts the other
  process) with DeepSpeed's ``"Muon"`` block and ``configure_optimizers`` returning None;
* Accelerate under ``accelerate launch --multi_gpu`` with DeepSpeed's ``"Muon"`` block (the
  launcher's ``--use_deepspeed`` needs DeepSpeed installed to start at all), trained, and
  (``DTYPEPLAN_FULL_MATRICES=1``) resumed from Accelerate's checkpoint in a fresh launch;
* (``DTYPEPLAN_FULL_MATRICES=1``) the HF docs' ds_config_zero2.json with its type changed to
  "Muon" under ``dtypeplan run``: refused on every rank with the table's reason (offload).

Each run must: train (the loss finite and falling where the data allows, every weight moved);
run the whole-tensor optimizer, not a fallback (``implementation`` "whole", the torch class
that steps, each parameter owned by exactly one rank with the states of its class: Muon's
``momentum_buffer`` on exactly DeepSpeed's Muon parameters, AdamW's moments on the rest,
Adafactor's row and column statistics on the matrices); and leave both ranks holding the same
parameters, each the rounding of its fp32 master (DeepSpeed's Muon diverged across ranks at
ZeRO-1/2: deepspeedai/DeepSpeed#8090). ZeRO-1 and ZeRO-3 end on the same masters within
:data:`STAGE_BOUND` of the distance trained (measured: bitwise equal, both classes).

Cost: 20-25 s a launch on 2 cores. CI's slow run takes the HF Trainer's two classes at both
stages, Lightning at ZeRO-3 and Accelerate at ZeRO-1: six launches, about 145 s; with
``DTYPEPLAN_FULL_MATRICES=1`` also the Trainer's ``--optim adafactor``, Lightning at ZeRO-1
and each Lightning stage resumed from its checkpoint, Accelerate at ZeRO-3 and each stage
resumed, and the refusal.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._helpers import full_matrices, full_only
from tests.launched.whole import MUON_LR, digest
from tests.test_launchers import (
    LAUNCH_TIMEOUT_S,
    ROOT,
    accelerate_launch,
    launch_env,
    lightning_own,
    rank_facts,
    run_launcher,
)

RUN_CLM = ROOT / "tests" / "data" / "hf_scripts" / "run_clm.py"
HF_ZERO2 = "tests/data/deepspeed_configs/hf_transformers__ds_config_zero2.json"
OVERRIDES = (
    "vocab_size=128,n_positions=32,n_embd=32,n_layer=2,n_head=2,"
    "embd_pdrop=0,resid_pdrop=0,attn_pdrop=0"
)
"""The tiny GPT-2 of tests/test_trainer_launchers.py, no dropout."""
STEPS, SAMPLES = 6, 8
"""Optimizer steps; the samples, all of them in each step (2 ranks x 2 micro-batches x 2): the
loss of the same batch falls step after step."""
STAGE_BOUND = 5 * 2.0**-8
"""ZeRO-1 against ZeRO-3, relative to the distance the masters moved: Muon's bf16 Newton-Schulz
may round inputs an fp32 ulp apart differently at each of its 5 iterations, 2^-8 of the update
each (tests/test_whole_tensor.py's derivation); with bf16 parameters an fp32 ulp between two
masters may round to different parameters, as much for Adafactor."""

BASE_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
}
"""A DeepSpeed config as its docs write one, every value the Trainer knows "auto"."""
HF_CASES: dict[str, dict[str, Any]] = {
    "Muon": {
        # DeepSpeed's Muon, as its docs write the block: lr for Muon, adam_lr for the rest.
        "block": {
            "type": "Muon",
            "params": {
                "lr": "auto",
                "momentum": 0.95,
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto",
                "adam_lr": 3e-3,
            },
        },  # fmt: skip
        "args": ["--learning_rate", str(MUON_LR)],
        "inner": "dtypeplan.muon.MuonWithAuxAdamW",
    },
    "Adafactor": {
        "block": {"type": "Adafactor", "params": {"lr": "auto", "weight_decay": "auto"}},
        "args": ["--learning_rate", "1e-2"],
        "inner": "torch.optim.Adafactor",
    },
    "hf adafactor": {  # the Trainer's own optim=, with no optimizer block in the config
        "args": ["--learning_rate", "1e-2", "--optim", "adafactor"],
        "inner": "transformers.optimization.Adafactor",
    },
}


def _hf_config(path: Path, name: str, stage: int) -> Path:
    config = {**BASE_CONFIG, "zero_optimization": {"stage": stage}}
    if "block" in HF_CASES[name]:
        config["optimizer"] = HF_CASES[name]["block"]
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def _dtypeplan_run(out: Path, config: Path, *args: str) -> list[str]:
    """``dtypeplan run`` of run_clm.py, unedited, with each rank's facts written to ``out``."""
    launcher = [sys.executable, "-m", "dtypeplan", "run", "--standalone", "--nproc_per_node", "2"]
    return [
        *launcher, "-m", "tests.launched.hf_rank_facts", str(out), str(RUN_CLM),
        "--deepspeed", str(config), "--model_type", "gpt2", "--config_overrides", OVERRIDES,
        "--do_train", "--output_dir", str(out / "output"), "--max_steps", str(STEPS),
        "--save_steps", "3", "--logging_steps", "1", "--num_train_samples", str(SAMPLES),
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--lr_scheduler_type", "constant", "--max_grad_norm", "0.5", "--bf16", "--use_cpu",
        "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0", *args,
    ]  # fmt: skip


def _start_weights() -> dict[str, torch.Tensor]:
    """run_clm.py's model before training (``set_seed(42)``, then the model from the config)."""
    import transformers

    transformers.set_seed(42)
    config = transformers.GPT2Config()
    config.update_from_string(OVERRIDES)
    model = transformers.GPT2LMHeadModel(config)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_falling(losses: list[float]) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), f"not falling: {losses}"


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[n].float() - b[n].float()).square().sum()) for n in a))


def _assert_ran_whole(ranks: list[dict[str, Any]], stage: int, inner: str) -> dict[str, str]:
    """Both ranks ran ``inner`` on whole parameters at ``stage``, each parameter owned by one
    rank, and hold the same parameters, each its master's rounding. Returns each parameter's
    states by name."""
    for ran in ranks:
        assert (ran["implementation"], ran["stage"], ran["inner"]) == ("whole", stage, inner), ran
        assert ran["held"] == ran["masters_as_held"], "a parameter is not its master's rounding"
        assert ran["owned"], "a rank owns nothing: the parameters are not spread over the ranks"
    assert ranks[0]["held"] == ranks[1]["held"], "the ranks hold different parameters"
    assert ranks[0]["masters"] == ranks[1]["masters"], "the ranks export different masters"
    owned = [set(ran["owned"]) for ran in ranks]
    assert not owned[0] & owned[1], f"owned twice: {owned[0] & owned[1]}"
    assert owned[0] | owned[1] == set(ranks[0]["held"]), "a parameter has no owner"
    return {name: "+".join(states) for ran in ranks for name, states in ran["owned"].items()}


def _assert_states(name: str, states: dict[str, str], shapes: dict[str, torch.Size]) -> None:
    """The states of the class that ran, on the parameters it runs them on."""
    if name == "Muon":
        # DeepSpeed's tag (deepspeed.runtime.utils.set_optimizer_flags): 2-D, no "embed" or
        # "lm_head" in the name; torch's Muon takes matrices only.
        muon = {
            n
            for n in shapes
            if len(shapes[n]) == 2 and "embed" not in n.lower() and "lm_head" not in n.lower()
        }
        expected = {
            n: "momentum_buffer" if n in muon else "exp_avg+exp_avg_sq+step" for n in shapes
        }
    elif name == "Adafactor":
        expected = {
            n: "col_var+row_var+step" if len(s) == 2 else "step+variance" for n, s in shapes.items()
        }
    else:  # transformers' Adafactor: factored second moment on matrices, RMS on every tensor
        expected = {
            n: "RMS+exp_avg_sq_col+exp_avg_sq_row+step" if len(s) == 2 else "RMS+exp_avg_sq+step"
            for n, s in shapes.items()
        }  # fmt: skip
    assert states == expected, {
        n: (states.get(n), expected[n]) for n in expected if states.get(n) != expected[n]
    }


def _trainer_run(tmp_path: Path, name: str, stage: int) -> dict[str, Any]:
    """One launch at ``stage``: what it logged, wrote and held, checked."""
    from safetensors.torch import load_file

    out = tmp_path / f"zero{stage}"
    out.mkdir()
    config = _hf_config(tmp_path / f"ds_zero{stage}.json", name, stage)
    run_launcher(_dtypeplan_run(out, config, *HF_CASES[name]["args"]), ROOT)
    output = out / "output"
    state = json.loads((output / "trainer_state.json").read_text(encoding="utf-8"))
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(losses) == STEPS, losses
    _assert_falling(losses)
    ranks = [json.loads((out / f"ran.{rank}.json").read_text()) for rank in (0, 1)]
    states = _assert_ran_whole(ranks, stage, HF_CASES[name]["inner"])
    masters = load_file(str(output / "model.safetensors"))
    saved = {n: digest(masters[n]) for n in ranks[0]["masters"]}
    assert saved == ranks[0]["masters"], "the Trainer saved other weights than the fp32 masters"
    start = _start_weights()
    _assert_states(name, states, {n: start[n].shape for n in states})
    unmoved = [n for n in start if torch.equal(start[n], masters[n])]
    assert not unmoved, f"not trained: {unmoved}"
    return {"losses": losses, "masters": masters, "moved": _distance(masters, start)}


HF_TRAINER_CASES = [
    pytest.param(name, marks=full_only("the config's two classes") if name == "hf adafactor"
                 else ()) for name in HF_CASES
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", HF_TRAINER_CASES)
def test_unedited_trainer_script_trains_a_whole_class(tmp_path: Path, name: str) -> None:
    one, three = (_trainer_run(tmp_path, name, stage) for stage in (1, 3))
    apart = _distance(one["masters"], three["masters"])
    assert apart <= STAGE_BOUND * one["moved"], (apart, one["moved"])
    print(
        f"dtypeplan run run_clm.py {name}: losses at ZeRO-1 {one['losses']}, ZeRO-3 "
        f"{three['losses']}; masters moved {one['moved']:.3f} (L2), ZeRO-1 to ZeRO-3 "
        f"{apart / one['moved']:.1e} of that"
    )


LIGHTNING_STAGES = [pytest.param(1, marks=full_only("ZeRO-3, without the resume")), 3]


@pytest.mark.slow
@pytest.mark.parametrize("stage", LIGHTNING_STAGES)
def test_lightning_deepspeed_muon_under_its_launcher(tmp_path: Path, stage: int) -> None:
    phases = ("straight", "first", "resume") if full_matrices() else ("straight",)
    for phase in phases:
        arguments = ("python", str(stage), str(tmp_path), phase, "muon")
        run_launcher(lightning_own("lightning_recipe.py", *arguments), ROOT)
    straight = rank_facts(tmp_path, "straight")
    for facts in straight:
        assert facts["world_size"] == 2 and facts["global_step"] == 4
        assert facts["explained_lr"] == MUON_LR
        _assert_falling(facts["losses"])  # one sequence, repeated: the same data each step
    assert [f["sampler"][1:] for f in straight] == [[2, 0], [2, 1]]
    states = _assert_ran_whole([f["ran"] for f in straight], stage, HF_CASES["Muon"]["inner"])
    shapes = _recipe_shapes("model.")
    _assert_states("Muon", states, shapes)
    if "resume" in phases:
        assert rank_facts(tmp_path, "resume")[0]["masters"] == straight[0]["masters"], (
            "resume is not bitwise"
        )
    print(f"Lightning ZeRO-{stage} DeepSpeed Muon: losses {straight[0]['losses']}, phases {phases}")


def _recipe_shapes(prefix: str) -> dict[str, torch.Size]:
    """The recipes' tiny GPT-2 (tests/workers/real_models.py): each parameter's shape."""
    from tests.workers.real_models import build_model

    return {prefix + n: p.shape for n, p in build_model("gpt2").named_parameters()}


ACCELERATE_STAGES = [1, pytest.param(3, marks=full_only("ZeRO-1, without the resume"))]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ACCELERATE_STAGES)
def test_accelerate_launch_deepspeed_muon(tmp_path: Path, stage: int) -> None:
    phases = ("full", "resume") if full_matrices() else ("full",)
    for phase in phases:
        command = accelerate_launch(
            "accelerate_recipe.py", str(stage), str(tmp_path), phase, "muon"
        )
        run_launcher(command, ROOT)
    full = rank_facts(tmp_path, "full")
    for facts in full:
        assert facts["num_processes"] == 2
        assert facts["distributed_type"] == "DistributedType.MULTI_CPU"
        assert facts["plan_lr"] == MUON_LR
        assert all(math.isfinite(x) for x in facts["losses"]), facts["losses"]
    assert full[0]["seen"] != full[1]["seen"], "both ranks trained on the same batches"
    states = _assert_ran_whole([f["ran"] for f in full], stage, HF_CASES["Muon"]["inner"])
    _assert_states("Muon", states, _recipe_shapes(""))
    from tests.workers.real_models import build_model

    # The data are new random tokens each step (the loss cannot fall far): every weight moved.
    start = {n: p.detach() for n, p in build_model("gpt2").named_parameters()}
    ended = {
        n: torch.tensor(full[0]["masters"][n], dtype=torch.int32).view(torch.float32) for n in start
    }
    unmoved = [n for n in start if torch.equal(start[n].flatten(), ended[n])]
    assert not unmoved, f"not trained: {unmoved}"
    if "resume" in phases:
        resumed = rank_facts(tmp_path, "resume")
        _assert_ran_whole([f["ran"] for f in resumed], stage, HF_CASES["Muon"]["inner"])
        assert resumed[0]["masters"] == full[0]["masters"], "resume is not bitwise"
    print(f"accelerate launch ZeRO-{stage} DeepSpeed Muon: losses {[f['losses'] for f in full]}")


@pytest.mark.slow
@full_only("the launched trainings above")
def test_hf_docs_zero2_file_with_muon_is_refused_under_the_launcher(tmp_path: Path) -> None:
    """The first config a Trainer user tries: the HF docs' ds_config_zero2.json with its type
    changed to "Muon". Its optimizer offload is not served for whole parameters (the owner
    keeps its whole master on the device): every rank stops with the table's reason, naming
    offload, before a step; no hang, no silent training without Muon."""
    config = json.loads((ROOT / HF_ZERO2).read_text(encoding="utf-8"))
    config["optimizer"]["type"] = "Muon"
    path = tmp_path / "ds_config_zero2_muon.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    out = tmp_path / "run"
    out.mkdir()
    done = subprocess.run(
        _dtypeplan_run(out, path, "--learning_rate", str(MUON_LR)), cwd=ROOT, env=launch_env(),
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout[-2000:]
    refusals = {
        line.partition("]: ")[0]: line
        for line in done.stderr.splitlines()
        if "dtypeplan.errors.NotSupportedError: " in line
    }
    assert sorted(refusals) == ["[rank0", "[rank1"], done.stderr[-4000:]  # each rank says why
    for line in refusals.values():
        assert "whole parameters" in line and "offload" in line, line
    assert not (out / "ran.0.json").exists() and not (out / "output" / "checkpoint-3").exists()
