"""Where dtypeplan's reading of a config differs from DeepSpeed 0.19.8's, and the fix.

dtypeplan accepts DeepSpeed configs with DeepSpeed's meaning except at a few deliberate points,
each stated by ``explain()`` for the configs it touches:

- gradient accumulation dtype: DeepSpeed sums gradients in the model dtype unless
  ``data_types.grad_accum_dtype`` says otherwise; dtypeplan's table sums bf16 gradients in fp32
  (the original ``gradient_accumulation_dtype`` discussion: bf16 sums lose low bits at every
  micro-batch);
- wire dtype: DeepSpeed sends gradients in the model's 16-bit dtype unless
  ``communication_data_type`` says otherwise; dtypeplan's default follows its rules table;
- gradient clipping: DeepSpeed 0.19.8 clips at 1.0 when ``gradient_clipping`` is absent
  (``GRADIENT_CLIPPING_DEFAULT``); dtypeplan does not clip unless asked, so that a config
  without the key keeps meaning what it meant before;
- no ``optimizer`` block: DeepSpeed runs the program's own optimizer; dtypeplan falls back to
  AdamW with lr 1e-3;
- ``gradient_accumulation_steps``: DeepSpeed's ``engine.backward`` divides each micro-batch's
  loss by it; dtypeplan sums micro-batch gradients as they come (as documented for
  ``opt.backward``) and uses the key only to know the step boundary.
"""

from __future__ import annotations

from typing import Any

from dtypeplan.resolver import _deepspeed_keys as ds
from dtypeplan.resolver._config import PrecisionConfig

__all__ = ["deepspeed_differences"]

DEEPSPEED = f"DeepSpeed {ds.DEEPSPEED_VERSION}"


def _deepspeed_wire(params: str) -> str:
    # DeepSpeedEngine.communication_data_type: fp16 under fp16, bf16 under bf16, else fp32.
    return params if params in ("fp16", "bf16") else "fp32"


def deepspeed_differences(
    config: PrecisionConfig, point: dict[str, Any], origins: dict[str, str]
) -> list[str]:
    """One line per point where this plan does not do what DeepSpeed would with the config."""
    params = "fp16" if point["params"] == "fp16+bf16" else point["params"]
    found: list[str] = []
    if config.grad_accum_dtype is None and point["accum"] != params:
        found.append(
            f"gradient accumulation: dtypeplan sums {params} gradients in {point['accum']} "
            f"({origins['grad_accum_dtype']}); {DEEPSPEED} sums them in the model dtype "
            f"({params}) when data_types.grad_accum_dtype is absent. For DeepSpeed's behaviour "
            f'set "data_types": {{"grad_accum_dtype": "{params}"}}'
        )
    wire = _deepspeed_wire(params)
    if config.comm_dtype is None and point["comm"] != wire:
        found.append(
            f"wire dtype: dtypeplan sends gradients in {point['comm']} "
            f"({origins['comm_dtype']}); {DEEPSPEED} sends them in {wire} when "
            f"communication_data_type is absent. For DeepSpeed's behaviour set "
            f'"communication_data_type": "{wire}"'
        )
    if not config.gradient_clipping_given:
        clip = ds.TOP_LEVEL_DEFAULTS["gradient_clipping"]
        found.append(
            f"gradient clipping: off (dtypeplan's default); {DEEPSPEED} clips the global "
            f"gradient norm at {clip} when gradient_clipping is absent. For DeepSpeed's "
            f'behaviour set "gradient_clipping": {clip}'
        )
    if not config.optimizer_given:
        found.append(
            f"no optimizer block: {DEEPSPEED} runs the program's own optimizer "
            "(deepspeed.initialize(optimizer=...); the HF Trainer passes AdamW with "
            "TrainingArguments.learning_rate, 5e-5 by default); dtypeplan's default is AdamW "
            "with lr 1e-3. Give an optimizer block, or pass your optimizer to plan.build"
        )
    steps = config.gradient_accumulation_steps
    if steps is not None and steps > 1:
        found.append(
            f"gradient_accumulation_steps={steps}: {DEEPSPEED}'s engine.backward divides each "
            f"micro-batch's loss by {steps}; dtypeplan sums the micro-batches' gradients as "
            f"they come (it only learns the step boundary from the key: the reduction starts "
            f"inside the last of the {steps} backward passes). For DeepSpeed's behaviour "
            f"divide the loss by {steps} before backward"
        )
    return found
