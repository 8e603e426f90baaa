"""Unit tests of GraphClient's liveliness lookup: a test double stands in for the zenoh session
(the end-to-end `kaitian node list` tests run it against real graphs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kaitian_ros.runtime import graph_client
from kaitian_ros.runtime import zenoh_session as zs
from kaitian_ros.runtime.graph_client import GraphClient


@dataclass
class _Key:
    key_expr: str


@dataclass
class _Reply:
    ok: _Key


class SessionDoubleWithScriptedAnswers:
    """Test double of a zenoh session: each liveliness query gets the next scripted answer
    (the last one repeats)."""

    def __init__(self, answers: list[list[str]]) -> None:
        self.answers = answers
        self.asked = 0

    def liveliness(self) -> SessionDoubleWithScriptedAnswers:
        return self

    def get(self, key: str, timeout: float) -> list[_Reply]:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        return [_Reply(_Key(k)) for k in answer]


def _client_on(session: Any) -> GraphClient:
    client = GraphClient.__new__(GraphClient)  # no real session: the double answers
    client.domain, client.session = 0, session
    return client


def _node(name: str, zid: str) -> str:
    return zs.node_token(0, zid, 1, "/", name)


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch) -> None:
    monkeypatch.setattr(graph_client, "SETTLE_S", 0.0)
    monkeypatch.setattr(graph_client, "EMPTY_WAIT_S", 0.2)


def test_a_partial_first_answer_is_asked_again_until_two_answers_agree() -> None:
    everyone = [_node(n, z) for n, z in (("camera", "a1"), ("compute_0", "b2"), ("coordinator", "c3"))]
    session = SessionDoubleWithScriptedAnswers([everyone[1:2], everyone[:2], everyone])
    assert _client_on(session).nodes() == ["/camera", "/compute_0", "/coordinator"]
    assert session.asked == 4  # partial, partial, whole, whole again


def test_an_empty_graph_is_asked_until_the_deadline_then_reported_empty() -> None:
    session = SessionDoubleWithScriptedAnswers([[]])
    assert _client_on(session).liveliness(wait_s=0.05) == []
    assert session.asked >= 2


def test_empty_answers_are_asked_again_past_the_settling_deadline() -> None:
    camera = [_node("camera", "a1")]
    session = SessionDoubleWithScriptedAnswers([[]] * 3 + [camera])
    # wait_s 0 would answer at once; a short wait_s still waits out EMPTY_WAIT_S for a first node
    assert [e.node_name for e in _client_on(session).liveliness(wait_s=0.001)] == ["camera"]


def test_no_wait_means_one_answer() -> None:
    session = SessionDoubleWithScriptedAnswers([[_node("camera", "a1")], [_node("camera", "a1"), _node("x", "b2")]])
    assert [e.node_name for e in _client_on(session).liveliness(wait_s=0.0)] == ["camera"]
    assert session.asked == 1
