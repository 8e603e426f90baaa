"""The compute node's request table: bounded by count and by the activation bytes its
requests' runners hold, evicting the request fed least recently, every drop counted."""

from __future__ import annotations

import time

import torch

from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import make_plan
from kaitian_ros.core.split import split_model
from kaitian_ros.core.stripe import StripeRunner
from kaitian_ros.nodes.compute_requests import RequestState, RequestTable

torch.set_num_threads(1)
GRAPH = split_model(build_model("resnet18", in_channels=3).eval(), (3, 96, 80))
# two segments: node a computes its first segment and then waits for b's halo rows, which a
# forged request never gets - it holds what it computed until evicted or expired
PLAN = make_plan(GRAPH, ["a", "b"], [0.5, 0.5], cuts=GRAPH.cut_values)


def stuck_request(request_id: int, fed_s: float) -> RequestState:
    state = RequestState(request_id, 1, StripeRunner(GRAPH, PLAN, "a", min_run_rows=1), started_s=time.time(),
                         last_fed_s=fed_s)
    lo, hi = PLAN.input_rows_for("a")
    state.runner.feed(0, lo, torch.randn(1, 3, hi - lo, 80))
    assert not state.runner.done and state.runner.held_bytes > 0
    return state


def test_the_byte_bound_evicts_the_requests_fed_least_recently_and_never_the_one_just_fed():
    drops: list[str] = []
    table = RequestTable(drops.append)
    states = [stuck_request(i, fed_s=float(i)) for i in range(6)]
    each = states[0].runner.held_bytes
    for s in states[:5]:
        table.put(s)
    assert table.held_bytes() == sum(s.runner.held_bytes for s in states[:5])
    newest = states[5]
    table.put(newest)
    table.bound_bytes(newest, max_bytes=int(2.5 * each))  # room for the newest and one more
    assert [s.request_id for s in table] == [4, 5]
    assert table.held_bytes() <= 2.5 * each
    assert len(drops) == 4 and all(d.startswith("evicted: request ") and "MB of activations held" in d
                                   for d in drops), drops
    assert [int(d.split()[2]) for d in drops] == [0, 1, 2, 3]  # least recently fed first
    assert table.dropped_since_trim == 4
    assert table.evicted == 4  # the node's telemetry behind_drops: evicted for room
    # one request alone above the bound stays: its rows are a valid plan's
    table.bound_bytes(newest, max_bytes=1)
    assert [s.request_id for s in table] == [5]


def test_the_count_bound_and_expiry_drop_with_their_reasons():
    drops: list[str] = []
    table = RequestTable(drops.append)
    for i in range(3):
        table.put(stuck_request(i, fed_s=10.0 - i))  # request 2 was fed least recently
    table.make_room(max_requests=3)
    assert sorted(s.request_id for s in table) == [0, 1]
    assert drops == ["evicted: request 2 (table full, 3 requests held)"]
    table.expire(time.time() + 60.0, timeout_s=10.0)
    assert len(table) == 0 and table.held_bytes() == 0
    assert drops[1:] == [f"request timeout: request {i} never completed (missing rows)" for i in (0, 1)]
    assert table.evicted == 1  # an expired request is not one the node was too busy to keep


def test_a_finished_request_holds_nothing():
    plan = make_plan(GRAPH, ["a"], [1.0])
    state = RequestState(7, 1, StripeRunner(GRAPH, plan, "a"), started_s=time.time())
    table = RequestTable(lambda why: None)
    table.put(state)
    state.runner.feed(0, 0, torch.randn(1, 3, 96, 80))
    assert state.runner.done and table.held_bytes() == 0
    table.finish(state)
    assert len(table) == 0


def test_drops_ended_once_per_burst_after_a_quiet_check():
    drops: list[str] = []
    table = RequestTable(drops.append)
    assert not table.drops_ended()  # nothing dropped
    for i in range(2):
        table.put(stuck_request(i, fed_s=float(i)))
    table.make_room(max_requests=2)
    assert not table.drops_ended()  # drops since the last check: the burst may go on
    table.make_room(max_requests=1)
    assert not table.drops_ended()
    assert table.drops_ended()  # a check with no new drop: over, once
    assert not table.drops_ended()
    assert len(drops) == 2


def test_a_drop_outside_the_table_ends_a_burst_too():
    table = RequestTable(lambda reason: None)
    table.note_drop_elsewhere()  # e.g. a chunk for a plan that was never announced
    assert not table.drops_ended()
    assert table.drops_ended()
    assert not table.drops_ended()
