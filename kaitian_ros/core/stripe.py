"""Incremental wavefront executor for one node's stripe of one request.

A `StripeRunner` keeps, per trunk value it touches, the rows it computed or received as
immutable pieces (`RowPieces`): a run's result and a fed slab are kept as they are, and rows
are only copied where an op reads across pieces (or adds border padding) - not into a
value-wide buffer on every partial run (docs/architecture-core.md has the measurements).
Every `feed` of rows (image slabs from the coordinator, halo rows from neighbours) computes,
op by op in topological order, every not-yet-computed row whose input window is now fully
available - in maximal contiguous runs, so each row of each op is computed exactly once and
convs see as many rows per call as have arrived. Own segment-k output rows are immediately
segment k+1 input; rows neighbours need are emitted as HALO, rows of the last segment as
OUTPUT, as soon as they exist.

With an `emit` callback each emission is handed on the moment its rows exist, not at the end
of the feed: a HALO computed early in a feed travels while the node computes the rest.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from .graph import ModelGraph, TrunkOp, memory_format_of
from .intervals import EMPTY, Interval, intersect, iv_add, iv_intersect, iv_sub
from .plan import WHOLE_RUNS, Plan

COORDINATOR = "coordinator"
DEFAULT_MIN_RUN_ROWS = 8


@dataclass(frozen=True, eq=False)
class Emission:
    role: str  # "HALO" or "OUTPUT" ("OUTPUT_SUM": a node's sum of its OUTPUT rows, `core.pooled`)
    segment: int  # HALO: segment whose input these rows are; OUTPUT: last segment
    consumer: str  # node id, or "coordinator" for OUTPUT
    row_offset: int
    rows: Tensor  # (N, C, r, W), contiguous, owned by the receiver


class RowPieces:
    """The rows of one trunk value a runner holds, as disjoint, immutable row pieces, each a
    (N, C, r, W) tensor in the graph's activation format: a run's result or a fed slab is kept
    as it is, and rows are copied only where a read spans pieces or adds border padding.
    Nothing is written into a piece after it is added, so a piece may be a view of another.

    Copying every partial run's result into one buffer per value read through windows
    (reads then are views) measured slower for MobileNetV2 (streamed single-node trunk 320x240:
    5 % more compute than pieces in slabs of 64 rows, 11 % in slabs of 16) and within noise for
    ResNet-18 at 224 (+-3 %), interleaved in one process on the development machine.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._pieces: list[tuple[int, int, Tensor]] = []
        self.nbytes = 0  # of the pieces as added (a piece that is a view of another counts again)

    def add(self, lo: int, hi: int, rows: Tensor) -> None:
        k = bisect.bisect_left(self._starts, lo)
        self._starts.insert(k, lo)
        self._pieces.insert(k, (lo, hi, rows))
        self.nbytes += rows.numel() * rows.element_size()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (t for _, _, t in self._pieces)

    def read(self, lo: int, hi: int, top: int = 0, bottom: int = 0, fill: float = 0.0) -> Tensor:
        """Rows [lo, hi) with `top`/`bottom` rows of `fill` around them (padding at the image
        border): a view when one piece holds them and no padding is asked for, else one copy.
        Rows of [lo, hi) no piece holds are zeros: a strided 1x1 conv reads every other row of
        its window, and the plan sends only those."""
        k = max(0, bisect.bisect_right(self._starts, lo) - 1)
        a, b, t = self._pieces[k]
        if top <= 0 and bottom <= 0 and a <= lo and hi <= b:
            # a whole piece as it is: slicing a tensor costs microseconds, read per op and run
            return t if a == lo and b == hi else t[:, :, lo - a:hi - a]
        n, c, _, w = t.shape
        out = torch.empty((n, c, top + (hi - lo) + bottom, w), dtype=t.dtype, device=t.device,
                          memory_format=memory_format_of(t))
        if top > 0:
            out[:, :, :top].fill_(fill)
        row = lo  # rows before it are written
        for a, b, t in self._pieces[k:]:
            if a >= hi:
                break
            r0, r1 = max(a, lo), min(b, hi)
            if r0 < r1:
                if r0 > row:
                    out[:, :, top + row - lo:top + r0 - lo].zero_()
                out[:, :, top + r0 - lo:top + r1 - lo].copy_(t[:, :, r0 - a:r1 - a])
                row = r1
        if row < hi:
            out[:, :, top + row - lo:top + hi - lo].zero_()
        if bottom > 0:
            out[:, :, top + hi - lo:].fill_(fill)
        return out


def _contains(ivs: list[Interval], row: int) -> bool:
    return any(a <= row < b for a, b in ivs)


_E = TypeVar("_E")


class Wavefront(Generic[_E]):
    """The row bookkeeping and wavefront of `StripeRunner`, generic in what a run hands on:
    subclasses say what a run computes (`_compute`) and what its rows emit (`_emit`)."""

    def __init__(self, graph: ModelGraph, plan: Plan, node_id: str, *,
                 min_run_rows: int = DEFAULT_MIN_RUN_ROWS,
                 on_run: Callable[[int, int, float], None] | None = None) -> None:
        self.graph, self.plan, self.node_id = graph, plan, node_id
        self.on_run = on_run  # (op, rows, seconds) of every run: live cost measurements
        self.min_run_rows = max(1, int(min_run_rows))
        me = plan.index(node_id)
        nv = graph.num_values
        self._comp: list[Interval] = [EMPTY] * nv  # rows this node computes, per value
        self._expect: list[list[Interval]] = [[] for _ in range(nv)]  # rows still to receive
        self._seg_in: list[int] = [s.in_value for s in plan.segments]
        self._targets: dict[int, list[tuple[str, int, Interval]]] = {}  # value -> halo targets
        last = plan.num_segments - 1
        for k, seg in enumerate(plan.segments):
            comp, _ = graph.required_rows(seg.in_value, seg.out_value, seg.out_rows[me])
            for v, r in comp.items():
                self._comp[v] = r if r[0] < r[1] else EMPTY
            need = seg.in_rows[me]
            own_in = EMPTY if k == 0 else plan.segments[k - 1].out_rows[me]
            self._expect[seg.in_value] = iv_sub([need], own_in) if need[0] < need[1] else []
            if k > 0:
                self._targets[seg.in_value] = [(h.dst, k, (h.lo, h.hi))
                                               for h in plan.halo_targets(node_id, k)]
        self._final = graph.output_value
        self._last_seg = last
        self._remaining: list[list[Interval]] = [
            [self._comp[v]] if self._comp[v][0] < self._comp[v][1] else [] for v in range(nv)]
        self._avail: list[list[Interval]] = [[] for _ in range(nv)]
        self._ops = [j for j in range(len(graph.ops)) if self._remaining[j + 1]]
        self._run_min = [self._shortest_run(plan, r) for r in self._comp]
        # one segment: every input row comes from the coordinator, none from a neighbour, so
        # once all of them are here before any run, each op's rows run in one call, in order
        # (`_run_straight`)
        self._straight = plan.num_segments == 1
        self._n: int | None = None  # the batch size of the first rows fed
        self._stats = {"rows_computed": 0, "runs": 0, "compute_s": 0.0, "rows_in": 0,
                       "halo_rows_in": 0, "halo_rows_out": 0, "output_rows": 0, "feeds": 0,
                       "flops_planned": plan.flops_for(node_id)}

    def _shortest_run(self, plan: Plan, rows: Interval) -> int:
        """The shortest run of a value's `rows` (this node's) computed while rows next to it
        are still to come. In a one-segment plan every row comes in the coordinator's slabs:
        an op with fewer rows than `min_run_rows` would wait for the last slab (ResNet-18 at
        224: layers 2-4, 28, 14 and 7 rows, two thirds of the trunk, ran only after the whole
        image had crossed the link), so a run of half the op's rows goes at once - at most
        one more call per op. Behind a cut, halos arrive at many places and halves fragment
        the runs (up to +45 % compute for the stripes of 2- and 3-way splits, docs/planner.md)."""
        if plan.num_segments > 1 or self.min_run_rows >= WHOLE_RUNS:
            return self.min_run_rows
        return min(self.min_run_rows, max(1, -(-(rows[1] - rows[0]) // 2)))

    # ------------------------------------------------------------------ public
    @property
    def done(self) -> bool:
        return not any(self._remaining[j + 1] for j in self._ops)

    def expected_rows(self, segment: int) -> list[Interval]:
        """Rows of `segment`'s input still to be received (image rows for segment 0)."""
        return list(self._expect[self._seg_in[segment]])

    def stats(self) -> dict:
        return dict(self._stats)

    def _check_expected(self, segment: int, lo: int, hi: int) -> None:
        exp = self._expect[self._seg_in[segment]]
        if not any(a <= lo and hi <= b for a, b in exp):
            raise ValueError(f"node {self.node_id}: rows [{lo},{hi}) of segment {segment} not "
                             f"expected (still expecting {exp})")

    def _arrive(self, segment: int, lo: int, hi: int) -> None:
        v = self._seg_in[segment]
        self._expect[v] = iv_sub(self._expect[v], (lo, hi))
        self._avail[v] = iv_add(self._avail[v], (lo, hi))
        self._stats["rows_in" if segment == 0 else "halo_rows_in"] += hi - lo
        self._stats["feeds"] += 1

    # ------------------------------------------------------------------ internals
    def _advance(self, changed: set[int], sink: Callable[[_E], None]) -> None:
        if self._straight and not self._expect[self._seg_in[0]]:
            self._run_straight(sink)
            return
        ops = self.graph.ops
        for j in self._ops:
            v = j + 1
            rem = self._remaining[v]
            if not rem:
                continue
            op = ops[j]
            if not any(u in changed for u in op.inputs):
                continue  # nothing new to compute from
            cov: list[Interval] | None = None
            for u in op.inputs:
                cu: list[Interval] = []
                for iv in self._avail[u]:
                    cu = iv_add(cu, op.covered(iv))
                cov = cu if cov is None else iv_intersect(cov, cu)
            runs = iv_intersect(rem, cov or [])
            for a, b in runs:
                if b - a < self._run_min[v] and (_contains(rem, a - 1) or _contains(rem, b)):
                    continue  # more rows next to this run are coming: compute them together
                self._compute(j, a, b)
                self._straight = False  # some rows are computed: the rest as the wavefront goes
                changed.add(v)
                for e in self._emit(v, a, b):
                    sink(e)
                if not self._remaining[v]:
                    self._finished(j)

    def _run_straight(self, sink: Callable[[_E], None]) -> None:
        """All of a one-segment plan's input is here and nothing is computed yet: each op's rows
        in one run, in topological order - the runs `_advance` would make, without working
        out per op which rows its inputs now cover and with each value's rows set once instead
        of through the interval algebra (for MobileNetV2's 62 ops that bookkeeping cost ~1 ms
        of a 25 ms trunk, docs/architecture-core.md). The path of every single-device request."""
        for j in self._ops:
            v = j + 1
            a, b = self._comp[v]
            self._run(j, a, b)
            self._avail[v], self._remaining[v] = [(a, b)], []
            for e in self._emit(v, a, b):
                sink(e)
            self._finished(j)

    def _compute(self, j: int, a: int, b: int) -> None:
        """Run op `j` on rows [a, b) and mark them available and done."""
        self._run(j, a, b)
        v = j + 1
        self._avail[v] = iv_add(self._avail[v], (a, b))
        self._remaining[v] = iv_sub(self._remaining[v], (a, b))

    def _finished(self, j: int) -> None:
        """Op `j` has all its rows and emitted them (the subclass's: what that frees)."""

    def _run(self, j: int, a: int, b: int) -> None:
        """What a run of op `j` on rows [a, b) does (the subclass's): compute them, or cost them."""
        raise NotImplementedError

    def _emit(self, v: int, a: int, b: int) -> list[_E]:
        raise NotImplementedError


class StripeRunner(Wavefront[Emission]):
    """Executes `node_id`'s part of `plan` for one request (see module docstring).

    `min_run_rows`: a run shorter than this is deferred while rows next to it are still to
    come (they will arrive - the plan guarantees every needed row), trading a little latency
    for fewer, larger torch calls. 1 = fully eager. Measured (ResNet-18 224, one thread): a
    1-2 row conv call costs ~1.5x per row of a 56-row call, so the default batches a little.
    """

    def __init__(self, graph: ModelGraph, plan: Plan, node_id: str, *,
                 min_run_rows: int = DEFAULT_MIN_RUN_ROWS,
                 on_run: Callable[[int, int, float], None] | None = None) -> None:
        super().__init__(graph, plan, node_id, min_run_rows=min_run_rows, on_run=on_run)
        self._rows = [RowPieces() for _ in range(graph.num_values)]
        self._format = graph.activation_format
        self._held = 0
        # this node's ops that read each value: once they all have their rows, nothing reads it
        # (here, not in Wavefront: the planner's simulator replays plans without rows to free)
        self._readers: list[list[int]] = [[] for _ in range(graph.num_values)]
        for j in self._ops:
            for u in graph.ops[j].inputs:
                self._readers[u].append(j)

    @property
    def held_bytes(self) -> int:
        """Bytes of the activation rows this runner still holds (fed and computed, not yet
        released): what an unfinished request costs its node."""
        return self._held

    def feed(self, segment: int, row_offset: int, rows: Tensor,
             emit: Callable[[Emission], None] | None = None) -> list[Emission]:
        """Take `rows` of `segment`'s input at `row_offset`, compute what they complete and
        return the resulting emissions - or, with `emit`, hand each one to it as soon as its
        rows exist (and return [])."""
        if not 0 <= segment < len(self._seg_in):
            raise ValueError(f"segment {segment} out of range 0..{len(self._seg_in) - 1}")
        v = self._seg_in[segment]
        c, _, w = self.graph.value_shapes[v]
        if not isinstance(rows, Tensor) or rows.dim() != 4:
            raise ValueError(f"rows must be a 4-D tensor (N,C,r,W), got "
                             f"{getattr(rows, 'shape', type(rows))}")
        n, rc, r, rw = rows.shape
        if rc != c or rw != w or r < 1:
            raise ValueError(f"segment {segment} rows must have shape (N,{c},r>=1,{w}), "
                             f"got {tuple(rows.shape)}")
        if self._n is not None and n != self._n:
            raise ValueError(f"batch size {n} differs from earlier rows ({self._n})")
        lo, hi = int(row_offset), int(row_offset) + r
        self._check_expected(segment, lo, hi)
        if not rows.is_floating_point():
            raise ValueError(f"rows must be floating point, got {rows.dtype}")
        self._n = n
        t0 = time.perf_counter()
        out: list[Emission] = []
        handed_s = 0.0  # time inside `emit`: the caller's, not this node's compute
        sink: Callable[[Emission], None] = out.append
        if emit is not None:
            def hand_on(e: Emission) -> None:
                nonlocal handed_s
                h0 = time.perf_counter()
                emit(e)
                handed_s += time.perf_counter() - h0

            sink = hand_on

        # kept as it is when it already is on the device in the activation format (also host -> device)
        self._add(v, lo, hi, rows.to(self.graph.device).contiguous(memory_format=self.graph.activation_format))
        self._arrive(segment, lo, hi)
        self._advance({v}, sink)
        self._stats["compute_s"] += time.perf_counter() - t0 - handed_s
        return out

    # ------------------------------------------------------------------ internals
    def _run(self, j: int, a: int, b: int) -> None:
        """Compute op `j`'s rows [a, b), keep them and report the run's time to `on_run`."""
        t0 = time.perf_counter() if self.on_run is not None else 0.0
        y = self._op_rows(self.graph.ops[j], a, b)
        self._add(j + 1, a, b, y.contiguous(memory_format=self._format))
        if self.on_run is not None:
            if self.graph.device.type == "cuda":  # kernels run asynchronously: time them whole
                torch.cuda.synchronize(self.graph.device)
            self.on_run(j, b - a, time.perf_counter() - t0)
        self._stats["rows_computed"] += b - a
        self._stats["runs"] += 1

    def _add(self, v: int, lo: int, hi: int, rows: Tensor) -> None:
        pieces = self._rows[v]
        before = pieces.nbytes
        pieces.add(lo, hi, rows)
        self._held += pieces.nbytes - before

    def _finished(self, j: int) -> None:
        """Release the values no op of this node reads any more: op `j`'s inputs once their
        last reader is done, its own output if no op reads it (emissions are copies). A request
        then holds its live activations, not all it ever computed: one node, whole image, at
        most 4 MB for ResNet-18 at 224 (14 MB when nothing was released), 9 MB for MobileNetV2
        at 320x240 (43 MB), 16 MB for VGG-11 (36 MB)."""
        for u in (*self.graph.ops[j].inputs, j + 1):
            if all(not self._remaining[c + 1] for c in self._readers[u]):
                self._held -= self._rows[u].nbytes
                self._rows[u] = RowPieces()

    def _op_rows(self, op: TrunkOp, a: int, b: int) -> Tensor:
        """Output rows [a, b) of `op` from the rows its inputs hold."""
        if op.window is not None:
            first, stop, top, bottom = op.window.input_rows(a, b)
            rows = self._rows[op.inputs[0]]
            if op.pads_itself(top, bottom):
                return op.run_border(rows.read(first, stop), top, bottom, a, b)
            # padding rows and rows from several pieces in one copy
            return op.run([rows.read(first, stop, top, bottom, op.pad_value)], a, b)
        return op.run([self._rows[u].read(a, b) for u in op.inputs], a, b)

    def _emit(self, v: int, a: int, b: int) -> list[Emission]:
        out: list[Emission] = []
        pieces = self._rows[v]
        if v == self._final:
            out.append(Emission("OUTPUT", self._last_seg, COORDINATOR, a, pieces.read(a, b).clone()))
            self._stats["output_rows"] += b - a
        for dst, seg, rng in self._targets.get(v, ()):
            lo, hi = intersect((a, b), rng)
            if lo < hi:
                out.append(Emission("HALO", seg, dst, lo, pieces.read(lo, hi).clone()))
                self._stats["halo_rows_out"] += hi - lo
        return out


def run_plan_locally(
    graph: ModelGraph,
    plan: Plan,
    image: Tensor,
    *,
    slab_rows: int | None = None,
    seed: int | None = None,
    min_run_rows: int = DEFAULT_MIN_RUN_ROWS,
    runners_out: dict[str, StripeRunner] | None = None,
    graphs: Mapping[str, ModelGraph] | None = None,
) -> Tensor:
    """Simulate the whole collaborative trunk in-process and gather its output.

    The coordinator sends each active node its input rows in slabs of `slab_rows` (default
    `plan.slab_rows`); emissions are routed until every runner is done. With `seed`, slabs
    and messages are delivered in a random order (what a network may do). Pass a dict as
    `runners_out` to get the runners (for their stats). `graphs` gives a node its own graph of
    the same model, e.g. on another device (a heterogeneous split; rows move between devices
    as the runners copy them in); the others use `graph`.
    """
    if image.dim() != 4 or tuple(image.shape[1:]) != tuple(plan.input_shape):
        raise ValueError(f"image must be (N,{','.join(map(str, plan.input_shape))}), "
                         f"got {tuple(image.shape)}")
    slab = plan.slab_rows if slab_rows is None else int(slab_rows)
    if slab < 1:
        raise ValueError("slab_rows must be >= 1")
    rng = random.Random(seed) if seed is not None else None
    runners = {n: StripeRunner((graphs or {}).get(n, graph), plan, n, min_run_rows=min_run_rows)
               for n in plan.active_nodes()}
    if runners_out is not None:
        runners_out.update(runners)
    queue: list[tuple[str, int, int, Tensor]] = []
    per_node: list[list[tuple[str, int, int, Tensor]]] = []
    for n in runners:
        lo, hi = plan.input_rows_for(n)
        per_node.append([(n, 0, a, image[:, :, a:min(a + slab, hi)])
                         for a in range(lo, hi, slab)])
    if rng is None:  # round-robin over nodes, slabs in order
        for i in range(max((len(p) for p in per_node), default=0)):
            queue.extend(p[i] for p in per_node if i < len(p))
    else:
        queue = [m for p in per_node for m in p]
        rng.shuffle(queue)
    c, h, w = plan.output_shape
    result = image.new_full((image.shape[0], c, h, w), float("nan"))
    written = [False] * h
    pos = 0
    while pos < len(queue):
        if rng is not None:  # deliver any pending message next
            k = rng.randrange(pos, len(queue))
            queue[pos], queue[k] = queue[k], queue[pos]
        node, seg, off, rows = queue[pos]
        pos += 1
        for e in runners[node].feed(seg, off, rows):
            if e.role == "OUTPUT":
                r = e.rows.shape[2]
                if any(written[e.row_offset:e.row_offset + r]):
                    raise RuntimeError(f"output rows from {e.row_offset} written twice")
                written[e.row_offset:e.row_offset + r] = [True] * r
                result[:, :, e.row_offset:e.row_offset + r] = e.rows
            else:
                queue.append((e.consumer, e.segment, e.row_offset, e.rows))
    stuck = [n for n, r in runners.items() if not r.done]
    if stuck or not all(written):
        raise RuntimeError(f"plan did not complete: runners not done {stuck}, "
                           f"missing output rows {[i for i, x in enumerate(written) if not x]}")
    return result
