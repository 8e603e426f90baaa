"""A compute node killed with SIGKILL and respawned by the launcher gets back the plan that ran
when it left, at once (no search that would first try plans the cost model over-rates), and
the results stay exact. Real processes on the embedded runtime; no timing assertion."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import wait_until
from inference_helpers import InferenceGraph

pytestmark = pytest.mark.e2e

MODEL = dict(model="resnet18", height=128, width=128, slab_rows=16)


def _shape(plan) -> tuple:
    return (str(plan.strategy), list(plan.node_ids), [round(float(s), 3) for s in plan.shares],
            [int(c) for c in plan.cut_values])


def test_a_respawned_node_gets_the_plan_it_left(tmp_path):
    with InferenceGraph(tmp_path, **MODEL, slowdowns=[1.0, 1.0], shares=[1.0, 2.0], supervise=True) as g:
        g.wait_ready()
        # frames one at a time: each request runs alone, so the plan's latency is measured
        frames = g.frames(6)
        g.check_outputs(frames, g.stream(frames, window=1))
        before = g.latest_plan()
        victim = "compute_0"
        old_pid = g.pid(victim)
        os.kill(old_pid, signal.SIGKILL)

        def plan_with(text: str):
            return next((p for p in g.plans.snapshot() if text in str(p.reason)), None)

        lost = wait_until(lambda: plan_with(f"{victim} lost"), f"a plan without {victim}", 30.0, interval_s=0.05)
        assert victim not in list(lost.node_ids)
        try:
            back = wait_until(lambda: plan_with(f"{victim} joined again"), f"{victim} back in a plan after "
                              "its respawn", 60.0, interval_s=0.05)
        except AssertionError as exc:
            reasons = [f"v{p.version}: {p.reason}" for p in g.plans.snapshot()]
            raise AssertionError(f"{exc}; plans: {reasons}\n{g.out.text(last=40)}") from None
        assert g.pid(victim) != old_pid
        assert "(the plan it left)" in str(back.reason), back.reason
        assert _shape(back) == _shape(before), (back.reason, before.reason)
        frames = g.frames(4, first=30)
        after = g.check_outputs(frames, g.stream(frames))  # complete and exact again
        assert all(victim in list(f.node_ids) for f in after)
        assert "Traceback" not in g.out.text(), g.out.text(last=60)
