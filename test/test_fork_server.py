"""The fork server the launcher forks its nodes from (kaitian_ros.fork_server): orders, exit
codes as Popen reports them, output, process names, and no child left behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import pid_running, wait_until

from kaitian_ros.fork_server import WARM, ForkOrder, ForkServer
from kaitian_ros.warm_start import Order


def test_an_order_round_trips_and_a_foreign_module_is_refused():
    order = ForkOrder("kaitian_ros.nodes.scheduler", ("--ros-args",), {"A": "1"}, "/", "scheduler")
    assert ForkOrder.from_bytes(order.to_bytes()) == order
    with pytest.raises(ValueError, match="kaitian_ros node"):
        ForkOrder.from_bytes(ForkOrder("os", (), {}, "/", "x").to_bytes())
    with pytest.raises(ValueError, match="not an order"):
        ForkOrder.from_bytes(b"{")
    warm = ForkOrder(WARM, (), {}, "/", "warm")  # the warm interpreter, the one other module allowed
    assert ForkOrder.from_bytes(warm.to_bytes()) == warm


@pytest.mark.e2e
def test_forked_nodes_report_output_exit_codes_and_names_and_die_with_the_server(router):
    env = dict(os.environ, KAITIAN_RUNTIME="embedded", KAITIAN_ROUTER=router.endpoint, PYTHONUNBUFFERED="1")
    server = ForkServer.start(env)
    assert server is not None
    try:
        # bad parameters: the node's one-line refusal comes through its own pipe, exit code 2
        bad = server.fork("kaitian_ros.nodes.scheduler",
                          ["--ros-args", "-r", "__node:=sched_bad", "-p", "ewma_alpha:=7.0"], env, "sched_bad")
        assert bad is not None and bad.wait(timeout=60) == 2
        assert bad.stdout is not None and "ewma_alpha" in bad.stdout.read()
        # a node that runs: its process name is its node name, SIGKILL is reported as Popen does
        live = server.fork("kaitian_ros.nodes.scheduler", ["--ros-args", "-r", "__node:=sched_live"], env,
                           "sched_live")
        assert live is not None and live.poll() is None
        wait_until(lambda: Path(f"/proc/{live.pid}/comm").read_text().strip() == "sched_live",
                   "the forked node named after itself")
        assert os.getpgid(live.pid) == live.pid  # its own process group, as a launched node
        live.kill()
        assert live.wait(timeout=10) == -signal.SIGKILL
        # a node still running when the server ends gets SIGTERM from the kernel
        orphan = server.fork("kaitian_ros.nodes.scheduler", ["--ros-args", "-r", "__node:=sched_orphan"],
                             env, "sched_orphan")
        assert orphan is not None
        # a warm interpreter: it reads the node to become on its input, here one that refuses
        warm = server.fork(WARM, [], env, "warm")
        assert warm is not None and warm.stdin is not None and warm.poll() is None
        warm.stdin.write(Order("kaitian_ros.nodes.scheduler", ("--ros-args", "-r", "__node:=sched_warm", "-p",
                                                             "ewma_alpha:=7.0"), {}).to_line())
        warm.stdin.close()
        assert warm.wait(timeout=60) == 2
        assert warm.stdout is not None and "ewma_alpha" in warm.stdout.read()
    finally:
        server.close()
    wait_until(lambda: not pid_running(orphan.pid), "the orphaned node ended", 15.0)
    assert orphan.poll() is not None
    assert server.fork("kaitian_ros.nodes.scheduler", [], env, "late") is None  # a closed server forks nothing


@pytest.mark.e2e
def test_a_server_that_cannot_start_is_none():
    broken = dict(os.environ, PYTHONHOME="/nonexistent")  # the interpreter cannot even start
    assert ForkServer.start(broken, timeout_s=30.0) is None


LAUNCH_CHECKS = """
import json, os, sys
from kaitian_ros.fork_server import ForkServer
from kaitian_ros.preflight import forked_preflight
from kaitian_ros.scenario import load_scenario
env = dict(os.environ, KAITIAN_RUNTIME="embedded")
server = ForkServer.start(env)
try:
    bad = forked_preflight(load_scenario("hetero_inference", [("model", "nope")]), server, env)
    # weights:= is in no node's file: the launcher finds the nodes that declare it (no torch either)
    good = forked_preflight(load_scenario("hetero_inference", [("weights", "")]), server, env)
finally:
    server.close()
print(json.dumps({"bad": bad, "good": good, "torch": "torch" in sys.modules}))
"""


@pytest.mark.e2e
def test_the_launch_checks_run_in_a_fork_and_the_launcher_never_imports_torch():
    """`kaitian launch`'s checks (preflight) in a fork of the fork server: the answer of the
    in-process checks, and the launching process has not imported torch - also not to find
    which nodes declare a parameter given on the command line."""
    import json
    import subprocess
    import sys

    from kaitian_ros.preflight import preflight
    from kaitian_ros.scenario import load_scenario

    out = subprocess.run([sys.executable, "-c", LAUNCH_CHECKS], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bad"] == preflight(load_scenario("hetero_inference", [("model", "nope")])) != ""
    assert "unknown model 'nope'" in got["bad"] and got["good"] == "" and got["torch"] is False


def _loaded_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.e2e
def test_the_server_imports_what_the_scenarios_nodes_import_and_torch_only_for_them(router):
    """A camera and a monitor need no torch: their server does not load it, and forks them all
    the same; a server for compute nodes has torch (and the compute module) loaded before the
    first fork."""
    from kaitian_ros.fork_server import preload_modules

    camera = preload_modules(["image_source", "monitor", "image_source"])
    assert "torch" not in camera and camera.count("kaitian_ros.nodes.image_source") == 1
    assert "kaitian_ros.nodes.compute" in preload_modules(["compute"])
    assert "torch" in preload_modules(["trainer"])  # a trainer imports it only once it builds its model
    env = dict(os.environ, KAITIAN_RUNTIME="embedded", KAITIAN_ROUTER=router.endpoint, PYTHONUNBUFFERED="1")
    light, heavy = ForkServer.start(env, camera), ForkServer.start(env, preload_modules(["compute"]))
    assert light is not None and heavy is not None
    try:
        assert not _loaded_torch(light.process.pid) and _loaded_torch(heavy.process.pid)
        monitor = light.fork("kaitian_ros.nodes.monitor", ["--ros-args", "-r", "__node:=mon"], env, "mon")
        assert monitor is not None
        wait_until(lambda: Path(f"/proc/{monitor.pid}/comm").read_text().strip() == "mon", "the monitor forked")
        monitor.send_signal(signal.SIGINT)
        assert monitor.wait(timeout=30) == 0
        assert monitor.stdout is not None and "Traceback" not in monitor.stdout.read()
    finally:
        light.close()
        heavy.close()


def _lines_until(child, text: str, timeout_s: float = 60.0) -> str:
    """`child`'s output up to the first line containing `text` (the child is killed after
    `timeout_s`, which ends the read)."""
    import threading

    timer = threading.Timer(timeout_s, child.kill)
    timer.start()
    seen = []
    try:
        for line in child.stdout:
            seen.append(line)
            if text in line:
                return "".join(seen)
    finally:
        timer.cancel()
    raise AssertionError(f"no line with {text!r} in:\n{''.join(seen)}")


@pytest.mark.e2e
def test_nodes_forked_after_a_preparation_take_its_model_and_costs(router):
    """The server prepares a compute node's model and start-up costs once; compute nodes forked
    after it (at another emulated speed too) take them, and so does a coordinator of the same
    model (its graph). A repeat is answered at once; what a node would refuse, and a device the
    server must not initialise, are not prepared."""
    from kaitian_ros.fork_server import preload_modules

    env = dict(os.environ, KAITIAN_RUNTIME="embedded", KAITIAN_ROUTER=router.endpoint, PYTHONUNBUFFERED="1")
    model = ["-p", "model:=digits_cnn", "-p", "input_height:=32", "-p", "input_width:=32", "-p", "num_classes:=10"]
    server = ForkServer.start(env, preload_modules(["compute", "coordinator"]))
    assert server is not None
    try:
        done = server.prepare(["--ros-args", "-r", "__node:=compute_0", *model], 120.0)
        assert done.outcome == "built" and done.news, done
        assert "digits_cnn (3, 32, 32) on cpu: built, costs measured" in done.text, done
        again = server.prepare(["--ros-args", "-r", "__node:=compute_1", *model, "-p", "emulated_slowdown:=2.0"], 60.0)
        assert again.outcome == "already" and not again.news, again  # name and speed are not part of it
        bad = server.prepare(["--ros-args", *model, "-p", "threads:=0"], 60.0)
        assert bad.outcome == "refused" and bad.news and bad.text.startswith("not prepared"), bad
        gpu = server.prepare(["--ros-args", *model, "-p", "device:=cuda:0"], 60.0)
        assert gpu.outcome == "refused" and "not a CPU" in gpu.text, gpu
        slow = server.fork("kaitian_ros.nodes.compute",
                           ["--ros-args", "-r", "__node:=compute_1", *model, "-p", "emulated_slowdown:=2.0"], env,
                           "compute_1")
        assert slow is not None
        out = _lines_until(slow, "costs measured")
        assert "costs measured by the fork server before this node started" in out and "(EMULATED)" in out, out
        coordinator = server.fork("kaitian_ros.nodes.coordinator",
                                  ["--ros-args", "-r", "__node:=coordinator", *model, "-p",
                                   "compute_nodes:=[compute_1]", "-p", "static_shares:=[1.0]"], env, "coordinator")
        assert coordinator is not None
        assert "(model built by the fork server)" in _lines_until(coordinator, "-> trunk")
        for child in (slow, coordinator):
            child.send_signal(signal.SIGINT)
            assert child.wait(timeout=30) == 0
    finally:
        server.close()
