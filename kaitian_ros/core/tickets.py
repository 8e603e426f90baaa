"""Pairing the coordinator's tickets with the camera images a compute node takes itself.

Under a direct plan (one compute node computes the whole image) that node subscribes to the
camera topic itself, so the image crosses its link once and the coordinator stays off the
request's path. The coordinator still decides which images become requests - it drops frames
while busy, numbers the requests and re-dispatches them when a node dies - and says so with a
ticket per accepted image: request id, plan version and the image's name. Image and ticket
travel separately, either may arrive first. `TicketBook` pairs them by that name.

An image's name is its header (stamp, frame_id) and the CRC-32 of its data. The header alone
does not do: a camera may stamp two frames alike, and a node that missed the first of them (its
subscription was new, the ticket had been given back before the image came) once paired the
first frame's ticket with the second frame and answered with the wrong frame's result. With the
content in the name, a ticket pairs only with the image it was issued for, or with an identical
one (which has the same result).

Pure bookkeeping, bounded, no I/O: the node turns a pair into a request, and sends back a
ticket whose image never came (the coordinator then sends the rows itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ImageKey = tuple[int, int, str, int]  # the image header's stamp (sec, nanosec), frame_id, CRC-32 of its data


@dataclass(frozen=True)
class Ticket:
    """The coordinator accepted the image named `key` as `request_id` of `plan_version`."""

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
    """Images without a ticket yet and tickets without an image yet, each bounded, oldest first.

    An image nobody tickets was dropped by the coordinator (busy): the oldest goes when more
    than `max_images` wait. Images with one name are identical (same header, same data): a
    ticket takes any of them."""

    def __init__(self, max_images: int = 4, max_tickets: int = 16) -> None:
        if max_images < 1 or max_tickets < 1:
            raise ValueError(f"max_images and max_tickets must be >= 1, got {max_images}, {max_tickets}")
        self.max_images, self.max_tickets = max_images, max_tickets
        self.images: list[tuple[ImageKey, Any, float]] = []  # (name, image, received_s), oldest first
        self.tickets: list[Ticket] = []  # oldest first
        self.unticketed = 0  # images dropped without a ticket (the coordinator dropped them)

    def has_image(self, key: ImageKey) -> bool:
        return any(k == key for k, _, _ in self.images)

    def add_image(self, key: ImageKey, image: Any, received_s: float) -> Match | None:
        """The image's match if its ticket is here, else None (the image waits)."""
        for i, ticket in enumerate(self.tickets):
            if ticket.key == key:
                del self.tickets[i]
                return Match(ticket, image, received_s)
        self.images.append((key, image, received_s))
        if len(self.images) > self.max_images:
            del self.images[0]
            self.unticketed += 1
        return None

    def add_ticket(self, ticket: Ticket) -> tuple[Match | None, list[Ticket]]:
        """(the ticket's match if its image is here, tickets given back): the oldest waiting
        tickets beyond `max_tickets` are given back."""
        for i, (key, image, received_s) in enumerate(self.images):
            if key == ticket.key:
                del self.images[i]
                return Match(ticket, image, received_s), []
        self.tickets.append(ticket)
        given_back = self.tickets[:-self.max_tickets]
        del self.tickets[:-self.max_tickets]
        return None, given_back

    def expire(self, now_s: float, wait_s: float) -> list[Ticket]:
        """The tickets that waited longer than `wait_s` for their image: given back."""
        late = [t for t in self.tickets if now_s - t.arrived_s > wait_s]
        self.tickets = [t for t in self.tickets if now_s - t.arrived_s <= wait_s]
        return late

    def clear_images(self) -> None:
        """The node stopped taking camera images: those waiting will never be ticketed."""
        self.unticketed += len(self.images)
        self.images.clear()
