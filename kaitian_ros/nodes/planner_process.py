"""The coordinator's planner rounds, in a process of their own.

A planning round (`plan_round`) is a full search of the strategy-complete planner over one
snapshot of what the coordinator knows (`PlanRequest`): pure Python, up to a few hundred ms for
a deep model over three nodes. Run on a thread of the coordinator it held the interpreter lock
for most of that time, and the coordinator's own work on frames - receiving the image, sending
slabs, gathering rows, the head - waited for it: 6-10 ms more latency per frame while a search
ran (measured: MobileNetV2 over three nodes). `PlannerProcess` runs rounds in a child process
that builds the same model graph; the coordinator hands it requests and picks up results
without ever waiting for one.

A spawned child starts a fresh interpreter and imports torch again: 2 s of CPU and ~200 MB of
memory of its own on this machine, at every coordinator start. So the coordinator's ``main``
forks the child (`prefork`) before the node opens its middleware session - while no thread
of the middleware or of torch runs, the only moment a fork is safe - and the child shares the imported
modules' pages with it; the model spec follows over the pipe once the node has read its
parameters (`planner_for`). Where the process already runs other threads (the coordinator
built inside another program) the child is spawned as before.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kaitian_ros.core import planner
from kaitian_ros.core.costs import Costs
from kaitian_ros.core.graph import ModelGraph
from kaitian_ros.core.plan import PlanSpec
from kaitian_ros.processes import name_process, tie_to_parent

PLANNER_NICE = 10  # the child's niceness: ~10x less CPU than a compute node when both want a core


@dataclass(frozen=True)
class PlanRequest:
    """Everything one planning round reads, taken on the coordinator's executor thread (the
    round works on this snapshot only)."""

    reason: str
    effective: int
    force: bool
    alive: tuple[str, ...]
    nodes: tuple[str, ...]  # the alive nodes that may take part
    shares: tuple[float, ...]
    policy: str
    share_search: bool
    margin: float  # a more complex strategy must be predicted this much faster
    measured: dict  # spec_key -> planner.MeasuredPlan: plans that ran lately
    costs: Costs
    missing: tuple[str, ...]  # nodes planned with prior costs
    slab_rows: int
    strategy: str
    latest_version: int
    latest_spec: PlanSpec | None
    latest_slab_rows: int
    whole_image: bool  # the planner may send a plan's input in one slab
    # frozenset of nodes -> measured / predicted of the last plan that ran on them
    earlier_errors: dict = field(default_factory=dict)
    quick: bool = False  # single-node plans only (a node of the running plan changed speed)
    resume: planner.MeasuredPlan | None = None  # the plan that ran last under the parameters just set

    def material(self) -> tuple:
        """What decides a round's choice, each measured number on a 5 % (links 10 %) log grid:
        two requests with equal `material()` choose the same plan, so a periodic round over
        unchanged inputs can be skipped (its CPU time is taken from the frame path on a small
        host). Absolute buckets, not "within 5 % of the last round": a slow drift still
        crosses a bucket edge and is planned for."""
        c = self.costs
        profiles = tuple(sorted((n, _bucket(p.trunk_ms), _bucket(p.message_ms + 0.1), p.min_run_rows,
                                 tuple(sorted((src, _bucket(e.bytes_per_ms, LINK_STEP), _bucket(e.latency_ms + 0.1))
                                              for src, e in p.links.items())))
                                for n, p in c.profiles.items()))
        links = tuple(sorted((k, _bucket(e.bytes_per_ms, LINK_STEP), _bucket(e.latency_ms + 0.1))
                             for k, e in c.links.items()))
        overheads = (_bucket(c.pre_ms + 0.1), _bucket(c.post_ms + 0.1), _bucket(c.send_ms_per_mb + 0.1),
                     _bucket(c.link_prior.bytes_per_ms, LINK_STEP), c.slab_rows)
        total = sum(self.shares) or 1.0
        return (self.alive, self.nodes, tuple(round(20 * s / total) for s in self.shares), self.policy,
                self.share_search, self.margin, self.missing, self.slab_rows, self.strategy, self.latest_version,
                self.latest_slab_rows, self.whole_image, self.quick, profiles, links, overheads,
                tuple(sorted((k, _bucket(m.ms)) for k, m in self.measured.items())),
                tuple(sorted((tuple(sorted(k)), _bucket(e)) for k, e in self.earlier_errors.items())))


MEASURE_STEP = 0.05  # measured times and errors: steps of 5 %, about their run-to-run noise
LINK_STEP = 0.10  # link rates: a meter over 16 chunks moves ~10 % between windows


def _bucket(x: float, step: float = MEASURE_STEP) -> int:
    """`x` on a log grid of relative steps `step`."""
    if not x > 0 or math.isinf(x):
        return -(1 << 30) if not x > 0 else 1 << 30
    return round(math.log(x) / math.log1p(step))


class RunningPlan(NamedTuple):
    """The newest plan as a round sees it."""

    predicted_ms: float  # its prediction now
    expected_ms: float  # what it measured if it ran lately, else the prediction
    measured: bool


def plan_round(graph: ModelGraph, r: PlanRequest) -> tuple[planner.Choice | None, Any]:
    """(choice, the newest plan now as a `RunningPlan`, or None) - or (None, the error)."""
    try:
        strategy = "single" if r.quick else r.strategy
        choice = planner.choose_plan(graph, r.nodes, r.costs, slab_rows=r.slab_rows, strategy=strategy,
                                     shares=r.shares, adapt_shares=r.share_search, margin=r.margin,
                                     measured=r.measured, earlier_errors=r.earlier_errors,
                                     whole_image=r.whole_image)
        choice = planner.resuming(choice, r.resume, r.margin)
        was = None
        if r.latest_spec is not None and set(r.latest_spec.node_ids) <= set(r.nodes):
            predicted = planner.predict(graph, r.latest_spec, r.costs, slab_rows=r.latest_slab_rows)
            seen = r.measured.get(planner.spec_key(r.latest_spec, r.latest_slab_rows))
            was = RunningPlan(predicted, seen.ms if seen is not None else predicted, seen is not None)
        return choice, was
    except (ValueError, RuntimeError) as exc:
        return None, exc


def _serve(conn: Any, spec: Any, parent_end: Any = None) -> None:
    """The child: build the graph (of `spec`, or of the spec the pipe brings first when it was
    forked before the coordinator knew it), then answer requests until the coordinator goes away.
    `parent_end`: the coordinator's end of the pipe, which a forked child holds a copy of."""
    import signal

    if parent_end is not None:  # else the coordinator closing its end would never end our recv
        parent_end.close()

    import torch

    from kaitian_ros.nodes import inference_common as ic

    # Ctrl-C reaches the whole process group: the coordinator shuts down and closes the pipe,
    # which ends this loop (no traceback of an interrupted recv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM when the coordinator dies, even by SIGKILL: no orphan keeps a respawned
    # coordinator's output pipe or a core busy
    tie_to_parent()
    name_process("planner")  # not its parent's name in ps and top, when forked
    # background work: a round is worth less than a frame. On cores shared with compute nodes
    # (a robot's own device, or the benchmark's emulated ones) a round that the scheduler's
    # new shares start competes with the frame in flight on that device
    with contextlib.suppress(OSError):
        os.nice(PLANNER_NICE)
    if spec is None:
        try:
            spec = conn.recv()
        except (EOFError, OSError):  # the coordinator ended before it needed a planner
            return
    torch.set_num_threads(1)
    from kaitian_ros.nodes import compute_prepare

    graph = compute_prepare.take_graph(spec, "cpu") or ic.build_graph(spec)  # (forked with it: coordinator)
    try:
        conn.send("ready")
    except (BrokenPipeError, OSError):  # the coordinator died while the graph was built
        return
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the coordinator is gone
            return
        try:
            result = plan_round(graph, request)
        except Exception as exc:  # noqa: BLE001 - a round must never end the planner: report it as the error
            result = (None, RuntimeError(f"planner failed: {type(exc).__name__}: {exc}"))
        try:
            conn.send(result)
        except (BrokenPipeError, OSError):
            return


_prefork: PlannerProcess | None = None


def prefork() -> None:
    """Fork the planner's process now, unless a Python thread runs (module docstring); the
    next `planner_for` hands it its model spec. Called before the node's runtime exists: the
    only other threads then are those native ones an import starts (OpenBLAS's pool), which
    stop and restart themselves around a fork, as the launcher's fork server relies on too."""
    global _prefork
    if _prefork is None and threading.active_count() == 1:
        _prefork = PlannerProcess(None)


def planner_for(spec: Any) -> PlannerProcess:
    """A planner process for `spec`: the one `prefork` made (once), else a spawned one."""
    global _prefork
    made, _prefork = _prefork, None
    if made is not None and made.alive():
        made._conn.send(spec)
        return made
    if made is not None:
        made.close()
    return PlannerProcess(spec)


class PlannerProcess:
    """One child process running planning rounds, one at a time (`submit`, then `result`)."""

    def __init__(self, spec: Any) -> None:
        """With `spec` None the child is forked and waits for its spec on the pipe (`prefork`,
        in a process of one thread only); with a spec it is spawned: a fork of a process with
        middleware and torch threads running could inherit a lock one of them held."""
        ctx: Any = multiprocessing.get_context("spawn" if spec is not None else "fork")
        self._conn, child = ctx.Pipe()
        # a forked child gets its copy of our end too (not pickled: only spawn pickles arguments)
        args = (child, spec) if spec is not None else (child, None, self._conn)
        self._proc = ctx.Process(target=_serve, args=args, name="kaitian-planner", daemon=True)
        self._proc.start()
        child.close()
        self.ready = False
        self.busy: PlanRequest | None = None
        self._submitted_s = 0.0
        self.last_round_ms = 0.0  # wall time of the last round, submit to result (diagnostics)

    def alive(self) -> bool:
        return self._proc.is_alive()

    def is_ready(self) -> bool:
        """Whether the child has built its graph and takes requests (it starts with the
        coordinator and needs a few seconds to import torch and build the model)."""
        if not self.ready and self.busy is None:
            self.result()
        return self.ready and self.alive()

    def submit(self, request: PlanRequest) -> None:
        if self.busy is not None:
            raise RuntimeError("a planning round is already running")
        self._conn.send(request)
        self.busy = request
        self._submitted_s = time.monotonic()

    def result(self) -> tuple[PlanRequest, planner.Choice | None, Any] | None:
        """The finished round (its request, choice, was) if one finished, else None; never waits."""
        while self._conn.poll():
            try:
                got = self._conn.recv()
            except (EOFError, OSError):
                return None
            if got == "ready":
                self.ready = True
                continue
            request, self.busy = self.busy, None
            self.last_round_ms = (time.monotonic() - self._submitted_s) * 1e3
            return (request, *got) if request is not None else None
        return None

    def close(self, grace_s: float = 2.0) -> None:
        """Close the pipe, which ends the child by itself; kill it if it has not ended within
        `grace_s` (at niceness 10 on loaded cores its exit alone can take seconds)."""
        try:
            self._conn.close()
        finally:
            self._proc.join(timeout=grace_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5.0)  # reaped: once close() returns, it is not alive()

