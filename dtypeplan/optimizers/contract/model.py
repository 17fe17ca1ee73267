"""What ``prepare_model`` does to the model: one dtype, the fp32 values kept, own storage.

**One dtype for the whole model, without losing the fp32 values the master weights start
from.**
``plan.prepare_model(model)`` casts the model whole to ``plan.param_dtype``, as DeepSpeed's
engine does (``module.bfloat16()``): every floating-point parameter, frozen ones included, and
every floating-point buffer (BatchNorm's running statistics, rotary tables); integer buffers
are left alone. Without that, ``build(p for p in model.parameters() if p.requires_grad)``
would leave frozen layers and buffers in fp32 and the forward would mix dtypes.

The README's order is ``prepare_model`` then ``build``, and ``build`` takes the fp32 master
weights from the parameters' values. A cast to bf16 before that would leave masters with 8
mantissa bits. So the cast keeps each trainable parameter's value from before the cast (the
tensor itself, not a copy: the memory the model held anyway) in a weak map, and ``build``
takes it back (:func:`restore_cast_values`) before it reads the masters: the masters are the
original fp32 weights, bit for bit, and the map entry is dropped. Frozen parameters keep
nothing (they are not the optimizer's, and keeping fp32 copies of a frozen backbone would
undo the memory the cast saves).

Changes between ``prepare_model`` and ``build`` win over the kept values, element by element:
where a parameter no longer equals its kept value cast down (``model.load_state_dict``, an
in-place write), its current value is taken; where it still does, the kept value is (the same
number, with its lower bits). A parameter moved to another device takes its kept value along;
one turned back to fp32 (or wider) by the user keeps its own value.

The forward's floating-point inputs are cast to the same dtype (:func:`cast_forward_inputs`, as
FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` does at ZeRO-3): a bf16 model fed
the fp32 batch a data loader yields would otherwise fail in its first matmul. Integer inputs
(token ids, labels) stay as they are.

**``model.state_dict()`` of a model whose parameters are views into the optimizer's flat buffer.**

At ZeRO 0-2 ``build`` makes every trainable parameter a view into one flat buffer per param
group (``buffers/layout.py``). ``model.state_dict()`` hands those views out as they are, and tools
that save by storage take them for one shared tensor: ``safetensors.torch.save_model`` refuses
("None is covering the entire storage"), and Accelerate's ``save_state`` keeps one name per
storage and drops the others (1 of 28 tensors of a small GPT-2), silently.

So a model readied by ``plan.prepare_model`` gives each such parameter in its state dict as its
own tensor: a copy, made when ``state_dict()`` is called, in the parameter dtype on the
parameter's device (what the view holds, bit for bit). Parameters that share one tensor (tied
embeddings) share one copy, so savers still see them as tied. Tensors that already own their
storage (buffers, frozen parameters, any parameter before ``build``) are handed out as before,
and so is everything under ``keep_vars=True`` (the parameters themselves). The price is one
copy of the trainable parameters while the state dict lives, as a full state dict of FSDP
costs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "cast_floating_buffers",
    "cast_forward_inputs",
    "cast_model",
    "give_parameters_own_storage",
    "restore_cast_values",
]

_VALUES_BEFORE_CAST: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Trainable parameter -> its tensor before :func:`cast_model` cast it to a narrower dtype."""


def _narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to ``target`` may round (so the value is worth keeping)."""
    return source != target and torch.finfo(source).bits >= torch.finfo(target).bits


@torch.no_grad()
def cast_floating_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point buffer of ``model`` to ``dtype`` in place (shared ones stay shared)."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None or not buffer.is_floating_point() or buffer.dtype == dtype:
                continue
            if id(buffer) not in done:
                done[id(buffer)] = buffer.to(dtype)
            module._buffers[name] = done[id(buffer)]


@torch.no_grad()
def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model`` whole to ``dtype`` in place, keeping trainable parameters' wider values.

    Parameters keep their identity (``param.data`` is replaced), so tied parameters stay tied
    and references held elsewhere stay valid. Returns ``model``.
    """
    for param in model.parameters():
        if not param.is_floating_point() or param.dtype == dtype:
            continue
        before = param.data
        param.data = before.to(dtype)
        if param.requires_grad and _narrows(before.dtype, dtype):
            _VALUES_BEFORE_CAST[param] = before
    cast_floating_buffers(model, dtype)
    return model


_INPUT_CAST = "_dtypeplan_input_cast"
"""The module attribute holding :func:`cast_forward_inputs`'s hook (one per module)."""


class _CastInputs:
    """The forward pre-hook: a class, not a closure, so a prepared model pickles and copies.

    The target is the dtype the model's parameters have when it runs (``dtype`` before it has
    any floating one): a model the program turned to another dtype after ``prepare_model``
    (``model.float()``) gets inputs it can take, and the optimizer's own check at ``step()``
    says what is wrong with it.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), self.dtype)

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                return tensor.to(dtype)
            return tensor

        return tree_map_only(torch.Tensor, cast, (args, kwargs))


def cast_forward_inputs(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point tensors among ``model``'s forward arguments to ``dtype``.

    A forward pre-hook on ``model`` itself (not a wrapper: names, class and ``state_dict``
    stay), reaching tensors inside tuples, lists and dicts. A second call replaces the first;
    an fp32 ``dtype`` (fp32 or autocast plans: the model stays fp32) installs none.
    """
    previous = getattr(model, _INPUT_CAST, None)
    if previous is not None:
        previous.remove()
        delattr(model, _INPUT_CAST)
    if dtype == torch.float32:
        return
    handle = model.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True)
    setattr(model, _INPUT_CAST, handle)


@torch.no_grad()
def restore_cast_values(params: Iterable[torch.Tensor]) -> None:
    """Give each of ``params`` that :func:`cast_model` cast down its value from before the cast.

    Called by the optimizer's constructor before it reads the master weights, so they start
    from the original values. Elements changed since the cast keep their current value (see
    the module docstring). Each kept value is used once and dropped.
    """
    for param in params:
        before = _VALUES_BEFORE_CAST.pop(param, None)
        if before is None:
            continue
        now = param.data
        if now.shape != before.shape or not _narrows(before.dtype, now.dtype):
            continue  # reshaped, or made wide again by the user: its own value wins
        before = before.to(now.device)
        unchanged = now == before.to(now.dtype)
        param.data = torch.where(unchanged, before, now.to(before.dtype))


_HANDLE = "_dtypeplan_state_dict_copies"
"""The module attribute holding the post-hook (one per module)."""


def _is_partial_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers only part of its storage (a view into a larger buffer)."""
    storage = tensor.untyped_storage()
    return (
        tensor.data_ptr() != storage.data_ptr()
        or tensor.numel() * tensor.element_size() != storage.nbytes()
    )


@torch.no_grad()
def _copy_views(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """The post-hook: the partial views under ``prefix`` copied, tied ones once."""
    copies: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, torch.nn.Parameter) or not _is_partial_view(value):
            continue  # keep_vars=True, or a tensor of its own
        if value.device.type == "meta":
            continue
        where = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
        if where not in copies:
            copies[where] = value.clone()
        state_dict[key] = copies[where]


def give_parameters_own_storage(model: torch.nn.Module) -> None:
    """Install the post-hook on ``model`` (a second call keeps one)."""
    previous = getattr(model, _HANDLE, None)
    if previous is not None:
        previous.remove()
    setattr(model, _HANDLE, model.register_state_dict_post_hook(_copy_views))
