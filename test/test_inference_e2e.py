"""End to end: the hetero_inference graph (coordinator + compute processes on the embedded
runtime) against the single-device model, on frames the test publishes itself.

Each test launches its own graph on a router bound to a free port (no cross-talk), waits for
the coordinator's plan to name every compute node, then acts as the camera. Assertions are on
results and telemetry timestamps only, never on speed.
"""

from __future__ import annotations

from inference_helpers import InferenceGraph, wait_until

FRAMES = 6


def test_two_compute_processes_match_single_device(tmp_path):
    """resnet18 (4 segments, HALO exchange between the two nodes), uneven shares, 4-row slabs."""
    with InferenceGraph(tmp_path, model="resnet18", height=128, width=128, slowdowns=[1.0, 2.0],
                        shares=[1.0, 2.0], slab_rows=4) as g:
        plan = g.wait_ready()
        assert list(plan.node_ids) == ["compute_0", "compute_1"]
        frames = g.frames(FRAMES)
        outputs = g.check_outputs(frames, g.stream(frames))
        assert len(g.fused) == FRAMES, "exactly one FusedOutput per frame"
        assert {int(f.request_id) for f in outputs} == set(range(1, FRAMES + 1)), "no request lost"
        for f in outputs:
            assert list(f.node_ids) == ["compute_0", "compute_1"]
            assert [int(r) for r in f.node_rows] == [1, 3]  # round(4 * 1/3) = 1 row, the rest
        assert not g.dead_children()


def test_three_compute_processes_match_single_device(tmp_path):
    """mobilenet_v2 over three nodes of different emulated speed, uneven shares."""
    with InferenceGraph(tmp_path, model="mobilenet_v2", height=128, width=96,
                        slowdowns=[1.0, 1.5, 2.5], shares=[3.0, 2.0, 3.0], slab_rows=4) as g:
        plan = g.wait_ready()
        assert list(plan.node_ids) == ["compute_0", "compute_1", "compute_2"]
        frames = g.frames(FRAMES)
        outputs = g.check_outputs(frames, g.stream(frames))
        assert len(g.fused) == FRAMES
        for f in outputs:
            assert list(f.node_ids) == ["compute_0", "compute_1", "compute_2"]
            assert all(int(r) > 0 for r in f.node_rows)
        # every node reported telemetry for every request it served
        served = {(t.node_id, int(t.request_id)) for t in g.telemetry.snapshot() if t.request_id}
        for f in outputs:
            for node in f.node_ids:
                assert (node, int(f.request_id)) in served


def test_first_output_slab_leaves_before_last_input_slab_arrives(tmp_path):
    """Overlap: an EMULATED slow input link (the coordinator paces its input slabs 20 ms apart)
    and 2-row slabs; a compute node publishes OUTPUT rows while its INPUT rows still arrive."""
    with InferenceGraph(tmp_path, model="digits_cnn", height=64, width=64, slowdowns=[1.0, 2.0],
                        shares=[1.0, 1.0], slab_rows=2,
                        coordinator={"input_pacing_ms": 20.0}) as g:
        g.wait_ready()
        frames = g.frames(3)
        outputs = g.check_outputs(frames, g.stream(frames, window=1))
        ids = {int(f.request_id) for f in outputs}
        wait_until(lambda: {int(t.request_id) for t in g.telemetry.snapshot() if t.request_id} >= ids,
                   "telemetry for every request")
        reports = [t for t in g.telemetry.snapshot() if int(t.request_id) in ids]
        for t in reports:  # the timestamps describe a streamed request at all
            assert 0 < t.first_input_s <= t.last_input_s, t
            assert 0 < t.first_output_s <= t.last_output_s, t
            assert t.bytes_in > 0 and t.bytes_out > 0 and t.rows > 0
        overlapped = [(t.node_id, int(t.request_id)) for t in reports if t.first_output_s < t.last_input_s]
        assert overlapped, ("no node published an OUTPUT slab before its last INPUT slab arrived: " +
                            "; ".join(f"{t.node_id} r{t.request_id}: last_in {t.last_input_s:.3f} "
                                      f"first_out {t.first_output_s:.3f}" for t in reports))
        # every request overlapped on some node, not just one lucky frame
        assert {rid for _, rid in overlapped} == ids, overlapped


def test_node_whose_share_rounds_to_zero_rows(tmp_path):
    """resnet18 at 64x64 has a 2-row trunk output: three equal shares give the middle node zero
    rows (round(2/3) = round(4/3) = 1), so it drops out of the plan's active nodes; results stay
    complete and exact, and the idle node is never sent work."""
    with InferenceGraph(tmp_path, model="resnet18", height=64, width=64, slowdowns=[1.0, 1.0, 2.0],
                        shares=[1.0, 1.0, 1.0], slab_rows=4) as g:
        plan = g.wait_ready()
        assert list(plan.node_ids) == ["compute_0", "compute_1", "compute_2"]
        frames = g.frames(4)
        outputs = g.check_outputs(frames, g.stream(frames))
        for f in outputs:
            assert list(f.node_ids) == ["compute_0", "compute_2"]
            assert [int(r) for r in f.node_rows] == [1, 1]
        assert not [t for t in g.heartbeats_of("compute_1") if t.request_id], "idle node got work"
        assert {int(f.request_id) for f in outputs} == set(range(1, len(frames) + 1))
        assert not g.dead_children()
