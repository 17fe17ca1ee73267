"""``python -m tests.workers.unedited_patch OUT``: what ``use_for_unedited_scripts`` changes
in a fresh process (issue 27), printed as one JSON line (it changes transformers for the whole
process, so it runs apart from the test process)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    out = sys.argv[1]
    import transformers

    from dtypeplan.integrations.hf_trainer import DtypeplanTrainer, use_for_unedited_scripts

    use_for_unedited_scripts()
    use_for_unedited_scripts()  # idempotent
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    from tests.workers.real_models import build_model

    class Mine(Trainer):  # type: ignore[misc, valid-type]
        """A script's own Trainer subclass, defined after the patch."""

    common = {"output_dir": out, "use_cpu": True, "report_to": []}
    given = Seq2SeqTrainingArguments(**common, deepspeed={"zero_optimization": {"stage": 1}})
    text = TrainingArguments(**common, deepspeed='{"bf16": {"enabled": "auto"}}')
    plain = TrainingArguments(**common)
    trainer = Seq2SeqTrainer(model=build_model("gpt2"), args=given)
    try:
        Trainer(model=build_model("gpt2"), args=plain)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    facts = {
        "trainer": Trainer is DtypeplanTrainer and transformers.trainer.Trainer is Trainer,
        "seq2seq": issubclass(Seq2SeqTrainer, DtypeplanTrainer)
        and Seq2SeqTrainer.__mro__[2].__name__ == "Seq2SeqTrainer",
        "mine": issubclass(Mine, DtypeplanTrainer),
        "args": [
            given.deepspeed, given.dtypeplan_config, text.deepspeed, text.dtypeplan_config,
            getattr(plain, "dtypeplan_config", None),
        ],
        "deepspeed_enabled": trainer.is_deepspeed_enabled,
        "config": trainer.dtypeplan_config,
        "refused": "--deepspeed" in refused,
    }  # fmt: skip
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
