"""The coordinator's side of the direct path (`direct_single`).

When the plan computes the whole image on one compute node, that node takes the camera images
itself and publishes their FusedOutput (`nodes.compute_direct`): the image crosses its link
once, and neither the input rows nor the result pass through this process. The coordinator
still decides which images become requests (it drops frames while busy, numbers requests,
times them out and re-dispatches them when a node leaves): per accepted image it sends the node
a ticket - request id, plan version, the image's header and the CRC-32 of its data - and closes
the request when the node's OUTPUT_SUM arrives, without running the head or publishing a second
result.

A ticket whose image never reached the node comes back; that request's rows are then sent as
under any plan. DIRECT_MAX_RETURNS in a row (a camera that stamps every frame alike, a route
that does not form) put the direct path off for DIRECT_RETRY_S: the plan is announced again
without it. Whether a plan takes the direct path is decided each time a plan version is
announced; a parameter change announces the running plan again.
"""

from __future__ import annotations

import time
from typing import Any

from kaitian_ros.core.plan import Plan
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.nodes.coordinator_lateness import LatenessWatch
from kaitian_ros.nodes.coordinator_requests import Request

# tickets given back in a row before the direct path is put off: a node's first tickets after
# it subscribed come back while the camera's route to it forms (1-3 at a stream of frames here)
DIRECT_MAX_RETURNS = 8
DIRECT_RETRY_S = 30.0  # then it is tried again this much later


class DirectPath(LatenessWatch):
    """Tickets, their returns, and which plan versions take the direct path."""

    direct_off_until: float | None  # monotonic: the direct path is off until then

    def _direct_node(self, plan: Plan) -> str:
        """The node that takes the camera images itself under `plan` ('' none): the direct path
        needs the whole image computed on one node and sent at once (a plan that streams its
        input in slabs keeps them: on a slow link the node computes while the rest crosses,
        robot_edge measured 9 ms slower with the camera's whole image instead), a head that
        starts with a global average pool (the node answers from its sum) and images straight
        from the camera (no EMULATED input pacing). Whether streaming or the whole image wins
        is measured (`planner.streaming_twin`), the whole image on this path."""
        if not self.params["direct_single"] or self.params["input_pacing_ms"] > 0 or not self.graph.pooled_head:
            return ""
        if self.direct_off_until is not None and time.monotonic() < self.direct_off_until:
            return ""
        nodes, height = plan.active_nodes(), self.spec.input_shape[1]
        if len(nodes) != 1 or plan.input_rows_for(nodes[0]) != (0, height) or plan.slab_rows < height:
            return ""
        return nodes[0]

    def _send_ticket(self, req: Request) -> None:
        node = req.plan.active_nodes()[0]
        self.chunk_pubs[node].publish(ic.ticket_message(
            request_id=req.request_id, plan_version=req.version, producer=proto.COORDINATOR, consumer=node,
            frame_id=req.frame_id, stamp=req.image_stamp, image_crc32=req.image_crc32,
            total_rows=self.spec.input_shape[1]))
        req.inputs_sent_s = time.time()

    def _ticket_back(self, msg: Any) -> None:
        """A node gave a ticket back (its image never reached it): send that request's rows."""
        req = self.requests.get(int(msg.request_id))
        if req is None or not req.direct or int(msg.plan_version) != req.version or \
                msg.producer not in req.plan.active_nodes():
            self.rt.rejected.count(f"stale ticket: request {msg.request_id} v{msg.plan_version} is not "
                                   f"waiting for {msg.producer!r} on the direct path")
            return
        req.direct = False
        self.counts["direct_returned"] += 1
        self.direct_returns += 1
        self._send_inputs(req)
        if self.direct_returns >= DIRECT_MAX_RETURNS and req.version in self.direct_versions:
            self.direct_off_until = time.monotonic() + DIRECT_RETRY_S
            self.counts["direct_off"] += 1
            self.rt.logger.warning(f"direct path off for {DIRECT_RETRY_S:.0f} s: {self.direct_returns} tickets "
                                   f"given back by {msg.producer} in a row")
            self._reannounce("direct path off")

    def _retry_direct(self, now_m: float) -> None:
        """The direct path's time off is over: announce the running plan again (with it)."""
        if self.direct_off_until is not None and now_m >= self.direct_off_until:
            self.direct_off_until = None
            self._direct_changed("direct path tried again")

    def _direct_changed(self, reason: str) -> None:
        """A setting of the direct path changed: the running plan is announced again only if
        that changes whether it takes the path (a new version costs its first request's
        measurement and may set off trials: toggling `direct_single` under a streamed plan once
        made the bench's `ours_via_coordinator` 8 ms slower than ours on the same plan)."""
        if self.current is None:
            return
        now = self._direct_node(self.plans[self.current.version])
        if now != self.direct_versions.get(self.current.version, ""):
            self._reannounce(reason)

    def _reannounce(self, reason: str) -> None:
        """The running plan again as a new version, from the next request: whether it takes the
        direct path is decided anew. A held switch decides that when it takes effect."""
        if self.current is None or self.pending is not None:
            return
        self._activate(self._running_again(reason, effective_from_request=self.next_request))
