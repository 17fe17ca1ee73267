"""The expected numerical cost of a combination, from the project's measured drift tables.

The figures are copied from three benchmark results (``benchmarks/`` is not shipped, so they
live here as data, each with its source file):

* ``benchmarks/results/master_tradeoff-2026-12-01.json`` (``bench_master_tradeoff``): a 2-layer
  GPT-2 (120,576 parameters), AdamW, 150 steps at lr 3e-4 and 3e-5, bf16 parameters; the
  relative deviation of the held-out loss from fp32 ``torch.optim``;
* ``benchmarks/results/wire_drift-2026-12-01.json`` (``bench_wire_drift``): the same model on 4
  gloo ranks as 2 shard groups of 2, 100 steps, the wire across the groups; the held-out loss's
  relative deviation from the fp32 wire (worst of 2 seeds);
* ``benchmarks/results/fp8_fidelity-2026-12-02.json`` (``bench_fp8_fidelity``): a 2-layer Llama
  (115,008 parameters), 200 steps, each fp8 recipe (emulated); the held-out loss's relative
  deviation from bf16 compute.

Each figure is the worst ``|deviation|`` over the runs (both learning rates, both seeds). The
cost of a combination is the sum of its components' figures (:func:`numerical_cost`): an
additive model, and a tiny model's, so read it as an order of magnitude that ranks
combinations, not as a forecast of a large run's loss. A component the benchmarks did not
measure (fp16 parameters or masters, a 16-bit accumulator, a 16-bit wire within the shard
group, autocast, an fp16 wire across) takes the nearest measured figure as a stand-in and is
listed in :attr:`NumericalCost.unmeasured`, so that nothing unmeasured passes as measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MEASURED", "NumericalCost", "numerical_cost"]

MASTER_TRADEOFF = "benchmarks/results/master_tradeoff-2026-12-01.json"
WIRE_DRIFT = "benchmarks/results/wire_drift-2026-12-01.json"
FP8_FIDELITY = "benchmarks/results/fp8_fidelity-2026-12-02.json"

MEASURED: Mapping[tuple[str, str], tuple[float, str]] = {
    # (component, value) -> (worst |relative held-out loss deviation|, source)
    ("master", "fp32 masters of 16-bit params"): (4.051e-05, MASTER_TRADEOFF),
    ("master", "bf16"): (5.419e-03, MASTER_TRADEOFF),
    ("master", "bf16_sr"): (8.714e-05, MASTER_TRADEOFF),
    ("master", "bf16_kahan"): (4.280e-05, MASTER_TRADEOFF),
    ("states", "bf16"): (1.220e-04, MASTER_TRADEOFF),
    ("states", "int8"): (3.438e-04, MASTER_TRADEOFF),
    ("states", "fp8"): (3.868e-04, MASTER_TRADEOFF),
    ("states", "fp8/bf16"): (2.684e-04, MASTER_TRADEOFF),
    ("wire_across", "bf16"): (1.119e-05, WIRE_DRIFT),
    ("wire_across", "int8"): (3.583e-04, WIRE_DRIFT),
    ("wire_across", "fp8"): (5.006e-06, WIRE_DRIFT),
    ("fp8", "tensorwise"): (3.787e-04, FP8_FIDELITY),
    ("fp8", "rowwise"): (3.379e-04, FP8_FIDELITY),
    ("fp8", "rowwise_with_gw_hp"): (2.699e-04, FP8_FIDELITY),
    ("fp8", "mxfp8"): (9.286e-05, FP8_FIDELITY),
}
"""The measured figures. The states rows are with fp32 masters (the row's master drift is
inside them, so they are an upper bound of the states' own)."""


@dataclass(frozen=True)
class NumericalCost:
    """A combination's expected relative deviation of the held-out loss from fp32."""

    total: float
    parts: tuple[tuple[str, float], ...]
    """Each component with its figure (the nonzero ones)."""
    unmeasured: tuple[str, ...]
    """Components whose figure is a stand-in (no benchmark measured them)."""

    def text(self) -> str:
        mark = "*" if self.unmeasured else ""
        return f"{self.total:.1e}{mark}" if self.total else f"0{mark}"


def _states(pair: str) -> tuple[float, bool]:
    if pair == "fp32":
        return 0.0, True
    if ("states", pair) in MEASURED:
        return MEASURED["states", pair][0], True
    # A pair the benchmark did not run: each moment at most as far off as both in its dtype.
    figures = [MEASURED["states", d][0] for d in pair.split("/") if d != "fp32"]
    return max(figures), False


def numerical_cost(point: Mapping[str, Any]) -> NumericalCost:
    """The cost of one combination (a point of the table, see ``enumeration.py``)."""
    parts: list[tuple[str, float]] = []
    unmeasured: list[str] = []

    def add(name: str, figure: float, measured: bool = True) -> None:
        if figure:
            parts.append((name, figure))
        if not measured:
            unmeasured.append(name)

    params, master = point["params"], point["master"]
    if master == "fp32":
        if params == "bf16":
            add("bf16 params, fp32 masters", MEASURED["master", "fp32 masters of 16-bit params"][0])
        elif params == "fp16":
            add("fp16 params", MEASURED["master", "fp32 masters of 16-bit params"][0], False)
        elif point["autocast"] != "none":
            add("autocast", MEASURED["master", "fp32 masters of 16-bit params"][0], False)
    elif master == "fp16":
        add("fp16 masters", MEASURED["master", "bf16"][0], False)
    else:
        add(f"masters {master}", MEASURED["master", master][0])
    figure, measured = _states(point["states"])
    add(f"states {point['states']}", figure, measured)
    if point["accum"] != "fp32":
        add(f"{point['accum']} accumulator", MEASURED["wire_across", "bf16"][0], False)
    if point["comm"] != "fp32":
        # A 16-bit reduction within the group rounds the partial sums as the 16-bit wire
        # across the groups does; fp32_sum adds them in fp32 (one rounding, as measured).
        add(f"{point['comm']} wire", MEASURED["wire_across", "bf16"][0], False)
    wire = point["shard_groups"].partition("_")[2]
    if wire in ("bf16", "int8", "fp8"):
        add(f"{wire} across", MEASURED["wire_across", wire][0])
    elif wire == "fp16":
        add("fp16 across", MEASURED["wire_across", "bf16"][0], False)
    if point.get("fp8"):
        add(f"fp8 {point['fp8_recipe']}", MEASURED["fp8", point["fp8_recipe"]][0])
    return NumericalCost(
        total=sum(f for _, f in parts), parts=tuple(parts), unmeasured=tuple(unmeasured)
    )
