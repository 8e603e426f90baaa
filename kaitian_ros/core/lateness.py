"""Late compute nodes: alive (heartbeats arrive) but not delivering their rows.

A node whose process is flooded with chunks nobody asked for, or whose host is busy with
something else, keeps sending heartbeats, so dead-node supervision never removes it; every
request then waits for it. The coordinator asks `late_owners` about the request in flight its
nodes should be working on (the one whose inputs went out first); a node named there leaves
the plan for a while (`quarantine_after`) and the request is sent again to the others. It
comes back when its quarantine is over and its own heartbeat says it holds no more requests
than the coordinator could have sent it (`may_rejoin`): a flooded node holds a table full of
made-up requests until they time out on it.

Pure: times are given by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

# rows still missing this many times the plan's predicted latency after the inputs went out (and
# at least the coordinator's `late_after_s`) are late: the first request of a plan version pays one-off
# costs (kernel selection, weight packing) of 2-5x its steady latency here, hence x2 for it
LATE_FACTOR = 4.0
FIRST_REQUEST_FACTOR = 2.0
# a node whose own telemetry shows requests the coordinator never sent (a flood) will not catch
# up: its rows are late once the plan's predicted latency is past by half, without the floor
OVERLOADED_FACTOR = 1.5
QUARANTINE_S = 2.0  # the first time a node is late; doubled each time it is late again soon
# at most: each try of a node still late costs one late request (0.5-1 s of delay), and a node
# must not stay out long after its fault ended (with 30 s a 20 s link collapse kept it out 11 s
# beyond the collapse)
QUARANTINE_MAX_S = 8.0
STRIKES_FORGOTTEN_S = 60.0  # late again after this long counts as a first time
# requests a node may hold beyond the coordinator's max_in_flight: those it was dropped from
# (abandoned, they time out on the node) and one re-dispatched under a newer plan
SPARE_REQUESTS = 2
# a node's telemetry for requests the coordinator never issued, counted over this long, adds to
# what it holds: a flood of complete requests (the node computes and finishes each) leaves no
# queue in its table, only the work
FOREIGN_WINDOW_S = 1.0


@dataclass(frozen=True)
class Quarantine:
    """A node out of the plan for being late."""

    since_s: float
    until_s: float
    strikes: int  # times late in a row (each within STRIKES_FORGOTTEN_S of the previous)
    reason: str
    ended: bool = False  # the node is back (or a new process of it came): kept for its strikes


def held_out(quarantines: Mapping[str, Quarantine]) -> dict[str, Quarantine]:
    """The nodes out of the plan for lateness now, of each node's latest quarantine."""
    return {n: q for n, q in quarantines.items() if not q.ended}


def late_threshold_s(predicted_ms: float, late_after_s: float, first_of_version: bool,
                     overloaded: bool = False) -> float:
    """How long after its inputs went out a request's missing rows make their owner late
    (`overloaded`: an owner that holds requests the coordinator never sent)."""
    first = FIRST_REQUEST_FACTOR if first_of_version else 1.0
    if overloaded:
        return min(late_after_s, OVERLOADED_FACTOR * first * max(predicted_ms, 0.0) / 1e3)
    return max(late_after_s, LATE_FACTOR * first * max(predicted_ms, 0.0) / 1e3)


def drops_since(before: int | None, reported: int) -> int:
    """The drops for being behind a node reports since its previous telemetry (`before`: the
    count that one reported; None for its first, which counts none: a coordinator started beside
    a long-running node must not take all its old drops for new ones). A count below the
    previous is a restarted node's, counting from 0 again: all of it is new."""
    if before is None:
        return 0
    return reported - before if reported >= before else reported


def node_load(in_progress: int, foreign_s: Iterable[float], now_s: float,
              dropped: Iterable[tuple[float, int]] = ()) -> int:
    """Requests on a node: those in progress (its telemetry) plus those it reported finishing in
    the last FOREIGN_WINDOW_S that the coordinator never issued (`foreign_s`, their times), plus
    the messages it dropped for being behind in that window (`dropped`: (time, how many) from
    the growth of its telemetry's `behind_drops`: chunks that waited too long in its queue,
    evicted requests, a full buffer of chunks for plans not yet announced). A node flooded
    faster than it can take chunks drops them as stale before they become requests: its table
    stays short while our rows wait behind the flood, and only its drops show it (a flood test:
    the flooded node never counted as overloaded, so while both nodes owed rows nobody was
    blamed and a request timed out)."""
    def recent(t: float) -> bool:
        return now_s - t <= FOREIGN_WINDOW_S

    return in_progress + sum(1 for t in foreign_s if recent(t)) + sum(n for t, n in dropped if recent(t))


def overloaded(queue_depth: int, max_in_flight: int) -> bool:
    """A node holding more requests in progress than the coordinator could have sent it: some
    are not ours (a flood of made-up requests)."""
    return queue_depth > max_in_flight + SPARE_REQUESTS


def late_owners(missing_owners: Collection[str], active: Sequence[str], alive: Collection[str],
                elapsed_s: float, thresholds_s: Mapping[str, float],
                overloaded_nodes: Collection[str] = (), feeders: Collection[str] = (),
                loads: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """The nodes to blame for a request in flight for `elapsed_s`: those that owe rows past
    their threshold (`thresholds_s`, by node: `late_threshold_s`), when somebody else can take
    over. When every node of a split owes rows, a late node also delays the others (they wait
    for its halo rows), so only those that are `overloaded_nodes` are blamed; if none is,
    nobody (the host, not one node, is slow). The same when the plan has `feeders` - active
    nodes that own no output rows (a layer-wise plan's first device, a stripes plan's nodes
    before a solo tail): the rows owed may be waiting for them. Of several overloaded nodes
    only the most loaded (`loads`, by node: `node_load`) is blamed: a flooded node's partners
    hold made-up requests too - the flood's requests its halo rows started on them - but fewer,
    and blaming both left nobody to take over, so a flood on a two-node split was never
    blamed. Nobody either when no alive node is left without blame."""
    late = tuple(n for n in active if n in missing_owners and elapsed_s > thresholds_s.get(n, math.inf))
    if (len(active) > 1 and all(n in missing_owners for n in active)) or any(n in active for n in feeders):
        late = tuple(n for n in late if n in overloaded_nodes)
        if len(late) > 1 and loads:
            top = max(loads.get(n, 0) for n in late)
            late = tuple(n for n in late if loads.get(n, 0) == top)
    if not late:
        return ()
    if not any(n not in late for n in alive):
        return ()
    return late


def quarantine_after(previous: Quarantine | None, now_s: float, reason: str) -> Quarantine:
    """The quarantine of a node found late at `now_s` (`previous`: its last one, if any)."""
    strikes = 1
    if previous is not None and now_s - previous.until_s <= STRIKES_FORGOTTEN_S:
        strikes = previous.strikes + 1
    seconds = min(QUARANTINE_MAX_S, QUARANTINE_S * 2 ** (strikes - 1))
    return Quarantine(now_s, now_s + seconds, strikes, reason)


def may_rejoin(quarantine: Quarantine, now_s: float, queue_depth: int, max_in_flight: int) -> bool:
    """Whether a quarantined node's heartbeat (`queue_depth`: requests it holds) lets it back."""
    return now_s >= quarantine.until_s and not overloaded(queue_depth, max_in_flight)
