"""Tests of the pure share policy (kaitian_ros.core.policy): math properties and state machine."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kaitian_ros.core.policy import decide, heartbeat, initial_state, observe
from kaitian_ros.core.policy_config import PARAMETERS, PolicyConfig, config_from_params
from kaitian_ros.core.policy_state import Assignment, PolicyState, TelemetrySample
from kaitian_ros.core.water_filling import equalise_finish_time, predicted_makespan

FAST = settings(max_examples=150, deadline=None)

speed_st = st.floats(0.01, 1e4, allow_nan=False, allow_infinity=False)
link_st = st.one_of(st.floats(0.01, 1e5, allow_nan=False, allow_infinity=False),
                    st.just(math.inf))
fixed_st = st.floats(0.0, 50.0, allow_nan=False, allow_infinity=False)
work_st = st.floats(1.0, 1e6, allow_nan=False, allow_infinity=False)
bytes_st = st.floats(0.0, 1e7, allow_nan=False, allow_infinity=False)


@st.composite
def models(draw, min_n: int = 1, max_n: int = 8):
    n = draw(st.integers(min_n, max_n))
    return (draw(work_st), draw(bytes_st),
            draw(st.lists(speed_st, min_size=n, max_size=n)),
            draw(st.lists(link_st, min_size=n, max_size=n)),
            draw(st.lists(fixed_st, min_size=n, max_size=n)))


# --------------------------------------------------------------------------------------------
# equalise_finish_time / predicted_makespan
# --------------------------------------------------------------------------------------------


@FAST
@given(models())
def test_shares_nonnegative_and_sum_to_one(m):
    x = equalise_finish_time(*m)
    assert len(x) == len(m[2])
    assert all(v >= 0 for v in x)
    assert abs(sum(x) - 1.0) <= 1e-9


@FAST
@given(models())
def test_finish_times_equal_and_optimal(m):
    w, b, sp, lk, fx = m
    x = equalise_finish_time(w, b, sp, lk, fx)
    t = predicted_makespan(w, b, sp, lk, fx, x)
    k = [max(w / s, 0.0 if math.isinf(link) or b == 0 else b / link) for s, link in zip(sp, lk)]
    for xi, ki, fi in zip(x, k, fx):
        if xi > 0:  # every participating node finishes at the common T
            assert xi * ki + fi == pytest.approx(t, rel=1e-9, abs=1e-9)
        else:  # a node left out could not even start before T
            assert fi >= t - 1e-9 * max(1.0, t)
    # No other split does better: equal shares and all-on-one are valid alternatives.
    n = len(sp)
    assert t <= predicted_makespan(w, b, sp, lk, fx, [1.0 / n] * n) * (1 + 1e-9)
    for i in range(n):
        one = [0.0] * n
        one[i] = 1.0
        assert t <= predicted_makespan(w, b, sp, lk, fx, one) * (1 + 1e-9)


@FAST
@given(models(min_n=2), st.data())
def test_faster_node_never_fewer_rows_on_equal_link(m, data):
    w, b, sp, _, _ = m
    n = len(sp)
    link = data.draw(link_st)
    f = data.draw(fixed_st)
    x = equalise_finish_time(w, b, sp, [link] * n, [f] * n)
    for i in range(n):
        for j in range(n):
            if sp[i] >= sp[j]:
                assert x[i] >= x[j]


@FAST
@given(models(min_n=2), st.data())
def test_slower_link_never_more_rows_at_equal_speed(m, data):
    w, b, _, lk, _ = m
    n = len(lk)
    s = data.draw(speed_st)
    f = data.draw(fixed_st)
    x = equalise_finish_time(w, b, [s] * n, lk, [f] * n)
    for i in range(n):
        for j in range(n):
            if lk[i] <= lk[j]:
                assert x[i] <= x[j]


@FAST
@given(models())
def test_equalise_is_deterministic(m):
    assert equalise_finish_time(*m) == equalise_finish_time(*m)


def test_known_split_and_link_bound():
    # speeds 1 and 3 (no transfer cost): 25/75, both finish at 25 ms.
    x = equalise_finish_time(100.0, 0.0, [1.0, 3.0], [math.inf, math.inf], [0.0, 0.0])
    assert x == pytest.approx((0.25, 0.75))
    # Node 1 is 3x faster but its link only carries 1 byte/ms: transfer dominates there.
    x = equalise_finish_time(100.0, 100.0, [1.0, 3.0], [10.0, 1.0], [0.0, 0.0])
    # k = (100, 100): equal finish needs equal shares.
    assert x == pytest.approx((0.5, 0.5))
    # A huge fixed cost excludes a node entirely.
    x = equalise_finish_time(100.0, 0.0, [1.0, 1.0], [math.inf, math.inf], [0.0, 500.0])
    assert x == (1.0, 0.0)


@pytest.mark.parametrize("bad", [
    dict(work=0.0), dict(speeds=[0.0, 1.0]), dict(speeds=[math.nan, 1.0]),
    dict(link_rates=[0.0, 1.0]), dict(fixed_ms=[-1.0, 0.0]), dict(speeds=[1.0]),
])
def test_equalise_rejects_bad_inputs(bad):
    args = dict(work=1.0, bytes_total=1.0, speeds=[1.0, 1.0], link_rates=[1.0, 1.0],
                fixed_ms=[0.0, 0.0])
    args.update(bad)
    with pytest.raises(ValueError):
        equalise_finish_time(**args)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_parameter_table_matches_config_defaults():
    cfg = PolicyConfig()
    names = {f.name for f in dataclasses.fields(PolicyConfig)}
    assert {p.name for p in PARAMETERS} == names
    for p in PARAMETERS:
        assert getattr(cfg, p.name) == p.default, p.name
        assert p.type in ("string", "double", "integer", "bool", "double_array")
        assert p.description
        if p.min is not None and p.type in ("double", "integer"):
            assert p.min <= p.default <= p.max


@pytest.mark.parametrize("changes, word", [
    (dict(policy="fastest"), "policy"),
    (dict(ewma_alpha=0.0), "ewma_alpha"),
    (dict(ewma_alpha=1.5), "ewma_alpha"),
    (dict(min_gain=-0.1), "min_gain"),
    (dict(min_interval_s=math.nan), "min_interval_s"),
    (dict(dead_after_s=0.0), "dead_after_s"),
    (dict(warmup_requests=0), "warmup_requests"),
    (dict(warmup_requests=2.5), "warmup_requests"),
    (dict(probe_share=0.9), "probe_share"),
    (dict(static_shares=(0.5, -0.1)), "static_shares"),
    (dict(policy="static"), "static_shares"),
    (dict(policy="static", static_shares=(0.0, 0.0)), "static_shares"),
    (dict(wait_as_fixed="yes"), "wait_as_fixed"),
])
def test_invalid_config_refused_with_reason(changes, word):
    with pytest.raises(ValueError, match=word):
        PolicyConfig(**changes)
    # Live retuning goes through replace(), which validates the same way.
    with pytest.raises(ValueError, match=word):
        dataclasses.replace(PolicyConfig(), **changes)


@FAST
@given(st.sampled_from([p for p in PARAMETERS if p.type in ("double", "integer")]),
       st.floats(-1e7, 1e7, allow_nan=False))
def test_config_range_matches_descriptor(p, value):
    if p.type == "integer":
        value = int(value)
    inside = p.min <= value <= p.max
    if inside:
        assert getattr(PolicyConfig(**{p.name: value}), p.name) == value
    else:
        with pytest.raises(ValueError, match=p.name):
            PolicyConfig(**{p.name: value})


def test_config_from_params():
    cfg = config_from_params({"policy": "static", "static_shares": [1, 3], "min_gain": 0})
    assert cfg.static_shares == (1.0, 3.0) and cfg.min_gain == 0.0
    with pytest.raises(ValueError, match="unknown"):
        config_from_params({"min_gian": 0.1})
    m = PolicyConfig(policy="static", static_shares={"a": 1.0})
    assert m.static_shares["a"] == 1.0


# --------------------------------------------------------------------------------------------
# Simulation helper: a deterministic cluster driven through observe/heartbeat/decide
# --------------------------------------------------------------------------------------------

W = 1000.0     # model cost of a whole request
B = 0.0        # bytes of a whole request (links ignored unless a test sets them)
DT = 0.05      # seconds between requests


class Sim:
    def __init__(self, cfg: PolicyConfig, speeds: dict[str, float],
                 links: dict[str, float] | None = None, bytes_total: float = B):
        self.cfg = cfg
        self.speeds = dict(speeds)
        self.links = links or dict.fromkeys(speeds, math.inf)
        self.bytes_total = bytes_total
        self.state: PolicyState = initial_state(cfg, list(speeds))
        self.published: list[Assignment] = []
        self.plans: list[Assignment] = []
        self.alive = set(speeds)
        self.r = 0
        self.now = 0.0
        self._decide()

    def _decide(self) -> Assignment | None:
        self.pre = self.state  # what decide saw (for tests that re-check its arithmetic)
        self.state, a = decide(self.state, self.now, self.r, self.cfg)
        if a is not None:
            self.published.append(a)
            self.plans.append(a)
        return a

    def plan_for(self, r: int) -> Assignment:
        return [a for a in self.plans if a.effective_from_request <= r][-1] \
            if any(a.effective_from_request <= r for a in self.plans) else self.plans[0]

    def step(self) -> Assignment | None:
        """Run request r under its plan, report telemetry and heartbeats, then decide."""
        plan = self.plan_for(self.r)
        for n, x in zip(plan.node_ids, plan.shares):
            if n not in self.alive or x <= 0:
                continue
            work = x * W
            nbytes = x * self.bytes_total
            transfer = 0.0 if math.isinf(self.links[n]) else nbytes / self.links[n]
            self.state = observe(self.state, TelemetrySample(
                node_id=n, request_id=self.r, rows=max(1, round(x * 480)), work=work,
                compute_ms=work / self.speeds[n], transfer_ms=transfer, wait_ms=0.0,
                bytes_in=int(nbytes), bytes_out=0, stamp_s=self.now), self.cfg)
        for n in sorted(self.alive):
            self.state = heartbeat(self.state, n, self.now, self.cfg)
        self.r += 1
        self.now += DT
        return self._decide()

    def run(self, k: int) -> list[Assignment]:
        out = [a for a in (self.step() for _ in range(k)) if a is not None]
        return out

    def shares(self) -> dict[str, float]:
        a = self.state.assignment
        return dict(zip(a.node_ids, a.shares))


def _cfg(**kw) -> PolicyConfig:
    base = dict(min_interval_s=0.0, min_gain=0.05, warmup_requests=3, dead_after_s=1.0,
                ewma_alpha=0.5)
    base.update(kw)
    return PolicyConfig(**base)


# --------------------------------------------------------------------------------------------
# State machine
# --------------------------------------------------------------------------------------------


def test_adaptive_converges_and_follows_a_slowdown():
    sim = Sim(_cfg(), {"compute_0": 1.0, "compute_1": 1.0})
    first = sim.published[0]
    assert first.version == 1 and first.shares == (0.5, 0.5)
    assert first.effective_from_request == 0 + 2
    sim.run(10)
    assert sim.shares()["compute_0"] == pytest.approx(0.5)
    sim.speeds["compute_1"] = 1.0 / 3.0          # thermal throttling: 3x slower
    r0 = sim.r
    sim.run(10)
    s = sim.shares()
    assert s["compute_1"] == pytest.approx(0.25, abs=0.02)  # 1/(1+3)
    last = sim.published[-1]
    assert last.effective_from_request - r0 <= 10
    assert "compute_1 slower" in last.reason and "->" in last.reason
    assert "predicted makespan" in last.reason
    assert last.predicted_makespan_ms == pytest.approx(0.25 * W / (1 / 3), rel=0.05)


def test_link_aware_shares():
    # Equal compute speed, compute_1 sits behind a slow link: it must get fewer rows.
    sim = Sim(_cfg(), {"compute_0": 1.0, "compute_1": 1.0},
              links={"compute_0": 1e6, "compute_1": 2.0}, bytes_total=4000.0)
    sim.run(15)
    s = sim.shares()
    assert s["compute_1"] < s["compute_0"]
    # k = max(W/s, B/l) = (1000, 2000): shares 2/3, 1/3.
    assert s["compute_1"] == pytest.approx(1 / 3, abs=0.02)


def test_versions_strictly_increase_and_effective_from_ahead():
    sim = Sim(_cfg(), {"a": 1.0, "b": 2.0, "c": 0.5})
    for sp in [0.2, 3.0, 1.0, 0.3]:
        sim.speeds["a"] = sp
        sim.run(6)
    v = [a.version for a in sim.published]
    e = [a.effective_from_request for a in sim.published]
    assert len(v) >= 4
    assert v == sorted(set(v)) and e == sorted(set(e))


def test_hysteresis_suppresses_small_changes():
    sim = Sim(_cfg(min_gain=0.05), {"a": 1.0, "b": 1.0})
    sim.run(10)
    n = len(sim.published)
    # 4 % slower on one node: the best split improves the makespan by < 5 %.
    sim.speeds["b"] = 0.96
    assert sim.run(20) == []
    assert len(sim.published) == n
    # 30 % slower: well above min_gain -> a new plan.
    sim.speeds["b"] = 0.7
    assert len(sim.run(10)) >= 1


@FAST
@given(st.floats(0.0, 0.5), st.floats(0.3, 1.0))
def test_hysteresis_threshold_property(min_gain, slow):
    """Every load-driven publish had a predicted gain >= min_gain under the estimates it saw;
    every suppressed decision had less."""
    sim = Sim(_cfg(min_gain=min_gain), {"a": 1.0, "b": 1.0})
    sim.run(6)
    sim.speeds["b"] = slow
    for _ in range(10):
        before = sim.state.assignment
        a = sim.step()
        pre = sim.pre
        if not all(pre.estimates[n].samples > 0 for n in before.node_ids):
            continue
        sp = [pre.estimates[n].speed for n in before.node_ids]
        inf2 = [math.inf] * len(sp)
        old = predicted_makespan(pre.work_total, 0.0, sp, inf2, [0.0] * len(sp), before.shares)
        best = predicted_makespan(pre.work_total, 0.0, sp, inf2, [0.0] * len(sp),
                                  equalise_finish_time(pre.work_total, 0.0, sp, inf2,
                                                       [0.0] * len(sp)))
        gain = (old - best) / old
        if a is None:
            assert gain < max(min_gain, 1e-9) + 1e-12
        else:
            assert a.node_ids == before.node_ids
            assert gain >= min_gain - 1e-12


def test_min_interval_respected():
    cfg = _cfg(min_interval_s=1.0, min_gain=0.01, change_ratio=1.0)  # change detection off
    sim = Sim(cfg, {"a": 1.0, "b": 1.0})
    sim.run(10)
    times = []
    speeds = [0.3, 2.0, 0.5, 1.5, 0.2, 1.0] * 3
    for sp in speeds:
        sim.speeds["b"] = sp
        for _ in range(3):  # a big change every 0.15 s
            if sim.step() is not None:
                times.append(sim.now)
    assert len(times) >= 2
    assert all(t2 - t1 >= 1.0 - 1e-9 for t1, t2 in itertools.pairwise(times))


def test_step_change_is_followed_at_once_despite_min_interval():
    # EWMA 0.3 alone needs ~10 samples to follow a 3x slowdown, min_interval_s 5 s would hold
    # the plan for 100 requests; two confirming samples restart the estimate and act at once.
    cfg = _cfg(min_interval_s=5.0, ewma_alpha=0.3, min_gain=0.1)
    sim = Sim(cfg, {"compute_0": 1.0, "compute_1": 1.0, "compute_2": 1.0})
    sim.run(12)
    sim.now += 10.0  # long after the last publish: the first reaction is not the bypass
    sim.run(1)
    n_before = len(sim.published)
    sim.speeds["compute_1"] = 1.0 / 3.0
    r0 = sim.r
    sim.run(2 + 2)  # 2 confirming samples (under plans already issued), then decide
    fresh = sim.published[n_before:]
    assert fresh, "no reaction to a 3x slowdown"
    assert fresh[0].effective_from_request - r0 <= 2 + 1 + 2  # detect + decide + lead
    assert dict(zip(fresh[-1].node_ids, fresh[-1].shares))["compute_1"] == \
        pytest.approx(1 / 7, abs=0.02)  # speeds 1 : 1/3 : 1 -> 3/7, 1/7, 3/7
    assert sim.state.estimates["compute_1"].speed == pytest.approx(W / 3 / (W / 3) / 3, rel=0.05)
    # recovery is a step change too, and is acted on although min_interval_s has not passed
    sim.speeds["compute_1"] = 1.0
    n_before = len(sim.published)
    sim.run(8)
    assert len(sim.published) > n_before
    assert sim.shares()["compute_1"] == pytest.approx(1 / 3, abs=0.03)


def test_one_outlier_does_not_restart_the_estimate():
    cfg = _cfg(ewma_alpha=0.3, change_samples=2)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0})
    sim.run(10)
    sim.speeds["b"] = 0.2  # one request 5x slow (a scheduling hiccup)
    sim.run(1)
    e = sim.state.estimates["b"]
    # the EWMA moved, one surprise counted, no restart at the outlier's speed
    assert 0.3 < e.speed < 1.0 and e.surprise == -1 and "b" not in sim.state.changed
    sim.speeds["b"] = 1.0
    sim.run(3)
    # the normal samples that follow look fast against the dented average and may restart it
    # at the true speed - never at the outlier's
    assert sim.state.estimates["b"].speed == pytest.approx(1.0, abs=0.15)


def test_change_detection_off_keeps_plain_ewma():
    cfg = _cfg(ewma_alpha=0.3, change_ratio=1.0)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0})
    sim.run(10)
    sim.speeds["b"] = 1.0 / 3.0
    sim.run(3)
    sp = sim.state.estimates["b"].speed
    assert sp > 0.4  # three EWMA steps from 1 toward 1/3 (a restart would give 1/3)


def test_dead_node_leaves_after_dead_after_s_and_publishes_immediately():
    cfg = _cfg(dead_after_s=0.5, min_interval_s=100.0, min_gain=0.9)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0, "c": 1.0})
    sim.run(6)
    assert set(sim.shares()) == {"a", "b", "c"}
    sim.alive.discard("c")
    last_seen = sim.state.estimates["c"].last_seen_s
    for n in ("a", "b"):  # the survivors keep beating
        sim.state = heartbeat(sim.state, n, last_seen + 0.4, cfg)
    # Just before dead_after_s: still in the plan.
    st_, a = decide(sim.state, last_seen + 0.5 - 1e-6, sim.r, cfg)
    assert a is None and "c" not in st_.dead
    # At dead_after_s: leaves, published despite min_interval_s and min_gain.
    st_, a = decide(sim.state, last_seen + 0.5 + 1e-9, sim.r, cfg)
    assert a is not None and a.node_ids == ("a", "b")
    assert a.shares == pytest.approx((0.5, 0.5))
    assert "c silent" in a.reason and "leaves" in a.reason
    assert a.version == sim.state.assignment.version + 1
    assert a.effective_from_request == sim.r + 2
    # A late telemetry sample from before the death does not resurrect it.
    late = TelemetrySample("c", sim.r - 1, 160, 300.0, 300.0, 0.0, 0.0, 0, 0, last_seen)
    st2 = observe(st_, late, cfg)
    st2, a2 = decide(st2, last_seen + 0.6, sim.r, cfg)
    assert a2 is None and "c" in st2.dead


def test_restarted_node_rejoins_after_warmup():
    cfg = _cfg(dead_after_s=0.3, warmup_requests=3, probe_share=0.05)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0})
    sim.run(6)
    sim.alive.discard("b")
    sim.run(10)
    assert sim.state.assignment.node_ids == ("a",)
    sim.alive.add("b")
    sim.speeds["b"] = 3.0  # restarted on a faster device
    pubs = sim.run(12)
    assert pubs[0].node_ids == ("a", "b") and pubs[0].shares[1] == pytest.approx(0.05)
    assert sim.shares()["b"] == pytest.approx(0.75, abs=0.03)


def test_warmup_join_with_probe_share():
    cfg = _cfg(warmup_requests=4, probe_share=0.05)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0})
    sim.run(8)
    n0 = len(sim.published)
    # A newcomer announces itself by heartbeat.
    sim.speeds["n"] = 2.0
    sim.links["n"] = math.inf
    sim.alive.add("n")
    pubs = sim.run(1)
    assert len(pubs) == 1
    p = pubs[0]
    assert p.node_ids == ("a", "b", "n")
    assert p.shares[2] == pytest.approx(0.05)          # probe share while warming up
    assert "n new" in p.reason
    assert "n" not in sim.state.members
    # Runs its probe rows for warmup_requests requests, then joins with a real share.
    pubs = sim.run(12)
    joined = [a for a in pubs if "n warm" in a.reason]
    assert len(joined) == 1 and "n" in sim.state.members
    assert sim.shares()["n"] == pytest.approx(0.5, abs=0.03)   # speeds 1,1,2
    assert len(sim.published) > n0


def test_cold_start_equal_then_all_join_together():
    cfg = _cfg(warmup_requests=3)
    sim = Sim(cfg, {"a": 1.0, "b": 4.0})
    assert sim.published[0].shares == (0.5, 0.5)
    assert "warming up" in sim.published[0].reason
    pubs = sim.run(8)
    assert pubs[0].shares == pytest.approx((0.2, 0.8))
    assert "a, b warm" in pubs[0].reason and "full members" in pubs[0].reason


def test_profile_once_never_changes_except_membership():
    cfg = _cfg(policy="profile_once", min_gain=0.0, dead_after_s=0.5)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0, "c": 2.0})
    sim.run(8)
    profiled = sim.state.assignment
    assert profiled.shares == pytest.approx((0.25, 0.25, 0.5))
    for sp in (0.1, 5.0, 0.3):
        sim.speeds["a"] = sp
        assert sim.run(10) == []
    assert sim.state.assignment == profiled
    # Membership still counts: c dies -> re-split with the profiled (stale) speeds.
    sim.alive.discard("c")
    pubs = sim.run(15)
    assert len(pubs) == 1
    assert pubs[0].node_ids == ("a", "b") and pubs[0].shares == pytest.approx((0.5, 0.5))


def test_static_and_equal():
    cfg = _cfg(policy="static", static_shares=(0.6, 0.3, 0.1), dead_after_s=0.3)
    sim = Sim(cfg, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert sim.published[0].shares == pytest.approx((0.6, 0.3, 0.1))
    sim.speeds["a"] = 0.1
    assert sim.run(10) == []       # static ignores load
    sim.alive.discard("c")
    pubs = sim.run(10)
    assert len(pubs) == 1 and pubs[0].shares == pytest.approx((2 / 3, 1 / 3))

    cfg = _cfg(policy="static", static_shares={"b": 1.0, "c": 3.0})
    sim = Sim(cfg, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert sim.published[0].node_ids == ("b", "c")
    assert sim.published[0].shares == pytest.approx((0.25, 0.75))

    cfg = _cfg(policy="equal", dead_after_s=0.3)
    sim = Sim(cfg, {"a": 1.0, "b": 9.0, "c": 0.1})
    assert sim.published[0].shares == pytest.approx((1 / 3,) * 3)
    assert sim.run(10) == []
    sim.alive.discard("b")
    pubs = sim.run(10)
    assert len(pubs) == 1 and pubs[0].shares == pytest.approx((0.5, 0.5))


def test_live_policy_switch_publishes():
    sim = Sim(_cfg(), {"a": 1.0, "b": 3.0})
    sim.run(8)
    assert sim.shares()["b"] == pytest.approx(0.75, abs=0.02)
    sim.cfg = dataclasses.replace(sim.cfg, policy="equal")
    pubs = sim.run(3)
    assert len(pubs) == 1 and pubs[0].policy == "equal" and pubs[0].shares == (0.5, 0.5)
    assert "policy adaptive -> equal" in pubs[0].reason


def test_no_live_node_publishes_nothing():
    cfg = _cfg(dead_after_s=0.5)
    st_ = initial_state(cfg, ["a"])
    st_, a = decide(st_, 0.0, 0, cfg)
    assert a is not None
    st_, a = decide(st_, 10.0, 5, cfg)
    assert a is None and "a" in st_.dead


events_st = st.lists(st.tuples(
    st.sampled_from(["obs", "hb", "decide", "advance"]),
    st.sampled_from(["a", "b", "c"]),
    st.floats(0.05, 20.0), st.floats(0.0, 5.0)), max_size=60)


def _replay(events, cfg):
    state = initial_state(cfg, ["a", "b"])
    now, r, out = 0.0, 0, []
    for kind, node, speed, wait in events:
        if kind == "advance":
            now += wait / 5
            r += 1
        elif kind == "hb":
            state = heartbeat(state, node, now, cfg)
        elif kind == "obs":
            work = 100.0 * speed
            state = observe(state, TelemetrySample(node, r, 10, work, work / speed, speed,
                                                   wait, 1000, 10, now), cfg)
        else:
            state, a = decide(state, now, r, cfg)
            out.append(a)
    return state, out


@settings(max_examples=120, deadline=None)
@given(events_st, st.sampled_from(["adaptive", "profile_once", "equal"]))
def test_random_event_streams_keep_invariants_and_are_deterministic(events, policy):
    cfg = _cfg(policy=policy, dead_after_s=0.7, min_interval_s=0.2, wait_as_fixed=True)
    s1, out1 = _replay(events, cfg)
    s2, out2 = _replay(events, cfg)
    assert s1 == s2 and out1 == out2          # identical inputs -> identical outputs
    pubs = [a for a in out1 if a is not None]
    for a in pubs:
        assert len(a.node_ids) == len(a.shares) == len(set(a.node_ids)) > 0
        assert all(x >= 0 for x in a.shares)
        assert abs(sum(a.shares) - 1.0) <= 1e-9
        assert a.reason
        assert math.isfinite(a.predicted_makespan_ms) and a.predicted_makespan_ms >= 0
    for a1, a2 in itertools.pairwise(pubs):
        assert a2.version == a1.version + 1
        assert a2.effective_from_request > a1.effective_from_request
