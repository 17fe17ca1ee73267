"""What the HF Trainer / Accelerate DeepSpeed integration writes into each "auto" key.

The values are those of default ``TrainingArguments``.

Hand-derived (pure data) from:
- huggingface/transformers src/transformers/integrations/deepspeed.py at
  3a80c166389f65756701d6afe22bc6ec954603da (HfTrainerDeepSpeedConfig.trainer_config_process and
  .trainer_config_finalize, deepspeed_optim_sched);
- huggingface/transformers src/transformers/training_args.py at
  00349ae87eddc872ffa21a8a54f264375a0056a8 (TrainingArguments field defaults);
- huggingface/accelerate src/accelerate/accelerator.py and src/accelerate/utils/dataclasses.py at
  16cb6eb80dd9aa8b4df1a63ef57863e455d53b83 (Accelerator._prepare_deepspeed,
  DeepSpeedPlugin.fill_match / set_mixed_precision).
See tests/data/deepspeed_configs/HF_AUTO_DEFAULTS.md for the reasoning.
"""

from typing import Any

# TrainingArguments defaults that feed "auto" keys.
TRAINING_ARGUMENTS_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-05,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-08,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "fp16": False,
    "fp16_full_eval": False,
    "bf16": False,
    "bf16_full_eval": False,
    "warmup_steps": 0,
}

# Dotted config path -> (value filled with default TrainingArguments, where it comes from).
# The source is a TrainingArguments field (or an expression of fields), or "constant".
HF_AUTO_FILLS: dict[str, tuple[Any, str]] = {
    "gradient_clipping": (1.0, "max_grad_norm"),
    "fp16.enabled": (False, "fp16 or fp16_full_eval (with fp16_backend amp)"),
    "bf16.enabled": (False, "bf16 or bf16_full_eval"),
    "optimizer.params.lr": (5e-05, "learning_rate"),
    "optimizer.params.betas": ([0.9, 0.999], "[adam_beta1, adam_beta2]"),
    "optimizer.params.eps": (1e-08, "adam_epsilon"),
    "optimizer.params.weight_decay": (0.0, "weight_decay"),
    "scheduler.params.warmup_min_lr": (0, "constant"),
    "scheduler.params.warmup_max_lr": (5e-05, "learning_rate"),
    # transformers 5.24 fills max(1, ...): deepspeed >= 0.19.6 refuses 0 (older ones took it).
    "scheduler.params.warmup_num_steps": (
        1,
        "max(1, warmup_steps) (max(1, get_warmup_steps(num_training_steps)))",
    ),
    "gradient_accumulation_steps": (1, "gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": (8, "per_device_train_batch_size"),
}

# Dotted path -> formula, for "auto" keys filled from the runtime (world size, data, step count).
HF_AUTO_RUNTIME: dict[str, str] = {
    "train_batch_size": (
        "world_size * per_device_train_batch_size * gradient_accumulation_steps (world_size = "
        "data-parallel size; divided by the sequence-parallel size under Ulysses SP)"
    ),
    "scheduler.params.total_num_steps": (
        "num_training_steps computed by the Trainer (max_steps, or epochs * steps per epoch)"
    ),
}

# Dotted path -> formula, for "auto" keys filled from the model config (hidden_size, or
# max(hidden_sizes), or text_config.hidden_size); the stage3_* ones only at ZeRO stage 3.
HF_AUTO_FROM_MODEL: dict[str, str] = {
    "zero_optimization.reduce_bucket_size": "hidden_size * hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "int(0.9 * hidden_size * hidden_size)",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size",
}

# Dotted path -> (value, source) filled by Accelerate (not by the Trainer) when it prepares
# the model.
ACCELERATE_AUTO_FILLS: dict[str, tuple[Any, str]] = {
    "gradient_clipping": (1.0, "constant (Accelerator._prepare_deepspeed)"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        False,
        "constant (Accelerator._prepare_deepspeed)",
    ),
    "fp16.enabled": (False, "mixed_precision == 'fp16' (default 'no')"),
    "bf16.enabled": (False, "mixed_precision in ('bf16', 'fp8') (default 'no')"),
}

# Top-level keys the Trainer / Accelerate set whatever the file says.
HF_SET_ALWAYS: dict[str, tuple[Any, str]] = {
    "zero_allow_untested_optimizer": (
        True,
        "set when the config has no optimizer block (Trainer) or a torch optimizer is passed "
        "(Accelerate)",
    ),
    "steps_per_print": (
        float("inf"),
        "DeepSpeedPlugin.__post_init__ (silences DeepSpeed's step log)",
    ),
}
