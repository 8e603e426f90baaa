"""coordinator node: camera frames in, fused results out.

For every sensor_msgs/Image on ``input_topic`` it preprocesses the frame, opens a request
under the current plan version, streams each compute node its input rows in slabs, gathers
the OUTPUT rows, runs the head and publishes FusedOutput on ``/kaitian/fused``.

It is the single authority on plan versions (``/kaitian/plan``, latched). Its planner
(`core.planner`) predicts every candidate - the whole trunk on each node, every layer-wise
cut and order, row stripes with the scheduler's shares and with shares by measured speed -
from the cost profiles the compute nodes publish (``/kaitian/profiles``) and the links it and
they measured, and runs the fastest (``strategy`` forces one). It replans when the scheduler
proposes shares, when a node joins or leaves, when a profile changes and every
``replan_period_s``, switching only for a predicted gain of ``min_plan_gain``. A compute node
that stops sending heartbeats leaves the plan; its in-flight requests are re-dispatched to the
survivors under a new version so no frame is lost.

Requests run in `coordinator_requests`, late nodes are judged in `coordinator_lateness`,
/diagnostics in `coordinator_report`, parameters in
`coordinator_params`, plan prices in `coordinator_costs`, plans that ran in `core.plan_memory`,
what a measured latency sets off in `coordinator_measured`.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import time
from typing import Any

import torch

from kaitian_ros.core import exploration, planner
from kaitian_ros.core.authority import AuthorityTracker, ImpersonationGuard, new_incarnation
from kaitian_ros.core.costs import DeviceProfile, LinkMeter, profile_problem
from kaitian_ros.core.plan import Plan, same_spec
from kaitian_ros.core.plan_memory import PlanMemory, same_speed
from kaitian_ros.core.policy import Assignment
from kaitian_ros.nodes import compute_prepare
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.nodes.coordinator_costs import planning_costs
from kaitian_ros.nodes.coordinator_direct import DirectPath
from kaitian_ros.nodes.coordinator_measured import observe_latency
from kaitian_ros.nodes.coordinator_params import PARAMETERS, PLAN_SETTINGS
from kaitian_ros.nodes.coordinator_report import report
from kaitian_ros.nodes.coordinator_requests import Request
from kaitian_ros.nodes.planner_process import PlanRequest, plan_round, planner_for, prefork
from kaitian_ros.runtime import run_node
from kaitian_ros.runtime.api import MessageInfo, QoS, Runtime, SetParametersResult
from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher

# a departed node's own samples reach us before the end of its liveliness: telemetry received
# before its departure was handled, or this soon after (rclpy stamps receipt in the executor),
# is from the dead process. Short: a warm respawn sends its first heartbeat ~0.7 s after death
DEPARTED_QUIET_S = 0.25


class Coordinator(DirectPath):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        torch.set_num_threads(self.params["threads"])
        problem = proto.static_shares_problem(self.params["static_shares"], self.params["compute_nodes"])
        if problem:
            raise ValueError(problem)
        self.spec = ic.ModelSpec.from_params(self.params)
        self.labels = ic.load_labels(self.params["labels"], self.params["labels_file"], self.spec.num_classes)
        # forked from the fork server after it prepared the compute nodes: their model, built
        prepared = compute_prepare.take_graph(self.spec, "cpu")
        self.graph = prepared or ic.build_graph(self.spec)
        self.out_shape = self.graph.trunk_output_shape
        self.nodes = tuple(self.params["compute_nodes"])
        self.last_seen: dict[str, float] = {}
        self.alive: tuple[str, ...] = ()
        self.assignment: Assignment | None = None  # scheduler's latest proposal
        self.assignment_s = time.monotonic()  # of the latest accepted proposal (start: none yet)
        # compute node -> (monotonic, wall) time its session's end was handled
        self.departed: dict[str, tuple[float, float]] = {}
        self.delivered: set[str] = set()  # nodes that delivered rows: warm, judged by lateness
        self._start_lateness_watch()
        self.oldest_finished_s = 0.0  # wall time the oldest request in flight last completed or timed out
        self.current: Assignment | None = None
        self.pending: Assignment | None = None  # adopted, effective from a later request
        self.plans: dict[int, Plan] = {}
        self.profiles: dict[str, DeviceProfile] = {}
        self.meters: dict[str, LinkMeter] = {}  # compute node -> coordinator links (OUTPUT chunks)
        self.pre_ms = 0.0  # image received -> preprocessed, ready to send (EWMA)
        self.post_ms = 0.0  # last OUTPUT chunk -> result published (EWMA)
        self.send_ms_per_mb = 0.0  # publishing cost of chunk payload (EWMA)
        self.choice: planner.Choice | None = None  # the planner's newest choice
        self.exploration = exploration.Exploration()  # the trials' share of the requests (`core.exploration`)
        self.searched_versions: dict[int, bool] = {}  # plan version chosen by our own search -> a trial
        self.memory = PlanMemory()  # what plans really took lately, the plans nodes left
        self.unmeasured_version: int | None = None  # the newest plan version until its first request completes
        self.predicted_ms = 0.0  # the newest plan's latency as last predicted
        self.measure_replanned = 0  # the plan version a measurement last made the planner look again at
        # a streaming twin on trial: (its plan version, the spec_key of the plan it was tried from)
        self.twin_trial: tuple[int, tuple] | None = None
        self.planner, self.planner_lost = planner_for(self.spec), False  # planning rounds off the executor
        self._replan_again: tuple[str, int] | None = None
        self.last_replan = 0.0
        self.last_material: tuple | None = None  # inputs of the last planning round submitted
        self.requests: dict[int, Request] = {}
        self.direct_versions: dict[int, str] = {}  # plan version -> its node taking the camera images
        self.direct_returns = 0
        self.direct_off_until: float | None = None  # monotonic: the direct path is off until then
        self.waiting: Any = None  # newest image waiting for an in-flight slot
        # a restarted coordinator is a new authority: compute nodes reset their plan bookkeeping
        # on a new incarnation, and its request ids continue above the old run's
        self.incarnation = new_incarnation()
        self.guard = ImpersonationGuard("coordinator", self.incarnation)  # forged plans on our topic
        self.next_request = proto.first_request_id()
        self.scheduler_authority = AuthorityTracker("scheduler")
        self.counts: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque = collections.deque(maxlen=200)
        self.chunk_pubs = {n: rt.create_publisher(proto.chunk_topic(n), "TensorChunk") for n in self.nodes}
        self.plan_pub = rt.create_publisher(proto.PLAN_TOPIC, "LoadAssignment", QoS.LATCHED)
        self.fused_pub = rt.create_publisher(proto.FUSED_TOPIC, "FusedOutput")
        self.diagnostics = DiagnosticsPublisher(rt, hardware_id="cpu")
        self._sendq: queue.SimpleQueue | None = None
        rt.create_subscription(proto.TELEMETRY_TOPIC, "NodeTelemetry", self._on_telemetry, with_info=True)
        rt.create_subscription(proto.ASSIGNMENT_TOPIC, "LoadAssignment", self._on_assignment, QoS.LATCHED)
        rt.create_subscription(proto.PROFILES_TOPIC, "CostProfile", self._on_profile, QoS.LATCHED)
        rt.create_subscription(proto.chunk_topic(proto.COORDINATOR), "TensorChunk", self._on_chunk, with_info=True)
        rt.create_subscription(proto.PLAN_TOPIC, "LoadAssignment", self._on_plan_topic, QoS.LATCHED)
        rt.on_node_gone(self._on_node_gone)
        self.image_sub = rt.create_subscription(self.params["input_topic"], "Image", self._on_image, QoS.BEST_EFFORT)
        rt.add_on_set_parameters_callback(self._on_set)
        rt.create_timer(0.05, self._check)
        rt.create_timer(1.0, lambda: report(self))
        rt.logger.info(f"{self.spec.name} {self.spec.input_shape} -> trunk {self.out_shape}, "
                       f"compute nodes {list(self.nodes)}" + (" (model built by the fork server)" if prepared else ""))

    def close(self) -> None:
        self.planner.close()

    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        if "static_shares" in changes:
            problem = proto.static_shares_problem(changes["static_shares"], list(self.nodes))
            if problem:
                return SetParametersResult(False, problem)
        if "threads" in changes:
            torch.set_num_threads(changes["threads"])
        direct = {k for k in ("direct_single", "input_pacing_ms") if k in changes and changes[k] != self.params[k]}
        self.params = self.params | changes
        if direct:
            self.direct_off_until = None
            self._direct_changed(f"{', '.join(sorted(direct))} set")
        if set(PLAN_SETTINGS) & set(changes):
            # self.params already holds the new values; the runtime applies them after we return
            self.memory.forget_departures()
            self._replan(f"{', '.join(sorted(changes))} set", force=True, resume=True)
        return SetParametersResult(True)

    # --- membership and plans -----------------------------------------------------------
    def _on_telemetry(self, msg: Any, info: MessageInfo) -> None:
        if msg.node_id not in self.nodes:
            return
        gone_mono, gone_wall = self.departed.get(msg.node_id, (float("-inf"), float("-inf")))
        if info.received_s <= gone_wall or time.monotonic() - gone_mono < DEPARTED_QUIET_S:
            return  # sent before it died, handled after: it must not rejoin the dead node
        self._note_load(msg)
        if self._held_out(msg.node_id, int(msg.queue_depth)):
            return
        first = msg.node_id not in self.alive
        self.last_seen[msg.node_id] = time.monotonic()
        if first:
            self.alive = tuple(n for n in self.nodes if n in self.last_seen and
                               time.monotonic() - self.last_seen[n] < self.params["dead_after_s"])
            if not self._restore_plan_it_left(msg.node_id):
                self._replan(f"{msg.node_id} joined", force=True)

    def _restore_plan_it_left(self, node: str) -> bool:
        """A node that comes back (a respawned process), the other nodes of the plan it left at
        the speed they had, gets that plan at once and without a search: the planner had
        settled on it with everything it knew, while a search at the rejoin first tried plans
        the model over-rated (kill_compute took 3-5 s back to the pre-fault latency so). The
        periodic rounds refine it from there."""
        d, why_not = self.memory.take_departure(node, time.monotonic(), self.params["strategy"], self.alive,
                                                self.profiles)
        if why_not:
            self.rt.logger.info(why_not)
        if d is None:
            return False
        request = self.plan_request(f"{node} joined again", 0, True)
        if request is None or not set(d.spec.node_ids) <= set(request.nodes):
            return False  # fixed shares that leave a node of it out now: plan by them
        cand = planner.Candidate(d.spec, d.predicted_ms, f"{d.spec.describe(self.graph)} (the plan it left)",
                                 d.measured_ms, d.slab_rows)
        self.apply_plan(request, planner.Choice(cand, None, (cand,)), None)
        return True

    def _on_profile(self, msg: Any) -> None:
        try:
            profile = ic.profile_from_msg(msg)
        except ValueError as exc:
            self.rt.rejected.count(f"bad profile (malformed): {exc}")
            return
        problem = profile_problem(profile, n_ops=len(self.graph.ops), model=self.spec.key,
                                  known_nodes=self.nodes)
        if problem:  # counted by category; the node's last good profile stays in use
            category, _, detail = problem.partition(": ")
            self.rt.rejected.count(f"bad profile ({category}): {detail}")
            return
        old = self.profiles.get(profile.node_id)
        if old is not None and profile.version == old.version:
            return  # the same profile again (a latched re-delivery)
        self.profiles[profile.node_id] = profile
        # a device that changed speed is planned for at once; smaller refinements wait for the
        # periodic round (every full search costs the coordinator's host CPU time)
        if profile.node_id in self.alive and (old is None or not same_speed(old.trunk_ms, profile.trunk_ms)):
            running = self.running_plan()
            self.replan_soon(f"{profile.node_id} profile v{profile.version}: trunk "
                              f"{old.trunk_ms if old else 0.0:.1f} -> {profile.trunk_ms:.1f} ms",
                              quick=running is not None and profile.node_id in running.active_nodes())

    def _on_assignment(self, msg: Any) -> None:
        if not self.params["use_scheduler"]:
            return
        try:
            proposal = proto.assignment_from_msg(msg)
        except ValueError as exc:
            self.rt.rejected.count(f"bad assignment: {exc}")
            return
        if proposal.effective_from_request > self.next_request + proto.MAX_EFFECTIVE_LEAD:
            self.rt.rejected.count(f"implausible effective_from_request: scheduler v{proposal.version} from request "
                                   f"{proposal.effective_from_request}, next request is {self.next_request}")
            return
        if proto.accept_versioned(self.rt, self.scheduler_authority, msg) is None:
            return
        previous, self.assignment = self.assignment, proposal
        self.assignment_s = time.monotonic()
        if self.params["share_search"] and proposal.policy == "adaptive" and previous is not None and \
                previous.policy == "adaptive" and proto.members(previous) == proto.members(proposal):
            # the planner searches shares by the nodes' measured speeds itself: the scheduler's
            # newest shares are one candidate among those, taken at the next round. A round per
            # proposal kept the planner process busy back to back while speeds changed (the
            # scheduler proposes every few hundred ms then) - a core the compute nodes lacked
            return
        self.replan_soon(f"scheduler v{proposal.version}: {proposal.reason}",
                          effective=proposal.effective_from_request, proposal=True)

    def shares_for(self, alive: tuple[str, ...]) -> tuple[tuple[float, ...], str]:
        """The proposed shares of the alive nodes (aligned with `alive`) and their policy."""
        if self.params["use_scheduler"] and self.assignment is not None:
            table = dict(zip(self.assignment.node_ids, self.assignment.shares))
            if any(table.get(n, 0.0) > 0 for n in alive):
                return tuple(table.get(n, 0.0) for n in alive), self.assignment.policy
        table = dict(zip(self.nodes, self.params["static_shares"]))
        return tuple(table[n] for n in alive), "static"

    def _observe_latency(self, plan: Plan, ms: float) -> None:
        observe_latency(self, plan, ms)

    def running_plan(self) -> Plan | None:
        """The plan of the version in effect (None before the first)."""
        return self.plans.get(self.current.version) if self.current is not None else None

    def _replan(self, reason: str, effective: int = 0, force: bool = False, resume: bool = False) -> None:
        """Choose the plan for the alive nodes now (membership, parameters: `force`), and
        publish it as a new version if it differs from the newest one. `resume`: parameters
        were set; a measured plan that ran under them before is kept unless clearly beaten."""
        request = self.plan_request(reason, effective, force, resume)
        if request is not None:
            self.last_material = request.material()
            self.apply_plan(request, *plan_round(self.graph, request))

    def replan_soon(self, reason: str, effective: int = 0, proposal: bool = False, quick: bool = False,
                     periodic: bool = False) -> None:
        """Re-predict with new measurements in the planner process (a full search takes up to a
        few hundred ms: the executor goes on serving frames); `_check` applies the result.
        Only the adaptive policy follows measurements: with fixed shares (no scheduler, or the
        scheduler's static/equal/profile_once policies) a plan is chosen when the nodes, the
        parameters or the proposed shares (`proposal`) change, and then kept.
        `quick`: a node of the running plan changed speed, or a split measured worse than it
        should - first a round over single-node plans only (a few ms instead of a full search's
        100-350 ms, or seconds on a slow machine, while every request runs slow), then the full search.
        `periodic`: nothing happened but time passed - skipped when every input of the round
        is where it was at the last round (`PlanRequest.material`): the same choice again."""
        self.last_replan = time.monotonic()
        if not proposal and self.shares_for(tuple(n for n in self.nodes if n in self.alive))[1] != "adaptive":
            return
        if self.planner.busy is not None:
            self._replan_again = (reason, max(effective, self._replan_again[1] if self._replan_again else 0))
            return
        request = self.plan_request(reason, effective, False)
        if request is None:
            return
        material = request.material()
        if periodic and material == self.last_material:
            self.counts["plan_rounds_skipped"] += 1
            return
        self.last_material = material
        if self.planner.is_ready():
            if quick and request.strategy == "auto":
                request = dataclasses.replace(request, quick=True)
                self._replan_again = (reason, effective)
            self.planner.submit(request)
            self.counts["plan_rounds"] += 1
            return
        if not self.planner.alive() and not self.planner_lost:  # killed, out of memory: plan here
            self.planner_lost = True
            self.rt.logger.warning("planner process not running: planning on the executor from now on")
        # still starting: the first seconds (nodes join, the scheduler adapts) must not wait for it
        self.apply_plan(request, *plan_round(self.graph, request))

    def _collect_plan(self) -> None:
        """Apply a finished planning round's choice (on the executor thread)."""
        planned = self.planner.result()
        if planned is None and self.planner.busy is not None and not self.planner.alive():
            self.planner.busy = None  # it died during the round: plan again (on the executor)
        if self.planner.busy is not None:
            return
        if planned is not None:
            request = planned[0]
            latest = self.pending or self.current
            # a structural change while it planned was planned again at once: drop this result
            if request.alive == tuple(n for n in self.nodes if n in self.alive) and \
                    request.latest_version == (latest.version if latest else 0):
                self.apply_plan(*planned)
        if self._replan_again is not None:
            reason, effective = self._replan_again
            self._replan_again = None
            self.replan_soon(reason, effective, proposal=True)

    def _settings(self) -> tuple:
        return tuple(tuple(v) if isinstance(v := self.params[k], list) else v for k in PLAN_SETTINGS)

    def plan_request(self, reason: str, effective: int, force: bool, resume: bool = False) -> PlanRequest | None:
        self.last_replan = time.monotonic()
        alive = tuple(n for n in self.nodes if n in self.alive)
        shares, policy = self.shares_for(alive)
        nodes = alive
        if policy != "adaptive":
            # fixed shares say which nodes take part: a zero share keeps a node out of every
            # candidate (the adaptive policy's shares are only a starting point)
            nodes, shares = tuple(n for n, x in zip(alive, shares) if x > 0), tuple(x for x in shares if x > 0)
        if not nodes or sum(shares) <= 0:
            if self.current is not None:
                self.rt.logger.warning(f"no compute node available ({reason})")
            return None
        costs, missing = planning_costs(
            self.graph, self.spec.key, self.profiles, self.meters, nodes, shares,
            plan_link_mbit=self.params["plan_link_mbit"], slab_rows=self.params["slab_rows"], pre_ms=self.pre_ms,
            post_ms=self.post_ms, send_ms_per_mb=self.send_ms_per_mb)
        latest = self.pending or self.current
        old = self.plans.get(latest.version) if latest is not None else None
        search = policy == "adaptive" and self.params["share_search"]
        now = time.monotonic()
        measured = self.memory.measured(now, self.profiles, self.alive)
        again = self.memory.resumable(self._settings(), now, self.profiles, self.alive) if resume else None
        return PlanRequest(reason, effective, force, alive, nodes, shares, policy, search,
                           self.params["min_plan_gain"], measured, costs, tuple(missing),
                           self.params["slab_rows"], self.params["strategy"],
                           latest.version if latest else 0, old.spec if old is not None else None,
                           old.slab_rows if old is not None else 0,
                           # input pacing emulates a slow link per slab: one slab would skip it
                           self.params["input_pacing_ms"] <= 0, self.memory.earlier_errors(now), resume=again)

    def apply_plan(self, request: PlanRequest, choice: planner.Choice | None, was: Any) -> None:
        if choice is None:
            self.rt.logger.error(f"cannot plan over {request.nodes} ({request.reason}): {was}")
            return
        self.choice = choice
        force = request.force
        if self.pending is not None and self.current is not None and any(
                n not in self.alive for n in self.plans[self.current.version].active_nodes()):
            # the running plan sends rows to a lost node while the next one waits for its
            # effective request: switch now (the caller then re-dispatches in-flight requests)
            self._activate(dataclasses.replace(self.pending, effective_from_request=self.next_request))
        searching = request.share_search
        if searching and exploration.is_trial(choice.best) and not self.exploration.may_try(
                request.alive, self.profiles, self.params["trial_share"]):
            measured = exploration.without_trial(choice)
            if measured is not None:
                self.counts["trials_declined"] += 1
                self.rt.logger.debug(f"trials took their share of the requests: {measured.best.label} instead of "
                                     f"{choice.best.label} ({request.reason})")
                choice = measured
        latest = self.pending or self.current
        spec = choice.best.spec
        old = self.plans.get(latest.version) if latest is not None else None
        if old is not None and same_spec(old.spec, spec) and old.slab_rows == choice.best.slab_rows:
            self.predicted_ms = choice.best.predicted_ms
            return
        if old is not None and request.strategy != "auto" and old.spec.strategy != request.strategy:
            force = True  # the running plan is a fallback (too few nodes for the strategy asked)
        # the running plan can go on: switch only for a clear gain (no flapping between near-equal
        # plans on measurement noise); by measurement where there is one. Not when the shares are
        # the scheduler's (`share_search` off, or a fixed policy): then its proposal is the plan,
        # e.g. a probe share for a node that (re)joined, which must get rows to be measured at all
        if (old is not None and not force and request.share_search and was is not None
                and set(old.active_nodes()) <= set(request.nodes)
                and not planner.worth_switching(was.expected_ms, was.measured, choice.best,
                                                self.params["min_plan_gain"])):
            self.predicted_ms = was.predicted_ms
            return
        self.predicted_ms = choice.best.predicted_ms
        plan = choice.plan(self.graph)
        text = f"{request.reason}: {choice.summary()}"
        if request.missing:
            text += f" (no cost profile yet from {', '.join(request.missing)}: priors)"
        version = (latest.version + 1) if latest else 1
        effective = request.effective
        pv = Assignment(version, max(self.next_request, effective), plan.node_ids, plan.shares,
                        request.policy, text, choice.best.predicted_ms)
        self.plans[version] = plan
        if searching:
            trial = exploration.is_trial(choice.best)
            self.searched_versions = {v: t for v, t in self.searched_versions.items() if v > version - 64}
            self.searched_versions[version] = trial
            if trial:
                self.counts["trials"] += 1
                self.exploration = self.exploration.tried(request.alive, self.profiles)
        if effective > self.next_request:
            # the scheduler asked for a switch at a later request: hold it until then
            self.pending = pv
            return
        self._activate(pv)

    def _activate(self, pv: Assignment) -> None:
        version = pv.version
        self.pending = None
        self.current = pv
        self.unmeasured_version = version
        plan = self.plans[version]
        self.memory.ran_with(self._settings(), plan)
        ru = self.choice.runner_up if self.choice is not None else None
        direct = self._direct_node(plan)
        if direct:
            self.direct_versions[version] = direct
        msg = proto.assignment_msg(pv, self.incarnation, plan, ru.label if ru else "", ru.predicted_ms if ru else 0.0,
                                   self.image_sub.topic if direct else "")
        self.guard.published(version, proto.assignment_digest(msg))
        self.plan_pub.publish(msg)
        self.rt.logger.info(f"plan v{version}: {pv.reason}")
        in_use = {r.version for r in self.requests.values()} | {version} | (
            {self.pending.version} if self.pending else set())
        self.plans = {v: p for v, p in self.plans.items() if v in in_use}
        self.direct_versions = {v: n for v, n in self.direct_versions.items() if v in self.plans}

    # --- supervision --------------------------------------------------------------------
    def _on_node_gone(self, fqn: str) -> None:
        """A compute node's process ended (its session with it): out of the plan now, its
        requests in flight sent again, instead of waiting dead_after_s for its heartbeats."""
        name = fqn.rsplit("/", 1)[-1]
        if name in self.nodes:
            self.departed[name] = (time.monotonic(), time.time())
            if name in self.quarantines:  # a new process of it is not the late one
                self.quarantines[name] = dataclasses.replace(self.quarantines[name], ended=True)
        if name in self.alive:
            self.counts["departures"] += 1
            self._drop([name], "left the graph")

    def _drop(self, dead: list[str], why: str, label: str = "lost") -> None:
        running = self.running_plan()
        if running is not None:
            self.memory.record_departure(running, dead, self.predicted_ms, time.monotonic(), self.profiles)
        self.alive = tuple(n for n in self.alive if n not in dead)
        for n in dead:
            self.last_seen.pop(n, None)
        self.rt.logger.warning(f"compute node(s) {dead} {why}: leaving the plan")
        self._replan(f"{', '.join(dead)} {label}", force=True)
        self._redispatch(set(dead))

    def _check(self) -> None:
        now_m = time.monotonic()
        owed = self.guard.due(now_m)
        if owed is not None:
            self._reincarnate(owed, "impostor seen while the last re-announcement was recent")
        dead = [n for n in self.alive if now_m - self.last_seen.get(n, 0.0) > self.params["dead_after_s"]]
        self._drop_late(now_m, dead)
        if dead:
            self._drop(dead, f"silent > {self.params['dead_after_s']} s")
        elif self.alive and time.monotonic() - self.last_replan >= self.params["replan_period_s"]:
            self.replan_soon("periodic re-prediction", periodic=True)
        self._collect_plan()
        self._time_out_requests()
        self._retry_direct(now_m)

    def _on_plan_topic(self, msg: Any) -> None:
        """Our own topic: a plan we did not publish is forged (or a second coordinator runs)."""
        reason, incarnation = proto.answer_on_own_topic(self.rt, self.guard, msg, proto.PLAN_TOPIC, time.monotonic())
        if incarnation is not None:
            self._reincarnate(incarnation, reason)


def main(argv: list[str] | None = None) -> int:
    prefork()  # before the middleware's threads start (planner_process docstring)
    return run_node(Coordinator, "coordinator", argv)


if __name__ == "__main__":
    raise SystemExit(main())
