"""The rclpy adapter (kaitian_ros/runtime/ros.py) on real rclpy (ROS 2 Jazzy from PyPI).

Runs inside the ROS 2 environment, started by test/test_ros_real.py. What it checks:

- a publish puts exactly the bytes of ``interfaces.encode`` on the wire (raw CDR),
- a raw subscription decodes with ``interfaces.decode``; garbage is dropped and counted,
- QoS profiles and parameter descriptors (ranges, read_only) are mapped as documented,
- parameter refusals carry the embedded runtime's reasons (a real EmbeddedRuntime on a router),
  also for a set that comes from outside (what ``ros2 param set`` does),
- node callbacks that raise are logged, the executor keeps going; spin ends at shutdown.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import rclpy
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, ReliabilityPolicy, qos_profile_sensor_data

from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, SetParametersResult
from kaitian_ros.runtime.ros import RosRuntime, message_class

PARAMS = (
    P("emulated_slowdown", T.DOUBLE, 1.0, "sleep (s-1)x compute", 1.0, 100.0),
    P("slab_rows", T.INTEGER, 8, "rows per slab", 1, 4096),
    P("min_gain", T.DOUBLE, 0.05, "one-sided", 0.0, None),
    P("device", T.STRING, "cpu", "torch device", read_only=True),
    P("policy", T.STRING, "adaptive", "share policy", choices=("adaptive", "static", "equal")),
    P("static_shares", T.DOUBLE_ARRAY, [], "shares", 0.0, 1.0),
    P("verbose", T.BOOL, False, "log more"),
)


def refuse_odd_slab(values: dict[str, Any]) -> SetParametersResult:
    if values.get("slab_rows", 2) % 2:
        return SetParametersResult(False, "slab_rows must be even")
    return SetParametersResult(True, "")


@pytest.fixture
def runtime() -> Any:
    rt = RosRuntime("adapter_check", [])
    yield rt
    rt.close()


def spin_until(rt: RosRuntime, done: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        rt.spin_once(0.05)


def test_node_name_from_ros_args_and_close_releases_rclpy() -> None:
    rt = RosRuntime("compute", ["--ros-args", "-r", "__node:=compute_7"])
    assert rt.node_name == "compute_7" and rt.fqn == "/compute_7" and rclpy.ok()
    rt.close()
    rt.close()  # idempotent
    assert not rclpy.ok()


def test_publish_puts_exactly_the_encoded_bytes_on_the_wire(runtime: RosRuntime) -> None:
    msg = interfaces.make("TensorChunk", request_id=7, **interfaces.tensor_fields(
        np.arange(24, dtype=np.float32).reshape(2, 3, 4)))
    wire: list[bytes] = []
    runtime.node.create_subscription(message_class("TensorChunk"), "/check/chunks", wire.append, 10, raw=True)
    pub = runtime.create_publisher("/check/chunks", "TensorChunk")
    expected = bytes(interfaces.encode(msg, "TensorChunk"))
    spin_until(runtime, lambda: (pub.publish(msg), wire)[1], "the published chunk")
    assert wire[0] == expected
    pub.publish_raw(memoryview(expected))  # any buffer is handed to rclpy as bytes
    count = len(wire)
    spin_until(runtime, lambda: len(wire) > count, "the raw publish")
    assert wire[-1] == expected
    image = runtime.create_publisher("/camera/image_raw", "Image", QoS.BEST_EFFORT)
    assert image.msg_type == "sensor_msgs/msg/Image"


def test_qos_mapping(runtime: RosRuntime) -> None:
    reliable = runtime.qos_profile(QoS.RELIABLE)
    assert (reliable.reliability, reliable.depth, reliable.durability, reliable.history) == (
        ReliabilityPolicy.RELIABLE, 10, DurabilityPolicy.VOLATILE, HistoryPolicy.KEEP_LAST)
    assert runtime.qos_profile(QoS.BEST_EFFORT) == qos_profile_sensor_data
    latched = runtime.qos_profile(QoS.LATCHED)
    assert (latched.reliability, latched.depth, latched.durability) == (
        ReliabilityPolicy.RELIABLE, 1, DurabilityPolicy.TRANSIENT_LOCAL)


def test_garbage_on_a_raw_subscription_is_dropped_and_counted(runtime: RosRuntime) -> None:
    got: list[Any] = []
    runtime.create_subscription("/check/state", "String", got.append)
    raw = runtime.node.create_publisher(message_class("String"), "/check/state", 10)
    good = bytes(interfaces.encode(interfaces.make("String", data="plan v3"), "String"))
    spin_until(runtime, lambda: (raw.publish(good), got)[1], "a good message")
    assert got[0].data == "plan v3"
    garbage = (b"\x07\x07\x00\x00junk", b"\x00\x01\x00\x00\xff\xff\xff\x7f", b"\x00\x01")
    for junk in garbage:
        raw.publish(junk)
    spin_until(runtime, lambda: runtime.rejected.total >= len(garbage), "3 rejected messages")
    assert all(m.data == "plan v3" for m in got)
    assert runtime.rejected.counts == {"malformed": 3} and "/check/state" in runtime.rejected.last_reason


def test_a_destroyed_subscription_receives_nothing_more(runtime: RosRuntime) -> None:
    got: list[Any] = []
    sub = runtime.create_subscription("/check/images", "String", got.append)
    raw = runtime.node.create_publisher(message_class("String"), "/check/images", 10)
    good = bytes(interfaces.encode(interfaces.make("String", data="before"), "String"))
    spin_until(runtime, lambda: (raw.publish(good), got)[1], "a message before")
    sub.destroy()
    sub.destroy()  # a second destroy is harmless
    spin_until(runtime, lambda: raw.get_subscription_count() == 0, "the subscription gone from the graph")
    seen = len(got)
    after = bytes(interfaces.encode(interfaces.make("String", data="after"), "String"))
    for _ in range(5):
        raw.publish(after)
    for _ in range(20):
        rclpy.spin_once(runtime.node, timeout_sec=0.01)
    assert len(got) == seen and all(m.data == "before" for m in got)


def test_callback_exceptions_are_logged_and_spin_ends_at_shutdown(runtime: RosRuntime,
                                                                  capfd: pytest.CaptureFixture) -> None:
    calls: list[int] = []

    def boom() -> None:
        calls.append(1)
        if len(calls) == 3:
            runtime.shutdown()
        raise RuntimeError("node bug")

    runtime.create_timer(0.02, boom)
    runtime.spin()  # returns once the third call asked for shutdown, the raises did not end it
    assert len(calls) == 3 and not runtime.ok()
    assert capfd.readouterr().err.count("node bug") >= 3
    with pytest.raises(ValueError):
        runtime.create_timer(0.0, boom)


def test_parameter_descriptors_are_mapped(runtime: RosRuntime) -> None:
    values = runtime.declare_parameters(PARAMS)
    assert values["emulated_slowdown"] == 1.0 and values["static_shares"] == []
    described = {d.name: runtime.node.describe_parameter(d.name) for d in PARAMS}
    slow = described["emulated_slowdown"]
    assert slow.description == "sleep (s-1)x compute" and not slow.read_only
    assert (slow.floating_point_range[0].from_value, slow.floating_point_range[0].to_value) == (1.0, 100.0)
    assert not slow.integer_range
    slab = described["slab_rows"].integer_range[0]
    assert (slab.from_value, slab.to_value, slab.step) == (1, 4096, 0)
    gain = described["min_gain"].floating_point_range[0]
    assert gain.from_value == 0.0 and gain.to_value > 1e300
    assert described["device"].read_only
    assert "adaptive" in described["policy"].additional_constraints
    assert not described["static_shares"].floating_point_range  # rclpy ranges are scalar only
    assert not described["verbose"].floating_point_range and not described["verbose"].integer_range


def test_overrides_win_and_are_checked_like_embedded() -> None:
    rt = RosRuntime("adapter_check", ["--ros-args", "-p", "emulated_slowdown:=3", "-p", "policy:=equal"])
    try:
        assert rt.declare_parameter(PARAMS[0]) == 3.0 and isinstance(rt.get_parameter("emulated_slowdown"), float)
        assert rt.declare_parameter(PARAMS[4]) == "equal"
    finally:
        rt.close()  # rclpy is initialised once per process: the next runtime re-inits with its argv
    bad = RosRuntime("adapter_check", ["--ros-args", "-p", "slab_rows:=0"])
    try:
        with pytest.raises(ValueError, match="invalid initial value: parameter 'slab_rows' = 0 is out of range"):
            bad.declare_parameter(PARAMS[1])
    finally:
        bad.close()


PROPOSALS = [
    {"emulated_slowdown": 3.0},
    {"emulated_slowdown": 3},          # an integer for a double: accepted by both
    {"emulated_slowdown": 0.5},        # below range
    {"emulated_slowdown": math.inf},
    {"emulated_slowdown": "fast"},
    {"slab_rows": 16},
    {"slab_rows": 15},                 # refused by the node's own callback
    {"slab_rows": 2.0},                # a double for an integer: refused by both
    {"device": "cuda:0"},              # read-only
    {"policy": "greedy"},
    {"static_shares": [0.5, 0.5]},
    {"static_shares": [0.5, 1.5]},     # element out of range
    {"verbose": 1},
    {"nope": 1},
    {"slab_rows": 4, "policy": "greedy"},
]


@pytest.fixture
def both(router: str) -> Any:
    """The same parameters declared on a RosRuntime and an EmbeddedRuntime."""
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import parse_node_args

    ros = RosRuntime("param_node", [])
    emb = EmbeddedRuntime(parse_node_args([], "param_node"), router=router)
    for rt in (ros, emb):
        rt.declare_parameters(PARAMS)
        rt.add_on_set_parameters_callback(refuse_odd_slab)
    yield ros, emb
    emb.close()
    ros.close()


def test_refusal_reasons_equal_the_embedded_runtime(both: Any) -> None:
    ros, emb = both
    for proposal in PROPOSALS:
        a, b = ros.set_parameters(dict(proposal)), emb.set_parameters(dict(proposal))
        assert (a.successful, a.reason) == (b.successful, b.reason), proposal
        for name in proposal:
            if name != "nope":
                assert ros.get_parameter(name) == emb.get_parameter(name), proposal


def test_external_param_set_goes_through_the_same_check(both: Any) -> None:
    """What `ros2 param set` does: rclpy's own read-only/range checks, then our on-set callback."""
    ros, emb = both
    # everything rclpy passes on to the callbacks is refused with the embedded wording
    for proposal in ({"slab_rows": 15}, {"policy": "greedy"}, {"static_shares": [math.nan]},
                     {"static_shares": [0.5, 1.5]}, {"slab_rows": "x"}, {"slab_rows": 64}):
        (name, value), = proposal.items()
        a = ros.node.set_parameters_atomically([Parameter(name, value=value)])
        b = emb.set_parameters(proposal)
        assert (a.successful, a.reason) == (b.successful, b.reason), proposal
    assert ros.get_parameter("slab_rows") == 64
    # read-only and scalar ranges: rclpy refuses before any callback, in its own words
    refused = ros.node.set_parameters_atomically([Parameter("device", value="cuda:0")])
    assert not refused.successful and ros.get_parameter("device") == "cpu"
    low = ros.node.set_parameters_atomically([Parameter("emulated_slowdown", value=0.5)])
    assert not low.successful and ros.get_parameter("emulated_slowdown") == 1.0


def test_successful_sets_are_logged_once(runtime: RosRuntime, capfd: pytest.CaptureFixture) -> None:
    runtime.declare_parameters(PARAMS)
    capfd.readouterr()
    assert runtime.set_parameters({"emulated_slowdown": 2}).successful
    assert runtime.get_parameter("emulated_slowdown") == 2.0
    err = capfd.readouterr().err
    assert err.count("parameter emulated_slowdown set to 2.0") == 1, err
