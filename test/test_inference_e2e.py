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
