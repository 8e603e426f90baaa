"""The coordinator's planner process: the same choice as a round in-process, errors reported,
the coordinator never waiting for it."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from helpers import wait_until

from kaitian_ros.core.costs import Costs, DeviceProfile, LinkEstimate, OpCost
from kaitian_ros.core.plan import PlanSpec
from kaitian_ros.core.planner import MeasuredPlan, spec_key
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes.planner_process import PLANNER_NICE, PlannerProcess, PlanRequest, plan_round

pytestmark = pytest.mark.e2e

SPEC = ic.ModelSpec(name="digits_cnn", input_shape=(1, 32, 32), num_classes=10, seed=0, weights="")


def _costs(graph) -> Costs:
    def profile(node: str, per_mflop: float) -> DeviceProfile:
        ops = tuple(OpCost(0.01, op.flops_per_row / 1e6 * per_mflop) for op in graph.ops)
        return DeviceProfile(node, 1, SPEC.key, "cpu", 1.0, ops,
                             sum(c.ms(op.out_shape[1]) for c, op in zip(ops, graph.ops)), 0.01, 8)

    return Costs({"a": profile("a", 0.05), "b": profile("b", 0.1)}, {}, LinkEstimate(1e6, 0.0))


def _request(costs: Costs, **over) -> PlanRequest:
    running = PlanSpec.single("a")
    fields = dict(reason="test", effective=0, force=False, alive=("a", "b"), nodes=("a", "b"),
                  shares=(1.0, 1.0), policy="adaptive", share_search=True, margin=0.1,
                  measured={spec_key(running, 8): MeasuredPlan(running, 8, 5.0)}, costs=costs,
                  missing=(), slab_rows=8, strategy="auto", latest_version=1, latest_spec=running,
                  latest_slab_rows=8, whole_image=True)
    return PlanRequest(**(fields | over))


def _wait(proc: PlannerProcess, timeout_s: float = 120.0):
    return wait_until(proc.result, "the planner process's answer", timeout_s)


def test_the_planner_process_chooses_what_a_round_in_process_chooses() -> None:
    torch.set_num_threads(1)
    graph = ic.build_graph(SPEC)
    costs = _costs(graph)
    proc = PlannerProcess(SPEC)
    try:
        request = _request(costs)
        t0 = time.monotonic()
        proc.submit(request)
        assert time.monotonic() - t0 < 1.0  # handing over a request does not wait for the round
        with pytest.raises(RuntimeError, match="already running"):
            proc.submit(request)
        got_request, choice, was = _wait(proc)
        here, was_here = plan_round(graph, request)
        assert got_request == request and proc.busy is None and proc.is_ready()
        # the round ran at a lower priority than the coordinator (background work: frames first)
        want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + PLANNER_NICE)  # 19: the lowest there is
        assert os.getpriority(os.PRIO_PROCESS, proc._proc.pid) == want
        assert choice.best.spec == here.best.spec and choice.best.predicted_ms == pytest.approx(here.best.predicted_ms)
        assert [c.label for c in choice.candidates] == [c.label for c in here.candidates]
        assert was == pytest.approx(was_here) and was[1] == 5.0
        # a request the planner cannot serve comes back as the error, and the process goes on
        proc.submit(_request(costs, strategy="sideways"))
        _, none, error = _wait(proc)
        assert none is None and "strategy must be one of" in str(error)
        proc.submit(request)
        assert _wait(proc)[1].best.spec == here.best.spec
    finally:
        proc.close(grace_s=60.0)  # starved by the tests beside it, a niceness 10 exit can take seconds
    assert not proc.alive() and proc._proc.exitcode == 0


PREFORKED = """
import json, sys, threading, time
sys.path.insert(0, "test")
import test_planner_process as t
from kaitian_ros.nodes import planner_process as pp
pp.prefork()  # a fresh interpreter: no thread yet
forked = pp._prefork
made = pp.planner_for(t.SPEC)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
pp.prefork()  # a thread runs now: no fork (planner_for would spawn)
graph = t.ic.build_graph(t.SPEC)
request = t._request(t._costs(graph))
made.submit(request)
_, choice, _ = t._wait(made)
here, _ = pp.plan_round(graph, request)
print(json.dumps({"forked": forked is made, "made": type(made._proc).__name__, "again": pp._prefork is None,
                  "same": choice.best.spec == here.best.spec}))
made.close(grace_s=60.0)
print(json.dumps({"closed": not made.alive(), "exitcode": made._proc.exitcode}))
"""


def test_a_planner_forked_before_the_node_starts_plans_as_a_spawned_one() -> None:
    """`prefork` in a process without threads (a node's main before its runtime exists) forks
    the planner, which gets its spec later and chooses what a round in-process chooses; once a
    thread runs it forks nothing (the spawned planner is the test above)."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    out = subprocess.run([sys.executable, "-c", PREFORKED], cwd=str(REPO), capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    first, last = (json.loads(line) for line in out.stdout.splitlines()[-2:])
    assert first == {"forked": True, "made": "ForkProcess", "again": True, "same": True}, first
    # it ended by itself when the coordinator closed the pipe (not killed after close()'s grace
    # period: a forked child that kept a copy of the coordinator's end never saw the pipe close)
    assert last == {"closed": True, "exitcode": 0}, last


def test_inputs_that_moved_less_than_their_noise_plan_the_same_round_and_real_changes_do_not() -> None:
    graph = ic.build_graph(SPEC)
    costs = _costs(graph)
    base = _request(costs)
    assert base.material() == _request(costs).material()

    def with_trunk(factor: float) -> PlanRequest:
        p = costs.profiles["b"]
        moved = Costs(dict(costs.profiles) | {"b": dataclasses.replace(p, trunk_ms=p.trunk_ms * factor)},
                      costs.links, costs.link_prior)
        return _request(moved)

    # a trunk time within a bucket of 5 % keeps the material; one that moved by 20 % changes it
    near = [with_trunk(f).material() == base.material() for f in (1.001, 0.999)]
    assert any(near)
    assert with_trunk(1.2).material() != base.material()
    running = PlanSpec.single("a")
    slower = {spec_key(running, 8): MeasuredPlan(running, 8, 6.0)}
    assert _request(costs, measured=slower).material() != base.material()  # the running plan got slower
    assert _request(costs, alive=("a",), nodes=("a",), shares=(1.0,)).material() != base.material()
    assert _request(costs, strategy="stripes").material() != base.material()
    assert _request(costs, earlier_errors={frozenset({"a", "b"}): 1.5}).material() != base.material()
    faster_link = Costs(costs.profiles, {("a", "coordinator"): LinkEstimate(2e4, 0.5)}, costs.link_prior)
    assert _request(faster_link).material() != base.material()
    # the scheduler's shares are compared at the planner's own grain (0.05 of the total)
    assert _request(costs, shares=(1.0, 1.001)).material() == base.material()
    assert _request(costs, shares=(1.0, 2.0)).material() != base.material()


def test_a_plans_measured_latency_is_the_median_of_its_latest_requests() -> None:
    """One request slowed by a busy moment does not make a plan look slow (the planner compares
    plans by this), and the window forgets the oldest requests."""
    from kaitian_ros.core.plan_memory import MEASURED_WINDOW, ObservedPlan

    spec = PlanSpec.single("a")

    def observed(samples: tuple[float, ...]) -> ObservedPlan:
        return ObservedPlan(spec, 8, samples[-MEASURED_WINDOW:], len(samples), 0.0, {}, 50.0, frozenset("a"), {})

    assert observed((50.0, 200.0, 52.0)).ms == 52.0
    assert observed((200.0, 51.0, 52.0)).ms == 52.0
    # a real change of speed wins once it is most of the window
    assert observed((50.0,) * 5 + (80.0,) * 3).ms == 80.0
