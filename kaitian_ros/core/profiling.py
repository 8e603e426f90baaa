"""Start-up cost measurement: every trunk op timed as the stripe executor calls it.

`measure_profile` runs each op on row windows of a few sizes as `StripeRunner._run` runs
a streamed run - a window op's input rows copied first, as a run reading rows of two pieces
copies them - and fits `OpCost` per op. The whole trunk is timed too. A time
budget bounds it; ops left unmeasured when it runs out get their full-map time per row.
`probe` times a few ops again later (idle devices still notice that they got faster or slower).

Times come from the `clock` the caller passes (the compute node's device clock), times the
emulated slowdown, which is how the node applies it: a device s times slower has its rows s
times later.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from .costs import OpCost, fit_op_cost
from .graph import ModelGraph, window_rows

PROBE_MS = 1.0  # about what the probe op should take (see `measure_profile`)


@dataclass(frozen=True)
class MeasuredCosts:
    op_costs: tuple[OpCost, ...]
    trunk_ms: float
    run_ms: float  # the stripe executor's bookkeeping per run (slowdown included)
    probe_ops: tuple[int, ...]  # the consecutive ops `probe` times, whole maps
    probe_base_ms: float  # their measured time (slowdown included) at start-up
    elapsed_s: float

    def scaled(self, factor: float) -> MeasuredCosts:
        """These costs on a device `factor` times slower (every time here is linear in the
        emulated slowdown: `measure_profile` at slowdown s equals this at 1.0, scaled by s)."""
        return MeasuredCosts(tuple(c.scaled(factor) for c in self.op_costs), self.trunk_ms * factor,
                             self.run_ms * factor, self.probe_ops, self.probe_base_ms * factor, self.elapsed_s)


def _sync(graph: ModelGraph) -> None:
    if graph.device.type == "cuda":
        torch.cuda.synchronize(graph.device)


def _values(graph: ModelGraph, n: int) -> list[torch.Tensor]:
    """Every trunk value of one random image, whole (inputs for the timed calls)."""
    x = torch.randn(n, *graph.input_shape, device=graph.device).contiguous(
        memory_format=graph.activation_format)
    vals = [x]
    with torch.no_grad():
        for j, op in enumerate(graph.ops):
            vals.append(_call(graph, vals, j, 0, op.out_shape[1]))
    return vals


def _call(graph: ModelGraph, vals: list[torch.Tensor], j: int, a: int, b: int, *,
          streamed: bool = False) -> torch.Tensor:
    """Output rows [a, b) of op j from whole inputs, the way the stripe executor computes them.
    With `streamed`, a window op first copies its input rows, as a streamed run does that reads
    rows of two pieces (the rows its previous run left and the newly arrived ones)."""
    op = graph.ops[j]
    fmt = graph.activation_format
    if op.window is None:
        y = op.run([vals[u][:, :, a:b] for u in op.inputs], a, b)
    elif streamed:
        first, stop, top, bottom = op.window.input_rows(a, b)
        y = op.run_border(vals[op.inputs[0]][:, :, first:stop].clone(memory_format=fmt), top, bottom, a, b)
    else:
        y = window_rows(op, vals[op.inputs[0]], a, b)
    return y.contiguous(memory_format=fmt)


def _row_counts(h: int) -> list[int]:
    return sorted({h, max(1, h // 2), max(1, h // 4), max(1, h // 8), min(h, 8)})


def measure_profile(graph: ModelGraph, clock: Callable[[], float], *, slowdown: float = 1.0,
                    reps: int = 3, budget_s: float = 10.0, batch: int = 1
                    ) -> tuple[MeasuredCosts, list[torch.Tensor | None]]:
    """Time every op at several row counts (median of `reps`), within about `budget_s`; also
    returns the inputs `probe` needs."""
    t_start = time.monotonic()
    with torch.no_grad():
        vals = _values(graph, batch)
        _sync(graph)
        samples: list[list[tuple[int, float]]] = [[] for _ in graph.ops]
        trunk = []
        for _ in range(reps):  # whole trunk, as `run_ops` runs it (warms every kernel up too)
            c0 = clock()
            graph.run_ops(vals[0])
            _sync(graph)
            trunk.append((clock() - c0) * 1e3)
        for j, op in enumerate(graph.ops):
            h = op.out_shape[1]
            for rows in _row_counts(h):
                if time.monotonic() - t_start > budget_s and samples[j]:
                    break
                a = max(0, (h - rows) // 2)  # a window in the middle: no border rows
                times = []
                for _ in range(reps + 1):
                    c0 = clock()
                    _call(graph, vals, j, a, a + rows, streamed=True)
                    _sync(graph)
                    times.append((clock() - c0) * 1e3)
                samples[j].append((rows, statistics.median(times[1:])))  # first: kernel warm-up
        costs = tuple(fit_op_cost(s).scaled(slowdown) for s in samples)
        # the probe: consecutive ops from the middle of the trunk, whole maps, until they take
        # PROBE_MS (long enough that timer and cache noise stay small, short enough to run
        # often); its reference time is taken the way later probes take theirs
        full = [c.ms(op.out_shape[1]) / slowdown for c, op in zip(costs, graph.ops)]
        first = last = len(graph.ops) // 2
        while last < len(graph.ops) and sum(full[first:last]) < PROBE_MS:
            last += 1
        while first > 0 and sum(full[first:last]) < PROBE_MS:
            first -= 1
        probe_ops = tuple(range(first, last))
        keep = {u for j in probe_ops for u in graph.ops[j].inputs}
        inputs = [vals[u] if u in keep else None for u in range(len(vals))]
    run_ms = executor_run_ms(graph, costs, clock) * slowdown
    measured = MeasuredCosts(costs, statistics.median(trunk) * slowdown, run_ms, probe_ops, 0.0, 0.0)
    base = statistics.median(probe(graph, measured, clock, slowdown, inputs) for _ in range(5))
    return MeasuredCosts(costs, measured.trunk_ms, run_ms, probe_ops, base, time.monotonic() - t_start), inputs


def executor_run_ms(graph: ModelGraph, op_costs: tuple[OpCost, ...], clock: Callable[[], float],
                    slab_rows: int = 8, reps: int = 3) -> float:
    """The stripe executor's own cost per run - finding runs, interval bookkeeping, routing
    emissions - which the op timings above do not contain: a single-node plan in small slabs
    replayed by the simulator's shadow runner, which does that bookkeeping and nothing else."""
    from .costs import Costs, DeviceProfile, LinkEstimate
    from .plan import PlanSpec, build_plan
    from .simulate import simulate

    profile = DeviceProfile("probe", 0, "", "", 1.0, op_costs, 1.0, 0.0, min_run_rows=slab_rows)
    costs = Costs({"probe": profile}, {}, LinkEstimate(1e9, 0.0), slab_rows=slab_rows)
    plan = build_plan(graph, PlanSpec.single("probe"), slab_rows=slab_rows)
    times, runs = [], 1
    for _ in range(reps):
        c0 = clock()
        runs = simulate(graph, plan, costs).node_runs["probe"]
        times.append((clock() - c0) * 1e3)
    return min(times) / max(1, runs)


def probe(graph: ModelGraph, measured: MeasuredCosts, clock: Callable[[], float], slowdown: float,
          inputs: list[torch.Tensor | None], reps: int = 3) -> float:
    """Time `measured.probe_ops` again: the fastest of `reps` passes after one untimed pass (ms,
    slowdown included). After idling, a first call is 2-5x slower here (cold caches) and the
    next ones up to 1.5x: the warm-up pass and the minimum keep that out of the comparison.
    `inputs` are the whole values the ops read (as `measure_profile` returns them)."""
    assert all(inputs[u] is not None for j in measured.probe_ops for u in graph.ops[j].inputs)
    vals = cast("list[torch.Tensor]", inputs)  # None only at values no probe op reads
    with torch.no_grad():
        times = []
        for k in range(reps + 1):
            c0 = clock()
            for j in measured.probe_ops:
                _call(graph, vals, j, 0, graph.ops[j].out_shape[1])
            _sync(graph)
            if k:
                times.append((clock() - c0) * 1e3)
        return min(times) * slowdown
