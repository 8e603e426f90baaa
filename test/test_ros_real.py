"""The ROS 2 path on real rclpy (ROS 2 Jazzy from PyPI wheels, built by tools/ros2_from_pypi.sh).

The test process itself runs without ROS; every ROS side runs in a child process in the
environment the script writes (.ros2/env.sh), a node started the way `ros2 launch` starts it.
On a Python the wheels do not exist for, the script says so in one line and these tests are
skipped with that line as the reason.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

# the first test's ros_env fixture may build .ros2/ (wheels, CMake: up to its own 900 s limit):
# more than the suite's default per-test timeout
pytestmark = [pytest.mark.e2e, pytest.mark.ros, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "ros2_from_pypi.sh"
VENV_PYTHON = str(ROOT / ".ros2" / "venv" / "bin" / "python")  # the ROS 2 environment's interpreter


@pytest.fixture(scope="module")
def ros_env() -> dict[str, str]:
    """The environment of .ros2/env.sh (built or brought up to date first), on its own DDS domain."""
    built = subprocess.run(["bash", str(SCRIPT)], capture_output=True, check=False, text=True, timeout=900)
    if built.returncode == 3:
        pytest.skip(built.stderr.strip())
    assert built.returncode == 0, f"tools/ros2_from_pypi.sh failed:\n{built.stdout[-2000:]}\n{built.stderr[-2000:]}"
    dump = subprocess.run(["bash", "-c", f"source {ROOT / '.ros2' / 'env.sh'} && env -0"], capture_output=True,
                          check=True, timeout=30)
    env = dict(item.split("=", 1) for item in dump.stdout.decode().split("\0") if "=" in item)
    env["ROS_DOMAIN_ID"] = str(random.randint(1, 200))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _ros_python(env: dict[str, str], code: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    # not from the repository root: there the source tree's kaitian_ros (no generated msg/)
    # would shadow the installed one on sys.path
    return subprocess.run([VENV_PYTHON, "-c", textwrap.dedent(code)], env=env, capture_output=True, check=False,
                          text=True, timeout=timeout_s, cwd="/")


@contextlib.contextmanager
def _ros_node(env: dict[str, str], module: str, name: str, params: Path) -> Iterator[subprocess.Popen]:
    """A package node on rclpy, started as `ros2 launch` starts it; on leaving, it must still be
    running (a refused parameter or a bad message must not end it) and must not have printed a
    traceback."""
    node = subprocess.Popen([VENV_PYTHON, "-m", module, "--ros-args", "-r",
                             f"__node:={name}", "--params-file", str(params)], env=dict(env, KAITIAN_RUNTIME="ros"),
                            cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield node
        assert node.poll() is None, f"{name} exited"
    finally:
        node.terminate()
        try:
            out, _ = node.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            node.kill()
            out, _ = node.communicate()
    assert "Traceback" not in out, out[-3000:]


def test_module_imports_without_rclpy() -> None:
    """rclpy is imported lazily: importing the adapter module needs no ROS installation."""
    import sys

    code = "import sys, kaitian_ros.runtime.ros; print('rclpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_rclpy_adapter_checks_on_real_rclpy(ros_env: dict[str, str]) -> None:
    """The adapter's own checks (test/ros2/check_runtime_ros.py: bytes on the wire, QoS and
    descriptor mapping, garbage counted, refusal wording equal to the embedded runtime's),
    run by pytest inside the ROS 2 environment."""
    checks = ROOT / "test" / "ros2"
    got = subprocess.run([VENV_PYTHON, "-m", "pytest", "-q", "-c",
                          str(checks / "pytest.ini"), str(checks / "check_runtime_ros.py")],
                         env=ros_env, cwd="/", capture_output=True, check=False, text=True, timeout=300)
    assert got.returncode == 0, got.stdout[-5000:] + got.stderr[-2000:]
    assert " passed" in got.stdout and "skipped" not in got.stdout, got.stdout[-2000:]


def test_wire_equality_between_rclpy_and_the_package_codec(ros_env: dict[str, str]) -> None:
    """A typed rclpy publisher's message decodes with the package's codec to the same values;
    the codec's bytes published raw deserialize in a typed rclpy subscriber."""
    got = _ros_python(ros_env, """
        import time
        import numpy as np
        import rclpy
        from kaitian_ros.msg import FusedOutput
        from kaitian_ros.runtime import interfaces

        rclpy.init()
        node = rclpy.create_node("wire_check")
        raw_in, typed_in = [], []
        node.create_subscription(FusedOutput, "/wire/typed", raw_in.append, 10, raw=True)
        node.create_subscription(FusedOutput, "/wire/raw", typed_in.append, 10)
        typed_pub = node.create_publisher(FusedOutput, "/wire/typed", 10)
        raw_pub = node.create_publisher(FusedOutput, "/wire/raw", 10)
        sent = FusedOutput(request_id=2**40 + 7, plan_version=3, complete=True, status="ok",
                           node_ids=["compute_0", "compute_1"], node_rows=[3, 4], latency_ms=12.5)
        ours = interfaces.make("FusedOutput", request_id=99, plan_version=5, complete=False,
                               status="timeout: missing rows 1-2", node_ids=["a"],
                               node_rows=np.array([7], dtype=np.uint32))
        raw = bytes(interfaces.encode(ours, "FusedOutput"))
        t0 = time.time()
        while time.time() - t0 < 20 and not (raw_in and typed_in):
            typed_pub.publish(sent)
            raw_pub.publish(raw)
            rclpy.spin_once(node, timeout_sec=0.1)
        assert raw_in and typed_in, (len(raw_in), len(typed_in))
        back = interfaces.decode(raw_in[0], "FusedOutput")
        assert (back.request_id, back.plan_version, back.complete, back.status, list(back.node_ids),
                list(back.node_rows), back.latency_ms) == (2**40 + 7, 3, True, "ok", ["compute_0", "compute_1"],
                                                           [3, 4], 12.5), back
        m = typed_in[0]
        assert (m.request_id, m.plan_version, m.complete, m.status, list(m.node_ids), list(m.node_rows)) == \\
            (99, 5, False, "timeout: missing rows 1-2", ["a"], [7]), m
        print("WIRE OK")
        rclpy.shutdown()
    """)
    assert got.returncode == 0 and "WIRE OK" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]


def test_image_source_node_on_rclpy_publishes_sensor_data_images(ros_env: dict[str, str], tmp_path: Path) -> None:
    """The image source started as `ros2 launch` starts it (`--ros-args -r __node:=NAME
    --params-file FILE`) on real rclpy: a plain rclpy subscriber with sensor-data QoS gets
    sensor_msgs/Image frames of the configured size."""
    params = tmp_path / "params.yaml"
    params.write_text("camera:\n  ros__parameters:\n    rate_hz: 10.0\n    width: 96\n    height: 64\n")
    with _ros_node(ros_env, "kaitian_ros.nodes.image_source", "camera", params):
        got = _ros_python(ros_env, """
            import time
            import rclpy
            from rclpy.qos import qos_profile_sensor_data
            from sensor_msgs.msg import Image

            rclpy.init()
            node = rclpy.create_node("image_check")
            frames = []
            node.create_subscription(Image, "/camera/image_raw", frames.append, qos_profile_sensor_data)
            t0 = time.time()
            while time.time() - t0 < 30 and len(frames) < 3:
                rclpy.spin_once(node, timeout_sec=0.1)
            assert len(frames) >= 3, len(frames)
            f = frames[-1]
            assert (f.width, f.height, f.encoding, f.step, len(f.data)) == (96, 64, "rgb8", 96 * 3, 96 * 64 * 3), f
            print("IMAGES OK")
            rclpy.shutdown()
        """)
        assert got.returncode == 0 and "IMAGES OK" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]


def test_parameters_through_rclpy_parameter_services(ros_env: dict[str, str], tmp_path: Path) -> None:
    """What `ros2 param set/get/describe/list` call, on a node running on real rclpy: a valid set
    takes effect, out-of-range / wrong-type / read-only sets are refused with a reason, the
    descriptor carries the range, and the node keeps running."""
    params = tmp_path / "params.yaml"
    params.write_text("camera:\n  ros__parameters:\n    rate_hz: 10.0\n    width: 64\n    height: 48\n")
    with _ros_node(ros_env, "kaitian_ros.nodes.image_source", "camera", params):
        got = _ros_python(ros_env, """
            import time
            import rclpy
            from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
            from rcl_interfaces.srv import DescribeParameters, GetParameters, ListParameters, SetParameters

            rclpy.init()
            node = rclpy.create_node("param_check")

            def call(srv_type, name, request):
                client = node.create_client(srv_type, name)
                assert client.wait_for_service(timeout_sec=30.0), name
                future = client.call_async(request)
                rclpy.spin_until_future_complete(node, future, timeout_sec=30.0)
                assert future.done(), name
                return future.result()

            def set_one(name, value):
                req = SetParameters.Request(parameters=[Parameter(name=name, value=value)])
                return call(SetParameters, "/camera/set_parameters", req).results[0]

            def get(name):
                return call(GetParameters, "/camera/get_parameters", GetParameters.Request(names=[name])).values[0]

            ok = set_one("rate_hz", ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=5.0))
            assert ok.successful, ok.reason
            assert get("rate_hz").double_value == 5.0
            high = set_one("rate_hz", ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=5000.0))
            assert not high.successful and high.reason, high
            typed = set_one("rate_hz", ParameterValue(type=ParameterType.PARAMETER_STRING, string_value="fast"))
            assert not typed.successful and typed.reason, typed
            frozen = set_one("topic", ParameterValue(type=ParameterType.PARAMETER_STRING, string_value="/other"))
            assert not frozen.successful and frozen.reason, frozen
            assert get("rate_hz").double_value == 5.0 and get("topic").string_value == "/camera/image_raw"
            desc = call(DescribeParameters, "/camera/describe_parameters",
                        DescribeParameters.Request(names=["rate_hz", "topic"])).descriptors
            rng = desc[0].floating_point_range[0]
            assert (rng.from_value, rng.to_value) == (0.1, 1000.0) and desc[0].description, desc[0]
            assert desc[1].read_only, desc[1]
            names = call(ListParameters, "/camera/list_parameters", ListParameters.Request()).result.names
            assert {"rate_hz", "width", "height", "topic"} <= set(names), names
            print("PARAMS OK", high.reason, "|", typed.reason, "|", frozen.reason)
            rclpy.shutdown()
        """)
        assert got.returncode == 0 and "PARAMS OK" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]


def test_latched_assignment_and_diagnostics_on_rclpy(ros_env: dict[str, str], tmp_path: Path) -> None:
    """The scheduler on real rclpy, fed typed NodeTelemetry heartbeats: a subscriber created
    after its assignment went out still gets it (latched: transient local), and /diagnostics
    arrives as diagnostic_msgs/DiagnosticArray naming the node."""
    params = tmp_path / "params.yaml"
    params.write_text("scheduler:\n  ros__parameters:\n    compute_nodes: [compute_0]\n    policy: adaptive\n")
    with _ros_node(ros_env, "kaitian_ros.nodes.scheduler", "scheduler", params):
        got = _ros_python(ros_env, """
            import time
            import rclpy
            from diagnostic_msgs.msg import DiagnosticArray
            from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
            from kaitian_ros.msg import LoadAssignment, NodeTelemetry

            rclpy.init()
            node = rclpy.create_node("latch_check")
            diagnostics = []
            node.create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, 10)
            telemetry = node.create_publisher(NodeTelemetry, "/kaitian/telemetry", 10)
            t0 = time.time()
            while time.time() - t0 < 30 and not any("scheduler" in s.name for d in diagnostics for s in d.status
                                                    if s.message.startswith("v")):
                telemetry.publish(NodeTelemetry(node_id="compute_0", request_id=0, device="cpu"))
                rclpy.spin_once(node, timeout_sec=0.1)
            statuses = [s for d in diagnostics for s in d.status if "scheduler" in s.name]
            assert statuses, [s.name for d in diagnostics for s in d.status]
            assert any(s.message.startswith("v") for s in statuses), [s.message for s in statuses]
            # the assignment went out before this subscriber exists
            late = []
            latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                 durability=DurabilityPolicy.TRANSIENT_LOCAL)
            node.create_subscription(LoadAssignment, "/kaitian/assignment", late.append, latched)
            t0 = time.time()
            while time.time() - t0 < 20 and not late:
                rclpy.spin_once(node, timeout_sec=0.1)
            assert late, "a late subscriber got no latched assignment"
            a = late[-1]
            assert a.version >= 1 and list(a.node_ids) == ["compute_0"] and abs(sum(a.shares) - 1.0) < 1e-6, a
            print("LATCH OK", a.version, statuses[-1].message)
            rclpy.shutdown()
        """)
        assert got.returncode == 0 and "LATCH OK" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]


def _ros_params_file(tmp_path: Path, scenario: str, overrides: list[str]) -> tuple[Path, dict, dict]:
    """The scenario's parameter file as `ros2 launch` hands it to nodes (empty lists left out:
    rcl's YAML parser refuses them), its content, and each node's executable."""
    from kaitian_ros.ros_launch import launch_parameters
    from kaitian_ros.scenario import load_scenario

    resolved = load_scenario(scenario, overrides)
    data = {n.name: {"ros__parameters": launch_parameters(n.parameters)} for n in resolved.nodes}
    path = tmp_path / f"{scenario}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data, {n.name: n.executable for n in resolved.nodes}


@pytest.mark.slow
def test_hetero_inference_graph_on_rclpy_equals_the_single_device_result(ros_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """The hetero_inference graph (image source, coordinator, scheduler, two compute nodes),
    every node its own process on real rclpy: a plain rclpy subscriber of /kaitian/fused gets
    complete results equal to the whole model on one device for the frames it saw; a late
    subscriber to the latched /kaitian/plan gets the running plan; garbage published raw on the
    camera topic is dropped and counted by the coordinator (its /diagnostics say so), which
    keeps serving."""
    from kaitian_ros.core.tensors import image_to_array, preprocess, relative_error
    from kaitian_ros.nodes import inference_common as ic

    params, data, executables = _ros_params_file(tmp_path, "hetero_inference", [
        "compute_nodes:=2", "slowdowns:=[1.0,2.0]", "input_height:=64", "input_width:=64"])
    out_dir = tmp_path / "seen"
    out_dir.mkdir()
    with contextlib.ExitStack() as nodes:
        for name, executable in executables.items():
            nodes.enter_context(_ros_node(ros_env, f"kaitian_ros.nodes.{executable}", name, params))
        got = _ros_python(ros_env, f"""
            import json, time
            import numpy as np
            import rclpy
            from diagnostic_msgs.msg import DiagnosticArray
            from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
            from sensor_msgs.msg import Image
            from kaitian_ros.msg import FusedOutput, LoadAssignment

            rclpy.init()
            node = rclpy.create_node("fused_check")
            images, fused, diagnostics = {{}}, [], []
            node.create_subscription(Image, "/camera/image_raw",
                                     lambda m: images.__setitem__((m.header.stamp.sec, m.header.stamp.nanosec), m),
                                     qos_profile_sensor_data)
            node.create_subscription(FusedOutput, "/kaitian/fused", fused.append, 10)
            node.create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, 10)

            def spin_until(done, timeout_s, what):
                t0 = time.time()
                while time.time() - t0 < timeout_s and not done():
                    rclpy.spin_once(node, timeout_sec=0.1)
                assert done(), what

            def matched():
                return [(images[k], f) for f in fused if f.complete
                        and (k := (f.header.stamp.sec, f.header.stamp.nanosec)) in images]

            spin_until(lambda: len(matched()) >= 3, 150, f"3 complete results of seen frames: "
                       f"{{[(f.complete, f.status) for f in fused]}}")
            for i, (image, f) in enumerate(matched()[:3]):
                np.savez("{out_dir}/pair%d.npz" % i, pixels=np.array(image.data, dtype=np.uint8),
                         height=image.height, width=image.width, encoding=image.encoding,
                         result=np.array(f.data, dtype=np.uint8), shape=np.array(f.shape),
                         dtype_code=f.dtype_code, dtype_bits=f.dtype_bits, node_ids=np.array(list(f.node_ids)),
                         node_rows=np.array(list(f.node_rows)), plan_version=f.plan_version, status=f.status)
            # the plan went out before this subscriber exists
            late = []
            node.create_subscription(LoadAssignment, "/kaitian/plan", late.append,
                                     QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                                durability=DurabilityPolicy.TRANSIENT_LOCAL))
            spin_until(lambda: late, 20, "a late subscriber got no latched plan")
            served = max(int(f.plan_version) for f in fused if f.complete)
            assert late[-1].version >= served and late[-1].strategy, (late[-1].version, served)

            # garbage on the camera topic: dropped and counted, the coordinator keeps serving
            garbage = node.create_publisher(Image, "/camera/image_raw", qos_profile_sensor_data)

            def send_garbage():  # best effort, and discovery of a new publisher takes a while: repeat
                for junk in (b"\\x00\\x01\\x00\\x00\\xff\\xff\\xff\\x7f", b"\\x00\\x01\\x00\\x00" + b"\\x07" * 9):
                    garbage.publish(junk)
                return rejected()

            def rejected():
                for d in diagnostics[-20:]:
                    for s in d.status:
                        values = {{v.key: v.value for v in s.values}}
                        if "coordinator" in s.name and int(values.get("rejected", "0")) >= 2:
                            return values
                return None

            spin_until(send_garbage, 30, "the coordinator counted the garbage in /diagnostics")
            reasons = [k for k in rejected() if k.startswith("rejected.malformed")]
            assert reasons, rejected()
            before = len(fused)
            spin_until(lambda: any(f.complete for f in fused[before:]), 60, "a result after the garbage")
            print("GRAPH OK", json.dumps({{"plan": late[-1].version, "strategy": late[-1].strategy,
                                          "reasons": reasons}}))
            rclpy.shutdown()
        """, timeout_s=300.0)
        assert got.returncode == 0 and "GRAPH OK" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]

    # the coordinator's model: its declared defaults, then what the parameter file set
    from kaitian_ros.nodes.model_params import MODEL_PARAMETERS

    declared = {d.name: d.default for d in MODEL_PARAMETERS}
    spec = ic.ModelSpec.from_params(declared | data["coordinator"]["ros__parameters"])
    graph = ic.build_graph(spec)
    c, h, w = spec.input_shape
    for path in sorted(out_dir.glob("pair*.npz")):
        pair = np.load(path)
        assert str(pair["status"]) == "ok"
        height, width = int(pair["height"]), int(pair["width"])
        arr = image_to_array(pair["pixels"], height, width, str(pair["encoding"]), width * 3)
        with torch.no_grad():
            ref = graph.run_head(graph.run_trunk(preprocess(arr, h, w, c, normalise=True)))
        assert (int(pair["dtype_code"]), int(pair["dtype_bits"])) == (2, 32)
        result = torch.from_numpy(pair["result"].view(np.float32).reshape(tuple(pair["shape"])).copy())
        assert relative_error(result, ref) <= 1e-4, path.name
        assert int(pair["node_rows"].sum()) == graph.trunk_output_shape[1]
    assert len(list(out_dir.glob("pair*.npz"))) == 3


def test_trainer_ranks_on_rclpy_publish_training_telemetry(ros_env: dict[str, str], tmp_path: Path) -> None:
    """Two trainer ranks (a real gloo process group) as nodes on real rclpy: a plain rclpy
    subscriber gets kaitian_ros/msg/TrainingTelemetry from both; both ranks finish and exit 0."""
    from helpers import free_port

    common = {"world_size": 2, "master_addr": "127.0.0.1", "master_port": free_port(), "model": "digits_cnn",
              "dataset": "digits", "global_batch": 64, "epochs": 3, "lr": 0.05, "policy": "adaptive",
              "rebalance_every": 3, "timeout_s": 60.0}
    params = tmp_path / "trainers.yaml"
    params.write_text(yaml.safe_dump({f"trainer_{r}": {"ros__parameters": common | {
        "rank": r, "device": f"cpu:{'ab'[r]}", "emulated_slowdown": 1.0 + r}} for r in (0, 1)}))
    listener = subprocess.Popen([VENV_PYTHON, "-c", textwrap.dedent("""
        import time
        import rclpy
        from kaitian_ros.msg import TrainingTelemetry

        rclpy.init()
        node = rclpy.create_node("telemetry_check")
        got = []
        node.create_subscription(TrainingTelemetry, "/kaitian/training/telemetry", got.append, 100)
        print("LISTENING", flush=True)
        t0 = time.time()
        while time.time() - t0 < 120 and not ({m.rank for m in got} == {0, 1} and len(got) >= 6):
            rclpy.spin_once(node, timeout_sec=0.1)
        by_rank = {r: [m for m in got if m.rank == r] for r in (0, 1)}
        assert all(by_rank.values()), {r: len(v) for r, v in by_rank.items()}
        for r, msgs in by_rank.items():
            m = msgs[-1]
            assert m.device == "cpu:" + "ab"[r] and m.global_batch == 64 and 0 < m.local_batch < 64, m
            assert m.emulated == (r == 1) and m.emulated_slowdown == 1.0 + r and m.step_ms > 0, m
        print("TELEMETRY OK", {r: len(v) for r, v in by_rank.items()})
        rclpy.shutdown()
    """)], env=ros_env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainers = []
    try:
        assert listener.stdout.readline().strip() == "LISTENING"
        for rank in (0, 1):
            trainers.append(subprocess.Popen(
                [VENV_PYTHON, "-m", "kaitian_ros.nodes.trainer", "--ros-args", "-r", f"__node:=trainer_{rank}",
                 "--params-file", str(params)], env=dict(ros_env, KAITIAN_RUNTIME="ros"), cwd="/",
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        heard, _ = listener.communicate(timeout=150)
        outs = [t.communicate(timeout=120)[0] for t in trainers]
    finally:
        for p in [listener, *trainers]:
            if p.poll() is None:
                p.kill()
    assert "TELEMETRY OK" in heard, heard[-3000:] + "".join(o[-2000:] for o in outs)
    for t, out in zip(trainers, outs):
        assert t.returncode == 0 and "Traceback" not in out, out[-3000:]


def test_bench_transport_runs_the_rclpy_path_beside_the_embedded_one(ros_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    """`kaitian bench transport --runtime ros` in the ROS 2 environment: one run measures raw
    zenoh, the embedded runtime and the rclpy runtime and writes JSON + PNG (no speed asserted)."""
    out = tmp_path / "transport.json"
    got = subprocess.run([VENV_PYTHON, "-m", "kaitian_ros.cli", "bench",
                          "transport", "--runtime", "ros", "--quick", "--repeats", "1", "--json", str(out)],
                         env=ros_env, cwd="/", capture_output=True, check=False, text=True, timeout=300)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["config"]["runtimes"] == ["embedded", "ros"]
    for mode in ("raw_4mib", "ours_4mib", "raw_256b", "ours_256b", "ros_4mib", "ros_256b"):
        (trial,) = summary["repeats"][mode]
        assert trial["n"] > 1 and trial["msgs_per_s"] > 0, (mode, trial)
    assert "rclpy runtime" in got.stdout and out.with_suffix(".png").stat().st_size > 0
