"""A compute node's direct path: under a plan that computes the whole image on this node alone
(its ``image_topic`` set), the node takes the camera images itself and answers on
``/kaitian/fused``, so the coordinator is off the request's path: no input rows from it, no
trip back through it for the head. The coordinator still decides which images become requests
and tickets each one (TensorChunk ROLE_TICKET: request id, plan version, the image's header and
the CRC-32 of its data); `core.tickets.TicketBook` pairs tickets with images. A ticket whose
image does not come within ``image_wait_s`` (the subscription is new, the camera dropped it)
goes back to the coordinator, which then sends that request's rows as under any other plan.

The node listens to the camera only while its newest plan asks it to: under any other plan the
images would cross its link for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from kaitian_ros.core.tensors import warm_resize
from kaitian_ros.core.tickets import Match, Ticket, TicketBook
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import QoS, Runtime, Subscription


class DirectImages:
    """The camera subscription a node's newest plan asks for, and the tickets and images
    waiting for each other (`run` gets every pair; `give_back` publishes a returned ticket)."""

    def __init__(self, rt: Runtime, run: Callable[[Match], None], give_back: Callable[[Ticket, str], None]) -> None:
        self.rt, self._run, self._give_back = rt, run, give_back
        self.book = TicketBook()
        self.topics: dict[int, str] = {}  # plan version -> the camera topic it names ("" none)
        self.sub: Subscription | None = None
        self.asked = ""  # the topic the subscription was made for (its resolved name may differ)
        self.given_back = 0
        self.answered = 0
        self.images_seen = 0  # on the current subscription
        # how long an image waited here for its ticket (mean of the last ~10): what the
        # coordinator's turn adds to a direct request, since the node computes once both are here
        self.ticket_wait_ms = 0.0

    @property
    def topic(self) -> str:
        return self.sub.topic if self.sub is not None else ""

    def follow(self, version: int, topic: str, kept: Collection[int]) -> None:
        """Plan `version` names camera `topic` ('' none) and the node keeps the plans `kept`:
        listen to the camera while the newest of them names a topic, and only then."""
        self.topics[version] = topic
        self.topics = {v: t for v, t in self.topics.items() if v in kept}
        want = self.topics[max(self.topics)] if self.topics else ""
        if self.sub is not None and want != self.asked:
            self.sub.destroy()
            self.sub = None
            self.book.clear_images()
            self.rt.logger.info("direct path off: camera images go through the coordinator again")
        if want and self.sub is None:
            self.sub = self.rt.create_subscription(want, "Image", self._on_image, QoS.BEST_EFFORT)
            self.asked, self.images_seen = want, 0
            self.rt.logger.info(f"direct path: taking the camera images from {want} myself")

    def _on_image(self, msg: Any) -> None:
        self.images_seen += 1
        received = time.time()
        match = self.book.add_image(proto.image_key(msg.header, proto.image_crc32(msg.data)), msg, received)
        if match is not None:  # its ticket came first: the image waited for nothing
            self._paired(match, waited_ms=0.0)

    def on_ticket(self, msg: Any) -> None:
        """A ticket from the coordinator (its plan is known and names this node)."""
        ticket = Ticket(int(msg.request_id), int(msg.plan_version), proto.image_key(msg.header, msg.image_crc32),
                        time.monotonic())
        if not self.topics.get(ticket.plan_version):
            self._give_back(ticket, f"plan v{ticket.plan_version} does not send this node the camera images")
            return
        if self.images_seen == 0 and not self.book.has_image(ticket.key):
            # a new subscription that has seen no image yet: the ticket's image went past before
            # its route existed (images travel ahead of their tickets), it will not come
            self._give_back(ticket, "its image came before this node listened to the camera")
            return
        match, back = self.book.add_ticket(ticket)
        for t in back:
            self._give_back(t, "too many tickets waiting")
        if match is not None:
            self._paired(match, waited_ms=max(0.0, time.time() - match.received_s) * 1e3)

    def _paired(self, match: Match, waited_ms: float) -> None:
        """Run a ticket and its image; `waited_ms`: how long the image waited for the ticket."""
        self.ticket_wait_ms += 0.1 * (waited_ms - self.ticket_wait_ms)
        self._run(match)

    def expire(self, wait_s: float) -> None:
        """Give back the tickets whose image did not come within `wait_s`."""
        for t in self.book.expire(time.monotonic(), wait_s):
            self._give_back(t, f"its image did not arrive within {wait_s:.2f} s")

    def status(self) -> dict[str, Any]:
        return {"direct_topic": self.topic, "direct_answered": self.answered, "direct_given_back": self.given_back,
                "direct_unticketed_images": self.book.unticketed,
                "direct_ticket_wait_ms": round(self.ticket_wait_ms, 2)}


def ticket_back_message(ticket: Ticket, node_id: str) -> Any:
    """The TensorChunk that gives `ticket` back to the coordinator."""
    sec, nanosec, frame_id, crc32 = ticket.key
    stamp = interfaces.msg_class("Time")(sec=sec, nanosec=nanosec)
    return ic.ticket_message(request_id=ticket.request_id, plan_version=ticket.plan_version, producer=node_id,
                             consumer=proto.COORDINATOR, frame_id=frame_id, stamp=stamp, image_crc32=crc32)


def warm_direct_path(graph: Any, labels: Sequence[str]) -> None:
    """Pay the direct path's one-off costs at start-up instead of in its first request: OpenCV
    (loaded and first called on the first image a process resizes), the head's first call and
    the first encoding of a FusedOutput (its serializer is built then). That request measured
    them here: 32 ms for the image, 17 ms to publish, twice its compute; counted as the plan's
    measured latency, it made the coordinator leave a single-device plan 1.3x faster than the
    one it went to (`kaitian bench adaptivity`). Only where the path can run (a pooled head):
    OpenCV adds about 16 MB to the process."""
    if not graph.pooled_head:
        return
    warm_resize()
    c = graph.trunk_output_shape[0]
    with torch.no_grad():
        result = graph.run_head_on_sums([torch.zeros(1, c, 1, 1)])
    interfaces.encode(ic.fused_message(request_id=0, plan_version=0, frame_id="", image_stamp=None, latency_ms=0.0,
                                       result=result, labels=labels, node_ids=[""], node_rows=[0], status="ok"),
                      "FusedOutput")
