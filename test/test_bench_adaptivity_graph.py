"""`AdaptivityGraph` bookkeeping that needs no running graph: answers and plans arrive on
different topics, and the records a test reads must not take an answer whose plan is still on
its way for an answer under a plan without nodes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kaitian_ros.bench.adaptivity_graph import AdaptivityGraph, _Log


def _answer(request_id: int, version: int) -> SimpleNamespace:
    """A FusedOutput double: the fields `records` reads."""
    stamp = SimpleNamespace(sec=request_id, nanosec=0)
    return SimpleNamespace(request_id=request_id, plan_version=version, complete=True, status="ok",
                           latency_ms=10.0, node_ids=["compute_0", "compute_2"], node_rows=[4, 4],
                           header=SimpleNamespace(stamp=stamp))


def _plan(version: int) -> SimpleNamespace:
    """A LoadAssignment (plan) double."""
    return SimpleNamespace(version=version, node_ids=["compute_0", "compute_2"], shares=[0.5, 0.5])


def _graph_logs() -> AdaptivityGraph:
    g = AdaptivityGraph.__new__(AdaptivityGraph)  # only the message logs: no processes
    g.fused, g.plans, g.assignments, g.telemetry = _Log(), _Log(), _Log(), _Log()
    g.sent = {}
    return g


def test_the_plan_of_every_answer_is_waited_for() -> None:
    g = _graph_logs()
    g.plans(_plan(1))
    g.fused(_answer(1, 1))
    g.fused(_answer(2, 2))  # its plan is still on its way
    late = threading.Timer(0.2, g.plans, args=(_plan(2),))
    late.start()
    g._wait_for_plans(5.0)
    # returned when the plan arrived, not at once (the answer would read as a plan of no node)
    assert g.records()[-1]["shares"] == {"compute_0": 0.5, "compute_2": 0.5}
    late.join()


def test_a_plan_that_never_comes_is_waited_for_no_longer_than_asked() -> None:
    g = _graph_logs()
    g.fused(_answer(1, 7))
    t0 = time.monotonic()
    g._wait_for_plans(0.3)
    assert time.monotonic() - t0 >= 0.3
    assert g.records()[-1]["shares"] == {}


def test_each_answer_carries_its_nodes_compute_and_wait_from_their_telemetry() -> None:
    """A slow launch is told apart as slower computing (device time) or waiting for a core."""
    g = _graph_logs()
    g.plans(_plan(1))
    g.telemetry(SimpleNamespace(request_id=0, node_id="compute_0", compute_ms=0.0, wait_ms=0.0))  # heartbeat
    g.telemetry(SimpleNamespace(request_id=1, node_id="compute_0", compute_ms=14.25, wait_ms=1.5))
    g.telemetry(SimpleNamespace(request_id=1, node_id="compute_2", compute_ms=13.0, wait_ms=6.125))
    g.fused(_answer(1, 1))
    g.fused(_answer(2, 1))  # no telemetry (yet) for this one
    got = g.records()
    assert got[0]["node_ms"] == {"compute_0": [14.25, 1.5], "compute_2": [13.0, 6.12]}
    assert got[1]["node_ms"] == {}
