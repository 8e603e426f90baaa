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


def test_live_runs_at_twice_the_base_double_the_costs() -> None:
    r = CostRefiner(BASE)
    for k in range(12):
        r.observe_run(0, 8 + k % 3, _ms(0, 8 + k % 3, 2.0))
    assert r.op_ratio(0) == pytest.approx(2.0)
    cur = r.current()
    assert cur[0].call_ms == pytest.approx(0.2) and cur[0].row_ms == pytest.approx(0.04)
    # ops not (yet) seen follow the device ratio
    assert cur[1] == pytest.approx(OpCost(0.1, 0.02)) and r.device_ratio == pytest.approx(2.0)
    assert r.live_samples == 12 and r.samples == 12
    # a second op that runs at the base: its own ratio once it has enough samples
    for _ in range(r.min_op_samples):
        r.observe_run(2, 4, _ms(2, 4, 1.0))
    assert r.op_ratio(2) == pytest.approx(1.0) and r.op_ratio(0) == pytest.approx(2.0)


def test_invalid_runs_are_ignored() -> None:
    r = CostRefiner(BASE)
    for rows, ms in ((0, 1.0), (4, math.nan), (4, -1.0), (4, math.inf)):
        r.observe_run(0, rows, ms)
    assert r.live_samples == 0 and r.current() == BASE


def test_a_single_outlier_is_ignored_but_confirmed_ones_count() -> None:
    r = CostRefiner(BASE)
    for _ in range(5):
        r.observe_run(0, 8, _ms(0, 8, 1.0))
    assert r.op_ratio(0) == pytest.approx(1.0)
    r.observe_run(0, 8, _ms(0, 8, 10.0))  # one slow call: kernels built, weights packed
    assert r.op_ratio(0) == pytest.approx(1.0) and r.current()[0] == pytest.approx(BASE[0])
    r.observe_run(0, 8, _ms(0, 8, 1.0))  # back to normal: the count starts over
    for _ in range(r.confirm - 1):
        r.observe_run(0, 8, _ms(0, 8, 10.0))
    assert r.op_ratio(0) == pytest.approx(1.0)  # confirm - 1 in a row: still ignored
    r.observe_run(0, 8, _ms(0, 8, 10.0))  # the confirm-th in a row: a slower device
    assert r.op_ratio(0) > 2.0
    for _ in range(40):
        r.observe_run(0, 8, _ms(0, 8, 10.0))
    assert r.op_ratio(0) == pytest.approx(10.0, rel=0.02)
    # a far-too-fast outlier is ignored the same way
    r.observe_run(0, 8, _ms(0, 8, 0.5))
    assert r.op_ratio(0) == pytest.approx(10.0, rel=0.02)


def test_idle_probes_showing_a_slower_device_scale_idle_ops() -> None:
    r = CostRefiner(BASE)
    for _ in range(5):
        r.observe_run(0, 8, _ms(0, 8, 1.0))
        r.observe_run(1, 8, _ms(1, 8, 1.0))
    before = r.current()
    assert before == pytest.approx(BASE)
    for _ in range(8):
        r.observe_probe(3.0, 1.0)
    # the probe level moves in deadband-sized steps: within one deadband of the true 3x
    assert 3.0 / r.probe_deadband <= r.probe_ratio <= 3.0
    for j in range(3):  # ops that ran before (0, 1) and one that never ran (2) alike
        assert r.op_ratio(j) == pytest.approx(r.probe_ratio)
        assert r.current()[j].row_ms == pytest.approx(BASE[j].row_ms * r.probe_ratio)
    assert r.probe_samples == 8 and r.samples == 18
    # the next live run of an op sets it straight (it starts over from the measured time)
    r.observe_run(0, 8, _ms(0, 8, 3.0))
    assert r.op_ratio(0) == pytest.approx(3.0)


def test_a_probe_within_the_deadband_changes_nothing() -> None:
    r = CostRefiner(BASE)
    for _ in range(5):
        r.observe_run(0, 8, _ms(0, 8, 2.0))
    before = r.current()
    for _ in range(10):
        r.observe_probe(1.3, 1.0)  # 1.3x < deadband 1.5
    for _ in range(10):
        r.observe_probe(0.8, 1.0)
    assert r.probe_ratio == 1.0 and r.current() == before
    r.observe_probe(math.nan, 1.0)
    r.observe_probe(5.0, 0.0)  # no start-up time: nothing to compare with
    r.observe_probe(-1.0, 1.0)
    assert r.probe_ratio == 1.0 and r.probe_samples == 20


def test_refined_costs_are_clamped() -> None:
    r = CostRefiner(BASE, confirm=1)
    for _ in range(60):
        r.observe_run(0, 8, _ms(0, 8, 1000.0))
    assert r.current()[0] == pytest.approx(BASE[0].scaled(20.0))


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


def test_link_meter_rate_and_latency_from_a_burst() -> None:
    m = LinkMeter()
    assert m.estimate() is None
    _deliver(m, _bursts(), jitter=(0.03, -0.02, 0.0, 0.04, -0.03))
    est = m.estimate()
    assert est is not None and est.samples == 24
    assert est.bytes_per_ms == pytest.approx(RATE, rel=0.05)
    assert est.latency_ms == pytest.approx(LAT_MS, abs=0.2)
    # exact timestamps: exact numbers
    m = LinkMeter()
    _deliver(m, _bursts(n_bursts=1, per_burst=10))
    est = m.estimate()
    assert est.bytes_per_ms == pytest.approx(RATE) and est.latency_ms == pytest.approx(LAT_MS)
    assert est.ms(20_000) == pytest.approx(LAT_MS + 2.0)


def test_link_meter_without_queued_chunks_underestimates_the_rate() -> None:
    m = LinkMeter()
    _deliver(m, [(k * 0.1, 20_000) for k in range(5)])  # each onto an idle link
    est = m.estimate()
    # 20 kB in 2 ms + 0.5 ms latency: the whole transit, on the safe side
    assert est.bytes_per_ms == pytest.approx(20_000 / 2.5) and est.bytes_per_ms < RATE
    assert est.latency_ms == pytest.approx(0.0, abs=1e-9)


def test_link_meter_small_queued_chunks_do_not_set_the_rate() -> None:
    m = LinkMeter()
    _deliver(m, [(0.0, 20_000)] + [(0.0, 500)] * 10, jitter=(0.0, 1.0))  # tiny chunks, slowed
    assert m.samples == 0 and m.idle_samples == 1
    assert m.estimate().bytes_per_ms == pytest.approx(20_000 / 2.5)


def test_link_meter_ignores_clock_skew_and_garbage() -> None:
    m = LinkMeter()
    _deliver(m, _bursts(n_bursts=1), skew_s=-1.0)  # the receiver's clock 1 s behind the sender's
    # the rate comes from gaps on one clock each: right whatever the skew; no latency is learnt
    # from transits that came out negative
    assert m.idle_samples == 0 and m.estimate().bytes_per_ms == pytest.approx(RATE)
    m = LinkMeter()
    _deliver(m, _bursts(n_bursts=1), skew_s=+1.5)  # 1.5 s ahead: idle transits are too long
    assert m.estimate().bytes_per_ms == pytest.approx(RATE)
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
    # a link to or from the coordinator that nobody measured: the prior, not composed
    assert c.link(COORDINATOR, "a") == PRIOR and c.link("b", COORDINATOR) == PRIOR
    assert c.link("a", COORDINATOR) == up


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
        r.observe_run(1, 8, 3.0 * p.op_costs[1].ms(8))
    q = replace(p, op_costs=r.current(), run_samples=r.samples, version=2)
    assert _problem(q) == "" and q.op_costs[1].row_ms == pytest.approx(0.3)
