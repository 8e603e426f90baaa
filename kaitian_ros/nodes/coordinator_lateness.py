"""The coordinator's watch over late and overloaded compute nodes (`core.lateness`).

`LatenessWatch` is the part of `kaitian_ros.nodes.coordinator.Coordinator` that judges the
compute nodes by what they owe and what they report: a warm node that still owes rows of the
request it should be working on past its lateness threshold leaves the plan for a quarantine
and its requests go to the others; it comes back once its telemetry shows it no busier than
the coordinator could have made it. A node's load is the requests in progress on it, those it
reported finishing that this coordinator never issued (a flood's), and the chunks it dropped
for being behind (its telemetry's `behind_drops`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Collection
from typing import Any

from kaitian_ros.core import lateness
from kaitian_ros.nodes.coordinator_requests import RequestFlow, owners_missing


class LatenessWatch(RequestFlow):
    """Late nodes out of the plan, and back in (their state, set by `Coordinator`)."""

    quarantines: dict[str, lateness.Quarantine]  # each node's latest (held out until it ends)
    in_progress: dict[str, int]  # compute node -> requests in progress on it (its latest telemetry)
    foreign: dict[str, collections.deque]  # compute node -> times it reported requests we never issued
    drops: dict[str, collections.deque]  # compute node -> (time, chunks) it dropped for being behind
    behind_drops: dict[str, int]  # compute node -> its latest telemetry behind_drops

    def _start_lateness_watch(self) -> None:
        self.quarantines = {}  # late nodes out of the plan for now; each node's latest (its strikes)
        self.in_progress = {}
        self.foreign = {}
        self.drops = {}
        self.behind_drops = {}

    def _note_load(self, msg: Any) -> None:
        """A node's telemetry: what it says of the node's load beside its requests in progress."""
        if int(msg.request_id) >= self.next_request:  # finished a request we never issued: a flood's
            self.foreign.setdefault(msg.node_id, collections.deque(maxlen=256)).append(time.monotonic())
        behind = int(msg.behind_drops)
        grown = lateness.drops_since(self.behind_drops.get(msg.node_id), behind)
        self.behind_drops[msg.node_id] = behind
        if grown > 0:
            self.drops.setdefault(msg.node_id, collections.deque(maxlen=256)).append((time.monotonic(), grown))

    def _held_out(self, node: str, in_progress: int) -> bool:
        """A node's telemetry reports `in_progress` requests: whether it stays out of the plan
        (quarantined for lateness; it is let back once `core.lateness.may_rejoin`)."""
        self.in_progress[node] = in_progress
        q = self.quarantines.get(node)
        if q is None or q.ended:
            return False
        load = self._load(node)
        if not lateness.may_rejoin(q, time.monotonic(), load, self.params["max_in_flight"]):
            return True
        self.quarantines[node] = dataclasses.replace(q, ended=True)
        self.rt.logger.info(f"{node} back after {time.monotonic() - q.since_s:.1f} s out of the plan ({q.reason}); "
                            f"{load} requests on it")
        return False

    def node_loads(self) -> dict[str, int]:
        """Each alive node's load now (`core.lateness.node_load`), for /diagnostics."""
        return {n: self._load(n) for n in self.alive}

    def _load(self, node: str) -> int:
        return lateness.node_load(self.in_progress.get(node, 0), self.foreign.get(node, ()), time.monotonic(),
                                  self.drops.get(node, ()))

    def _drop_late(self, now_m: float, dead: Collection[str]) -> None:
        """Late nodes leave the plan for their quarantine; their requests go to the others."""
        for n, why in self._late_nodes().items():
            if n in dead or n not in self.alive or not any(m != n and m not in dead for m in self.alive):
                continue  # nobody left to take its rows
            q = self.quarantines[n] = lateness.quarantine_after(self.quarantines.get(n), now_m, why)
            self.counts["late_drops"] += 1
            self._drop([n], f"{why}: out of the plan for {q.until_s - q.since_s:.0f} s at least", "late")

    def _late_nodes(self) -> dict[str, str]:
        """Warm nodes that owe rows of the request they should be working on past its lateness
        threshold (node -> why), when other nodes can take over (`core.lateness`).

        Only the request whose inputs went out first is judged, from when its last input slab
        was published or the request before it finished, whichever is later: a node computes
        requests in the order their chunks arrive, so a later request waits behind it, and
        inputs queued behind a paced (EMULATED slow) link are not the node's delay. A newer
        request that finished first does not restart the clock (`RequestFlow._finished`)."""
        late_after = self.params["late_after_s"]
        sent = [r for r in self.requests.values() if r.inputs_sent_s is not None]
        if late_after <= 0 or not sent:
            return {}
        req = min(sent, key=lambda r: r.inputs_sent_s or 0.0)
        elapsed = time.time() - max(req.inputs_sent_s or 0.0, self.oldest_finished_s)
        loads = {n: self._load(n) for n in self.in_progress}
        busy = {n for n, load in loads.items() if lateness.overloaded(load, self.params["max_in_flight"])}
        owners = owners_missing(req)
        # a node that never delivered is cold (its first calls build kernels): not judged yet
        thresholds = {n: lateness.late_threshold_s(req.predicted_ms, late_after, req.first_of_version, n in busy)
                      for n in owners if n in self.delivered}
        late: dict[str, str] = {}
        feeders = req.plan.feeder_nodes()
        for n in lateness.late_owners(owners, req.plan.active_nodes(), self.alive, elapsed, thresholds, busy, feeders,
                                      loads):
            held = f", {loads[n]} requests on it" if n in busy else ""
            late[n] = (f"late: rows of request {req.request_id} still missing {elapsed:.2f} s after its inputs "
                       f"(predicted {req.predicted_ms:.0f} ms{held})")
        return late
