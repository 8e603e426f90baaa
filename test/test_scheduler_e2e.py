"""End to end: the scheduler node re-balances a running hetero_inference graph, and the graph
survives a compute node dying and coming back.

Real processes (coordinator, scheduler with policy ``adaptive``, compute nodes) on the embedded
runtime, a router on a free port per test; the test is the camera (a steady closed-loop stream:
the next frame as soon as fewer than ``window`` are unanswered) through an EmbeddedRuntime. The
harness is :class:`kaitian_ros.bench.adaptivity_graph.AdaptivityGraph` (the adaptivity benchmark runs
the same graph). Speeds are EMULATED (``emulated_slowdown``). No absolute timing assertion:
shares are compared with shares, latency medians with latency medians; the time to drop a dead
node is measured, printed and bounded generously (2 busy cores shared with other test runs).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest
from helpers import wait_until
from inference_helpers import shared_fork_server

from kaitian_ros.bench.adaptivity_graph import AdaptivityGraph, check_requests, scenario_config

pytestmark = pytest.mark.e2e

MODEL = dict(model="resnet18", height=128, width=128, num_classes=10, slab_rows=8)
# the scheduler's shares as the plan's stripes: these tests are about the share policy (the
# planner's own choices have their tests in test_planner_e2e.py)
SCHEDULER_STRIPES = {"strategy": "stripes", "share_search": False}
ADAPT_WITHIN = 15  # requests after the first slowed one until a plan shrinks the slowed node (measured 6-10)
SLACK_S = 3.0  # for a loaded 2-core machine: heartbeat delivery + executor backlog + plan delivery
LATE_ANSWER_S = 5.0  # a request in flight when the test checks, well under request_timeout_s


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kaitian_ros.cli", *args], capture_output=True, check=False, text=True,
                          timeout=60)


def _assert_every_request_answered_once(g: AdaptivityGraph) -> list[dict]:
    """Every request id from the first answered to the last has one complete answer. A request
    still in flight when the test looks (a node's death re-dispatches it behind newer ones) gets
    LATE_ANSWER_S to arrive: lost is what never comes, not what comes late; a late one is printed."""
    check = check_requests(g.records())
    assert check["first"] is not None, "no FusedOutput at all"
    missing = set(check["missing"])
    deadline = time.monotonic() + LATE_ANSWER_S
    while not missing <= {r["request_id"] for r in g.records()} and time.monotonic() < deadline:
        time.sleep(0.05)
    records = g.records()
    late = [(r["request_id"] - check["first"], r["plan_version"], r["status"][:60]) for r in records
            if r["request_id"] in missing]
    if late:
        print(f"answered after the test first looked (request, plan version, status): {late}")
    check = check_requests(records)
    if check["missing"]:  # the story on one line: a CI log keeps a failure's last line
        pytest.fail(f"request ids without an answer: {[i - check['first'] for i in check['missing']]} "
                    f"(counted from the first answered); {g.story()}")
    assert not check["duplicates"], f"request ids answered twice: {check['duplicates']}"
    bad = [(r["request_id"], r["status"]) for r in records if not r["complete"]]
    if bad:
        pytest.fail(f"incomplete answers: {bad}; {g.story()}")
    return sorted(records, key=lambda r: r["request_id"])


def test_slowed_node_gets_a_smaller_share(tmp_path):
    """2 compute nodes at equal speed; ``kaitian param set /compute_1 emulated_slowdown 3.0``
    while frames flow -> within ADAPT_WITHIN requests the executed plan gives compute_1 a
    smaller share than before (the latencies before, slowed and at the end are printed)."""
    cfg = scenario_config(**MODEL, slowdowns=[1.0, 1.0], policy="adaptive", dead_after_s=2.0,
                          coordinator=SCHEDULER_STRIPES)
    t0 = time.monotonic()
    with AdaptivityGraph(cfg, fork=shared_fork_server()) as g:
        g.wait_ready(timeout_s=90.0)
        g.drive(12, window=1, timeout_s=90.0)  # cold start: warm-up samples, the equalised plan

        def newest_share() -> float:
            records = g.records()
            return max(records, key=lambda r: r["request_id"])["shares"].get("compute_1", 0.0) if records else 0.0

        # the slowdown must hit a node that carries real work: on a loaded machine a cold start can
        # measure compute_1 slow (lazy torch init) and give it a few percent, after which slowing it
        # changes nothing measurable. Equal nodes mostly settle near equal shares, but with three
        # test workers on two cores one of them can measure 0.5x for minutes (a clean clone once
        # settled at 0.17/0.83 and waited 90 s for 0.3-0.7): a third of the rows or more will do.
        g.drive(until=lambda: newest_share() >= 0.3, window=1, timeout_s=90.0)
        before = g.records()
        last_before = max(before, key=lambda r: r["request_id"])
        share_before = last_before["shares"]["compute_1"]
        assert share_before >= 0.3, f"compute_1 never carried a third of the rows: {share_before:.3f}"
        base_ms = statistics.median(r["latency_ms"] for r in before[-6:])
        result: dict = {}

        def slow_down() -> None:
            result["cli"] = _cli("param", "set", "/compute_1", "emulated_slowdown", "3.0",
                                 "--router", g.endpoint)

        def settled() -> bool:
            first = g.first_request_with_slowdown("compute_1", 3.0)
            newest = max((r["request_id"] for r in g.records()), default=0)
            return first is not None and newest >= first + ADAPT_WITHIN + 6

        g.drive(until=settled, window=1, timeout_s=120.0, events=[(0, slow_down)])
        cli = result["cli"]
        assert cli.returncode == 0, cli.stderr
        assert "Set parameter successful" in cli.stdout

        records = _assert_every_request_answered_once(g)
        r_slow = g.first_request_with_slowdown("compute_1", 3.0)
        assert r_slow > last_before["request_id"]
        slowed = [r for r in records if r["request_id"] >= r_slow]
        adapted = next((r for r in slowed if r["shares"].get("compute_1", 0.0) < 0.8 * share_before), None)
        shares = [(r["request_id"], r["plan_version"], round(r["shares"].get("compute_1", 0.0), 3)) for r in slowed]
        assert adapted is not None, f"compute_1 share never shrank below 0.8 x {share_before:.3f}: {shares}"
        k = adapted["request_id"] - r_slow
        # the slowed requests before the policy reacted: those still at the old share - or, when the
        # share had already dipped below 0.8x by then (the shares move with telemetry noise, and the
        # planner waits for its process now, so the graph is warmer when the test starts), the first
        # two slowed requests, which ran before the scheduler could have seen two slowed samples
        old_plan = [r["latency_ms"] for r in slowed if r["shares"].get("compute_1", 0.0) >= 0.8 * share_before] \
            or [r["latency_ms"] for r in slowed[:2]]
        end = [r["latency_ms"] for r in records[-6:]]
        final_share = records[-1]["shares"]["compute_1"]
        print(f"\nstartup+run {time.monotonic() - t0:.1f} s; compute_1 share {share_before:.3f} -> "
              f"{final_share:.3f} (first smaller plan v{adapted['plan_version']} at request "
              f"{adapted['request_id']}, {k} requests after the first slowed one {r_slow}); latency medians: "
              f"before {base_ms:.0f} ms, slowed under the old plan {statistics.median(old_plan):.0f} ms "
              f"({len(old_plan)} requests), last 6 {statistics.median(end):.0f} ms")
        assert k <= ADAPT_WITHIN, f"took {k} requests to shrink compute_1: {shares}"
        assert final_share < share_before
        # latencies are printed, not asserted: on a loaded machine the policy may overshoot (CI:
        # compute_1 0.48 -> 0.05, everything on compute_0 slower than the slowed old plan) and
        # medians of a few requests compare noise; `kaitian bench adaptivity` measures latency
        for _, m in g.assignments.snapshot():
            print(f"  proposal v{m.version} from request {m.effective_from_request}: {m.reason}")
        assert not g.dead_children()

        # no frames now: periodic re-predictions over unchanged inputs are skipped and counted
        skipped = int(g.coordinator_values.get("plan_rounds_skipped", "0"))
        g.set_param("coordinator", "replan_period_s", 0.2)
        wait_until(lambda: int(g.coordinator_values.get("plan_rounds_skipped", "0")) > skipped,
                   f"plan_rounds_skipped above {skipped} (coordinator /diagnostics {g.coordinator_values})",
                   interval_s=0.1)


@pytest.mark.slow
def test_killed_node_leaves_the_plan_and_a_restarted_node_rejoins(tmp_path):
    """3 compute nodes, scheduler ``adaptive``: SIGKILL compute_2 while two requests are in flight
    -> no request id missing or incomplete, compute_2 out of the executed plan within
    dead_after_s + one decide period (+ SLACK_S on this machine); restart it -> it is planned
    again, serves rows, and after its warm-up gets a full (non-probe) share."""
    dead_after_s = 1.2  # the coordinator's
    # The scheduler notices first, so its proposal without compute_2 is still waiting for its
    # effective_from_request (no new request can start: both in flight wait on the dead node)
    # when the coordinator notices: it must switch at once and re-dispatch, not wait for it.
    cfg = scenario_config(**MODEL, slowdowns=[1.0, 1.0, 1.0], policy="adaptive", dead_after_s=dead_after_s,
                          scheduler={"probe_share": 0.05, "dead_after_s": 1.0}, coordinator=SCHEDULER_STRIPES)
    decide_period_s = cfg["scheduler"]["ros__parameters"]["decide_period_s"]
    t0 = time.monotonic()
    with AdaptivityGraph(cfg, fork=shared_fork_server()) as g:
        g.wait_ready(timeout_s=90.0)
        g.drive(8, window=2, timeout_s=90.0)
        killed: list[float] = []

        def dropped_at() -> float | None:
            return next((t for t, m in g.plans.snapshot() if killed and t >= killed[0]
                         and "compute_2" not in m.node_ids), None)

        def four_answers_after_the_drop() -> bool:
            t = dropped_at()
            return t is not None and sum(r["arrived_s"] > t + 0.5 for r in g.records()) >= 4

        g.drive(until=four_answers_after_the_drop, window=2, timeout_s=90.0,
                events=[(2, lambda: killed.append(g.kill("compute_2")))])
        dropped = dropped_at()
        detect_s = dropped - killed[0]
        proposals = [(t - killed[0], m) for t, m in g.assignments.snapshot() if t >= killed[0]]
        sched_s = next((dt for dt, m in proposals if "compute_2" not in m.node_ids), None)
        print(f"\ncompute_2 out of the coordinator's plan {detect_s:.2f} s after SIGKILL, out of the "
              f"scheduler's proposal after {sched_s if sched_s is None else round(sched_s, 2)} s "
              f"(dead_after_s {dead_after_s}, decide period {decide_period_s})")
        assert detect_s <= dead_after_s + decide_period_s + SLACK_S
        _assert_every_request_answered_once(g)
        after_kill = [r for r in g.records() if r["arrived_s"] > dropped + 0.5]
        assert after_kill and all("compute_2" not in r["node_ids"] for r in after_kill)

        g.restart("compute_2")
        t_restart = time.monotonic()

        def serving_again() -> bool:
            return any(r["arrived_s"] > t_restart and "compute_2" in r["node_ids"]
                       and r["node_rows"][r["node_ids"].index("compute_2")] > 0 for r in g.records())

        g.drive(until=serving_again, window=2, timeout_s=90.0)
        rejoin_s = time.monotonic() - t_restart
        probe = g.records()[-1]["shares"].get("compute_2", 0.0)

        def full_member() -> bool:
            plan = g.latest_plan()
            return "compute_2" in plan.node_ids and float(plan.shares[list(plan.node_ids).index("compute_2")]) > 0.15

        g.drive(until=full_member, window=2, timeout_s=60.0)
        t_full = time.monotonic()
        g.drive(4, window=2, timeout_s=60.0)
        records = _assert_every_request_answered_once(g)
        final = records[-1]["shares"]
        as_member = [r["shares"].get("compute_2", 0.0) for r in records if r["arrived_s"] > t_full]
        print(f"restarted compute_2 served rows {rejoin_s:.1f} s after the restart (share {probe:.3f}), "
              f"shares at the end {({n: round(s, 3) for n, s in final.items()})}; "
              f"{len(records)} requests in {time.monotonic() - t0:.1f} s")
        # requests ran with a full member's share, not the probe share (0.05); it moves with
        # telemetry noise after the wait above saw it over 0.15 (a clean-clone CI run ended at
        # 0.146 of an equal 1/3), and on a loaded machine the newest request once ran without it
        # (0.53/0.47 over the other two: the node, busy after its start, briefly out again)
        assert any(s > 2 * 0.05 for s in as_member), as_member
        assert not [n for n in g.dead_children() if n != "compute_2"] and "compute_2" not in g.dead_children()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))


def test_forged_new_incarnations_are_caught_by_the_authorities_they_impersonate():
    """Without the security option a listener cannot tell a forged new incarnation from a
    restart; the impersonated authority can. A forged plan (all rows to one node, a new
    incarnation) and a forged assignment reach every node; the coordinator and the scheduler see
    them on their own topics, re-announce under new incarnations, and every request is answered,
    complete, once."""
    from helpers import wait_routed

    from kaitian_ros.core.authority import new_incarnation
    from kaitian_ros.core.policy_state import Assignment
    from kaitian_ros.nodes import protocol as proto
    from kaitian_ros.runtime.api import QoS

    cfg = scenario_config(**MODEL, slowdowns=[1.0, 1.0], policy="adaptive", dead_after_s=2.0,
                          coordinator=SCHEDULER_STRIPES)
    with AdaptivityGraph(cfg, fork=shared_fork_server()) as g:
        g.wait_ready(timeout_s=90.0)
        g.drive(6, window=1, timeout_s=90.0)
        plan, proposal = g.latest_plan(), g.latest_assignment()
        forged_plans = g.rt.create_publisher(proto.PLAN_TOPIC, "LoadAssignment", QoS.LATCHED)
        forged_proposals = g.rt.create_publisher(proto.ASSIGNMENT_TOPIC, "LoadAssignment", QoS.LATCHED)
        wait_routed(forged_plans, "the nodes' subscriptions to the plan")
        wait_routed(forged_proposals, "the coordinator's subscription to the assignment")
        fake_plan, fake_proposal = new_incarnation(), new_incarnation()
        forged_plans.publish(proto.assignment_msg(
            Assignment(1, 0, ("compute_1",), (1.0,), "adaptive", "forged", 1.0), fake_plan))
        forged_proposals.publish(proto.assignment_msg(
            Assignment(1, 0, ("compute_0", "compute_1"), (0.0, 1.0), "adaptive", "forged", 1.0), fake_proposal))
        wait_until(lambda: int(g.latest_plan().incarnation) not in (int(plan.incarnation), fake_plan),
                   "the coordinator re-announcing its plan under a new incarnation", 30.0)
        wait_until(lambda: int(g.latest_assignment().incarnation) not in (int(proposal.incarnation), fake_proposal),
                   "the scheduler re-announcing under a new incarnation", 30.0)
        g.drive(6, window=1, timeout_s=90.0)
        _assert_every_request_answered_once(g)
        out = g.out.text()
        assert "re-announcing the plan as incarnation" in out and "impostor: another coordinator incarnation" in out
        assert "[scheduler]" in out and "impostor: another scheduler incarnation" in out
        assert not g.dead_children()
