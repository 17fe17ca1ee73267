"""transformers' GPT-2 and Llama (tiny configs, random init, tied embeddings) on spawned ranks."""

from __future__ import annotations

import copy
import traceback
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import dtypeplan
from tests.workers.torch_contract import full

VOCAB, STEPS = 128, 5


def build_model(arch: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def no_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Decay on matrices; none on biases and norms (every HF training script does this)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
    ]


def run_case(rank: int, world: int, arch: str, stage: int, dtype: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    plan = dtypeplan.resolve(config)
    reference = build_model(arch)
    model = plan.prepare_model(copy.deepcopy(reference))
    opt = plan.build(no_decay_groups(model))
    ref_opt = torch.optim.AdamW(no_decay_groups(reference), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4 * world, 16), generator=generator)
        ref_opt.zero_grad()
        ref_loss = reference(input_ids=tokens, labels=tokens).loss
        ref_loss.backward()
        ref_opt.step()
        mine = tokens.chunk(world)[rank]
        opt.zero_grad()
        loss = model(input_ids=mine, labels=mine).loss.float()
        opt.backward(loss)
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
        ref_losses.append(float(ref_loss))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    blocks = model.transformer.h if arch == "gpt2" else model.model.layers
    # ZeRO-3: each decoder block is an FSDP unit of its own (issue 10 item 10), the root too.
    units = [isinstance(m, FSDPModule) for m in (*blocks, model)]
    exported = dtypeplan.checkpoint.export_model_state(opt, model)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    in_ = model.get_input_embeddings().weight
    tied_names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is in_]
    export_ok = set(exported) == set(names) and all(
        exported[n] is exported[tied_names[0]] for n in tied_names
    )
    mine_w = [full(p) for p in model.parameters()]
    ref_w = [p.detach() for p in reference.parameters()]
    diff = sum(float((a - b).square().sum()) for a, b in zip(mine_w, ref_w, strict=True))
    size = sum(float(b.square().sum()) for b in ref_w)
    return {
        "losses": losses,
        "ref": ref_losses,
        "tied": tied,
        "rel": (diff / size) ** 0.5,
        "units": units,
        "tied_names": tied_names,
        "export_ok": export_ok,
    }


def run_cases(rank: int, world: int, cases: list[tuple[str, int, str]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for arch, stage, dtype in cases:
        try:
            results[f"{arch}-stage{stage}-{dtype}"] = run_case(rank, world, arch, stage, dtype)
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[f"{arch}-stage{stage}-{dtype}"] = f"{exc!r}\n{traceback.format_exc(limit=-3)}"
        torch.distributed.barrier()
    return results
