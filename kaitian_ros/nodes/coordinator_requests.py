"""The coordinator's requests: image -> input slabs -> OUTPUT chunks -> head -> FusedOutput.

`RequestFlow` is the part of `kaitian_ros.nodes.coordinator.Coordinator` that runs requests
under the plan in effect: it preprocesses a camera frame, streams each active compute node its
input rows in slabs, gathers the OUTPUT rows, runs the head and publishes FusedOutput; it times
out and re-dispatches requests. The coordinator sets its state up and chooses the plans.

On the direct path (a plan computing the whole image on one node, `direct_single`) that node
takes the camera image itself and publishes the FusedOutput: the coordinator only tickets the
image (`nodes.compute_direct`) and waits for the node's sum to close the request.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kaitian_ros.core import exploration
from kaitian_ros.core.costs import LinkMeter, observe_link
from kaitian_ros.core.graph import ModelGraph
from kaitian_ros.core.plan import Plan
from kaitian_ros.core.policy import Assignment
from kaitian_ros.core.tensors import ImageFormatError, image_to_array, resize_pixels
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import MessageInfo, Publisher, Runtime


@dataclass
class Request:
    request_id: int
    version: int
    plan: Plan
    image_stamp: Any
    frame_id: str
    received_s: float
    dispatched_s: float
    pixels: np.ndarray  # the camera image (H, W, C uint8), as received
    out: torch.Tensor
    got: np.ndarray  # bool per trunk-output row
    redispatches: int = 0
    predicted_ms: float = 0.0  # the plan's predicted latency at dispatch
    inputs_sent_s: float | None = None  # wall time its last input slab was published (None: not yet)
    first_of_version: bool = False  # the plan version's first request (one-off costs)
    alone: bool = True  # no other request in flight during its whole life (its latency is the plan's)
    sources: dict = field(default_factory=dict)  # node -> rows received
    sums: dict = field(default_factory=dict)  # OUTPUT_SUM received: first row -> (N, C, 1, 1) sum of the node's rows
    x: torch.Tensor | None = None  # the model's input rows (uint8), made when first sent
    direct: bool = False  # ticketed on the direct path: its node took the image itself and answers
    image_crc32: int = 0  # the direct path's: CRC-32 of the camera image's data (its ticket names the image)


class RequestFlow:
    """Requests in flight under the coordinator's plans (its state, set by `Coordinator`)."""

    rt: Runtime
    params: dict[str, Any]
    spec: ic.ModelSpec
    graph: ModelGraph
    labels: tuple[str, ...]
    nodes: tuple[str, ...]
    out_shape: tuple[int, int, int]
    current: Assignment | None  # the plan version in effect
    pending: Assignment | None  # adopted, effective from a later request
    plans: dict[int, Plan]
    unmeasured_version: int | None
    predicted_ms: float  # the running plan's latency as last predicted
    delivered: set[str]  # compute nodes that delivered OUTPUT rows at least once (warm)
    alive: tuple[str, ...]
    oldest_finished_s: float  # wall time the oldest request in flight last completed or timed out
    requests: dict[int, Request]
    waiting: Any  # newest image waiting for an in-flight slot
    next_request: int
    meters: dict[str, LinkMeter]
    pre_ms: float
    post_ms: float
    send_ms_per_mb: float
    counts: collections.Counter[str]
    latencies: collections.deque
    chunk_pubs: dict[str, Publisher]
    direct_versions: dict[int, str]  # plan version -> the node that takes the camera images itself
    direct_returns: int  # tickets given back since the last direct request completed
    exploration: exploration.Exploration  # the trials' share of the requests
    searched_versions: dict[int, bool]  # plan version chosen by the coordinator's own search -> a trial
    fused_pub: Publisher
    _sendq: queue.SimpleQueue | None
    incarnation: int  # the coordinator's authority (compute nodes reset on a new one)

    def _activate(self, pv: Assignment) -> None:
        """Put plan version `pv` in effect (the coordinator's: it publishes the plan)."""
        raise NotImplementedError

    def _observe_latency(self, plan: Plan, ms: float) -> None:
        """Remember what a request that ran alone took under `plan` (the coordinator's)."""
        raise NotImplementedError

    def _send_ticket(self, req: Request) -> None:
        """The direct path: tell the plan's node which camera image is this request
        (`coordinator_direct`)."""
        raise NotImplementedError

    def _ticket_back(self, msg: Any) -> None:
        """A node gave a ticket back (`coordinator_direct`)."""
        raise NotImplementedError

    def _on_image(self, msg: Any) -> None:
        received = time.time()
        try:
            pixels = image_to_array(msg.data, int(msg.height), int(msg.width), msg.encoding, int(msg.step))
        except ImageFormatError as exc:
            self.rt.rejected.count(f"bad image: {exc}")
            return
        if self.current is None:
            self.counts["dropped_no_plan"] += 1
            return
        if len(self.requests) >= self.params["max_in_flight"]:
            if self.waiting is not None:
                self.counts["dropped_busy"] += 1  # camera frames: the newest wins
            self.waiting = (msg, pixels, received)
            return
        self._dispatch_new(msg, pixels, received)

    def _dispatch_new(self, msg: Any, pixels: np.ndarray, received: float) -> None:
        rid = self.next_request
        if self.pending is not None and rid >= self.pending.effective_from_request:
            self._activate(self.pending)
        assert self.current is not None  # callers dispatch only while a plan is in effect
        self.next_request += 1
        c, h, w = self.out_shape
        direct = self.current.version in self.direct_versions
        req = Request(rid, self.current.version, self.plans[self.current.version], msg.header.stamp,
                      msg.header.frame_id, received, time.time(), pixels,
                      torch.empty((1, c, h, w)), np.zeros(h, dtype=bool), predicted_ms=self.predicted_ms,
                      first_of_version=self.current.version == self.unmeasured_version,
                      direct=direct, image_crc32=proto.image_crc32(msg.data) if direct else 0)
        if self.requests:
            req.alone = False
            for other in self.requests.values():
                other.alone = False
        self.requests[rid] = req
        self._send_inputs(req)

    def _send_inputs(self, req: Request) -> None:
        t0 = time.perf_counter()
        sent = self._send_input_slabs(req)
        if sent:
            mb = sent / 1e6
            self.send_ms_per_mb += 0.1 * ((time.perf_counter() - t0) * 1e3 / mb - self.send_ms_per_mb)

    def _input_rows(self, req: Request) -> torch.Tensor:
        """The request's input: the image resized to the model's, uint8 (the compute nodes
        normalise it: 4x fewer bytes on the wire than float32)."""
        if req.x is None:
            t0 = time.perf_counter()
            c, h, w = self.spec.input_shape
            req.x = resize_pixels(req.pixels, h, w, c)
            self.pre_ms += 0.1 * ((time.perf_counter() - t0) * 1e3 - self.pre_ms)
        return req.x

    def _send_input_slabs(self, req: Request) -> int:
        """Publish (or queue, when paced) every active node's input slabs; the bytes published."""
        if req.direct:
            self._send_ticket(req)
            return 0
        plan, slab = req.plan, req.plan.slab_rows  # the plan's own: the planner may send the whole image
        total = self.spec.input_shape[1]
        x = self._input_rows(req)
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
                        request_id=req.request_id, plan_version=req.version, producer=proto.COORDINATOR,
                        consumer=node, segment=0, role=proto.ROLE_INPUT, row_offset=a, total_rows=total,
                        rows=x[:, :, a:z], slab_index=i, last_slab=last, frame_id=req.frame_id)))
        pacing = self.params["input_pacing_ms"] / 1e3
        if pacing <= 0:
            for node, m in messages:
                self.chunk_pubs[node].publish(m)
            req.inputs_sent_s = time.time()
            return sum(len(m.data) for _, m in messages)
        if self._sendq is None:  # emulated slow link: pace on a sender thread, keep the executor free
            self._sendq = queue.SimpleQueue()
            threading.Thread(target=self._paced_sender, daemon=True).start()
        req.inputs_sent_s = None
        for k, (node, m) in enumerate(messages):
            # the last one marks the request's inputs as sent (for this dispatch of it only)
            self._sendq.put((node, m, (req, req.redispatches) if k == len(messages) - 1 else None))
        return 0

    def _paced_sender(self) -> None:
        sendq = self._sendq
        assert sendq is not None  # started right after the queue is made
        while self.rt.ok():
            node, m, last_of = sendq.get()
            self.chunk_pubs[node].publish(m)
            if last_of is not None and last_of[0].redispatches == last_of[1]:
                last_of[0].inputs_sent_s = time.time()
            time.sleep(self.params["input_pacing_ms"] / 1e3)

    def _on_chunk(self, msg: Any, info: MessageInfo | None = None) -> None:
        if info is not None and info.source_timestamp_s and msg.producer in self.nodes:
            observe_link(self.meters, msg.producer, len(msg.data), info.source_timestamp_s, info.received_s)
        if msg.role == proto.ROLE_TICKET and msg.consumer == proto.COORDINATOR:
            self._ticket_back(msg)
            return
        summed = msg.role == proto.ROLE_OUTPUT_SUM
        if msg.role not in (proto.ROLE_OUTPUT, proto.ROLE_OUTPUT_SUM) or msg.consumer != proto.COORDINATOR:
            self.rt.rejected.count(f"bad role: coordinator only takes OUTPUT and OUTPUT_SUM chunks, "
                                   f"got role {msg.role}")
            return
        if summed and not self.graph.pooled_head:
            self.rt.rejected.count("bad chunk: OUTPUT_SUM, but the head does not start with a global average pool")
            return
        req = self.requests.get(int(msg.request_id))
        if req is None:
            self.rt.rejected.count(f"stale chunk: request {msg.request_id} not in flight")
            return
        if int(msg.plan_version) != req.version:
            self.rt.rejected.count(
                f"stale plan: request {msg.request_id} runs v{req.version}, chunk v{msg.plan_version}")
            return
        try:
            rows = ic.chunk_rows(msg)
            if rows.dtype != req.out.dtype:
                raise ValueError(f"OUTPUT rows are {rows.dtype}, the trunk output is {req.out.dtype}")
            a = int(msg.row_offset)
            lo, hi = req.plan.output_rows_for(msg.producer)
            if summed:  # all the producer's rows at once
                if tuple(rows.shape) != (*req.out.shape[:2], 1, 1) or a != lo or lo >= hi:
                    raise ValueError(f"OUTPUT_SUM {tuple(rows.shape)} at row {a}: {msg.producer} owes the sum "
                                     f"{(*req.out.shape[:2], 1, 1)} of rows [{lo},{hi}) in v{req.version}")
                z = hi
            else:
                z = a + rows.shape[2]
                if rows.shape[:2] != req.out.shape[:2] or rows.shape[3] != req.out.shape[3] or z > req.out.shape[2]:
                    raise ValueError(f"rows {tuple(rows.shape)} at {a} do not fit trunk output {tuple(req.out.shape)}")
                if not (lo <= a and z <= hi):
                    raise ValueError(f"{msg.producer} does not own rows [{a},{z}) in v{req.version}")
            if req.got[a:z].any():
                raise ValueError(f"rows [{a},{z}) received twice")
        except (ValueError, interfaces.DecodeError) as exc:
            self.rt.rejected.count(f"bad chunk: {exc}")
            return
        if summed:
            req.sums[a] = rows
        else:
            req.out[:, :, a:z] = rows
        req.got[a:z] = True
        req.sources[msg.producer] = req.sources.get(msg.producer, 0) + (z - a)
        self.delivered.add(msg.producer)
        if req.got.all():
            self._complete(req)

    def _finished(self, req: Request) -> None:
        """`req` leaves the requests in flight (completed or timed out). Only the oldest one's end
        starts the next one's lateness clock: a newer request that finishes first says nothing
        of an older one, whose rows may be lost (likely in a flood test that failed: a flood
        evicts a real request from the node's full table; with every newer answer restarting
        its clock the node was never late for it, and the request waited its whole timeout)."""
        del self.requests[req.request_id]
        if all(r.request_id > req.request_id for r in self.requests.values()):
            self.oldest_finished_s = time.time()

    def _complete(self, req: Request) -> None:
        t0 = time.perf_counter()
        self._finished(req)
        if req.direct:  # its node published the FusedOutput; the sum it sent is bookkeeping
            self.direct_returns = 0
            self.counts["direct_requests"] += 1
            self.latencies.append((time.time() - req.received_s) * 1e3)
        else:
            self._answer(req, t0)
        if not req.direct and req.version in self.direct_versions:
            # its ticket came back (the camera's route to the node was still forming): it ran the
            # coordinator's path, not its plan's, so it measures neither that plan nor the one-off
            # costs the plan's first request on the direct path still pays
            pass
        elif req.version == self.unmeasured_version:
            # a plan version's first request pays one-off costs on its new row shapes (kernel
            # selection, weight packing: 2-5x its steady latency here); folded into the plan's
            # measured latency it made a good plan look slow for the next ~8 requests
            self.unmeasured_version = None
        elif req.alone and req.redispatches == 0:
            self._observe_latency(req.plan, (time.time() - req.received_s) * 1e3)
        self.counts["completed"] += 1
        if req.version in self.searched_versions:
            self.exploration = self.exploration.completed(self.searched_versions[req.version])
        self._start_waiting()

    def _answer(self, req: Request, t0: float) -> None:
        """The head on the gathered trunk output, published as the request's FusedOutput."""
        with torch.no_grad():
            if req.sums:  # the nodes' sums in row order (a node that sent rows: their sum here)
                ranges = sorted(req.plan.output_rows_for(n) for n in req.plan.active_nodes())
                result = self.graph.run_head_on_sums([
                    req.sums[lo] if lo in req.sums else req.out[:, :, lo:hi].sum(dim=(2, 3), keepdim=True)
                    for lo, hi in ranges if hi > lo])
            else:
                result = self.graph.run_head(req.out)
        self._publish_fused(req, result, "ok")
        self.post_ms += 0.1 * ((time.perf_counter() - t0) * 1e3 - self.post_ms)

    def _publish_fused(self, req: Request, result: torch.Tensor | None, status: str) -> None:
        latency_ms = (time.time() - req.received_s) * 1e3
        nodes = req.plan.active_nodes()
        self.fused_pub.publish(ic.fused_message(
            request_id=req.request_id, plan_version=req.version, frame_id=req.frame_id,
            image_stamp=req.image_stamp, latency_ms=latency_ms, result=result, labels=self.labels,
            node_ids=nodes, node_rows=[int(np.diff(req.plan.output_rows_for(n))[0]) for n in nodes], status=status))
        if result is not None:
            self.latencies.append(latency_ms)

    def _start_waiting(self) -> None:
        if self.waiting is not None and len(self.requests) < self.params["max_in_flight"] and self.current:
            msg, pixels, received = self.waiting
            self.waiting = None
            self._dispatch_new(msg, pixels, received)

    def _time_out_requests(self) -> None:
        """Publish complete=false for every request in flight longer than request_timeout_s."""
        now = time.time()
        for req in [r for r in self.requests.values() if now - r.dispatched_s > self.params["request_timeout_s"]]:
            missing = np.flatnonzero(~req.got)
            owners = owners_missing(req)
            self._finished(req)
            self.counts["timeouts"] += 1
            self._publish_fused(req, None, f"timeout: missing rows {missing[0]}-{missing[-1]} from "
                                                  f"{', '.join(owners)}")
            self._start_waiting()
        self._start_waiting()

    def _drop(self, dead: list[str], why: str, label: str = "lost") -> None:
        """Take nodes out of the plan and re-dispatch their requests (the coordinator's)."""
        raise NotImplementedError

    def _redispatch(self, dead: set[str]) -> None:
        """Restart the lost nodes' in-flight requests on the survivors under the new plan."""
        if self.current is None or not self.current.node_ids:
            return
        for req in list(self.requests.values()):
            if req.version == self.current.version or not (dead & set(req.plan.active_nodes())):
                continue
            self._restart(req, self.current.version, self.plans[self.current.version])
            self._send_inputs(req)

    def _restart(self, req: Request, version: int, plan: Plan) -> None:
        """Start ``req`` over under ``version`` (its rows are sent again by the caller)."""
        req.version, req.plan = version, plan
        req.got[:] = False
        req.sources.clear()
        req.sums.clear()
        req.redispatches += 1
        req.dispatched_s = time.time()
        req.inputs_sent_s = None
        req.predicted_ms = self.predicted_ms
        # under a version that has not completed a request yet it pays that version's one-off
        # costs (new row shapes) like any first request: its nodes get the longer lateness threshold
        req.first_of_version = version == self.unmeasured_version
        req.direct = False  # the node it goes to now may not have its image: send the rows
        self.counts["redispatched"] += 1

    def _running_again(self, reason: str, **changes: Any) -> Assignment:
        """The plan in effect as the next version (its Plan kept under it too), `reason` before
        its own; `changes` to other fields of the assignment. The caller activates it."""
        assert self.current is not None  # callers re-announce only while a plan is in effect
        pv = dataclasses.replace(self.current, version=self.current.version + 1,
                                 reason=f"{reason}: {self.current.reason}", **changes)
        self.plans[pv.version] = self.plans[self.current.version]
        if self.current.version in self.searched_versions:
            self.searched_versions[pv.version] = self.searched_versions[self.current.version]
        return pv

    def _reincarnate(self, incarnation: int, reason: str) -> None:
        """Publish the running plan again under a new incarnation: compute nodes take it as a
        restart, retire the impostor's incarnation with our old one, and drop the requests they
        held, so every request in flight is sent again under the re-announced plan."""
        self.incarnation = incarnation
        self.counts["reincarnations"] += 1
        self.rt.logger.warning(f"{reason}: re-announcing the plan as incarnation {incarnation:016x}")
        if self.current is None:
            return
        pv = self._running_again("re-announced after an impostor")
        plan = self.plans[pv.version]
        self.pending = None  # a held switch was announced under the old incarnation: plan again
        for req in list(self.requests.values()):
            self._restart(req, pv.version, plan)
        self._activate(pv)
        for req in list(self.requests.values()):
            self._send_inputs(req)


def owners_missing(req: Request) -> list[str]:
    """The nodes of the request's plan that owe trunk-output rows it has not received."""
    missing = ~req.got
    return [n for n in req.plan.active_nodes() if missing[slice(*req.plan.output_rows_for(n))].any()]
