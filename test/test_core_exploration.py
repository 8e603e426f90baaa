"""core.exploration: plans known only by their prediction take a bounded share of the requests."""

from __future__ import annotations

from dataclasses import dataclass

from kaitian_ros.core.exploration import (
    EXPLORE_ALLOWANCE,
    EXPLORE_SHARE,
    Exploration,
    is_trial,
    without_trial,
)
from kaitian_ros.core.plan import PlanSpec
from kaitian_ros.core.plan_memory import SPEED_CHANGE
from kaitian_ros.core.planner import Candidate, Choice


@dataclass
class _Profile:  # what the account reads of a DeviceProfile
    trunk_ms: float


PROFILES = {"a": _Profile(10.0), "b": _Profile(20.0)}
ALIVE = ("a", "b")


def _spend(account: Exploration, trials: int, requests_each: int, between: int = 0) -> Exploration:
    """`trials` trials of `requests_each` requests, each followed by `between` measured ones."""
    for _ in range(trials):
        account = account.tried(ALIVE, PROFILES)
        for _ in range(requests_each):
            account = account.completed(on_trial=True)
        for _ in range(between):
            account = account.completed(on_trial=False)
    return account


def test_the_allowance_lets_the_first_trials_run_then_the_share_bounds_them():
    account = Exploration()
    assert account.may_try(ALIVE, PROFILES)
    account = _spend(account, 2, 4)  # the allowance: two trials of four requests
    assert account.on_trials == EXPLORE_ALLOWANCE and account.may_try(ALIVE, PROFILES)
    account = _spend(account, 1, 4)
    assert not account.may_try(ALIVE, PROFILES)
    # measured requests earn trials back: 5 % of them
    needed = int((account.on_trials - EXPLORE_ALLOWANCE) / EXPLORE_SHARE) - account.searched
    for _ in range(needed - 1):
        account = account.completed(on_trial=False)
    assert not account.may_try(ALIVE, PROFILES)
    account = account.completed(on_trial=False)
    assert account.may_try(ALIVE, PROFILES)


def test_over_a_long_stream_trials_stay_within_their_share():
    account, on_trials = Exploration(), 0
    for _ in range(2000):
        trial = account.may_try(ALIVE, PROFILES)  # a search that would try a new plan every time
        if trial:
            account = account.tried(ALIVE, PROFILES)
        for _ in range(4):
            account = account.completed(on_trial=trial)
            on_trials += trial
    assert on_trials <= EXPLORE_SHARE * 8000 + EXPLORE_ALLOWANCE + 4


def test_a_new_situation_may_always_be_tried():
    spent = _spend(Exploration(), 5, 4)
    assert not spent.may_try(ALIVE, PROFILES)
    assert spent.may_try(("a",), PROFILES)  # a node left
    assert spent.may_try(("a", "b", "c"), PROFILES | {"c": _Profile(5.0)})  # a node joined
    faster = PROFILES | {"b": _Profile(20.0 / SPEED_CHANGE / 1.01)}
    assert spent.may_try(ALIVE, faster)  # a node changed speed
    assert not spent.may_try(ALIVE, PROFILES | {"b": _Profile(21.0)})  # drift is no change


def _cand(node: str, predicted: float, measured: float | None = None) -> Candidate:
    return Candidate(PlanSpec.single(node), predicted, f"single {node}", measured_ms=measured)


def test_without_a_trial_the_fastest_measured_candidate_runs():
    trial, slow, fast = _cand("a", 40.0), _cand("b", 45.0, measured=70.0), _cand("c", 50.0, measured=60.0)
    choice = Choice(trial, slow, (trial, slow, fast))
    assert is_trial(choice.best) and not is_trial(fast)
    instead = without_trial(choice)
    assert instead is not None and instead.best == fast and instead.runner_up == trial
    assert without_trial(Choice(trial, None, (trial,))) is None  # nothing measured: only a trial tells
