"""Print dtypeplan/resolver/_deepspeed_keys.py from an installed DeepSpeed.

Usage (where DeepSpeed is installed; it is not a dependency of dtypeplan):

    DS_ACCELERATOR=cpu python tools/deepspeed_keys.py > dtypeplan/resolver/_deepspeed_keys.py

The script reads DeepSpeed's own definitions and nothing else:

- the pydantic config models (``model_fields``: each field's alias, default, and the
  ``DeepSpeedConfigModel`` extras ``deprecated`` / ``new_param`` in ``json_schema_extra``) for
  zero_optimization, offload_optimizer, offload_param, bf16 (also read for the legacy ``bfloat16``
  block) and fp16;
- the top-level keys, found by running ``DeepSpeedConfig`` on a minimal config whose dict records
  every key DeepSpeed looks up;
- the constants for data_types, torch_autocast, gradient clipping, communication and loss scaling;
- the optimizer and scheduler constructors (``inspect.signature``) for Adam/AdamW and the
  ``deepspeed.runtime.lr_schedules`` classes.

The output is deterministic (sorted), so a test can compare it with the committed module.
"""

import inspect
import logging
import pprint
import sys


def _default(field):
    if field.is_required():
        return "<required>"
    if field.default_factory is not None:
        value = field.default_factory()
        return value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    value = field.get_default(call_default_factory=False)
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "value") and isinstance(value.value, (int, str)):  # enums
        return value.value
    if isinstance(value, int):
        return int(value)  # pp_int -> int
    if isinstance(value, float):
        return float(value)
    return repr(value)


def _model_block(model):
    fields, deprecated, defaults = {}, {}, {}
    for name in sorted(model.model_fields):
        field = model.model_fields[name]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("deprecated", False):
            deprecated[name] = extra.get("new_param", "")
            continue
        aliases = [field.alias] if field.alias and field.alias != name else []
        fields[name] = aliases
        defaults[name] = _default(field)
    return fields, deprecated, defaults


class _RecordingDict(dict):
    """A dict that records the keys looked up in it (DeepSpeedConfig copies it with copy.copy)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = set()

    def __copy__(self):
        new = _RecordingDict(self)
        new.seen = self.seen
        return new

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def keys(self):
        outer = self

        class _Keys:
            def __contains__(self, key):
                outer.seen.add(key)
                return dict.__contains__(outer, key)

            def __iter__(self):
                return iter(dict.keys(outer))

        return _Keys()


def _top_level_keys():
    from deepspeed import comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    # Pretend a process group exists so the world-size branch (which reads
    # "sequence_parallel_size") is taken, as in a real launch.
    saved = dist.get_rank, dist.get_world_size
    dist.get_rank, dist.get_world_size = (lambda *a, **k: 0), (lambda *a, **k: 1)
    try:
        recorder = _RecordingDict({"train_batch_size": 1})
        DeepSpeedConfig(recorder)
    finally:
        dist.get_rank, dist.get_world_size = saved
    return sorted(k for k in recorder.seen if isinstance(k, str))


def _signature_defaults(fn, skip):
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = "<required>" if p.default is p.empty else p.default
        if isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def build():
    import deepspeed
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import constants as C
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    fields, deprecated, defaults = {}, {}, {}
    for block, model in (
        ("zero_optimization", DeepSpeedZeroConfig),
        ("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
        ("offload_param", DeepSpeedZeroOffloadParamConfig),
        ("bf16", DeepSpeedBF16Config),
        ("bfloat16", DeepSpeedBF16Config),
        ("fp16", DeepSpeedFP16Config),
    ):
        fields[block], deprecated[block], defaults[block] = _model_block(model)

    data_types = {
        C.GRAD_ACCUM_DTYPE: C.GRAD_ACCUM_DTYPE_DEFAULT,
        C.PARAM_DTYPE: C.PARAM_DTYPE_DEFAULT,
        C.BUFFER_DTYPE: C.BUFFER_DTYPE_DEFAULT,
        C.KEEP_IN_FP32_MODULES: C.KEEP_IN_FP32_MODULES_DEFAULT,
    }
    fields["data_types"] = {k: [] for k in sorted(data_types)}
    defaults["data_types"] = dict(sorted(data_types.items()))
    deprecated["data_types"] = {}
    autocast = {
        C.TORCH_AUTOCAST_ENABLED: C.TORCH_AUTOCAST_ENABLED_DEFAULT,
        C.TORCH_AUTOCAST_DTYPE: None,
        C.TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES: None,
    }
    fields["torch_autocast"] = {k: [] for k in sorted(autocast)}
    defaults["torch_autocast"] = dict(sorted(autocast.items()))
    deprecated["torch_autocast"] = {}

    removed_top = sorted(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    removed_zero = sorted(ds_config._REMOVED_ZERO_CONFIG_KEYS)
    top = [k for k in _top_level_keys() if k not in removed_top]

    top_defaults = {
        C.GRADIENT_CLIPPING: C.GRADIENT_CLIPPING_DEFAULT,
        C.COMMUNICATION_DATA_TYPE: C.COMMUNICATION_DATA_TYPE_DEFAULT,
        C.SEQ_PARALLEL_COMMUNICATION_DATA_TYPE: C.SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT,
        C.PRESCALE_GRADIENTS: C.PRESCALE_GRADIENTS_DEFAULT,
        C.GRADIENT_PREDIVIDE_FACTOR: C.GRADIENT_PREDIVIDE_FACTOR_DEFAULT,
        C.GRADIENT_ALLREDUCE_OP: C.GRADIENT_ALLREDUCE_OP_DEFAULT,
        C.ZERO_ALLOW_UNTESTED_OPTIMIZER: C.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT,
        C.ZERO_FORCE_DS_CPU_OPTIMIZER: C.ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT,
        C.TRAIN_BATCH_SIZE: C.TRAIN_BATCH_SIZE_DEFAULT,
        C.TRAIN_MICRO_BATCH_SIZE_PER_GPU: C.TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT,
        C.GRADIENT_ACCUMULATION_STEPS: C.GRADIENT_ACCUMULATION_STEPS_DEFAULT,
    }

    from deepspeed.ops.adam.fused_adam import FusedAdam

    adam_params = _signature_defaults(FusedAdam.__init__, {"self", "params"})
    adam_params[ds_config.ADAM_W_MODE] = ds_config.ADAM_W_MODE_DEFAULT
    adam_params[ds_config.TORCH_ADAM_PARAM] = False
    adam_params["fp32_optimizer_states"] = None
    adam_params = dict(sorted(adam_params.items()))

    schedulers = {}
    for name in sorted(lr_schedules.VALID_LR_SCHEDULES):
        cls = getattr(lr_schedules, name)
        schedulers[name] = _signature_defaults(cls.__init__, {"self", "optimizer"})

    return {
        "DEEPSPEED_VERSION": deepspeed.__version__,
        "TOP_LEVEL_KEYS": top,
        "REMOVED_TOP_LEVEL_KEYS": removed_top,
        "REMOVED_ZERO_KEYS": removed_zero,
        "FIELDS": fields,
        "DEPRECATED": deprecated,
        "DEFAULTS": defaults,
        "TOP_LEVEL_DEFAULTS": dict(sorted(top_defaults.items())),
        "DEEPSPEED_OPTIMIZERS": sorted(ds_config.DEEPSPEED_OPTIMIZERS),
        "ADAM_PARAMS": adam_params,
        "SCHEDULERS": schedulers,
    }


_TYPES = {
    "DEEPSPEED_VERSION": "str",
    "TOP_LEVEL_KEYS": "List[str]",
    "REMOVED_TOP_LEVEL_KEYS": "List[str]",
    "REMOVED_ZERO_KEYS": "List[str]",
    "FIELDS": "Dict[str, Dict[str, List[str]]]",
    "DEPRECATED": "Dict[str, Dict[str, str]]",
    "DEFAULTS": "Dict[str, Dict[str, Any]]",
    "TOP_LEVEL_DEFAULTS": "Dict[str, Any]",
    "DEEPSPEED_OPTIMIZERS": "List[str]",
    "ADAM_PARAMS": "Dict[str, Any]",
    "SCHEDULERS": "Dict[str, Dict[str, Any]]",
}

_COMMENTS = {
    "TOP_LEVEL_KEYS": "Top-level keys DeepSpeedConfig looks up (any other top-level key is ignored).",
    "REMOVED_TOP_LEVEL_KEYS": "Top-level keys DeepSpeedConfig refuses with DeepSpeedConfigError.",
    "REMOVED_ZERO_KEYS": "zero_optimization keys DeepSpeedConfig refuses with DeepSpeedConfigError.",
    "FIELDS": (
        "Block -> canonical field -> aliases. 'bfloat16' is the legacy block, read with the bf16\n"
        "# model only when 'bf16' is absent. Pydantic blocks forbid unknown keys, and drop any value\n"
        '# equal to "auto" before validation (the field default applies).'
    ),
    "DEPRECATED": "Block -> deprecated field -> field it sets ('' = none; the value is only warned about).",
    "DEFAULTS": "Block -> canonical field -> default.",
    "TOP_LEVEL_DEFAULTS": "Top-level scalars that bear on precision, batch or optimizer choice -> default.",
    "DEEPSPEED_OPTIMIZERS": (
        "optimizer.type values (case-insensitive) DeepSpeed builds itself; any other\n"
        "# type is looked up as getattr(torch.optim, type)."
    ),
    "ADAM_PARAMS": (
        "optimizer.params accepted for Adam/AdamW -> default (FusedAdam's signature plus the\n"
        "# keys the engine pops: adam_w_mode, torch_adam, fp32_optimizer_states)."
    ),
    "SCHEDULERS": "scheduler.type -> scheduler.params -> default (constructor signature).",
}


def render(data):
    lines = [
        '"""DeepSpeed {v}\'s accepted config keys, aliases and precision defaults, read from its own config models.'.format(
            v=data["DEEPSPEED_VERSION"]
        ),
        "",
        "Generated; do not edit. Regenerate where DeepSpeed is installed with:",
        "",
        "    python tools/deepspeed_keys.py > dtypeplan/resolver/_deepspeed_keys.py",
        '"""',
        "",
        "from typing import Any, Dict, List",
        "",
    ]
    for name in _TYPES:
        lines.append("")
        if name in _COMMENTS:
            lines.append("# " + _COMMENTS[name])
        text = pprint.pformat(data[name], indent=1, width=100, sort_dicts=True)
        lines.append(f"{name}: {_TYPES[name]} = {text}")
    return "\n".join(lines) + "\n"


def main():
    logging.disable(logging.WARNING)
    sys.stdout.write(render(build()))


if __name__ == "__main__":
    main()
