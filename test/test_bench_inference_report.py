"""bench.inference_report: the held-out comparison of ours with the best baseline (pure)."""

from __future__ import annotations

import pytest

from kaitian_ros.bench.inference_report import ours_over_best_heldout


def test_a_truly_faster_baseline_is_chosen_both_ways() -> None:
    ratio, chosen = ours_over_best_heldout({"ours": [10.0] * 10, "a": [8.0] * 10, "b": [12.0] * 10})
    assert ratio == pytest.approx(1.25) and chosen == ["a", "a"]


def test_the_baseline_chosen_on_half_the_frames_is_measured_on_the_other_half() -> None:
    # a and b are the same within noise: whichever looks faster on one half is slower on the other
    samples = {"ours": [11.0] * 10, "a": [10.0, 12.0] * 5, "b": [12.0, 10.0] * 5}
    ratio, chosen = ours_over_best_heldout(samples)
    assert chosen == ["a", "b"]  # even frames pick a, odd frames pick b
    assert ratio == pytest.approx(11.0 / 12.0)


def test_too_few_frames_is_an_error() -> None:
    with pytest.raises(ValueError, match="ours"):
        ours_over_best_heldout({"ours": [1.0], "a": [1.0, 2.0]})
    with pytest.raises(ValueError, match="baseline"):
        ours_over_best_heldout({"ours": [1.0, 2.0], "a": [1.0]})
