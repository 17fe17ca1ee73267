"""A model's sizes for planning: every parameter's element count and the transformer's shape.

Three ways in:

* an ``nn.Module`` (build it under ``torch.device("meta")``: no memory): its parameters as
  ``named_parameters`` lists them (tied weights once), and the ``nn.Linear`` weights fp8
  compute would convert (:data:`FP8_EXCLUDED`, dimensions multiples of 16);
* a transformers config (a ``config.json`` path or its directory, a dict, a
  ``PretrainedConfig``): for the GPT-2 and Llama families (Llama, Mistral, Qwen2) counted *by
  formula* from the config (:func:`_gpt2`, :func:`_llama`: the same parameters, in the same
  order, as the transformers class builds; ``tests/test_planner.py`` checks both against the
  class built on the meta device), any other ``model_type`` by building
  ``AutoModelForCausalLM.from_config`` on the meta device (transformers needed). The formula
  is the default because it takes microseconds and needs neither transformers nor torch's
  module code: building a 70B model on meta takes seconds;
* a parameter count (``--params``): one flat tensor, no transformer shape, so no activations.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FP8_EXCLUDED", "ModelSizes", "model_sizes"]

FP8_EXCLUDED = ("lm_head", "output", "score", "classifier")
"""The linear layers fp8 compute leaves alone by default (``fp8.exclude_modules``)."""

_LLAMA_LIKE = ("llama", "mistral", "qwen2")

Named = tuple[str, tuple[int, ...]]
"""A parameter's name and shape."""


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """What the planner needs of a model."""

    name: str
    param_numels: tuple[int, ...]
    """Every parameter's element count (tied weights once)."""
    param_shapes: tuple[Named, ...] = ()
    """Every parameter's name and shape, in the same order (empty for a bare count): the
    whole-tensor optimizers' states depend on them (``plan.memory(param_shapes=...)``)."""
    fp8_weights: tuple[int, ...] = ()
    """Element counts of the weights fp8 compute converts (whole ``nn.Linear`` weights)."""
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    largest_block: int = 0
    """Elements of the largest transformer block (ZeRO-3 gathers one block at a time)."""
    source: str = ""
    """How the sizes were found (formula, meta-device module, a count)."""

    @property
    def num_params(self) -> int:
        return sum(self.param_numels)

    @property
    def named_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """``{name: shape}`` as ``plan.memory(param_shapes=...)`` takes it (None: unknown)."""
        return dict(self.param_shapes) if self.param_shapes else None

    @property
    def has_shape(self) -> bool:
        return None not in (self.layers, self.hidden, self.heads, self.vocab)


def model_sizes(model: Any, *, build: bool = False) -> ModelSizes:
    """The sizes of ``model``: an ``nn.Module``, a config (path, directory, dict,
    ``PretrainedConfig``), a parameter count, or :class:`ModelSizes`. ``build``: count a
    config from its class built on the meta device even where a formula exists."""
    if isinstance(model, ModelSizes):
        return model
    if isinstance(model, int) and not isinstance(model, bool):
        if model <= 0:
            raise ValueError(f"a parameter count must be positive, not {model}")
        return ModelSizes(name=f"{model:,} parameters", param_numels=(model,), source="a count")
    if _is_module(model):
        return _from_module(model, name=type(model).__name__, source="an nn.Module")
    config = _read_config(model)
    kind = config.get("model_type")
    if not build and kind == "gpt2":
        return _gpt2(config)
    if not build and kind in _LLAMA_LIKE:
        return _llama(config)
    return _built_on_meta(config)


def _is_module(model: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(model, torch.nn.Module)


def _read_config(model: Any) -> dict[str, Any]:
    if isinstance(model, Mapping):
        return dict(model)
    to_dict = getattr(model, "to_dict", None)
    if callable(to_dict):  # a transformers PretrainedConfig
        return dict(to_dict())
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as file:
                document = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read a transformers config.json at {path}: {error}") from None
        if not isinstance(document, dict) or "model_type" not in document:
            raise ValueError(f"{path} is not a transformers config.json (no model_type)")
        return document
    raise ValueError(
        f"cannot read a model from {type(model).__name__}: give an nn.Module (built on the meta "
        "device), a transformers config.json (or its directory, a dict, a PretrainedConfig) or "
        "a parameter count"
    )


def _eligible(name: str, in_features: int, out_features: int) -> bool:
    last = name.rpartition(".")[2]
    return in_features % 16 == 0 and out_features % 16 == 0 and last not in FP8_EXCLUDED


def _from_module(module: Any, *, name: str, source: str, **shape: Any) -> ModelSizes:
    import torch

    named = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    numels = tuple(math.prod(shape) for _, shape in named)
    fp8 = tuple(
        m.weight.numel()
        for n, m in module.named_modules()
        if type(m) is torch.nn.Linear and _eligible(n, m.in_features, m.out_features)
    )
    blocks = [
        sum(p.numel() for p in child.parameters())
        for child in module.modules()
        if isinstance(child, torch.nn.ModuleList)
        for child in child
    ]
    return ModelSizes(
        name=name,
        param_numels=numels,
        param_shapes=named,
        fp8_weights=fp8,
        largest_block=max(blocks, default=0),
        source=source,
        **shape,
    )


def _shape(config: Mapping[str, Any]) -> dict[str, Any]:
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    vocab = config.get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, heads, vocab)):
        raise ValueError("the config lacks the transformer's layers, hidden size, heads or vocab")
    return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}


def _name(config: Mapping[str, Any]) -> str:
    return str(config.get("_name_or_path") or config.get("architectures", ["model"])[0])


def _built_on_meta(config: Mapping[str, Any]) -> ModelSizes:
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError(
            f"model_type {config.get('model_type')!r} has no formula here (gpt2, "
            f"{', '.join(_LLAMA_LIKE)}): counting it builds the model on the meta device, which "
            "needs transformers (pip install transformers)"
        ) from None
    hf_config = transformers.AutoConfig.for_model(**dict(config))
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(hf_config)
    return _from_module(
        module,
        name=_name(config),
        source=f"{type(module).__name__} built on the meta device",
        **_shape(config),
    )


def _linear(
    shapes: list[Named],
    fp8: list[int],
    name: str,
    n_in: int,
    n_out: int,
    bias: bool,
) -> None:
    """An ``nn.Linear``'s parameters: its weight (out, in) and bias."""
    shapes.append((f"{name}.weight", (n_out, n_in)))
    if bias:
        shapes.append((f"{name}.bias", (n_out,)))
    if _eligible(name, n_in, n_out):
        fp8.append(n_in * n_out)


def _sizes(
    config: Mapping[str, Any],
    named: Sequence[Named],
    block: Sequence[Named],
    **fields: Any,
) -> ModelSizes:
    return ModelSizes(
        name=_name(config),
        param_numels=tuple(math.prod(shape) for _, shape in named),
        param_shapes=tuple(named),
        largest_block=sum(math.prod(shape) for _, shape in block),
        **fields,
    )


def _gpt2(config: Mapping[str, Any]) -> ModelSizes:
    """GPT2LMHeadModel: wte, wpe, per block ln_1, c_attn, c_proj, ln_2, c_fc, c_proj (Conv1D,
    weight (in, out) and bias: not nn.Linear, so no fp8 layer), ln_f; lm_head tied to wte."""
    shape = _shape(config)
    h, layers = shape["hidden"], shape["layers"]
    inner = config.get("n_inner") or 4 * h
    block: list[Named] = [
        ("ln_1.weight", (h,)),
        ("ln_1.bias", (h,)),
        ("attn.c_attn.weight", (h, 3 * h)),
        ("attn.c_attn.bias", (3 * h,)),
        ("attn.c_proj.weight", (h, h)),
        ("attn.c_proj.bias", (h,)),
        ("ln_2.weight", (h,)),
        ("ln_2.bias", (h,)),
        ("mlp.c_fc.weight", (h, inner)),
        ("mlp.c_fc.bias", (inner,)),
        ("mlp.c_proj.weight", (inner, h)),
        ("mlp.c_proj.bias", (h,)),
    ]
    named: list[Named] = [
        ("transformer.wte.weight", (shape["vocab"], h)),
        ("transformer.wpe.weight", (config.get("n_positions", 1024), h)),
    ]
    named += [(f"transformer.h.{i}.{n}", s) for i in range(layers) for n, s in block]
    named += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
    return _sizes(config, named, block, source="counted from the config (GPT-2 formula)", **shape)


def _llama(config: Mapping[str, Any]) -> ModelSizes:
    """LlamaForCausalLM (and Mistral, Qwen2): embed_tokens, per layer q/k/v/o projections
    (biases with attention_bias, or always for Qwen2's q/k/v), gate/up/down (mlp_bias), two
    RMSNorms; the final norm; lm_head unless tied."""
    shape = _shape(config)
    h, layers = shape["hidden"], shape["layers"]
    heads = shape["heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    inner = config["intermediate_size"]
    qkv_bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
    o_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    block: list[Named] = []
    fp8: list[int] = []
    _linear(block, fp8, "self_attn.q_proj", h, heads * head_dim, qkv_bias)
    _linear(block, fp8, "self_attn.k_proj", h, kv_heads * head_dim, qkv_bias)
    _linear(block, fp8, "self_attn.v_proj", h, kv_heads * head_dim, qkv_bias)
    _linear(block, fp8, "self_attn.o_proj", heads * head_dim, h, o_bias)
    for name, n_in, n_out in (
        ("mlp.gate_proj", h, inner),
        ("mlp.up_proj", h, inner),
        ("mlp.down_proj", inner, h),
    ):
        _linear(block, fp8, name, n_in, n_out, mlp_bias)
    block += [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    named: list[Named] = [("model.embed_tokens.weight", (shape["vocab"], h))]
    named += [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in block]
    named.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        named.append(("lm_head.weight", (shape["vocab"], h)))  # excluded from fp8 by default
    return _sizes(
        config,
        named,
        block,
        fp8_weights=tuple(fp8 * layers),
        source=f"counted from the config ({config.get('model_type')} formula)",
        **shape,
    )
