"""`zenoh_session.watch_departures` with a zenoh session double (named as such: a unit test of
the adapter; the real sessions are in test_runtime_embedded.py): a node's token withdrawn is
only a departure when no one holds it on a second look either."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import zenoh

from kaitian_ros.runtime import zenoh_session as zs


class _LivelinessDouble:
    """Session double: the departure subscriber's handler, and liveliness queries answered
    from a script (one list of replies per query; the last repeats)."""

    def __init__(self, answers: list[list[Any]]) -> None:
        self.answers = answers
        self.queries = 0
        self.handler: Any = None

    def liveliness(self) -> _LivelinessDouble:
        return self

    def declare_subscriber(self, key: str, handler: Any) -> object:
        self.handler = handler
        return object()

    def get(self, key: str, timeout: float) -> list[Any]:
        self.queries += 1
        return self.answers[min(self.queries, len(self.answers)) - 1]


HELD = SimpleNamespace(ok=object())  # a reply: someone holds the token
KEY = zs.node_token(0, "aa", 1, "/", "watcher")


def _withdraw(answers: list[list[Any]], queries: int) -> tuple[_LivelinessDouble, list[str]]:
    """The token withdrawn; returns once `queries` were asked (or 5 s passed) and the
    confirmation had time to report."""
    session, gone = _LivelinessDouble(answers), []
    reported = threading.Event()

    def on_gone(entry: zs.LivelinessEntry) -> None:
        gone.append(entry.node_fqn)
        reported.set()

    zs.watch_departures(session, 0, on_gone)
    session.handler(SimpleNamespace(kind=zenoh.SampleKind.DELETE, key_expr=KEY))
    deadline = time.monotonic() + 5.0
    while session.queries < queries and time.monotonic() < deadline:
        time.sleep(0.01)
    reported.wait(0.3)
    return session, gone


def test_a_token_still_held_on_the_second_look_is_no_departure() -> None:
    session, gone = _withdraw([[], [HELD]], 2)
    assert session.queries == 2 and gone == []


def test_a_token_held_by_no_one_twice_is_a_departure() -> None:
    session, gone = _withdraw([[]], zs.CONFIRM_QUERIES)
    assert session.queries == zs.CONFIRM_QUERIES and gone == ["/watcher"]


def test_a_token_held_at_once_is_asked_once() -> None:
    session, gone = _withdraw([[HELD]], 1)
    time.sleep(zs.CONFIRM_PAUSE_S + 0.1)  # a second query would have come by now
    assert session.queries == 1 and gone == []
