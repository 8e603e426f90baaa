"""/diagnostics publishing (diagnostic_msgs/DiagnosticArray), shared by every node."""

from __future__ import annotations

import enum
from typing import Any

from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import QoS, Runtime

DIAGNOSTICS_TOPIC = "/diagnostics"


class Level(enum.IntEnum):
    OK = 0
    WARN = 1
    ERROR = 2
    STALE = 3


class DiagnosticsPublisher:
    """One node's /diagnostics. Every status carries the node's dropped messages (``rejected``,
    ``rejected.<reason>`` counts since start, ``last_reject_reason``); a report that would be OK
    while messages were dropped since the previous report is raised to WARN, naming the newest
    reason, so every node type shows bad input the same way."""

    def __init__(self, rt: Runtime, hardware_id: str = "") -> None:
        self.rt = rt
        self.hardware_id = hardware_id
        self.pub = rt.create_publisher(DIAGNOSTICS_TOPIC, "DiagnosticArray", QoS.RELIABLE)
        self._reported_rejects = 0

    def status(self, level: Level, message: str, values: dict[str, Any], name: str | None = None) -> Any:
        kv = [interfaces.make("KeyValue", key=str(k), value=str(v)) for k, v in values.items()]
        return interfaces.make("DiagnosticStatus", level=int(level), name=name or f"kaitian: {self.rt.node_name}",
                               message=message, hardware_id=self.hardware_id, values=kv)

    def publish(self, level: Level, message: str, values: dict[str, Any], name: str | None = None) -> None:
        rejected = self.rt.rejected
        total = rejected.total
        values = dict(values) | {"rejected": total, "last_reject_reason": rejected.last_reason} | {
            f"rejected.{k}": v for k, v in sorted(rejected.counts.items())}
        new = total - self._reported_rejects
        self._reported_rejects = total
        if new > 0 and level == Level.OK:
            level = Level.WARN
            message = (f"{message}; dropped {new} message{'s' * (new != 1)} since the last report "
                       f"(last: {rejected.last_reason})")
        array = interfaces.make("DiagnosticArray", status=[self.status(level, message, values, name)])
        self.pub.publish(array)
