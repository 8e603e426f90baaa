"""core.tickets: the direct path's pairing of the coordinator's tickets with camera images.

Either may arrive first; every ticket ends matched with the image it names (header and CRC-32
of the data) or given back, never matched with another image; both sides stay bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kaitian_ros.core.tickets import Ticket, TicketBook


def _key(i: int, crc32: int = 0) -> tuple[int, int, str, int]:
    return (100 + i, 500 * i, "camera", crc32)


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
    assert [k for k, _, _ in book.images] == [_key(3), _key(4)] and book.unticketed == 3
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


def test_two_images_with_one_header_pair_by_their_data_even_when_the_first_was_missed():
    """A camera stamping two frames alike: the ticket of the frame this node never saw (or saw
    only after giving its ticket back) must not take the other frame."""
    book = TicketBook()
    first = Ticket(request_id=1007, plan_version=3, key=_key(7, crc32=111), arrived_s=1.0)
    second = Ticket(request_id=1008, plan_version=3, key=_key(7, crc32=222), arrived_s=1.1)
    assert book.add_ticket(first) == (None, [])
    assert book.add_image(_key(7, crc32=222), "second", 1.2) is None  # not the first ticket's image
    match, back = book.add_ticket(second)
    assert back == [] and match is not None and (match.ticket, match.image) == (second, "second")
    assert book.expire(now_s=2.0, wait_s=0.25) == [first]
    # its image after the ticket went back: it waits, and a later ticket of the other frame passes it by
    assert book.add_image(_key(7, crc32=111), "first, late", 2.1) is None
    third = Ticket(request_id=1009, plan_version=3, key=_key(7, crc32=333), arrived_s=2.2)
    assert book.add_ticket(third) == (None, [])
    assert book.add_image(_key(7, crc32=333), "third", 2.3).ticket == third


def test_identical_images_are_taken_by_their_tickets_in_turn():
    book = TicketBook()
    assert book.add_image(_key(5, 9), "copy a", 1.0) is None
    assert book.add_image(_key(5, 9), "copy b", 1.1) is None
    taken = [book.add_ticket(Ticket(request_id=r, plan_version=3, key=_key(5, 9), arrived_s=1.2))[0]
             for r in (1, 2)]
    assert [(m.ticket.request_id, m.image) for m in taken if m] == [(1, "copy a"), (2, "copy b")]
    assert not book.images and not book.tickets


def test_tickets_beyond_the_bound_give_the_oldest_back():
    book = TicketBook(max_tickets=2)
    assert book.add_ticket(_ticket(1)) == (None, [])
    assert book.add_ticket(_ticket(2)) == (None, [])
    assert book.add_ticket(_ticket(3)) == (None, [_ticket(1)])
    match = book.add_image(_key(2), "img2", 2.0)
    assert match is not None and match.ticket == _ticket(2)


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="max_images"):
        TicketBook(max_images=0)


@given(st.permutations(list(range(6)) + [f"t{i}" for i in range(6)]), st.booleans())
def test_any_arrival_order_matches_every_ticket_with_its_own_image(order, one_header):
    """Also when every frame carries one header (`one_header`): the data tells them apart."""
    book = TicketBook(max_images=8, max_tickets=8)

    def key(i: int) -> tuple[int, int, str, int]:
        return _key(0, crc32=i) if one_header else _key(i, crc32=i)

    matched = {}
    for event in order:
        if isinstance(event, int):
            m = book.add_image(key(event), f"img{event}", 0.0)
        else:
            i = int(event[1:])
            m, back = book.add_ticket(Ticket(request_id=1000 + i, plan_version=3, key=key(i), arrived_s=0.0))
            assert back == []
        if m is not None:
            assert m.ticket.request_id not in matched
            matched[m.ticket.request_id] = m.image
    assert matched == {1000 + i: f"img{i}" for i in range(6)}
    assert not book.images and not book.tickets
