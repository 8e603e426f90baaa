"""The warm interpreter the launcher respawns nodes from (kaitian_ros.warm_start): its order
line, and a real interpreter becoming a node that refuses bad parameters."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

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


@pytest.mark.e2e
def test_a_warm_interpreter_becomes_the_node_it_is_told_and_exits_with_its_code(tmp_path, router) -> None:
    """A real interpreter: told to become a scheduler with a bad parameter, it runs the node's
    own main, which refuses to start (exit code 2, the reason on its output); told nothing (the
    launcher closed its standard input), it exits 0; told garbage, it says so and exits 2."""
    params = tmp_path / "p.yaml"
    params.write_text("scheduler:\n  ros__parameters:\n    compute_nodes: [a, b]\n    dead_after_s: 0.01\n")
    order = Order("kaitian_ros.nodes.scheduler",
                  ("--ros-args", "-r", "__node:=scheduler", "--params-file", str(params)),
                  {"KAITIAN_RUNTIME": "embedded", "KAITIAN_ROUTER": router.endpoint})
    cmd = [sys.executable, "-u", "-m", "kaitian_ros.warm_start"]
    became = subprocess.run(cmd, input=order.to_line(), capture_output=True, check=False, text=True, timeout=120)
    assert became.returncode == 2, became.stdout + became.stderr
    assert "dead_after_s" in became.stdout + became.stderr
    unused = subprocess.run(cmd, input="", capture_output=True, check=False, text=True, timeout=120)
    assert unused.returncode == 0 and unused.stdout == ""
    garbage = subprocess.run(cmd, input="hello\n", capture_output=True, check=False, text=True, timeout=120)
    assert garbage.returncode == 2 and "not an order" in garbage.stderr


def test_prepared_costs_are_the_measured_ones_scaled_and_a_bad_preparation_is_refused() -> None:
    """`compute_prepare.prepare` resolves a compute node's parameters as the node does, builds its
    model and measures its costs at slowdown 1; a node's costs at slowdown s are those scaled."""
    from kaitian_ros.nodes import compute_prepare
    from kaitian_ros.warm_start import parse_prepare

    argv = ["--ros-args", "-r", "__node:=compute_7", "-p", "model:=digits_cnn", "-p", "input_height:=32",
            "-p", "input_width:=32", "-p", "input_channels:=1", "-p", "profile_budget_s:=0.5"]
    compute_prepare.drop_prepared()
    try:
        built = compute_prepare.prepare(argv)
        assert built.outcome == "built" and "built, costs measured" in built.text, built
        assert compute_prepare.prepare(argv + ["-p", "emulated_slowdown:=3.0"]).outcome == "already"  # speed: scaled
        (prepared,) = compute_prepare.PREPARED.values()
        slow = prepared.costs.scaled(3.0)
        assert slow.trunk_ms == pytest.approx(3 * prepared.costs.trunk_ms)
        assert slow.probe_base_ms == pytest.approx(3 * prepared.costs.probe_base_ms)
        assert [c.row_ms for c in slow.op_costs] == pytest.approx([3 * c.row_ms for c in prepared.costs.op_costs])
        assert slow.probe_ops == prepared.costs.probe_ops
        # the node would refuse it
        refused = compute_prepare.prepare(argv + ["-p", "threads:=0"])
        assert refused.outcome == "refused" and refused.text.startswith("not prepared"), refused
    finally:
        compute_prepare.drop_prepared()
    assert parse_prepare('[["--ros-args"]]') == [["--ros-args"]]
    for bad in ("{", '{"a": 1}', "[[1]]"):
        with pytest.raises(ValueError, match="prepare-compute"):
            parse_prepare(bad)


@pytest.mark.e2e
def test_a_compute_node_respawned_from_a_warm_interpreter_takes_the_model_and_costs_it_prepared(
        tmp_path, router) -> None:
    params = tmp_path / "p.yaml"
    params.write_text("compute_0:\n  ros__parameters:\n    model: digits_cnn\n    input_height: 32\n"
                      "    input_width: 32\n    input_channels: 1\n    emulated_slowdown: 2.0\n"
                      "    profile_budget_s: 0.5\n")
    argv = ("--ros-args", "-r", "__node:=compute_0", "--params-file", str(params))
    order = Order("kaitian_ros.nodes.compute", argv, {"KAITIAN_RUNTIME": "embedded", "KAITIAN_ROUTER": router.endpoint})
    proc = subprocess.Popen([sys.executable, "-u", "-m", "kaitian_ros.warm_start", "--prepare-compute",
                             json.dumps([list(argv)])], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    watchdog = threading.Timer(120.0, proc.kill)  # a line that never comes ends the reads below
    watchdog.start()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for line in proc.stdout:  # the preparation is reported before the order is written
            lines.append(line)
            if "built, costs measured" in line:
                break
        proc.stdin.write(order.to_line())
        proc.stdin.close()
        for line in proc.stdout:
            lines.append(line)
            if "slowdown 2.0" in line:  # the node's start-up done
                break
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "compute_0"  # in ps: the node it became
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=30)
    text = "".join(lines)
    assert "costs measured by the warm interpreter before this respawn" in text, text
    assert "(EMULATED)" in text


def test_the_launchers_warm_interpreter_prepares_for_the_compute_nodes_it_may_become() -> None:
    from kaitian_ros.launcher import Launcher
    from kaitian_ros.scenario import load_scenario

    launcher = Launcher(load_scenario("hetero_inference"), "tcp/127.0.0.1:1",
                        node_prefix={"compute_2": ["ip", "netns", "exec", "x"]})
    args = launcher._warm_args()
    assert args[0] == "--prepare-compute"
    names = [next(a.split(":=")[1] for a in argv if a.startswith("__node:=")) for argv in json.loads(args[1])]
    assert names == ["compute_0", "compute_1"]  # compute_2 has the interpreter under its prefix
    assert all(str(launcher.params_file) in argv for argv in json.loads(args[1]))
    assert sorted(launcher.warm_slots) == [(), ("ip", "netns", "exec", "x")]
    inside = launcher._warm_args(("ip", "netns", "exec", "x"))
    assert [next(a.split(":=")[1] for a in argv if a.startswith("__node:=")) for argv in json.loads(inside[1])] \
        == ["compute_2"]
    off = Launcher(load_scenario("hetero_inference", ["respawn:=false"]), "tcp/127.0.0.1:1")
    assert off._warm_args() == []


def test_a_preparation_crosses_the_fork_servers_socket_as_it_was_and_garbage_is_refused() -> None:
    from kaitian_ros.nodes.preparation import Preparation

    for outcome in ("built", "already", "refused"):
        p = Preparation(outcome, f"digits_cnn on cpu: {outcome}")
        assert Preparation.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert [Preparation(o, "").news for o in ("built", "already", "refused")] == [True, False, True]
    for bad in ({}, {"outcome": "done", "text": "x"}, {"outcome": "built", "text": 3}):
        with pytest.raises(ValueError, match="not a preparation"):
            Preparation.from_dict(bad)
