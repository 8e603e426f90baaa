"""The warm interpreter the launcher respawns nodes from (kaitian_ros.warm_start): its order
line, and a real interpreter becoming a node that refuses bad parameters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kaitian_ros.warm_start import Order


def test_an_order_survives_its_line_and_bad_lines_are_refused() -> None:
    order = Order("kaitian_ros.nodes.compute", ("--ros-args", "-r", "__node:=compute_0"), {"KAITIAN_X": "1"})
    assert Order.from_line(order.to_line()) == order
    for line in ("", "{", '{"module": "os", "argv": [], "env": {}}',
                 '{"module": "kaitian_ros.nodes.compute", "argv": [1], "env": {}}',
                 '{"module": "kaitian_ros.nodes.compute", "argv": [], "env": {"A": 2}}',
                 '{"argv": [], "env": {}}'):
        with pytest.raises(ValueError, match="not an order"):
            Order.from_line(line)


def test_a_warm_interpreter_becomes_the_node_it_is_told_and_exits_with_its_code(tmp_path, router) -> None:
    """A real interpreter: told to become a scheduler with a bad parameter, it runs the node's
    own main, which refuses to start (exit code 2, the reason on its output); told nothing (the
    launcher closed its standard input), it exits 0; told garbage, it says so and exits 2."""
    params = tmp_path / "p.yaml"
    params.write_text("scheduler:\n  ros__parameters:\n    compute_nodes: [a, b]\n    dead_after_s: 0.01\n")
    order = Order("kaitian_ros.nodes.scheduler", ("--ros-args", "-r", "__node:=scheduler", "--params-file",
                                                  str(params)), {"KAITIAN_RUNTIME": "embedded", "KAITIAN_ROUTER": router.endpoint})
    cmd = [sys.executable, "-u", "-m", "kaitian_ros.warm_start"]
    became = subprocess.run(cmd, input=order.to_line(), capture_output=True, text=True, timeout=120)
    assert became.returncode == 2, became.stdout + became.stderr
    assert "dead_after_s" in became.stdout + became.stderr
    unused = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=120)
    assert unused.returncode == 0 and unused.stdout == ""
    garbage = subprocess.run(cmd, input="hello\n", capture_output=True, text=True, timeout=120)
    assert garbage.returncode == 2 and "not an order" in garbage.stderr
