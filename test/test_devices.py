"""Compute devices: the device string is checked with a reason, the graph and the stripe
buffers live on the model's device, and (where CUDA exists) a split on the GPU equals the
CPU trunk. On a machine without CUDA the GPU test is reported as skipped, not passed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import child_env

from kaitian_ros.core.plan import make_plan
from kaitian_ros.core.stripe import StripeRunner, run_plan_locally
from kaitian_ros.nodes import inference_common as ic

torch.set_num_threads(1)
SPEC = ic.ModelSpec("resnet18", (3, 64, 64), 10, 0, "")


def test_check_device_accepts_cpu_and_explains_the_rest() -> None:
    assert ic.check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a torch device string"):
        ic.check_device("gpu-please")
    if torch.cuda.is_available():
        assert ic.check_device("cuda:0").type == "cuda"
        with pytest.raises(ValueError, match="CUDA device"):
            ic.check_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            ic.check_device("cuda:0")


def test_cpu_busy_clock_counts_work_not_waiting() -> None:
    """A CPU node's compute time is CPU time: waiting for a core (or sleeping) is not compute,
    so co-located nodes do not make each other look slow (docs/policy.md "Compute time")."""
    import time

    clock = ic.busy_clock(torch.device("cpu"))
    t0 = clock()
    time.sleep(0.3)  # the behaviour under test: sleeping is not compute time
    slept = clock() - t0
    t0 = clock()
    x = torch.randn(256, 256)
    for _ in range(50):
        x = torch.tanh(x @ x)
    worked = clock() - t0
    assert slept < 0.05, f"0.3 s of sleep counted as {slept:.3f} s of compute"
    assert worked > 0.0


def test_graph_and_buffers_on_the_model_device() -> None:
    g = ic.build_graph(SPEC, "cpu")
    assert g.device == torch.device("cpu")
    plan = make_plan(g, ["a", "b"], [0.6, 0.4], slab_rows=16)
    x = torch.randn(1, *SPEC.input_shape, dtype=torch.float64).float()
    runners: dict = {}
    out = run_plan_locally(g, plan, x, runners_out=runners)
    assert all(t.device == g.device for r in runners.values() for p in r._rows for t in p)
    ref = g.run_trunk(x)
    assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    # a node with its own graph of the model (on a GPU in the CUDA test below) runs on that one
    other = ic.build_graph(SPEC, "cpu")
    runners = {}
    out = run_plan_locally(g, plan, x, seed=1, graphs={"b": other}, runners_out=runners)
    assert runners["b"].graph is other and runners["a"].graph is g
    assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_split_on_cuda_equals_cpu_trunk() -> None:
    g_cpu = ic.build_graph(SPEC, "cpu")
    g_gpu = ic.build_graph(SPEC, "cuda:0")
    assert g_gpu.device.type == "cuda"
    x = torch.randn(1, *SPEC.input_shape)
    ref = g_cpu.run_trunk(x)
    plan = make_plan(g_gpu, ["a", "b"], [0.7, 0.3], slab_rows=16)
    runner = StripeRunner(g_gpu, make_plan(g_gpu, ["a"], [1.0], slab_rows=16), "a")
    rows = [e for k in range(0, 64, 16) for e in runner.feed(0, k, x[:, :, k:k + 16])]
    got = torch.cat([e.rows for e in sorted(rows, key=lambda e: e.row_offset)
                     if e.role == "OUTPUT"], dim=2).cpu()
    # build_graph turns TF32 off on CUDA, so a GPU stripe holds the CPU tolerance of 1e-4
    assert not torch.backends.cudnn.allow_tf32
    assert float((got - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    out = run_plan_locally(g_gpu, plan, x.cuda()).cpu()
    assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_split_across_a_cuda_node_and_a_cpu_node_equals_cpu_trunk() -> None:
    """A heterogeneous split: node a computes on the GPU, node b on the CPU; halo rows cross
    between the devices, in a shuffled delivery order."""
    g_cpu = ic.build_graph(SPEC, "cpu")
    g_gpu = ic.build_graph(SPEC, "cuda:0")
    x = torch.randn(1, *SPEC.input_shape)
    ref = g_cpu.run_trunk(x)
    plan = make_plan(g_cpu, ["a", "b"], [0.6, 0.4], slab_rows=8)
    runners: dict = {}
    out = run_plan_locally(g_cpu, plan, x, seed=3, graphs={"a": g_gpu}, runners_out=runners)
    assert runners["a"].graph.device.type == "cuda" and runners["b"].graph.device.type == "cpu"
    assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


@pytest.mark.e2e
def test_compute_node_refuses_an_unusable_device_with_one_line(router) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: cuda:0 is usable")
    p = subprocess.run([sys.executable, "-m", "kaitian_ros.nodes.compute", "--ros-args",
                        "-r", "__node:=compute_x", "-p", "device:=cuda:0", "-p", "model:=digits_cnn",
                        "-p", "input_height:=8", "-p", "input_width:=8", "-p", "input_channels:=1"],
                       capture_output=True, check=False, text=True, timeout=120,
                       env=child_env(router.endpoint))
    assert p.returncode != 0
    assert "CUDA is not available" in p.stderr, p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1, p.stderr
