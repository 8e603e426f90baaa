"""What the coordinator remembers about plans that ran.

How long each plan really took (requests that ran alone only), how far the cost model was off
on each set of nodes, and the plan that ran when a node left (restored when the node comes
back and the plan's other nodes kept their speed). Pure: every method is given the current time, the nodes' cost
profiles and the alive nodes; nothing here reads a clock or talks to the middleware.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kaitian_ros.core import planner
from kaitian_ros.core.costs import DeviceProfile
from kaitian_ros.core.plan import Plan, PlanSpec

SPEED_CHANGE = 1.3  # a profile whose trunk time moved this much is a device that changed speed
OBSERVED_TTL_S = 60.0  # a plan's measured latency is forgotten this long after it last ran
# Requests that ran alone before a plan's measured latency counts, and how many of the latest
# its median is over. A median of three ignores one request that a busy moment slowed down;
# an average seeded by the first ones let one such request make a good plan look worse than
# the one before it for the rest of OBSERVED_TTL_S (robot_two_edges lost its layer-wise plan so)
MEASURED_MIN = 3
MEASURED_WINDOW = 5
OBSERVED_MAX = 64  # plans remembered at most: the oldest go


def same_speed(before_ms: float, after_ms: float) -> bool:
    """A trunk time within SPEED_CHANGE of an earlier one: the device did not change speed."""
    return before_ms / SPEED_CHANGE <= after_ms <= before_ms * SPEED_CHANGE


def changed_speed(trunks: Mapping[str, float], profiles: Mapping[str, DeviceProfile],
                  ignore: str = "") -> str | None:
    """The first node of `trunks` (node -> trunk_ms then) whose profile is gone or whose trunk
    time moved beyond SPEED_CHANGE since, other than `ignore`; None if none did."""
    for n, trunk in trunks.items():
        profile = profiles.get(n)
        if n != ignore and (profile is None or not same_speed(trunk, profile.trunk_ms)):
            return n
    return None


def _run_rows(nodes: Collection[str], profiles: Mapping[str, DeviceProfile]) -> dict[str, int]:
    return {n: profiles[n].min_run_rows for n in nodes if n in profiles}


@dataclass(frozen=True)
class ObservedPlan:
    spec: PlanSpec
    slab_rows: int
    samples: tuple[float, ...]  # latencies of the latest requests that ran alone under it (ms)
    n: int  # requests that ran alone under it since the measurement started
    last_s: float  # monotonic time of the last one
    trunks: dict  # node -> profile trunk_ms at its latest request
    predicted_ms: float  # the plan's predicted latency at the latest request
    active: frozenset  # the nodes it keeps busy (`planner.error_key`)
    run_rows: dict  # node -> its executor's min_run_rows at its latest request (profile); {}: whole image

    @property
    def ms(self) -> float:
        """The plan's measured latency: the median of the latest samples."""
        return statistics.median(self.samples)


@dataclass(frozen=True)
class Departure:
    """The plan that ran when a node of it left (restored if the node comes back)."""

    spec: PlanSpec
    slab_rows: int
    predicted_ms: float  # its latest prediction
    measured_ms: float | None  # what it measured, if it ran long enough alone
    trunks: dict  # node -> profile trunk_ms then
    left_s: float  # monotonic


class PlanMemory:
    """What plans really took lately (`observed`, by `planner.spec_key`) and the plan that ran
    when each node left (`left_from`, by node)."""

    def __init__(self) -> None:
        self.observed: dict[tuple, ObservedPlan] = {}  # what plans really took lately
        self.left_from: dict[str, Departure] = {}  # compute node -> the plan that ran when it left
        self.by_settings: dict[tuple, tuple[PlanSpec, int]] = {}  # settings -> (spec, slab_rows) run last

    def observe(self, plan: Plan, ms: float, predicted_ms: float, now: float,
                profiles: Mapping[str, DeviceProfile], alive: Collection[str]) -> ObservedPlan | None:
        """Remember that a request that ran alone under `plan` took `ms`, and that the plan was
        predicted to take `predicted_ms` then; the plan's observation now (None if forgotten)."""
        spec, slab_rows = plan.spec, plan.slab_rows
        trunks = {n: profiles[n].trunk_ms for n in spec.node_ids if n in profiles}
        # a whole image runs every op once per stripe whatever the nodes' min_run_rows (Plan.run_rows)
        run_rows = {} if plan.whole_image else _run_rows(spec.node_ids, profiles)
        key = planner.spec_key(spec, slab_rows)
        seen = self.observed.get(key)
        if seen is None or not self.still_valid(seen, now, profiles, alive):
            self.observed[key] = ObservedPlan(spec, slab_rows, (ms,), 1, now, trunks, predicted_ms,
                                              planner.error_key(spec, plan.active_nodes()), run_rows)
        else:  # the speeds it now ran at: a slow drift of a profile while it runs is its speed
            self.observed[key] = ObservedPlan(spec, slab_rows, (*seen.samples, ms)[-MEASURED_WINDOW:], seen.n + 1,
                                              now, trunks, predicted_ms, seen.active, run_rows)
        if len(self.observed) > OBSERVED_MAX:  # bounded: the oldest go
            for k, _ in sorted(self.observed.items(), key=lambda kv: kv[1].last_s)[:len(self.observed) - OBSERVED_MAX]:
                del self.observed[k]
        return self.observed.get(key)

    def forget(self, key: tuple) -> None:
        """Drop what the plan `key` measured: its next requests measure it afresh."""
        self.observed.pop(key, None)

    @staticmethod
    def still_valid(seen: ObservedPlan, now: float, profiles: Mapping[str, DeviceProfile],
                    alive: Collection[str]) -> bool:
        """A measurement stays valid while it is recent and no node of the plan changed speed
        since its latest request (its profile's trunk time within SPEED_CHANGE of what it was
        then) or, for a streamed plan, the way its executor groups rows (`min_run_rows`: the same
        plan with every op run once per node is another computation than in runs of a few rows;
        the benchmark's `no_stream` variant measured a plan so that `auto` then took for its
        own). A whole image runs every op once per stripe whatever `min_run_rows` says.
        Since the latest, not the first: a profile refined from live requests drifts
        away from the start-up measurement, and compared with the first request the single
        device lost its measurement in the benchmark's `default` scenario while it ran, and
        the search went back to a stripes plan measured worse."""
        return now - seen.last_s <= OBSERVED_TTL_S and all(n in alive for n in seen.spec.node_ids) and \
            changed_speed(seen.trunks, profiles) is None and \
            (not seen.run_rows or _run_rows(seen.spec.node_ids, profiles) == seen.run_rows)

    def measured(self, now: float, profiles: Mapping[str, DeviceProfile],
                 alive: Collection[str]) -> dict[tuple, planner.MeasuredPlan]:
        """The plans with a valid measured latency, for the planner."""
        return {k: planner.MeasuredPlan(o.spec, o.slab_rows, o.ms) for k, o in self.observed.items()
                if o.n >= MEASURED_MIN and self.still_valid(o, now, profiles, alive)}

    def beaten(self, plan: Plan, ms: float, gain: float, now: float, profiles: Mapping[str, DeviceProfile],
               alive: Collection[str]) -> bool:
        """Whether another plan that ran lately measured faster than `ms` by more than `gain`."""
        key = planner.spec_key(plan.spec, plan.slab_rows)
        return any(m.ms * (1.0 + gain) < ms for k, m in self.measured(now, profiles, alive).items() if k != key)

    def earlier_errors(self, now: float) -> dict[frozenset, float]:
        """measured / predicted of the plan that ran last on each set of nodes, also when a node
        of it changed speed since (then its latency no longer counts, but how far the model was
        off on those nodes still does: without it, every speed change let the planner try the
        same over-optimistic split again)."""
        latest: dict[frozenset, ObservedPlan] = {}
        for o in self.observed.values():
            if o.n >= MEASURED_MIN and o.predicted_ms > 0 and now - o.last_s <= OBSERVED_TTL_S and \
                    (o.active not in latest or o.last_s > latest[o.active].last_s):
                latest[o.active] = o
        return {nodes: o.ms / o.predicted_ms for nodes, o in latest.items()}

    def record_departure(self, running: Plan, dead: Collection[str], predicted_ms: float, now: float,
                         profiles: Mapping[str, DeviceProfile]) -> None:
        """Nodes of the running plan left: remember the plan for each of them (with what it
        measured), if every node of it has a profile."""
        if not all(n in profiles for n in running.spec.node_ids):
            return
        seen = self.observed.get(planner.spec_key(running.spec, running.slab_rows))
        measured = seen.ms if seen is not None and seen.n >= MEASURED_MIN else None
        trunks = {n: profiles[n].trunk_ms for n in running.spec.node_ids}
        for n in dead:
            if n in running.active_nodes():
                self.left_from[n] = Departure(running.spec, running.slab_rows, predicted_ms, measured, trunks, now)

    def take_departure(self, node: str, now: float, strategy: str, alive: Collection[str],
                       profiles: Mapping[str, DeviceProfile]) -> tuple[Departure | None, str]:
        """The plan `node` left, if it can run again now (forgotten either way): recent, of the
        strategy asked, every node of it alive and every other node at the speed it had then.
        The second value says why not when another node of it changed speed ("" otherwise).

        The returning node's own speed is not compared: its new process publishes a start-up
        measurement, the departed one a profile refined from live requests, and on a busy
        host the two differed by 1.5x for the same device (the test of this refused its
        restore so). A real change shows in the periodic rounds, which re-plan from there."""
        d = self.left_from.pop(node, None)
        if d is None or now - d.left_s > OBSERVED_TTL_S or strategy not in ("auto", d.spec.strategy) or \
                any(n not in alive for n in d.spec.node_ids):
            return None, ""
        n = changed_speed(d.trunks, profiles, ignore=node)
        if n is not None:
            profile = profiles.get(n)
            return None, (f"{node} joined again, {n} at another speed (trunk {d.trunks[n]:.1f} -> "
                          f"{profile.trunk_ms if profile else float('nan'):.1f} ms): planning anew")
        return d, ""

    def ran_with(self, settings: tuple, plan: Plan) -> None:
        """`plan` took effect while the plan-shaping parameters were `settings` (any hashable
        value the caller derives from them)."""
        self.by_settings.pop(settings, None)  # newest last: the oldest go first when bounded
        self.by_settings[settings] = (plan.spec, plan.slab_rows)
        while len(self.by_settings) > OBSERVED_MAX:
            del self.by_settings[next(iter(self.by_settings))]

    def resumable(self, settings: tuple, now: float, profiles: Mapping[str, DeviceProfile],
                  alive: Collection[str]) -> planner.MeasuredPlan | None:
        """The plan that ran last under `settings`, if its measurement is still valid: what the
        parameters returning to `settings` start from (a user who tried another strategy and
        went back to `auto` gets the plan auto had found, not a new search's first guesses)."""
        got = self.by_settings.get(settings)
        return None if got is None else self.measured(now, profiles, alive).get(planner.spec_key(*got))

    def forget_departures(self) -> None:
        """The plans nodes left were chosen under settings that changed: none is restored."""
        self.left_from.clear()
