"""End to end: the hetero_inference graph (coordinator + compute processes on the embedded
runtime) against the single-device model, on frames the test publishes itself.

Each test launches its own graph on a router bound to a free port (no cross-talk), waits for
the coordinator's plan to name every compute node, then acts as the camera. Assertions are on
results and telemetry timestamps only, never on speed.
"""

from __future__ import annotations

import pytest
import torch
from inference_helpers import InferenceGraph, wait_until

pytestmark = pytest.mark.e2e

FRAMES = 6


def test_two_compute_processes_match_single_device(tmp_path):
    """resnet18 (4 segments, HALO exchange between the two nodes), uneven shares, 4-row slabs;
    weights from a file (`weights:=PATH`: the single-device reference loads the same file, so
    nodes that ignored it would not match) and class names from a labels file."""
    import torch

    from kaitian_ros.core.models import build_model

    weights = tmp_path / "resnet18_seed5.pt"
    torch.save(build_model("resnet18", num_classes=10, seed=5).state_dict(), weights)
    names = [f"class-{i}" for i in range(10)]
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(names) + "\n\n")
    with InferenceGraph(tmp_path, model="resnet18", height=128, width=128, slowdowns=[1.0, 2.0],
                        shares=[1.0, 2.0], slab_rows=4, weights=str(weights),
                        coordinator={"labels_file": str(labels)}) as g:
        plan = g.wait_ready()
        assert list(plan.node_ids) == ["compute_0", "compute_1"]
        frames = g.frames(FRAMES)
        outputs = g.check_outputs(frames, g.stream(frames))
        assert len(g.fused) == FRAMES, "exactly one FusedOutput per frame"
        ids = sorted(int(f.request_id) for f in outputs)
        assert ids == list(range(ids[0], ids[0] + FRAMES)), "no request lost"
        for f in outputs:  # (check_outputs compared node_ids/node_rows with the announced plan)
            # the planner may refine cuts as measurements come in; the nodes stay both
            assert list(g.executed_plan(f.plan_version).node_ids) == ["compute_0", "compute_1"]
            assert 0 <= f.top_class < 10 and f.top_label == names[f.top_class]
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
            assert f.plan_version == plan.version
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
                        coordinator={"input_pacing_ms": 20.0},
                        compute={"min_run_rows": 2}) as g:  # stream at slab granularity
        g.wait_ready()
        frames = g.frames(3)
        outputs = g.check_outputs(frames, g.stream(frames, window=1))
        ids = {int(f.request_id) for f in outputs}
        wait_until(lambda: {int(t.request_id) for t in g.telemetry.snapshot() if t.request_id} >= ids,
                   "telemetry for every request")
        reports = [t for t in g.telemetry.snapshot() if int(t.request_id) in ids]
        for t in reports:  # the timestamps describe a streamed request at all
            assert 0 < t.first_input_s <= t.last_input_s, t
            assert t.bytes_in > 0 and t.bytes_out > 0 and t.rows > 0
            # (a node whose rows all go to its neighbour - the plan's solo tail runs on the
            # other node - publishes HALO rows only)
            assert t.first_output_s == 0 or t.first_output_s <= t.last_output_s, t
        overlapped = [(t.node_id, int(t.request_id)) for t in reports if t.first_output_s < t.last_input_s]
        assert overlapped, ("no node published an OUTPUT slab before its last INPUT slab arrived: " +
                            "; ".join(f"{t.node_id} r{t.request_id}: last_in {t.last_input_s:.3f} "
                                      f"first_out {t.first_output_s:.3f}" for t in reports))
        # every request overlapped on some node, not just one lucky frame
        assert {rid for _, rid in overlapped} == ids, overlapped


@pytest.mark.slow
def test_node_whose_share_rounds_to_zero_rows(tmp_path):
    """resnet18 at 64x64 has a 2-row trunk output: of three compute nodes at least one owns zero
    trunk-output rows whatever the shares. Depending on the plan it is then either not active at
    all (no rows in any segment: it gets no work) or only computes rows of an earlier segment
    that its neighbours need (node_rows 0). Either way every result is complete and exact."""
    with InferenceGraph(tmp_path, model="resnet18", height=64, width=64, slowdowns=[1.0, 1.0, 2.0],
                        shares=[1.0, 1.0, 1.0], slab_rows=4) as g:
        pv = g.wait_ready()
        assert list(pv.node_ids) == ["compute_0", "compute_1", "compute_2"]
        active, rows = g.expected_rows(pv.version)
        zero = [n for n in pv.node_ids if n not in active or rows[active.index(n)] == 0]
        assert zero, f"no zero-row node in plan v{pv.version}: {active} {rows}"
        frames = g.frames(4)
        outputs = g.check_outputs(frames, g.stream(frames))  # node_rows as the plan says, 0s included
        for f in outputs:
            assert f.plan_version == pv.version
        for node in pv.node_ids:
            served = [t for t in g.heartbeats_of(node) if t.request_id]
            if node in active:
                wait_until(lambda node=node: len([t for t in g.heartbeats_of(node) if t.request_id]) >= len(frames),
                           f"{node} telemetry for every request")
            else:
                assert not served, f"{node} has no rows in plan v{pv.version} but got work"
        ids = sorted(int(f.request_id) for f in outputs)
        assert ids == list(range(ids[0], ids[0] + len(frames)))
        assert not g.dead_children()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_node_and_cpu_node_match_single_device(tmp_path):
    """A real heterogeneous graph: compute_0 on the GPU, compute_1 on the CPU, halo rows
    between them over Zenoh; the fused output equals the single-device CPU reference."""
    with InferenceGraph(tmp_path, model="resnet18", height=128, width=128, slowdowns=[1.0, 1.0],
                        shares=[1.0, 1.0], slab_rows=8, devices=["cuda:0", "cpu"]) as g:
        plan = g.wait_ready()
        assert list(plan.node_ids) == ["compute_0", "compute_1"]
        frames = g.frames(FRAMES)
        outputs = g.check_outputs(frames, g.stream(frames))
        assert len(g.fused) == FRAMES
        for f in outputs:
            assert list(f.node_ids) == ["compute_0", "compute_1"], "both devices computed rows"
        assert not g.dead_children()
