"""Row-stripe plan: who computes which rows of which segment, and which halo rows flow where.

Pure and deterministic: `make_plan(graph, node_ids, shares, ...)` depends on nothing else.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .graph import EMPTY, Interval, ModelGraph, intersect, iv_sub


@dataclass(frozen=True)
class CostModel:
    """Latency model used to choose segment cuts.

    Node i computes at `flops_per_ms * n_active * share_i` (the scheduler sets shares in
    proportion to speed, so the mean node runs at `flops_per_ms`). A segment costs the slowest
    node's compute; each cut adds `exchange_ms` plus the largest per-node halo transfer at
    `link_bytes_per_ms` (transfers to different nodes proceed in parallel).
    """

    flops_per_ms: float = 4.5e7  # ~ one CPU thread here: ResNet-18 trunk 3.6 GFLOP in ~80 ms
    # per cut: message latency + synchronisation with neighbours. 0.5 since session 4: at 1.0
    # the planner preferred one segment for shares like 0.43/0.14/0.43 at 128x128 (the slow
    # node rounds to no rows, the other two compute 95 % of the trunk each); at 0.5 it cuts 5
    # times and the two compute 60 %. Adaptivity benchmark: 15 (7/30/15) -> 7 (5/7/7).
    exchange_ms: float = 0.5
    link_bytes_per_ms: float = 1.0e5  # 100 MB/s (~ gigabit link)
    bytes_per_element: int = 4  # float32
    # Per-call costs the flop count misses (measured here, ResNet-18, one thread): every conv
    # call reads its whole weight tensor - with the weights prepacked once
    # (`graph.prepacked_conv`) at memory speed; before that the default CPU conv also reordered
    # them on every call, and a 1-row call of a layer4 conv cost as much as all 7 rows. Each
    # call also has a fixed Python/dispatch cost. Runs are about `run_rows` rows (the stripe
    # executor's min_run_rows). These terms decide whether the low-resolution, weight-heavy
    # tail is split at all (see `make_plan(solo_tail=...)`).
    call_ms: float = 0.05
    weight_bytes_per_ms: float = 2.0e7  # ~20 GB/s: prepacked weights (graph.prepacked_conv)
    run_rows: int = 8


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
    shares: tuple[float, ...]  # normalised, sum 1
    slab_rows: int
    segments: tuple[SegmentPlan, ...]
    input_shape: tuple[int, int, int]
    output_shape: tuple[int, int, int]
    estimated_ms: float  # cost-model latency of this plan

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

    def input_rows_for(self, node_id: str) -> tuple[int, int]:
        return self.segments[0].in_rows[self.index(node_id)]

    def output_rows_for(self, node_id: str) -> tuple[int, int]:
        return self.segments[-1].out_rows[self.index(node_id)]

    def segment_rows_for(self, node_id: str, segment: int) -> tuple[int, int]:
        return self.segments[segment].out_rows[self.index(node_id)]

    def active_nodes(self) -> tuple[str, ...]:
        return tuple(n for i, n in enumerate(self.node_ids)
                     if any(s.out_rows[i][0] < s.out_rows[i][1] for s in self.segments))

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
                   cost: CostModel) -> dict[int, float]:
    """Predicted ms of segment (a, b] (+ the exchange at a if a > 0) for every candidate a < b,
    from one backward sweep of row requirements starting at value b."""
    n_active = sum(1 for s in shares if s > 0)
    stripes = split_rows(graph.value_shapes[b][1], shares)
    need = [{b: st} for st in stripes]
    flops = [0.0] * len(shares)
    cand_set = set(cands)
    out: dict[int, float] = {}
    for j in range(b - 1, -1, -1):
        op = graph.ops[j]
        for i, nd in enumerate(need):
            rng = nd.get(j + 1, EMPTY)
            if rng[0] >= rng[1]:
                continue
            flops[i] += _len(rng) * op.flops_per_row
            w = op.needs(rng)
            for u in op.inputs:
                old = nd.get(u, EMPTY)
                nd[u] = w if old[0] >= old[1] else (min(old[0], w[0]), max(old[1], w[1]))
        a = j
        if a not in cand_set:
            continue
        seg_ms = max((f / (cost.flops_per_ms * n_active * s) for f, s in zip(flops, shares)
                      if f > 0), default=0.0)
        if a > 0:
            c, h, w_ = graph.value_shapes[a]
            own = split_rows(h, shares)
            halo = max(_len(nd.get(a, EMPTY)) - _len(intersect(nd.get(a, EMPTY), own[i]))
                       for i, nd in enumerate(need))
            if halo > 0:
                seg_ms += cost.exchange_ms + halo * c * w_ * cost.bytes_per_element / \
                    cost.link_bytes_per_ms
        out[a] = seg_ms
    return out


def _choose_cuts(graph: ModelGraph, shares: tuple[float, ...], cost: CostModel,
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
        seg = _segment_costs(graph, cands[:bi], cands[bi], shares, cost)
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


# --------------------------------------------------------------------------- make_plan
def make_plan(
    graph: ModelGraph,
    node_ids: Sequence[str],
    shares: Sequence[float],
    *,
    slab_rows: int = 8,
    cost: CostModel = CostModel(),
    max_segments: int | None = None,
    cuts: Sequence[int] | None = None,
    solo_tail: bool | None = None,
) -> Plan:
    """Plan for splitting `graph`'s trunk over `node_ids` by `shares` (>= 0, normalised).

    `cuts` (graph value indices from `graph.cut_values`) overrides the cost model's choice;
    `max_segments` bounds the number of segments it may choose.

    `solo_tail`: the segments from some cut on may run whole on the node with the largest
    share (a layer-wise split after the row stripes: late, low-resolution layers are
    weight-bound, so splitting their few rows saves little compute and costs an exchange).
    None (default): the cost model picks the cut, or none, when `cuts` is not given; True: it
    may do so even with explicit `cuts`; False: never.
    """
    ids = tuple(str(n) for n in node_ids)
    if not ids:
        raise ValueError("no nodes")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate node ids in {ids}")
    if "coordinator" in ids:
        raise ValueError("'coordinator' is reserved for the OUTPUT consumer")
    norm = normalise_shares(shares, len(ids))
    if int(slab_rows) < 1:
        raise ValueError(f"slab_rows must be >= 1, got {slab_rows}")
    if max_segments is not None and max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    if cuts is None:
        chosen, _ = _choose_cuts(graph, norm, cost, max_segments)
    else:
        bad = [c for c in cuts if c not in graph.cut_values]
        if bad:
            raise ValueError(f"cuts {bad} are not cut points; valid: {graph.cut_values}")
        chosen = sorted({int(c) for c in cuts})
    bounds = [0, *chosen, graph.output_value]
    allow_solo = (cuts is None) if solo_tail is None else bool(solo_tail)
    if not allow_solo or sum(1 for s in norm if s > 0) < 2 or len(bounds) < 3:
        segments = _build_segments(graph, ids, norm, bounds, len(bounds) - 1)
        est = _estimate(graph, segments, norm, cost)
    else:
        # try "segments from t on run whole on the fastest node" for every t (t = #segments: no
        # solo tail; the solo segments merge into one), keep the cheapest; ties -> no solo tail
        best = None
        for t in range(len(bounds) - 1, 0, -1):
            bt = bounds[:t + 1] + ([graph.output_value] if t < len(bounds) - 1 else [])
            segs = _build_segments(graph, ids, norm, bt, t)
            e = _estimate(graph, segs, norm, cost)
            if best is None or e < best[0] - 1e-9 * (1.0 + abs(e)):
                best = (e, segs)
        est, segments = best
    return Plan(ids, norm, int(slab_rows), tuple(segments), graph.input_shape,
                graph.trunk_output_shape, est)


def _build_segments(graph: ModelGraph, ids: tuple[str, ...], norm: tuple[float, ...],
                    bounds: list[int], solo_from: int) -> list[SegmentPlan]:
    """Segments between `bounds`; from segment `solo_from` on all rows go to the fastest node."""
    fastest = max(range(len(norm)), key=lambda i: (norm[i], -i))
    solo = tuple(1.0 if i == fastest else 0.0 for i in range(len(norm)))
    segments: list[SegmentPlan] = []
    prev_out: tuple[Interval, ...] = ()
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        out_rows = split_rows(graph.value_shapes[b][1], norm if k < solo_from else solo)
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


def _call_overhead(graph: ModelGraph, seg: SegmentPlan, i: int, cost: CostModel) -> float:
    """Flop-equivalent of node i's per-call costs in `seg`: fixed cost per run plus the weight
    bytes each run of a conv reads beyond what its flops already take."""
    if cost.call_ms <= 0 and cost.weight_bytes_per_ms <= 0:
        return 0.0
    rows = seg.out_rows[i]
    if rows[0] >= rows[1]:
        return 0.0
    comp, _ = graph.required_rows(seg.in_value, seg.out_value, rows)
    extra_ms = 0.0
    for v, r in comp.items():
        n = _len(r)
        if n <= 0:
            continue
        op = graph.ops[v - 1]
        calls = -(-n // max(1, cost.run_rows))
        ms = calls * cost.call_ms
        if op.window is not None and cost.weight_bytes_per_ms > 0:
            # conv weights ~ flops_per_row / (2 * W_out) elements (tiny for pools)
            wbytes = op.flops_per_row / (2.0 * op.out_shape[2]) * cost.bytes_per_element
            ms += max(0.0, calls * wbytes / cost.weight_bytes_per_ms - n * op.flops_per_row / cost.flops_per_ms)
        extra_ms += ms
    return extra_ms * cost.flops_per_ms


def _estimate(graph: ModelGraph, segments: list[SegmentPlan], shares: tuple[float, ...],
              cost: CostModel) -> float:
    n_active = sum(1 for s in shares if s > 0)
    total = 0.0
    for k, seg in enumerate(segments):
        total += max(((f + _call_overhead(graph, seg, i, cost)) / (cost.flops_per_ms * n_active * s)
                      for i, (f, s) in enumerate(zip(seg.flops, shares)) if f > 0), default=0.0)
        if k > 0 and seg.halos:
            c, _, w = graph.value_shapes[seg.in_value]
            per_dst: dict[str, int] = {}
            for h in seg.halos:
                per_dst[h.dst] = per_dst.get(h.dst, 0) + h.hi - h.lo
            total += cost.exchange_ms + max(per_dst.values()) * c * w * \
                cost.bytes_per_element / cost.link_bytes_per_ms
    return total
