"""A resume at the same layout restores every bit, in whatever order torch users load.

* Round trips through ``optimizer.state_dict()`` / ``load_state_dict`` and through
  ``dtypeplan.checkpoint.save`` / ``load`` into a fresh optimizer of the same layout restore
  every state bit: int8 / fp8 codes and block scales (loading their values would quantize them
  anew, which moves a block's absmax: torchao's signed map ends at -0.993), bf16 moments, and
  the Kahan compensation with its weights (a pair halfway between two bf16 numbers is two
  pairs of one value, and the forward pass sees the weights). For every master dtype and
  rounding and every state dtype.
* ``model.load_state_dict`` before or after the optimizer's load (torch's usual order is
  model first) keeps the restored Kahan compensation: the resumed run is bitwise the
  uninterrupted one.
* A hyperparameter changed on one rank after build (a scheduler only one rank steps) fails the
  next step on every rank, naming the param group, the hyperparameter and the ranks, at ZeRO
  0-3, before any weight moves (the check rides on the step's summary all-reduce).

One process here; the 2-rank cases (ZeRO-1 and ZeRO-3 round trips and load orders, the
hyperparameter check at stages 0, 2 and 3) run on one spawned group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.errors import RankMismatchError
from dtypeplan.launch import spawn
from dtypeplan.optimizers.contract.hyperparameters import HyperparameterCheck
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION
from tests.workers import exact_resume as cases


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("master", sorted(cases.MASTERS))
def test_same_layout_round_trip_restores_every_bit(how: str, master: str, tmp_path: Any) -> None:
    for states in cases.STATES:
        cfg = cases.config(master, states, stage=2)
        result = cases.round_trip(cfg, how, str(tmp_path / states))
        assert result["states"] == [], (states, result)
        assert result["params"] == [], (states, result)
        # Stochastic rounding's noise is a hash of each master's checkpointed step count
        # (quantized states too): a resumed run draws the bits of the uninterrupted one.
        assert result["same_run"], (states, result)


@pytest.mark.parametrize("master", sorted(cases.MASTERS))
def test_resume_after_skipped_steps_is_bitwise(master: str, tmp_path: Any) -> None:
    """Issue 29 item 4: a head that skips every other step has its own step count; with bf16
    stochastic rounding its piece was rounded with a build-seeded generator that no
    checkpoint holds (9.8e-4 off the uninterrupted run). Every rounding, every state kind
    (the one-pass update, the fp32 pieces), through state_dict and dtypeplan.checkpoint."""
    for states, how in [("fp32", "state_dict"), ("bf16", "checkpoint"), ("int8", "checkpoint")]:
        cfg = cases.config(master, states, stage=2)
        result = cases.skipped_step_resume(cfg, how, str(tmp_path / f"{states}-{how}"))
        assert result["same_run"], (master, states, how, result)


@pytest.mark.parametrize(
    ("stage", "how"), [(0, "checkpoint"), (2, "state_dict"), (2, "checkpoint")]
)
def test_sgd_resume_with_stochastic_bf16_masters_is_bitwise(
    stage: int, how: str, tmp_path: Any
) -> None:
    """Issue 29 item 4, SGD: a class without a step count rounded its bf16 masters (the chunks
    and the pieces of a skipping head) with a generator seeded at build that no checkpoint
    holds: 7.8e-3 off the uninterrupted run after a resume, with or without skipped steps.
    Its roundings are counted in a checkpointed ``rounding_step``; with and without momentum
    (no state at all), through state_dict and dtypeplan.checkpoint."""
    for momentum in cases.SGD_MOMENTA:
        cfg = cases.config("bf16-stochastic", "fp32", stage=stage, sgd_momentum=momentum)
        where = str(tmp_path / str(momentum))
        result = cases.round_trip(cfg, how, where + "-round-trip")
        assert result == {"states": [], "params": [], "same_run": True}, (momentum, result)
        result = cases.skipped_step_resume({**cfg, "check_nonfinite": True}, how, where)
        assert result["same_run"], (momentum, result)
        # The NaN steps were skipped whole, and the count survived the resume.
        assert result["skipped"] == (1, 1, 2), result


def test_sgd_stochastic_rounding_counts_in_a_saved_scalar_state(tmp_path: Any) -> None:
    """The count is a scalar state like torch's ``step``: per param group in the checkpoint's
    manifest, per parameter for the head that skipped; no generator is left to the update."""
    cfg = cases.config("bf16-stochastic", "fp32", stage=2, sgd_momentum=0.0)
    model, opt = cases.build(cfg)
    cases.train(model, opt, range(3))
    assert not hasattr(opt._low_precision, "_generators")  # type: ignore[attr-defined]
    scalars = opt.group_scalar_state()
    assert {k: int(v) for k, v in scalars.items()} == {"scalar.group.0.rounding_step": 3}
    saved = opt.state_dict()["state"]
    assert all(int(entry["rounding_step"]) == 3 for entry in saved.values()), saved


def test_mixed_quantized_states_round_trip_restores_every_bit(tmp_path: Any) -> None:
    cfg = cases.config("fp32", "fp32", stage=1)
    cfg["optimizer_states"] = {"exp_avg": "int8", "exp_avg_sq": "fp8"}
    for how in ("state_dict", "checkpoint"):
        result = cases.round_trip(cfg, how, str(tmp_path / how))
        assert result == {"states": [], "params": [], "same_run": True}, (how, result)


def test_kahan_pair_halfway_between_two_bf16_weights_survives_a_checkpoint(
    tmp_path: Any,
) -> None:
    """1.0 + 2**-8 (half a bf16 ulp at 1) is the pair (1.0, +2**-8) and (1.0078125, -2**-8):
    the checkpoint's fp32 value alone cannot tell which; the saved compensation does."""
    cfg = cases.config("bf16-kahan", "fp32", stage=0)
    model, opt = cases.build(cfg)
    cases.train(model, opt, range(2))
    masters = [m for s in opt.groups for m in s.masters]  # type: ignore[attr-defined]
    master = masters[0]
    with torch.no_grad():
        master[:2] = torch.tensor([1.0, 1.0078125])
        opt.inner.state[master][KAHAN_COMPENSATION][:2] = torch.tensor([2.0**-8, -(2.0**-8)])
    want = cases.state_bits(opt), cases.param_bits(model)
    checkpoint.save(opt, tmp_path / "ckpt")
    model2, opt2 = cases.build(cfg, seed=3)
    checkpoint.load(opt2, tmp_path / "ckpt")
    assert cases.differing(cases.state_bits(opt2), want[0]) == []
    assert cases.differing(cases.param_bits(model2), want[1]) == []


@pytest.mark.parametrize("stage", [0, 2])
def test_kahan_compensation_survives_the_torch_load_order(stage: int, tmp_path: Any) -> None:
    cfg = cases.config("bf16-kahan", "fp32", stage=stage, lr=1e-3)
    for how in ("state_dict", "checkpoint"):
        for order in ("model_first", "optimizer_first"):
            directory = str(tmp_path / f"{how}-{order}")
            result = cases.torch_order_resume(cfg, how, order, directory)
            assert result == {"losses": True, "params": []}, (how, order, result)


def test_a_real_change_after_the_load_drops_the_compensation_of_that_weight_only() -> None:
    """The user writes other weights after the optimizer's load: the masters take them, and
    only the changed elements lose their compensation (it belonged to the old weights)."""
    cfg = cases.config("bf16-kahan", "fp32", stage=0)
    model, opt = cases.build(cfg)
    cases.train(model, opt, range(3))
    saved, weights = opt.state_dict(), cases.model_state(model)
    model2, opt2 = cases.build(cfg, seed=9)
    opt2.load_state_dict(saved)
    first = next(iter(weights))
    weights[first].view(-1)[0] += 0.25
    model2.load_state_dict(weights)
    state = opt2.groups[0]  # type: ignore[attr-defined]
    # Parameter 0's piece: its bucket's master, from its offset there.
    _, _, end, bucket, offset = next(p for p in state._pieces() if p[0] == 0)
    master = state.masters[bucket][offset : offset + end]
    held = opt2.inner.state[state.masters[bucket]][KAHAN_COMPENSATION]
    compensation = held[offset : offset + end].clone()
    assert bool((compensation[:2] != 0).all()), "the test needs compensated weights"
    opt2.model_sync.pick_up()  # type: ignore[attr-defined]
    after = held[offset : offset + end]
    assert float(after[0]) == 0.0
    assert torch.equal(after[1:], compensation[1:])
    assert float(master[0]) == float(weights[first].view(-1)[0])


@pytest.fixture(scope="module")
def group() -> list[dict[str, Any]]:
    return spawn(cases.spawned_group, 2, timeout_s=600)


@pytest.mark.slow
def test_two_ranks_same_layout_round_trips_restore_every_bit(group: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(group):
        for key, result in results.items():
            if key.startswith("round_trip/"):
                assert result == {"states": [], "params": [], "same_run": True}, (rank, key)


@pytest.mark.slow
def test_two_ranks_kahan_survives_the_torch_load_order(group: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(group):
        for key, result in results.items():
            if key.startswith("order/"):
                assert result == {"losses": True, "params": []}, (rank, key, result)


@pytest.mark.parametrize(
    "key", [cases.skipped_step_key(*case) for case in cases.SKIPPED_STEP_CASES]
)
@pytest.mark.slow
def test_two_ranks_resume_after_skipped_steps_is_bitwise(
    group: list[dict[str, Any]], key: str
) -> None:
    """Issue 29 item 4 on two ranks: a head that skips every other step and two NaN steps
    every parameter skips (check_nonfinite), saved and resumed through dtypeplan.checkpoint
    into another init, trains on bitwise as the uninterrupted run, for every master rounding
    (AdamW; SGD at ZeRO-3: its own rounding count per local shard)."""
    for rank, results in enumerate(group):
        result = results[key]
        assert result["same_run"], (rank, key, result)
        assert result["skipped"] == (1, 1, 2), (rank, key, result)


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.slow
def test_lr_changed_on_one_rank_fails_the_step_naming_group_and_ranks(
    group: list[dict[str, Any]], stage: int
) -> None:
    for rank, results in enumerate(group):
        result = results[f"lr/{stage}"]
        assert not result["ok"], (rank, result)
        assert result["type"] == "RankMismatchError", (rank, result)
        message = result["message"]
        assert "param group 1" in message and "lr" in message, message
        assert "rank 1" in message and "rank 0" in message, message
        # Failed before the update of the step that saw the difference: replicas still equal.
        assert result["params_unchanged"], (rank, result)


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.slow
def test_hyperparameter_check_adds_values_not_a_collective(
    group: list[dict[str, Any]], stage: int
) -> None:
    """A step all-reduces as many times with the check as without; one all-reduce (the step's
    summary) is longer by the check's slots (2 ranks: 2 + 4 per hyperparameter); and the
    check changes no number."""
    for results in group:
        found = results[f"all_reduces/{stage}"]
        with_check, without = found["sizes"]
        assert len(with_check) == len(without), found
        longer = [(a, b) for a, b in zip(with_check, without, strict=True) if a != b]
        assert len(longer) == 1 and longer[0][0] - longer[0][1] == found["slots"], found
        assert found["slots"] > 2, found
        assert found["same_numbers"], found


def _summed_slots(groups_per_rank: list[list[dict[str, Any]]], keys: list[str]) -> torch.Tensor:
    """What the step's all-reduce gives: the sum of every rank's slots (fp32, as sent)."""
    world = len(groups_per_rank)
    checks = [
        HyperparameterCheck(groups, keys, world, rank)
        for rank, groups in enumerate(groups_per_rank)
    ]
    total = torch.zeros(checks[0].numel, dtype=torch.float32)
    for check in checks:
        total += torch.tensor(check.slots(), dtype=torch.float32)
    return total


@pytest.mark.parametrize("world", [2, 3, 1000])
def test_hyperparameter_fingerprint_names_group_keys_and_ranks(world: int) -> None:
    """The sums stay exact in fp32 at any world size: equal groups pass, and a difference is
    found with the group, the hyperparameters and the ranks that hold each value."""
    keys = ["betas", "eps", "lr", "weight_decay"]

    def groups(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> list[dict[str, Any]]:
        return [
            {"params": [], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
            {"params": [], "lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": 0.1},
        ]

    same = [groups() for _ in range(world)]
    HyperparameterCheck(same[0], keys, world, 0).post(_summed_slots(same, keys))
    changed = [groups() for _ in range(world)]
    changed[world - 1] = groups(lr=5e-4, betas=(0.9, 0.99))
    check = HyperparameterCheck(changed[world - 1], keys, world, world - 1)
    with pytest.raises(RankMismatchError) as raised:
        check.post(_summed_slots(changed, keys))
    message = str(raised.value)
    assert "param group 1: betas, lr differs" in message, message
    assert "param group 0" not in message, message
    others = {2: "rank 0", 3: "ranks 0, 1"}.get(world, f"ranks 0-{world - 2}")
    assert others in message and f"rank {world - 1}" in message, message
    assert f"rank {world - 1} has betas=(0.9, 0.99), lr=0.0005" in message, message


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("move", ["to", "data"])
def test_a_load_after_the_parameters_were_rebound_is_seen_by_the_next_forward(
    stage: int, move: str, tmp_path: Any
) -> None:
    """``model.to(...)`` (Accelerate, Lightning) or ``param.data = ...`` after build points the
    parameters away from the flat buffer; a load right after must still put the checkpoint's
    weights where the forward reads them, not only at the next step."""
    from tests._helpers import make_batch, make_model, mse

    plan = dtypeplan.resolve(cases.config("fp32", "fp32", stage=stage))
    model = make_model(0)
    opt = plan.build(model.parameters())
    x, y = make_batch(0, 8)
    for _ in range(2):
        opt.backward(mse(model, x, y))
        opt.step()
        opt.zero_grad()
        if _ == 0:
            checkpoint.save(opt, str(tmp_path))
            saved = [p.detach().clone() for p in model.parameters()]
            saved_loss = mse(model, x, y).item()
    if move == "to":
        model.to("cpu:0")
    else:
        for p in model.parameters():
            p.data = p.data.clone()
    checkpoint.load(opt, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert mse(model, x, y).item() == saved_loss
