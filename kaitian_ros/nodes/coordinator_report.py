"""The coordinator's /diagnostics status: frames, latency, the plan in effect and its
runner-up, the planner process, links, and what needs attention (timeouts, forged plans, no
scheduler)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kaitian_ros.core import lateness
from kaitian_ros.core.graph import ModelGraph
from kaitian_ros.core.plan import Plan
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime.diagnostics import Level

if TYPE_CHECKING:
    from kaitian_ros.nodes.coordinator import Coordinator

IMPOSTOR_REPORT_S = 30.0  # ERROR on /diagnostics this long after a forged plan was seen


def plan_text(graph: ModelGraph, plan: Plan) -> str:
    """The plan in words, with the slabs its input rows are sent in."""
    return plan.spec.describe(graph) + (", whole image" if plan.whole_image
                                        else f", slabs of {plan.slab_rows} rows")


def planner_state(c: Coordinator) -> str:
    """`starting` (planning rounds run on the executor until the planner process has built
    its graph), `ready`, or `lost` (it died: every round on the executor)."""
    if c.planner_lost or not c.planner.alive():
        return "lost"
    return "ready" if c.planner.is_ready() else "starting"


def report(c: Coordinator) -> None:
    """Publish the coordinator's /diagnostics status (every second)."""
    lat = sorted(c.latencies)
    p50 = lat[len(lat) // 2] if lat else 0.0
    p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))] if lat else 0.0
    level = Level.OK if c.current and c.alive else Level.WARN
    text = (f"{c.counts['completed']} frames, p50 {p50:.1f} ms" if c.current
            else "waiting for compute nodes")
    plan = c.running_plan()
    if plan is not None:
        text += f", {plan_text(c.graph, plan)} (predicted {c.predicted_ms:.1f} ms)"
    held = lateness.held_out(c.quarantines)
    if held:
        level, text = Level.WARN, text + ", late and out of the plan for now: " + ", ".join(sorted(held))
    if c.counts["timeouts"]:
        level, text = Level.WARN, text + f", {c.counts['timeouts']} timed out"
    if c.guard.impostor_within(time.monotonic(), IMPOSTOR_REPORT_S):
        level, text = Level.ERROR, text + (f", forged plans on {proto.PLAN_TOPIC} ({c.guard.impostors}): "
                                           f"re-announced as a new incarnation")
    silent_s = time.monotonic() - c.assignment_s
    if c.params["use_scheduler"] and c.assignment is None and c.alive and silent_s > c.params["assignment_warn_s"]:
        # a latched topic: a running scheduler's assignment reaches a new coordinator at once
        level, text = Level.WARN, (text + f", no assignment from the scheduler in {silent_s:.0f} s "
                                          "although compute nodes report (scheduler down or refused?)")
    ru = c.choice.runner_up if c.choice is not None else None
    c.diagnostics.publish(level, text, {
        "plan_version": c.current.version if c.current else 0,
        "incarnation": f"{c.incarnation:016x}", "scheduler_restarts": c.scheduler_authority.restarts,
        # which scheduler run and version it follows (a forged or replayed proposal shows here)
        "scheduler_incarnation": f"{c.scheduler_authority.incarnation:016x}",
        "scheduler_version": c.scheduler_authority.version,
        "strategy": plan.strategy if plan is not None else "",
        "plan": plan_text(c.graph, plan) if plan is not None else "",
        # the node taking the camera images itself under the plan in effect ('' = through us)
        "direct": c.direct_versions.get(c.current.version, "") if c.current else "",
        "predicted_ms": f"{c.predicted_ms:.1f}",
        "runner_up": ru.label if ru is not None else "",
        "runner_up_ms": f"{ru.predicted_ms:.1f}" if ru is not None else "",
        "profiles": ",".join(f"{n}:v{p.version}" for n, p in sorted(c.profiles.items())),
        "pre_ms": f"{c.pre_ms:.2f}", "post_ms": f"{c.post_ms:.2f}",
        "send_ms_per_mb": f"{c.send_ms_per_mb:.2f}",
        "links_in": ",".join(f"{n}:{e.bytes_per_ms * 8e-3:.0f}Mbit/{e.latency_ms:.2f}ms" for n, m in
                             sorted(c.meters.items()) if (e := m.estimate()) is not None),
        "planner": planner_state(c), "plan_round_ms": f"{c.planner.last_round_ms:.0f}",
        "alive": ",".join(c.alive), "in_flight": len(c.requests),
        "late": ",".join(f"{n}:{_quarantine_left(q.until_s)}" for n, q in sorted(held.items())),
        # requests on each node in the last second, its drops for being behind included
        "load": ",".join(f"{n}:{load}" for n, load in c.node_loads().items()),
        "latency_p50_ms": f"{p50:.1f}", "latency_p95_ms": f"{p95:.1f}"}
        | dict(c.counts))


def _quarantine_left(until_s: float) -> str:
    """A late node's state: the quarantine time left, or waiting for a heartbeat that shows no
    more requests in progress than the coordinator sent it."""
    left = until_s - time.monotonic()
    return f"{left:.1f}s left" if left > 0 else "waiting for a plausible heartbeat"
