#!/usr/bin/env python
"""Causal language modeling with the HF Trainer: a small stand-in for transformers'
examples/pytorch/language-modeling/run_clm.py.

It mirrors that script's structure and keeps its flags where they exist: ModelArguments and
DataTrainingArguments dataclasses next to TrainingArguments, parsed by HfArgumentParser (from
the command line or one .json file); logging from the arguments; the last checkpoint in
output_dir detected; set_seed; a model from ``--model_type`` and ``--config_overrides``
(run_clm's training from scratch: no hub download); ``Trainer(...)``;
``trainer.train(resume_from_checkpoint=...)``, ``save_model``, metrics and ``save_state``.
What it leaves out: the datasets library and tokenizer (the data is seeded random token
blocks, ``--num_train_samples`` of ``--block_size``), evaluation and the hub.

It is a script written for the HF Trainer and nothing else: the tests run it unedited, under
``dtypeplan run ... --deepspeed ds_config.json``, as a DeepSpeed user runs run_clm.py under
``torchrun ... --deepspeed ds_config.json``. Do not add dtypeplan to it.
"""

import logging
import os
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: str = field(
        default="gpt2", metadata={"help": "The model type to train from scratch."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Override some default config settings, e.g. n_embd=10,resid_pdrop=0.2"},
    )


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16, metadata={"help": "Sequence length of each sample."})
    num_train_samples: int = field(default=64, metadata={"help": "How many samples to train on."})
    data_seed_value: int = field(default=7, metadata={"help": "Seed of the random token data."})


class TokenBlocks(torch.utils.data.Dataset):
    """What run_clm's group_texts yields: input_ids blocks, labels equal to them."""

    def __init__(self, count: int, block_size: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (count, block_size), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(
            json_file=os.path.abspath(sys.argv[1])
        )
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, distributed training: "
        f"{training_args.parallel_mode.value == 'distributed'}"
    )

    # Detecting last checkpoint.
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        logger.info(f"Overriding config: {model_args.config_overrides}")
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    train_dataset = TokenBlocks(
        data_args.num_train_samples,
        data_args.block_size,
        config.vocab_size,
        data_args.data_seed_value,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # Saves the tokenizer too for easy upload

        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()


if __name__ == "__main__":
    main()
