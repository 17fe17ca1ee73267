"""What training frameworks do to a model and optimizer, met by the library itself.

HF Trainer, Accelerate and Lightning build the optimizer at their own time, wrap the model in
DDP, move it with ``.to``, clip with torch's utility and save it with safetensors. Each test
here is one such thing done to a model and optimizer of dtypeplan without any integration.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.errors import OptimizerUsageError
from tests._helpers import make_model


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_build_without_a_group_under_a_multi_rank_launcher_is_refused(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = make_model(0)
    with pytest.raises(OptimizerUsageError, match="prepare_model.*WORLD_SIZE=2"):
        plan.prepare_model(model)
    with pytest.raises(OptimizerUsageError, match="WORLD_SIZE=2.*Initialize the process group"):
        plan.build(model.parameters())
    monkeypatch.setenv("WORLD_SIZE", "1")
    plan.build(plan.prepare_model(model).parameters()).close()


DDP_CASES = [
    # stage, bf16 params + fp32 accumulation, DDP's options, micro-batches per step
    {"stage": 0, "bf16": True, "micro_batches": 1},
    {"stage": 1, "bf16": False, "bucket_view": True, "micro_batches": 2, "no_sync": True},
    {"stage": 1, "bf16": True, "micro_batches": 2},  # every micro-batch synchronized
    # the HF Trainer's; the optimizer collected, never closed
    {"stage": 2, "bf16": True, "find_unused": True, "micro_batches": 1, "collected": True},
    {"stage": 2, "bf16": False, "static_graph": True, "bucket_view": True, "micro_batches": 2},
    # the reducer armed by hand after forward (Accelerate's trigger_sync_in_backward)
    {"stage": 1, "bf16": True, "micro_batches": 2, "armed_anyway": True},
]
DDP_DEFAULTS = {
    "bucket_view": False,
    "find_unused": False,
    "static_graph": False,
    "no_sync": False,
    "armed_anyway": False,
}


@pytest.mark.slow
def test_under_a_ddp_wrapper_the_optimizer_alone_reduces() -> None:
    """DDP around parameters the optimizer owns (Accelerate, Lightning 32-true, the Trainer):
    the same losses and parameters, bit for bit, as without DDP, the same gradient-sized
    collectives on the wire (DDP's buckets go nowhere), no .grad left after backward, and no
    "set by hand" error at step. DDP stays quiet: no bucket reaches its communication hook, it
    writes no .grad, and no collective of its own runs (not even find_unused_parameters' map),
    from the first iteration on (static_graph: from the second; its first reduces all buckets
    whatever the flag); only a reducer armed by hand goes through the hook, and still trains
    the same. Once the optimizer is closed (or collected) the wrapper reduces again (the mean
    gradient in .grad). A wrapper around parameters partly owned by dtypeplan still reduces
    the others as DDP (their first backward was divided by the world size twice before). DDP
    broadcasts its buffers from rank 0 as often as around torch.optim. A DDP with a
    communication hook of its own is refused."""
    from dtypeplan.launch import spawn
    from tests.workers.framework_use import ddp_cases

    cases = [{**DDP_DEFAULTS, **case} for case in DDP_CASES]
    cases.append({"partly_owned": True})
    cases.append({"buffers": True})
    cases.append({**DDP_DEFAULTS, "stage": 1, "bf16": True, "micro_batches": 1, "own_hook": True})
    for rank, rank_results in enumerate(spawn(ddp_cases, 2, cases)):
        *compared, (partly, partly_bare), (buffers, ddp_buffers), refused = rank_results
        assert "communication hook of its own" in refused
        for case, (wrapped, bare) in zip(cases, compared, strict=False):
            assert wrapped["losses"] == bare["losses"], case
            for mine, theirs in zip(wrapped["params"], bare["params"], strict=True):
                assert torch.equal(mine, theirs), case
            assert wrapped["wire"] == bare["wire"], case
            assert bare["wire"], "the profiler saw the optimizer's own collectives"
            assert not any(wrapped["grads_after_backward"]), case
            for mine, theirs in zip(wrapped["after_close"], bare["after_close"], strict=True):
                assert torch.equal(mine, theirs), case
            if case["armed_anyway"]:
                assert all(wrapped["ddp_wrote"]) and all(wrapped["hook_calls"]), wrapped
                continue
            assert wrapped["all_collectives"] == bare["all_collectives"], case
            first = 1 if case["static_graph"] else 0  # the steps DDP is quiet from
            assert wrapped["hook_calls"][first:] == [0] * (3 - first), (case, wrapped)
            per_step = case["micro_batches"]
            assert len(wrapped["ddp_wrote"]) == 3 * per_step, case
            assert not any(wrapped["ddp_wrote"][first * per_step :]), (case, wrapped)
        assert partly["losses"] == partly_bare["losses"]
        for mine, theirs in zip(partly["params"], partly_bare["params"], strict=True):
            assert torch.equal(mine, theirs)
        assert partly["hook_calls"] == 6, partly  # one bucket per synchronized backward
        # DDP broadcasts rank 0's buffers as often as without dtypeplan (after a sync)
        assert buffers == ddp_buffers and True in buffers, buffers
        assert rank == 0 or False in buffers, buffers  # rank 0's own, always


class _TakesMany(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, extra: dict, ids: torch.Tensor, *, scale: torch.Tensor):
        assert ids.dtype == torch.long
        return self.linear(x) + self.linear(extra["y"][0]) * scale + ids


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_prepare_model_casts_floating_forward_inputs(stage: int) -> None:
    """As FSDP2's cast_forward_inputs: floating tensors (positional, keyword, nested) to the
    parameter dtype; integer ones untouched; preparing twice installs one cast."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    model = plan.prepare_model(plan.prepare_model(_TakesMany()))
    out = model(
        torch.randn(4, 3),
        {"y": [torch.randn(4, 3, dtype=torch.float64)]},
        torch.ones(4, 2, dtype=torch.long),
        scale=torch.tensor(2.0),
    )
    assert out.dtype == torch.bfloat16
    assert len(model._forward_pre_hooks) == 1
    twin = copy.deepcopy(model)
    ids = torch.ones(4, 2, dtype=torch.long)
    out = twin(torch.randn(4, 3), {"y": [torch.randn(4, 3)]}, ids, scale=torch.tensor(1.0))
    assert out.dtype == torch.bfloat16
    dtypeplan.resolve({"zero_optimization": {"stage": stage}}).prepare_model(model)
    assert not model._forward_pre_hooks


def _tiny_gpt2() -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _trained(model: torch.nn.Module, stage: int) -> torch.nn.Module:
    """``model`` prepared and built at ``stage`` in bf16, after one step (so the parameters
    are the flat buffer's views and hold values the optimizer wrote)."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters(), lr=1e-2)
    optimizer.backward(sum(p.float().pow(2).sum() for p in model.parameters()))
    optimizer.step()
    model._test_optimizer = optimizer  # type: ignore[assignment]  # kept alive with the model
    return model


@pytest.mark.parametrize("stage", [0, 2])
def test_safetensors_saves_every_tensor_after_build(stage: int, tmp_path: pytest.TempPathFactory):
    """Parameters are views into one flat buffer after build; safetensors' savers (and
    Accelerate's, which keeps one name per storage) must still write each of them."""
    from accelerate.utils import save as accelerate_save
    from safetensors.torch import load_file, load_model, save_file, save_model

    model = _trained(_tiny_gpt2(), stage)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    keys = set(model.state_dict())
    tied = {"lm_head.weight", "transformer.wte.weight"}  # savers keep one of the two
    assert len(keys - tied) == 27

    def check(saved: Any) -> None:
        assert keys - tied <= set(saved) and tied & set(saved)
        for name in set(saved) & keys:
            value = params.get(name, params["transformer.wte.weight"])
            assert torch.equal(saved[name], value), name

    save_model(model, str(tmp_path / "model.safetensors"))
    check(load_file(str(tmp_path / "model.safetensors")))
    fresh = _tiny_gpt2().to(torch.bfloat16)
    load_model(fresh, str(tmp_path / "model.safetensors"))
    check(dict(fresh.named_parameters()))

    model.save_pretrained(str(tmp_path / "pretrained"))
    check(load_file(str(tmp_path / "pretrained" / "model.safetensors")))

    accelerate_save(model.state_dict(), str(tmp_path / "acc.safetensors"), safe_serialization=True)
    check(load_file(str(tmp_path / "acc.safetensors")))

    # save_file refuses tied tensors (safetensors' rule, with or without dtypeplan), naming
    # only the tied pair and the way out; an untied model's state dict saves whole.
    with pytest.raises(RuntimeError, match=r"lm_head.weight.*save_model|save_model"):
        save_file(model.state_dict(), str(tmp_path / "tied.safetensors"))
    mlp = _trained(make_model(0), stage)
    save_file(mlp.state_dict(), str(tmp_path / "mlp.safetensors"))
    loaded = load_file(str(tmp_path / "mlp.safetensors"))
    assert loaded.keys() == mlp.state_dict().keys()
    for name, p in mlp.named_parameters():
        assert torch.equal(loaded[name], p.detach())
    # the parameters themselves are untouched: still the optimizer's views
    assert all(p.data_ptr() != loaded[n].data_ptr() for n, p in mlp.named_parameters())
    assert model.state_dict(keep_vars=True)["lm_head.weight"] is model.lm_head.weight


def test_a_zero3_model_survives_what_frameworks_do_to_it() -> None:
    """model.to(its device) / .cpu() before and after build (failed: "_apply(): Couldn't swap
    Linear.weight", weak references on the DTensor parameters), the same losses bit for bit as
    without; DDP around the FSDP2-sharded model refused, naming the integrations that work
    (was a NotImplementedError about a sharding strategy for broadcast, then torch's "DDP is
    not needed" that named none)."""
    from dtypeplan.launch import spawn
    from tests.workers.framework_use import zero3_handling

    for result in spawn(zero3_handling, 2):
        for bf16 in (False, True):
            assert result[f"moved_bf16={bf16}"] == result[f"still_bf16={bf16}"]
        assert "takes no DDP wrapper" in result["ddp"], result["ddp"]
        for integration in ("DtypeplanTrainer", "dtypeplan run", "DtypeplanAccelerator"):
            assert integration in result["ddp"], result["ddp"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_torch_clip_grad_norm_on_owned_gradients_fails_loudly(stage: int) -> None:
    """torch.nn.utils.clip_grad_norm_ (what the frameworks call) found no .grad and returned 0;
    now it raises naming optimizer.clip_grad_norm_, which clips for real. Backward passes
    that follow replace the placeholder (bare loss.backward() too), and the step is that of
    torch.optim on the summed gradient."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}})
    model, reference = make_model(0), make_model(0)
    optimizer = plan.build(model.parameters(), optimizer=torch.optim.SGD, lr=0.1)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(8, 12), torch.randn(8, 6)
    for net in (model, reference):
        for half in (slice(0, 4), slice(4, 8)):  # two micro-batches, bare backward
            torch.nn.functional.mse_loss(net(x[half]), y[half]).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not optimizer.held_tensors().grads
    with pytest.raises(OptimizerUsageError, match=r"optimizer\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(OptimizerUsageError, match="held by a dtypeplan optimizer"):
        next(model.parameters()).grad.norm()  # type: ignore[union-attr]
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    norm = optimizer.clip_grad_norm_(0.5)
    assert torch.allclose(norm, expected, rtol=1e-6, atol=0)
    optimizer.step()
    torch_optimizer.step()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    torch.nn.functional.mse_loss(model(x), y).backward()
    model.zero_grad()  # the framework's own zero_grad clears the placeholders as any .grad
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_torch_clip_grad_norm_at_zero3_fails_loudly_where_the_optimizer_holds_gradients() -> None:
    """ZeRO-3 with bf16 accumulation or bf16 masters: the optimizer takes each reduced shard
    into its accumulator and cleared .grad, so torch's clip_grad_norm_ found nothing and
    returned 0 (placeholders=False is that code). Now .grad holds a DTensor placeholder and the
    call raises naming optimizer.clip_grad_norm_; training is bitwise as before (two
    micro-batches, the second a bare backward onto the placeholders). With an fp32
    accumulator FSDP2's .grad is real and torch's norm is the optimizer's."""
    from dtypeplan.launch import spawn
    from tests.workers.framework_use import ZERO3_CLIP_CASES, zero3_clipping

    for result in spawn(zero3_clipping, 2):
        reference = result["reference"]
        for name in ZERO3_CLIP_CASES:
            new, old = result[f"{name}/placeholders=True"], result[f"{name}/placeholders=False"]
            assert new["losses"] == old["losses"], name
            assert all(torch.equal(a, b) for a, b in zip(new["params"], old["params"], strict=True))
            assert new["norms"] == old["norms"], name
            # bf16 weights and gradients (eps 2**-8), a few roundings in the sums
            assert new["norms"][0] == pytest.approx(reference, rel=4 * 2**-8), name
            assert new["held_ok"] and new["model_zero_grad"] and all(new["kept_by_step"])
            assert new["state_keys"] == old["state_keys"]
            if name == "fp32_accumulation":
                assert new["placeholders"] == ["none"] * 3
                for torch_norm, norm in zip(new["torch_clip"], new["norms"], strict=True):
                    assert torch_norm == pytest.approx(norm, rel=1e-6), name
                continue
            assert old["torch_clip"] == [0.0] * 3, name  # what was silent
            assert new["placeholders"] == ["all"] * 3, name
            for error in new["torch_clip"]:
                assert isinstance(error, str) and error.startswith("OptimizerUsageError"), error
                assert "optimizer.clip_grad_norm_" in error


@pytest.mark.slow
def test_finding_ddp_wrappers_walks_no_live_objects() -> None:
    """The first backward finds the DDP wrapper around the optimizer's parameters without
    walking the live objects: a dead ``weakref.proxy`` among them made that walk raise
    ``ReferenceError`` (isinstance met it), and torch's deprecated ``reduce_op`` warn; here
    ``gc.get_objects`` fails if called. The wrapper is the one whose forward ran; the global
    hook that saw it is gone after the first backward."""
    import gc
    import weakref

    from dtypeplan.launch import spawn
    from tests.workers.framework_use import ddp_wrappers_found

    class Gone:
        pass

    target = Gone()
    proxy = weakref.proxy(target)
    del target
    gc.collect()
    with pytest.raises(ReferenceError):
        isinstance(proxy, int)  # what a walk with isinstance met
    del proxy
    for result in spawn(ddp_wrappers_found, 2):
        assert result["hook_while_watching"] and not result["hook_after_first_backward"]
        assert (result["found"], result["idle_found"]) == (1, 0), result
        assert result["cooperating"], result
        assert not [w for w in result["warnings"] if "reduce_op" in w], result["warnings"]
