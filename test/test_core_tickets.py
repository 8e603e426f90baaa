"""core.tickets: the direct path's pairing of the coordinator's tickets with camera images.

Either may arrive first; every ticket ends matched with the image it names or given back,
never matched with another image; both sides stay bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kaitian_ros.core.tickets import Ticket, TicketBook


def _key(i: int) -> tuple[int, int, str]:
    return (100 + i, 500 * i, "camera")


def _ticket(i: int, at: float = 0.0) -> Ticket:
    return Ticket(request_id=1000 + i, plan_version=3, key=_key(i), arrived_s=at)


def test_image_first_then_ticket_and_ticket_first_then_image_both_match():
    book = TicketBook()
    assert book.add_image(_key(1), "img1", 10.0) is None
    match, back = book.add_ticket(_ticket(1))
    assert back == [] and match is not None
    assert (match.ticket.request_id, match.image, match.received_s) == (1001, "img1", 10.0)
    match, back = book.add_ticket(_ticket(2))
    assert match is None and back == []
    match = book.add_image(_key(2), "img2", 11.0)
    assert match is not None and (match.ticket.request_id, match.image) == (1002, "img2")
    assert not book.images and not book.tickets


def test_images_nobody_tickets_are_bounded_oldest_first():
    book = TicketBook(max_images=2)
    for i in range(5):
        book.add_image(_key(i), f"img{i}", float(i))
    assert list(book.images) == [_key(3), _key(4)] and book.unticketed == 3
    match, back = book.add_ticket(_ticket(0))  # its image was dropped: the ticket waits, then expires
    assert match is None and back == []
    assert book.expire(now_s=0.5, wait_s=0.25) == [_ticket(0)]
    assert not book.tickets


def test_a_ticket_whose_image_does_not_come_is_given_back_after_the_wait_only():
    book = TicketBook()
    book.add_ticket(_ticket(1, at=5.0))
    assert book.expire(now_s=5.2, wait_s=0.25) == []
    assert book.expire(now_s=5.3, wait_s=0.25) == [_ticket(1, at=5.0)]
    assert book.add_image(_key(1), "late", 5.4) is None  # too late: it waits for a ticket that never comes


def test_two_images_with_one_header_are_never_matched_and_their_ticket_goes_back():
    book = TicketBook()
    assert book.add_image(_key(7), "first", 1.0) is None
    assert book.add_image(_key(7), "second", 1.1) is None
    assert _key(7) not in book.images
    match, back = book.add_ticket(_ticket(7))
    assert match is None and back == [_ticket(7)]
    assert book.add_image(_key(7), "third", 1.2) is None  # still ambiguous: not kept


def test_tickets_beyond_the_bound_and_a_resent_ticket_give_the_older_back():
    book = TicketBook(max_tickets=2)
    assert book.add_ticket(_ticket(1)) == (None, [])
    assert book.add_ticket(_ticket(2)) == (None, [])
    assert book.add_ticket(_ticket(3)) == (None, [_ticket(1)])
    newer = Ticket(request_id=2002, plan_version=4, key=_key(2), arrived_s=1.0)
    assert book.add_ticket(newer) == (None, [_ticket(2)])
    match = book.add_image(_key(2), "img2", 2.0)
    assert match is not None and match.ticket == newer


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="max_images"):
        TicketBook(max_images=0)


@given(st.permutations(list(range(6)) + [f"t{i}" for i in range(6)]))
def test_any_arrival_order_matches_every_ticket_with_its_own_image(order):
    book = TicketBook(max_images=8, max_tickets=8)
    matched = {}
    for event in order:
        if isinstance(event, int):
            m = book.add_image(_key(event), f"img{event}", 0.0)
        else:
            m, back = book.add_ticket(_ticket(int(event[1:])))
            assert back == []
        if m is not None:
            assert m.ticket.request_id not in matched
            matched[m.ticket.request_id] = m.image
    assert matched == {1000 + i: f"img{i}" for i in range(6)}
    assert not book.images and not book.tickets
