"""A compute node's unfinished requests (`kaitian_ros.nodes.compute`): their state, and the
table that holds them, bounded by count and by the activation bytes their runners hold.

Both bounds evict the request fed least recently: a real request in flight gets chunks every
few milliseconds, a forged or abandoned one got its last long ago, so a flood of made-up
requests displaces its own kind. The byte bound is the one that keeps memory bounded: a
request waiting for rows that never come (a flood's request under a plan with cuts, whose halos
no neighbour sends) holds what it computed so far, MBs for ResNet-18 at 224.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kaitian_ros.core.pooled import RowSum
from kaitian_ros.core.stripe import StripeRunner

IN_PROGRESS_S = 1.0  # a request fed this recently is in progress (telemetry queue_depth)
MB = 1024 * 1024


@dataclass
class RequestState:
    request_id: int
    plan_version: int
    runner: StripeRunner
    started_s: float
    first_sent_s: float = 0.0   # coordinator's publish time of the first INPUT slab
    first_input_s: float = 0.0
    last_input_s: float = 0.0
    first_output_s: float = 0.0
    last_output_s: float = 0.0
    compute_s: float = 0.0
    feeds_predicted_ms: float = 0.0  # start-up cost of the runs its feeds computed
    bytes_in: int = 0
    bytes_out: int = 0
    frame_id: str = ""
    slab_counts: dict = field(default_factory=dict)
    last_fed_s: float = 0.0  # monotonic time of its latest chunk (the eviction order)
    output_sum: RowSum | None = None  # a pooled head's: this node's output rows, summed when all exist
    image_stamp: Any = None  # the direct path's (the node took the image itself): it publishes FusedOutput
    image_received_s: float = 0.0  # the direct path's: when the image reached this node (wall time)


class RequestTable:
    """Unfinished requests by id; every eviction and expiry is reported to `count_drop` with
    its reason."""

    def __init__(self, count_drop: Callable[[str], None]) -> None:
        self._by_id: dict[int, RequestState] = {}
        self._count_drop = count_drop
        self.dropped_since_trim = 0  # evicted or expired since the node last gave memory back
        self.evicted = 0  # requests evicted for room since start: the node was behind (its telemetry)
        self._dropped_at_last_check = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._by_id.values()))

    def get(self, request_id: int) -> RequestState | None:
        return self._by_id.get(request_id)

    def put(self, state: RequestState) -> None:
        self._by_id[state.request_id] = state

    def finish(self, state: RequestState) -> None:
        del self._by_id[state.request_id]

    def clear(self) -> None:
        self._by_id.clear()

    def held_bytes(self) -> int:
        return sum(s.runner.held_bytes for s in self._by_id.values())

    def make_room(self, max_requests: int) -> None:
        """Before a new request: evict until there is room for it."""
        while len(self._by_id) >= max_requests:
            self._evict(min(self._by_id.values(), key=lambda r: r.last_fed_s),
                        f"table full, {max_requests} requests held")

    def bound_bytes(self, fed: RequestState, max_bytes: int) -> None:
        """After a feed of `fed` (in the table): evict others while the table holds more than
        `max_bytes`. `fed` itself stays even alone above the bound: its rows are a valid plan's,
        so one request of that size is what the model needs."""
        held = self.held_bytes()
        while held > max_bytes:
            others = [s for s in self._by_id.values() if s is not fed]
            if not others:
                return
            victim = min(others, key=lambda r: r.last_fed_s)
            held -= victim.runner.held_bytes
            self._evict(victim, f"{max_bytes / MB:.0f} MB of activations held")

    def expire(self, now_s: float, timeout_s: float) -> None:
        """Forget requests started over `timeout_s` ago (wall clock)."""
        for state in [s for s in self._by_id.values() if now_s - s.started_s > timeout_s]:
            self._drop(state, f"request timeout: request {state.request_id} never completed (missing rows)")

    def note_drop_elsewhere(self) -> None:
        """A drop of the node's outside this table (a chunk for a plan never announced): it ends a
        burst of drops the same way (``drops_ended``), so its memory is given back too."""
        self.dropped_since_trim += 1

    def drops_ended(self) -> bool:
        """True once per burst of drops: at the first call (the node's 1 s housekeeping) that
        finds drops since the last burst and none since the previous call. The node then gives
        memory back. Waiting for an empty table instead never came while real requests kept
        flowing: a flood's expired requests left +62 MB held."""
        n = self.dropped_since_trim
        ended = n > 0 and n == self._dropped_at_last_check
        self._dropped_at_last_check = 0 if ended else n
        if ended:
            self.dropped_since_trim = 0
        return ended

    def in_progress(self) -> int:
        """Requests fed within IN_PROGRESS_S: the coordinator lets a node that was late back in
        once this is no more than it could have sent. Held requests would not do: a flood's
        made-up requests stay in the table until they expire, long after the flood."""
        now = time.monotonic()
        return sum(1 for s in self._by_id.values() if now - s.last_fed_s <= IN_PROGRESS_S)

    def _evict(self, victim: RequestState, why: str) -> None:
        self.evicted += 1
        self._drop(victim, f"evicted: request {victim.request_id} ({why})")

    def _drop(self, state: RequestState, reason: str) -> None:
        del self._by_id[state.request_id]
        self.dropped_since_trim += 1
        self._count_drop(reason)
