"""The launch view keeps state only for the scenario's compute nodes and never prints control
characters from the wire (messages fed to its handlers directly; no graph needed)."""

from __future__ import annotations

from kaitian_ros.live_view import LiveView
from kaitian_ros.runtime import interfaces
from kaitian_ros.scenario import load_scenario


def _telemetry(node_id: str, **fields) -> object:
    return interfaces.make("NodeTelemetry", node_id=node_id, request_id=fields.pop("request_id", 7),
                           rows=8, compute_ms=12.5, **fields)


def test_view_ignores_unknown_node_ids_and_escapes_control_characters():
    view = LiveView("tcp/127.0.0.1:1", load_scenario("hetero_inference", ["compute_nodes:=2"]))
    for i in range(5000):  # a flood of made-up node ids
        view._on_telemetry(_telemetry(f"ghost_{i}"), 0)
    view._on_telemetry(_telemetry("compute_0", device="cpu\x1b[2J\x07"), 0)
    assert set(view.nodes) == {"compute_0"}
    text = view.render()
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text, text
    assert "5000 telemetry messages from nodes not in the scenario" in text
    assert "ghost" not in text
