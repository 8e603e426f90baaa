"""Pairing the coordinator's tickets with the camera images a compute node takes itself.

Under a direct plan (one compute node computes the whole image) that node subscribes to the
camera topic itself, so the image crosses its link once and the coordinator stays off the
request's path. The coordinator still decides which images become requests - it drops frames
while busy, numbers the requests and re-dispatches them when a node dies - and says so with a
ticket per accepted image: request id, plan version and the image's header. Image and ticket
travel separately, either may arrive first. `TicketBook` pairs them by the image's header.

Pure bookkeeping, bounded, no I/O: the node turns a pair into a request, and sends back a
ticket whose image never came (the coordinator then sends the rows itself).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

ImageKey = tuple[int, int, str]  # the image header's stamp (sec, nanosec) and frame_id


@dataclass(frozen=True)
class Ticket:
    """The coordinator accepted the image with header `key` as `request_id` of `plan_version`."""

    request_id: int
    plan_version: int
    key: ImageKey
    arrived_s: float


@dataclass(frozen=True)
class Match:
    """A ticket and its image (`received_s`: when the image reached this node)."""

    ticket: Ticket
    image: Any
    received_s: float


class TicketBook:
    """Images without a ticket yet and tickets without an image yet, each bounded.

    An image nobody tickets was dropped by the coordinator (busy): the oldest goes when more
    than `max_images` wait. Two images with one header cannot be told apart: both are
    dropped and a ticket naming that header is given back (`ambiguous`)."""

    def __init__(self, max_images: int = 4, max_tickets: int = 16) -> None:
        if max_images < 1 or max_tickets < 1:
            raise ValueError(f"max_images and max_tickets must be >= 1, got {max_images}, {max_tickets}")
        self.max_images, self.max_tickets = max_images, max_tickets
        self.images: collections.OrderedDict[ImageKey, tuple[Any, float]] = collections.OrderedDict()
        self.tickets: collections.OrderedDict[ImageKey, Ticket] = collections.OrderedDict()
        self.ambiguous: collections.OrderedDict[ImageKey, None] = collections.OrderedDict()
        self.unticketed = 0  # images dropped without a ticket (the coordinator dropped them)

    def add_image(self, key: ImageKey, image: Any, received_s: float) -> Match | None:
        """The image's match if its ticket is here, else None (the image waits)."""
        if key in self.ambiguous:
            return None
        if key in self.images:  # the same header twice: which one a ticket means is unknown
            del self.images[key]
            self._mark_ambiguous(key)
            return None
        ticket = self.tickets.pop(key, None)
        if ticket is not None:
            return Match(ticket, image, received_s)
        self.images[key] = (image, received_s)
        while len(self.images) > self.max_images:
            self.images.popitem(last=False)
            self.unticketed += 1
        return None

    def add_ticket(self, ticket: Ticket) -> tuple[Match | None, list[Ticket]]:
        """(the ticket's match if its image is here, tickets given back): a ticket whose header
        two images carried is given back at once, as are the oldest beyond `max_tickets`."""
        if ticket.key in self.ambiguous:
            return None, [ticket]
        found = self.images.pop(ticket.key, None)
        if found is not None:
            return Match(ticket, found[0], found[1]), []
        given_back = []
        old = self.tickets.pop(ticket.key, None)
        if old is not None:  # a re-sent ticket (the coordinator restarted the request): the newer counts
            given_back.append(old)
        self.tickets[ticket.key] = ticket
        while len(self.tickets) > self.max_tickets:
            given_back.append(self.tickets.popitem(last=False)[1])
        return None, given_back

    def expire(self, now_s: float, wait_s: float) -> list[Ticket]:
        """The tickets that waited longer than `wait_s` for their image: given back."""
        late = [t for t in self.tickets.values() if now_s - t.arrived_s > wait_s]
        for t in late:
            del self.tickets[t.key]
        return late

    def clear_images(self) -> None:
        """The node stopped taking camera images: those waiting will never be ticketed."""
        self.unticketed += len(self.images)
        self.images.clear()

    def _mark_ambiguous(self, key: ImageKey) -> None:
        self.ambiguous[key] = None
        while len(self.ambiguous) > 4 * self.max_images:
            self.ambiguous.popitem(last=False)
