"""`kaitian launch` and the introspection/parameter CLI against real launched graphs.

Every graph gets its own router port (bound to port 0 first), so parallel runs never cross-talk.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap

import pytest
import yaml
from helpers import (
    Probe,
    Proc,
    child_env,
    free_port,
    pid_running,
    pids_with_env,
    run_cli,
    run_clis,
    wait_until,
)

from kaitian_ros.runtime.api import QoS

pytestmark = pytest.mark.e2e

STARTED = r"\[launch\] started (\S+) \((\S+)\) pid (\d+)"


def start_launch(scenario: str, *overrides: str) -> tuple[Proc, str]:
    endpoint = f"tcp/127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-u", "-m", "kaitian_ros.cli", "--router", endpoint, "launch", scenario, *overrides,
           "--no-view"]
    return Proc(cmd, child_env(endpoint)), endpoint


def started_pids(launch: Proc, count: int) -> dict[str, int]:
    """Pids of the router (a child of the launcher, started first) and of ``count`` nodes."""
    return {m.group(1): int(m.group(3)) for m in launch.wait_for(STARTED, count=count + 1)}


def assert_nothing_left(launch: Proc, endpoint: str, pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        assert not pid_running(pid), f"node {name} (pid {pid}) survived the launcher"
    # any process (node, grandchild, the launcher itself) started for this graph carries its router
    leftovers = pids_with_env("KAITIAN_ROUTER", endpoint)
    assert leftovers == [], f"processes left behind: {leftovers}\n{launch.output()}"


@pytest.fixture(scope="module")
def camera_demo():
    launch, endpoint = start_launch("camera_demo")
    try:
        pids = started_pids(launch, 2)
        launch.wait_for(r"\[monitor\] .*/camera/image_raw: .*frames")  # images are flowing
        probe = Probe(endpoint, "cli_test_probe")
        yield launch, endpoint, pids, probe
        probe.close()
    finally:
        launch.stop()
        launch.wait()


# --- introspection ------------------------------------------------------------------------------

def test_node_list(camera_demo):
    _, endpoint, _, _ = camera_demo
    result = run_cli("node", "list", router=endpoint)
    assert result.returncode == 0, result.stderr
    # /launch: the launcher's own node (its /diagnostics on supervision)
    assert result.stdout.split() == ["/cli_test_probe", "/image_source", "/launch", "/monitor"]


def test_topic_list_with_types(camera_demo):
    _, endpoint, _, _ = camera_demo
    result = run_cli("topic", "list", "-t", router=endpoint)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "/camera/image_raw [sensor_msgs/msg/Image]" in lines
    assert "/diagnostics [diagnostic_msgs/msg/DiagnosticArray]" in lines


def test_topic_echo_once(camera_demo):
    _, endpoint, _, _ = camera_demo
    result = run_cli("topic", "echo", "/camera/image_raw", "--once", "--timeout", "15", router=endpoint)
    assert result.returncode == 0, result.stderr
    docs = result.stdout.split("\n---")
    assert len(docs) == 2 and docs[1].strip() == "", "--once prints exactly one message"
    msg = yaml.safe_load(docs[0])
    assert (msg["width"], msg["height"], msg["encoding"], msg["step"]) == (224, 224, "rgb8", 672)
    assert msg["header"]["frame_id"] == "camera"
    assert msg["data"] == "<array type: uint8, length: 150528>"


def test_topic_hz_with_timeout(camera_demo):
    _, endpoint, _, _ = camera_demo
    result = run_cli("topic", "hz", "/camera/image_raw", "--timeout", "2.0", router=endpoint)
    assert result.returncode == 0, result.stderr
    rates = [float(line.split(":")[1]) for line in result.stdout.splitlines() if line.startswith("average rate:")]
    assert rates and all(r > 0 for r in rates), result.stdout


def test_param_list_get(camera_demo):
    _, endpoint, _, _ = camera_demo
    listed = run_cli("param", "list", "image_source", router=endpoint)
    assert listed.returncode == 0, listed.stderr
    names = [line.strip() for line in listed.stdout.splitlines()[1:]]
    assert {"rate_hz", "width", "height", "source", "topic", "frame_id"} <= set(names)
    got = run_cli("param", "get", "/image_source", "rate_hz", router=endpoint)
    assert got.stdout.strip() == "Double value is: 10.0"


# --- parameters on a running node ---------------------------------------------------------------

def _images(probe: Probe):
    return probe.collect("/camera/image_raw", "Image", QoS.BEST_EFFORT)


REFUSALS = [
    ("rate_hz", "5000.0", r"out of range \[0.1, 1000.0\]"),
    ("width", "4", "out of range"),
    ("topic", "/elsewhere", "read-only"),
    ("no_such_param", "1", "not declared"),
    ("rate_hz", "fast", "expects double"),
    ("source", "/" + "a" * 300, "File name too long"),       # the OS refuses the path: a reason, no crash
    ("source", "/" + "a" * 5000, "at most 4096"),
    ("source", "/no_such_dir/no_such_clip.mp4", "neither 'synthetic', a file, nor a folder"),
]


def test_param_set_refused_with_reason_and_node_keeps_running(camera_demo):
    launch, endpoint, pids, probe = camera_demo
    for name, value, reason in REFUSALS:
        result = run_cli("param", "set", "image_source", name, value, router=endpoint)
        assert result.returncode != 0, (name, value)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Setting parameter failed: "), result.stderr
        assert re.search(reason, lines[0]), lines[0]
    # nothing changed, and the node is still up and publishing
    dumped = yaml.safe_load(run_cli("param", "dump", "image_source", router=endpoint).stdout)
    values = dumped["/image_source"]["ros__parameters"]
    assert (values["rate_hz"], values["width"], values["topic"]) == (10.0, 224, "/camera/image_raw")
    assert "no_such_param" not in values
    images = _images(probe)
    wait_until(lambda: len(images) >= 2, "images after the refused sets")
    assert all(m.width == 224 for m in images.snapshot())
    assert pid_running(pids["image_source"]) and launch.alive()


def test_param_set_in_range_takes_effect(camera_demo):
    """Runs last among the camera_demo tests: it leaves the camera at 32 px wide."""
    launch, endpoint, _, probe = camera_demo
    images = _images(probe)
    for name, value in (("width", "32"), ("frame_id", "relabelled"), ("rate_hz", "20.0")):
        result = run_cli("param", "set", "image_source", name, value, router=endpoint)
        assert (result.returncode, result.stdout.strip()) == (0, "Set parameter successful"), result.stderr
    # the node publishes what the new values say
    wait_until(lambda: any(m.width == 32 and m.header.frame_id == "relabelled" and len(m.data) == 32 * 224 * 3
                           for m in images.snapshot()), "a 32-pixel-wide 'relabelled' image")
    dumped = yaml.safe_load(run_cli("param", "dump", "image_source", router=endpoint).stdout)
    values = dumped["/image_source"]["ros__parameters"]
    assert (values["rate_hz"], values["width"], values["frame_id"]) == (20.0, 32, "relabelled")
    assert launch.alive()


# --- launcher lifecycle -----------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_launch_interrupted_leaves_no_process(sig):
    launch, endpoint = start_launch("camera_demo")
    try:
        pids = started_pids(launch, 2)
        assert set(pids) == {"router", "image_source", "monitor"}
        launch.wait_for(r"\[monitor\] .*frames")
        assert all(pid_running(p) for p in pids.values())
        launch.p.send_signal(sig)
        code = launch.wait()
    finally:
        launch.stop()
    assert code == 0, launch.output()
    assert f"{sig.name} received" in launch.output()
    assert_nothing_left(launch, endpoint, pids)


def test_stopped_in_its_first_seconds_the_graph_prints_no_traceback():
    """Ctrl-C right after every node started (they are still importing torch): no node prints a
    KeyboardInterrupt traceback, and nothing is left behind."""
    # a smaller input than the file's 224x224: what is checked is the stop, not the model
    launch, endpoint = start_launch("hetero_inference", "compute_nodes:=2", "input_height:=64", "input_width:=64")
    try:
        pids = started_pids(launch, 5)
        launch.p.send_signal(signal.SIGINT)
        code = launch.wait()
    finally:
        launch.stop()
    assert code == 0, launch.output()
    assert "Traceback" not in launch.output(), launch.output()
    assert_nothing_left(launch, endpoint, pids)


def test_stopped_while_the_fork_server_prepares_the_graph_starts_no_node():
    """Ctrl-C while the fork server builds the compute nodes' model (right after the router is
    up): the launch ends at once, with no node started and nothing left."""
    launch, endpoint = start_launch("hetero_inference", "input_height:=64", "input_width:=64")
    try:
        pids = started_pids(launch, 0)  # the router
        launch.p.send_signal(signal.SIGINT)
        code = launch.wait()
    finally:
        launch.stop()
    assert code == 0, launch.output()
    assert "[launch] started router" in launch.output()
    assert "[launch] started image_source" not in launch.output(), launch.output()
    assert_nothing_left(launch, endpoint, pids)


def test_node_killed_while_running_makes_launch_fail_naming_it():
    launch, endpoint = start_launch("camera_demo")
    try:
        pids = started_pids(launch, 2)
        launch.wait_for(r"\[monitor\] .*frames")

        os.kill(pids["image_source"], signal.SIGKILL)  # a real crash: no cleanup, no exit code of its own
        code = launch.wait()
    finally:
        launch.stop()
    assert code != 0
    assert "node 'image_source' died unexpectedly (exit code -9; no respawn)" in launch.output()
    assert_nothing_left(launch, endpoint, pids)


def test_respawned_node_comes_back_is_reported_and_the_cap_holds():
    """image_source with respawn (launch arguments): killed with SIGKILL it is restarted after
    its delay, frames flow again, the launcher's /diagnostics (node /launch) count the restart;
    past respawn_max_retries the next death stops the graph naming it."""
    launch, endpoint = start_launch("camera_demo", "image_source.respawn:=true", "image_source.respawn_delay:=0.2",
                                    "image_source.respawn_max_retries:=1")
    probe = None
    try:
        pids = started_pids(launch, 2)
        launch.wait_for(r"\[monitor\] .*frames")
        probe = Probe(endpoint, "respawn_probe")
        diagnostics = probe.collect("/diagnostics", "DiagnosticArray")
        frames = probe.collect("/camera/image_raw", "Image", QoS.BEST_EFFORT)
        os.kill(pids["image_source"], signal.SIGKILL)
        launch.wait_for(r"node 'image_source' exited \(exit code -9\); respawning in 0.2 s \(restart 1 of 1\)")
        # started 1 s after the graph, the warm interpreter (torch and the middleware imported)
        # becomes the respawned node
        launch.wait_for(r"\[launch\] image_source respawns from the warm interpreter")
        (again,) = launch.wait_for(r"\[launch\] started image_source \(image_source\) pid (\d+)", count=2)[1:]
        respawned = int(again.group(1))
        assert respawned != pids["image_source"] and pid_running(respawned)
        before = len(frames)
        wait_until(lambda: len(frames) > before + 2, "frames from the respawned image_source")

        def launch_status():
            for array in diagnostics.snapshot():
                for st in array.status:
                    values = {kv.key: kv.value for kv in st.values}
                    if st.name == "kaitian: launch" and values.get("image_source.restarts") == "1":
                        return st
            return None

        status = wait_until(launch_status, "/launch diagnostics counting the restart")
        assert status.level in (1, 2) and "image_source" in status.message  # WARN (or ERROR while down)
        os.kill(respawned, signal.SIGKILL)
        code = launch.wait()
    finally:
        if probe is not None:
            probe.close()
        launch.stop()
    assert code != 0
    assert "node 'image_source' died unexpectedly (exit code -9; respawned 1 times already" in launch.output()
    assert_nothing_left(launch, endpoint, pids | {"image_source_again": respawned})


@pytest.mark.parametrize("bad", [
    {"source": "/nonexistent/clip.mp4"},  # the node's constructor raises: cannot open its source
    {"rate_hz": 5000.0},                  # invalid initial parameter value: refused at declare time
], ids=["bogus_source", "out_of_range_parameter"])
def test_node_that_crashes_at_start_makes_launch_exit_nonzero_naming_it(tmp_path, bad):
    scenario = tmp_path / "broken.yaml"
    scenario.write_text(textwrap.dedent("""\
        watcher:
          ros__parameters:
            executable: monitor
            input_topic: /camera/image_raw
        broken_camera:
          ros__parameters:
            executable: image_source
        """))
    data = yaml.safe_load(scenario.read_text())
    data["broken_camera"]["ros__parameters"].update(bad)
    scenario.write_text(yaml.safe_dump(data))
    launch, endpoint = start_launch(str(scenario))
    try:
        pids = started_pids(launch, 2)
        code = launch.wait()
    finally:
        launch.stop()
    assert code != 0
    out = launch.output()
    assert "node 'broken_camera' refused to start (exit code 2" in out, out
    assert "[broken_camera]" in out and "refusing to start" in out, out
    assert "node 'watcher' died" not in out
    assert_nothing_left(launch, endpoint, pids)


# --- user errors: one line on stderr, non-zero, no traceback --------------------------------------

def _one_line_error(result) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unknown_subcommand():
    assert "invalid choice: 'frobnicate'" in _one_line_error(run_cli("frobnicate"))


def test_bad_scenario_name():
    line = _one_line_error(run_cli("launch", "no_such_scenario"))
    assert "unknown scenario 'no_such_scenario'" in line and "camera_demo" in line


def test_bad_launch_argument():
    assert "no_such_parameter" in _one_line_error(run_cli("launch", "camera_demo", "no_such_parameter:=1"))


def test_unknown_model_or_device_fails_before_any_node_starts():
    model, device = run_clis(("launch", "robot_edge", "model:=nosuchnet", "--no-view"),
                             ("launch", "robot_edge", "compute_1.device:=nosuchdevice:0", "--no-view"))
    line = _one_line_error(model)
    assert "unknown model 'nosuchnet'" in line and "resnet18" in line and "compute_1" in line
    assert "[launch] started" not in line
    line = _one_line_error(device)
    assert "nosuchdevice:0" in line and "compute_1" in line


def test_labels_or_weights_that_do_not_fit_the_model_fail_before_any_node_starts(tmp_path):
    """robot_edge's model has 1000 classes: 9 names, a weights file of another model, a missing
    weights file - each one line naming the problem and the nodes, nothing started."""
    import torch

    from kaitian_ros.core.models import build_model

    nine = tmp_path / "nine.txt"
    nine.write_text("\n".join(f"c{i}" for i in range(9)) + "\n")
    other = tmp_path / "digits.pt"
    torch.save(build_model("digits_cnn").state_dict(), other)
    labels, weights, missing = run_clis(("launch", "robot_edge", f"labels_file:={nine}", "--no-view"),
                                        ("launch", "robot_edge", f"weights:={other}", "--no-view"),
                                        ("launch", "robot_edge", f"weights:={tmp_path / 'none.pt'}", "--no-view"))
    line = _one_line_error(labels)
    assert "has 9 names, the model has num_classes 1000" in line and "coordinator" in line
    assert "[launch] started" not in line
    line = _one_line_error(weights)
    assert f"weights '{other}' do not load into model 'resnet18'" in line and "compute_1" in line
    line = _one_line_error(missing)
    assert "does not exist" in line


def test_bench_inference_mistakes_are_one_line():
    unknown, matrix, scenario = run_clis(("bench", "inference", "--model", "nosuchnet"),
                                         ("bench", "inference", "--matrix", "--model", "vgg11"),
                                         ("bench", "inference", "--scenario", "nope"))
    line = _one_line_error(unknown)
    assert "unknown model 'nosuchnet'" in line
    assert "--model" in _one_line_error(matrix)
    assert "invalid choice: 'nope'" in _one_line_error(scenario)


def test_bench_transport_on_rclpy_without_ros_is_one_line():
    """The test process has no ROS environment (the rclpy run itself is in test_ros_real.py)."""
    line = _one_line_error(run_cli("bench", "transport", "--runtime", "ros", "--quick"))
    assert "rclpy" in line and "ros2_from_pypi.sh" in line


def test_train_and_bench_help_show_their_own_options():
    train, bench, transport = run_clis(("train", "--help"), ("bench", "training", "--help"),
                                       ("bench", "transport", "--help"))
    assert train.returncode == 0 and "--ranks" in train.stdout and "--global-batch" in train.stdout, train.stdout
    assert bench.returncode == 0 and "--quick" in bench.stdout and "--json" in bench.stdout, bench.stdout
    assert transport.returncode == 0 and "--runtime" in transport.stdout


def test_binary_scenario_file_is_one_line(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01 not text")
    line = _one_line_error(run_cli("launch", str(path)))
    assert "not a text file" in line and "binary.yaml" in line


def test_param_get_on_missing_node(router):
    line = _one_line_error(run_cli("param", "get", "/ghost", "rate_hz", router=router.endpoint))
    assert "node '/ghost' not found" in line


def test_topic_echo_unknown_topic(router):
    assert "topic '/nowhere' not found" in _one_line_error(
        run_cli("topic", "echo", "/nowhere", "--once", router=router.endpoint))
