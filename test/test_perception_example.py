"""The perception_example node and the README's five-line perception node, each a real process on
the embedded runtime, against a real publisher of FusedOutput (test/helpers.py ``fused_pub``:
complete results with (1, 10) logits, and incomplete ones)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import FUSED_LABELS, REPO, Probe, Proc, child_env, spawn_helper, spawn_node, wait_until

pytestmark = pytest.mark.e2e

COUNT = 10


def _sent(publisher: Proc) -> list[dict]:
    return json.loads(publisher.wait_for(r'^\{"sent"')[0].string)["sent"]["fused"]


def test_logs_class_label_score_latency_and_completeness(router) -> None:
    node = spawn_node("perception_example", "perception", router.endpoint)
    publisher = None
    try:
        node.wait_for(r"listening on /kaitian/fused$")
        publisher = spawn_helper("fused_pub", str(COUNT), "fused", router=router.endpoint)
        sent = _sent(publisher)
        node.wait_for(r"request \d+: ", count=COUNT)
        for fused in sent:
            (line,) = [m.string for m in node.find(rf"request {fused['request_id']}: ")]
            assert f"latency {fused['latency_ms']:.1f} ms" in line, line
            if fused["complete"]:
                cls = fused["top_class"]
                assert f"class {cls} ({FUSED_LABELS[cls]}) score {fused['top_score']:.3f}," in line, line
                assert line.startswith("[INFO]") and line.endswith(", complete"), line
            else:
                assert line.startswith("[WARN]"), line
                assert f"incomplete ({fused['status']})" in line, line
        assert sum(not f["complete"] for f in sent) == 2
        assert node.alive()
    finally:
        node.stop()
        if publisher is not None:
            publisher.stop()
    assert node.p.returncode == 0, node.output()
    assert node.find(rf"{COUNT} results, 2 incomplete"), node.output()
    assert "Traceback" not in node.output()


def test_a_tensor_that_does_not_add_up_is_logged_not_fatal(router) -> None:
    """complete=True with 3 data bytes for a (1, 10) float32 tensor; a later good one still logs."""
    node = spawn_node("perception_example", "perception", router.endpoint)
    probe = Probe(router.endpoint)
    try:
        node.wait_for(r"listening on /kaitian/fused$")
        from kaitian_ros.runtime import interfaces

        pub = probe.rt.create_publisher("/kaitian/fused", "FusedOutput")
        wait_until(lambda: pub._pub.matching_status.matching, "the node's subscription")
        bad = interfaces.make("FusedOutput", request_id=5, complete=True, dtype_code=2, dtype_bits=32,
                              shape=np.array([1, 10], np.int64), data=np.zeros(3, np.uint8))
        logits = np.arange(10, dtype=np.float32)
        good = interfaces.make("FusedOutput", request_id=6, complete=True, dtype_code=2, dtype_bits=32,
                               shape=np.array([1, 10], np.int64), data=logits.view(np.uint8), latency_ms=3.0)
        pub.publish(bad)
        pub.publish(good)
        node.wait_for(r"request 5: undecodable result")
        node.wait_for(r"request 6: class 9 score 0\.6\d\d, latency 3\.0 ms")
        assert node.alive()
    finally:
        probe.close()
        node.stop()
    assert node.p.returncode == 0, node.output()


def _readme_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## A perception node in five lines"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_readme_perception_node_runs(router, tmp_path: Path) -> None:
    snippet = _readme_snippet()
    body = snippet[snippet.index("def perception"):snippet.index("run_node(perception")]
    assert len([line for line in body.splitlines() if line.strip()]) == 5
    script = tmp_path / "my_perception.py"
    script.write_text(snippet)
    node = Proc([sys.executable, "-u", str(script)], child_env(router.endpoint, PYTHONPATH=str(REPO)))
    publisher = None
    try:
        publisher = spawn_helper("fused_pub", str(COUNT), "fused", router=router.endpoint)
        sent = _sent(publisher)
        complete = [f for f in sent if f["complete"]]
        node.wait_for(r"\[my_perception\]: request \d+: class \d+", count=len(complete))
        for fused in complete:
            assert node.find(rf"request {fused['request_id']}: class {fused['top_class']}$"), node.output()
        assert not node.find(r"Traceback")
    finally:
        node.stop()
        if publisher is not None:
            publisher.stop()
    assert node.p.returncode == 0, node.output()
