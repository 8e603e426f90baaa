"""Predicted latency of a plan: the stripe executor replayed on a virtual clock.

`simulate(graph, plan, costs)` runs every active node's `StripeRunner` logic - the same
wavefront, the same deferral of short runs (``min_run_rows``), the same emissions - without
computing anything: each run advances its node's clock by the node's measured cost of that op
and row count, and each chunk crosses its link at the measured rate and latency. It models:

* the coordinator publishing each node's input slabs, interleaved as it does, each publish
  costing its share of `Costs.send_ms_per_mb`;
* links as resources: a node's uplink and downlink carry one chunk at a time (a node behind one
  network interface receives its input and its halos through it); the coordinator's host has
  a link of its own to each node;
* a node as one executor thread: chunks are fed in arrival order, each costing
  `DeviceProfile.message_ms`, and a feed's HALO/OUTPUT rows leave the moment they exist (with
  a pooled head a node's output leaves as one sum of C floats when its last row exists);
* the coordinator's own work before the first and after the last chunk (`Costs.pre_ms`,
  `Costs.post_ms`: preprocessing, head, publishing the result).

What it leaves out: cores shared between nodes of one host beyond what the measured costs
already contain, and Zenoh's batching. The predicted latency is compared with the measured one
in ``kaitian bench inference`` (``predicted_ms`` against ``latency_ms`` of ``ours``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .costs import COORDINATOR, Costs
from .graph import ModelGraph
from .plan import Plan
from .stripe import Wavefront


@dataclass(frozen=True)
class Prediction:
    latency_ms: float  # image at the coordinator -> fused result published
    outputs_ms: float  # ... -> last trunk-output row at the coordinator
    node_busy_ms: Mapping[str, float]  # compute + message handling per node
    node_done_ms: Mapping[str, float]  # when each node finished its last feed
    node_runs: Mapping[str, int]  # runs each node's executor makes


@dataclass(frozen=True, eq=False)
class _Sent:
    role: str
    segment: int
    consumer: str
    row_offset: int
    rows: int


class _ShadowRunner(Wavefront[_Sent]):
    """StripeRunner's wavefront computing nothing: runs cost measured time on `clock_ms`."""

    def __init__(self, graph: ModelGraph, plan: Plan, node_id: str, costs: Costs) -> None:
        profile = costs.profiles[node_id]
        super().__init__(graph, plan, node_id, min_run_rows=plan.run_rows(profile.min_run_rows))
        self._profile = profile
        self.clock_ms = 0.0
        self.busy_ms = 0.0
        self.runs = 0

    def _run(self, j: int, a: int, b: int) -> None:
        ms = self._profile.op_costs[j].ms(b - a) + self._profile.run_ms
        self.clock_ms += ms
        self.busy_ms += ms
        self.runs += 1

    def _emit(self, v: int, a: int, b: int) -> list[_Sent]:
        out: list[_Sent] = []
        if v == self._final:
            out.append(_Sent("OUTPUT", self._last_seg, COORDINATOR, a, b - a))
        for dst, seg, rng in self._targets.get(v, ()):
            lo, hi = max(a, rng[0]), min(b, rng[1])
            if lo < hi:
                out.append(_Sent("HALO", seg, dst, lo, hi - lo))
        return out

    def feed_rows(self, segment: int, lo: int, hi: int, sink: Callable[[_Sent], None]) -> None:
        self._check_expected(segment, lo, hi)
        self._arrive(segment, lo, hi)
        self._advance({self._seg_in[segment]}, sink)


def simulate(graph: ModelGraph, plan: Plan, costs: Costs) -> Prediction:
    """Predicted latency of `plan` with `costs` (see module docstring); each node defers short
    runs as its executor will (`Plan.run_rows` of its profile's `min_run_rows`)."""
    nodes = plan.active_nodes()
    runners = {n: _ShadowRunner(graph, plan, n, costs) for n in nodes}
    free: dict[tuple[str, str], float] = {}  # ("up"|"down", node) -> when that link is free
    node_free = dict.fromkeys(nodes, 0.0)
    events: list[tuple[float, int, str, int, int, int]] = []  # (t, seq, dst, segment, lo, hi)
    seq = 0
    send_ms_per_byte = costs.send_ms_per_mb / 1e6

    def send(t: float, src: str, dst: str, segment: int, lo: int, hi: int, nbytes: float) -> None:
        nonlocal seq
        link = costs.link(src, dst)
        keys = [k for k in (("up", src), ("down", dst)) if k[1] != COORDINATOR]
        start = max([t] + [free.get(k, 0.0) for k in keys])
        done = start + nbytes / link.bytes_per_ms
        for k in keys:
            free[k] = done
        seq += 1
        heapq.heappush(events, (done + link.latency_ms, seq, dst, segment, lo, hi))

    # the coordinator's input slabs, interleaved over nodes as it sends them
    c_in, _, w_in = graph.value_shapes[0]
    slab = plan.slab_rows
    batches = []
    for n in nodes:
        lo, hi = plan.input_rows_for(n)
        batches.append([(n, a, min(a + slab, hi)) for a in range(lo, hi, slab)])
    t = 0.0
    for i in range(max((len(b) for b in batches), default=0)):
        for b in batches:
            if i < len(b):
                n, a, z = b[i]
                nbytes = (z - a) * c_in * w_in  # uint8 pixels
                t += nbytes * send_ms_per_byte
                send(t, COORDINATOR, n, 0, a, z, nbytes)

    out_rows = plan.output_shape[1]
    got_rows = 0
    summed = dict.fromkeys(nodes, 0)  # a pooled head's: output rows each node has summed so far
    outputs_ms = 0.0
    while events:
        t, _, dst, segment, lo, hi = heapq.heappop(events)
        if dst == COORDINATOR:
            got_rows += hi - lo
            outputs_ms = max(outputs_ms, t)
            continue
        runner = runners[dst]
        profile = runner._profile
        runner.clock_ms = max(t, node_free[dst]) + profile.message_ms
        runner.busy_ms += profile.message_ms

        def sink(e: _Sent, src: str = dst, r: _ShadowRunner = runner) -> None:
            c, _, w = graph.value_shapes[plan.segments[e.segment].in_value] if e.role == "HALO" \
                else plan.output_shape
            lo, hi = e.row_offset, e.row_offset + e.rows
            nbytes = e.rows * c * w * 4  # float32 rows
            if e.role == "OUTPUT" and graph.pooled_head:  # one sum of the node's rows, when all exist
                summed[src] += e.rows
                lo, hi = plan.output_rows_for(src)
                if summed[src] < hi - lo:
                    return
                nbytes = c * 4
            r.clock_ms += nbytes * send_ms_per_byte
            send(r.clock_ms, src, e.consumer, e.segment, lo, hi, nbytes)

        runner.feed_rows(segment, lo, hi, sink)
        node_free[dst] = runner.clock_ms
    stuck = [n for n, r in runners.items() if not r.done]
    if stuck or got_rows != out_rows:
        raise RuntimeError(f"simulated plan did not complete: {stuck} not done, {got_rows}/{out_rows} rows")
    return Prediction(costs.pre_ms + outputs_ms + costs.post_ms, outputs_ms,
                      {n: r.busy_ms for n, r in runners.items()}, dict(node_free),
                      {n: r.runs for n, r in runners.items()})
