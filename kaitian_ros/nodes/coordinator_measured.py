"""What a measured latency sets off in the coordinator.

A request that ran alone is a measurement of its plan (`core.plan_memory`). Once the running
plan's measurement counts, the coordinator either leaves it - at once for a plan that measured
faster lately (`planner.measured_return`), else through a planning round (first over single
nodes when a split missed) - or, when it keeps it, tries its streaming twin
(`planner.streaming_twin`): streamed or not is settled by measuring both. Once the twin has
measured, the plan it was tried from runs again and is measured afresh (`_back_from_twin`), and
the faster of the two stays.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from kaitian_ros.core import planner
from kaitian_ros.core.plan import Plan
from kaitian_ros.core.plan_memory import MEASURED_MIN

if TYPE_CHECKING:
    from kaitian_ros.nodes.coordinator import Coordinator


def observe_latency(c: Coordinator, plan: Plan, ms: float) -> None:
    """Remember what a plan really took (requests that ran alone only: two requests in flight
    share the nodes, and the planner predicts one request), and what it was predicted to take
    then; leave the running plan or try its twin as the measurement says."""
    running = c.running_plan()
    key = planner.spec_key(plan.spec, plan.slab_rows)
    is_running = running is not None and planner.spec_key(running.spec, running.slab_rows) == key
    # the newest prediction of the running plan (re-predicted every round), else its own
    predicted = c.predicted_ms if is_running else plan.estimated_ms
    t, gain = time.monotonic(), c.params["min_plan_gain"]
    now = c.memory.observe(plan, ms, predicted, t, c.profiles, c.alive)
    version = c.current.version if c.current is not None else 0
    if now is None or not is_running or now.n < MEASURED_MIN:
        return
    if c.twin_trial is not None and c.twin_trial[0] == version:  # the version's plan is the twin
        origin_key, c.twin_trial = c.twin_trial[1], None
        if _back_from_twin(c, origin_key, now.ms):
            return
    # when its measurement first counts, and once per version (a plan kept on an older one):
    # the model was wrong, a plan that ran before or the newest round's runner-up is better
    if (now.n == MEASURED_MIN or c.measure_replanned != version) and (
            now.ms > c.predicted_ms * (1 + gain)
            or c.memory.beaten(plan, now.ms, planner.measured_margin(gain), t, c.profiles, c.alive)
            or planner.worth_leaving(c.choice, key, now.ms, gain)):
        c.measure_replanned = version
        why = f"measured {now.ms:.1f} ms, predicted {c.predicted_ms:.1f} ms"
        if not _return_to_measured(c, key, now.ms, why, t):
            c.replan_soon(why, quick=len(plan.active_nodes()) > 1)
    elif c.pending is None and c.planner.busy is None:
        # not while a round runs: it may be the one this plan's measurement just asked for (the
        # plan's node slowed down 3x: the twin on that same node was tried, and the round's
        # answer, a plan on another node, was dropped for the version the trial had started)
        _try_twin(c, plan, now.ms, t)


def _following(c: Coordinator) -> planner.Choice | None:
    """The newest planning round's choice if the coordinator follows measurements now: only
    with the `adaptive` policy (with fixed shares the plan is kept), not under `input_pacing_ms`
    (one slab would skip it), and once a round has chosen; else None."""
    alive = tuple(n for n in c.nodes if n in c.alive)
    if c.shares_for(alive)[1] != "adaptive" or c.params["input_pacing_ms"] > 0:
        return None
    return c.choice


def _switch(c: Coordinator, choice: planner.Choice, to: planner.Candidate, why: str) -> bool:
    """Run `to` now, the newest round's candidates kept for later looks; whether it did."""
    request = c.plan_request(why, 0, False)
    if request is None or not set(to.spec.node_ids) <= set(request.nodes):
        return False
    c.apply_plan(request, choice.switched_to(to), None)
    return True


def _return_to_measured(c: Coordinator, running_key: tuple, ms: float, why: str, now: float) -> bool:
    """Switch to the plan that measured fastest lately, if the running plan (`running_key`) is
    worth leaving for it (`planner.measured_return`); whether it did."""
    choice = _following(c)
    if choice is None or c.pending is not None:
        return False
    measured = c.memory.measured(now, c.profiles, c.alive)
    if c.params["strategy"] != "auto":
        measured = {k: m for k, m in measured.items() if m.spec.strategy == c.params["strategy"]}
    back = planner.measured_return(choice, measured, running_key, ms, c.params["min_plan_gain"])
    return back is not None and _switch(c, choice, back, why)


def _back_from_twin(c: Coordinator, origin_key: tuple, twin_ms: float) -> bool:
    """The streaming twin's trial measured (`twin_ms`): run the plan it was tried from
    (`origin_key`) again and measure that afresh; whether it did. The twin was tried because
    that plan measured within `min_plan_gain` of the twin's prediction, and a plan that ran
    slower for a few requests (the machine busy a moment, the first requests after a node was
    lost) sets that off with a measurement of its worst moment: compared with that, a twin
    slower than the plan's usual latency measured as good and stayed (the adaptivity benchmark:
    a direct single-node plan at 15.5 ms, three requests at 21-25, its twin kept at 21-22 ms for
    the 75 requests of two phases). Measured again, the plan is compared with the twin's
    measurement as any two plans are (`observe_latency`): the faster of the two runs on."""
    choice = _following(c)
    if choice is None or c.pending is not None:
        return False
    origin = choice.by_key.get(origin_key)
    seen = c.memory.observed.get(origin_key)
    if origin is None or seen is None:
        return False
    c.memory.forget(origin_key)
    # run as the measured plan it was (not a trial of a prediction: the trial budget is not spent on it)
    back = dataclasses.replace(origin, measured_ms=seen.ms)
    return _switch(c, choice, back, f"its streaming twin measured {twin_ms:.1f} ms, measuring it again")


def _try_twin(c: Coordinator, plan: Plan, ms: float, now: float) -> None:
    """Run the plan's `planner.streaming_twin` for a trial, if it has one (only where
    measurements are followed, so a twin that measures worse is left again)."""
    choice = _following(c)
    if choice is None:
        return
    twin = planner.streaming_twin(choice, plan.spec, plan.slab_rows, ms, whole=c.spec.input_shape[1],
                                  streamed=c.params["slab_rows"], measured=c.memory.measured(now, c.profiles, c.alive),
                                  min_gain=c.params["min_plan_gain"])
    if twin is not None:
        trial = dataclasses.replace(twin, label=f"{twin.label} (trial: streamed or not, only measuring tells)")
        _switch(c, choice, trial, f"measured {ms:.1f} ms")
        # the switch may have been declined (the trial budget spent): only a twin that runs is on trial
        latest = c.pending or c.current
        started = c.plans.get(latest.version) if latest is not None else None
        if latest is not None and started is not None and planner.spec_key(started.spec, started.slab_rows) == \
                planner.spec_key(twin.spec, twin.slab_rows):
            c.twin_trial = (latest.version, planner.spec_key(plan.spec, plan.slab_rows))
