"""The README's Accelerate recipe as a user's script, started by a real launcher.

``python -m torch.distributed.run --nproc_per_node 2 accelerate_recipe.py STAGE OUT PHASE`` (or
``accelerate launch --multi_gpu --num_processes 2 ...``) on CPU: the HF docs' all-"auto"
ds_config_zero2.json at ZeRO ``STAGE``, ``DtypeplanAccelerator(mixed_precision="bf16")``,
``accelerator.resolve`` filling the "auto" values. PHASE ``full`` trains ``STEPS`` steps,
saving Accelerate's checkpoint at ``SAVE_AT`` and the weights at the end (``save_model``, and
``save_pretrained`` with ``get_state_dict``); PHASE ``resume`` loads that checkpoint in a
fresh process and trains the remaining steps. Each rank writes what it saw as JSON. A fourth
argument ``muon``: the config's optimizer block is DeepSpeed's ``"Muon"`` (tests/launched/
whole.py), and each rank also writes what ran.
"""

from __future__ import annotations

import json
import os
import sys

import torch

STEPS, SAVE_AT, MICRO, LR = 4, 2, 2, 3e-3


def main(stage: int, out: str, phase: str, kind: str = "adamw") -> None:
    from dtypeplan.integrations import DtypeplanAccelerator
    from dtypeplan.integrations._common import find_optimizer
    from tests.launched.whole import MUON_BLOCK, MUON_LR, what_ran
    from tests.workers.integrations import hf_config, master_bits, token_data
    from tests.workers.real_models import build_model

    assert kind in ("adamw", "muon"), kind
    torch.set_num_threads(1)
    muon = kind == "muon"
    accelerator = DtypeplanAccelerator(mixed_precision="bf16")
    config = hf_config(stage)
    if muon:
        config["optimizer"] = MUON_BLOCK
    plan = accelerator.resolve(
        config,
        auto={
            "optimizer.params.lr": MUON_LR if muon else LR,
            "train_micro_batch_size_per_gpu": MICRO,
        },
    )
    model = plan.prepare_model(build_model("gpt2"))
    optimizer = plan.build(model.parameters())
    data = token_data(STEPS * MICRO * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = os.path.join(out, "ckpt")
    first_step = 0
    if phase == "resume":
        accelerator.load_state(ckpt)
        first_step = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT)
    seen: list[list[int]] = []
    losses: list[float] = []
    for step, batch in enumerate(loader, start=first_step):
        seen.append(batch["input_ids"][:, 0].tolist())
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if phase == "full" and step + 1 == SAVE_AT:
            accelerator.save_state(ckpt)
    own = find_optimizer(optimizer)
    assert own is not None
    state = accelerator.get_state_dict(model)
    masters = master_bits(state)  # before saving: Accelerate's save_model empties the dict
    weights = os.path.join(out, f"weights-{phase}")
    accelerator.save_model(model, os.path.join(weights, "save_model"))
    accelerator.unwrap_model(model).save_pretrained(
        os.path.join(weights, "pretrained"),
        state_dict=state,
        is_main_process=accelerator.is_main_process,
    )
    accelerator.wait_for_everyone()
    facts = {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "world_size": torch.distributed.get_world_size(),
        "param_dtypes": sorted(
            {str(p.dtype) for p in accelerator.unwrap_model(model).parameters()}
        ),
        "plan_param_dtype": str(plan.param_dtype),
        "plan_lr": plan.optimizer.params.get("lr"),
        "seen": seen,
        "losses": losses,
        "masters": masters,
    }
    if muon:
        facts["ran"] = what_ran(optimizer, accelerator.unwrap_model(model))
    rank = accelerator.process_index
    with open(os.path.join(out, f"{phase}.{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(facts, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], *sys.argv[4:])
