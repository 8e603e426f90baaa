"""bench.transport_report: the ratios compare each path with raw zenoh on the same path."""

from __future__ import annotations

import pytest

from kaitian_ros.bench.transport_report import TARGET_RATIO, summarise, table


def _trial(gbytes: float, msgs: float) -> dict:
    return {"gbytes_per_s": gbytes, "msgs_per_s": msgs, "pub_msgs_per_s": msgs, "n": 10, "lost": 0, "seconds": 1.0}


def _results() -> dict:
    return {"raw_4mib": [_trial(2.0, 500), _trial(4.0, 1000), _trial(3.0, 700)],
            "ours_4mib": [_trial(2.4, 600), _trial(2.7, 650), _trial(1.5, 400)],
            "raw_256b": [_trial(0.03, 100_000)] * 3,
            "ours_256b": [_trial(0.01, 40_000), _trial(0.01, 60_000), _trial(0.01, 50_000)],
            "raw_4mib_tcp": [_trial(1.0, 250)] * 3,
            "ours_4mib_tcp": [_trial(0.5, 120), _trial(0.6, 150), _trial(0.7, 170)]}


def test_ratios_are_medians_over_the_same_path() -> None:
    s = summarise(_results(), {"repeats": 3})
    assert s["ratio_to_raw"] == pytest.approx(2.4 / 3.0)  # medians, shared-memory path
    assert s["tcp"]["ratio_to_raw"] == pytest.approx(0.6 / 1.0)  # TCP only: its own raw row
    assert s["ratio_to_raw_256b"] == pytest.approx(0.5)
    assert s["min_max"]["ours_4mib"]["gbytes_per_s"] == [1.5, 2.7]
    assert s["meets_targets"] == {"ratio_to_raw": TARGET_RATIO <= 2.4 / 3.0, "ratio_to_raw_tcp": False,
                                  "msgs_per_s_256b": True, "ratio_to_raw_256b": True}
    text = table(s)
    assert "TCP only" in text and "NOT met" in text
