"""End to end: a compute node that is alive but late leaves the plan, and comes back.

Real processes on the embedded runtime (coordinator, scheduler with the adaptive policy, two
compute nodes at equal EMULATED speed), the test as the camera, and a real attacker process
(`kaitian_ros.bench.chaos_attack flood`) that floods one compute node's chunk topic with
valid-looking INPUT chunks of made-up requests. The flooded node keeps sending heartbeats, so
dead-node supervision never removes it; the coordinator's lateness rule (`late_after_s`,
`core.lateness`) must. No timing assertion: the chaos benchmark measures the output gap.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from inference_helpers import shared_fork_server

from kaitian_ros.bench.adaptivity_graph import AdaptivityGraph, check_requests, scenario_config
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.processes import start_child

pytestmark = pytest.mark.e2e

MODEL = dict(model="resnet18", height=128, width=128, num_classes=10, slab_rows=8)
# both nodes hold rows while the flood starts (the planner's own choice could move the plan off
# the victim, and a flood at a node without rows delays nobody)
BOTH_NODES = {"strategy": "stripes", "share_search": False}
FLOOD_MAX_S = 30


@pytest.mark.parametrize("flood", ["slabs", "whole_stripes"])
def test_flooded_node_leaves_the_plan_every_frame_is_answered_and_it_comes_back(flood):
    """`slabs`: chunks of a few rows, which pile up as requests in the node's table; whole
    stripes: requests the node computes and finishes, so only its telemetry for requests the
    coordinator never issued shows the flood (`lateness.FOREIGN_WINDOW_S`)."""
    # dead_after_s well above a heartbeat's delay on busy cores: the flooded node stays alive, the
    # lateness rule is what must take it out
    cfg = scenario_config(**MODEL, slowdowns=[1.0, 1.0], policy="adaptive", dead_after_s=5.0,
                          coordinator=BOTH_NODES)
    with AdaptivityGraph(cfg, fork=shared_fork_server()) as g:
        g.wait_ready(timeout_s=90.0)
        g.drive(10, window=1, timeout_s=90.0)
        latest = g.latest_plan()
        victim = max(zip(latest.node_ids, latest.shares), key=lambda ns: ns[1])[0]
        # the flood lasts until the victim is out (at most FLOOD_MAX_S): how soon a flood makes a node
        # late depends on how fast this machine lets the attacker send and the victim compute
        cmd = [sys.executable, "-u", "-m", "kaitian_ros.bench.chaos_attack", "flood", "--node", victim,
               "--seconds", str(FLOOD_MAX_S), "--rate", "1000", "--model", "resnet18", "--height", "128",
               "--width", "128", "--num-classes", "10", "--slab-rows", "32", "--wait-go"]
        cmd += ["--whole-stripes"] if flood == "whole_stripes" else []
        attacker = start_child(cmd, own_group=False, env=dict(os.environ, KAITIAN_ROUTER=g.endpoint),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               bufsize=1)

        loads: dict[str, int] = {}  # the highest load the coordinator reported for each node

        def late_version() -> int | None:
            for item in filter(None, g.coordinator_values.get("load", "").split(",")):
                node, load = item.split(":")
                loads[node] = max(loads.get(node, 0), int(load))
            return next((v for v, m in sorted(g.plan_table().items()) if f"{victim} late" in m.reason), None)

        try:
            assert attacker.stdout is not None and attacker.stdin is not None
            ready = attacker.stdout.readline()
            assert '"ready"' in ready, ready + (attacker.stderr.read() if attacker.stderr else "")
            first_flooded = max((r["request_id"] for r in g.records()), default=0)
            attacker.stdin.write("go\n")
            attacker.stdin.flush()
            g.drive(until=lambda: late_version() is not None or attacker.poll() is not None, window=1,
                    timeout_s=FLOOD_MAX_S + 60.0)
            attacker.terminate()  # ends the flood: it prints what it sent and exits 0
            sent, errors = attacker.communicate(timeout=30)
            assert attacker.returncode == 0, errors
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait(timeout=30)

        left = late_version()
        if left is None:
            pytest.fail(f"{victim} never left the plan as late; flood: {sent.strip()}; highest loads seen: {loads}; "
                        f"{g.story()}")
        assert victim not in proto.members(g.plan_table()[left])

        def back() -> bool:
            return any(v > left and victim in proto.members(m) for v, m in g.plan_table().items())

        g.drive(until=back, window=1, timeout_s=90.0)
        g.drive(5, window=1, timeout_s=60.0)

        records = sorted(g.records(), key=lambda r: r["request_id"])
        check = check_requests(records)
        assert not check["missing"], f"requests without an answer: {check['missing']}"
        assert not check["duplicates"], f"requests answered twice: {check['duplicates']}"
        bad = [(r["request_id"], r["status"]) for r in records if not r["complete"]]
        if bad:
            pytest.fail(f"incomplete answers: {bad}; {g.story()}")
        # the late node's requests were answered by the others while it was out
        during = [r for r in records if r["request_id"] > first_flooded and r["plan_version"] >= left
                  and victim not in r["node_ids"]]
        assert during, "no request ran without the late node"
        arrivals = sorted(r["arrived_s"] for r in records if r["request_id"] > first_flooded)
        gap = max((b - a for a, b in itertools.pairwise(arrivals)), default=0.0)
        plans = [(v, sorted(proto.members(m))) for v, m in sorted(g.plan_table().items())]
        print(f"\n{victim} left the plan at v{left} ({g.plan_table()[left].reason}); longest gap between "
              f"answers from the flood on {gap:.2f} s; highest loads seen: {loads}; plans: {plans}")
