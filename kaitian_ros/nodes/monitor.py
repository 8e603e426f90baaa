"""monitor node: watches an image topic and reports its rate and size on /diagnostics.

It is what makes ``camera_demo`` show a working graph before any inference node exists, and a
handy probe on any camera topic.
"""

from __future__ import annotations

import time
from typing import Any

from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime
from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher, Level

PARAMETERS = (
    P("input_topic", T.STRING, "/camera/image_raw", "image topic to watch", read_only=True),
    P("report_period_s", T.DOUBLE, 1.0, "seconds between reports", 0.1, 60.0),
    P("expected_rate_hz", T.DOUBLE, 0.0, "warn below half this rate (0 = no expectation)", 0.0, 1000.0),
)


class Monitor:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        rt.add_on_set_parameters_callback(self._on_set)
        self.frames = 0
        self.window_frames = 0
        self.window_start = time.monotonic()
        self.last: Any = None
        rt.create_subscription(self.params["input_topic"], "Image", self._on_image, QoS.BEST_EFFORT)
        self.diagnostics = DiagnosticsPublisher(rt, hardware_id="cpu")
        self.timer = rt.create_timer(self.params["report_period_s"], self._report)

    def _on_set(self, changes: dict[str, Any]) -> Any:
        from kaitian_ros.runtime.api import SetParametersResult

        self.params |= changes
        if "report_period_s" in changes:
            self.timer.cancel()
            self.timer = self.rt.create_timer(changes["report_period_s"], self._report)
        return SetParametersResult(True)

    def _on_image(self, msg: Any) -> None:
        self.frames += 1
        self.window_frames += 1
        self.last = msg

    def _report(self) -> None:
        elapsed = max(time.monotonic() - self.window_start, 1e-9)
        rate = self.window_frames / elapsed
        self.window_start, self.window_frames = time.monotonic(), 0
        expected = self.params["expected_rate_hz"]
        if self.last is None:
            level, text = Level.WARN, f"no image on {self.params['input_topic']} yet"
        elif expected and rate < 0.5 * expected:
            level, text = Level.WARN, f"{rate:.1f} Hz, expected {expected:.1f} Hz"
        else:
            level, text = Level.OK, f"{rate:.1f} Hz"
        values: dict = {"frames": self.frames, "rate_hz": f"{rate:.2f}"}  # dropped messages: added by publish
        if self.last is not None:
            values |= {"width": self.last.width, "height": self.last.height, "encoding": self.last.encoding,
                       "latency_ms": f"{(time.time() - interfaces.stamp_to_s(self.last.header.stamp)) * 1e3:.1f}"}
        self.diagnostics.publish(level, text, values)
        self.rt.logger.info(f"{self.params['input_topic']}: {text}, {self.frames} frames")


def main(argv: list[str] | None = None) -> int:
    return run_node(Monitor, "monitor", argv)


if __name__ == "__main__":
    raise SystemExit(main())
