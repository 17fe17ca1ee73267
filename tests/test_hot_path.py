"""The hot path's decisions and wiring (issue 14).

* Adam's decoupled decay is honoured on every update path (W1);
* a gradient mean goes on the wire as NCCL's native AVG, as SUM (then one folded divide) on
  gloo, and the engine divides exactly once (W2);
* every tensor handed to a collective lives on the parameters' device (on CPU ranks this runs
  the same wiring; the check bites on a GPU, where ``benchmarks/gpu/run_all.sh`` runs it);
* with ``gradient_accumulation_steps`` the optimizer starts the boundary reduction inside the
  last bare ``loss.backward()``, with the numbers of ``last_micro_batch=True`` (S13).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.comm import Communicator
from dtypeplan.comm._collectives import mean_reduction
from dtypeplan.launch import spawn
from dtypeplan.optimizers.kernels.torch_adam import decoupled_weight_decay
from tests._helpers import make_batch, make_model, mse
from tests.workers.hot_path import SHARDED_BOUNDARY_RUNS, boundary_case, hot_path_cases

# --- W1: which weight decay -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch_class", "group", "decoupled"),
    [
        (torch.optim.AdamW, {}, True),
        (torch.optim.AdamW, {"decoupled_weight_decay": True}, True),
        (torch.optim.Adam, {}, False),
        (torch.optim.Adam, {"decoupled_weight_decay": False}, False),
        (torch.optim.Adam, {"decoupled_weight_decay": True}, True),
    ],
)
def test_decoupled_weight_decay_decision(
    torch_class: type[torch.optim.Optimizer], group: dict, decoupled: bool
) -> None:
    assert decoupled_weight_decay(torch_class, group) is decoupled


def test_adam_with_decoupled_decay_matches_torch() -> None:
    """The engine's own Adam update (not torch's step()) against torch.optim.Adam."""
    # The client-optimizer path: a config's "Adam" already means AdamW (DeepSpeed's adam_w_mode).
    params = {"lr": 1e-2, "weight_decay": 0.5, "decoupled_weight_decay": True}
    plan = dtypeplan.resolve({})
    model, reference = make_model(0), make_model(0)
    optimizer = plan.build(model.parameters(), optimizer=torch.optim.Adam, **params)
    torch_optimizer = torch.optim.Adam(
        reference.parameters(), lr=1e-2, weight_decay=0.5, decoupled_weight_decay=True
    )
    for seed in range(3):
        x, y = make_batch(seed, 8)
        optimizer.zero_grad()
        optimizer.backward(mse(model, x, y))
        optimizer.step()
        torch_optimizer.zero_grad()
        mse(reference, x, y).backward()
        torch_optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        # fp32 throughout; the gradient is divided by a grad_scale of 1 (exact), and the
        # fused kernels of both sides are the same: a few ulps from summation order at most.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


_UNIT_FACTOR_KERNELS = {
    # The fused Adam path (kernels/torch_adam.fused_adam_kernel), and a class stepped through
    # inner.step() (inner_step_grads) whose fused kernel takes a grad_scale.
    "adamw": (torch.optim.AdamW, "_fused_adamw_", {"lr": 1e-2, "fused": True}),
    "sgd": (torch.optim.SGD, "_fused_sgd_", {"lr": 1e-2, "momentum": 0.9, "fused": True}),
}


@pytest.mark.parametrize("clip", [0.0, 1e-3])
@pytest.mark.parametrize("kernel", sorted(_UNIT_FACTOR_KERNELS))
def test_host_factor_of_exactly_one_skips_the_kernels_rescaling(kernel: str, clip: float) -> None:
    """One process, no clipping: torch's fused kernel gets no ``grad_scale`` (it would write
    every gradient back, divided by 1), and the numbers are torch's; clipped, it gets one."""
    torch_class, kernel_name, params = _UNIT_FACTOR_KERNELS[kernel]
    plan = dtypeplan.resolve({"gradient_clipping": clip})
    model, reference = make_model(0), make_model(0)
    optimizer = plan.build(model.parameters(), optimizer=torch_class, **params)
    torch_optimizer = torch_class(reference.parameters(), **params)
    scales: list[torch.Tensor | None] = []
    fused = getattr(torch, kernel_name)

    def recording(*args: object, grad_scale: torch.Tensor | None = None, **kwargs: object) -> None:
        scales.append(grad_scale)
        fused(*args, grad_scale=grad_scale, **kwargs)

    x, y = make_batch(0, 8)
    with mock.patch.object(torch, kernel_name, recording):
        optimizer.backward(mse(model, x, y), last_micro_batch=True)
        optimizer.step()
    assert scales and all((s is None) == (clip == 0.0) for s in scales)
    if clip == 0.0:
        mse(reference, x, y).backward()
        torch_optimizer.step()
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# --- W2: the reduction op per backend ---------------------------------------------------------


def test_mean_reduction_per_backend() -> None:
    assert mean_reduction("nccl", 8) == (dist.ReduceOp.AVG, 1)
    assert mean_reduction("gloo", 8) == (dist.ReduceOp.SUM, 8)
    assert mean_reduction("none", 1) == (dist.ReduceOp.SUM, 1)


def test_communicator_folds_what_the_backend_left() -> None:
    """With the backend mocked as NCCL the mean calls send AVG and leave nothing to divide."""
    sent: list[object] = []

    class _Work:
        def wait(self) -> None:
            pass

    def fake_all_reduce(tensor: torch.Tensor, op: object, **_: object) -> _Work:
        sent.append(op)
        return _Work()

    def fake_reduce_scatter(
        out: torch.Tensor, full: torch.Tensor, op: object, **_: object
    ) -> _Work:
        sent.append(op)
        return _Work()

    with (
        mock.patch.object(dist, "is_available", return_value=True),
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_world_size", return_value=4),
        mock.patch.object(dist, "get_rank", return_value=0),
        mock.patch.object(dist, "get_backend", return_value="nccl"),
        mock.patch.object(dist, "all_reduce", fake_all_reduce),
        mock.patch("dtypeplan.comm._collectives._reduce_scatter_flat", fake_reduce_scatter),
    ):
        comm = Communicator(group=object())  # type: ignore[arg-type]
        assert comm.backend == "nccl" and comm.reduction_divisor == 1
        comm.start_all_reduce_mean(torch.ones(8), torch.float32, "collective")()
        comm.start_reduce_scatter_mean(torch.ones(2), torch.ones(8), torch.float32, "collective")()
        comm.start_all_reduce_sum(torch.ones(8), torch.float32, "collective")()
        comm.all_reduce_scalars(torch.ones(1))
        with mock.patch.object(dist, "get_backend", return_value="gloo"):
            gloo = Communicator(group=object())  # type: ignore[arg-type]
        assert gloo.reduction_divisor == 4
        gloo.start_all_reduce_mean(torch.ones(8), torch.float32, "collective")()
    avg, total = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    # Gradient means average on NCCL; plain sums and the norm scalar stay sums; gloo sums.
    assert sent == [avg, avg, total, total, total], sent


def test_engine_divides_by_the_communicators_divisor_once() -> None:
    """A fake NCCL mean (the sum over 4) must give the same update as a real gloo-style sum."""
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0}
    results = []
    for divisor in (1, 3):
        plan = dtypeplan.resolve(config)
        model = make_model(0)
        optimizer = plan.build(model.parameters())
        optimizer.comm.reduction_divisor = divisor
        x, y = make_batch(0, 8)
        loss = mse(model, x, y)
        optimizer.backward(loss * divisor)  # what a SUM over `divisor` equal ranks delivers
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for mean, summed in zip(*results, strict=True):
        torch.testing.assert_close(mean, summed, rtol=1e-6, atol=1e-7)


# --- the 2-rank cases: devices of collective tensors, and the accumulation boundary ----------


def _device_configs() -> list[dict]:
    configs = []
    for stage, sharded in [(0, False), (1, False), (1, True), (2, True), (3, True)]:
        configs.append(
            {
                "bf16": {"enabled": True},
                "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": sharded},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
                "gradient_clipping": 1.0,
            }
        )
    return configs


def _boundary_configs() -> list[dict]:
    return [
        {
            "bf16": {"enabled": True},
            "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": False},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
            "gradient_clipping": 1.0,
        }
        for stage in (0, 1)
    ]


def _sharded_boundary_config() -> dict:
    return {
        **_boundary_configs()[0],
        "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 300},
    }


@pytest.mark.slow
def test_two_ranks_devices_and_boundary() -> None:
    # With two GPUs the ranks run on them over NCCL, where a stray CPU tensor would fail;
    # elsewhere on CPU over gloo (the same wiring, and the boundary checks).
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    results = spawn(
        hot_path_cases,
        2,
        _device_configs(),
        _boundary_configs(),
        _sharded_boundary_config(),
        backend=backend,
        timeout_s=300,
    )
    for rank in results:
        for config, case in zip(_device_configs(), rank["devices"], strict=True):
            assert case["log"], config
            assert len(case["param_devices"]) == 1, case["param_devices"]
            stray = {(op, d) for op, d in case["log"] if d != case["param_devices"][0]}
            assert not stray, (config, stray)
        boundary = rank["boundary"]
        for index in range(len(_boundary_configs())):
            steps, flag, nothing, batch = boundary[4 * index : 4 * index + 4]
            for step in range(3):
                # Nothing goes out during the first backward of a step; told the boundary,
                # the step's reduction starts inside the second; untold, it waits for step().
                assert steps["collectives_after_backward"][step][0] == 0
                assert steps["collectives_after_backward"][step][1] > 0
                assert flag["collectives_after_backward"][step][1] > 0
                assert nothing["collectives_after_backward"][step] == [0, 0]
            # Told the boundary, the backward took the norms of the chunks it finished (all
            # but the last MAX_IN_FLIGHT, finished by the step); untold, the step takes all.
            assert all(0 < n < steps["buckets"] for n in steps["norms_known_at_step"]), steps
            assert all(0 < n < flag["buckets"] for n in flag["norms_known_at_step"]), flag
            assert nothing["norms_known_at_step"] == [0, 0, 0]
            # The same collectives in the same order, the same norms to the bit: bit-identical
            # parameters.
            assert steps["grad_norms"] == flag["grad_norms"] == nothing["grad_norms"]
            for a, b, c in zip(steps["params"], flag["params"], nothing["params"], strict=True):
                assert torch.equal(a, b) and torch.equal(a, c)
            assert "gradient_accumulation_steps" in steps["third_backward_error"]
            # DeepSpeed's batch sizes tell the same boundary: the same collectives, norms and
            # parameters, and the error names where the count came from.
            assert batch["collectives_after_backward"] == steps["collectives_after_backward"]
            assert batch["norms_known_at_step"] == steps["norms_known_at_step"]
            assert batch["grad_norms"] == steps["grad_norms"]
            for a, b in zip(steps["params"], batch["params"], strict=True):
                assert torch.equal(a, b)
            assert "derived as DeepSpeed does" in batch["third_backward_error"], batch
        _check_sharded_boundary(rank["sharded_boundary"])


def _check_sharded_boundary(runs: list[dict]) -> None:
    """ZeRO-2: told the boundary, the last backward takes every chunk's norm as its
    reduce-scatter lands; a backward after the one counted last drops them (the chunks
    changed), and the step takes them all again. Norms and parameters as untold, to the bit."""
    by_run = dict(zip(SHARDED_BOUNDARY_RUNS, runs, strict=True))
    steps, flag, nothing = by_run[("steps", 2)], by_run[("flag", 2)], by_run[("nothing", 2)]
    assert steps["norms_known_at_step"] == [steps["buckets"]] * 3, steps
    assert flag["norms_known_at_step"] == [flag["buckets"]] * 3, flag
    assert nothing["norms_known_at_step"] == [0, 0, 0]
    assert steps["grad_norms"] == flag["grad_norms"] == nothing["grad_norms"]
    for a, b, c in zip(steps["params"], flag["params"], nothing["params"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    miscounted, untold = by_run[("steps", 3)], by_run[("nothing", 3)]
    assert miscounted["norms_known_at_step"] == [0, 0, 0], miscounted
    assert miscounted["grad_norms"] == untold["grad_norms"]
    for a, b in zip(miscounted["params"], untold["params"], strict=True):
        assert torch.equal(a, b)


def test_one_process_boundary_takes_every_norm_in_backward() -> None:
    """Without a group nothing is in flight: told the boundary, the last backward takes every
    bucket's norm, and the step's norm and update are those of an untold run, to the bit."""
    config = _boundary_configs()[0]
    told = boundary_case(0, 1, config, "flag")
    untold = boundary_case(0, 1, config, "nothing")
    assert told["norms_known_at_step"] == [told["buckets"]] * 3, told
    assert untold["norms_known_at_step"] == [0, 0, 0]
    assert told["grad_norms"] == untold["grad_norms"]
    for a, b in zip(told["params"], untold["params"], strict=True):
        assert torch.equal(a, b)


# --- .grad set by hand: copied onto an empty accumulator --------------------------------------


class _AccumulatorWrites(torch.utils._python_dispatch.TorchDispatchMode):
    """Elements each in-place op writes into one storage (the accumulator), by op name."""

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__()
        self.pointer = storage.untyped_storage().data_ptr()
        self.written: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        target = args[0] if args else None
        name = func.overloadpacket.__name__
        if (
            name.endswith("_")
            and isinstance(target, torch.Tensor)
            and target.untyped_storage().data_ptr() == self.pointer
        ):
            self.written[name] = self.written.get(name, 0) + target.numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("accumulation", ["fp32", "bf16"])
def test_hand_set_grads_are_copied_onto_an_empty_accumulator(accumulation: str) -> None:
    """``.grad`` set by hand with no backward since ``zero_grad``: each gradient is copied into
    the accumulator and only what no gradient covers is zeroed (was: the whole accumulator
    zeroed, then every gradient added), and a stale accumulator (a backward's gradients of the
    step before) leaks into neither the update nor ``grad_norm``."""
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    config["gradient_accumulation_dtype"] = accumulation
    model, reference = make_model(0), make_model(0)
    optimizer = dtypeplan.resolve(config).build(model.parameters())
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    params, reference_params = list(model.parameters()), list(reference.parameters())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[accumulation]
    generator = torch.Generator().manual_seed(3)
    left_out = len(params) - 1  # in the second step this parameter gets no gradient
    (state,) = optimizer.groups
    writes = _AccumulatorWrites(state.accumulator)
    for step in range(2):
        # Values the accumulation dtype holds exactly, so torch sees the same gradients.
        grads = [torch.randn(p.shape, generator=generator).to(dtype).float() for p in params]
        optimizer.zero_grad()
        torch_optimizer.zero_grad()
        pairs = zip(params, reference_params, grads, strict=True)
        for index, (param, theirs, grad) in enumerate(pairs):
            if step == 0 or index != left_out:
                param.grad, theirs.grad = grad.clone(), grad.clone()
        with writes if step == 1 else contextlib.nullcontext():
            optimizer.step()
        torch_optimizer.step()
    covered = sum(g.numel() for i, g in enumerate(grads) if i != left_out)
    assert writes.written.get("copy_") == covered
    assert writes.written.get("zero_", 0) == state.accumulator.numel() - covered
    assert "add_" not in writes.written
    expected_norm = torch.stack([g.norm() for i, g in enumerate(grads) if i != left_out]).norm()
    assert optimizer.grad_norm == pytest.approx(float(expected_norm), rel=1e-6)
    for mine, theirs in zip(params, reference_params, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
