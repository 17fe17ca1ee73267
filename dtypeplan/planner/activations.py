"""Activation bytes of a transformer's training step, by a stated formula (nothing is run).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), section 4.1: one transformer layer with sequence ``s``, micro-batch ``b``,
hidden size ``h``, ``a`` attention heads and 16-bit activations stores

    s * b * h * (34 + 5 * a * s / h)   bytes without recomputation,
    s * b * h * 34                     with selective recomputation (the attention's
                                       ``a * s * s`` scores, softmax and dropout are recomputed;
                                       what FlashAttention-style kernels store anyway),
    s * b * h * 2                      with full recomputation (only the layer's input),

and the output layer adds ``4 * s * b * h * (1 + v / h)`` (its input, the final norm's input,
and the logits with the cross-entropy's fp32 copy, vocabulary ``v``). The 34 counts 2-byte
activations and 1-byte dropout masks; for fp32 activations (fp32 parameters without autocast)
the 2-byte terms double, which this module approximates by doubling the layer figure. The
formula is for GPT-style blocks with a 4h MLP; for Llama's gated MLP (``intermediate_size``
wider than 4h, three matrices) it is an approximation (within about 20% by the paper's own
accounting). ZeRO does not shard activations: every rank holds its micro-batch's.
"""

from __future__ import annotations

from dtypeplan.planner.model_sizes import ModelSizes

__all__ = ["RECOMPUTE", "activation_bytes"]

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none, selective (attention scores recomputed), full (each
layer's forward rerun in backward, only its input kept)."""


def activation_bytes(
    sizes: ModelSizes, *, micro_batch: int, seq: int, recompute: str, bytes_per_value: int
) -> int:
    """Bytes of activations one rank holds for one micro-batch of ``micro_batch`` sequences of
    ``seq`` tokens; 0 for a model without a transformer shape (a bare parameter count)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, not {recompute!r}")
    if not sizes.has_shape or micro_batch == 0:
        return 0
    assert sizes.layers and sizes.hidden and sizes.heads and sizes.vocab
    s, b, h, a, v = seq, micro_batch, sizes.hidden, sizes.heads, sizes.vocab
    if recompute == "full":
        per_layer = 2 * s * b * h
    elif recompute == "selective":
        per_layer = 34 * s * b * h
    else:
        per_layer = s * b * h * 34 + 5 * a * s * s * b
    scale = max(bytes_per_value, 2) / 2
    output = 4 * s * b * h + 4 * s * b * v
    return int(per_layer * sizes.layers * scale) + output
