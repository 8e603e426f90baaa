"""What an inference run of ``kaitian launch`` did, told once at its end: frames fused
(complete or not, and why not), latency p50/p95, frames dropped by reason, plan changes and
the last plan, duration. Pure bookkeeping: the live view feeds it, nothing here does I/O."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kaitian_ros.terminal_text import printable

# latencies kept for the percentiles: about 9 hours at 30 fps, 800 kB (older ones fall out)
LATENCY_WINDOW = 1_000_000


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` (0..1) nearest-rank percentile of ascending values, None if there are none
    (the same rank the coordinator's /diagnostics uses)."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def incomplete_reason(status: str) -> str:
    """The kind of failure a FusedOutput ``status`` names (``timeout: missing rows ...`` ->
    ``timeout``): counted per kind, not per wording that varies with the rows."""
    kind = status.split(":", 1)[0].strip()
    return kind if kind else "unknown"


@dataclass(frozen=True)
class RunSummary:
    duration_s: float
    frames: int                                # fused results received
    complete: int
    incomplete: tuple[tuple[str, int], ...]    # (reason, count), most frequent first
    p50_ms: float | None                       # over the complete frames
    p95_ms: float | None
    drops: tuple[tuple[str, int], ...]         # (what dropped, count) for counts > 0
    plans: int                                 # plans that came, each unlike the one before
    last_plan: str                             # the last plan in words ("" if none came)

    @property
    def plan_changes(self) -> int:
        """Switches after the first plan was adopted."""
        return max(0, self.plans - 1)

    @property
    def incomplete_count(self) -> int:
        return sum(n for _, n in self.incomplete)


class RunTally:
    """Counts what the run's fused results and plans said (fed as they arrive)."""

    def __init__(self, latency_window: int = LATENCY_WINDOW) -> None:
        self.frames = 0
        self.complete = 0
        self.incomplete: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=latency_window)
        self.plans = 0
        self.last_plan_key: tuple[int, int] | None = None
        self.last_plan = ""

    def add_fused(self, latency_ms: float, complete: bool, status: str) -> None:
        self.frames += 1
        if complete:
            self.complete += 1
            if math.isfinite(latency_ms) and latency_ms >= 0:
                self.latencies.append(latency_ms)
        else:
            self.incomplete[incomplete_reason(status)] += 1

    def add_plan(self, incarnation: int, version: int, description: str) -> None:
        """One /kaitian/plan sample: a plan unlike the previous one counts (a latched
        re-delivery of the same plan does not). Only the last plan is kept: anyone can publish
        on the topic, a flood of made-up versions must not grow the tally."""
        key = (incarnation, version)
        if key != self.last_plan_key:
            self.plans += 1
            self.last_plan_key = key
            self.last_plan = description

    def summary(self, duration_s: float, drops: Mapping[str, int] | Iterable[tuple[str, int]] = ()) -> RunSummary:
        lat = sorted(self.latencies)
        pairs = drops.items() if isinstance(drops, Mapping) else drops
        return RunSummary(
            duration_s=max(0.0, duration_s), frames=self.frames, complete=self.complete,
            incomplete=tuple(self.incomplete.most_common()),
            p50_ms=percentile(lat, 0.5), p95_ms=percentile(lat, 0.95),
            drops=tuple((name, int(n)) for name, n in pairs if int(n) > 0),
            plans=self.plans, last_plan=self.last_plan)


def format_summary(s: RunSummary) -> str:
    """The compact block ``kaitian launch`` prints at exit (plain text; names from the wire
    with their control characters escaped)."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    lines = [f"[summary] {s.duration_s:.1f} s, {s.frames} frames fused: {s.complete} complete, "
             f"{s.incomplete_count} incomplete"
             + (f" ({', '.join(f'{n} {why}' for why, n in s.incomplete)})" if s.incomplete else ""),
             f"[summary] latency p50 {ms(s.p50_ms)}, p95 {ms(s.p95_ms)} (complete frames)",
             "[summary] dropped: " + (", ".join(f"{name} {n}" for name, n in s.drops) if s.drops else "none")]
    if s.plans:
        lines.append(f"[summary] plans: {s.plans} ({s.plan_changes} change{'s' * (s.plan_changes != 1)}), "
                     f"last: {s.last_plan}")
    else:
        lines.append("[summary] plans: none came (no compute node joined?)")
    return "\n".join(printable(line) for line in lines)
