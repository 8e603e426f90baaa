"""coordinator node: camera frames in, fused results out.

For every sensor_msgs/Image on ``input_topic`` it preprocesses the frame, opens a request
under the current plan version, streams each compute node its input rows in slabs, gathers
the OUTPUT rows, runs the head and publishes FusedOutput on ``/kaitian/fused``.

It is the single authority on plan versions (``/kaitian/plan``, latched): it adopts the
scheduler's LoadAssignment proposals, or uses its static shares when no scheduler runs, and
removes a compute node that stops sending heartbeats, re-dispatching that node's in-flight
requests to the survivors under a new version so no frame is lost.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kaitian_ros.core.plan import Plan
from kaitian_ros.core.policy import Assignment
from kaitian_ros.core.tensors import ImageFormatError, image_to_array, resize_pixels
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime, SetParametersResult
from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher, Level

PARAMETERS = ic.MODEL_PARAMETERS + (
    P("input_topic", T.STRING, "/camera/image_raw", "camera topic (sensor_msgs/Image)", read_only=True),
    P("compute_nodes", T.STRING_ARRAY, ["compute_0", "compute_1"], "compute node ids in row order",
      read_only=True),
    P("static_shares", T.DOUBLE_ARRAY, [1.0, 1.0], "shares used until/unless a scheduler assigns (one per node)",
      0.0, 1e6),
    P("use_scheduler", T.BOOL, True, "adopt LoadAssignment from /kaitian/assignment when one is published"),
    P("max_in_flight", T.INTEGER, 2, "requests dispatched but not finished", 1, 64),
    P("request_timeout_s", T.DOUBLE, 5.0, "publish complete=false after this long", 0.05, 600.0),
    P("dead_after_s", T.DOUBLE, 1.5, "a compute node silent this long leaves the plan", 0.2, 600.0),
    P("input_pacing_ms", T.DOUBLE, 0.0,
      "EMULATED slow input link: pause between input slabs (0 = send at once)", 0.0, 10000.0),
    P("threads", T.INTEGER, 1, "torch CPU threads for preprocessing and the head", 1, 256),
)


@dataclass
class Request:
    request_id: int
    version: int
    plan: Plan
    image_stamp: Any
    frame_id: str
    received_s: float
    dispatched_s: float
    x: torch.Tensor
    out: torch.Tensor
    got: np.ndarray  # bool per trunk-output row
    redispatches: int = 0
    sources: dict = field(default_factory=dict)  # node -> rows received


class Coordinator:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        torch.set_num_threads(self.params["threads"])
        problem = self._shares_problem(self.params["static_shares"], self.params["compute_nodes"])
        if problem:
            raise ValueError(problem)
        self.spec = ic.ModelSpec.from_params(self.params)
        self.graph = ic.build_graph(self.spec)
        self.out_shape = self.graph.trunk_output_shape
        self.nodes = tuple(self.params["compute_nodes"])
        self.last_seen: dict[str, float] = {}
        self.alive: tuple[str, ...] = ()
        self.assignment: Assignment | None = None  # scheduler's latest proposal
        self.current: Assignment | None = None
        self.pending: Assignment | None = None  # adopted, effective from a later request
        self.plans: dict[int, Plan] = {}
        self.requests: dict[int, Request] = {}
        self.waiting: Any = None  # newest image waiting for an in-flight slot
        self.next_request = 1
        self.counts = collections.Counter()
        self.latencies: collections.deque = collections.deque(maxlen=200)
        self.chunk_pubs = {n: rt.create_publisher(ic.chunk_topic(n), "TensorChunk") for n in self.nodes}
        self.plan_pub = rt.create_publisher(ic.PLAN_TOPIC, "LoadAssignment", QoS.LATCHED)
        self.fused_pub = rt.create_publisher(ic.FUSED_TOPIC, "FusedOutput")
        self.diagnostics = DiagnosticsPublisher(rt, hardware_id="cpu")
        self._sendq: queue.SimpleQueue | None = None
        rt.create_subscription(ic.TELEMETRY_TOPIC, "NodeTelemetry", self._on_telemetry)
        rt.create_subscription(ic.ASSIGNMENT_TOPIC, "LoadAssignment", self._on_assignment, QoS.LATCHED)
        rt.create_subscription(ic.chunk_topic(ic.COORDINATOR), "TensorChunk", self._on_chunk)
        rt.create_subscription(self.params["input_topic"], "Image", self._on_image, QoS.BEST_EFFORT)
        rt.add_on_set_parameters_callback(self._on_set)
        rt.create_timer(0.05, self._check)
        rt.create_timer(1.0, self._report)
        rt.logger.info(f"{self.spec.name} {self.spec.input_shape} -> trunk {self.out_shape}, "
                       f"compute nodes {list(self.nodes)}")

    @staticmethod
    def _shares_problem(shares: list[float], nodes: list[str]) -> str:
        """'' if ``shares`` fit ``nodes``, else why not (startup raises it, param set returns it)."""
        if len(shares) != len(nodes):
            return f"static_shares has {len(shares)} values for {len(nodes)} compute nodes"
        if sum(shares) <= 0:
            return "static_shares must not all be zero"
        return ""

    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        if "static_shares" in changes:
            problem = self._shares_problem(changes["static_shares"], list(self.nodes))
            if problem:
                return SetParametersResult(False, problem)
        if "threads" in changes:
            torch.set_num_threads(changes["threads"])
        self.params = self.params | changes
        if "static_shares" in changes or "use_scheduler" in changes:
            # self.params already holds the new values; the runtime applies them after we return
            self._replan("parameters changed")
        return SetParametersResult(True)

    # --- membership and plans -----------------------------------------------------------
    def _on_telemetry(self, msg: Any) -> None:
        if msg.node_id not in self.nodes:
            return
        first = msg.node_id not in self.alive
        self.last_seen[msg.node_id] = time.monotonic()
        if first:
            self.alive = tuple(n for n in self.nodes if n in self.last_seen and
                               time.monotonic() - self.last_seen[n] < self.params["dead_after_s"])
            self._replan(f"{msg.node_id} joined")

    def _on_assignment(self, msg: Any) -> None:
        if not self.params["use_scheduler"]:
            return
        try:
            proposal = ic.assignment_from_msg(msg)
        except ValueError as exc:
            self.rt.rejected.count(f"bad assignment: {exc}")
            return
        if self.assignment is not None and proposal.version <= self.assignment.version:
            return
        self.assignment = proposal
        self._replan(f"scheduler v{proposal.version}: {proposal.reason}", effective=proposal.effective_from_request)

    def _shares_for(self, alive: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[float, ...], str]:
        if self.params["use_scheduler"] and self.assignment is not None:
            table = dict(zip(self.assignment.node_ids, self.assignment.shares))
            nodes = tuple(n for n in alive if table.get(n, 0.0) > 0)
            if nodes:
                return nodes, tuple(table[n] for n in nodes), self.assignment.policy
        table = dict(zip(self.nodes, self.params["static_shares"]))
        nodes = tuple(n for n in alive if table[n] > 0)
        return nodes, tuple(table[n] for n in nodes), "static"

    def _replan(self, reason: str, effective: int = 0) -> None:
        nodes, shares, policy = self._shares_for(self.alive)
        if not nodes:
            if self.current is not None:
                self.rt.logger.warning(f"no compute node available ({reason})")
            return
        total = sum(shares)
        shares = tuple(s / total for s in shares)
        try:
            shares, plan = self._plan_with_rows(nodes, shares)
        except ValueError as exc:
            self.rt.logger.error(f"cannot plan {nodes} {shares}: {exc}")
            return
        latest = self.pending or self.current
        if latest is not None and latest.node_ids == nodes and all(
                math.isclose(a, b, abs_tol=1e-9) for a, b in zip(latest.shares, shares)):
            if latest is self.pending and self.current is not None and any(
                    n not in self.alive for n in self.current.node_ids):
                # the scheduler saw the loss first: its proposal without the lost node is still
                # waiting for its effective_from_request, but the running plan sends rows to a
                # dead node, so switch now (the caller then re-dispatches in-flight requests)
                self._activate(dataclasses.replace(self.pending, effective_from_request=self.next_request))
            return
        version = (latest.version + 1) if latest else 1
        pv = Assignment(version, max(self.next_request, effective), nodes, shares, policy, reason,
                        plan.estimated_ms)
        self.plans[version] = plan
        if effective > self.next_request:
            # the scheduler asked for a switch at a later request: hold it until then
            self.pending = pv
            return
        self._activate(pv)

    def _plan_with_rows(self, nodes: tuple[str, ...], shares: tuple[float, ...]) -> tuple[tuple[float, ...], Plan]:
        """The plan for ``shares``, where every node with a positive share owns rows.

        Rows are whole, so a share below the row granularity (a newcomer's probe share, a very
        slow node) can round to nothing: that node would get no work, send no telemetry, and the
        scheduler would never see it warm up or speed up again. Such a share is doubled (then
        all renormalised) until the node owns at least one row; the plan message carries the
        shares actually executed."""
        slab = self.params["slab_rows"]
        plan = ic.plan_for(self.graph, nodes, shares, slab, self.params["plan_link_mbit"])
        for _ in range(10):
            starved = [i for i, n in enumerate(nodes) if shares[i] > 0 and n not in plan.active_nodes()]
            if not starved:
                break
            raised = [s * 2 if i in starved else s for i, s in enumerate(shares)]
            shares = tuple(s / sum(raised) for s in raised)
            plan = ic.plan_for(self.graph, nodes, shares, slab, self.params["plan_link_mbit"])
        return shares, plan

    def _activate(self, pv: Assignment) -> None:
        version = pv.version
        self.pending = None
        self.current = pv
        nodes, shares, reason = pv.node_ids, pv.shares, pv.reason
        self.plan_pub.publish(ic.assignment_msg(pv))
        self.rt.logger.info(f"plan v{version}: " + ", ".join(f"{n} {s:.2f}" for n, s in zip(nodes, shares))
                            + f" ({reason})")
        in_use = {r.version for r in self.requests.values()} | {version} | (
            {self.pending.version} if self.pending else set())
        self.plans = {v: p for v, p in self.plans.items() if v in in_use}

    # --- requests -----------------------------------------------------------------------
    def _on_image(self, msg: Any) -> None:
        received = time.time()
        try:
            pixels = image_to_array(msg.data, int(msg.height), int(msg.width), msg.encoding, int(msg.step))
            # uint8 rows on the wire; the compute nodes normalise them (4x fewer input bytes)
            x = resize_pixels(pixels, self.spec.input_shape[1], self.spec.input_shape[2], self.spec.input_shape[0])
        except ImageFormatError as exc:
            self.rt.rejected.count(f"bad image: {exc}")
            return
        if self.current is None:
            self.counts["dropped_no_plan"] += 1
            return
        if len(self.requests) >= self.params["max_in_flight"]:
            if self.waiting is not None:
                self.counts["dropped_busy"] += 1  # camera frames: the newest wins
            self.waiting = (msg, x, received)
            return
        self._dispatch_new(msg, x, received)

    def _dispatch_new(self, msg: Any, x: torch.Tensor, received: float) -> None:
        rid = self.next_request
        if self.pending is not None and rid >= self.pending.effective_from_request:
            self._activate(self.pending)
        self.next_request += 1
        c, h, w = self.out_shape
        req = Request(rid, self.current.version, self.plans[self.current.version], msg.header.stamp,
                      msg.header.frame_id, received, time.time(), x,
                      torch.empty((1, c, h, w)), np.zeros(h, dtype=bool))
        self.requests[rid] = req
        self._send_inputs(req)

    def _send_inputs(self, req: Request) -> None:
        plan, slab = req.plan, self.params["slab_rows"]
        total = self.spec.input_shape[1]
        batches = []
        for node in plan.active_nodes():
            lo, hi = plan.input_rows_for(node)
            batches.append([(node, a, min(a + slab, hi), (a + slab) >= hi) for a in range(lo, hi, slab)])
        messages = []
        for i in range(max((len(b) for b in batches), default=0)):  # interleave: all nodes start at once
            for b in batches:
                if i < len(b):
                    node, a, z, last = b[i]
                    messages.append((node, ic.chunk_message(
                        request_id=req.request_id, plan_version=req.version, producer=ic.COORDINATOR,
                        consumer=node, segment=0, role=ic.ROLE_INPUT, row_offset=a, total_rows=total,
                        rows=req.x[:, :, a:z], slab_index=i, last_slab=last, frame_id=req.frame_id)))
        pacing = self.params["input_pacing_ms"] / 1e3
        if pacing <= 0:
            for node, m in messages:
                self.chunk_pubs[node].publish(m)
            return
        if self._sendq is None:  # emulated slow link: pace on a sender thread, keep the executor free
            self._sendq = queue.SimpleQueue()
            threading.Thread(target=self._paced_sender, daemon=True).start()
        for item in messages:
            self._sendq.put(item)

    def _paced_sender(self) -> None:
        while self.rt.ok():
            node, m = self._sendq.get()
            self.chunk_pubs[node].publish(m)
            time.sleep(self.params["input_pacing_ms"] / 1e3)

    def _on_chunk(self, msg: Any) -> None:
        if msg.role != ic.ROLE_OUTPUT or msg.consumer != ic.COORDINATOR:
            self.rt.rejected.count(f"bad role: coordinator only takes OUTPUT chunks, got role {msg.role}")
            return
        req = self.requests.get(int(msg.request_id))
        if req is None:
            self.rt.rejected.count(f"stale chunk: request {msg.request_id} not in flight")
            return
        if int(msg.plan_version) != req.version:
            self.rt.rejected.count(f"stale plan: request {msg.request_id} runs v{req.version}, chunk v{msg.plan_version}")
            return
        try:
            rows = ic.chunk_rows(msg)
            if rows.dtype != req.out.dtype:
                raise ValueError(f"OUTPUT rows are {rows.dtype}, the trunk output is {req.out.dtype}")
            a = int(msg.row_offset)
            z = a + rows.shape[2]
            if rows.shape[:2] != req.out.shape[:2] or rows.shape[3] != req.out.shape[3] or z > req.out.shape[2]:
                raise ValueError(f"rows {tuple(rows.shape)} at {a} do not fit trunk output {tuple(req.out.shape)}")
            lo, hi = req.plan.output_rows_for(msg.producer)
            if not (lo <= a and z <= hi):
                raise ValueError(f"{msg.producer} does not own rows [{a},{z}) in v{req.version}")
            if req.got[a:z].any():
                raise ValueError(f"rows [{a},{z}) received twice")
        except (ValueError, interfaces.DecodeError) as exc:
            self.rt.rejected.count(f"bad chunk: {exc}")
            return
        req.out[:, :, a:z] = rows
        req.got[a:z] = True
        req.sources[msg.producer] = req.sources.get(msg.producer, 0) + (z - a)
        if req.got.all():
            self._complete(req)

    def _complete(self, req: Request) -> None:
        del self.requests[req.request_id]
        with torch.no_grad():
            result = self.graph.run_head(req.out)
        self._publish_fused(req, result, True, "ok")
        self.counts["completed"] += 1
        self._start_waiting()

    def _publish_fused(self, req: Request, result: torch.Tensor | None, complete: bool, status: str) -> None:
        latency_ms = (time.time() - req.received_s) * 1e3
        top_class, top_score = -1, 0.0
        fields: dict[str, Any] = {}
        if result is not None:
            flat = result.reshape(result.shape[0], -1)
            if result.dim() == 2 and flat.shape[1] > 1:
                probs = torch.softmax(flat[0], dim=0)
                top_class, top_score = int(probs.argmax()), float(probs.max())
            fields = interfaces.tensor_fields(result.contiguous())
        nodes = req.plan.active_nodes()
        rows = [int(np.diff(req.plan.output_rows_for(n))[0]) for n in nodes]
        self.fused_pub.publish(interfaces.make(
            "FusedOutput", header=interfaces.header(req.frame_id, req.image_stamp), request_id=req.request_id,
            plan_version=req.version, complete=complete, top_class=top_class, top_score=top_score,
            latency_ms=latency_ms, node_ids=list(nodes), node_rows=np.asarray(rows, np.uint32),
            status=status, **fields))
        if complete:
            self.latencies.append(latency_ms)

    def _start_waiting(self) -> None:
        if self.waiting is not None and len(self.requests) < self.params["max_in_flight"] and self.current:
            msg, x, received = self.waiting
            self.waiting = None
            self._dispatch_new(msg, x, received)

    # --- supervision --------------------------------------------------------------------
    def _check(self) -> None:
        now_m = time.monotonic()
        dead = [n for n in self.alive if now_m - self.last_seen.get(n, 0.0) > self.params["dead_after_s"]]
        if dead:
            self.alive = tuple(n for n in self.alive if n not in dead)
            self.rt.logger.warning(f"compute node(s) {dead} silent > {self.params['dead_after_s']} s: "
                                   f"leaving the plan")
            self._replan(f"{', '.join(dead)} lost")
            self._redispatch(set(dead))
        now = time.time()
        for req in [r for r in self.requests.values() if now - r.dispatched_s > self.params["request_timeout_s"]]:
            missing = np.flatnonzero(~req.got)
            owners = [n for n in req.plan.active_nodes()
                      if any(req.plan.output_rows_for(n)[0] <= m < req.plan.output_rows_for(n)[1] for m in missing)]
            del self.requests[req.request_id]
            self.counts["timeouts"] += 1
            self._publish_fused(req, None, False, f"timeout: missing rows {missing[0]}-{missing[-1]} from "
                                                  f"{', '.join(owners)}")
            self._start_waiting()
        self._start_waiting()

    def _redispatch(self, dead: set[str]) -> None:
        """Restart the lost nodes' in-flight requests on the survivors under the new plan."""
        if self.current is None or not self.current.node_ids:
            return
        for req in list(self.requests.values()):
            if req.version == self.current.version or not (dead & set(req.plan.active_nodes())):
                continue
            req.version = self.current.version
            req.plan = self.plans[self.current.version]
            req.got[:] = False
            req.sources.clear()
            req.redispatches += 1
            req.dispatched_s = time.time()
            self.counts["redispatched"] += 1
            self._send_inputs(req)

    def _report(self) -> None:
        lat = sorted(self.latencies)
        p50 = lat[len(lat) // 2] if lat else 0.0
        p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))] if lat else 0.0
        level = Level.OK if self.current and self.alive else Level.WARN
        text = (f"{self.counts['completed']} frames, p50 {p50:.1f} ms" if self.current
                else "waiting for compute nodes")
        if self.counts["timeouts"]:
            level, text = Level.WARN, text + f", {self.counts['timeouts']} timed out"
        self.diagnostics.publish(level, text, {
            "plan_version": self.current.version if self.current else 0,
            "alive": ",".join(self.alive), "in_flight": len(self.requests),
            "latency_p50_ms": f"{p50:.1f}", "latency_p95_ms": f"{p95:.1f}",
            "rejected": self.rt.rejected.total, "last_reject_reason": self.rt.rejected.last_reason}
            | {k: v for k, v in self.counts.items()})


def main(argv: list[str] | None = None) -> int:
    return run_node(Coordinator, "coordinator", argv)


if __name__ == "__main__":
    raise SystemExit(main())
