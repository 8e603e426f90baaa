"""scheduler node: live telemetry -> versioned LoadAssignment (KAITIAN-style, but continuous).

All the decisions are the pure policy in :mod:`kaitian_ros.core.policy`; this node only feeds
it telemetry and heartbeats, calls ``decide`` on a timer, publishes the result on the latched
``/kaitian/assignment`` topic and reports on ``/diagnostics``. Every policy parameter is live
(``kaitian param set /scheduler min_gain 0.1`` or ``ros2 param set``) and validated by the
policy's own config checks, so a refused value comes back with the policy's reason.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, cast

from kaitian_ros.core import policy as pol
from kaitian_ros.core import policy_config
from kaitian_ros.core.authority import ImpersonationGuard, new_incarnation
from kaitian_ros.core.policy_config import config_from_params
from kaitian_ros.core.policy_state import Assignment, TelemetrySample
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime import run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime, SetParametersResult
from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher, Level

_TYPES = {"string": T.STRING, "double": T.DOUBLE, "integer": T.INTEGER, "bool": T.BOOL,
          "double_array": T.DOUBLE_ARRAY}
POLICY_PARAMETERS = tuple(
    P(d.name, _TYPES[d.type], list(cast(Sequence[float], d.default)) if d.type == "double_array" else d.default,
      d.description,
      # a node is live if its heartbeats come: the policy itself takes any timeout, the node
      # no less than two of the slowest heartbeats
      proto.MIN_DEAD_AFTER_S if d.name == "dead_after_s" else d.min, d.max, choices=d.choices)
    for d in policy_config.PARAMETERS)
NODE_PARAMETERS = (
    P("compute_nodes", T.STRING_ARRAY, ["compute_0", "compute_1"], "compute node ids in row order",
      read_only=True),
    P("decide_period_s", T.DOUBLE, 0.1, "how often the policy is asked for a decision", 0.01, 60.0),
    P("lead_requests", T.INTEGER, 2, "an assignment takes effect this many requests after the newest seen",
      0, 1000),
)

PARAMETERS = NODE_PARAMETERS + POLICY_PARAMETERS
IMPOSTOR_REPORT_S = 30.0  # ERROR on /diagnostics this long after a forged assignment was seen
TELEMETRY_FRESH_S = 2.0  # telemetry "flows" while its newest sample is younger than this
STALL_PERIODS, STALL_MIN_S = 5, 2.0  # decisions missing this long while it flows: ERROR


class Scheduler:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        problem = proto.static_shares_problem(self.params["static_shares"], self.params["compute_nodes"],
                                           empty_ok=True)
        if problem:
            raise ValueError(problem)
        self.config = config_from_params({d.name: self.params[d.name] for d in policy_config.PARAMETERS})
        self.state = pol.initial_state(self.config, tuple(self.params["compute_nodes"]))
        self.newest_request = 0
        self.published = 0
        self.incarnation = new_incarnation()  # a restarted scheduler is a new authority (core.authority)
        self.guard = ImpersonationGuard("scheduler", self.incarnation)  # forged assignments on our topic
        self.telemetry_s = 0.0  # monotonic time of the newest telemetry sample (0: none yet)
        self.decided_s = time.monotonic()  # of the newest decision that ran through
        self.decide_errors = 0
        self.last_decide_error = ""
        self.last: Assignment | None = None
        self.pub = rt.create_publisher(proto.ASSIGNMENT_TOPIC, "LoadAssignment", QoS.LATCHED)
        self.diagnostics = DiagnosticsPublisher(rt, hardware_id="cpu")
        rt.create_subscription(proto.TELEMETRY_TOPIC, "NodeTelemetry", self._on_telemetry)
        rt.create_subscription(proto.ASSIGNMENT_TOPIC, "LoadAssignment", self._on_assignment_topic, QoS.LATCHED)
        rt.add_on_set_parameters_callback(self._on_set)
        self.timer = rt.create_timer(self.params["decide_period_s"], self._decide)
        rt.create_timer(1.0, self._report)
        rt.logger.info(f"policy {self.config.policy} over {self.params['compute_nodes']}")

    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        if "static_shares" in changes:
            problem = proto.static_shares_problem(changes["static_shares"], self.params["compute_nodes"], empty_ok=True)
            if problem:
                return SetParametersResult(False, problem)
        policy_changes = {k: v for k, v in changes.items() if k in {d.name for d in policy_config.PARAMETERS}}
        try:
            config = config_from_params(policy_changes, base=self.config) if policy_changes else self.config
        except ValueError as exc:
            return SetParametersResult(False, str(exc))
        self.config = config
        self.params = self.params | changes
        if "decide_period_s" in changes:
            self.timer.cancel()
            self.timer = self.rt.create_timer(changes["decide_period_s"], self._decide)
        return SetParametersResult(True)

    def _on_telemetry(self, msg: Any) -> None:
        if msg.node_id not in self.params["compute_nodes"]:
            return
        now = self.rt.now()
        if msg.request_id == 0:
            self.state = pol.heartbeat(self.state, msg.node_id, now, self.config)
            return
        problem = proto.request_id_problem(int(msg.request_id)) or proto.telemetry_problem(msg)
        if problem:
            self.rt.rejected.count(f"{problem} from {msg.node_id}")
            return
        self.newest_request = max(self.newest_request, int(msg.request_id))
        self.telemetry_s = time.monotonic()
        sample = TelemetrySample(
            node_id=msg.node_id, request_id=int(msg.request_id), rows=int(msg.rows), work=float(msg.work),
            compute_ms=float(msg.compute_ms), transfer_ms=float(msg.transfer_ms), wait_ms=float(msg.wait_ms),
            # transfer_ms is the spread of the node's incoming rows, so pair it with the bytes that
            # came in; outgoing halo/output bytes overlap with compute and would inflate the link term
            bytes_in=int(msg.bytes_in), bytes_out=0, stamp_s=now,
            share=float(msg.share) if msg.share > 0.0 else 0.0)
        self.state = pol.observe(self.state, sample, self.config)

    def _decide(self) -> None:
        owed = self.guard.due(time.monotonic())
        if owed is not None:
            self._reincarnate(owed, "impostor seen while the last re-announcement was recent")
        try:
            self.state, assignment = pol.decide(self.state, self.rt.now(), self.newest_request, self.config,
                                                self.params["lead_requests"])
            self.decided_s = time.monotonic()
            if assignment is None:
                return
            msg = proto.assignment_msg(assignment, self.incarnation)
        except Exception as exc:  # noqa: BLE001 - one bad input must not end adaptation: reported, tried again
            self.decide_errors += 1
            self.last_decide_error = f"{type(exc).__name__}: {exc}"
            self.rt.logger.error(f"decision failed: {self.last_decide_error}")
            return
        self._publish(assignment, msg)
        self.rt.logger.info(f"assignment v{assignment.version} from request {assignment.effective_from_request}: "
                            f"{assignment.reason}")

    def _publish(self, assignment: Assignment, msg: Any) -> None:
        self.last = assignment
        self.published += 1
        self.guard.published(assignment.version, proto.assignment_digest(msg))
        self.pub.publish(msg)

    def _on_assignment_topic(self, msg: Any) -> None:
        """Our own topic: an assignment we did not publish is forged; publish ours again under a
        new incarnation, which the coordinator follows as a restart (retiring the impostor's)."""
        reason, incarnation = proto.answer_on_own_topic(self.rt, self.guard, msg, proto.ASSIGNMENT_TOPIC,
                                                        time.monotonic())
        if incarnation is not None:
            self._reincarnate(incarnation, reason)

    def _reincarnate(self, incarnation: int, reason: str) -> None:
        self.incarnation = incarnation
        self.rt.logger.warning(f"{reason}: re-announcing as incarnation {incarnation:016x}")
        if self.last is not None:
            again = dataclasses.replace(self.last, version=self.last.version + 1,
                                        effective_from_request=self.newest_request + self.params["lead_requests"],
                                        reason=f"re-announced after an impostor: {self.last.reason}")
            self.state = dataclasses.replace(self.state, assignment=again)  # the policy numbers on from it
            self._publish(again, proto.assignment_msg(again, self.incarnation))

    def _report(self) -> None:
        values: dict[str, Any] = {"policy": self.config.policy, "published": self.published,
                                  "newest_request": self.newest_request}
        for node_id, est in self.state.estimates.items():
            values[f"{node_id}.speed_flops_per_ms"] = f"{est.speed:.3g}"
            values[f"{node_id}.link_bytes_per_ms"] = f"{est.link_rate:.3g}"
            values[f"{node_id}.samples"] = est.samples
            values[f"{node_id}.alive"] = node_id in self.state.members and node_id not in self.state.dead
        values["incarnation"] = f"{self.incarnation:016x}"
        now = time.monotonic()
        flowing = self.telemetry_s and now - self.telemetry_s < TELEMETRY_FRESH_S
        if self.last is not None:
            values |= {f"share.{n}": f"{s:.3f}" for n, s in zip(self.last.node_ids, self.last.shares)}
            text, level = f"v{self.last.version}: {self.last.reason}", Level.OK
        elif flowing:
            text, level = "telemetry flows but no assignment yet (members still warming up?)", Level.WARN
        else:
            text, level = "waiting for telemetry", Level.WARN
        stalled_s = now - self.decided_s
        if flowing and stalled_s > max(STALL_PERIODS * self.params["decide_period_s"], STALL_MIN_S):
            values["decisions_stalled_s"] = f"{stalled_s:.1f}"
            text, level = f"no decision for {stalled_s:.1f} s although telemetry flows", Level.ERROR
        if self.guard.impostor_within(time.monotonic(), IMPOSTOR_REPORT_S):
            text, level = (f"forged assignments on {proto.ASSIGNMENT_TOPIC} ({self.guard.impostors}): "
                           f"re-announced as a new incarnation"), Level.ERROR
        if self.decide_errors:
            values |= {"decide_errors": self.decide_errors, "last_decide_error": self.last_decide_error}
            text, level = f"decisions failing ({self.decide_errors}): {self.last_decide_error}", Level.ERROR
            self.telemetry_s = 0.0  # monotonic time of the newest telemetry sample (0: none yet)
        self.decided_s = time.monotonic()  # of the newest decision that ran through
        self.decide_errors = 0
        self.diagnostics.publish(level, text, values)


def main(argv: list[str] | None = None) -> int:
    return run_node(Scheduler, "scheduler", argv)


if __name__ == "__main__":
    raise SystemExit(main())
