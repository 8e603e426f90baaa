"""Helpers for the inference integration tests: a launched graph without image_source, the
test acting as the camera, and the single-device reference result for a frame.

The graph is started with :class:`kaitian_ros.launcher.Launcher` on a router bound to a free
port. The launcher is never asked to ``wait()``, so a compute node killed by a test does not
stop the graph (the launcher only treats a death as fatal while supervising); ``close()``
stops whatever is still running.

The graphs of one test process fork their nodes from one fork server (`shared_fork_server`):
its imports (about 2 s of CPU) are paid once per pytest worker instead of once per graph.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from helpers import Collector, wait_until

from kaitian_ros.core.tensors import image_to_array, preprocess, relative_error
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.api import QoS

CAMERA_TOPIC = "/camera/image_raw"
TOLERANCE = 1e-4  # max abs error relative to the reference's max magnitude (docs/planner.md, "Strategies")
_fork_server: Any = None


def shared_fork_server() -> Any:
    """This test process's fork server, started on first use from the main thread (a server
    dies with the thread that started it), or True - the launcher starts its own - elsewhere or
    when it cannot start. Ended by `atexit`."""
    import atexit

    from kaitian_ros.fork_server import ForkServer

    global _fork_server
    if threading.current_thread() is not threading.main_thread():
        return True
    if _fork_server is None or not _fork_server.alive():
        _fork_server = ForkServer.start(dict(os.environ, KAITIAN_RUNTIME="embedded", PYTHONUNBUFFERED="1"))
        if _fork_server is None:
            return True
        atexit.register(_fork_server.close)
    return _fork_server


STARTUP_S = 45.0  # liveness deadline for a graph to come up on 2 busy cores (not a perf check)


def scenario_dict(*, model: str, height: int, width: int, channels: int = 3, num_classes: int = 10,
                  slowdowns: Sequence[float], shares: Sequence[float], slab_rows: int = 4,
                  weights: str = "", coordinator: dict[str, Any] | None = None,
                  compute: dict[str, Any] | None = None,
                  devices: Sequence[str] | None = None) -> dict[str, Any]:
    """A hetero_inference-like graph (coordinator + compute_i), no image_source, no scheduler.

    The coordinator splits into stripes (``coordinator={"strategy": "auto"}`` lets it choose)
    and keeps its first plan unless another is predicted twice as fast (``min_plan_gain`` 1.0):
    these tests check results against the plan that ran, not the planner's taste."""
    model_params = {"model": model, "input_height": height, "input_width": width,
                    "input_channels": channels, "num_classes": num_classes, "seed": 0, "weights": weights,
                    "slab_rows": slab_rows}
    names = [f"compute_{i}" for i in range(len(slowdowns))]
    graph: dict[str, Any] = {"coordinator": {"ros__parameters": {
        "executable": "coordinator", "input_topic": CAMERA_TOPIC, "compute_nodes": names,
        "static_shares": [float(s) for s in shares], "use_scheduler": False, "max_in_flight": 4,
        "request_timeout_s": 30.0, "dead_after_s": 1.5, "strategy": "stripes", "min_plan_gain": 1.0,
        **model_params, **(coordinator or {})}}}
    for name, slowdown, device in zip(names, slowdowns, devices or ["cpu"] * len(names)):
        graph[name] = {"ros__parameters": {
            "executable": "compute", "device": device, "threads": 1,
            "emulated_slowdown": float(slowdown), **model_params, **(compute or {})}}
    return graph


def synthetic_image(index: int, height: int, width: int, channels: int = 3) -> np.ndarray:
    """Distinct, deterministic uint8 content per index (a seeded pattern plus noise)."""
    rng = np.random.default_rng(1000 + index)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = 127.5 * (1 + np.sin(x / width * 6.28 * (1 + index % 3) + index) *
                    np.cos(y / height * 6.28 * (1 + index % 2) - index))
    img = base[:, :, None] + rng.normal(0, 25, (height, width, channels))
    return np.clip(img, 0, 255).astype(np.uint8)


def image_msg(pixels: np.ndarray, index: int, encoding: str = "rgb8") -> Any:
    """sensor_msgs/Image of ``pixels`` with a stamp and frame_id unique to ``index``."""
    height, width, channels = pixels.shape
    stamp = interfaces.msg_class("Time")(sec=1_000 + index, nanosec=index * 1000 + 7)
    return interfaces.make("Image", header=interfaces.header(f"frame{index}", stamp), height=height,
                           width=width, encoding=encoding, is_bigendian=0, step=width * channels,
                           data=np.ascontiguousarray(pixels).reshape(-1))


class TimedCollector(Collector):
    """A Collector that also keeps each message's arrival time (time.monotonic())."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[float] = []

    def __call__(self, item: Any) -> None:
        with self.lock:
            self.items.append(item)
            self.arrived.append(time.monotonic())

    def timed(self) -> list[tuple[float, Any]]:
        with self.lock:
            return list(zip(self.arrived, self.items))


class Camera:
    """The test's own node (``test_camera``): an EmbeddedRuntime spinning on a thread."""

    def __init__(self, endpoint: str) -> None:
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.node_args import NodeArgs

        self.rt = EmbeddedRuntime(NodeArgs("test_camera"), router=endpoint)
        self.thread = threading.Thread(target=self.rt.spin, daemon=True)
        self.thread.start()

    def collect(self, topic: str, msg_type: str, qos: QoS = QoS.RELIABLE) -> TimedCollector:
        sink = TimedCollector()
        self.rt.create_subscription(topic, msg_type, sink, qos)
        return sink

    def close(self) -> None:
        self.rt.shutdown()
        self.thread.join(timeout=5.0)
        self.rt.close()


class InferenceGraph:
    """coordinator + compute nodes as real processes, plus an in-process camera/probe node."""

    def __init__(self, tmp_path: Path, *, supervise: bool = False, **scenario: Any) -> None:
        """``supervise``: the launcher supervises on a thread as ``kaitian launch`` does (nodes
        with respawn are restarted; one that dies for good stops the graph)."""
        from kaitian_ros.launcher import start_on_free_port
        from kaitian_ros.processes import CapturedOutput
        from kaitian_ros.scenario import load_scenario

        self.config = scenario_dict(**scenario)
        self.compute_names = [n for n in self.config if n.startswith("compute_")]
        params = self.config["coordinator"]["ros__parameters"]
        self.spec = ic.ModelSpec.from_params(params)
        path = Path(tmp_path) / "inference_test.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.scenario = load_scenario(str(path))
        self.out = CapturedOutput(echo=bool(os.environ.get("KT_ECHO")))  # KT_ECHO=1: print the nodes
        self.probe: Camera | None = None
        self._client: Any = None
        self.launcher = start_on_free_port(self.scenario, out=self.out, fork=shared_fork_server())
        self.endpoint = self.launcher.router_endpoint
        self.supervisor: threading.Thread | None = None
        if supervise:
            self.supervisor = threading.Thread(target=self.launcher.wait, daemon=True)
            self.supervisor.start()
        try:
            self.probe = Camera(self.endpoint)
            self.fused = self.probe.collect(proto.FUSED_TOPIC, "FusedOutput")
            self.plans = self.probe.collect(proto.PLAN_TOPIC, "LoadAssignment", QoS.LATCHED)
            self.telemetry = self.probe.collect(proto.TELEMETRY_TOPIC, "NodeTelemetry")
            self.diagnostics = self.probe.collect("/diagnostics", "DiagnosticArray")
            # a RELIABLE camera (compatible with the coordinator's best-effort subscription, as
            # in ROS 2): a best-effort publisher may drop a frame under load (zenoh congestion
            # control DROP), and these tests count frames
            self.camera = self.probe.rt.create_publisher(CAMERA_TOPIC, "Image", QoS.RELIABLE)
            self._graph = None
        except BaseException:
            self.close()
            raise

    # --- lifecycle ------------------------------------------------------------------------
    def pid(self, name: str) -> int:
        """The pid of ``name``'s current process (a respawned node's new one)."""
        for child in self.launcher.children:
            if child.spec.name == name:
                return child.process.pid
        raise KeyError(name)

    def pid_from_output(self, name: str) -> int:
        match = re.search(rf"started {re.escape(name)} \(compute\) pid (\d+)", self.out.text())
        assert match, f"no 'started {name}' line in the launcher output:\n{self.out.text()}"
        return int(match.group(1))

    def dead_children(self) -> list[str]:
        return [c.spec.name for c in self.launcher.children if c.process.poll() is not None]

    def wait_ready(self, nodes: Sequence[str] | None = None, timeout_s: float = STARTUP_S) -> Any:
        """Until the coordinator's latest plan names ``nodes`` (default: every compute node)."""
        want = tuple(nodes if nodes is not None else self.compute_names)

        def ready() -> Any:
            dead = self.dead_children()
            assert not dead, f"node(s) {dead} exited during startup:\n{self.out.text()}"
            plan = self.latest_plan()
            heartbeats = {t.node_id for t in self.telemetry.snapshot()}
            if plan is not None and tuple(plan.node_ids) == want and set(want) <= heartbeats:
                return plan
            return None

        try:
            return wait_until(ready, f"a plan naming {list(want)}", timeout_s, interval_s=0.1)
        except AssertionError as exc:
            # what this test's subscriptions saw last: a CI log keeps a failure's last line
            plans = [(int(p.version), list(p.node_ids)) for p in self.plans.snapshot()]
            heartbeats = sorted({t.node_id for t in self.telemetry.snapshot()})
            raise AssertionError(f"{exc}\n--- launcher output ---\n{self.out.text()}\n"
                                 f"plans seen here: {plans}; heartbeats seen from: {heartbeats}") from None

    def latest_plan(self) -> Any:
        """The plan announced last (a restarted coordinator numbers from 1 again)."""
        plans = self.plans.snapshot()
        return plans[-1] if plans else None

    def probe_client(self) -> Any:
        """A GraphClient on this graph's router (what ``kaitian param`` uses)."""
        from kaitian_ros.runtime.graph_client import GraphClient

        if self._client is None:
            self._client = GraphClient(router=self.endpoint)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        if self.launcher is not None:
            self.launcher.request_stop()
            if self.supervisor is not None:
                self.supervisor.join(timeout=30.0)
            self.launcher.stop()

    def __enter__(self) -> InferenceGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- frames ---------------------------------------------------------------------------
    def frames(self, count: int, first: int = 0) -> list[tuple[np.ndarray, Any]]:
        _, h, w = self.spec.input_shape
        # the camera sends a different size than the model input: the coordinator resizes
        out = []
        for i in range(first, first + count):
            pixels = synthetic_image(i, h + 8, w + 16, 3)
            out.append((pixels, image_msg(pixels, i)))
        return out

    def publish(self, msg: Any) -> None:
        self.camera.publish(msg)

    def stream(self, frames: Sequence[tuple[np.ndarray, Any]], window: int = 2,
               timeout_s: float = 60.0, on_sent: Any = None) -> dict[tuple[int, int], Any]:
        """Publish frames keeping at most ``window`` unanswered (so the coordinator never drops
        one as busy); return FusedOutput by image stamp once every frame has its answer."""
        already = len(self.fused)
        for i, (_, msg) in enumerate(frames):
            try:
                wait_until(lambda i=i: len(self.fused) - already >= i + 1 - window,
                           f"answers to {i + 1 - window} frame(s)", timeout_s, interval_s=0.01)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- launcher output ---\n{self.out.text()}") from None
            self.publish(msg)
            if on_sent is not None:
                on_sent(i)
        wanted = {interfaces.stamp_key(m.header.stamp) for _, m in frames}
        try:
            wait_until(lambda: wanted <= {interfaces.stamp_key(f.header.stamp)
                                          for f in self.fused.snapshot()[already:]},
                       f"a FusedOutput for each of {len(frames)} frames", timeout_s, interval_s=0.02)
        except AssertionError as exc:
            got = [(int(f.request_id), f.header.frame_id, f.status) for f in self.fused.snapshot()[already:]]
            coordinator = (self.diagnostics_of("coordinator") or [{}])[-1]
            raise AssertionError(f"{exc}; got {got}; coordinator /diagnostics {coordinator}"
                                 f"\n--- launcher output ---\n{self.out.text()}") from None
        by_stamp: dict[tuple[int, int], Any] = {}
        for f in self.fused.snapshot()[already:]:
            key = interfaces.stamp_key(f.header.stamp)
            assert key not in by_stamp, f"two FusedOutputs for frame stamp {key}"
            by_stamp[key] = f
        return by_stamp

    # --- the single-device reference ------------------------------------------------------
    @property
    def graph(self) -> Any:
        if self._graph is None:
            self._graph = ic.build_graph(self.spec)
        return self._graph

    def reference(self, pixels: np.ndarray, encoding: str = "rgb8") -> torch.Tensor:
        """The head output of the whole model on one device, on the coordinator's preprocessing."""
        c, h, w = self.spec.input_shape
        height, width, channels = pixels.shape
        arr = image_to_array(np.ascontiguousarray(pixels).reshape(-1), height, width, encoding,
                             width * channels)
        x = preprocess(arr, h, w, c, normalise=True)
        with torch.no_grad():
            return self.graph.run_head(self.graph.run_trunk(x))

    def check_outputs(self, frames: Sequence[tuple[np.ndarray, Any]],
                      by_stamp: dict[tuple[int, int], Any]) -> list[Any]:
        """Every frame's FusedOutput is complete and equals the reference; request ids unique."""
        outputs = []
        for pixels, msg in frames:
            fused = by_stamp[interfaces.stamp_key(msg.header.stamp)]
            assert fused.complete, f"frame {msg.header.frame_id}: incomplete ({fused.status})"
            assert fused.status == "ok", fused.status
            assert fused.header.frame_id == msg.header.frame_id
            result = interfaces.tensor_from_fields(fused).float()
            ref = self.reference(pixels)
            assert tuple(result.shape) == tuple(ref.shape), (tuple(result.shape), tuple(ref.shape))
            err = relative_error(result, ref)
            assert err <= TOLERANCE, f"frame {msg.header.frame_id}: relative error {err:.2e} > {TOLERANCE}"
            assert sum(int(r) for r in fused.node_rows) == self.graph.trunk_output_shape[1]
            nodes, rows = self.expected_rows(fused.plan_version)
            assert (list(fused.node_ids), [int(r) for r in fused.node_rows]) == (nodes, rows), \
                f"frame {msg.header.frame_id}: per-node rows differ from plan v{fused.plan_version}"
            outputs.append(fused)
        ids = [int(f.request_id) for f in outputs]
        assert len(set(ids)) == len(ids), f"request ids not unique: {ids}"
        return outputs

    def executed_plan(self, version: int) -> Any:
        """The Plan of a version the coordinator announced on /kaitian/plan (rebuilt here)."""
        # newest first: a restarted coordinator numbers its plans from 1 again
        pv = next((p for p in reversed(self.plans.snapshot()) if int(p.version) == int(version)), None)
        assert pv is not None, f"plan v{version} was never announced on {proto.PLAN_TOPIC}"
        slab = self.config["coordinator"]["ros__parameters"]["slab_rows"]
        return ic.plan_from_msg(self.graph, pv, slab)

    def expected_rows(self, version: int) -> tuple[list[str], list[int]]:
        """(active nodes, trunk-output rows of each) under plan ``version``."""
        plan = self.executed_plan(version)
        nodes = list(plan.active_nodes())
        return nodes, [b - a for a, b in (plan.output_rows_for(n) for n in nodes)]

    # --- node state ---------------------------------------------------------------------------
    def diagnostics_of(self, node: str) -> list[dict[str, str]]:
        """Key/value dicts of every /diagnostics status published by ``node``, oldest first
        (with its level as ``_level``, 0 OK/1 WARN/2 ERROR, and its text as ``_message``)."""
        out = []
        for array in self.diagnostics.snapshot():
            for status in array.status:
                if status.name == f"kaitian: {node}":
                    level = status.level[0] if isinstance(status.level, (bytes, bytearray)) else int(status.level)
                    out.append({kv.key: kv.value for kv in status.values}
                               | {"_level": level, "_message": status.message})
        return out

    def heartbeats_of(self, node: str) -> list[Any]:
        return [t for t in self.telemetry.snapshot() if t.node_id == node]


__all__ = [
    "TOLERANCE",
    "Collector",
    "InferenceGraph",
    "image_msg",
    "scenario_dict",
    "synthetic_image",
    "wait_until",
]
