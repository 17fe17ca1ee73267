"""A user's rules file at each framework entry point (tests/test_rules_entry_points.py): the HF
Trainer (``DtypeplanTrainer(dtypeplan_rules=...)``), Accelerate
(``DtypeplanAccelerator.resolve(config, rules=...)``), Lightning
(``DtypeplanStrategy(config, rules=...)``) and ``dtypeplan run``'s rank module
(``hf_trainer_run --rules RULES``, an unedited script), each driven as a user drives it, on a
config that the rules file refuses. Each returns what it raised (plain data for the parent)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from dtypeplan.errors import NotSupportedError
from tests.workers.integrations import MICRO, token_data

CONFIG = {"zero_optimization": {"stage": 1}}
"""A cell the shipped table runs (ZeRO-1, fp32) and the test's rules file refuses."""


def _trainer(root: str, rules: str) -> None:
    import transformers

    from dtypeplan.integrations import DtypeplanTrainer
    from tests.workers.real_models import build_model

    args = transformers.TrainingArguments(
        output_dir=os.path.join(root, "trainer"), max_steps=1, per_device_train_batch_size=MICRO,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = DtypeplanTrainer(
        model=build_model("gpt2"),
        args=args,
        train_dataset=token_data(4 * MICRO),
        dtypeplan_config=CONFIG,
        dtypeplan_rules=rules,
    )
    trainer.train()


def _accelerate(root: str, rules: str) -> None:
    from dtypeplan.integrations import DtypeplanAccelerator
    from tests.workers.real_models import build_model

    accelerator = DtypeplanAccelerator()
    plan = accelerator.resolve(CONFIG, rules=rules)
    model = plan.prepare_model(build_model("gpt2"))
    optimizer = plan.build(model.parameters())
    accelerator.prepare(model, optimizer)


def _lightning(root: str, rules: str) -> None:
    import lightning

    from dtypeplan.integrations import DtypeplanStrategy
    from tests.workers.real_models import build_model

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model("gpt2")

        def training_step(self, batch: Any, index: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = lightning.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
        strategy=DtypeplanStrategy(CONFIG, rules=rules), max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=os.path.join(root, "lightning"),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(token_data(4 * MICRO), batch_size=MICRO)
    trainer.fit(Module(), loader)


RUN_CLM = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hf_scripts", "run_clm.py"
)
"""A script written for the plain HF Trainer (tests/data/hf_scripts/run_clm.py)."""


def _unedited_script(root: str, rules: str) -> None:
    """What ``dtypeplan run --rules RULES`` starts in each rank: the rank module, which runs
    run_clm.py unedited (it makes ``transformers.Trainer`` dtypeplan's for this whole process:
    the last entry point)."""
    import json

    from dtypeplan.integrations import hf_trainer_run

    config = os.path.join(root, f"ds_config.{os.environ['RANK']}.json")
    with open(config, "w", encoding="utf-8") as handle:
        json.dump(CONFIG, handle)
    hf_trainer_run.main([
        "--rules", rules, RUN_CLM, "--deepspeed", config, "--model_type", "gpt2",
        "--config_overrides", "vocab_size=128,n_positions=32,n_embd=32,n_layer=2,n_head=2",
        "--do_train", "--output_dir", os.path.join(root, "run_clm"), "--max_steps", "1",
        "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_num_workers", "0",
    ])  # fmt: skip


ENTRY_POINTS: dict[str, Callable[[str, str], None]] = {
    "trainer": _trainer,
    "accelerate": _accelerate,
    "lightning": _lightning,
    "dtypeplan run's rank module": _unedited_script,
}


def refusals(rank: int, world: int, root: str, rules: str) -> dict[str, dict[str, str]]:
    """Each framework's run of :data:`CONFIG` with ``rules``: the type and message of what it
    raised (``"none"``: it trained)."""
    import torch.distributed as dist

    from tests.workers.integrations import _env

    _env(rank, world)
    torch.set_num_threads(1)
    out: dict[str, dict[str, str]] = {}
    for name, run in ENTRY_POINTS.items():
        try:
            run(root, rules)
            out[name] = {"raised": "none", "message": ""}
        except NotSupportedError as exc:
            out[name] = {"raised": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out[name] = {"raised": type(exc).__name__, "message": traceback.format_exc()}
        dist.barrier()
    return out
