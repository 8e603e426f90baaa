"""The live terminal view ``kaitian launch`` shows for inference scenarios: fps, latency
p50/p95, the plan in effect (strategy, predicted latency, runner-up), and per compute node its
share, rows and ms (emulated speed is labelled)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from kaitian_ros.runtime.graph_client import GraphClient, GraphError
from kaitian_ros.scenario import Scenario

REFRESH_S = 2.0


class LiveView:
    def __init__(self, router: str, scenario: Scenario, refresh_s: float = REFRESH_S) -> None:
        self.router = router
        self.scenario = scenario
        self.refresh_s = refresh_s
        self.client: GraphClient | None = None
        self.lock = threading.Lock()
        self.fused: collections.deque = collections.deque(maxlen=500)  # (arrival, latency, complete)
        self.last_result: tuple[int, str, float] | None = None  # the newest complete result's class, name, score
        self.nodes: dict[str, dict[str, Any]] = {}  # the scenario's compute nodes only
        self.compute_names = {n.name for n in scenario.compute_nodes()}
        self.strangers = 0  # telemetry from node ids the scenario does not have (counted, not kept)
        self.plan: Any = None
        self.subs: list[Any] = []
        self.last_render = time.monotonic()
        self.started = time.monotonic()

    def _connect(self) -> None:
        # the launcher starts the router; connect once it is up
        if self.client is not None or time.monotonic() - self.started < 1.0:
            return
        try:
            self.client = GraphClient(self.router)
        except GraphError:
            return
        self.subs = [
            self.client.subscribe("/kaitian/fused", "FusedOutput", self._on_fused),
            self.client.subscribe("/kaitian/telemetry", "NodeTelemetry", self._on_telemetry),
            self.client.subscribe("/kaitian/plan", "LoadAssignment", self._on_plan),
        ]

    def _on_fused(self, msg: Any, size: int) -> None:
        if msg is not None:
            with self.lock:
                self.fused.append((time.monotonic(), float(msg.latency_ms), bool(msg.complete)))
                if msg.complete and msg.top_class >= 0:
                    self.last_result = (int(msg.top_class), str(msg.top_label), float(msg.top_score))

    def _on_telemetry(self, msg: Any, size: int) -> None:
        if msg is None:
            return
        with self.lock:
            if msg.node_id not in self.compute_names:  # anyone can publish telemetry: keep no state for it
                self.strangers += 1
                return
            entry = self.nodes.setdefault(msg.node_id, {"ms": collections.deque(maxlen=20), "rows": 0})
            entry.update(device=msg.device, emulated=msg.emulated, slowdown=msg.emulated_slowdown,
                         seen=time.monotonic(), rejected=msg.rejected_count)
            if msg.request_id:
                entry["ms"].append(float(msg.compute_ms))
                entry["rows"] = int(msg.rows)

    def _on_plan(self, msg: Any, size: int) -> None:
        if msg is not None:
            with self.lock:
                self.plan = msg

    def tick(self) -> None:
        self._connect()
        if self.client is None or time.monotonic() - self.last_render < self.refresh_s:
            return
        self.last_render = time.monotonic()
        print(self.render(), flush=True)

    def render(self) -> str:
        now = time.monotonic()
        with self.lock:
            recent = [f for f in self.fused if now - f[0] <= 5.0]
            lat = sorted(f[1] for f in recent if f[2])
            incomplete = sum(1 for f in recent if not f[2])
            plan = self.plan
            shares = dict(zip(plan.node_ids, plan.shares)) if plan is not None else {}
            version = plan.version if plan is not None else 0
            nodes = {k: dict(v, ms=list(v["ms"])) for k, v in self.nodes.items()}
            strangers = self.strangers
            last = self.last_result
        fps = len(recent) / 5.0
        p50 = lat[len(lat) // 2] if lat else float("nan")
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan")
        lines = [f"[view] {fps:5.1f} fps | latency p50 {p50:7.1f} ms  p95 {p95:7.1f} ms | "
                 f"plan v{version}" + (f" | {incomplete} incomplete" if incomplete else "")]
        if plan is not None and plan.strategy:
            line = f"[view]   plan: {plan.strategy}, predicted {plan.predicted_makespan_ms:.1f} ms"
            if plan.runner_up:
                line += f"; runner-up {plan.runner_up} {plan.runner_up_ms:.1f} ms"
            lines.append(_printable(line))
        if last is not None:
            cls, label, score = last
            lines.append(_printable(f"[view]   last result: class {cls}" + (f" ({label})" if label else "")
                                    + f", score {score:.2f}"))
        for name in sorted(nodes):
            n = nodes[name]
            ms = sorted(n["ms"])
            med = ms[len(ms) // 2] if ms else float("nan")
            alive = "alive" if now - n.get("seen", 0) < 2.0 else "SILENT"
            emu = f" EMULATED x{n['slowdown']:.1f}" if n.get("emulated") else ""
            lines.append(_printable(
                f"[view]   {name:<12} {n.get('device', '?'):<6}{emu:<16} share {shares.get(name, 0.0):5.2f}"
                f"  rows {n['rows']:4d}  {med:7.1f} ms  {alive}  dropped {n.get('rejected', 0)}"))
        if strangers:
            lines.append(f"[view]   {strangers} telemetry messages from nodes not in the scenario (ignored)")
        return "\n".join(lines)

    def close(self) -> None:
        self.subs.clear()
        if self.client is not None:
            self.client.close()
            self.client = None


def _printable(text: str) -> str:
    """Text from the wire with control characters shown escaped, not sent to the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
