"""The direct path's one-off costs are paid at a compute node's start-up, not by its first
request (nodes/compute_direct.warm_direct_path): OpenCV is loaded only where an image needs a
resize, and warming leaves the model as it was, with or without a pooled head."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes.compute_direct import warm_direct_path
from kaitian_ros.runtime import interfaces


def _run(code: str) -> str:
    got = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False,
                         timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout.strip()


def test_an_image_at_the_models_size_loads_no_opencv_and_a_resize_does():
    out = _run("""
        import sys
        import numpy as np
        from kaitian_ros.core.tensors import resize_pixels
        x = resize_pixels(np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3), 4, 4)
        before = "cv2" in sys.modules
        y = resize_pixels(np.zeros((8, 8, 3), np.uint8), 4, 4)
        print(before, "cv2" in sys.modules, tuple(x.shape), tuple(y.shape), int(x[0, 1, 0, 0]))
    """)
    assert out == "False True (1, 3, 4, 4) (1, 3, 4, 4) 1"


def test_warming_loads_opencv_in_the_node_process():
    assert _run("""
        import sys
        from kaitian_ros.core.tensors import warm_resize
        warm_resize()
        print("cv2" in sys.modules)
    """) == "True"


@pytest.mark.parametrize("pooled", [True, False])
def test_warming_runs_with_or_without_a_pooled_head_and_leaves_the_model_unchanged(pooled):
    graph = ic.build_graph(ic.ModelSpec("resnet18", (3, 32, 32), 10, 0, ""), "cpu")
    assert graph.pooled_head
    graph = dataclasses.replace(graph, pooled_head=pooled)  # no built-in model lacks one
    x = torch.rand(1, 3, 32, 32)
    before = graph.run_ops(x)
    warm_direct_path(graph, [f"class {i}" for i in range(10)])
    assert torch.equal(graph.run_ops(x), before)


def test_a_node_that_cannot_take_the_direct_path_does_not_load_opencv():
    """No pooled head, no direct path: nothing to warm (OpenCV costs a process about 16 MB)."""
    assert _run("""
        import dataclasses, sys
        from kaitian_ros.nodes import inference_common as ic
        from kaitian_ros.nodes.compute_direct import warm_direct_path
        graph = ic.build_graph(ic.ModelSpec("resnet18", (3, 32, 32), 10, 0, ""), "cpu")
        warm_direct_path(dataclasses.replace(graph, pooled_head=False), [])
        print("cv2" in sys.modules)
    """) == "False"


def test_the_warming_message_is_a_valid_fused_output():
    """What warming encodes is what the node publishes: the same builder and codec."""
    result = torch.tensor([[0.0, 2.0, 1.0]])
    msg = ic.fused_message(request_id=7, plan_version=3, frame_id="cam", image_stamp=None, latency_ms=1.5,
                           result=result, labels=["a", "b", "c"], node_ids=["compute_0"], node_rows=[4],
                           status="ok")
    back = interfaces.decode(bytes(interfaces.encode(msg, "FusedOutput")), "FusedOutput")
    assert (back.request_id, back.top_class, back.top_label, back.complete) == (7, 1, "b", True)
    assert np.allclose(interfaces.array_from_fields(back), result.numpy())
