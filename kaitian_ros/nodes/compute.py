"""compute node: one per accelerator; computes its row stripe of every request, streaming.

Receives INPUT (image rows from the coordinator) and HALO (rows from neighbours) chunks on
``/kaitian/chunks/<node>``, feeds them to a StripeRunner per request (wavefront: every row
whose receptive field has arrived is computed at once), publishes HALO rows to neighbours and
OUTPUT rows to the coordinator as soon as they exist, then NodeTelemetry for the request
(compute time is device time: ``inference_common.busy_clock``).
Plans come from the coordinator's latched ``/kaitian/plan`` topic by version (the full spec:
strategy, cuts, per-segment shares); a chunk of an unknown, retired or mismatched plan, or one
that waited over ``max_queue_wait_s`` in the node's queue, is dropped and counted, never a crash.

Costs: at start-up the node times every trunk op at several row counts (bounded by
``profile_budget_s``) and publishes them on the latched ``/kaitian/profiles``; it refines them
from the runs it computes (wall time, the emulated slowdown applied), from short probes while
idle (every ``probe_period_s``, backing off to ``probe_max_period_s``) and from its incoming
links, and publishes a new version when they moved by ``profile_change`` (`compute_costs`).

Direct path: under a plan that computes the whole image on this node alone, the node takes the
camera images itself on the coordinator's tickets and publishes their FusedOutput
(`compute_direct`).

Its parameters are `compute_params`; a warm interpreter prepares one in `compute_prepare`.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import torch

from kaitian_ros import heap
from kaitian_ros.core.authority import AuthorityTracker
from kaitian_ros.core.costs import observe_link
from kaitian_ros.core.plan import Plan
from kaitian_ros.core.pooled import RowSum, sum_outputs
from kaitian_ros.core.stripe import StripeRunner
from kaitian_ros.core.tensors import ImageFormatError, image_to_array, normalise_input, resize_pixels
from kaitian_ros.core.tickets import Match, Ticket
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.nodes.compute_costs import NodeCosts
from kaitian_ros.nodes.compute_direct import DirectImages, ticket_back_message, warm_direct_path
from kaitian_ros.nodes.compute_params import PARAMETERS
from kaitian_ros.nodes.compute_prepare import PREPARED, PreparedKey, drop_prepared
from kaitian_ros.nodes.compute_requests import MB, RequestState, RequestTable
from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import MessageInfo, QoS, Runtime, SetParametersResult
from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher, Level

# chunks of a plan version not announced yet, held for pending_timeout_s: bounded, since anyone
# can send chunks naming a future version
MAX_PENDING = 256
MAX_PENDING_BYTES = 64 * 1024 * 1024

class ComputeNode(NodeCosts):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.node_id = rt.node_name
        self.params = rt.declare_parameters(PARAMETERS)
        torch.set_num_threads(self.params["threads"])
        # a chunk's arrival is stamped on the middleware's thread once it gets the interpreter:
        # at the default 5 ms switch interval the executor's bookkeeping delays that stamp by
        # more than a halo chunk takes on the link (the link meters read arrival gaps)
        sys.setswitchinterval(0.0005)
        self.device = ic.check_device(self.params["device"])
        self.spec = ic.ModelSpec.from_params(self.params)
        self.labels = ic.load_labels(self.params["labels"], self.params["labels_file"], self.spec.num_classes)
        # a node respawned from a warm interpreter finds its model built and its costs measured
        self.prepared = PREPARED.pop(PreparedKey.of(self.params), None)
        drop_prepared()  # those of other models (a fork server prepares for every launch it serves)
        self.graph = self.prepared.graph if self.prepared else ic.build_graph(self.spec, self.params["device"])
        self._trunk_flops = self.graph.trunk_flops()
        self.busy_clock = ic.busy_clock(self.device)
        self.plans: collections.OrderedDict[int, Plan] = collections.OrderedDict()
        self.requests = RequestTable(rt.rejected.count)
        self.pending: list[tuple[float, Any, Any]] = []  # chunks waiting for their plan (MAX_PENDING)
        self.pending_bytes = 0
        self.retired_below = 0  # plan versions below this are gone
        self.behind_drops = 0  # chunks dropped because this node was behind (evictions: the table's)
        self.coordinator = AuthorityTracker("coordinator")  # whose plan versions these are
        self.completed = 0
        self.pubs: dict[str, Any] = {}
        self.telemetry = rt.create_publisher(proto.TELEMETRY_TOPIC, "NodeTelemetry")
        self.direct = DirectImages(rt, self._run_direct, self._give_back)
        # made when the direct path first starts (`_on_plan`), before any image it answers
        self.fused_pub: Any = None
        warm_direct_path(self.graph, self.labels)
        self.diagnostics = DiagnosticsPublisher(rt, hardware_id=self.params["device"])
        self._measure_costs()
        self.profile_pub = rt.create_publisher(proto.PROFILES_TOPIC, "CostProfile", QoS.LATCHED)
        self._publish_profile("start-up measurement")
        rt.create_subscription(proto.PLAN_TOPIC, "LoadAssignment", self._on_plan, QoS.LATCHED)
        rt.create_subscription(proto.chunk_topic(self.node_id), "TensorChunk", self._on_chunk, with_info=True)
        rt.add_on_set_parameters_callback(self._on_set)
        self.hb_timer = rt.create_timer(1.0 / self.params["heartbeat_hz"], self._heartbeat)
        self.probe_timer = self._probe_timer()
        rt.create_timer(1.0, self._housekeeping)
        rt.create_timer(0.05, lambda: self.direct.expire(self.params["image_wait_s"]))
        rt.logger.info(f"{self.spec.name} {self.spec.input_shape} on {self.params['device']}, "
                       f"slowdown {self.params['emulated_slowdown']}"
                       f"{' (EMULATED)' if self.emulated else ''}")
        # announce itself now rather than a heartbeat period later: a respawned node is back in
        # the plan on its first heartbeat
        self._heartbeat()

    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        if "threads" in changes:
            torch.set_num_threads(changes["threads"])
        if "heartbeat_hz" in changes:
            self.hb_timer.cancel()
            self.hb_timer = self.rt.create_timer(1.0 / changes["heartbeat_hz"], self._heartbeat)
        self.params = self.params | changes
        if "probe_period_s" in changes:
            if self.probe_timer is not None:
                self.probe_timer.cancel()
            self.probe_timer = self._probe_timer()
        if "min_run_rows" in changes:  # the planner simulates this node's deferral
            self._publish_profile("min_run_rows changed")
        return SetParametersResult(True)

    # --- plans --------------------------------------------------------------------------
    def _on_plan(self, msg: Any) -> None:
        try:
            pv = proto.assignment_from_msg(msg)
        except ValueError as exc:
            self.rt.rejected.count(f"bad plan: {exc}")
            return
        try:
            plan = ic.plan_from_msg(self.graph, msg, self.params["slab_rows"])
        except ValueError as exc:
            self.rt.rejected.count(f"bad plan: v{pv.version}: {exc}")
            return
        verdict = proto.accept_versioned(self.rt, self.coordinator, msg)
        if verdict is None:
            return
        if verdict.reset:
            # a restarted coordinator numbers its plans from 1 again; the old run's requests and
            # plans are gone with it
            self.plans.clear()
            self.requests.clear()
            self.retired_below = 0
        self.plans[pv.version] = plan
        self.plans = collections.OrderedDict(sorted(self.plans.items()))
        while len(self.plans) > self.params["max_plans"]:
            old, _ = self.plans.popitem(last=False)
            self.retired_below = max(self.retired_below, old + 1)
        alone = plan.active_nodes() == (self.node_id,) and self.graph.pooled_head
        self.direct.follow(pv.version, msg.image_topic if alone else "", self.plans)
        if self.direct.sub is not None and self.fused_pub is None:  # before its first answer: the
            # publisher's declaration is then not part of that request's latency
            self.fused_pub = self.rt.create_publisher(proto.FUSED_TOPIC, "FusedOutput")
        waiting, self.pending, self.pending_bytes = self.pending, [], 0
        for _, chunk, info in waiting:
            self._on_chunk(chunk, info, held=True)

    # --- chunks -------------------------------------------------------------------------
    def _publisher(self, consumer: str) -> Any:
        pub = self.pubs.get(consumer)
        if pub is None:
            pub = self.pubs[consumer] = self.rt.create_publisher(proto.chunk_topic(consumer), "TensorChunk")
        return pub

    def _on_chunk(self, msg: Any, info: MessageInfo | None = None, held: bool = False) -> None:
        now = time.time()
        t_in = time.perf_counter()
        # arrival as the middleware saw it, not when this (maybe busy) node got to it
        arrived = info.received_s if info is not None else now
        sent = info.source_timestamp_s if info is not None and info.source_timestamp_s else arrived
        if info is not None and info.source_timestamp_s and msg.producer:
            observe_link(self.meters, msg.producer, len(msg.data), info.source_timestamp_s, info.received_s)
        if msg.consumer != self.node_id:
            self.rt.rejected.count(f"misaddressed: chunk for {msg.consumer!r}")
            return
        if not held and now - arrived > self.params["max_queue_wait_s"]:  # behind (a flood): late already
            self._drop_behind(f"stale: chunk waited {now - arrived:.1f} s in this node's queue")
            return
        if msg.role not in (proto.ROLE_INPUT, proto.ROLE_HALO, proto.ROLE_TICKET):
            self.rt.rejected.count(f"bad role: {msg.role}")
            return
        version = int(msg.plan_version)
        plan = self.plans.get(version)
        if plan is None:
            if version < self.retired_below or (self.plans and version < next(iter(self.plans))):
                self.rt.rejected.count(f"stale plan: v{version} retired")
            else:
                # plan message still on its way; held from its first arrival (re-examined on
                # every new plan, which must not restart its pending_timeout_s clock)
                if len(self.pending) >= MAX_PENDING or self.pending_bytes + len(msg.data) > MAX_PENDING_BYTES:
                    self._drop_behind(f"pending full: chunk of unknown plan v{version} "
                                      f"({len(self.pending)} chunks held)")
                    return
                self.pending.append((arrived, msg, info))
                self.pending_bytes += len(msg.data)
            return
        if self.node_id not in plan.active_nodes():
            self.rt.rejected.count(f"not in plan: v{version} has no rows for {self.node_id}")
            return
        if msg.role == proto.ROLE_TICKET:
            self.direct.on_ticket(msg)
            return
        problem = ic.chunk_shape_problem(self.graph, plan, msg)
        if problem:
            self.rt.rejected.count(f"bad chunk: request {msg.request_id}: {problem}")
            return
        try:
            rows = ic.chunk_rows(msg)
        except (ValueError, interfaces.DecodeError) as exc:
            self.rt.rejected.count(f"bad chunk: request {msg.request_id}: {exc}")
            return
        self._take_rows(int(msg.request_id), plan, version, int(msg.segment), int(msg.row_offset), msg.role, rows,
                        msg.header.frame_id, (now, t_in, sent, arrived), len(msg.data))

    def _run_direct(self, match: Match) -> None:
        """A ticketed camera image: the request's input, taken by this node itself."""
        t, image = match.ticket, match.image
        plan = self.plans.get(t.plan_version)
        if plan is None:
            self._give_back(t, f"plan v{t.plan_version} retired")
            return
        c, h, w = self.spec.input_shape
        try:
            pixels = image_to_array(image.data, int(image.height), int(image.width), image.encoding, int(image.step))
            rows = resize_pixels(pixels, h, w, c)
        except ImageFormatError as exc:
            self.rt.rejected.count(f"bad image: {exc}")
            self._give_back(t, "its image is unusable here")
            return
        if self.requests.get(t.request_id) is not None:
            self._give_back(t, "its request is already in progress here")
            return
        self.direct.answered += 1
        received = match.received_s
        self._take_rows(t.request_id, plan, t.plan_version, 0, 0, proto.ROLE_INPUT, rows, image.header.frame_id,
                        (time.time(), time.perf_counter(), received, received), len(image.data),
                        image_stamp=image.header.stamp)

    def _give_back(self, ticket: Ticket, why: str) -> None:
        self.direct.given_back += 1
        self.rt.logger.debug(f"ticket of request {ticket.request_id} given back: {why}")
        self._publisher(proto.COORDINATOR).publish(ticket_back_message(ticket, self.node_id))

    def _take_rows(self, request_id: int, plan: Plan, version: int, segment: int, row_offset: int, role: int,
                   rows: torch.Tensor, frame_id: str, times: tuple[float, float, float, float], nbytes: int,
                   image_stamp: Any = None) -> None:
        """Feed a request's rows (a chunk's, or on the direct path a camera image's); `times`:
        wall time now, perf_counter at arrival here, when sent, when it arrived (wall)."""
        now, t_in, sent, arrived = times
        state = self.requests.get(request_id)
        if state is not None and state.plan_version != version:
            if version < state.plan_version:
                self.rt.rejected.count(f"stale plan: request {request_id} moved to v{state.plan_version}")
                return
            state = None  # re-dispatched under a newer plan: start over
        try:
            if rows.dtype == torch.uint8 and role == proto.ROLE_INPUT:
                # image rows travel as pixels; per-pixel normalisation makes a slab exact on its own
                rows = normalise_input(rows, self.spec.input_shape[0], self.params["normalise"])
            if rows.dtype != torch.float32:  # the model computes in float32: another dtype would
                # fail inside the convolutions (uncounted RuntimeError), so refuse it here
                raise ValueError(f"chunk dtype {rows.dtype}, the model computes in float32")
            if state is None:
                self.requests.make_room(self.params["max_requests"])
                state = RequestState(request_id, version,
                                     StripeRunner(self.graph, plan, self.node_id,
                                                  min_run_rows=plan.run_rows(self.params["min_run_rows"]),
                                                  on_run=self._on_run),
                                     started_s=now, frame_id=frame_id, image_stamp=image_stamp,
                                     image_received_s=arrived)
            spent, wall = self._feed(state, plan, segment, row_offset, rows)
        except ValueError as exc:
            self.rt.rejected.count(f"bad chunk: request {request_id}: {exc}")
            return
        self.last_run_s = state.last_fed_s = time.monotonic()
        # this chunk's handling outside compute: decode was on the middleware thread, the rest here
        outside = max(0.0, (time.perf_counter() - t_in - wall) * 1e3)
        self.message_ms += 0.1 * (outside - self.message_ms)
        self.requests.put(state)
        self.requests.bound_bytes(state, self.params["max_held_mb"] * MB)
        if role == proto.ROLE_INPUT:
            state.first_sent_s = min(state.first_sent_s or sent, sent)
            state.first_input_s = min(state.first_input_s or arrived, arrived)
            state.last_input_s = max(state.last_input_s, arrived)
        state.bytes_in += nbytes
        state.compute_s += spent
        if state.runner.done:
            self._finish(state, plan)

    def _feed(self, state: RequestState, plan: Plan, segment: int, row_offset: int,
              rows: torch.Tensor) -> tuple[float, float]:
        """Feed rows to the request's runner, publishing every emission the moment its rows
        exist; returns the device time spent (EMULATED: times the slowdown) and the wall time
        of the feed."""
        slowdown = self.params["emulated_slowdown"]
        t0, wall0 = self.busy_clock(), time.perf_counter()
        # device-clock time inside `emit` - the EMULATED wait and publishing - is not compute
        # (on a wall-clock device such as CUDA the wait would otherwise count as compute)
        outside = 0.0
        self._feed_predicted = 0.0

        def emit(e: Any) -> None:
            nonlocal outside
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            e0 = self.busy_clock()
            if slowdown > 1.0:  # EMULATED: a device s times slower has these rows only now
                ic.sleep_until(wall0 + slowdown * (e0 - t0 - outside))
            self._publish(state, plan, [e])
            outside += self.busy_clock() - e0

        state.runner.feed(segment, row_offset, rows, emit=emit)
        if self.device.type == "cuda":  # kernels run asynchronously: time them whole
            torch.cuda.synchronize(self.device)
        spent = self.busy_clock() - t0 - outside
        if slowdown > 1.0 and spent > 0:
            ic.sleep_until(wall0 + slowdown * spent)  # emulated: this device is s times slower
            spent *= slowdown
        wall = time.perf_counter() - wall0
        state.feeds_predicted_ms += self._feed_predicted
        return spent, wall

    def _summed(self, state: RequestState, plan: Plan, emissions: list) -> list:
        """A pooled head needs only the output's mean: this node's OUTPUT rows become one
        OUTPUT_SUM emission once the last of them exists."""
        if not self.graph.pooled_head or all(e.role != "OUTPUT" for e in emissions):
            return emissions  # (a node owning no output rows never makes a RowSum)
        if state.output_sum is None:
            state.output_sum = RowSum(*plan.output_rows_for(self.node_id))
        return sum_outputs(emissions, state.output_sum)

    def _publish(self, state: RequestState, plan: Plan, emissions: list) -> None:
        for e in self._summed(state, plan, emissions):
            role = proto.ROLE_OF_NAME[e.role]
            if role == proto.ROLE_OUTPUT_SUM and state.image_stamp is not None:
                self._answer(state, plan, e.rows)  # first: the coordinator's copy is only bookkeeping
            key = (e.consumer, e.segment)
            index = state.slab_counts.get(key, 0)
            state.slab_counts[key] = index + 1
            total = plan.output_shape[1] if role != proto.ROLE_HALO else self.graph.value_shapes[
                plan.segments[e.segment].in_value][1]
            msg = ic.chunk_message(request_id=state.request_id, plan_version=state.plan_version,
                                   producer=self.node_id, consumer=e.consumer, segment=e.segment, role=role,
                                   row_offset=e.row_offset, total_rows=total, rows=e.rows,
                                   slab_index=index, frame_id=state.frame_id)
            self._publisher(e.consumer).publish(msg)
            state.bytes_out += e.rows.numel() * e.rows.element_size()
            if role != proto.ROLE_HALO:
                now = time.time()
                state.first_output_s = state.first_output_s or now
                state.last_output_s = now

    def _answer(self, state: RequestState, plan: Plan, output_sum: torch.Tensor) -> None:
        """The direct path's FusedOutput: the head on this node's sum of every output row."""
        with torch.no_grad():
            result = self.graph.run_head_on_sums([output_sum])
        self.fused_pub.publish(ic.fused_message(
            request_id=state.request_id, plan_version=state.plan_version, frame_id=state.frame_id,
            image_stamp=state.image_stamp, latency_ms=(time.time() - state.image_received_s) * 1e3, result=result,
            labels=self.labels, node_ids=[self.node_id], node_rows=[plan.output_shape[1]], status="ok"))

    def _finish(self, state: RequestState, plan: Plan) -> None:
        self.requests.finish(state)
        if self.completed > 0:  # the first request's calls build kernels and pack weights
            # device time, as the start-up profile measured it: on a CPU the time this process
            # waited for a core the other nodes share is not the device's speed (it made
            # every plan look as slow as the one running with all nodes busy at once)
            self.refiner.observe_feed(state.compute_s * 1e3, state.feeds_predicted_ms)
        self.completed += 1
        self._maybe_publish_profile()  # a device that changed speed shows it after one request
        end = time.time()
        wall_ms = (end - state.started_s) * 1e3
        rows = sum(b - a for a, b in (plan.segment_rows_for(self.node_id, k) for k in range(plan.num_segments)))
        self.telemetry.publish(self._telemetry_msg(
            request_id=state.request_id, plan_version=state.plan_version, rows=rows,
            # nominal work: this node's share of the whole trunk's cost. Not the FLOPs it
            # actually ran: those depend on which layers its stripe covers (halos, a solo
            # tail), and a speed in real FLOPs/ms made equal devices drift apart (docs/policy.md)
            work=plan.shares[plan.index(self.node_id)] * self._trunk_flops,
            share=plan.shares[plan.index(self.node_id)],
            compute_ms=state.compute_s * 1e3,
            # spread of this node's input arrivals: the link's share of the request's latency
            # (a burst on loopback arrives at once; through a rate-limited link it is spread out)
            transfer_ms=max(0.0, (state.last_input_s - state.first_input_s) * 1e3),
            wait_ms=max(0.0, wall_ms - state.compute_s * 1e3), bytes_in=state.bytes_in,
            bytes_out=state.bytes_out, first_input_s=state.first_input_s, last_input_s=state.last_input_s,
            first_output_s=state.first_output_s, last_output_s=state.last_output_s))

    def _telemetry_msg(self, **fields: Any) -> Any:
        return interfaces.make("NodeTelemetry", node_id=self.node_id, device=self.params["device"],
                               emulated=self.emulated, emulated_slowdown=self.params["emulated_slowdown"],
                               queue_depth=self.requests.in_progress(), rejected_count=self.rt.rejected.total,
                               last_reject_reason=self.rt.rejected.last_reason,
                               behind_drops=self.behind_drops + self.requests.evicted, **fields)

    def _drop_behind(self, reason: str) -> None:
        """Drop a chunk because this node is behind: counted apart too (telemetry
        `behind_drops`), the coordinator takes such drops as load (`core.lateness.node_load`)."""
        self.behind_drops += 1
        self.rt.rejected.count(reason)

    # --- timers -------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        self.telemetry.publish(self._telemetry_msg(request_id=0))

    def _housekeeping(self) -> None:
        self._maybe_publish_profile()
        now = time.time()
        self.requests.expire(now, self.params["request_timeout_s"])
        keep = []
        for stamp, chunk, info in self.pending:
            if now - stamp > self.params["pending_timeout_s"]:
                self.rt.rejected.count(f"unknown plan: v{chunk.plan_version} never announced")
                self.requests.note_drop_elsewhere()
            else:
                keep.append((stamp, chunk, info))
        self.pending = keep
        self.pending_bytes = sum(len(chunk.data) for _, chunk, _ in keep)
        if self.requests.drops_ended():  # a burst of junk is over: give its memory back
            heap.trim_heap()
        rejected = self.rt.rejected
        level = Level.OK
        text = f"{self.completed} requests" + (f", {rejected.total} dropped" if rejected.total else "")
        if not self.plans:
            level, text = Level.WARN, "waiting for a plan from the coordinator"
        profile = self.published
        self.diagnostics.publish(level, text + (" (speed EMULATED)" if self.emulated else ""), {
            "device": self.params["device"], "emulated": self.emulated,
            "profile_version": profile.version if profile else 0,
            "profile_trunk_ms": f"{profile.trunk_ms:.1f}" if profile else "",
            "probe_ratio": f"{self.refiner.probe_ratio:.2f}",
            "emulated_slowdown": self.params["emulated_slowdown"], "in_flight": len(self.requests),
            "held_mb": f"{self.requests.held_bytes() / MB:.1f}",
            "plans": ",".join(map(str, self.plans)),
            "coordinator_incarnation": f"{self.coordinator.incarnation:016x}", **self.direct.status()})


def main(argv: list[str] | None = None) -> int:
    return run_node(ComputeNode, "compute", argv)


if __name__ == "__main__":
    raise SystemExit(main())
