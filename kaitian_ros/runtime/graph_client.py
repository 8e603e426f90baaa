"""Introspection of a running embedded graph: what ``ros2 node/topic/param`` do, over Zenoh."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kaitian_ros.runtime import interfaces, security
from kaitian_ros.runtime import zenoh_session as zs

QUERY_TIMEOUT_S = 3.0
DISCOVERY_WAIT_S = 2.0  # how long a lookup by name keeps asking before "not found"
# how long an empty answer is asked again: a running graph always has a node, and on a loaded
# machine a new session's first answers can stay empty for over two seconds (CI once listed no node)
EMPTY_WAIT_S = 6.0
SETTLE_S = 0.3


class GraphError(RuntimeError):
    """A request to the graph that failed (no such node, refused, no answer)."""


@dataclass(frozen=True)
class TopicInfo:
    name: str
    types: tuple[str, ...]
    publishers: int
    subscribers: int


@dataclass(frozen=True)
class RawSample:
    """One message as it came off the wire: its CDR bytes untouched, and when it arrived."""

    payload: bytes
    received_ns: int   # wall clock when this process got it
    source_ns: int     # publisher's wall clock when it published (0: its attachment says nothing)
    gid: bytes         # the publisher's GID (b"" if unknown)
    cached: bool       # a latched publisher's answer to our late-joiner query, not a live sample


class GraphClient:
    def __init__(self, router: str | None = None, domain: int | None = None) -> None:
        self.domain = zs.domain_id() if domain is None else domain
        self.router = router or zs.router_endpoint()
        try:
            self.session = zs.open_session("peer", connect=self.router)
        except security.SecurityError as exc:  # KAITIAN_SECURITY names unusable certificates
            raise GraphError(str(exc)) from None
        except zs.SessionError as exc:
            hint = "" if security.from_env() else " (a secure graph needs KAITIAN_SECURITY=<cert dir>)"
            raise GraphError(f"cannot reach a router at {self.router}: {exc}{hint}") from None
        # a fresh session needs a moment before the router routes queries to it
        time.sleep(SETTLE_S)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> GraphClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def liveliness(self, wait_s: float = DISCOVERY_WAIT_S) -> list[zs.LivelinessEntry]:
        """Every entity's liveliness entry: asked until two answers ``SETTLE_S`` apart agree, for
        up to ``wait_s`` (0: one answer), and an empty answer for up to ``EMPTY_WAIT_S``. A session
        that just connected can get a partial answer while its direct links to the other peers
        come up (CI's `kaitian node list` once printed one of five nodes on a loaded machine), or
        none before its router has it in the graph (CI once printed none after two seconds)."""
        start = time.monotonic()
        deadline, empty_deadline = start + wait_s, start + max(wait_s, EMPTY_WAIT_S)
        previous: Counter[zs.LivelinessEntry] | None = None
        while True:
            entries = self._ask_liveliness()
            answer = Counter(entries)  # two publishers of one node on one topic are two entries
            now = time.monotonic()
            if wait_s <= 0 or (entries and (answer == previous or now >= deadline)) or now >= empty_deadline:
                return entries
            previous = answer
            time.sleep(SETTLE_S)

    def _ask_liveliness(self) -> list[zs.LivelinessEntry]:
        entries = []
        for reply in self.session.liveliness().get(f"{zs.LIVELINESS_PREFIX}/{self.domain}/**",
                                                   timeout=QUERY_TIMEOUT_S):
            if reply.ok is not None:
                entry = zs.parse_liveliness(str(reply.ok.key_expr))
                if entry is not None:
                    entries.append(entry)
        return entries

    def nodes(self) -> list[str]:
        return sorted({e.node_fqn for e in self.liveliness() if e.kind == "NN"})

    def topics(self, wait_s: float = DISCOVERY_WAIT_S) -> list[TopicInfo]:
        """Every topic with its types and counts of publishers and subscribers (asked until the
        answer settles, for up to ``wait_s``: `liveliness`)."""
        found: dict[str, dict[str, Any]] = {}
        for e in self.liveliness(wait_s):
            if e.kind not in ("MP", "MS"):
                continue
            info = found.setdefault(e.topic, {"types": set(), "MP": 0, "MS": 0})
            info["types"].add(e.type_name)
            info[e.kind] += 1
        return [TopicInfo(name, tuple(sorted(v["types"])), v["MP"], v["MS"]) for name, v in sorted(found.items())]

    def topic_type(self, topic: str, wait_s: float = DISCOVERY_WAIT_S) -> str:
        """The type of a published topic. Asked again for up to ``wait_s``: a session that
        just connected may not have every liveliness token yet (echo once failed that way)."""
        deadline = time.monotonic() + wait_s
        while True:
            for info in self.topics(wait_s=0.0):  # this loop does the asking again
                if info.name == topic:
                    return info.types[0]
            if time.monotonic() >= deadline:
                raise GraphError(f"topic '{topic}' not found (is its publisher running?)")
            time.sleep(0.2)

    def subscribe(self, topic: str, msg_type: str, callback: Callable[[Any, int], None]) -> Any:
        """Raw subscription for echo/hz: callback(decoded message or None, payload bytes)."""

        def on_raw(sample: RawSample) -> None:
            try:
                msg = interfaces.decode(sample.payload, msg_type)
            except interfaces.DecodeError:
                msg = None
            callback(msg, len(sample.payload))

        return self.subscribe_raw(topic, msg_type, on_raw)

    def subscribe_raw(self, topic: str, msg_type: str, callback: Callable[[RawSample], None],
                      *, latched: bool | None = None) -> Any:
        """Undecoded samples of ``topic`` with this package's type hash, on zenoh's threads.

        A latched publisher's cached last sample is asked for too, as a late-joining
        transient-local subscriber would: ``latched`` None asks whenever the topic has a
        publisher (one without a cache just does not answer), False never."""
        key = zs.topic_key(self.domain, topic, msg_type)

        def deliver(sample: Any, cached: bool) -> None:
            if not zs.is_concrete_key(str(sample.key_expr)):  # not a publisher's key (zs.is_concrete_key)
                return
            received_ns = time.time_ns()
            source_ns, gid = 0, b""
            if sample.attachment is not None:
                with contextlib.suppress(ValueError):  # foreign publishers may attach nothing useful
                    _, source_ns, gid = zs.parse_attachment(sample.attachment.to_bytes())
            callback(RawSample(sample.payload.to_bytes(), received_ns, source_ns, gid, cached))

        sub = self.session.declare_subscriber(key, lambda sample: deliver(sample, False))
        if latched is None:
            latched = any(e.kind == "MP" and e.topic == topic for e in self.liveliness())
        if latched:
            def deliver_reply(reply: Any) -> None:
                if reply.ok is not None:  # an error reply carries no sample
                    deliver(reply.ok, True)

            zs.query_latched(self.session, key, deliver_reply, QUERY_TIMEOUT_S)
        return sub

    def _param_request(self, node: str, op: str, request: dict[str, Any]) -> dict[str, Any]:
        fqn = node if node.startswith("/") else "/" + node
        replies = list(self.session.get(zs.param_key(self.domain, fqn, op),
                                        payload=json.dumps(request).encode(), timeout=zs.PARAM_QUERY_TIMEOUT_S))
        for reply in replies:
            if reply.ok is not None:
                return json.loads(reply.ok.payload.to_bytes())
        raise GraphError(f"node '{fqn}' not found (no parameter service answered within "
                         f"{zs.PARAM_QUERY_TIMEOUT_S:.0f} s)")

    def list_parameters(self, node: str) -> list[dict[str, Any]]:
        return self._param_request(node, "list", {})["parameters"]

    def get_parameter(self, node: str, name: str) -> Any:
        answer = self._param_request(node, "get", {"names": [name]})
        if not answer.get("successful"):
            raise GraphError(answer.get("reason", "refused"))
        return answer["values"][name]

    def set_parameters(self, node: str, values: dict[str, Any]) -> tuple[bool, str]:
        answer = self._param_request(node, "set", {"values": values})
        return bool(answer.get("successful")), str(answer.get("reason", ""))


class RateMeter:
    """``ros2 topic hz`` statistics over a sliding window of arrival times."""

    def __init__(self, window: int = 100) -> None:
        self.window = window
        self.stamps: list[float] = []
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    def tick(self, size: int = 0) -> None:
        with self.lock:
            self.stamps.append(time.monotonic())
            self.sizes.append(size)
            del self.stamps[:-self.window - 1]
            del self.sizes[:-self.window - 1]

    def summary(self) -> dict[str, float] | None:
        with self.lock:
            if len(self.stamps) < 2:
                return None
            gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        mean = sum(gaps) / len(gaps)
        std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        return {"rate": 1.0 / mean if mean > 0 else float("inf"), "min": min(gaps), "max": max(gaps),
                "std": std, "window": len(gaps)}
