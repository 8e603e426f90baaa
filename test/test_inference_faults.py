"""Faults on the inference graph: malformed chunks and images are dropped and counted with a
reason while the nodes keep serving; a compute process killed mid-run loses no frame.

Real processes on the embedded runtime, a router on a free port per graph. The kill test
starts the graph with the launcher but never lets it supervise (``wait``), so the launcher
does not stop the graph when the killed node disappears.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import wait_routed
from inference_helpers import InferenceGraph, image_msg, synthetic_image, wait_until

from kaitian_ros.core.policy_state import Assignment
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime import zenoh_session as zs
from kaitian_ros.runtime.api import QoS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """digits_cnn on 3x32x32 over two compute nodes: cheap, one segment, 4-row slabs."""
    g = InferenceGraph(tmp_path_factory.mktemp("faults"), model="digits_cnn", height=32, width=32,
                       slowdowns=[1.0, 1.5], shares=[1.0, 1.0], slab_rows=4,
                       compute={"pending_timeout_s": 1.0, "max_plans": 100})
    try:
        g.wait_ready()
        frames = g.frames(2)
        g.check_outputs(frames, g.stream(frames))
        yield g
    finally:
        g.close()


def latest_values(g: InferenceGraph, node: str) -> dict[str, str]:
    diags = g.diagnostics_of(node)
    return diags[-1] if diags else {}


def behind_drops(g: InferenceGraph, node: str) -> int:
    """`node`'s latest telemetry `behind_drops` (0 before its first)."""
    own = [t for t in g.telemetry.snapshot() if t.node_id == node]
    return int(own[-1].behind_drops) if own else 0


def plan_followed(g: InferenceGraph, node: str):
    """The newest plan message `node` holds of the coordinator it follows (None if none yet)."""
    values = latest_values(g, node)
    held = set(values.get("plans", "").split(","))
    plans = [p for p in g.plans.snapshot() if f"{int(p.incarnation):016x}" == values.get(
        "coordinator_incarnation") and str(int(p.version)) in held]
    return max(plans, key=lambda p: int(p.version)) if plans else None


def wait_values(g: InferenceGraph, node: str, predicate, what: str) -> dict[str, str]:
    def check():
        values = latest_values(g, node)
        return values if values and predicate(values) else None

    try:
        return wait_until(check, f"{node} /diagnostics showing {what}", timeout_s=20.0, interval_s=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last values: {latest_values(g, node)}") from None


def test_malformed_chunks_are_dropped_counted_and_the_node_keeps_serving(graph):
    g = graph
    node = "compute_0"
    before = int(latest_values(g, node).get("rejected", "0"))
    assert before == 0, latest_values(g, node)
    pv = g.latest_plan()
    plan = ic.plan_from_msg(g.graph, pv, 4)
    lo, hi = plan.input_rows_for(node)
    c, height, width = g.spec.input_shape
    assert hi < height, "compute_0 must not read the whole image for the out-of-range case"
    pub = g.probe.rt.create_publisher(proto.chunk_topic(node), "TensorChunk", QoS.RELIABLE)
    key = zs.topic_key(zs.domain_id(), proto.chunk_topic(node), "TensorChunk")
    rows = torch.randn(1, c, 4, width)

    def chunk(**over):
        fields = dict(request_id=10_000, plan_version=pv.version, producer=proto.COORDINATOR, consumer=node,
                      segment=0, role=proto.ROLE_INPUT, row_offset=lo, total_rows=height, rows=rows)
        fields.update(over)
        return ic.chunk_message(**fields)

    good = bytes(interfaces.encode(chunk(), "TensorChunk"))
    wait_routed(pub, f"{node}'s subscription to its chunks")
    rng = np.random.default_rng(7)
    injected = {
        "malformed": 2, "misaddressed": 1, "bad role": 1, "stale plan": 1, "bad chunk": 5,
        "unknown plan": 1,
    }
    # random bytes, and a valid chunk cut in half: undecodable CDR
    block = zs.CongestionControl.BLOCK
    g.probe.rt.session.put(key, rng.integers(0, 256, 300, dtype=np.uint8).tobytes(), congestion_control=block)
    g.probe.rt.session.put(key, good[: len(good) // 2], congestion_control=block)
    pub.publish(chunk(consumer="compute_1"))                      # misaddressed
    pub.publish(chunk(role=proto.ROLE_OUTPUT))                       # a compute node takes no OUTPUT
    pub.publish(chunk(plan_version=0))                            # older than any plan it holds
    pub.publish(chunk(rows=torch.randn(1, c, 4)))                 # 3-D: not (N,C,rows,W)
    pub.publish(chunk(rows=torch.randn(1, c, 4, width + 3)))      # wrong width
    wrong_len = chunk()
    wrong_len.data = wrong_len.data[:-4].copy()                   # shape says more bytes than sent
    pub.publish(wrong_len)
    pub.publish(chunk(row_offset=height - 4))                     # rows compute_1 owns, not compute_0
    # every input row compute_0 needs, but float16: the stripe would run (and fail) on it at once
    pub.publish(chunk(rows=torch.randn(1, c, hi - lo, width).half()))
    pub.publish(chunk(plan_version=pv.version + 1000))            # never announced
    total = sum(injected.values())

    values = wait_values(g, node, lambda v: int(v["rejected"]) >= total, f"{total} rejected")
    counts = {k[len("rejected."):]: int(v) for k, v in values.items() if k.startswith("rejected.")}
    assert counts == injected, values
    assert int(values["rejected"]) == total
    # the unknown plan is the last one counted: after pending_timeout_s without that plan
    assert values["last_reject_reason"].startswith("unknown plan: v"), values
    assert f"v{pv.version + 1000}" in values["last_reject_reason"]
    beat = wait_until(lambda: [t for t in g.heartbeats_of(node) if t.rejected_count >= total],
                      "a heartbeat with the new rejected_count")[-1]
    assert beat.rejected_count == total and beat.last_reject_reason == values["last_reject_reason"]

    assert not [line for line in g.out.text().splitlines()
                if line.startswith(f"[{node}]") and ("Traceback" in line or "callback raised" in line)]
    # still serving: next frames complete and exact
    frames = g.frames(3, first=100)
    g.check_outputs(frames, g.stream(frames))
    assert not g.dead_children()
    assert int(latest_values(g, node)["rejected"]) == total


def test_malformed_images_are_counted_and_the_coordinator_keeps_running(graph):
    g = graph
    node = "coordinator"
    base = int(wait_values(g, node, lambda v: True, "anything")["rejected"])
    h, w = 40, 48
    pixels = synthetic_image(500, h, w)
    bad_encoding = image_msg(pixels, 500, encoding="yuv422")
    too_short = image_msg(pixels, 501)
    too_short.data = too_short.data[: w * 3 * (h - 1)].copy()       # one row missing
    bad_step = image_msg(pixels, 502)
    bad_step.step = w                                               # step < width * 3
    key = zs.topic_key(zs.domain_id(), "/camera/image_raw", "Image")
    cases = [
        (lambda: g.publish(bad_encoding), "bad image: unsupported encoding 'yuv422'"),
        (lambda: g.publish(too_short), "bad image: image data"),
        (lambda: g.publish(bad_step), "bad image: image data"),
        (lambda: g.probe.rt.session.put(key, b"\x00\x01\x00\x00garbage",
                                        congestion_control=zs.CongestionControl.BLOCK), "malformed"),
    ]
    for i, (send, reason) in enumerate(cases, start=1):
        send()
        values = wait_values(g, node, lambda v, i=i: int(v["rejected"]) >= base + i, f"{base + i} rejected")
        assert int(values["rejected"]) == base + i, values
        assert values["last_reject_reason"].startswith(reason), (reason, values)
    fused_before = len(g.fused)
    frames = g.frames(3, first=200)
    g.check_outputs(frames, g.stream(frames))
    assert len(g.fused) == fused_before + 3, "a malformed image produced a FusedOutput"
    assert not g.dead_children()


def test_output_sum_for_a_head_that_needs_the_rows_is_refused(graph):
    """digits_cnn's head pools to 4x4, not to one value per channel: a per-channel sum of a
    node's output rows (what nodes send for a global-average-pool head) cannot stand for them."""
    g = graph
    node = "coordinator"
    assert not g.graph.pooled_head
    base = int(wait_values(g, node, lambda v: True, "anything")["rejected"])
    pv = g.latest_plan()
    c, _, _ = g.graph.trunk_output_shape
    pub = g.probe.rt.create_publisher(proto.chunk_topic(node), "TensorChunk", QoS.RELIABLE)
    wait_routed(pub, "the coordinator's subscription to its chunks")
    pub.publish(ic.chunk_message(request_id=10_000, plan_version=pv.version, producer="compute_0", consumer=node,
                                 segment=0, role=proto.ROLE_OUTPUT_SUM, row_offset=0,
                                 total_rows=g.graph.trunk_output_shape[1], rows=torch.randn(1, c, 1, 1)))
    values = wait_values(g, node, lambda v: int(v["rejected"]) >= base + 1, f"{base + 1} rejected")
    assert int(values["rejected"]) == base + 1, values
    assert values["last_reject_reason"].startswith("bad chunk: OUTPUT_SUM, but the head"), values
    frames = g.frames(2, first=300)
    g.check_outputs(frames, g.stream(frames))


@pytest.mark.slow
def test_compute_process_killed_mid_run_loses_no_frame(tmp_path):
    """kill -9 one of three compute nodes while frames flow (input paced so requests are in
    flight): every request still yields exactly one complete, exact FusedOutput, re-dispatched
    to the survivors; the coordinator's plan drops the dead node as soon as its session is gone
    (no wait for dead_after_s)."""
    dead_after_s = 1.5
    with InferenceGraph(tmp_path, model="digits_cnn", height=64, width=64, slowdowns=[1.0, 2.0, 1.0],
                        shares=[1.0, 1.0, 1.0], slab_rows=4,
                        coordinator={"input_pacing_ms": 10.0, "dead_after_s": dead_after_s,
                                     "max_in_flight": 4}) as g:
        ready = g.wait_ready()
        victim = "compute_1"
        pid = g.pid_from_output(victim)
        assert pid == g.pid(victim)
        killed = {}

        def kill_mid_run(i: int) -> None:
            if i == 5:  # frames 0-2 answered (window 3), 3-5 in flight
                os.kill(pid, signal.SIGKILL)
                killed["t"] = time.monotonic()

        frames = g.frames(12)
        by_stamp = g.stream(frames, window=3, on_sent=kill_mid_run)
        assert g.dead_children() == [victim]
        outputs = g.check_outputs(frames, by_stamp)
        ids = sorted(int(f.request_id) for f in outputs)
        assert ids == list(range(ids[0], ids[0] + len(frames))), f"requests lost or duplicated: {ids}"
        assert len(g.fused) == len(frames), "exactly one FusedOutput per request"
        # the plan without the dead node: when did it arrive (latched topic, collected as it came)
        plans = g.plans.timed()
        survivors = [p for _, p in plans if p.version > ready.version]
        assert survivors, [list(p.node_ids) for _, p in plans]
        dropped_after = next(t for t, p in plans if p is survivors[0]) - killed["t"]
        assert dropped_after <= dead_after_s + 1.0, f"plan dropped {victim} {dropped_after:.2f} s after the kill"
        assert list(survivors[0].node_ids) == ["compute_0", "compute_2"]
        assert f"{victim} lost" in survivors[0].reason
        assert len(survivors) == 1, [(p.version, p.reason) for p in survivors]
        # frames answered before the kill ran on all three; the rest on the survivors only
        before = [f for f in outputs if f.plan_version == ready.version]
        after = [f for f in outputs if f.plan_version == survivors[0].version]
        assert len(before) + len(after) == len(outputs)
        assert len(before) >= 3 and all(len(f.node_ids) == 3 for f in before)
        assert len(after) >= 6 and all(list(f.node_ids) == ["compute_0", "compute_2"] for f in after)
        coord = wait_values(g, "coordinator", lambda v: "redispatched" in v, "a re-dispatch count")
        assert int(coord["redispatched"]) >= 1, coord
        assert "timeouts" not in coord, coord
        # seen as a departure (its session's liveliness token went with the process), not by
        # waiting dead_after_s for missing heartbeats
        assert int(coord.get("departures", "0")) == 1, coord
        assert f"['{victim}'] left the graph" in g.out.text(), g.out.text(last=40)
        print(f"\nplan without {victim} {dropped_after:.2f} s after the kill")


def test_unknown_plan_chunk_times_out_while_other_plans_keep_arriving(graph):
    """A chunk of a never-announced plan is held pending_timeout_s (1 s here) from its arrival,
    then dropped and counted, even while other plan versions arrive meanwhile (each arrival
    re-examines the held chunks; that must not restart their clock)."""
    g = graph
    node = "compute_0"
    base = wait_values(g, node, lambda v: True, "anything")
    unknown_before = int(base.get("rejected.unknown plan", "0"))
    pv = g.latest_plan()
    c, height, width = g.spec.input_shape
    chunks = g.probe.rt.create_publisher(proto.chunk_topic(node), "TensorChunk", QoS.RELIABLE)
    # the test stands in for the coordinator (its incarnation) announcing new versions of the same
    # plan, 0.3 s apart
    plans = g.probe.rt.create_publisher(proto.PLAN_TOPIC, "LoadAssignment", QoS.LATCHED)
    wait_routed(chunks, f"{node}'s subscription to its chunks")
    wait_routed(plans, "the nodes' subscriptions to the plan")
    bogus = pv.version + 5000
    chunks.publish(ic.chunk_message(request_id=30_000, plan_version=bogus, producer=proto.COORDINATOR,
                                    consumer=node, segment=0, role=proto.ROLE_INPUT, row_offset=0,
                                    total_rows=height, rows=torch.randn(1, c, 4, width)))
    version = pv.version
    deadline = time.monotonic() + 12.0
    counted = False
    while time.monotonic() < deadline and not counted:
        version += 1
        plans.publish(proto.assignment_msg(Assignment(version, 0, tuple(pv.node_ids), tuple(pv.shares), "static",
                                                   "test: re-announced", 0.0), int(pv.incarnation)))
        time.sleep(0.3)  # the pace of the re-announcements under test (0.3 s apart), not a wait
        values = latest_values(g, node)
        counted = int(values.get("rejected.unknown plan", "0")) > unknown_before
    values = latest_values(g, node)
    assert counted, (f"chunk of unknown plan v{bogus} still held after 12 s while plans "
                     f"v{pv.version + 1}..v{version} arrived: {values}")
    assert values["last_reject_reason"] == f"unknown plan: v{bogus} never announced", values
    # the node still serves the coordinator's (real) plan
    frames = g.frames(2, first=300)
    g.check_outputs(frames, g.stream(frames))


def test_forged_chunks_cost_bounded_memory_and_oversized_ones_nothing(graph):
    """A chunk whose header declares a batch of 64 (or another shape the plan does not have) is
    refused from its header, before any buffer exists; made-up request ids beyond the node's
    request table (max_requests, 64 by default) evict the entry fed least recently, counted,
    and the real frames that follow still complete."""
    g = graph
    node = "compute_0"
    # the plan compute_0 runs now: the previous test stood in for the coordinator, which took its
    # plans for an impostor's and re-announced under a new incarnation
    def followed():
        return plan_followed(g, node)

    pv = wait_until(followed, f"the plan {node} follows")
    base = wait_values(g, node, lambda v: True, "anything")
    plan = ic.plan_from_msg(g.graph, pv, 4)
    lo, _ = plan.input_rows_for(node)
    c, height, width = g.spec.input_shape
    pub = g.probe.rt.create_publisher(proto.chunk_topic(node), "TensorChunk", QoS.RELIABLE)
    wait_routed(pub, f"{node}'s subscription to its chunks")

    def chunk(request_id: int, rows: torch.Tensor) -> object:
        return ic.chunk_message(request_id=request_id, plan_version=pv.version, producer=proto.COORDINATOR,
                                consumer=node, segment=0, role=proto.ROLE_INPUT, row_offset=lo,
                                total_rows=height, rows=rows)

    bad_before = int(base.get("rejected.bad chunk", "0"))
    for _ in range(3):  # the plan may move on while the chunk travels (then it is stale, not bad): aim again
        stale_before = int(latest_values(g, node).get("rejected.stale plan", "0"))
        pub.publish(chunk(40_000, torch.randn(64, c, 4, width)))
        values = wait_values(g, node, lambda v, s=stale_before: int(v.get("rejected.bad chunk", "0")) > bad_before
                             or int(v.get("rejected.stale plan", "0")) > s, "the batch-64 chunk")
        if int(values.get("rejected.bad chunk", "0")) > bad_before:
            break
        pv = wait_until(followed, f"the plan {node} follows")
        plan = ic.plan_from_msg(g.graph, pv, 4)
        lo, _ = plan.input_rows_for(node)
    assert "does not fit segment 0" in values["last_reject_reason"] and "(64, " in values["last_reject_reason"]

    evicted_before = int(base.get("rejected.evicted", "0"))
    behind_before = behind_drops(g, node)
    forged = 70
    for i in range(forged):  # one slab each: none of them can ever complete
        pub.publish(chunk(50_000 + i, torch.randn(1, c, 4, width)))
    values = wait_values(g, node, lambda v: int(v.get("rejected.evicted", "0")) - evicted_before >= forged - 64,
                         f"{forged - 64} evictions")
    assert int(values["in_flight"]) <= 64, values
    # and in its telemetry, as drops for being behind (the coordinator's lateness rule reads them)
    wait_until(lambda: behind_drops(g, node) - behind_before >= forged - 64, f"{node}'s telemetry behind_drops")
    assert 0.0 <= float(values["held_mb"]) <= 128.0, values  # max_held_mb's default
    frames = g.frames(3, first=400)
    g.check_outputs(frames, g.stream(frames))  # a real request evicts a forged one, never the reverse


def test_a_backlog_older_than_max_queue_wait_is_dropped_as_stale_and_the_node_keeps_serving(graph):
    """Chunks that waited in a compute node's own queue longer than `max_queue_wait_s` (a node
    behind, flooded with requests it computes) are dropped and counted as stale instead of
    computed one after the other long after the flood: their requests are late for the
    coordinator already."""
    g = graph
    node = "compute_0"
    client = g.probe_client()
    ok, why = client.set_parameters(node, {"max_queue_wait_s": 0.05})
    assert ok, why
    try:
        base = wait_values(g, node, lambda v: True, "anything")
        behind_before = behind_drops(g, node)
        pv = wait_until(lambda: plan_followed(g, node), f"the plan {node} follows")
        plan = ic.plan_from_msg(g.graph, pv, 4)
        lo, hi = plan.input_rows_for(node)
        c, height, width = g.spec.input_shape
        pub = g.probe.rt.create_publisher(proto.chunk_topic(node), "TensorChunk", QoS.RELIABLE)
        wait_routed(pub, f"{node}'s subscription to its chunks")
        rows = torch.randn(1, c, hi - lo, width)  # a whole stripe's input: each one is computed
        for i in range(500):  # back to back: the node falls behind within a few of them
            pub.publish(ic.chunk_message(request_id=60_000 + i, plan_version=pv.version, producer=proto.COORDINATOR,
                                         consumer=node, segment=0, role=proto.ROLE_INPUT, row_offset=lo,
                                         total_rows=height, rows=rows, last_slab=True))
        before = int(base.get("rejected.stale", "0"))
        values = wait_values(g, node, lambda v: int(v.get("rejected.stale", "0")) > before, "stale chunks")
        assert int(values["rejected.stale"]) > before
        stale = int(values["rejected.stale"]) - before
        wait_until(lambda: behind_drops(g, node) - behind_before >= stale, f"{node}'s telemetry behind_drops")
    finally:
        ok, why = client.set_parameters(node, {"max_queue_wait_s": 2.0})
        assert ok, why
    frames = g.frames(3, first=700)
    g.check_outputs(frames, g.stream(frames))
    assert not g.dead_children()


def test_the_direct_path_node_killed_mid_run_loses_no_frame(tmp_path):
    """kill -9 the node that takes the camera images itself (a single-device plan on the direct
    path) while frames flow: the requests it held are sent again, with their rows, to the other
    node, and every frame gets one complete, exact FusedOutput."""
    with InferenceGraph(tmp_path, model="resnet18", height=64, width=64, slowdowns=[1.0, 1.0],
                        shares=[1.0, 1.0], slab_rows=64,
                        coordinator={"strategy": "single", "dead_after_s": 1.5, "max_in_flight": 3}) as g:
        wait_values(g, "coordinator", lambda v: v.get("alive") == "compute_0,compute_1", "both nodes alive")
        # 60 s: at 30 s this wait ran out once under suite load (cause not found; its graph
        # starts at 64-row slabs, so not the planner's slab fix of 2f261d2): a failure now says
        # which plans came and what the coordinator counted
        try:
            plan = wait_until(lambda: ((p := g.latest_plan()) is not None and p.image_topic and p) or None,
                              "a single plan on the direct path", 60.0)
        except AssertionError as exc:
            plans = [(p.version, p.strategy, p.image_topic, p.reason) for p in g.plans.snapshot()]
            raise AssertionError(f"{exc}; plans: {plans}; coordinator: {latest_values(g, 'coordinator')}"
                                 f"\n--- launcher output ---\n{g.out.text()}") from None
        victim = ic.spec_from_msg(plan).node_ids[0]
        other = next(n for n in g.compute_names if n != victim)
        pid = g.pid(victim)
        warm = g.frames(3, first=40)
        g.check_outputs(warm, g.stream(warm))
        already = len(g.fused)

        def kill_mid_run(i: int) -> None:
            if i == 4:  # frames 0-1 answered (window 3), 2-4 in flight
                os.kill(pid, signal.SIGKILL)

        frames = g.frames(10)
        outputs = g.check_outputs(frames, g.stream(frames, window=3, on_sent=kill_mid_run))
        assert g.dead_children() == [victim]
        ids = sorted(int(f.request_id) for f in outputs)
        assert ids == list(range(ids[0], ids[0] + len(frames))), f"requests lost or duplicated: {ids}"
        assert len(g.fused) - already == len(frames), "exactly one FusedOutput per request"
        assert list(outputs[-1].node_ids) == [other]
        coord = wait_values(g, "coordinator", lambda v: "redispatched" in v or "departures" in v, "the departure")
        assert "timeouts" not in coord, coord
