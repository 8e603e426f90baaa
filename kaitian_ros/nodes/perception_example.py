"""perception_example node: what a perception node downstream of the collaborative inference
looks like. It subscribes to ``/kaitian/fused`` and logs, per result, the request id, the top
class (with its name, when the coordinator has ``labels``: ``FusedOutput.top_label``), its
score, the latency and whether the result is complete.

The class and score come from the result tensor itself, decoded with the package's helper
(``interfaces.array_from_fields``), as a node that uses more than the top class would read it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime, SetParametersResult

PARAMETERS = (
    P("input_topic", T.STRING, proto.FUSED_TOPIC, "FusedOutput topic to read", read_only=True),
)


def top_class(msg: Any) -> tuple[int, float] | None:
    """(class, softmax probability) of a classifier's result, None for any other result shape.

    Raises interfaces.DecodeError if the tensor fields do not describe the data."""
    logits = interfaces.array_from_fields(msg)
    if (int(msg.dtype_code), int(msg.dtype_bits)) == (4, 16):  # bfloat16 arrives as its uint16 bits
        logits = (logits.astype(np.uint32) << 16).view(np.float32)
    if logits.ndim != 2 or logits.shape[1] < 2:
        return None
    scores = logits[0].astype(np.float64)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    best = int(probs.argmax())
    return best, float(probs[best])


class PerceptionExample:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        rt.add_on_set_parameters_callback(self._on_set)
        self.results = 0
        self.incomplete = 0
        rt.create_subscription(self.params["input_topic"], "FusedOutput", self._on_fused, QoS.RELIABLE)
        rt.logger.info(f"listening on {self.params['input_topic']}")

    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        self.params |= changes
        return SetParametersResult(True)

    def _on_fused(self, msg: Any) -> None:
        self.results += 1
        # latency: the coordinator's (image in -> result out); age: camera stamp -> this node
        age_ms = (time.time() - interfaces.stamp_to_s(msg.header.stamp)) * 1e3
        timing = f"latency {msg.latency_ms:.1f} ms, age {age_ms:.1f} ms"
        if not msg.complete:
            self.incomplete += 1
            self.rt.logger.warning(f"request {msg.request_id}: incomplete ({msg.status}), {timing}")
            return
        try:
            top = top_class(msg)
        except interfaces.DecodeError as exc:  # a complete result whose tensor does not add up
            self.rt.logger.warning(f"request {msg.request_id}: undecodable result ({exc}), {timing}")
            return
        if top is None:
            shape = tuple(int(s) for s in msg.shape)
            self.rt.logger.info(f"request {msg.request_id}: result shape {shape}, {timing}, complete")
            return
        index, score = top
        # the coordinator names its own top class; the name belongs to this index only if they agree
        name = f" ({msg.top_label})" if msg.top_label and index == msg.top_class else ""
        self.rt.logger.info(f"request {msg.request_id}: class {index}{name} score {score:.3f}, {timing}, complete")

    def close(self) -> None:
        self.rt.logger.info(f"{self.results} results, {self.incomplete} incomplete")


def main(argv: list[str] | None = None) -> int:
    return run_node(PerceptionExample, "perception_example", argv)


if __name__ == "__main__":
    raise SystemExit(main())
