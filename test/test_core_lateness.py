"""core.lateness: which nodes a late request blames, how long they stay out, when they return."""

from __future__ import annotations

import dataclasses

import pytest

from kaitian_ros.core import lateness
from kaitian_ros.core.lateness import Quarantine, late_owners, late_threshold_s, may_rejoin, quarantine_after

NODES = ("compute_0", "compute_1")


def _at(threshold_s: float) -> dict[str, float]:
    return dict.fromkeys(NODES, threshold_s)


def test_threshold_is_the_larger_of_the_floor_and_a_multiple_of_the_prediction():
    assert late_threshold_s(70.0, 0.5, first_of_version=False) == pytest.approx(0.5)
    assert late_threshold_s(200.0, 0.5, first_of_version=False) == pytest.approx(lateness.LATE_FACTOR * 0.2)
    # the first request of a version pays one-off costs: twice the multiple
    assert late_threshold_s(100.0, 0.5, first_of_version=True) == pytest.approx(
        lateness.LATE_FACTOR * lateness.FIRST_REQUEST_FACTOR * 0.1)
    assert late_threshold_s(-5.0, 0.25, first_of_version=False) == pytest.approx(0.25)


def test_an_overloaded_node_is_late_soon_after_the_prediction():
    """It holds requests nobody sent it (a flood): it will not catch up, so no floor."""
    assert late_threshold_s(100.0, 0.5, first_of_version=False, overloaded=True) == pytest.approx(
        lateness.OVERLOADED_FACTOR * 0.1)
    # never later than the ordinary floor
    assert late_threshold_s(1000.0, 0.5, first_of_version=False, overloaded=True) == pytest.approx(0.5)


def test_nobody_is_late_before_the_threshold():
    assert late_owners({"compute_0"}, NODES, NODES, elapsed_s=0.4, thresholds_s=_at(0.5)) == ()
    assert late_owners(set(), NODES, NODES, elapsed_s=9.0, thresholds_s=_at(0.5)) == ()


def test_a_node_without_a_threshold_is_never_late():
    """A cold node (it never delivered rows) is not judged."""
    assert late_owners({"compute_0"}, NODES, NODES, elapsed_s=9.0, thresholds_s={"compute_1": 0.5}) == ()


def test_the_node_that_owes_rows_is_blamed_when_the_other_delivered():
    assert late_owners({"compute_0"}, NODES, NODES, elapsed_s=0.6, thresholds_s=_at(0.5)) == ("compute_0",)


def test_a_split_where_every_node_owes_rows_blames_nobody():
    """Every node slow at once: the host is busy, dropping one would not help."""
    assert late_owners({"compute_0", "compute_1"}, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5)) == ()


def test_a_split_where_every_node_owes_rows_blames_only_an_overloaded_node():
    """A flooded node delays its partners too (they wait for its halo rows): its own telemetry
    (more requests in progress than the coordinator sent) singles it out."""
    assert late_owners({"compute_0", "compute_1"}, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5),
                       overloaded_nodes={"compute_1"}) == ("compute_1",)
    assert lateness.overloaded(2 + lateness.SPARE_REQUESTS + 1, max_in_flight=2)
    assert not lateness.overloaded(2 + lateness.SPARE_REQUESTS, max_in_flight=2)


def test_of_several_overloaded_nodes_only_the_most_loaded_is_blamed():
    """A flood on compute_0 fills compute_1's table too (the flood's requests its halo rows
    started there): both overloaded, both owing rows. Blaming both would leave nobody to take
    over, so nobody was blamed; the most loaded one is the flood's target."""
    both = {"compute_0", "compute_1"}
    assert late_owners(both, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5), overloaded_nodes=both) == ()
    assert late_owners(both, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5), overloaded_nodes=both,
                       loads={"compute_0": 790, "compute_1": 70}) == ("compute_0",)
    # equal loads: no telling which one the flood aims at - nobody, as before
    assert late_owners(both, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5), overloaded_nodes=both,
                       loads={"compute_0": 64, "compute_1": 64}) == ()
    # three nodes: the most loaded goes, the third takes over
    three = ("compute_0", "compute_1", "compute_2")
    assert late_owners(set(three), three, three, elapsed_s=3.0, thresholds_s=dict.fromkeys(three, 0.5),
                       overloaded_nodes=both, loads={"compute_0": 300, "compute_1": 500, "compute_2": 1}) == \
        ("compute_1",)


def test_a_single_node_plan_blames_its_node_when_another_is_alive():
    assert late_owners({"compute_0"}, ("compute_0",), NODES, elapsed_s=0.6, thresholds_s=_at(0.5)) == ("compute_0",)
    # nobody to take over: keep waiting (the request timeout still applies)
    assert late_owners({"compute_0"}, ("compute_0",), ("compute_0",), elapsed_s=9.0, thresholds_s=_at(0.5)) == ()


def test_quarantine_doubles_while_the_node_keeps_being_late_and_is_forgotten_later():
    q1 = quarantine_after(None, 100.0, "late")
    assert (q1.strikes, q1.until_s - q1.since_s) == (1, lateness.QUARANTINE_S)
    q2 = quarantine_after(q1, q1.until_s + 1.0, "late")
    assert (q2.strikes, q2.until_s - q2.since_s) == (2, 2 * lateness.QUARANTINE_S)
    q = q2
    for _ in range(10):
        q = quarantine_after(q, q.until_s + 1.0, "late")
    assert q.until_s - q.since_s == lateness.QUARANTINE_MAX_S
    fresh = quarantine_after(q, q.until_s + lateness.STRIKES_FORGOTTEN_S + 1.0, "late")
    assert fresh.strikes == 1


def test_an_ended_quarantine_no_longer_holds_the_node_out_but_keeps_its_strikes():
    """One table of each node's latest quarantine: `held_out` is the nodes out of the plan now;
    a node back in the plan (or a new process of it) that is late again soon is out for longer."""
    q = quarantine_after(None, 100.0, "late")
    table = {"compute_0": q, "compute_1": quarantine_after(None, 100.0, "late")}
    assert set(lateness.held_out(table)) == {"compute_0", "compute_1"}
    table["compute_0"] = dataclasses.replace(q, ended=True)
    assert set(lateness.held_out(table)) == {"compute_1"}
    again = quarantine_after(table["compute_0"], q.until_s + 1.0, "late")
    assert again.strikes == 2 and not again.ended


def test_rejoin_needs_the_time_served_and_a_plausible_number_of_requests_in_progress():
    q = Quarantine(since_s=10.0, until_s=12.0, strikes=1, reason="late")
    assert not may_rejoin(q, 11.9, queue_depth=0, max_in_flight=2)
    assert may_rejoin(q, 12.0, queue_depth=2 + lateness.SPARE_REQUESTS, max_in_flight=2)
    # a flooded node is busy with requests the coordinator never sent
    assert not may_rejoin(q, 30.0, queue_depth=64, max_in_flight=2)


def test_a_plan_with_feeders_blames_only_an_overloaded_node():
    """Layer-wise: compute_0 runs the first layers and owns no output rows; the rows compute_1
    owes may be waiting for compute_0 (a collapsed link), so compute_1 is not to blame."""
    assert late_owners({"compute_1"}, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5),
                       feeders={"compute_0"}) == ()
    assert late_owners({"compute_1"}, NODES, NODES, elapsed_s=3.0, thresholds_s=_at(0.5),
                       overloaded_nodes={"compute_1"}, feeders={"compute_0"}) == ("compute_1",)


def test_requests_a_node_finished_that_the_coordinator_never_issued_count_as_load_for_a_while() -> None:
    """A flood of complete requests leaves no queue in the node's table (it finishes each); its
    telemetry for them, counted over FOREIGN_WINDOW_S, makes the node overloaded all the same."""
    now = 100.0
    flood = [now - 0.01 * k for k in range(20)]  # 20 finished in the last 0.2 s
    assert lateness.node_load(1, flood, now) == 21
    assert lateness.overloaded(lateness.node_load(1, flood, now), max_in_flight=2)
    assert not lateness.overloaded(lateness.node_load(1, [], now), max_in_flight=2)
    # the flood ended: once its last report is older than the window the node holds only its own
    later = now + lateness.FOREIGN_WINDOW_S + 0.01
    assert lateness.node_load(1, flood, later) == 1
    q = lateness.quarantine_after(None, now - 10.0, "late")
    assert not may_rejoin(q, now, lateness.node_load(1, flood, now), max_in_flight=2)
    assert may_rejoin(q, later, lateness.node_load(1, flood, later), max_in_flight=2)


def test_messages_a_node_dropped_lately_count_as_load() -> None:
    """A node flooded faster than it takes chunks drops them as stale before they become
    requests: its table stays short, its telemetry's growing behind_drops shows the flood."""
    now = 100.0
    drops = [(now - 0.5, 40), (now - 0.1, 35)]  # the growth of behind_drops between reports
    assert lateness.node_load(1, [], now, drops) == 76
    assert lateness.overloaded(lateness.node_load(1, [], now, drops), max_in_flight=2)
    # a few stale chunks after a re-plan are not a flood
    assert not lateness.overloaded(lateness.node_load(0, [], now, [(now - 0.2, 3)]), max_in_flight=2)
    later = now + lateness.FOREIGN_WINDOW_S + 0.01
    assert lateness.node_load(1, [], later, drops) == 1


def test_drops_since_the_previous_report_and_after_a_restart() -> None:
    assert lateness.drops_since(None, 500) == 0  # a first report: old drops are not new load
    assert lateness.drops_since(500, 540) == 40
    assert lateness.drops_since(540, 540) == 0
    assert lateness.drops_since(540, 7) == 7  # restarted: counts from 0 again
