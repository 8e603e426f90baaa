"""The live view ``kaitian launch`` shows for inference scenarios, and the run's summary at exit.

It listens to the graph like any tool (``/kaitian/fused``, ``/kaitian/telemetry``,
``/kaitian/plan``, the coordinator's ``/diagnostics``) and shows fps, latency p50/p95 against
the plan's prediction, the running strategy and plan, per compute node its state, share, rows,
compute ms, link and drops (emulated speed labelled EMULATED), and the last result. Until
results flow it says what the graph waits for (loading the model, compute nodes, a plan).

On a terminal the view is a table redrawn in place (rich), and the launcher's node lines are
printed above it; anywhere else (pipes, CI) it prints plain ``[view]`` lines every few seconds.
With ``show=False`` (``--no-view``) it only counts, for the summary.
"""

from __future__ import annotations

import collections
import io
import math
import sys
import threading
import time
from typing import Any, TextIO, cast

from kaitian_ros import view_render as vr
from kaitian_ros.run_summary import RunSummary, RunTally, format_summary, percentile
from kaitian_ros.runtime.graph_client import GraphClient, GraphError
from kaitian_ros.scenario import Scenario

REFRESH_S = 2.0        # plain lines: one block every REFRESH_S
TTY_REFRESH_S = 0.5    # the table's redraw: cheap enough next to a graph on 2 cores
RECENT_S = 5.0         # fps and percentiles over the results of the last RECENT_S
SILENT_AFTER_S = 2.0   # a compute node without telemetry this long is shown SILENT
CONNECT_AFTER_S = 1.0  # the launcher starts the router first: connect once it can be up

# coordinator /diagnostics values the view uses (the rest of a status is not kept)
_STATUS_KEYS = ("plan_version", "predicted_ms", "planner", "links_in", "dropped_busy", "dropped_no_plan",
                "rejected", "last_reject_reason")


class LiveView:
    def __init__(self, router: str, scenario: Scenario, refresh_s: float | None = None, *,
                 show: bool = True, tty: bool | None = None, stream: TextIO | None = None) -> None:
        self.router = router
        self.scenario = scenario
        self.show = show
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.refresh_s = refresh_s if refresh_s is not None else (TTY_REFRESH_S if self.tty else REFRESH_S)
        self.client: GraphClient | None = None
        self.lock = threading.Lock()
        self.fused: collections.deque = collections.deque(maxlen=500)  # (arrival, latency, complete)
        self.tally = RunTally()
        self.last_result = ""  # the newest complete result's class, name, score
        self.nodes: dict[str, dict[str, Any]] = {}  # the scenario's compute nodes only
        self.compute_names = [n.name for n in scenario.compute_nodes()]
        self.coordinator_names = {n.name for n in scenario.nodes if n.executable == "coordinator"}
        self.strangers = 0  # telemetry from node ids the scenario does not have (counted, not kept)
        self.plan: Any = None
        self.plan_text = ""
        self.status: dict[str, str] = {}  # the coordinator's latest /diagnostics values (_STATUS_KEYS)
        self.subs: list[Any] = []
        self.started = time.monotonic()
        self.last_render = self.started
        self.live: Any = None  # rich.live.Live while the table is shown
        self.console: Any = None

    # --- listening --------------------------------------------------------------------
    def _connect(self) -> None:
        if self.client is not None or time.monotonic() - self.started < CONNECT_AFTER_S:
            return
        try:
            self.client = GraphClient(self.router)
        except GraphError:
            return
        self.subs = [
            self.client.subscribe("/kaitian/fused", "FusedOutput", self._on_fused),
            self.client.subscribe("/kaitian/telemetry", "NodeTelemetry", self._on_telemetry),
            self.client.subscribe("/kaitian/plan", "LoadAssignment", self._on_plan),
            self.client.subscribe("/diagnostics", "DiagnosticArray", self._on_diagnostics),
        ]

    def _on_fused(self, msg: Any, size: int) -> None:
        if msg is None:
            return
        with self.lock:
            self.fused.append((time.monotonic(), float(msg.latency_ms), bool(msg.complete)))
            self.tally.add_fused(float(msg.latency_ms), bool(msg.complete), str(msg.status))
            if msg.complete and msg.top_class >= 0:
                label = f" ({msg.top_label})" if msg.top_label else ""
                self.last_result = f"class {int(msg.top_class)}{label}, score {float(msg.top_score):.2f}"

    def _on_telemetry(self, msg: Any, size: int) -> None:
        if msg is None:
            return
        with self.lock:
            if msg.node_id not in self.compute_names:  # anyone can publish telemetry: keep no state for it
                self.strangers += 1
                return
            entry = self.nodes.setdefault(msg.node_id, {"ms": collections.deque(maxlen=20), "rows": None})
            entry.update(device=str(msg.device), emulated=bool(msg.emulated), slowdown=float(msg.emulated_slowdown),
                         seen=time.monotonic(), rejected=int(msg.rejected_count),
                         last_reject=str(msg.last_reject_reason))
            if msg.request_id:
                entry["ms"].append(float(msg.compute_ms))
                entry["rows"] = int(msg.rows)

    def _on_plan(self, msg: Any, size: int) -> None:
        if msg is None:
            return
        text = _describe_plan(msg)
        with self.lock:
            self.plan, self.plan_text = msg, text
            self.tally.add_plan(int(msg.incarnation), int(msg.version), text)

    def _on_diagnostics(self, msg: Any, size: int) -> None:
        if msg is None:
            return
        for status in msg.status:
            name = str(status.name).removeprefix("kaitian: ").rsplit("/", 1)[-1]
            if name in self.coordinator_names:
                values = {str(kv.key): str(kv.value) for kv in status.values if kv.key in _STATUS_KEYS}
                with self.lock:
                    self.status = values

    # --- showing ----------------------------------------------------------------------
    def tick(self) -> None:
        self._connect()
        if not self.show or time.monotonic() - self.last_render < self.refresh_s:
            return
        self.last_render = time.monotonic()
        try:
            if self.tty:
                self._draw()
            else:
                print(self.render(), file=self.stream, flush=True)
        except Exception as exc:  # noqa: BLE001 - a view that fails must not stop the graph it shows
            self._stop_live()
            self.show = False
            print(f"[view] stopped: {type(exc).__name__}: {exc}", file=self.stream, flush=True)

    def _draw(self) -> None:
        from rich.live import Live

        renderable = vr.rich_view(self.snapshot())
        if self.live is None:
            # redrawn by tick() only (no refresh thread): at most 1/TTY_REFRESH_S redraws a second
            self.live = Live(renderable, console=self.rich_console(), auto_refresh=False, transient=False,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start(refresh=True)
        else:
            self.live.update(renderable, refresh=True)

    def _stop_live(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            live.stop()

    def rich_console(self) -> Any:
        """The rich Console on this view's stream (the live table and the node lines share it)."""
        if self.console is None:
            from rich.console import Console

            self.console = Console(file=self.stream, highlight=False, markup=False, emoji=False)
        return self.console

    @property
    def output(self) -> TextIO:
        """Where the launcher's node lines go: above the table on a terminal, else the stream."""
        if self.show and self.tty:
            return cast(TextIO, _ConsoleLines(self))  # a TextIOBase that implements write/flush
        return self.stream

    def render(self) -> str:
        """The current state as plain ``[view]`` lines."""
        return vr.plain_text(self.snapshot())

    def snapshot(self) -> vr.ViewSnapshot:
        now = time.monotonic()
        with self.lock:
            recent = [f for f in self.fused if now - f[0] <= RECENT_S]
            first = self.fused[0][0] if self.fused else now
            plan, plan_text, status = self.plan, self.plan_text, dict(self.status)
            nodes = {k: dict(v, ms=sorted(v["ms"])) for k, v in self.nodes.items()}
            frames, strangers, last = self.tally.frames, self.strangers, self.last_result
        lat = sorted(f[1] for f in recent if f[2])
        window = min(RECENT_S, max(1.0, now - first))
        shares = dict(zip(plan.node_ids, plan.shares)) if plan is not None else {}
        links = _links(status.get("links_in", ""))
        rows = []
        for name in self.compute_names:
            n = nodes.get(name)
            if n is None:
                rows.append(vr.NodeRow(name, vr.LOADING_MODEL))
                continue
            rows.append(vr.NodeRow(
                name, vr.ALIVE if now - n["seen"] < SILENT_AFTER_S else vr.SILENT, device=n["device"],
                slowdown=n["slowdown"] if n["emulated"] else None,
                # rows of its last request: stale once the plan gave it none
                share=float(shares[name]) if shares.get(name) else None,
                rows=n["rows"] if shares.get(name) else None,
                compute_ms=n["ms"][len(n["ms"]) // 2] if n["ms"] else None, link=links.get(name, ""),
                dropped=n["rejected"], last_drop=n["last_reject"] if n["rejected"] else ""))
        predicted = _number(status.get("predicted_ms")) \
            if plan is not None and status.get("plan_version") == str(plan.version) else None
        if predicted is None and plan is not None and plan.predicted_makespan_ms > 0:
            predicted = float(plan.predicted_makespan_ms)
        return vr.ViewSnapshot(
            elapsed_s=now - self.started, phase=_phase(status, nodes, plan, frames), fps=len(recent) / window,
            p50_ms=percentile(lat, 0.5), p95_ms=percentile(lat, 0.95),
            recent_incomplete=sum(1 for f in recent if not f[2]), frames=frames,
            plan_version=int(plan.version) if plan is not None else 0,
            strategy=str(plan.strategy or "stripes") if plan is not None else "", plan=plan_text,
            predicted_ms=predicted, runner_up=str(plan.runner_up) if plan is not None else "",
            runner_up_ms=float(plan.runner_up_ms) if plan is not None and plan.runner_up else None,
            planner=status.get("planner", ""), drops=tuple(_drops(status, {}).items()), last_result=last,
            nodes=tuple(rows), strangers=strangers)

    # --- the end ----------------------------------------------------------------------
    def summary(self) -> RunSummary:
        with self.lock:
            status = dict(self.status)
            rejected = {k: v["rejected"] for k, v in self.nodes.items()}
            return self.tally.summary(time.monotonic() - self.started, _drops(status, rejected))

    def summary_text(self) -> str:
        return format_summary(self.summary())

    def close(self) -> None:
        """Stop listening (the last table stays on the terminal)."""
        if self.live is not None and self.show:
            self.live.update(vr.rich_view(self.snapshot()), refresh=True)
        self._stop_live()
        self.subs.clear()
        if self.client is not None:
            self.client.close()
            self.client = None


class _ConsoleLines(io.TextIOBase):
    """A TextIO for the launcher's lines that prints each through the view's console, above
    the table being redrawn (a plain write would land inside it)."""

    def __init__(self, view: LiveView) -> None:
        self.view = view
        self.partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        from rich.text import Text

        self.partial += text
        *done, self.partial = self.partial.split("\n")
        for line in done:
            self.view.rich_console().print(Text(line), soft_wrap=True)
        return len(text)


def _phase(status: dict[str, str], nodes: dict[str, Any], plan: Any, frames: int) -> str:
    """What the graph waits for: nothing has reported yet while processes import torch and
    build the model; then compute nodes, a plan, the first frame."""
    if frames:
        return vr.RUNNING
    if not status and not nodes:
        return vr.LOADING_MODEL
    if not nodes:
        return vr.WAITING_FOR_NODES
    if plan is None:
        return vr.WAITING_FOR_PLAN
    return vr.WAITING_FOR_FRAMES


def _drops(status: dict[str, str], rejected_by_node: dict[str, int]) -> dict[str, int]:
    """What was dropped, by reason: the coordinator's counts, each compute node's rejected messages."""
    out = {"frames (coordinator busy)": _count(status.get("dropped_busy")),
           "frames (no plan yet)": _count(status.get("dropped_no_plan")),
           "messages rejected by the coordinator": _count(status.get("rejected"))}
    for name, n in sorted(rejected_by_node.items()):
        out[f"messages rejected by {name}"] = n
    return {k: v for k, v in out.items() if v > 0}


def _describe_plan(msg: Any) -> str:
    """The plan in words (``stripes compute_0 0.67/compute_1 0.33``), as the coordinator says it."""
    from kaitian_ros.nodes.inference_common import spec_from_msg

    try:
        return spec_from_msg(msg).describe()
    except (ValueError, TypeError, IndexError) as exc:
        return f"unreadable plan v{getattr(msg, 'version', '?')}: {exc}"


def _links(text: str) -> dict[str, str]:
    """``compute_0:800Mbit/0.12ms,compute_1:...`` (the coordinator's ``links_in``) by node."""
    out = {}
    for item in text.split(","):
        name, _, value = item.partition(":")
        if value:
            out[name] = value
    return out


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _count(text: str | None) -> int:
    value = _number(text)
    return int(value) if value is not None and math.isfinite(value) and value > 0 else 0
