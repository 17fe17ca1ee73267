"""The docs' Lightning recipe as a user's script, started as ``python lightning_recipe.py``
(Lightning starts its own processes) or under torchrun.

``python lightning_recipe.py LAUNCHER STAGE OUT PHASE [muon]``: the HF docs' all-"auto"
ds_config_zero2.json at ZeRO ``STAGE`` through ``DtypeplanStrategy``, ``precision="bf16-true"``
filling its precision keys, a tiny GPT-2 with AdamW from ``configure_optimizers``, 2 CPU
devices. PHASE ``straight`` trains 4 steps; ``first`` trains 2 and saves Lightning's
checkpoint; ``resume`` fits to 4 from it (an epoch is 2 steps: the resume starts an epoch).
Each rank writes what it saw as JSON. ``muon``: the config's optimizer block is DeepSpeed's
``"Muon"`` (tests/launched/whole.py) and ``configure_optimizers`` returns None, as under Lightning's
DeepSpeedStrategy; each rank also writes what ran and its losses.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning
import torch

STEPS, MICRO, LR = 4, 2, 3e-3


class TinyLM(lightning.LightningModule):
    def __init__(self, from_config: bool = False) -> None:
        super().__init__()
        from tests.workers.real_models import build_model

        self.model = build_model("gpt2")
        self.from_config = from_config
        self.losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> Any:
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if self.from_config:
            return None  # the config's optimizer block, as under Lightning's DeepSpeedStrategy
        return torch.optim.AdamW(self.parameters(), lr=LR)


def main(launcher: str, stage: int, out: str, phase: str, kind: str = "adamw") -> None:
    from dtypeplan.checkpoint import export_model_state
    from dtypeplan.integrations import DtypeplanStrategy
    from dtypeplan.integrations._common import find_optimizer
    from tests.launched.whole import MUON_BLOCK, MUON_LR, what_ran
    from tests.workers.integrations import hf_config, master_bits, token_data

    assert kind in ("adamw", "muon"), kind
    torch.set_num_threads(1)
    muon = kind == "muon"
    module = TinyLM(from_config=muon)
    config = hf_config(stage)
    if muon:
        config["optimizer"] = MUON_BLOCK
    trainer = lightning.Trainer(
        strategy=DtypeplanStrategy(config, auto={"optimizer.params.lr": MUON_LR if muon else LR}),
        precision="bf16-true",
        accelerator="cpu",
        devices=2,
        max_steps=2 if phase == "first" else STEPS,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    # One sequence repeated: Lightning's DistributedSampler orders an epoch by its number, and a
    # fit resumed from a checkpoint taken at max_steps replays another order (its plain DDP
    # run too: tests/workers/integrations.py); the sampler's split is checked instead.
    loader = torch.utils.data.DataLoader(token_data(1) * (2 * MICRO * 2), batch_size=MICRO)
    ckpt = os.path.join(out, "first.ckpt")
    trainer.fit(module, loader, ckpt_path=ckpt if phase == "resume" else None)
    if phase == "first":
        trainer.save_checkpoint(ckpt)
    own = find_optimizer(trainer.strategy.optimizers[0])
    assert own is not None and trainer.strategy.plan is not None
    masters = master_bits(export_model_state(own, module))
    final = os.path.join(out, f"{phase}.ckpt")
    if phase != "first":
        trainer.save_checkpoint(final)
    facts = {
        "launcher_env": {k: os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")},
        "world_size": trainer.world_size,
        "plan_param_dtype": str(trainer.strategy.plan.param_dtype),
        "explained_lr": trainer.strategy.plan.optimizer.params["lr"],
        "global_step": trainer.global_step,
        "sampler": [
            type(trainer.train_dataloader.sampler).__name__,
            trainer.train_dataloader.sampler.num_replicas,
            trainer.train_dataloader.sampler.rank,
        ],
        "masters": masters,
    }
    if muon:
        facts["ran"] = what_ran(trainer.strategy.optimizers[0], module)
        facts["losses"] = module.losses
    with open(os.path.join(out, f"{phase}.{trainer.global_rank}.json"), "w") as handle:
        json.dump(facts, handle)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], *sys.argv[5:])
