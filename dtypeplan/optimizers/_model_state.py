"""``model.state_dict()`` of a model whose parameters are views into the optimizer's flat buffer.

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

from typing import Any

import torch

__all__ = ["give_parameters_own_storage"]

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
