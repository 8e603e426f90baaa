"""What the live view of ``kaitian launch`` shows, as a value (:class:`ViewSnapshot`), and its
two renderings: a rich table redrawn in place on a terminal, plain ``[view]`` lines elsewhere
(pipes, CI logs: no escape codes). Every string that came over the wire is escaped here."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kaitian_ros.terminal_text import printable

# what the graph is waiting for before results flow ("" once they do)
LOADING_MODEL = "loading model"
WAITING_FOR_NODES = "waiting for compute nodes"
WAITING_FOR_PLAN = "waiting for the first plan"
WAITING_FOR_FRAMES = "waiting for the first frame"
RUNNING = ""

ALIVE = "alive"
SILENT = "SILENT"


@dataclass(frozen=True)
class NodeRow:
    name: str
    state: str                    # LOADING_MODEL before its first telemetry, ALIVE, SILENT
    device: str = ""
    slowdown: float | None = None  # the EMULATED slowdown in force, None at real speed
    share: float | None = None    # its share in the running plan, None when not in it
    rows: int | None = None       # output rows of its last request
    compute_ms: float | None = None  # median over its last requests
    link: str = ""                # the coordinator's estimate of the link from it
    dropped: int = 0              # messages it rejected since start
    last_drop: str = ""


@dataclass(frozen=True)
class ViewSnapshot:
    elapsed_s: float
    phase: str                    # one of the waiting phases above, RUNNING once frames are fused
    fps: float = 0.0
    p50_ms: float | None = None   # over the complete frames of the last seconds
    p95_ms: float | None = None
    recent_incomplete: int = 0
    frames: int = 0               # fused since the view started
    plan_version: int = 0
    strategy: str = ""            # stripes | single | layerwise
    plan: str = ""                # the running plan in words
    predicted_ms: float | None = None
    runner_up: str = ""
    runner_up_ms: float | None = None
    planner: str = ""             # the coordinator's planner process: starting | ready | lost
    drops: tuple[tuple[str, int], ...] = ()
    last_result: str = ""
    nodes: tuple[NodeRow, ...] = ()
    strangers: int = 0            # telemetry from node ids the scenario does not have


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _speed(row: NodeRow) -> str:
    # emulated heterogeneity is never shown as if it were a real device's speed
    return "" if row.slowdown is None else f"EMULATED x{row.slowdown:.1f}"


def _headline(s: ViewSnapshot, ellipsis: str) -> str:
    if s.phase:
        return f"{s.elapsed_s:.0f} s | {s.phase}{ellipsis}"
    text = (f"{s.elapsed_s:.0f} s | {s.fps:.1f} fps | latency p50 {_ms(s.p50_ms)}  p95 {_ms(s.p95_ms)}"
            f" (predicted {_ms(s.predicted_ms)}) | {s.frames} frames")
    return text + (f" | {s.recent_incomplete} incomplete" if s.recent_incomplete else "")


def _plan_line(s: ViewSnapshot) -> str:
    if not s.plan_version:
        return ""
    strategy = s.strategy or "stripes"
    # the plan in words starts with its strategy except for layerwise (``a [value 9] -> b``)
    named = s.plan if s.plan.startswith(strategy) else f"{strategy} {s.plan}".strip()
    text = f"plan v{s.plan_version}: {named}, predicted {_ms(s.predicted_ms)}"
    if s.runner_up:
        text += f"; runner-up {s.runner_up} {_ms(s.runner_up_ms)}"
    if s.planner and s.planner != "ready":
        text += f"; planner process {s.planner}"
    return text


def _drops_line(s: ViewSnapshot) -> str:
    return "dropped: " + ", ".join(f"{name} {n}" for name, n in s.drops) if s.drops else ""


def plain_text(s: ViewSnapshot) -> str:
    """The snapshot as ``[view]`` lines: no escape codes, control characters escaped."""
    lines = [f"[view] {_headline(s, '...')}"]
    extra = [_plan_line(s), f"last result: {s.last_result}" if s.last_result else "", _drops_line(s)]
    lines += [f"[view]   {line}" for line in extra if line]
    for n in s.nodes:
        if n.state == LOADING_MODEL:
            lines.append(f"[view]   {n.name:<12} {LOADING_MODEL}...")
            continue
        share = "-" if n.share is None else f"{n.share:.2f}"
        rows = "-" if n.rows is None else str(n.rows)
        lines.append(f"[view]   {n.name:<12} {n.device:<6} {_speed(n):<15} share {share:>4}  rows {rows:>4}  "
                     f"{_ms(n.compute_ms):>9}  link {n.link or '-'}  {n.state}  dropped {n.dropped}"
                     + (f" (last: {n.last_drop})" if n.last_drop else ""))
    if s.strangers:
        lines.append(f"[view]   {s.strangers} telemetry messages from nodes not in the scenario (ignored)")
    return "\n".join(printable(line) for line in lines)


def rich_view(s: ViewSnapshot) -> RenderableType:
    """The snapshot as a table for a terminal (redrawn in place by the caller). Strings go in
    as Text, never as markup: a node id like ``[red]x`` is shown as it is."""
    def text(value: str, style: str = "") -> Text:
        return Text(printable(value), style=style)

    parts: list[RenderableType] = [text(_headline(s, "…"), "bold" if s.phase else "bold green")]
    plan = _plan_line(s)
    if plan:
        parts.append(text(plan, "cyan"))
    if s.last_result:
        parts.append(text(f"last result: {s.last_result}"))
    table = Table(expand=False, show_edge=False, pad_edge=False)
    for column, justify in (("node", "left"), ("device", "left"), ("speed", "left"), ("state", "left"),
                            ("share", "right"), ("rows", "right"), ("compute", "right"), ("link", "left"),
                            ("dropped", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for n in s.nodes:
        state_style = {ALIVE: "green", SILENT: "bold red"}.get(n.state, "yellow")
        state = f"{n.state}…" if n.state == LOADING_MODEL else n.state
        table.add_row(text(n.name), text(n.device), text(_speed(n), "magenta"), text(state, state_style),
                      text("-" if n.share is None else f"{n.share:.2f}"),
                      text("-" if n.rows is None else str(n.rows)), text(_ms(n.compute_ms)),
                      text(n.link or "-"),
                      text(str(n.dropped) + (f" ({n.last_drop})" if n.last_drop else ""),
                           "red" if n.dropped else ""))
    parts.append(table)
    drops = _drops_line(s)
    if drops:
        parts.append(text(drops, "red"))
    if s.strangers:
        parts.append(text(f"{s.strangers} telemetry messages from nodes not in the scenario (ignored)", "dim"))
    return Group(*parts)
