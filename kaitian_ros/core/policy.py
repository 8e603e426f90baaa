"""Pure share policy: live telemetry -> per-node row shares (see docs/policy.md).

Everything here is a pure function of its arguments: no middleware, no threads, no I/O and no
clock reads (time comes in as ``now_s`` / ``stamp_s``). The scheduler node owns one
``PolicyState`` and threads it through ``observe`` / ``heartbeat`` / ``decide``; identical
inputs give identical outputs, which is what makes the policy testable and replayable.

Model (per request, node i with share x_i of the rows):

    T_i(x_i) = max(x_i * W / speed_i, x_i * B / link_i) + fixed_i = x_i * k_i + fixed_i

with W the model cost of a whole request, B its bytes, k_i = max(W/speed_i, B/link_i).
``equalise_finish_time`` water-fills the common finish time T so that sum x_i = 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

# The values, the configuration and the water-filling live in modules of their own; the names
# in __all__ are the policy's documented API (docs/policy.md) and stay importable from here.
from .policy_config import PARAMETERS, POLICIES, ParamDescriptor, PolicyConfig, config_from_params
from .policy_state import (
    MAX_REQUEST_ID,
    Assignment,
    NodeEstimate,
    PolicyState,
    TelemetrySample,
    frozen_map,
)
from .water_filling import equalise_finish_time, predicted_makespan

__all__ = [
    "PARAMETERS",
    "POLICIES",
    "Assignment",
    "NodeEstimate",
    "ParamDescriptor",
    "PolicyConfig",
    "PolicyState",
    "TelemetrySample",
    "config_from_params",
    "decide",
    "equalise_finish_time",
    "heartbeat",
    "initial_state",
    "observe",
    "predicted_makespan",
]


# How many published assignments we keep to look up which share a node had for a request
# (telemetry arrives for requests that ran under an older plan while a newer one is announced).
_HISTORY = 8


# --------------------------------------------------------------------------------------------
# State machine
# --------------------------------------------------------------------------------------------


def initial_state(config: PolicyConfig, node_ids: Sequence[str] = ()) -> PolicyState:
    """Fresh state; ``node_ids`` fixes the plan order (and static tuple order) up front."""
    config.validate()
    order: list[str] = []
    for n in node_ids:
        if not isinstance(n, str) or not n:
            raise ValueError(f"node ids must be non-empty strings, got {n!r}")
        if n not in order:
            order.append(n)
    return PolicyState(order=tuple(order),
                       estimates=frozen_map({n: NodeEstimate(node_id=n) for n in order}))


def _touch(state: PolicyState, node_id: str, stamp_s: float) -> tuple[PolicyState, NodeEstimate]:
    """Register/refresh a node; a dead node that speaks again after its death rejoins fresh."""
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"node id must be a non-empty string, got {node_id!r}")
    order = state.order if node_id in state.order else state.order + (node_id,)
    est = state.estimates.get(node_id) or NodeEstimate(node_id=node_id)
    dead = state.dead
    members = state.members
    profile = state.profile
    if node_id in dead and math.isfinite(stamp_s) and stamp_s > dead[node_id]:
        # Rejoin: the device may have changed (restart, other hardware) -> measure anew.
        est = NodeEstimate(node_id=node_id)
        dead = frozen_map({k: v for k, v in dead.items() if k != node_id})
        members = members - {node_id}
        profile = frozen_map({k: v for k, v in profile.items() if k != node_id})
    if math.isfinite(stamp_s) and node_id not in dead:
        last = est.last_seen_s
        est = replace(est, last_seen_s=stamp_s if last is None else max(last, stamp_s))
    state = replace(state, order=order, dead=dead, members=members, profile=profile)
    return state, est


def _with_estimate(state: PolicyState, est: NodeEstimate) -> PolicyState:
    d = dict(state.estimates)
    d[est.node_id] = est
    return replace(state, estimates=frozen_map(d))


def heartbeat(state: PolicyState, node_id: str, now_s: float, config: PolicyConfig
              ) -> PolicyState:
    """A node is alive at ``now_s`` (heartbeat or any other sign of life)."""
    state, est = _touch(state, node_id, now_s)
    return _with_estimate(state, est)


def _ew(old: float, new: float, alpha: float, first: bool) -> float:
    # First sample initialises the average; blending with a zero prior would bias it low.
    return new if first else (1.0 - alpha) * old + alpha * new


def _share_for(state: PolicyState, node_id: str, request_id: int) -> float | None:
    """Share node_id had in the plan that governed request_id (None if unknown)."""
    plan = None
    for a in state.history:
        if a.effective_from_request <= request_id:
            plan = a
    if plan is None:
        if state.history:
            return None  # older than anything we remember
        n = len([x for x in state.order if x not in state.dead]) or 1
        return 1.0 / n  # before any plan: assume the coordinator split equally
    if node_id not in plan.node_ids:
        return None
    return plan.shares[plan.node_ids.index(node_id)]


def observe(state: PolicyState, sample: TelemetrySample, config: PolicyConfig) -> PolicyState:
    """Fold one telemetry sample in. Malformed samples only count as a sign of life."""
    state, est = _touch(state, sample.node_id, sample.stamp_s)
    if sample.node_id in state.dead:
        return _with_estimate(state, est)  # late sample from a node we buried: ignore
    nums = (sample.work, sample.compute_ms, sample.transfer_ms, sample.wait_ms,
            sample.bytes_in, sample.bytes_out)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in nums) \
            or sample.rows <= 0 or sample.work <= 0 or sample.compute_ms <= 0:
        return _with_estimate(state, est)
    a = config.ewma_alpha
    first = est.samples == 0
    est, changed = _detect_change(est, float(sample.work) / float(sample.compute_ms), config)
    if changed:  # a step change, not noise: restart the averages from the new regime
        first = True
        est = replace(est, settle=config.change_samples)
        state = replace(state, changed=state.changed | {sample.node_id})
    elif est.settle > 0:
        # settling: the first post-change plan was made from one sample (often of a request
        # that was only partly slowed), so the next few may correct it without waiting
        est = replace(est, settle=est.settle - 1)
        state = replace(state, changed=state.changed | {sample.node_id})
    nbytes = float(sample.bytes_in + sample.bytes_out)
    ew_work = _ew(est.ew_work, float(sample.work), a, first)
    ew_c = _ew(est.ew_compute_ms, float(sample.compute_ms), a, first)
    fixed = _ew(est.fixed_ms, float(sample.wait_ms), a, first)
    link_samples = est.link_samples
    ew_b, ew_t, link = est.ew_bytes, est.ew_transfer_ms, est.link_rate
    if nbytes > 0 and sample.transfer_ms > 0:
        lf = link_samples == 0
        ew_b = _ew(ew_b, nbytes, a, lf)
        ew_t = _ew(ew_t, float(sample.transfer_ms), a, lf)
        link_samples += 1
        link = ew_b / ew_t
    est = replace(est, speed=ew_work / ew_c, link_rate=link, fixed_ms=fixed,
                  samples=est.samples + 1, ew_work=ew_work, ew_compute_ms=ew_c,
                  ew_bytes=ew_b, ew_transfer_ms=ew_t, link_samples=link_samples)
    state = _with_estimate(state, est)
    # Whole-request totals W, B from this node's part: work/share. Small (probe) shares are
    # dominated by halo rows and would inflate W, so only fair-sized shares are used.
    # the share it really ran with (the coordinator's planner may execute other shares than
    # the ones proposed); older nodes do not report it: the proposal history then
    share = sample.share if sample.share > 0 else _share_for(state, sample.node_id, sample.request_id)
    n_live = max(1, len([x for x in state.order if x not in state.dead]))
    if share is not None and share >= 0.5 / n_live:
        tf = state.totals_samples == 0
        state = replace(state,
                        work_total=_ew(state.work_total, sample.work / share, a, tf),
                        bytes_total=_ew(state.bytes_total, nbytes / share, a, tf),
                        totals_samples=state.totals_samples + 1)
    return state


def _detect_change(est: NodeEstimate, speed: float, config: PolicyConfig
                   ) -> tuple[NodeEstimate, bool]:
    """Count samples off the estimate by ``change_ratio``; True once ``change_samples``
    consecutive ones agree in direction (an EWMA alone needs ~1/alpha samples to follow a
    device that became 3x slower; one outlier - a scheduling hiccup - must not reset it)."""
    if config.change_ratio <= 1.0 or est.samples == 0 or est.speed <= 0:
        return replace(est, surprise=0), False
    r = speed / est.speed
    step = 1 if r >= config.change_ratio else -1 if r <= 1.0 / config.change_ratio else 0
    n = est.surprise + step if est.surprise * step > 0 else step
    if abs(n) >= config.change_samples:
        return replace(est, surprise=0), True
    return replace(est, surprise=n), False


def _totals(state: PolicyState, nodes: Sequence[str]) -> tuple[float, float]:
    if state.totals_samples > 0 and state.work_total > 0:
        return state.work_total, state.bytes_total
    # Fallback: assume each node computed an equal part.
    ests = [state.estimates[n] for n in nodes if state.estimates[n].samples > 0]
    if not ests:
        return 0.0, 0.0
    w = sum(e.ew_work for e in ests) / len(ests) * len(nodes)
    b = sum(e.ew_bytes for e in ests) / len(ests) * len(nodes)
    return w, b


def _model_inputs(ests: Sequence[NodeEstimate], config: PolicyConfig
                  ) -> tuple[list[float], list[float], list[float]]:
    return ([e.speed for e in ests], [e.link_rate for e in ests],
            [e.fixed_ms if config.wait_as_fixed else 0.0 for e in ests])


def _makespan(state: PolicyState, ests: Mapping[str, NodeEstimate], nodes: Sequence[str],
              shares: Sequence[float], config: PolicyConfig) -> float:
    """Prediction over nodes that have estimates; 0.0 when nothing is known yet."""
    w, b = _totals(state, nodes)
    pairs = [(ests[n], x) for n, x in zip(nodes, shares) if n in ests and ests[n].samples > 0]
    if w <= 0 or not pairs:
        return 0.0
    sp, lk, fx = _model_inputs([e for e, _ in pairs], config)
    return predicted_makespan(w, b, sp, lk, fx, [x for _, x in pairs])


def _fmt(shares: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in shares)


def _fmt_named(nodes: Sequence[str], shares: Sequence[float]) -> str:
    return ", ".join(f"{n} {x:.2f}" for n, x in zip(nodes, shares)) or "(none)"


def _adaptive_shares(state: PolicyState, ests: Mapping[str, NodeEstimate],
                     members: Sequence[str], probes: Sequence[str], config: PolicyConfig
                     ) -> dict[str, float]:
    shares: dict[str, float] = {}
    p_each = config.probe_share if members else 0.0
    p_each = min(p_each, 0.5 / max(1, len(probes)))  # probes never take over the plan
    budget = 1.0 - p_each * len(probes)
    if members:
        w, b = _totals(state, members)
        me = [ests[n] for n in members]
        if w > 0 and all(e.samples > 0 and e.speed > 0 for e in me):
            sp, lk, fx = _model_inputs(me, config)
            xs = equalise_finish_time(w * budget, b * budget, sp, lk, fx)
        else:
            xs = tuple(1.0 / len(members) for _ in members)
        for n, x in zip(members, xs):
            shares[n] = x * budget
    for n in probes:
        shares[n] = p_each
    return shares


def _static_shares(order: Sequence[str], alive: Sequence[str], config: PolicyConfig
                   ) -> dict[str, float]:
    if isinstance(config.static_shares, Mapping):
        raw = {n: float(config.static_shares.get(n, 0.0)) for n in alive}
    else:
        pos = {n: i for i, n in enumerate(order)}
        raw = {n: (float(config.static_shares[pos[n]]) if pos[n] < len(config.static_shares)
                   else 0.0) for n in alive}
    total = sum(raw.values())
    if total <= 0:
        return {n: 1.0 / len(alive) for n in alive}  # nobody configured is alive: equal
    # Dead nodes' static shares go to the survivors in proportion (renormalise).
    return {n: v / total for n, v in raw.items() if v > 0}


def decide(state: PolicyState, now_s: float, newest_request_id: int, config: PolicyConfig,
           lead_requests: int = 2) -> tuple[PolicyState, Assignment | None]:
    """Maybe publish a new plan. Returns (new state, assignment or None).

    Membership changes (death, join, warm-up finished, policy switch) publish at once; load
    driven changes (adaptive only) need >= min_gain predicted improvement and min_interval_s
    since the last publish. With no live node nothing is published.
    """
    if lead_requests < 0:
        raise ValueError(f"lead_requests must be >= 0, got {lead_requests}")
    ests = dict(state.estimates)
    # Nodes never heard from get their grace period from the first decision on.
    for n in state.order:
        if ests[n].last_seen_s is None:
            ests[n] = replace(ests[n], last_seen_s=now_s)
    dead = dict(state.dead)
    newly_dead = []
    for n in state.order:
        seen = ests[n].last_seen_s
        assert seen is not None  # set for every node by the loop above
        if n not in dead and now_s - seen >= config.dead_after_s:
            dead[n] = seen
            newly_dead.append(n)
    members_set = set(state.members) - set(dead)
    profile = {k: v for k, v in state.profile.items() if k not in dead}
    alive = [n for n in state.order if n not in dead]
    warm = {n: ests[n].samples >= config.warmup_requests for n in alive}

    # Promotion. Cold start (no member yet): everybody shares equally and all are promoted
    # together once all are warm - promoting one early would squeeze the rest to probe shares.
    joined: list[str] = []
    if not members_set:
        if alive and all(warm[n] for n in alive):
            joined = list(alive)
    else:
        joined = [n for n in alive if n not in members_set and warm[n]]
    members_set.update(joined)
    members = [n for n in alive if n in members_set]
    probes = [n for n in alive if n not in members_set]

    if config.policy == "profile_once":
        # KAITIAN-code baseline: each member's speed is measured once, when it joins.
        for n in members:
            if n not in profile:
                profile[n] = ests[n]
    else:
        profile = {}

    state = replace(state, estimates=frozen_map(ests), dead=frozen_map(dead),
                    members=frozenset(members_set), profile=frozen_map(profile))
    if not alive:
        return state, None

    # Desired plan.
    if config.policy == "equal":
        desired = {n: 1.0 / len(alive) for n in alive}
    elif config.policy == "static":
        desired = _static_shares(state.order, alive, config)
    elif config.policy == "profile_once":
        desired = (_adaptive_shares(state, state.profile, members, probes, config)
                   if members else {n: 1.0 / len(alive) for n in alive})
    else:
        desired = _adaptive_shares(state, ests, members, probes, config) \
            if members else {n: 1.0 / len(alive) for n in alive}
    node_ids = tuple(n for n in state.order if n in desired)
    shares = tuple(desired[n] for n in node_ids)
    total = sum(shares)
    shares = tuple(x / total for x in shares)
    # Warm-up status only shapes the plan of the measuring policies; for equal/static a node
    # finishing its warm-up is no reason to republish.
    measuring = config.policy in ("adaptive", "profile_once")
    roles = tuple((n, n in members_set or not measuring) for n in node_ids)

    cur = state.assignment
    model_ests = state.profile if config.policy == "profile_once" and members else state.estimates
    new_ms = _makespan(state, model_ests, node_ids, shares, config)
    structural = (cur is None or cur.node_ids != node_ids or state.roles != roles
                  or cur.policy != config.policy)
    if config.policy in ("equal", "static") and cur is not None and cur.shares != shares:
        structural = True  # static_shares retuned live
    reasons: list[str] = []
    if cur is None:
        reasons.append(f"initial plan ({config.policy}) over {len(node_ids)} node(s)")
    else:
        for n in newly_dead:
            silent = now_s - dead[n]
            reasons.append(f"{n} silent {silent:.1f} s >= dead_after_s "
                           f"{config.dead_after_s:g}: leaves")
        for n in node_ids:
            if n not in cur.node_ids:
                reasons.append(f"{n} new: probe share" if n in probes and members
                               else f"{n} joins")
        warmed = [n for n in joined if n in cur.node_ids]
        if warmed:
            reasons.append(f"{', '.join(warmed)} warm (>= {config.warmup_requests} samples): "
                           f"full member{'s' if len(warmed) > 1 else ''}")
        for n in cur.node_ids:
            if n not in node_ids and n not in newly_dead:
                reasons.append(f"{n} leaves (no share under {config.policy})")
        if cur.policy != config.policy:
            reasons.append(f"policy {cur.policy} -> {config.policy}")
        if not reasons and structural:
            reasons.append(f"{config.policy} shares changed")

    publish = structural
    if not publish and config.policy == "adaptive":
        assert cur is not None  # no plan yet is structural
        cur_ms = _makespan(state, state.estimates, cur.node_ids, cur.shares, config)
        gain = (cur_ms - new_ms) / cur_ms if cur_ms > 0 else 0.0
        interval_ok = (state.last_publish_s is None
                       or now_s - state.last_publish_s >= config.min_interval_s
                       or bool(state.changed & set(cur.node_ids)))
        # The 1e-9 floor keeps min_gain=0 from republishing on rounding noise.
        if gain >= max(config.min_gain, 1e-9) and interval_ok:
            publish = True
            reasons.append(_load_reason(state, cur, node_ids, shares))
    if not publish:
        return state, None

    details: list[str] = []
    if cur is not None:
        if cur.node_ids == node_ids:
            details.append(f"shares {_fmt(cur.shares)} -> {_fmt(shares)}")
        else:
            details.append(f"shares {_fmt_named(cur.node_ids, cur.shares)} -> "
                           f"{_fmt_named(node_ids, shares)}")
        old_ms = _makespan(state, model_ests, cur.node_ids, cur.shares, config) \
            if cur.node_ids == node_ids else cur.predicted_makespan_ms
        if old_ms > 0 and new_ms > 0:
            details.append(f"predicted makespan {old_ms:.0f}->{new_ms:.0f} ms")
    else:
        details.append(f"shares {_fmt_named(node_ids, shares)}")
        if probes and config.policy in ("adaptive", "profile_once"):
            details.append(f"warming up ({config.warmup_requests} samples to join)")
    # Strictly increasing effective_from keeps "plan for request r" unambiguous.
    eff = newest_request_id + lead_requests
    if cur is not None:
        eff = max(eff, cur.effective_from_request + 1)
    eff = min(eff, MAX_REQUEST_ID)  # a uint64 on the wire
    version = (cur.version + 1) if cur is not None else 1
    assignment = Assignment(version=version, effective_from_request=eff, node_ids=node_ids,
                            shares=shares, policy=config.policy,
                            reason="; ".join(reasons) + ": " + ", ".join(details),
                            predicted_makespan_ms=new_ms)
    state = replace(state, assignment=assignment,
                    history=(state.history + (assignment,))[-_HISTORY:], roles=roles,
                    published_estimates=state.estimates, last_publish_s=now_s,
                    changed=frozenset())
    return state, assignment


def _load_reason(state: PolicyState, cur: Assignment, node_ids: Sequence[str],
                 shares: Sequence[float]) -> str:
    """Name the node whose estimate moved most since the last publish (speed or link).

    A link change is named only where the link term binds (B/link > W/speed, now or at the
    last publish): a non-binding link estimate can swing widely without moving any share."""
    w, b = _totals(state, node_ids)

    def link_binds(e: NodeEstimate) -> bool:
        return (w > 0 and b > 0 and e.speed > 0 and math.isfinite(e.link_rate)
                and b / e.link_rate > w / e.speed)

    best: tuple[float, int, str] | None = None
    for i, n in enumerate(node_ids):
        now = state.estimates[n]
        then = state.published_estimates.get(n)
        if then is None or then.samples == 0 or then.speed <= 0 or now.speed <= 0:
            continue
        rs = now.speed / then.speed
        rl = (now.link_rate / then.link_rate
              if math.isfinite(now.link_rate) and math.isfinite(then.link_rate) else 1.0)
        if (link_binds(now) or link_binds(then)) and abs(math.log(rl)) > abs(math.log(rs)):
            text = f"{n} link {'slower' if rl < 1 else 'faster'} ({rl:.2f}x)"
            mag = abs(math.log(rl))
        else:
            text = f"{n} {'slower' if rs < 1 else 'faster'} (speed {rs:.2f}x)"
            mag = abs(math.log(rs))
        # Largest relative change wins; ties go to the earlier node (deterministic).
        if best is None or mag > best[0]:
            best = (mag, i, text)
    return best[2] if best is not None else "estimates refined"
