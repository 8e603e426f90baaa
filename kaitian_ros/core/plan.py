"""Execution plans: who computes which rows of which segment, and which halo rows flow where.

A `PlanSpec` says everything a plan version executes - strategy, nodes, segment cuts and the
row shares of every segment - and `build_plan(graph, spec)` derives the rows, halos and input
windows from it, purely and deterministically, so every node builds the same `Plan` from the
spec the coordinator publishes. The three strategies are one shape:

* ``stripes``: every segment split by the same shares (optionally a *solo tail*: the last
  segments whole on one node);
* ``single``: one segment, one node;
* ``layerwise``: segments whole on one node each, handed on at cuts (device X runs the trunk
  up to a cut, streams the activation rows to device Y, which runs the rest).

`make_plan(graph, node_ids, shares, ...)` chooses a stripes plan's cuts and solo tail with a
cost model (`cost_model.CostModel`, flop-based priors; `cost_model.PlanCosts` for measured
per-node costs).

* Stripes. Per segment, the segment-output rows are split by cumulative share boundaries
  (round(H * cumsum(shares))), so every row is owned exactly once, stripes are contiguous in
  node order, a zero share owns nothing, and boundaries line up across resolutions.
* Segments. A segment ends at a "cut" - a value that is the only tensor crossing that point
  (between residual blocks, anywhere in a plain chain). Inside a segment a node recomputes the
  halo it needs from its own input rows (redundant work that grows with depth); at a cut it
  instead receives the halo rows from the neighbours that own them (one more exchange).
  The cost model prices both and a dynamic programme over the cut candidates picks the set of
  cuts with the lowest predicted latency.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .cost_model import CostModel, PlanCosts
from .graph import EMPTY, Interval, ModelGraph, intersect, iv_sub
from .strategy_names import STRATEGIES

# a run length no stripe reaches: a node's executor runs every op once per stripe (Plan.run_rows)
WHOLE_RUNS = 1 << 30


@dataclass(frozen=True)
class PlanSpec:
    """What a plan executes: `segment_shares[k][i]` is node i's share of segment k's output rows
    (segment k ends at `cuts[k]`, the last at the trunk output). Shares need not be normalised."""

    strategy: str
    node_ids: tuple[str, ...]
    cuts: tuple[int, ...]
    segment_shares: tuple[tuple[float, ...], ...]

    @classmethod
    def single(cls, node_id: str) -> PlanSpec:
        return cls("single", (str(node_id),), (), ((1.0,),))

    @classmethod
    def layerwise(cls, first: str, second: str, cut: int) -> PlanSpec:
        return cls("layerwise", (str(first), str(second)), (int(cut),), ((1.0, 0.0), (0.0, 1.0)))

    @classmethod
    def stripes(cls, node_ids: Sequence[str], shares: Sequence[float], cuts: Sequence[int] = (),
                solo_from: int | None = None, solo_node: int | None = None) -> PlanSpec:
        """Stripes by `shares` in every segment; with `solo_from`, segments from that index on
        run whole on node `solo_node` (default: the largest share)."""
        ids = tuple(str(n) for n in node_ids)
        norm = normalise_shares(shares, len(ids))
        segs = len(tuple(cuts)) + 1
        if solo_from is not None and solo_from < 0:
            raise ValueError(f"solo_from must be a segment index >= 0, got {solo_from}")
        if solo_node is not None and not 0 <= solo_node < len(ids):
            raise ValueError(f"solo_node must index one of {len(ids)} nodes, got {solo_node}")
        if solo_from is None or solo_from >= segs:
            rows = (norm,) * segs
        else:
            who = max(range(len(norm)), key=lambda i: (norm[i], -i)) if solo_node is None else solo_node
            solo = tuple(1.0 if i == who else 0.0 for i in range(len(norm)))
            rows = (norm,) * solo_from + (solo,) * (segs - solo_from)
        return cls("stripes", ids, tuple(int(c) for c in cuts), rows)

    def describe(self, graph: ModelGraph | None = None) -> str:
        """Short human-readable form, e.g. for a plan's `reason`."""
        def at(v: int) -> str:
            return f"value {v}" + (f" {graph.value_shapes[v]}" if graph is not None else "")

        if self.strategy == "single":
            return f"single {self.node_ids[0]}"
        if self.strategy == "layerwise":
            return " -> ".join(
                f"{self.node_ids[max(range(len(self.node_ids)), key=lambda i: row[i])]}"
                + (f" [{at(self.cuts[k])}]" if k < len(self.cuts) else "")
                for k, row in enumerate(self.segment_shares))
        first = self.segment_shares[0]
        total = sum(first) or 1.0
        text = "stripes " + "/".join(f"{n} {x / total:.2f}" for n, x in zip(self.node_ids, first))
        if self.cuts:
            text += f", cuts {','.join(map(str, self.cuts))}"
        tail = [k for k, row in enumerate(self.segment_shares) if row != first]
        if tail:
            who = self.node_ids[max(range(len(first)), key=lambda i: self.segment_shares[-1][i])]
            text += f", solo tail on {who} from segment {tail[0]}"
        return text


def same_spec(a: PlanSpec, b: PlanSpec) -> bool:
    """The same plan, up to float noise in its shares."""
    return (a.strategy == b.strategy and a.node_ids == b.node_ids and a.cuts == b.cuts
            and all(math.isclose(x, y, abs_tol=1e-9) for ra, rb in zip(a.segment_shares, b.segment_shares)
                    for x, y in zip(ra, rb)))


@dataclass(frozen=True)
class HaloTransfer:
    segment: int  # segment whose input these rows are (= rows of segment - 1's output)
    src: str
    dst: str
    lo: int
    hi: int


@dataclass(frozen=True)
class SegmentPlan:
    in_value: int  # graph value index of the segment input (0 = image)
    out_value: int  # graph value index of the segment output
    out_rows: tuple[Interval, ...]  # per node (node_ids order): output stripe, (0, 0) if none
    in_rows: tuple[Interval, ...]  # per node: input rows read, incl. halo; (0, 0) if none
    flops: tuple[float, ...]  # per node, incl. redundant halo compute inside the segment
    halos: tuple[HaloTransfer, ...]  # rows of this segment's input sent node -> node


@dataclass(frozen=True)
class Plan:
    node_ids: tuple[str, ...]
    # each node's share of the trunk's work: its segment shares weighted by segment FLOPs
    # (= the stripe shares when every segment is split alike); sums to 1
    shares: tuple[float, ...]
    slab_rows: int
    segments: tuple[SegmentPlan, ...]
    input_shape: tuple[int, int, int]
    output_shape: tuple[int, int, int]
    estimated_ms: float  # cost-model latency of this plan
    spec: PlanSpec

    @property
    def strategy(self) -> str:
        return self.spec.strategy

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def cut_values(self) -> tuple[int, ...]:
        return tuple(s.out_value for s in self.segments[:-1])

    def index(self, node_id: str) -> int:
        try:
            return self.node_ids.index(node_id)
        except ValueError:
            raise ValueError(f"node {node_id!r} is not in the plan {self.node_ids}") from None

    @property
    def whole_image(self) -> bool:
        """The coordinator sends each node its input rows in one piece, not in slabs."""
        return self.slab_rows >= self.input_shape[1]

    def run_rows(self, streamed_run_rows: int) -> int:
        """The shortest run a node's executor computes while rows next to it are still to come
        (`stripe.Wavefront`): `streamed_run_rows` (the node's `min_run_rows`) while slabs stream
        in, and one run per op and stripe for a whole image. Then the only rows still to come
        are halos from a neighbour, which arrive within a few ms; computing the interior rows
        first split every op after a cut into two calls, and in MobileNetV2's many small ops
        that cost more than the wait (docs/planner.md, "A whole image runs every op once per stripe")."""
        return WHOLE_RUNS if self.whole_image else streamed_run_rows

    def input_rows_for(self, node_id: str) -> tuple[int, int]:
        return self.segments[0].in_rows[self.index(node_id)]

    def output_rows_for(self, node_id: str) -> tuple[int, int]:
        return self.segments[-1].out_rows[self.index(node_id)]

    def segment_rows_for(self, node_id: str, segment: int) -> tuple[int, int]:
        return self.segments[segment].out_rows[self.index(node_id)]

    def active_nodes(self) -> tuple[str, ...]:
        return tuple(n for i, n in enumerate(self.node_ids)
                     if any(s.out_rows[i][0] < s.out_rows[i][1] for s in self.segments))

    def feeder_nodes(self) -> tuple[str, ...]:
        """Active nodes that own no output rows: a layer-wise plan's first device, a stripes
        plan's nodes before a solo tail. The rows others owe may be waiting for them."""
        return tuple(n for n in self.active_nodes() if (rows := self.output_rows_for(n))[0] >= rows[1])

    def flops_for(self, node_id: str) -> float:
        i = self.index(node_id)
        return float(sum(s.flops[i] for s in self.segments))

    def halo_sources(self, node_id: str, segment: int) -> tuple[HaloTransfer, ...]:
        """Halo rows `node_id` receives for `segment`'s input."""
        return tuple(h for h in self.segments[segment].halos if h.dst == node_id)

    def halo_targets(self, node_id: str, segment: int) -> tuple[HaloTransfer, ...]:
        """Halo rows `node_id` sends for `segment`'s input (rows of its segment-1 output)."""
        return tuple(h for h in self.segments[segment].halos if h.src == node_id)


# --------------------------------------------------------------------------- helpers
def normalise_shares(shares: Sequence[float], n: int) -> tuple[float, ...]:
    if len(shares) != n:
        raise ValueError(f"got {len(shares)} shares for {n} nodes")
    vals = []
    for s in shares:
        try:
            f = float(s)
        except (TypeError, ValueError):
            raise ValueError(f"share {s!r} is not a number") from None
        if math.isnan(f) or math.isinf(f):
            raise ValueError(f"share {s!r} is not finite")
        if f < 0:
            raise ValueError(f"share {f} is negative")
        vals.append(f)
    total = math.fsum(vals)
    if total <= 0:
        raise ValueError("all shares are zero")
    return tuple(v / total for v in vals)


def split_rows(h: int, shares: Sequence[float]) -> tuple[Interval, ...]:
    """Contiguous stripes of [0, h) in node order from cumulative share boundaries."""
    out: list[Interval] = []
    cum, prev = 0.0, 0
    for i, s in enumerate(shares):
        cum += s
        b = h if i == len(shares) - 1 else min(h, math.floor(h * cum + 0.5))
        b = max(b, prev)
        out.append((prev, b) if b > prev else EMPTY)
        prev = b
    return tuple(out)


def _len(iv: Interval) -> int:
    return max(0, iv[1] - iv[0])


def _segment_costs(graph: ModelGraph, cands: list[int], b: int, shares: tuple[float, ...],
                   costs: PlanCosts) -> dict[int, float]:
    """Predicted ms of segment (a, b] (+ the exchange at a if a > 0) for every candidate a < b,
    from one backward sweep of row requirements starting at value b."""
    stripes = split_rows(graph.value_shapes[b][1], shares)
    need = [{b: st} for st in stripes]
    busy = [0.0] * len(shares)
    cand_set = set(cands)
    out: dict[int, float] = {}
    for j in range(b - 1, -1, -1):
        op = graph.ops[j]
        for i, nd in enumerate(need):
            rng = nd.get(j + 1, EMPTY)
            if rng[0] >= rng[1]:
                continue
            busy[i] += costs.op_ms(i, j, _len(rng))
            w = op.needs(rng)
            for u in op.inputs:
                old = nd.get(u, EMPTY)
                nd[u] = w if old[0] >= old[1] else (min(old[0], w[0]), max(old[1], w[1]))
        a = j
        if a not in cand_set:
            continue
        seg_ms = max(busy, default=0.0)
        if a > 0:
            c, h, w_ = graph.value_shapes[a]
            own = split_rows(h, shares)
            row_bytes = c * w_ * 4
            seg_ms += max((costs.transfer_ms(src, dst, _len(intersect(nd.get(a, EMPTY), own[src])) * row_bytes)
                           for dst, nd in enumerate(need) for src in range(len(shares))
                           if src != dst and _len(intersect(nd.get(a, EMPTY), own[src])) > 0), default=0.0)
        out[a] = seg_ms
    return out


def choose_cuts(graph: ModelGraph, shares: tuple[float, ...], costs: PlanCosts,
                 max_segments: int | None) -> tuple[list[int], float]:
    cands = [0, *graph.cut_values, graph.output_value]
    nc = len(cands)
    kmax = nc - 1 if max_segments is None else max(1, min(max_segments, nc - 1))
    inf = float("inf")
    # best[bi][k]: least cost to produce value cands[bi] with k segments; back-pointers in arg.
    best = [[inf] * (kmax + 1) for _ in range(nc)]
    arg = [[-1] * (kmax + 1) for _ in range(nc)]
    best[0][0] = 0.0
    for bi in range(1, nc):
        seg = _segment_costs(graph, cands[:bi], cands[bi], shares, costs)
        for ai in range(bi):
            c = seg[cands[ai]]
            for k in range(1, kmax + 1):
                v = best[ai][k - 1] + c
                # strictly better beyond float noise: ties keep the longer first segment
                if v < best[bi][k] - 1e-9 * (1.0 + abs(v)):
                    best[bi][k], arg[bi][k] = v, ai
    # fewest segments among the (near-)optimal: equal cost means the extra cuts buy nothing
    low = min(best[nc - 1][1:])
    k = next(kk for kk in range(1, kmax + 1) if best[nc - 1][kk] <= low + 1e-9 * (1.0 + low))
    total = best[nc - 1][k]
    cuts: list[int] = []
    bi = nc - 1
    while bi > 0:
        ai = arg[bi][k]
        cuts.append(cands[ai])
        bi, k = ai, k - 1
    return sorted(c for c in cuts if c > 0), total


# --------------------------------------------------------------------------- plans
def build_plan(graph: ModelGraph, spec: PlanSpec, *, slab_rows: int = 8, estimated_ms: float = 0.0) -> Plan:
    """The plan `spec` describes (ValueError saying what is wrong with a spec that does not fit
    `graph`). Pure: every node derives the same plan from the same spec."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {spec.strategy!r} (one of {', '.join(STRATEGIES)})")
    ids = tuple(str(n) for n in spec.node_ids)
    if not ids or any(not n for n in ids):
        raise ValueError("a plan needs non-empty node ids")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate node ids in {ids}")
    if "coordinator" in ids:
        raise ValueError("'coordinator' is reserved for the OUTPUT consumer")
    if int(slab_rows) < 1:
        raise ValueError(f"slab_rows must be >= 1, got {slab_rows}")
    cuts = tuple(int(c) for c in spec.cuts)
    bad = [c for c in cuts if c not in graph.cut_values]
    if bad:
        raise ValueError(f"cuts {bad} are not cut points; valid: {graph.cut_values}")
    if list(cuts) != sorted(set(cuts)):
        raise ValueError(f"cuts {list(cuts)} must be strictly increasing")
    if len(spec.segment_shares) != len(cuts) + 1:
        raise ValueError(f"{len(cuts)} cuts make {len(cuts) + 1} segments, got shares for "
                         f"{len(spec.segment_shares)}")
    norms = tuple(normalise_shares(row, len(ids)) for row in spec.segment_shares)
    owners = [tuple(i for i, x in enumerate(row) if x > 0) for row in norms]
    if spec.strategy == "single" and (len(ids) != 1 or cuts):
        raise ValueError(f"a single plan runs one segment on one node, got {len(ids)} nodes and cuts {list(cuts)}")
    if spec.strategy == "layerwise" and (any(len(o) != 1 for o in owners) or
                                         any(a == b for a, b in itertools.pairwise(owners))):
        raise ValueError("a layer-wise plan runs each segment whole on one node, another than the previous one")
    bounds = [0, *cuts, graph.output_value]
    segments = _build_segments(graph, ids, norms, bounds)
    seg_flops = [sum(graph.ops[j].flops_per_row * graph.ops[j].out_shape[1] for j in range(a, b))
                 for a, b in itertools.pairwise(bounds)]
    total = math.fsum(seg_flops)
    if total > 0:
        work = [math.fsum(n[i] * f for n, f in zip(norms, seg_flops)) / total for i in range(len(ids))]
    else:
        work = list(norms[0])
    norm_spec = PlanSpec(spec.strategy, ids, cuts, norms)
    return Plan(ids, tuple(work), int(slab_rows), tuple(segments), graph.input_shape,
                graph.trunk_output_shape, float(estimated_ms), norm_spec)


def make_plan(
    graph: ModelGraph,
    node_ids: Sequence[str],
    shares: Sequence[float],
    *,
    slab_rows: int = 8,
    cost: CostModel | PlanCosts = CostModel(),
    max_segments: int | None = None,
    cuts: Sequence[int] | None = None,
    solo_tail: bool | None = None,
) -> Plan:
    """Stripes plan for splitting `graph`'s trunk over `node_ids` by `shares` (>= 0, normalised).

    `cost`: a `CostModel` prior (node speeds taken from the shares) or measured `PlanCosts`
    (node index = position in `node_ids`). `cuts` (graph value indices from `graph.cut_values`)
    overrides the cost model's choice; `max_segments` bounds the number of segments it may choose.

    `solo_tail`: the segments from some cut on may run whole on the fastest node (a layer-wise
    split after the row stripes: late, low-resolution layers are weight-bound, so splitting their
    few rows saves little compute and costs an exchange). None (default): the cost model picks
    the cut, or none, when `cuts` is not given; True: it may do so even with explicit `cuts`;
    False: never.
    """
    ids = tuple(str(n) for n in node_ids)
    if not ids:
        raise ValueError("no nodes")
    norm = normalise_shares(shares, len(ids))
    if max_segments is not None and max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    costs = cost.bind(graph, norm) if isinstance(cost, CostModel) else cost
    if cuts is None:
        chosen, _ = choose_cuts(graph, norm, costs, max_segments)
    else:
        bad = [c for c in cuts if c not in graph.cut_values]
        if bad:
            raise ValueError(f"cuts {bad} are not cut points; valid: {graph.cut_values}")
        chosen = sorted({int(c) for c in cuts})
    allow_solo = (cuts is None) if solo_tail is None else bool(solo_tail)
    active = [i for i, s in enumerate(norm) if s > 0]
    specs = [PlanSpec.stripes(ids, norm, chosen)]
    if allow_solo and len(active) >= 2 and chosen:
        # "segments from t on run whole on the fastest node" for every t; the solo segments
        # merge into one
        fastest = min(active, key=lambda i: (sum(costs.op_ms(i, j, op.out_shape[1])
                                                 for j, op in enumerate(graph.ops)), -norm[i], i))
        for t in range(len(chosen), 0, -1):
            specs.append(PlanSpec.stripes(ids, norm, chosen[:t], solo_from=t, solo_node=fastest))
    best: tuple[float, Plan] | None = None
    for spec in specs:  # ties keep the earlier: no solo tail, then the longer split front
        plan = build_plan(graph, spec, slab_rows=slab_rows)
        e = estimate_ms(graph, plan, costs)
        if best is None or e < best[0] - 1e-9 * (1.0 + abs(e)):
            best = (e, plan)
    assert best is not None  # specs holds at least the plain stripes
    e, plan = best
    return replace(plan, estimated_ms=e)


def _build_segments(graph: ModelGraph, ids: tuple[str, ...], norms: tuple[tuple[float, ...], ...],
                    bounds: list[int]) -> list[SegmentPlan]:
    """Segments between `bounds`, segment k's rows split by `norms[k]`."""
    segments: list[SegmentPlan] = []
    prev_out: tuple[Interval, ...] = ()
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        out_rows = split_rows(graph.value_shapes[b][1], norms[k])
        in_rows, flops = [], []
        for st in out_rows:
            comp, need = graph.required_rows(a, b, st)
            in_rows.append(need if need[0] < need[1] else EMPTY)
            flops.append(float(sum(_len(r) * graph.ops[v - 1].flops_per_row
                                   for v, r in comp.items())))
        halos: list[HaloTransfer] = []
        if k > 0:
            for i, dst in enumerate(ids):
                missing = iv_sub([in_rows[i]], prev_out[i]) if in_rows[i] != EMPTY else []
                for j, src in enumerate(ids):
                    if j == i:
                        continue
                    for iv in missing:
                        lo, hi = intersect(iv, prev_out[j])
                        if lo < hi:
                            halos.append(HaloTransfer(k, src, dst, lo, hi))
        segments.append(SegmentPlan(a, b, out_rows, tuple(in_rows), tuple(flops), tuple(halos)))
        prev_out = out_rows
    return segments


def estimate_ms(graph: ModelGraph, plan: Plan, costs: PlanCosts) -> float:
    """Cost-model latency of `plan`: per segment the busiest node's compute, plus the slowest
    halo transfer at each cut (no overlap assumed; the simulator models the streaming)."""
    total = 0.0
    for k, seg in enumerate(plan.segments):
        busy = 0.0
        for i in range(len(plan.node_ids)):
            rows = seg.out_rows[i]
            if rows[0] >= rows[1]:
                continue
            comp, _ = graph.required_rows(seg.in_value, seg.out_value, rows)
            busy = max(busy, sum(costs.op_ms(i, v - 1, _len(r)) for v, r in comp.items() if _len(r) > 0))
        total += busy
        if k > 0 and seg.halos:
            c, _, w = graph.value_shapes[seg.in_value]
            idx = {n: i for i, n in enumerate(plan.node_ids)}
            pair: dict[tuple[int, int], int] = {}
            for h in seg.halos:
                key = (idx[h.src], idx[h.dst])
                pair[key] = pair.get(key, 0) + h.hi - h.lo
            total += max(costs.transfer_ms(s, d, r * c * w * 4) for (s, d), r in pair.items())
    return total
