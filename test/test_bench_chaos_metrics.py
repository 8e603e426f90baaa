"""The chaos benchmark's metrics (pure functions over recorded frames, answers and readings):
what counts as lost, duplicated and out of order, when a graph has recovered, RSS deltas, and
counters of a node that restarted."""

from __future__ import annotations

from kaitian_ros.bench.chaos_metrics import (
    Answer,
    Frame,
    count_frames,
    counter_increase,
    fault_kind,
    max_gap,
    reason_increase,
    recovery,
    rss_delta,
    targets,
)


def _frames(n: int, period: float = 0.2) -> list[Frame]:
    return [Frame((100 + i, 0), i * period) for i in range(n)]


def _answer(f: Frame, after: float = 0.05, complete: bool = True, ms: float | None = 50.0) -> Answer:
    return Answer(f.stamp, f.t + after, complete, ms)


def test_every_frame_answered_once_in_order_loses_nothing():
    frames = _frames(10)
    c = count_frames(frames, [_answer(f) for f in frames], 0.0, 2.0, answer_s=6.0)
    assert (c.frames, c.complete, c.lost, c.duplicated, c.out_of_order) == (10, 10, 0, 0, 0)


def test_unanswered_and_timed_out_frames_are_lost_unless_the_coordinator_was_down():
    frames = _frames(10)
    answers = [_answer(f) for f in frames[:4]]
    answers.append(_answer(frames[4], after=5.0, complete=False))  # the coordinator's timeout
    # frames 5..9 unanswered; 6 and 7 arrived while the coordinator was down, 1 dropped busy
    c = count_frames(frames, answers, 0.0, 2.0, answer_s=6.0, down=[(1.1, 1.5)], by_design=1)
    assert (c.complete, c.incomplete, c.unanswered, c.coordinator_down) == (4, 1, 5, 2)
    assert c.lost == 1 + (5 - 2)
    assert (c.dropped_by_design, c.lost_not_by_design) == (1, c.lost - 1)


def test_by_design_drops_never_exceed_the_unanswered_frames():
    frames = _frames(4)
    c = count_frames(frames, [_answer(f) for f in frames[:3]], 0.0, 1.0, answer_s=6.0, by_design=5)
    assert (c.lost, c.dropped_by_design, c.lost_not_by_design) == (1, 1, 0)


def test_an_answer_after_the_answer_window_does_not_count():
    frames = _frames(2)
    c = count_frames(frames, [_answer(frames[0]), _answer(frames[1], after=7.0)], 0.0, 1.0, answer_s=6.0)
    assert (c.complete, c.unanswered, c.lost) == (1, 1, 1)


def test_duplicates_and_out_of_order_answers():
    frames = _frames(5)
    f = frames
    # arrival order: 0, 2, 1 (older than 2: out of order), 1 again (a duplicate, still out of order), 3, 4
    answers = [_answer(f[0], 0.05), _answer(f[2], 0.05), Answer(f[1].stamp, f[2].t + 0.1, True, 300.0),
               Answer(f[1].stamp, f[2].t + 0.2, True, 400.0), _answer(f[3]), _answer(f[4])]
    c = count_frames(frames, answers, 0.0, 1.0, answer_s=6.0)
    assert (c.duplicated, c.out_of_order, c.lost) == (1, 2, 0)


def test_frames_outside_the_window_are_not_counted():
    frames = _frames(10)
    c = count_frames(frames, [], 0.5, 0.9, answer_s=6.0)
    assert c.frames == 2 and c.lost == 2  # t = 0.6 and 0.8


def test_recovery_waits_for_the_first_complete_answer_and_latency_within_ten_percent():
    frames = _frames(20)
    lat = [50.0] * 5 + [None, None] + [120.0, 110.0, 80.0, 54.0, 53.0, 56.0, 50.0] + [50.0] * 6
    answers = [Answer(f.stamp, f.t + 0.05, ms is not None, ms) for f, ms in zip(frames, lat)]
    r = recovery(answers, ref_t=1.0, baseline_ms=50.0)
    assert abs(r.first_complete_s - (frames[7].t + 0.05 - 1.0)) < 1e-9
    # the first 3 answers in a row with a median <= 55 ms: 80, 54, 53 (frames 9..11; one outlier
    # among three does not hold recovery back)
    assert abs(r.latency_back_s - (frames[11].t + 0.05 - 1.0)) < 1e-9
    assert r.recover_s == r.latency_back_s


def test_no_recovery_within_the_observation_is_none():
    frames = _frames(10)
    answers = [Answer(f.stamp, f.t + 0.05, True, 200.0) for f in frames]
    r = recovery(answers, ref_t=0.5, baseline_ms=50.0)
    assert r.first_complete_s is not None and r.latency_back_s is None and r.recover_s is None
    assert recovery([], 0.0, 50.0).recover_s is None


def test_max_gap_counts_the_window_edges():
    assert max_gap([1.0, 1.2, 2.5, 2.7], 0.5, 3.0) == 1.3
    assert max_gap([], 0.0, 4.0) == 4.0


def test_rss_delta_pre_median_peak_and_settled():
    samples = [(0.0, 500.0), (1.0, 502.0), (2.0, 501.0), (3.0, 900.0), (4.0, 700.0), (10.0, 530.0), (11.0, 540.0)]
    d = rss_delta(samples, (0.0, 2.0), (2.5, 11.0), settled_at=11.0)
    assert (d.pre_mb, d.peak_mb, d.settled_mb) == (501.0, 900.0, 535.0)
    assert (d.peak_delta_mb, d.settled_delta_mb) == (399.0, 34.0)
    assert rss_delta([], (0, 1), (1, 2), 2).peak_delta_mb is None


def test_counter_increase_across_a_restart():
    # baseline 7; +3; the process restarts (new identity) and counts 2; then +4
    assert counter_increase([("a", 7), ("a", 10), ("b", 2), ("b", 6)]) == 3 + 2 + 4
    # a value below the previous one with the same identity is a restart too
    assert counter_increase([(None, 7), (None, 9), (None, 1)]) == 2 + 1
    assert counter_increase([]) == 0


def test_reason_increase_reads_rejected_keys():
    readings = [("x", {"rejected": "3", "rejected.malformed": "3", "other": "z"}),
                ("x", {"rejected": "9", "rejected.malformed": "5", "rejected.queue full": "4"})]
    assert reason_increase(readings) == {"malformed": 2, "queue full": 4}


def test_targets_per_kind():
    assert fault_kind("kill_scheduler") == "kill_authority" and fault_kind("forge_plan_secure") == "forge_secure"
    met = {t.what: t.met for t in targets("kill_compute", {"lost": 0, "recover_s": 2.5})}
    assert met == {"lost == 0": True, "recover_s <= 2": False}
    flood = targets("flood", {"peak_rss_delta_mb": 120.0, "settled_rss_delta_mb": None, "output_gap_s": 0.4,
                              "settle_s": 30})
    assert [t.met for t in flood] == [True, None, True]
    forge = targets("forge", {"variants": [{"name": "a", "implausible": True, "counted": True, "effect": False},
                                           {"name": "b", "implausible": True, "counted": False, "effect": False},
                                           {"name": "c", "implausible": False, "counted": False, "effect": True}]})
    assert forge[0].met is False and "not: b" in forge[0].value
    assert targets("forge_secure", {"forgery_effect": None})[0].met is None
    secure = targets("forge_secure", {"forgery_effect": False, "forgery_effect_compute_certificate": True})
    assert [t.met for t in secure] == [True, None]
    assert targets("fuzz", {"skipped": True, "reason": "x"})[0].met is None
