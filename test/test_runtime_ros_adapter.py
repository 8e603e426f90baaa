"""Unit tests of the rclpy adapter (kaitian_ros/runtime/ros.py) against a TEST DOUBLE of rclpy.

ROS 2 cannot be installed on the machines these tests run on, so ``FakeRclpy`` below puts a
small stand-in ``rclpy`` / ``rcl_interfaces`` / message-package module tree into
``sys.modules``. The stand-in mimics only what the adapter touches (node naming from
``-r __node:=``, publisher/subscription objects, rclpy's parameter flow: descriptor read-only and
range checks before the on-set callbacks). These tests check the adapter's own logic:

- a publish hands rclpy exactly the bytes of ``interfaces.encode`` (raw CDR, type ``bytes``),
- a raw subscription decodes with ``interfaces.decode`` and drops + counts garbage,
- QoS profiles and parameter descriptors (ranges, read_only) are mapped as documented,
- refusal reasons equal the embedded runtime's (a real EmbeddedRuntime on a test router).

They are NOT evidence that the adapter runs on a real ROS 2 installation; that needs a colcon
build on Humble/Jazzy (see README.md).
"""

from __future__ import annotations

import enum
import itertools
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, SetParametersResult

# --- the test double ------------------------------------------------------------------------

class FakeRclpy:
    """Test double: a minimal fake of rclpy + rcl_interfaces + generated message modules."""

    def __init__(self) -> None:
        self.init_args: list[str] | None = None
        self.initialized = False
        self.nodes: list[Any] = []
        self.modules = self._build()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)

    # rclpy's module-level API
    def init(self, args: list[str] | None = None) -> None:
        self.init_args = list(args or [])
        self.initialized = True

    def ok(self, context: Any = None) -> bool:
        return self.initialized

    def shutdown(self, context: Any = None) -> None:
        self.initialized = False

    def _build(self) -> dict[str, types.ModuleType]:
        fake = self

        def module(name: str, **attrs: Any) -> types.ModuleType:
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            return mod

        # rcl_interfaces.msg
        @dataclass
        class IntegerRange:
            from_value: int = 0
            to_value: int = 0
            step: int = 0

        @dataclass
        class FloatingPointRange:
            from_value: float = 0.0
            to_value: float = 0.0
            step: float = 0.0

        @dataclass
        class RclParameterDescriptor:
            name: str = ""
            type: int = 0
            description: str = ""
            additional_constraints: str = ""
            read_only: bool = False
            dynamic_typing: bool = False
            floating_point_range: list = field(default_factory=list)
            integer_range: list = field(default_factory=list)

        @dataclass
        class RclSetParametersResult:
            successful: bool = False
            reason: str = ""

        # rclpy.qos
        class HistoryPolicy(enum.Enum):
            KEEP_LAST = 1
            KEEP_ALL = 2

        class ReliabilityPolicy(enum.Enum):
            RELIABLE = 1
            BEST_EFFORT = 2

        class DurabilityPolicy(enum.Enum):
            TRANSIENT_LOCAL = 1
            VOLATILE = 2

        @dataclass
        class QoSProfile:
            history: Any = HistoryPolicy.KEEP_LAST
            depth: int = 10
            reliability: Any = ReliabilityPolicy.RELIABLE
            durability: Any = DurabilityPolicy.VOLATILE

        sensor_data = QoSProfile(depth=5, reliability=ReliabilityPolicy.BEST_EFFORT)

        # rclpy.parameter
        class Parameter:
            def __init__(self, name: str, type_: Any = None, value: Any = None) -> None:
                self.name, self.type_, self.value = name, type_, value

        class InvalidParameterValueException(Exception):
            pass

        class FakePublisher:
            def __init__(self, msg_type: type, topic: str, qos: Any) -> None:
                self.msg_type, self.topic_name, self.qos = msg_type, topic, qos
                self.sent: list[Any] = []

            def publish(self, msg: Any) -> None:
                # rclpy: raw only for bytes, else it must be the typed message
                if not isinstance(msg, (bytes, self.msg_type)):
                    raise TypeError(f"expected bytes or {self.msg_type}, got {type(msg)}")
                self.sent.append(msg)

        class FakeSubscription:
            def __init__(self, msg_type: type, topic: str, cb: Any, qos: Any, raw: bool) -> None:
                self.msg_type, self.topic_name, self.callback, self.qos, self.raw = msg_type, topic, cb, qos, raw

        class FakeTimer:
            def __init__(self, period: float, cb: Any) -> None:
                self.period, self.callback, self.cancelled = period, cb, False

            def cancel(self) -> None:
                self.cancelled = True

        class FakeLogger:
            def __init__(self) -> None:
                self.lines: list[tuple[str, str]] = []

            def debug(self, m: str) -> None:
                self.lines.append(("debug", m))

            def info(self, m: str) -> None:
                self.lines.append(("info", m))

            def warning(self, m: str) -> None:
                self.lines.append(("warning", m))

            def error(self, m: str) -> None:
                self.lines.append(("error", m))

        class FakeClock:
            def now(self) -> Any:
                import time

                return types.SimpleNamespace(nanoseconds=time.time_ns())

        class FakeNode:
            """Parameter flow as rclpy's: read_only, then descriptor ranges, then callbacks."""

            def __init__(self, node_name: str, *, namespace: str | None = None) -> None:
                args = fake.init_args or []
                self._name, self._ns = node_name, namespace or "/"
                self._parameter_overrides: dict[str, Parameter] = {}
                for flag, value in itertools.pairwise(args):
                    if flag == "-r" and value.startswith("__node:="):
                        self._name = value.split(":=", 1)[1]
                    if flag == "-p":
                        key, text = value.split(":=", 1)
                        self._parameter_overrides[key] = Parameter(key, value=yaml.safe_load(text))
                self.publishers: list[FakePublisher] = []
                self.subscriptions: list[FakeSubscription] = []
                self.timers: list[FakeTimer] = []
                self.params: dict[str, Parameter] = {}
                self.descriptors: dict[str, RclParameterDescriptor] = {}
                self.callbacks: list[Any] = []
                self.logger = FakeLogger()
                self.destroyed = False
                fake.nodes.append(self)

            def get_name(self) -> str:
                return self._name

            def get_namespace(self) -> str:
                return self._ns

            def get_logger(self) -> FakeLogger:
                return self.logger

            def get_clock(self) -> FakeClock:
                return FakeClock()

            def create_publisher(self, msg_type: type, topic: str, qos: Any) -> FakePublisher:
                pub = FakePublisher(msg_type, topic, qos)
                self.publishers.append(pub)
                return pub

            def create_subscription(self, msg_type: type, topic: str, cb: Any, qos: Any, *,
                                    raw: bool = False) -> FakeSubscription:
                sub = FakeSubscription(msg_type, topic, cb, qos, raw)
                self.subscriptions.append(sub)
                return sub

            def create_timer(self, period: float, cb: Any) -> FakeTimer:
                timer = FakeTimer(period, cb)
                self.timers.append(timer)
                return timer

            def add_on_set_parameters_callback(self, cb: Any) -> None:
                self.callbacks.insert(0, cb)  # rclpy prepends

            def _check(self, param: Parameter, desc: RclParameterDescriptor, check_read_only: bool) -> Any:
                if check_read_only and desc.read_only:
                    return RclSetParametersResult(False, f"Trying to set a read-only parameter: {param.name}.")
                v = param.value
                if isinstance(v, float) and desc.floating_point_range:
                    r = desc.floating_point_range[0]
                    if not r.from_value <= v <= r.to_value:
                        return RclSetParametersResult(False, f"Parameter {param.name} out of range")
                if isinstance(v, int) and not isinstance(v, bool) and desc.integer_range:
                    r = desc.integer_range[0]
                    if not r.from_value <= v <= r.to_value:
                        return RclSetParametersResult(False, f"Parameter {param.name} out of range")
                for cb in self.callbacks:
                    result = cb([param])
                    if not result.successful:
                        return result
                return RclSetParametersResult(True, "")

            def declare_parameter(self, name: str, value: Any = None, descriptor: Any = None,
                                  ignore_override: bool = False) -> Parameter:
                if not ignore_override and name in self._parameter_overrides:
                    value = self._parameter_overrides[name].value
                param = Parameter(name, value=value)
                result = self._check(param, descriptor, check_read_only=False)
                if not result.successful:
                    raise InvalidParameterValueException(result.reason)
                self.params[name], self.descriptors[name] = param, descriptor
                return param

            def get_parameter(self, name: str) -> Parameter:
                return self.params[name]

            def set_parameters_atomically(self, params: list[Parameter]) -> Any:
                for p in params:
                    result = self._check(p, self.descriptors[p.name], check_read_only=True)
                    if not result.successful:
                        return result
                for p in params:
                    self.params[p.name] = p
                return RclSetParametersResult(True, "")

            def destroy_node(self) -> None:
                self.destroyed = True

        class ExternalShutdownException(Exception):
            pass

        class SingleThreadedExecutor:
            def __init__(self) -> None:
                self.nodes: list[Any] = []

            def add_node(self, node: Any) -> None:
                self.nodes.append(node)

            def remove_node(self, node: Any) -> None:
                self.nodes.remove(node)

            def spin_once(self, timeout_sec: float | None = None) -> None:
                pass

            def shutdown(self) -> None:
                pass

        def message_module(name: str, *classes: str) -> types.ModuleType:
            return module(name, **{c: type(c, (), {"__module__": name}) for c in classes})

        rclpy = module("rclpy", init=fake.init, ok=fake.ok, shutdown=fake.shutdown)
        mods = {
            "rclpy": rclpy,
            "rclpy.node": module("rclpy.node", Node=FakeNode),
            "rclpy.executors": module("rclpy.executors", SingleThreadedExecutor=SingleThreadedExecutor,
                                      ExternalShutdownException=ExternalShutdownException),
            "rclpy.qos": module("rclpy.qos", QoSProfile=QoSProfile, HistoryPolicy=HistoryPolicy,
                                ReliabilityPolicy=ReliabilityPolicy, DurabilityPolicy=DurabilityPolicy,
                                qos_profile_sensor_data=sensor_data),
            "rclpy.parameter": module("rclpy.parameter", Parameter=Parameter),
            "rcl_interfaces": module("rcl_interfaces"),
            "rcl_interfaces.msg": module("rcl_interfaces.msg", ParameterDescriptor=RclParameterDescriptor,
                                         IntegerRange=IntegerRange, FloatingPointRange=FloatingPointRange,
                                         SetParametersResult=RclSetParametersResult),
            "kaitian_ros.msg": message_module("kaitian_ros.msg", *interfaces.OWN_TYPES),
            "std_msgs": module("std_msgs"),
            "std_msgs.msg": message_module("std_msgs.msg", "String", "Header"),
            "sensor_msgs": module("sensor_msgs"),
            "sensor_msgs.msg": message_module("sensor_msgs.msg", "Image"),
        }
        for name, mod in mods.items():
            if name.startswith("rclpy."):
                setattr(rclpy, name.split(".", 1)[1], mod)
        mods["rcl_interfaces"].msg = mods["rcl_interfaces.msg"]
        return mods


@pytest.fixture
def fake_rclpy(monkeypatch: pytest.MonkeyPatch) -> FakeRclpy:
    fake = FakeRclpy()
    fake.install(monkeypatch)
    return fake


def make_runtime(argv: list[str], name: str = "adapter_test") -> Any:
    from kaitian_ros.runtime.ros import RosRuntime

    return RosRuntime(name, argv)


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


# --- tests ----------------------------------------------------------------------------------

def test_node_name_and_rclpy_init_come_from_ros_args(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime(["--ros-args", "-r", "__node:=compute_7"], name="compute")
    assert fake_rclpy.init_args[1:] == ["--ros-args", "-r", "__node:=compute_7"]
    assert rt.node_name == "compute_7" and rt.fqn == "/compute_7"
    rt.close()
    assert fake_rclpy.nodes[0].destroyed and not fake_rclpy.initialized


def test_publish_hands_rclpy_exactly_the_encoded_bytes(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])
    pub = rt.create_publisher("/kaitian/chunks/compute_0", "TensorChunk")
    import numpy as np

    msg = interfaces.make("TensorChunk", request_id=7, **interfaces.tensor_fields(
        np.arange(24, dtype=np.float32).reshape(2, 3, 4)))
    pub.publish(msg)
    fake_pub = fake_rclpy.nodes[0].publishers[0]
    assert fake_pub.msg_type is sys.modules["kaitian_ros.msg"].TensorChunk
    (sent,) = fake_pub.sent
    assert type(sent) is bytes
    assert sent == bytes(interfaces.encode(msg, "TensorChunk"))
    pub.publish_raw(memoryview(sent))
    assert fake_pub.sent[1] == sent and type(fake_pub.sent[1]) is bytes
    image_pub = rt.create_publisher("/camera/image_raw", "sensor_msgs/msg/Image", QoS.BEST_EFFORT)
    assert fake_rclpy.nodes[0].publishers[1].msg_type is sys.modules["sensor_msgs.msg"].Image
    assert image_pub.msg_type == "sensor_msgs/msg/Image"


def test_qos_mapping(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])
    qos = sys.modules["rclpy.qos"]
    reliable = rt.qos_profile(QoS.RELIABLE)
    assert (reliable.reliability, reliable.depth, reliable.durability, reliable.history) == (
        qos.ReliabilityPolicy.RELIABLE, 10, qos.DurabilityPolicy.VOLATILE, qos.HistoryPolicy.KEEP_LAST)
    assert rt.qos_profile(QoS.BEST_EFFORT) is qos.qos_profile_sensor_data
    latched = rt.qos_profile(QoS.LATCHED)
    assert (latched.reliability, latched.depth, latched.durability) == (
        qos.ReliabilityPolicy.RELIABLE, 1, qos.DurabilityPolicy.TRANSIENT_LOCAL)


def test_raw_subscription_decodes_and_counts_rejects(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])
    got: list[Any] = []
    rt.create_subscription("/kaitian/assignment", "String", got.append, QoS.LATCHED)
    sub = fake_rclpy.nodes[0].subscriptions[0]
    assert sub.raw is True and sub.msg_type is sys.modules["std_msgs.msg"].String
    text = interfaces.make("String", data="plan v3")
    sub.callback(bytes(interfaces.encode(text, "String")))
    assert [m.data for m in got] == ["plan v3"]
    for garbage in (b"", b"\x07\x07\x00\x00junk", b"\x00\x01\x00\x00\xff\xff\xff\x7f"):
        sub.callback(garbage)
    assert len(got) == 1
    assert rt.rejected.total == 3 and rt.rejected.counts == {"malformed": 3}
    assert "/kaitian/assignment" in rt.rejected.last_reason


def test_callback_exceptions_are_logged_not_raised(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])

    def boom(_: Any = None) -> None:
        raise RuntimeError("node bug")

    rt.create_timer(0.5, boom)
    rt.create_subscription("chatter", "String", boom)
    node = fake_rclpy.nodes[0]
    node.timers[0].callback()
    node.subscriptions[0].callback(bytes(interfaces.encode(interfaces.make("String", data="x"), "String")))
    assert sum("node bug" in m for level, m in node.logger.lines if level == "error") == 2
    with pytest.raises(ValueError):
        rt.create_timer(0.0, boom)


def test_parameter_descriptors_are_mapped(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])
    values = rt.declare_parameters(PARAMS)
    assert values["emulated_slowdown"] == 1.0 and values["static_shares"] == []
    described = fake_rclpy.nodes[0].descriptors
    slow = described["emulated_slowdown"]
    assert slow.description == "sleep (s-1)x compute" and not slow.read_only
    assert (slow.floating_point_range[0].from_value, slow.floating_point_range[0].to_value) == (1.0, 100.0)
    assert not slow.integer_range
    slab = described["slab_rows"].integer_range[0]
    assert (slab.from_value, slab.to_value, slab.step) == (1, 4096, 0)
    assert type(slab.from_value) is int
    gain = described["min_gain"].floating_point_range[0]
    assert gain.from_value == 0.0 and gain.to_value == sys.float_info.max
    assert described["device"].read_only
    assert "adaptive" in described["policy"].additional_constraints
    assert not described["static_shares"].floating_point_range  # rclpy ranges are scalar only
    assert not described["verbose"].floating_point_range and not described["verbose"].integer_range


def test_overrides_win_and_are_checked_like_embedded(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime(["--ros-args", "-p", "emulated_slowdown:=3", "-p", "policy:=equal"])
    assert rt.declare_parameter(PARAMS[0]) == 3.0 and isinstance(rt.get_parameter("emulated_slowdown"), float)
    assert rt.declare_parameter(PARAMS[4]) == "equal"
    rt.close()  # rclpy is initialised once per process: the next runtime re-inits with its argv
    bad = make_runtime(["--ros-args", "-p", "slab_rows:=0"])
    with pytest.raises(ValueError, match="invalid initial value: parameter 'slab_rows' = 0 is out of range"):
        bad.declare_parameter(PARAMS[1])


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


def test_refusal_reasons_equal_the_embedded_runtime(fake_rclpy: FakeRclpy, router: Any) -> None:
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import parse_node_args

    ros = make_runtime([], name="param_node")
    emb = EmbeddedRuntime(parse_node_args([], "param_node"), router=router.endpoint)
    try:
        for rt in (ros, emb):
            rt.declare_parameters(PARAMS)
            rt.add_on_set_parameters_callback(refuse_odd_slab)
        for proposal in PROPOSALS:
            a, b = ros.set_parameters(dict(proposal)), emb.set_parameters(dict(proposal))
            assert (a.successful, a.reason) == (b.successful, b.reason), proposal
            for name in proposal:
                if name != "nope":
                    assert ros.get_parameter(name) == emb.get_parameter(name), proposal
    finally:
        emb.close()
        ros.close()


def test_external_param_set_goes_through_the_same_check(fake_rclpy: FakeRclpy, router: Any) -> None:
    """What `ros2 param set` does: rclpy's own read-only/range checks, then our on-set callback."""
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import parse_node_args

    Parameter = sys.modules["rclpy.parameter"].Parameter
    ros = make_runtime([], name="param_node")
    emb = EmbeddedRuntime(parse_node_args([], "param_node"), router=router.endpoint)
    try:
        for rt in (ros, emb):
            rt.declare_parameters(PARAMS)
            rt.add_on_set_parameters_callback(refuse_odd_slab)
        node = fake_rclpy.nodes[0]
        # everything rclpy passes on to the callbacks is refused with the embedded wording
        for proposal in ({"slab_rows": 15}, {"policy": "greedy"}, {"static_shares": [math.nan]},
                         {"static_shares": [0.5, 1.5]}, {"slab_rows": "x"}, {"slab_rows": 64}):
            (name, value), = proposal.items()
            a, b = node.set_parameters_atomically([Parameter(name, value=value)]), emb.set_parameters(proposal)
            assert (a.successful, a.reason) == (b.successful, b.reason), proposal
        assert ros.get_parameter("slab_rows") == 64
        # read-only and scalar ranges: rclpy refuses before any callback, in its own words
        refused = node.set_parameters_atomically([Parameter("device", value="cuda:0")])
        assert not refused.successful and ros.get_parameter("device") == "cpu"
    finally:
        emb.close()
        ros.close()


def test_module_imports_without_rclpy() -> None:
    """rclpy is imported lazily: importing the adapter module needs no ROS installation."""
    import subprocess

    code = "import sys, kaitian_ros.runtime.ros; print('rclpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_spin_runs_until_shutdown_and_close_releases(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])
    calls: list[float] = []

    def once(timeout_sec: float | None = None) -> None:
        calls.append(timeout_sec)
        if len(calls) == 3:
            rt.shutdown()

    rt.executor.spin_once = once
    rt.spin()
    assert len(calls) == 3 and not rt.ok()
    rt.close()
    rt.close()  # idempotent
    assert fake_rclpy.nodes[0].destroyed and not fake_rclpy.initialized


def test_successful_sets_are_logged_once(fake_rclpy: FakeRclpy) -> None:
    rt = make_runtime([])
    rt.declare_parameters(PARAMS)
    assert rt.set_parameters({"emulated_slowdown": 2}).successful
    assert rt.get_parameter("emulated_slowdown") == 2.0
    logged = [m for level, m in fake_rclpy.nodes[0].logger.lines if level == "info"]
    assert logged == ["parameter emulated_slowdown set to 2.0"]
