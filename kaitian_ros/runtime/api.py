"""The Runtime protocol every node is written against, and the values it exchanges.

Two implementations: ``embedded`` (Zenoh, no ROS installation) and ``ros`` (rclpy).
Nodes never import either; they get a Runtime from :func:`kaitian_ros.runtime.create_runtime`.

Callbacks (subscriptions, timers, parameter changes) are always run one at a time on the
thread that calls :meth:`Runtime.spin`, like rclpy's single-threaded executor, so node state
needs no locks.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

ParameterValue = Any  # bool | int | float | str | list[float] | list[int] | list[str]


class QoS(enum.Enum):
    """The three QoS profiles nodes choose from (mapped to rclpy profiles / zenoh options)."""

    RELIABLE = "reliable"        # reliable, keep last 10, volatile: commands, telemetry, chunks
    BEST_EFFORT = "best_effort"  # qos_profile_sensor_data: camera frames; drop rather than block
    LATCHED = "latched"          # reliable + transient local, depth 1: state such as assignments


class ParameterType(enum.Enum):
    BOOL = "bool"
    INTEGER = "integer"
    DOUBLE = "double"
    STRING = "string"
    DOUBLE_ARRAY = "double_array"
    INTEGER_ARRAY = "integer_array"
    STRING_ARRAY = "string_array"


@dataclass(frozen=True)
class ParameterDescriptor:
    """What a node declares about a parameter (mirrors rcl_interfaces/ParameterDescriptor)."""

    name: str
    type: ParameterType
    default: ParameterValue
    description: str = ""
    min_value: float | None = None  # inclusive range for INTEGER / DOUBLE (element-wise for arrays)
    max_value: float | None = None
    read_only: bool = False
    choices: tuple[str, ...] = ()   # allowed values for STRING

    def check(self, value: ParameterValue) -> str:
        """'' if ``value`` is acceptable, else the reason it is refused."""
        try:
            coerced = coerce_parameter(self.type, value)
        except (TypeError, ValueError) as exc:
            return f"parameter '{self.name}' expects {self.type.value}: {exc}"
        items = coerced if isinstance(coerced, list) else [coerced]
        for item in items:
            if isinstance(item, float) and not math.isfinite(item):
                return f"parameter '{self.name}' must be finite, got {item}"
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                if self.min_value is not None and item < self.min_value:
                    return (f"parameter '{self.name}' = {item} is out of range "
                            f"[{self.min_value}, {self.max_value}]")
                if self.max_value is not None and item > self.max_value:
                    return (f"parameter '{self.name}' = {item} is out of range "
                            f"[{self.min_value}, {self.max_value}]")
        if self.choices and coerced not in self.choices:
            return f"parameter '{self.name}' = {coerced!r} is not one of {list(self.choices)}"
        return ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type.value, "default": self.default,
                "description": self.description, "min_value": self.min_value,
                "max_value": self.max_value, "read_only": self.read_only,
                "choices": list(self.choices)}


def coerce_parameter(kind: ParameterType, value: ParameterValue) -> ParameterValue:
    """Convert ``value`` to ``kind`` the way ROS 2 accepts it (int for double is fine, not vice versa)."""
    if kind is ParameterType.BOOL:
        if isinstance(value, bool):
            return value
        raise TypeError(f"got {type(value).__name__} {value!r}")
    if kind is ParameterType.INTEGER:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError(f"got {type(value).__name__} {value!r}")
    if kind is ParameterType.DOUBLE:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError(f"got {type(value).__name__} {value!r}")
    if kind is ParameterType.STRING:
        if isinstance(value, str):
            return value
        raise TypeError(f"got {type(value).__name__} {value!r}")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"got {type(value).__name__} {value!r}")
    inner = {ParameterType.DOUBLE_ARRAY: ParameterType.DOUBLE,
             ParameterType.INTEGER_ARRAY: ParameterType.INTEGER,
             ParameterType.STRING_ARRAY: ParameterType.STRING}[kind]
    return [coerce_parameter(inner, v) for v in value]


@dataclass(frozen=True)
class SetParametersResult:
    successful: bool
    reason: str = ""


@dataclass(frozen=True)
class MessageInfo:
    """Delivery facts of a message (``with_info=True`` subscriptions), like rclpy's MessageInfo."""

    received_s: float        # wall time the middleware handed it over (before the executor queue)
    source_timestamp_s: float  # wall time the publisher published it (0.0 if unknown)
    sequence: int = 0         # publisher's sequence number (0 if unknown)


ParametersCallback = Callable[[dict[str, ParameterValue]], SetParametersResult]


@dataclass
class RejectCounter:
    """Messages a node dropped, by reason; exposed in telemetry and /diagnostics."""

    counts: dict[str, int] = field(default_factory=dict)
    last_reason: str = ""

    def count(self, reason: str) -> None:
        key = reason.split(":", 1)[0]
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last_reason = reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class Publisher(Protocol):
    topic: str

    def publish(self, msg: Any) -> None: ...

    def publish_raw(self, cdr: bytes | memoryview) -> None: ...


class Subscription(Protocol):
    topic: str

    def destroy(self) -> None:
        """Stop receiving on this subscription (idempotent)."""


class Timer(Protocol):
    def cancel(self) -> None: ...


class Logger(Protocol):
    def debug(self, msg: str) -> None: ...

    def info(self, msg: str) -> None: ...

    def warning(self, msg: str) -> None: ...

    def error(self, msg: str) -> None: ...


class Runtime(Protocol):
    """What a node may use. Topics are ROS names ("/kaitian/fused", "telemetry" is relative)."""

    node_name: str
    namespace: str
    logger: Logger
    rejected: RejectCounter

    def create_publisher(self, topic: str, msg_type: str, qos: QoS = QoS.RELIABLE) -> Publisher: ...

    def create_subscription(self, topic: str, msg_type: str, callback: Callable[..., None],
                            qos: QoS = QoS.RELIABLE, *, with_info: bool = False) -> Subscription:
        """Deliver decoded messages to ``callback`` (``callback(msg, MessageInfo)`` with
        ``with_info``); undecodable ones are dropped and counted."""

    def create_timer(self, period_s: float, callback: Callable[[], None]) -> Timer: ...

    def declare_parameter(self, descriptor: ParameterDescriptor) -> ParameterValue:
        """Declare and return the value (overrides from the launch/params file win over default)."""

    def declare_parameters(self, descriptors: Sequence[ParameterDescriptor]) -> dict[str, ParameterValue]: ...

    def get_parameter(self, name: str) -> ParameterValue: ...

    def set_parameters(self, values: dict[str, ParameterValue]) -> SetParametersResult: ...

    def add_on_set_parameters_callback(self, callback: ParametersCallback) -> None:
        """``callback`` sees proposed values before they apply and may refuse with a reason."""

    def on_node_gone(self, callback: Callable[[str], None]) -> None:
        """``callback(fully qualified node name)`` on the executor when a node leaves the graph
        (its process ended or its session closed): a crash is seen in milliseconds instead of
        after a heartbeat timeout. A hung node that keeps its session is not gone."""

    def now(self) -> float:
        """Wall-clock seconds since the epoch."""

    def spin(self) -> None:
        """Run callbacks until shutdown (SIGINT/SIGTERM or :meth:`shutdown`)."""

    def spin_once(self, timeout_s: float = 0.0) -> None: ...

    def shutdown(self) -> None: ...

    def ok(self) -> bool: ...
