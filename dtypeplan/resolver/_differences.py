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
  ``opt.backward``) and uses the key only to know the step boundary (the same where DeepSpeed
  derives the count from ``train_batch_size`` and ``train_micro_batch_size_per_gpu``);
- ``torch_autocast``: DeepSpeed reduces the gradients of its ``lower_precision_safe_modules``
  (Linear, Conv1d-3d) in the autocast dtype and the rest in fp32, gathers those modules'
  ZeRO-3 parameters in the autocast dtype, and scales fp16 autocast with
  ``torch.amp.GradScaler``; dtypeplan sends every gradient in ``communication_data_type``,
  gathers fp32 shards (autocast casts them per op, to the same values) and scales with the
  fp16 block's DeepSpeed loss scaler (see :func:`_autocast_differences`);
- the ZeRO-3 schedule keys (``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``,
  ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``), ``sub_group_size``,
  ``overlap_comm``, the offloads' ``pin_memory`` and ``stage3_gather_16bit_weights_on_model_save``:
  DeepSpeed's ZeRO-3 gathers, keeps and steps by these; dtypeplan's FSDP2 by its units (one unit
  gathered ahead, every parameter sharded, resharded after forward, each local shard stepped
  whole), so the numbers agree and the peak memory and overlap differ (see
  :func:`zero_differences`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from dtypeplan.resolver import _deepspeed_keys as ds
from dtypeplan.resolver._batch import counted_sizes
from dtypeplan.resolver._config import PrecisionConfig

__all__ = [
    "DIFFERENCES",
    "Difference",
    "ZERO_DIFFERENCES",
    "deepspeed_differences",
    "zero_differences",
]

DEEPSPEED = f"DeepSpeed {ds.DEEPSPEED_VERSION}"


class Difference(NamedTuple):
    """One point where dtypeplan reads a config otherwise than DeepSpeed, in general terms
    (``deepspeed_differences`` states it for one config, with its values)."""

    point: str
    deepspeed: str
    dtypeplan: str
    fix: str
    """The setting that gives DeepSpeed's behaviour (or the nearest to it)."""


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "gradient accumulation dtype",
        "the model dtype",
        "the table's default: fp32 for bf16 (summing in bf16 drops low bits at every micro-batch)",
        '`"data_types": {"grad_accum_dtype": "bf16"}`',
    ),
    Difference(
        "wire dtype",
        "the model's 16-bit dtype",
        "the table's default (the accumulation dtype)",
        '`"communication_data_type": "bf16"`',
    ),
    Difference(
        "micro-batches per step (`gradient_accumulation_steps`, or worked out from the batch "
        "sizes)",
        "`engine.backward` divides each loss by it",
        "sums the micro-batches' gradients; uses the count only to know the last backward",
        "divide the loss by it before backward",
    ),
    Difference(
        "`gradient_clipping` absent",
        f"clips at {ds.TOP_LEVEL_DEFAULTS['gradient_clipping']}",
        "no clipping (configs keep their meaning)",
        f'`"gradient_clipping": {ds.TOP_LEVEL_DEFAULTS["gradient_clipping"]}`',
    ),
    Difference(
        "no `optimizer` block",
        "the program's optimizer",
        "AdamW, lr 1e-3",
        "an `optimizer` block, or your optimizer passed to `plan.build`",
    ),
    Difference(
        "`torch_autocast` wire dtype",
        "`lower_precision_safe_modules` (Linear, Conv) in the autocast dtype, the rest fp32",
        "every gradient in `communication_data_type`",
        '`"communication_data_type": "bf16"` (then for every module)',
    ),
    Difference(
        "`torch_autocast` at ZeRO-3",
        "all-gathers the `lower_precision_safe_modules`' parameters in the autocast dtype",
        "FSDP2 gathers the fp32 shards and autocast casts them at each op, to the same values "
        "(twice the bytes gathered)",
        "none needed: the numbers agree",
    ),
    Difference(
        "fp16 `torch_autocast` loss scaling",
        "`torch.amp.GradScaler` (growth every 2000 steps, no hysteresis)",
        "the `fp16` block's DeepSpeed loss scaler",
        '`"fp16": {"enabled": false, "loss_scale_window": 2000, "hysteresis": 1}`',
    ),
    Difference(
        "`torch_autocast.dtype` absent",
        "passes None to `torch.autocast`: the device's default (fp16 on CUDA, bf16 on CPU)",
        "the fp16 parameters' dtype with `fp16.enabled`, else bf16",
        '`"torch_autocast": {"dtype": "..."}` makes both agree',
    ),
)
"""Every point of ``deepspeed_differences`` but the ZeRO keys' (:data:`ZERO_DIFFERENCES`), one
row each: what the reference page
``docs/reference/deepspeed-differences.md`` is generated from (``dtypeplan docs``)."""


ZERO_DIFFERENCES: dict[str, Difference] = {
    "prefetch_bucket_size": Difference(
        "`stage3_prefetch_bucket_size`",
        "prefetches the next parameters, up to this many elements, ahead of their use",
        "FSDP2 gathers one unit ahead (the next unit in forward and in backward)",
        "choose the units (`plan.prepare_model(model, wrap=...)`): one unit is the most that "
        "is gathered ahead",
    ),
    "param_persistence_threshold": Difference(
        "`stage3_param_persistence_threshold`",
        "keeps parameters with fewer elements than this gathered whole on every rank",
        "shards every parameter, small ones too (gathered with their unit)",
        "none: the numbers agree; DeepSpeed's persistent parameters cost it device memory and "
        "save it gathers",
    ),
    "max_live_parameters": Difference(
        "`stage3_max_live_parameters`",
        "caps the gathered parameter elements held at once",
        "holds the running unit and the one prefetched, whatever their size",
        "smaller units (`wrap=`) bound the gathered bytes",
    ),
    "max_reuse_distance": Difference(
        "`stage3_max_reuse_distance`",
        "keeps a gathered parameter if it is used again within this many elements",
        "FSDP2 reshards each unit after its forward and gathers it again for backward",
        "none: the numbers agree; the backward's gathers are not skipped",
    ),
    "gather_16bit_weights_on_model_save": Difference(
        "`stage3_gather_16bit_weights_on_model_save`",
        "true: `save_16bit_model` (the HF Trainer's `save_model`) gathers the 16-bit weights on "
        "rank 0; false: it writes none",
        "the integrations' `save_model` writes the fp32 master weights, gathered one parameter "
        "at a time (`export_model_state`), whatever the key says; checkpoints never gather",
        "none needed: the weights written are the masters, which DeepSpeed's "
        "`zero_to_fp32.py` recovers",
    ),
    "sub_group_size": Difference(
        "`sub_group_size`",
        "steps the (offloaded) optimizer in groups of this many elements",
        "steps each local shard (ZeRO-3) or bucket chunk (ZeRO 1-2) in one fused call",
        "none: the numbers agree; only the host step's transient memory differs",
    ),
    "overlap_comm": Difference(
        "`overlap_comm`",
        "true: reduces in buckets while backward runs (extra buffers); false: after backward",
        "always overlaps: FSDP2 reduce-scatters each unit as its backward ends (ZeRO 1-2: each "
        "bucket as it fills)",
        "none: the numbers agree",
    ),
    "offload_param.pin_memory": Difference(
        "`offload_param.pin_memory`",
        "pins the host parameters only when true",
        "FSDP2's CPUOffloadPolicy pins them whenever the mesh is on CUDA",
        "none: the numbers and sizes agree; pinned memory is not pageable",
    ),
    "offload_optimizer.pin_memory": Difference(
        "`offload_optimizer.pin_memory`",
        "pins the host masters and states only when true",
        "pins them whenever the parameters are on an accelerator",
        "none: the numbers and sizes agree; pinned memory is not pageable",
    ),
}
"""The ZeRO keys of ``_fields.ZERO_SETTINGS``: how DeepSpeed reads each, and dtypeplan."""


ALL_STAGES = ("overlap_comm", "offload_optimizer.pin_memory")
"""The ZERO_DIFFERENCES keys DeepSpeed reads at every stage; it reads the others at ZeRO-3."""


def zero_differences(config: PrecisionConfig, stage: int) -> list[str]:
    """One line per ZeRO setting the config gives (``PrecisionConfig.zero_settings``, and the
    ones left ``"auto"`` for the HF Trainer to fill from the model) that DeepSpeed reads at
    ``stage``."""
    given = list(config.zero_settings)
    for auto in config.auto_values:
        name = auto.path.removeprefix("zero_optimization.").removeprefix("stage3_")
        if name in ZERO_DIFFERENCES and name not in {n for n, _ in given}:
            given.append((name, "auto"))
    found = []
    for name, value in given:
        if stage != 3 and name not in ALL_STAGES:
            continue
        difference = ZERO_DIFFERENCES[name]
        if value == "auto":
            shown = '"auto" (the HF Trainer fills it from the model)'
        elif isinstance(value, float) and value.is_integer():
            shown = f"{int(value):,}"
        else:
            shown = str(value).lower() if isinstance(value, bool) else f"{value:,}"
        fix = difference.fix[0].upper() + difference.fix[1:]
        found.append(
            f"zero_optimization.{name} = {shown}: {DEEPSPEED}: {difference.deepspeed}; "
            f"dtypeplan: {difference.dtypeplan}. {fix}"
        )
    return found


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
    found += _autocast_differences(config, point)
    found += zero_differences(config, point["stage"])
    steps, train, micro = counted_sizes(
        (
            config.gradient_accumulation_steps,
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
        ),
        config.auto_values,
    )
    if steps is not None and steps > 1:
        found.append(
            f"gradient_accumulation_steps={steps}: {DEEPSPEED}'s engine.backward divides each "
            f"micro-batch's loss by {steps}; dtypeplan sums the micro-batches' gradients as "
            f"they come (it only learns the step boundary from the key: the reduction starts "
            f"inside the last of the {steps} backward passes). For DeepSpeed's behaviour "
            f"divide the loss by {steps} before backward"
        )
    elif steps is None and train is not None and micro is not None:
        found.append(
            f"train_batch_size={train} with train_micro_batch_size_per_gpu={micro}: "
            f"{DEEPSPEED} works the micro-batches per step out (train_batch_size / (micro x "
            "data-parallel ranks)) and, when that count is above 1, its engine.backward "
            "divides each micro-batch's loss by it; dtypeplan works the same count out at "
            "build (to know the step boundary) but sums the micro-batches' gradients as they "
            "come. For DeepSpeed's behaviour divide the loss by it before backward"
        )
    return found


def _autocast_differences(config: PrecisionConfig, point: dict[str, Any]) -> list[str]:
    """What DeepSpeed's ``torch_autocast`` (``runtime/torch_autocast.py``) does otherwise."""
    if config.autocast == "none":
        return []
    dtype = config.autocast
    found = [
        f"torch_autocast gradients: {DEEPSPEED} reduces the gradients of "
        "torch_autocast.lower_precision_safe_modules (default Linear, Conv1d, Conv2d, Conv3d) "
        f"in {dtype} and every other gradient in the parameter dtype, whatever "
        f"communication_data_type says; dtypeplan reduces every gradient in {point['comm']} "
        "(communication_data_type, else the accumulation dtype). The nearest to DeepSpeed's: "
        f'"communication_data_type": "{dtype}" (norms and embeddings then travel in {dtype} too)'
    ]
    if point["stage"] == 3:
        found.append(
            f"torch_autocast at ZeRO-3: {DEEPSPEED} all-gathers those modules' parameters in "
            f"{dtype}; dtypeplan's FSDP2 gathers the fp32 shards and autocast casts them at each "
            "op, to the same values: the numbers agree, the gathers move twice the bytes"
        )
    if dtype == "fp16":
        found.append(
            f"fp16 autocast loss scaling: {DEEPSPEED} uses torch.amp.GradScaler (2**16, doubled "
            "after 2000 clean steps, halved at every overflow, no minimum) and ignores the fp16 "
            "block; dtypeplan scales with the fp16 block's DeepSpeed loss scaler (defaults: "
            "2**16, window 1000, hysteresis 2, min 1). For GradScaler's schedule set "
            '"fp16": {"enabled": false, "loss_scale_window": 2000, "hysteresis": 1}'
        )
    if not config.autocast_dtype_given:
        found.append(
            f"torch_autocast.dtype absent: {DEEPSPEED} passes None on to torch.autocast, which "
            "then takes the device's default (fp16 on CUDA, bf16 on CPU); dtypeplan uses "
            f"{dtype} (the fp16 parameters' dtype with fp16.enabled, else bf16). Set "
            f'"torch_autocast": {{"dtype": "{dtype}"}} to make both agree'
        )
    return found
