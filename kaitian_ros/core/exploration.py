"""How much of the request stream the coordinator may spend on plans it has only predicted.

When the coordinator searches plans itself (the adaptive policy with `share_search`), a plan
that wins on its prediction alone is a *trial*: only measuring it tells whether it is faster,
and its first requests are paid by the user whatever it measures. The cost model is within
5-15 % of what plans measure and near-equal candidates differ in small ways (shares 0.12/0.61
against 0.17/0.51), so without a bound every new round could try another one. The benchmark's
`robot_two_edges` showed it: each time its `ours` variant was configured, a new split was
tried on its prediction, measured worse, left, and the running plan's streaming twin tried
next; 10-18 of 30 measured frames ran on such trials, the plan it kept measured 46.6 ms and
ours' median was 54.1.

The bound is a share of the requests: trials may take a share (the coordinator's `trial_share`,
`EXPLORE_SHARE` by default) of the requests served while the coordinator searched, plus
`EXPLORE_ALLOWANCE` requests (a first few trials after
start-up). When it is spent, the fastest *measured* candidate of the round is run instead.
Nothing bounds a trial when no candidate has a measurement, or when the alive nodes or a
node's speed changed since the last trial (the measurements describe another situation).

Pure: the caller gives the alive nodes and the nodes' cost profiles.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from kaitian_ros.core.costs import DeviceProfile
from kaitian_ros.core.plan_memory import changed_speed
from kaitian_ros.core.planner import Candidate, Choice

# a trial costs its first request (one-off costs) and MEASURED_MIN (3) alone requests: about
# four. 5 %: at 30 frames/s one trial every 2.7 s at most once the allowance is spent
EXPLORE_SHARE = 0.05
EXPLORE_ALLOWANCE = 8  # requests: two trials, whatever came before


@dataclass(frozen=True)
class Exploration:
    """The coordinator's account of its trials."""

    searched: int = 0  # requests completed while the coordinator searched plans itself
    on_trials: int = 0  # of them, those that ran under a trial
    alive: frozenset = frozenset()  # the alive nodes at the last trial
    trunks: Mapping[str, float] = field(default_factory=dict)  # node -> profile trunk_ms at the last trial

    def completed(self, on_trial: bool) -> Exploration:
        """A request completed while the coordinator searched (`on_trial`: under a trial)."""
        return replace(self, searched=self.searched + 1, on_trials=self.on_trials + int(on_trial))

    def spent(self, share: float = EXPLORE_SHARE) -> bool:
        """Whether the trials took their share of the requests (`share` 1: never)."""
        return share < 1.0 and self.on_trials > share * self.searched + EXPLORE_ALLOWANCE

    def may_try(self, alive: Collection[str], profiles: Mapping[str, DeviceProfile],
                share: float = EXPLORE_SHARE) -> bool:
        """Whether a plan known only by its prediction may run now."""
        return (not self.spent(share) or frozenset(alive) != self.alive
                or changed_speed(self.trunks, profiles) is not None)

    def tried(self, alive: Collection[str], profiles: Mapping[str, DeviceProfile]) -> Exploration:
        """A trial starts: the situation it was started in."""
        return replace(self, alive=frozenset(alive),
                       trunks={n: p.trunk_ms for n, p in profiles.items() if n in alive})


def is_trial(candidate: Candidate) -> bool:
    """A candidate without a measurement: running it is a trial."""
    return candidate.measured_ms is None


def without_trial(choice: Choice) -> Choice | None:
    """The round's choice with its fastest measured candidate run instead of a trial; None
    when no candidate has a measurement (then only a trial can find out)."""
    measured = [c for c in choice.candidates if not is_trial(c)]
    if not measured:
        return None
    return choice.switched_to(min(measured, key=lambda c: c.expected_ms))
