"""The ROS 2 runtime: a thin adapter of the Runtime protocol (api.py) over rclpy (Humble, Jazzy).

What it does, and why:

- Messages stay rosbags dataclasses in node code. Publishing sends the rosbags CDR bytes raw
  (``Publisher.publish(bytes)``), subscriptions use ``raw=True`` and decode with
  :func:`interfaces.decode`, exactly the codec the embedded runtime uses. rclpy never converts
  large arrays in Python. The rclpy publisher/subscription still needs the generated message
  class (for the type support): ``pkg/msg/Name`` is imported as ``pkg.msg.Name``.
- Undecodable messages are dropped and counted in ``self.rejected`` with the embedded
  runtime's reason format.
- QoS: RELIABLE -> reliable, keep last 10, volatile; BEST_EFFORT -> ``qos_profile_sensor_data``;
  LATCHED -> reliable, keep last 1, transient local.
- Parameters are real ROS 2 parameters (``ros2 param get/set/describe`` work): declared with an
  ``rcl_interfaces/ParameterDescriptor`` carrying the description, ``read_only`` and an
  integer/floating-point range from ``min_value``/``max_value``. One on-set callback validates
  with :meth:`api.ParameterDescriptor.check` (the same function the embedded runtime uses), then
  runs the node's own callbacks in registration order. Initial values follow the embedded
  runtime too: the override (launch/params file/``-p``) or the default, checked, and coerced
  (an integer given for a double is accepted, as on the embedded runtime).

  Known difference, from rclpy itself: for an external ``ros2 param set``, rclpy checks
  ``read_only`` and the scalar range of the descriptor *before* any on-set callback and words
  that refusal itself ("Trying to set a read-only parameter: x."). The refusal happens either
  way; only the wording differs. :meth:`RosRuntime.set_parameters` (the API nodes use) checks
  first and gives the embedded runtime's reasons exactly.
- Callbacks run on one thread (a SingleThreadedExecutor); an exception in a node callback is
  logged and the node keeps running, as on the embedded runtime.

rclpy is imported only when a RosRuntime is created, so nothing else needs ROS installed.
"""

from __future__ import annotations

import array
import contextlib
import importlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from kaitian_ros import heap
from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import (
    MessageInfo,
    ParameterDescriptor,
    ParametersCallback,
    ParameterType,
    ParameterValue,
    QoS,
    RejectCounter,
    SetParametersResult,
    coerce_parameter,
)
from kaitian_ros.runtime.node_args import parse_node_args

RELIABLE_DEPTH = 10
SPIN_PERIOD_S = 0.1
NODE_POLL_S = 0.25  # how often on_node_gone compares the graph's node names
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def message_class(msg_type: str) -> type:
    """The rosidl-generated Python class of ``pkg/msg/Name`` (or a short alias like ``Image``)."""
    full = interfaces.TYPE_ALIASES.get(msg_type, msg_type)
    try:
        pkg, kind, name = full.split("/")
    except ValueError:
        raise ValueError(f"message type must look like 'pkg/msg/Name', got {msg_type!r}") from None
    module = importlib.import_module(f"{pkg}.{kind}")
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(f"{pkg}.{kind} has no message {name} (was the package built with colcon "
                          f"and the workspace sourced?)") from None


def plain_value(value: Any) -> Any:
    """rclpy hands arrays as array.array / numpy / tuples: make them lists for api.coerce_parameter."""
    if isinstance(value, (str, bytes, list)) or value is None:
        return value
    if isinstance(value, (array.array, tuple)) or hasattr(value, "tolist"):
        return value.tolist() if hasattr(value, "tolist") else list(value)
    return value


def rcl_descriptor(desc: ParameterDescriptor, modules: Any) -> Any:  # modules: rcl_interfaces.msg
    """rcl_interfaces/ParameterDescriptor of one of ours (description, read_only, ranges).

    Types are checked by api.ParameterDescriptor.check in the on-set callback (dynamic_typing):
    that accepts an integer for a double as the embedded runtime does, and an empty array
    default (which rclpy infers as BYTE_ARRAY) can later be set to the declared array type.
    """
    extra = ""
    if desc.choices:
        extra = f"one of {list(desc.choices)}"
    elif desc.type in (ParameterType.DOUBLE_ARRAY, ParameterType.INTEGER_ARRAY) and (
            desc.min_value is not None or desc.max_value is not None):
        extra = f"each element in [{desc.min_value}, {desc.max_value}]"
    out = modules.ParameterDescriptor(
        name=desc.name, description=desc.description, read_only=desc.read_only,
        additional_constraints=extra, dynamic_typing=True)
    if desc.min_value is None and desc.max_value is None:
        return out
    if desc.type is ParameterType.INTEGER:
        lo = _INT64_MIN if desc.min_value is None else int(desc.min_value)
        hi = _INT64_MAX if desc.max_value is None else int(desc.max_value)
        out.integer_range = [modules.IntegerRange(from_value=lo, to_value=hi, step=0)]
    elif desc.type is ParameterType.DOUBLE:
        low = -sys.float_info.max if desc.min_value is None else float(desc.min_value)
        high = sys.float_info.max if desc.max_value is None else float(desc.max_value)
        out.floating_point_range = [modules.FloatingPointRange(from_value=low, to_value=high, step=0.0)]
    return out


class RosLogger:
    """api.Logger over rclpy's RcutilsLogger (plus ``exception`` like logging.Logger)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def debug(self, msg: str) -> None:
        self._logger.debug(str(msg))

    def info(self, msg: str) -> None:
        self._logger.info(str(msg))

    def warning(self, msg: str) -> None:
        self._logger.warning(str(msg))

    warn = warning

    def error(self, msg: str) -> None:
        self._logger.error(str(msg))

    def exception(self, msg: str) -> None:
        self._logger.error(f"{msg}\n{traceback.format_exc().rstrip()}")


class RosPublisher:
    """Publishes rosbags messages as their CDR bytes through an rclpy publisher."""

    def __init__(self, rt: RosRuntime, topic: str, msg_type: str, qos: QoS) -> None:
        self.msg_type = interfaces.full_type_name(msg_type)
        self.qos = qos
        self._pub = rt.node.create_publisher(message_class(self.msg_type), topic, rt.qos_profile(qos))
        self.topic = getattr(self._pub, "topic_name", topic)

    def publish(self, msg: Any) -> None:
        self.publish_raw(interfaces.encode(msg, self.msg_type))

    def publish_raw(self, cdr: bytes | bytearray | memoryview) -> None:
        # rclpy publishes raw only for exactly `bytes` (anything else must be the typed class)
        self._pub.publish(cdr if type(cdr) is bytes else bytes(cdr))


class RosSubscription:
    """rclpy raw subscription: CDR bytes -> interfaces.decode -> node callback; bad input counted."""

    def __init__(self, rt: RosRuntime, topic: str, msg_type: str,
                 callback: Callable[..., None], qos: QoS, with_info: bool = False) -> None:
        self.with_info = with_info
        self.msg_type = interfaces.full_type_name(msg_type)
        self.callback = callback
        self.qos = qos
        self._rt = rt
        self.topic = topic
        self._sub = rt.node.create_subscription(message_class(self.msg_type), topic, self._on_raw,
                                                rt.qos_profile(qos), raw=True)
        self.topic = getattr(self._sub, "topic_name", topic)
        self.destroyed = False

    def destroy(self) -> None:
        """Stop receiving (rclpy's destroy_subscription)."""
        if not self.destroyed:
            self.destroyed = True
            self._rt.node.destroy_subscription(self._sub)

    def _on_raw(self, payload: bytes) -> None:
        # rclpy hands raw messages to the executor thread: arrival is when we see it
        received_s = time.time()
        try:
            msg = interfaces.decode(payload, self.msg_type)
        except interfaces.DecodeError as exc:
            self._rt.reject(f"malformed: {exc} on {self.topic}")
            return
        if self.with_info:
            self._rt.run_guarded(self.callback, msg, MessageInfo(received_s, 0.0, 0))
        else:
            self._rt.run_guarded(self.callback, msg)


class RosTimer:
    def __init__(self, rt: RosRuntime, period_s: float, callback: Callable[[], None]) -> None:
        if period_s <= 0:
            raise ValueError(f"timer period must be > 0, got {period_s}")
        self.period_s = period_s
        self.callback = callback
        self._timer = rt.node.create_timer(period_s, lambda: rt.run_guarded(callback))

    def cancel(self) -> None:
        self._timer.cancel()


class RosRuntime:
    """A node's runtime on rclpy. ``argv`` is the node's command line (``--ros-args ...``)."""

    def __init__(self, default_name: str, argv: Sequence[str]) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.node import Node

        self._rclpy = rclpy
        self._argv = list(argv)
        heap.tune_allocator()  # as the embedded runtime: large buffers stay in the heap
        self._owns_context = False
        if not rclpy.ok():
            # rcl handles --ros-args itself: node name (-r __node:=), namespace, remaps, params files
            rclpy.init(args=[sys.argv[0] if sys.argv and sys.argv[0] else default_name] + self._argv)
            self._owns_context = True
        self.node = Node(default_name)
        self.node_name = self.node.get_name()
        self.namespace = self.node.get_namespace()
        self.fqn = (self.namespace.rstrip("/") + "/" + self.node_name)
        self.logger = RosLogger(self.node.get_logger())
        self.rejected = RejectCounter()
        self._reject_lock = threading.Lock()
        self._descriptors: dict[str, ParameterDescriptor] = {}
        self._on_set: list[ParametersCallback] = []
        self._declaring = False
        self.node.add_on_set_parameters_callback(self._on_set_parameters)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self._shutdown = threading.Event()
        self._closed = False

    # --- QoS ----------------------------------------------------------------------------
    def qos_profile(self, qos: QoS) -> Any:
        from rclpy.qos import (
            DurabilityPolicy,
            HistoryPolicy,
            QoSProfile,
            ReliabilityPolicy,
            qos_profile_sensor_data,
        )

        if qos is QoS.BEST_EFFORT:
            return qos_profile_sensor_data
        if qos is QoS.LATCHED:
            return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                              reliability=ReliabilityPolicy.RELIABLE,
                              durability=DurabilityPolicy.TRANSIENT_LOCAL)
        return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=RELIABLE_DEPTH,
                          reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.VOLATILE)

    # --- graph entities -----------------------------------------------------------------
    def create_publisher(self, topic: str, msg_type: str, qos: QoS = QoS.RELIABLE) -> RosPublisher:
        return RosPublisher(self, topic, msg_type, qos)

    def create_subscription(self, topic: str, msg_type: str, callback: Callable[..., None],
                            qos: QoS = QoS.RELIABLE, *, with_info: bool = False) -> RosSubscription:
        return RosSubscription(self, topic, msg_type, callback, qos, with_info)

    def create_timer(self, period_s: float, callback: Callable[[], None]) -> RosTimer:
        return RosTimer(self, period_s, callback)

    def on_node_gone(self, callback: Callable[[str], None]) -> None:
        """rclpy has no departure event: the graph's node names are compared every 0.25 s."""
        def names() -> set[str]:
            return {f"{ns.rstrip('/')}/{name}" for name, ns in self.node.get_node_names_and_namespaces()}

        known = [names()]

        def poll() -> None:
            now = names()
            for fqn in sorted(known[0] - now):
                callback(fqn)
            known[0] = now

        self.create_timer(NODE_POLL_S, poll)

    def reject(self, reason: str) -> None:
        with self._reject_lock:
            self.rejected.count(reason)
        self.logger.debug(f"dropped message: {reason}")

    def run_guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """A node bug in one callback is logged, never takes the executor down."""
        try:
            fn(*args)
        except Exception:
            self.logger.exception("callback raised")

    # --- parameters ---------------------------------------------------------------------
    def _override(self, name: str) -> tuple[bool, Any]:
        """(found, value) of a parameter override given to this node (launch, params file, -p)."""
        overrides = getattr(self.node, "_parameter_overrides", None)  # rclpy's own parse
        if isinstance(overrides, dict):
            if name in overrides:
                return True, plain_value(getattr(overrides[name], "value", overrides[name]))
            return False, None
        parsed = parse_node_args(self._argv, self.node_name).parameters
        return (name in parsed), parsed.get(name)

    def declare_parameter(self, descriptor: ParameterDescriptor) -> ParameterValue:
        from rcl_interfaces import msg as rcl_msgs

        if descriptor.name in self._descriptors:
            raise ValueError(f"parameter '{descriptor.name}' already declared")
        found, value = self._override(descriptor.name)
        if not found:
            value = descriptor.default
        reason = descriptor.check(value)
        if reason:
            raise ValueError(f"invalid initial value: {reason}")
        value = coerce_parameter(descriptor.type, value)
        self._descriptors[descriptor.name] = descriptor
        self._declaring = True
        try:
            self.node.declare_parameter(descriptor.name, value, rcl_descriptor(descriptor, rcl_msgs),
                                        ignore_override=True)
        except Exception:
            del self._descriptors[descriptor.name]
            raise
        finally:
            self._declaring = False
        return value

    def declare_parameters(self, descriptors: Sequence[ParameterDescriptor]) -> dict[str, ParameterValue]:
        return {d.name: self.declare_parameter(d) for d in descriptors}

    def get_parameter(self, name: str) -> ParameterValue:
        desc = self._descriptors.get(name)
        if desc is None:
            raise KeyError(f"parameter '{name}' is not declared")
        return coerce_parameter(desc.type, plain_value(self.node.get_parameter(name).value))

    def add_on_set_parameters_callback(self, callback: ParametersCallback) -> None:
        self._on_set.append(callback)

    def parameters_snapshot(self) -> list[dict[str, Any]]:
        return [self._descriptors[n].as_dict() | {"value": self.get_parameter(n)}
                for n in sorted(self._descriptors)]

    def check_parameters(self, values: dict[str, ParameterValue]) -> tuple[SetParametersResult, dict]:
        """The embedded runtime's validation, in its order, with its reasons."""
        proposed: dict[str, ParameterValue] = {}
        for name, value in values.items():
            desc = self._descriptors.get(name)
            if desc is None:
                return SetParametersResult(False, f"parameter '{name}' is not declared"), {}
            if desc.read_only:
                return SetParametersResult(False, f"parameter '{name}' is read-only"), {}
            reason = desc.check(plain_value(value))
            if reason:
                return SetParametersResult(False, reason), {}
            proposed[name] = coerce_parameter(desc.type, plain_value(value))
        return SetParametersResult(True, ""), proposed

    def set_parameters(self, values: dict[str, ParameterValue]) -> SetParametersResult:
        """Validate all (embedded wording), then set atomically through rclpy (callbacks run)."""
        from rclpy.parameter import Parameter

        result, proposed = self.check_parameters(values)
        if not result.successful:
            return result
        outcome = self.node.set_parameters_atomically([Parameter(n, value=v) for n, v in proposed.items()])
        return SetParametersResult(bool(outcome.successful), str(outcome.reason or ""))

    def _on_set_parameters(self, parameters: list[Any]) -> Any:
        """The one rclpy on-set callback: api check, then the node's callbacks (in order)."""
        from rcl_interfaces.msg import SetParametersResult as RclResult

        if self._declaring:  # rclpy runs on-set callbacks at declaration too; already checked
            return RclResult(successful=True, reason="")
        values = {p.name: plain_value(p.value) for p in parameters}
        ours = {n: v for n, v in values.items() if n in self._descriptors}
        # parameters we did not declare (use_sim_time, ...) are rclpy's business
        result, proposed = self.check_parameters(ours)
        if result.successful and proposed:
            for callback in self._on_set:
                try:
                    result = callback(dict(proposed))
                except Exception as exc:  # noqa: BLE001 - a node bug refuses the change, never crashes the service
                    result = SetParametersResult(False, f"{type(exc).__name__}: {exc}")
                if not result.successful:
                    break
        if result.successful:  # logged for API and `ros2 param set` alike, as on the embedded runtime
            for name, value in proposed.items():
                self.logger.info(f"parameter {name} set to {value!r}")
        return RclResult(successful=bool(result.successful), reason=result.reason)

    # --- executor -----------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the epoch on the node's clock (ROS time: wall clock unless use_sim_time)."""
        return self.node.get_clock().now().nanoseconds * 1e-9

    def ok(self) -> bool:
        return not self._shutdown.is_set() and self._rclpy.ok()

    def spin_once(self, timeout_s: float = 0.0) -> None:
        self.executor.spin_once(timeout_sec=timeout_s)

    def spin(self) -> None:
        from rclpy import executors

        # the context shut down from outside (rclpy's own signal handling) ends spin quietly
        external = getattr(executors, "ExternalShutdownException", KeyboardInterrupt)
        try:
            while self.ok():
                self.executor.spin_once(timeout_sec=SPIN_PERIOD_S)
        except (KeyboardInterrupt, external):
            pass

    def shutdown(self) -> None:
        self._shutdown.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.shutdown()
        # best effort, in order: rclpy raises assorted errors (RCLError, InvalidHandle, ...) on
        # handles a signal handler or an earlier failure already destroyed
        with contextlib.suppress(Exception):
            self.executor.remove_node(self.node)
            self.executor.shutdown()
        with contextlib.suppress(Exception):
            self.node.destroy_node()
        if self._owns_context:
            with contextlib.suppress(Exception):  # already shut down by a signal handler
                if self._rclpy.ok():
                    self._rclpy.shutdown()
