"""Measured costs (pure values, no clock): op-cost fits, profile plausibility checks, live-run
and idle-probe refinement, link rate/latency from delivered chunks, and the planner's view of
links (measured, composed through the coordinator, prior)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kaitian_ros.core.costs import (
    COORDINATOR,
    MAX_LINK_BYTES_PER_MS,
    MAX_TRUNK_MS,
    CostRefiner,
    Costs,
    DeviceProfile,
    LinkEstimate,
    LinkMeter,
    OpCost,
    fit_op_cost,
    model_key,
    next_probe_period,
    profile_problem,
)


# --------------------------------------------------------------------------- OpCost / fit
def test_op_cost_ms_and_scaled() -> None:
    c = OpCost(0.5, 0.25)
    assert c.ms(4) == 1.5 and c.ms(0) == 0.0 and c.ms(-3) == 0.0
    assert c.scaled(2.0) == OpCost(1.0, 0.5)


def test_fit_recovers_call_and_row_from_exact_samples() -> None:
    samples = [(r, 0.3 + 0.05 * r) for r in (1, 2, 4, 8, 16, 32) for _ in range(2)]
    c = fit_op_cost(samples)
    assert c.call_ms == pytest.approx(0.3, rel=1e-9) and c.row_ms == pytest.approx(0.05, rel=1e-9)
    # invalid samples (no rows, NaN, negative, inf) are left out of the fit
    noisy = samples + [(0, 5.0), (4, math.nan), (8, -1.0), (2, math.inf), (-1, 3.0)]
    assert fit_op_cost(noisy) == pytest.approx(c)
    assert fit_op_cost(noisy).row_ms == pytest.approx(0.05, rel=1e-9)


def test_fit_clamps_negative_terms() -> None:
    # ms = -0.5 + 0.1 * rows: a negative call cost becomes 0, all of the time per row
    samples = [(8, 0.3), (16, 1.1), (32, 2.7)]
    c = fit_op_cost(samples)
    assert c.call_ms == 0.0 and c.row_ms == pytest.approx(4.1 / 56)
    # time falling with rows (noise): no per-row term, the mean time per call
    c = fit_op_cost([(1, 2.0), (4, 1.5), (16, 1.0)])
    assert c.row_ms == 0.0 and c.call_ms == pytest.approx(1.5)
    # one row count: all of it per row
    c = fit_op_cost([(8, 2.0), (8, 4.0)])
    assert c == OpCost(0.0, pytest.approx(3.0 / 8))
    for c in (fit_op_cost(samples), fit_op_cost([(1, 2.0), (4, 1.5)])):
        assert c.call_ms >= 0 and c.row_ms >= 0


def test_fit_without_valid_samples_refuses() -> None:
    for bad in ([], [(0, 1.0)], [(4, math.nan), (2, -1.0)]):
        with pytest.raises(ValueError, match="no valid"):
            fit_op_cost(bad)


# --------------------------------------------------------------------------- profiles
MODEL = model_key("resnet18", (3, 64, 64))
N_OPS = 4


def _profile(**kw) -> DeviceProfile:
    base = dict(node_id="gpu", version=1, model=MODEL, device="cpu", emulated_slowdown=1.0,
                op_costs=(OpCost(0.05, 0.1),) * N_OPS, trunk_ms=12.0, message_ms=0.05,
                links={"coordinator": LinkEstimate(1e5, 0.2, 10)})
    base.update(kw)
    return DeviceProfile(**base)


def _problem(p: DeviceProfile) -> str:
    return profile_problem(p, n_ops=N_OPS, model=MODEL, known_nodes=["gpu", "npu"])


def test_model_key() -> None:
    assert MODEL == "resnet18 3x64x64"
    assert model_key("vgg11", [1, 8, 8]) == "vgg11 1x8x8"


def test_good_profile_is_accepted() -> None:
    assert _problem(_profile()) == ""
    assert _problem(_profile(links={})) == ""
    assert _problem(_profile(emulated_slowdown=3.0, min_run_rows=1)) == ""
    # zero terms are fine while the op costs something in all
    assert _problem(_profile(op_costs=(OpCost(0.0, 0.0),) * 3 + (OpCost(0.0, 0.1),))) == ""
    p = _profile(emulated_slowdown=2.0)
    assert p.emulated and not _profile().emulated


@pytest.mark.parametrize("change,words", [
    (dict(node_id="edge"), ["unknown node", "edge"]),
    (dict(model=model_key("resnet18", (3, 32, 32))), ["3x32x32", "3x64x64"]),
    (dict(model=model_key("vgg11", (3, 64, 64))), ["vgg11"]),
    (dict(op_costs=(OpCost(0.05, 0.1),) * (N_OPS - 1)), ["3 op costs", f"{N_OPS} ops"]),
    (dict(op_costs=(OpCost(0.05, 0.1),) * (N_OPS + 1)), ["5 op costs"]),
    (dict(emulated_slowdown=math.nan), ["emulated_slowdown"]),
    (dict(emulated_slowdown=0.5), ["emulated_slowdown"]),
    (dict(emulated_slowdown=1e6), ["emulated_slowdown"]),
    (dict(trunk_ms=math.nan), ["trunk_ms"]),
    (dict(trunk_ms=0.0), ["trunk_ms"]),
    (dict(trunk_ms=-5.0), ["trunk_ms"]),
    (dict(trunk_ms=math.inf), ["trunk_ms"]),
    (dict(trunk_ms=MAX_TRUNK_MS * 10), ["trunk_ms"]),
    (dict(message_ms=-0.1), ["message_ms"]),
    (dict(message_ms=math.nan), ["message_ms"]),
    (dict(min_run_rows=0), ["min_run_rows"]),
    (dict(op_costs=(OpCost(0.05, 0.1), OpCost(math.nan, 0.1), OpCost(0.05, 0.1), OpCost(0.05, 0.1))),
     ["op 1", "call_ms"]),
    (dict(op_costs=(OpCost(0.05, 0.1),) * 3 + (OpCost(0.05, -0.1),)), ["op 3", "row_ms"]),
    (dict(op_costs=(OpCost(0.05, 0.1),) * 3 + (OpCost(0.05, math.inf),)), ["op 3", "row_ms"]),
    (dict(op_costs=(OpCost(1e9, 0.1),) + (OpCost(0.05, 0.1),) * 3), ["op 0", "call_ms"]),
    (dict(op_costs=(OpCost(0.0, 0.0),) * N_OPS), ["costs nothing"]),
    (dict(links={"": LinkEstimate(1e5, 0.2)}), ["no sender"]),
    (dict(links={"npu": LinkEstimate(0.0, 0.2)}), ["npu", "rate"]),
    (dict(links={"npu": LinkEstimate(-5.0, 0.2)}), ["npu", "rate"]),
    (dict(links={"npu": LinkEstimate(math.nan, 0.2)}), ["npu", "rate"]),
    (dict(links={"npu": LinkEstimate(MAX_LINK_BYTES_PER_MS * 10, 0.2)}), ["npu", "rate"]),
    (dict(links={"npu": LinkEstimate(1e5, -0.2)}), ["npu", "latency"]),
    (dict(links={"npu": LinkEstimate(1e5, math.nan)}), ["npu", "latency"]),
    (dict(links={"npu": LinkEstimate(1e5, 1e9)}), ["npu", "latency"]),
])
def test_bad_profile_is_refused_with_a_reason(change: dict, words: list[str]) -> None:
    why = _problem(_profile(**change))
    assert why, change
    assert "gpu" in why or "edge" in why  # names the profile
    for w in words:
        assert w in why, (w, why)


def test_device_profile_op_ms_counts_calls() -> None:
    p = _profile(op_costs=(OpCost(1.0, 0.5),) * N_OPS)
    assert p.op_ms(0, 16, 8) == 2 * 1.0 + 16 * 0.5
    assert p.op_ms(0, 17, 8) == 3 * 1.0 + 17 * 0.5
    assert p.op_ms(0, 5, 0) == 5 * 1.0 + 5 * 0.5  # run_rows < 1 taken as 1
    assert p.op_ms(0, 0, 8) == 0.0


# --------------------------------------------------------------------------- refiner
BASE = (OpCost(0.1, 0.02), OpCost(0.05, 0.01), OpCost(0.2, 0.05))


def _ms(op: int, rows: int, factor: float) -> float:
    return factor * BASE[op].ms(rows)


def test_refiner_starts_at_the_base() -> None:
    r = CostRefiner(BASE)
    assert r.current() == BASE and r.samples == 0 and r.device_ratio == 1.0


def _feed(r: CostRefiner, factor: float, runs=((0, 8), (1, 8), (2, 4))) -> None:
    """One feed whose runs took `factor` times their start-up cost."""
    predicted = sum(r.predicted_run_ms(op, rows) for op, rows in runs)
    r.observe_feed(factor * predicted, predicted)


def test_live_feeds_at_twice_the_base_double_every_cost() -> None:
    r = CostRefiner(BASE)
    for _ in range(12):
        _feed(r, 2.0)
    assert r.device_ratio == pytest.approx(2.0)
    cur = r.current()
    for c, b in zip(cur, BASE):  # the start-up costs' shape, scaled
        assert c.call_ms == pytest.approx(2 * b.call_ms) and c.row_ms == pytest.approx(2 * b.row_ms)
    assert r.live_samples == 12 and r.samples == 12
    # the EWMA follows a change within a few feeds
    for _ in range(12):
        _feed(r, 1.0)
    assert r.device_ratio == pytest.approx(1.0, rel=0.15)


def test_invalid_feeds_are_ignored() -> None:
    r = CostRefiner(BASE)
    for measured, predicted in ((1.0, 0.0), (math.nan, 1.0), (-1.0, 1.0), (math.inf, 1.0)):
        r.observe_feed(measured, predicted)
    assert r.live_samples == 0 and r.current() == BASE


def test_two_requests_in_a_row_at_a_new_speed_restart_the_ratio() -> None:
    r = CostRefiner(BASE)
    for _ in range(10):
        _feed(r, 1.0)
    _feed(r, 3.0)  # one slow request: noise, or a new speed - held back
    assert r.device_ratio == pytest.approx(1.0)
    _feed(r, 1.0)  # it was noise: folded in with this one
    assert 1.0 < r.device_ratio < 1.8
    _feed(r, 3.0)
    _feed(r, 3.0)  # twice in a row: the device is 3x slower now
    assert r.device_ratio == pytest.approx(3.0)
    _feed(r, 1.0)
    _feed(r, 1.0)  # and back
    assert r.device_ratio == pytest.approx(1.0)
    _feed(r, 3.0)
    _feed(r, 0.3)  # far off both ways: no new speed
    assert r.device_ratio == pytest.approx(1.0, rel=0.05)


def test_requests_with_little_work_do_not_move_the_ratio() -> None:
    """A layer-wise tail of a few small ops: fixed per-feed costs make it look 2.5x slow."""
    r = CostRefiner(BASE, min_feed_ms=1.0)
    for _ in range(10):
        r.observe_feed(2.5 * 0.5, 0.5)  # 0.5 ms of work at start-up: ignored
    assert r.live_samples == 0 and r.device_ratio == 1.0
    r.observe_feed(2.4, 2.0)  # real work counts
    assert r.live_samples == 1 and r.device_ratio == pytest.approx(1.2)


def test_idle_probes_showing_a_slower_device_scale_every_op() -> None:
    r = CostRefiner(BASE)
    for _ in range(5):
        _feed(r, 1.0)
    assert r.current() == pytest.approx(BASE)
    for _ in range(4):
        r.observe_probe(3.0, 1.0)
    assert r.probe_ratio == 1.0  # four slow probes: not yet a whole window
    r.observe_probe(3.0, 1.0)
    assert r.probe_ratio == pytest.approx(3.0) and r.device_ratio == pytest.approx(3.0)
    assert r.current()[2].row_ms == pytest.approx(3 * BASE[2].row_ms)
    assert r.probe_samples == 5 and r.samples == 10
    # the next live feed sets it straight (it starts over from what the feed measured)
    _feed(r, 2.5)
    assert r.device_ratio == pytest.approx(2.5)
    # recovered while idle: one fast probe in the window shows it, the drift since the last
    # feed scales it back
    r.observe_probe(1.0, 1.0)
    assert r.device_ratio == pytest.approx(2.5 / 3.0)


def test_idle_probes_back_off_while_the_level_holds_and_come_back_when_it_moves() -> None:
    """An idle node's probes come less often while they see no change (twice the period each
    time, up to the cap), and at the full rate again after one that moved the level: a device
    that recovered while idle is seen at the next probe, and probed closely after that."""
    r = CostRefiner(BASE)
    period, periods = 0.1, []
    for ms in (1.0, 1.1, 0.9, 1.2, 1.0, 1.3):  # noise within the deadband: the level holds
        level = r.probe_ratio
        r.observe_probe(ms, 1.0)
        period = next_probe_period(period, 0.1, 0.5, r.probe_ratio != level)
        periods.append(period)
    assert periods == pytest.approx([0.2, 0.4, 0.5, 0.5, 0.5, 0.5])
    level = r.probe_ratio
    r.observe_probe(0.3, 1.0)  # 3x faster than the level: one probe moves it
    assert r.probe_ratio != level
    assert next_probe_period(period, 0.1, 0.5, r.probe_ratio != level) == 0.1
    # a cap not above the base period: no backoff
    assert next_probe_period(0.1, 0.1, 0.1, False) == next_probe_period(0.1, 0.1, 0.0, False) == 0.1


def test_a_speed_change_seen_live_is_not_counted_again_by_the_idle_probes() -> None:
    """Slowed 3x while computing, then idle: the probes see the 3x the feeds already saw (it
    read 9x), and when the device recovers they bring it back to 1x (it read 3x)."""
    r = CostRefiner(BASE)
    for _ in range(5):
        _feed(r, 1.0)
    for _ in range(5):
        r.observe_probe(1.0, 1.0)  # idle at the start-up speed
    _feed(r, 1.0)
    _feed(r, 3.0)
    _feed(r, 3.0)  # slowed while computing: confirmed by two requests
    assert r.device_ratio == pytest.approx(3.0)
    for _ in range(5):  # then idle, the plan moved its rows elsewhere
        r.observe_probe(3.0, 1.0)
    assert r.device_ratio == pytest.approx(3.0)
    r.observe_probe(1.0, 1.0)  # back at full speed while idle
    assert r.device_ratio == pytest.approx(1.0)
    _feed(r, 1.0)  # and the next live feed agrees
    assert r.device_ratio == pytest.approx(1.0)


def test_one_noisy_probe_or_one_within_the_deadband_changes_nothing() -> None:
    r = CostRefiner(BASE)
    for _ in range(5):
        _feed(r, 2.0)
    before = r.current()
    # probes slowed down by other processes (here up to 2.5x): the fastest of the window stays
    for x in (1.0, 4.0, 1.0, 1.0, 2.3, 1.9, 2.5, 1.1, 2.2, 1.6, 0.9, 2.0):
        r.observe_probe(x, 1.0)
    assert r.probe_ratio == 1.0 and r.current() == before
    for _ in range(10):
        r.observe_probe(1.8, 1.0)  # a whole window at 1.8x < deadband 2
    for _ in range(10):
        r.observe_probe(0.6, 1.0)
    assert r.probe_ratio == 1.0 and r.current() == before
    r.observe_probe(math.nan, 1.0)
    r.observe_probe(5.0, 0.0)  # no start-up time: nothing to compare with
    r.observe_probe(-1.0, 1.0)
    assert r.probe_ratio == 1.0 and r.probe_samples == 32


def test_refined_costs_are_clamped() -> None:
    r = CostRefiner(BASE)
    for _ in range(60):
        _feed(r, 1000.0)
    assert r.current()[0] == pytest.approx(BASE[0].scaled(50.0))


# --------------------------------------------------------------------------- links
RATE = 10_000.0  # bytes per ms (10 MB/s)
LAT_MS = 0.5


def _deliver(meter: LinkMeter, chunks: list[tuple[float, int]], *, rate=RATE, lat_ms=LAT_MS,
             jitter=(), skew_s=0.0) -> None:
    """A link that carries one chunk at a time: chunk (sent_s, nbytes) starts when sent or when
    the previous one finished, takes nbytes / rate (times 1 + jitter), arrives lat_ms later."""
    free = -math.inf
    for k, (sent, nbytes) in enumerate(chunks):
        f = 1.0 + (jitter[k % len(jitter)] if jitter else 0.0)
        start = max(sent, free)
        free = start + nbytes / rate * f / 1e3
        meter.observe(nbytes, sent, free + lat_ms / 1e3 + skew_s)


def _bursts(n_bursts=3, per_burst=8, nbytes=20_000, gap_s=0.05) -> list[tuple[float, int]]:
    return [(b * gap_s, nbytes) for b in range(n_bursts) for _ in range(per_burst)]


def test_link_meter_rate_and_latency_from_bursts() -> None:
    m = LinkMeter()
    assert m.estimate() is None
    _deliver(m, _bursts(), jitter=(0.03, -0.02, 0.0, 0.04, -0.03))
    est = m.estimate()
    assert est is not None and est.samples == 24
    assert est.bytes_per_ms == pytest.approx(RATE, rel=0.05)
    assert est.latency_ms == pytest.approx(LAT_MS, abs=0.2)
    m = LinkMeter()
    _deliver(m, _bursts(n_bursts=1, per_burst=10))  # exact timestamps: exact numbers
    est = m.estimate()
    assert est.bytes_per_ms == pytest.approx(RATE) and est.latency_ms == pytest.approx(LAT_MS)
    assert est.ms(20_000) == pytest.approx(LAT_MS + 2.0)


def test_link_meter_rate_does_not_depend_on_clock_skew() -> None:
    for skew in (1.5, 0.0):  # the receiver's clock 1.5 s ahead, or in step
        m = LinkMeter()
        _deliver(m, _bursts(), skew_s=skew)
        assert m.estimate().bytes_per_ms == pytest.approx(RATE)


def test_link_meter_one_delayed_burst_does_not_move_the_median() -> None:
    """A node busy computing stamps arrivals late; the median of recent bursts ignores one."""
    m = LinkMeter()
    _deliver(m, _bursts(n_bursts=4))
    good = m.estimate().bytes_per_ms
    for k in range(8):  # a fifth burst whose later chunks were all stamped at once
        m.observe(20_000, 1.0, 1.002 if k == 0 else 1.010 + k * 1e-5)
    assert m.estimate().bytes_per_ms == pytest.approx(good)


def test_link_meter_without_bursts_underestimates_the_rate() -> None:
    m = LinkMeter()
    _deliver(m, [(k * 0.1, 20_000) for k in range(5)])  # each onto an idle link
    est = m.estimate()
    # 20 kB in 2 ms + 0.5 ms latency: the whole transit, on the safe side
    assert est.bytes_per_ms == pytest.approx(20_000 / 2.5) and est.bytes_per_ms < RATE
    assert est.latency_ms == pytest.approx(0.0, abs=1e-9)


def test_link_meter_small_bursts_do_not_set_the_rate() -> None:
    m = LinkMeter()
    for k in range(3):
        for j in range(3):  # 500 B chunks: bursts carrying too little to time
            m.observe(500, k * 0.1, k * 0.1 + 0.0006 + j * 1e-5)
    assert m.rates == [] and m.estimate() is None  # too small to say anything: unmeasured


def test_link_meter_chunks_the_sender_spaced_out_do_not_set_the_rate() -> None:
    """Halo rows leave as they are computed, milliseconds apart: their arrival gaps are the
    sender's pace, not the link's (this once read a 100 Mbit/s link as 3 Mbit/s)."""
    m = LinkMeter()
    for k in range(10):
        m.observe(4000, k * 0.004, k * 0.004 + 0.0002)  # 4 kB every 4 ms over a fast link
    assert m.rates == [] and m.estimate() is None
    m.observe(40_000, 1.0, 1.0045)  # one big chunk: bytes over its whole transit
    assert m.estimate().bytes_per_ms == pytest.approx(40_000 / 4.5)


def test_link_meter_ignores_clock_skew_and_garbage() -> None:
    m = LinkMeter()
    _deliver(m, _bursts(n_bursts=1), skew_s=-1.0)  # every chunk "arrives" before it was sent
    assert m.estimate() is None
    m = LinkMeter()
    _deliver(m, _bursts())
    good = m.estimate()
    m.observe(20_000, 10.0, 9.999)  # arrival before send: nothing to learn
    m.observe(20_000, math.nan, 11.0)
    m.observe(20_000, 11.0, math.inf)
    m.observe(0, 12.0, 12.01)
    m.observe(-5, 12.0, 12.01)
    assert m.estimate() == good


def test_link_estimates_are_bounded() -> None:
    m = LinkMeter()
    m.observe(20_000, 0.0, 1e-12)  # a timer tick: an absurd rate
    assert m.estimate().bytes_per_ms == MAX_LINK_BYTES_PER_MS
    assert LinkEstimate(1000.0, 2.0).ms(0) == 2.0
    assert LinkEstimate(1000.0, 2.0).ms(500) == 2.5


# --------------------------------------------------------------------------- Costs
PRIOR = LinkEstimate(50_000.0, 1.0)


def test_costs_link_measured_composed_and_prior() -> None:
    up = LinkEstimate(5_000.0, 0.3, 7)
    down = LinkEstimate(8_000.0, 0.2, 9)
    direct = LinkEstimate(2_000.0, 0.05, 3)
    c = Costs({}, {("a", COORDINATOR): up, (COORDINATOR, "b"): down, ("b", "c"): direct}, PRIOR)
    assert c.link("b", "c") == direct  # measured
    ab = c.link("a", "b")  # unmeasured: the slower leg, both latencies
    assert ab.bytes_per_ms == 5_000.0 and ab.latency_ms == pytest.approx(0.5)
    ca = c.link("c", "a")  # neither leg measured: two prior legs
    assert ca.bytes_per_ms == PRIOR.bytes_per_ms and ca.latency_ms == pytest.approx(2 * PRIOR.latency_ms)
    cb = c.link("c", "b")  # one leg measured (coordinator -> b), the other the prior
    assert cb.bytes_per_ms == 8_000.0 and cb.latency_ms == pytest.approx(PRIOR.latency_ms + 0.2)
    ac = c.link("a", "c")  # the measured up leg is slower than the prior
    assert ac.bytes_per_ms == 5_000.0 and ac.latency_ms == pytest.approx(0.3 + PRIOR.latency_ms)
    # a link to or from the coordinator measured only the other way (a pooled head's few kB of
    # output per request time no rate): that direction's estimate; measured neither way: the
    # prior, not composed
    assert c.link(COORDINATOR, "a") == up and c.link("b", COORDINATOR) == down
    assert c.link(COORDINATOR, "c") == PRIOR and c.link("c", COORDINATOR) == PRIOR
    assert c.link("a", COORDINATOR) == up
    # a direct measurement far below what both measured legs carry is a receiver's delay
    slow = LinkEstimate(1_000.0, 0.0, 50)
    c = Costs({}, {("a", COORDINATOR): up, (COORDINATOR, "b"): down, ("a", "b"): slow}, PRIOR)
    assert c.link("a", "b") == LinkEstimate(5_000.0, 0.5)  # the legs
    fair = LinkEstimate(3_000.0, 0.1, 50)  # within the floor: believed
    c = Costs({}, {("a", COORDINATOR): up, (COORDINATOR, "b"): down, ("a", "b"): fair}, PRIOR)
    assert c.link("a", "b") == fair


def test_a_coordinator_link_far_slower_than_its_other_direction_takes_that_rate() -> None:
    """A receiver that stamps chunks late (a busy interpreter) measures a link as crawling: a
    link to or from the coordinator 10x slower than the other direction takes the other
    direction's rate; an asymmetry within that is believed."""
    back = LinkEstimate(25_000.0, 0.1, 40)  # coordinator -> a, as node a measured it
    crawl = LinkEstimate(800.0, 0.4, 30)  # a -> coordinator, as the coordinator measured it
    c = Costs({}, {(COORDINATOR, "a"): back, ("a", COORDINATOR): crawl}, PRIOR)
    assert c.link("a", COORDINATOR) == LinkEstimate(25_000.0, 0.4, 30)
    assert c.link(COORDINATOR, "a") == back
    slower = LinkEstimate(5_000.0, 0.4, 30)  # 5x asymmetric: believed
    c = Costs({}, {(COORDINATOR, "a"): back, ("a", COORDINATOR): slower}, PRIOR)
    assert c.link("a", COORDINATOR) == slower
    # the other way round too: a node stamping the coordinator's slabs late
    c = Costs({}, {(COORDINATOR, "a"): crawl, ("a", COORDINATOR): back}, PRIOR)
    assert c.link(COORDINATOR, "a") == LinkEstimate(25_000.0, 0.4, 30)


def test_costs_node_view_and_links_from_profiles() -> None:
    pa = _profile(node_id="a", op_costs=(OpCost(1.0, 0.5),) * N_OPS, min_run_rows=4,
                  links={"b": LinkEstimate(3_000.0, 0.4)})
    pb = _profile(node_id="b", op_costs=(OpCost(2.0, 1.0),) * N_OPS, min_run_rows=16,
                  links={"a": LinkEstimate(4_000.0, 0.1), COORDINATOR: LinkEstimate(9_000.0, 0.0)})
    given = LinkEstimate(1_000.0, 0.7)
    c = Costs({"a": pa, "b": pb}, {("a", "b"): given}, PRIOR, slab_rows=8)
    with pytest.raises(ValueError, match="no cost profile"):
        c.for_nodes(["a", "ghost"])
    v = c.for_nodes(["b", "a"])
    # runs of max(min_run_rows, slab_rows) rows
    assert v.op_ms(1, 0, 16) == pa.op_ms(0, 16, 8) == 2 * 1.0 + 16 * 0.5
    assert v.op_ms(0, 0, 16) == pb.op_ms(0, 16, 16) == 1 * 2.0 + 16 * 1.0
    assert v.transfer_ms(1, 0, 700) == pytest.approx(0.7 + 700 / 1_000.0)  # a -> b as given
    merged = c.with_links_from_profiles()
    assert merged.links[("a", "b")] == given  # what was given stays
    assert merged.links[("b", "a")] == LinkEstimate(3_000.0, 0.4)  # a measured b -> a
    assert merged.links[(COORDINATOR, "b")] == LinkEstimate(9_000.0, 0.0)
    assert ("b", "a") not in c.links  # the original is unchanged
    assert merged.for_nodes(["b", "a"]).transfer_ms(0, 1, 300) == pytest.approx(0.4 + 0.1)


def test_stale_profile_replace_keeps_checks() -> None:
    """A profile refined with `CostRefiner.current()` is still a valid profile."""
    p = _profile()
    r = CostRefiner(p.op_costs)
    for _ in range(5):
        r.observe_feed(3.0 * p.op_costs[1].ms(8), p.op_costs[1].ms(8))
    q = replace(p, op_costs=r.current(), run_samples=r.samples, version=2)
    assert _problem(q) == "" and q.op_costs[1].row_ms == pytest.approx(3 * p.op_costs[1].row_ms)


def test_observe_link_meters_each_sender_and_no_more_senders_than_its_bound() -> None:
    from kaitian_ros.core.costs import MAX_METERED_SENDERS, observe_link

    meters: dict = {}
    for i in range(MAX_METERED_SENDERS + 5):  # forged producer names beyond the bound are not metered
        observe_link(meters, f"node_{i}", 20000, 1.0, 1.002)
    assert len(meters) == MAX_METERED_SENDERS and "node_0" in meters
    observe_link(meters, "node_0", 20000, 1.01, 1.012)
    assert meters["node_0"].samples >= 1 and f"node_{MAX_METERED_SENDERS}" not in meters
