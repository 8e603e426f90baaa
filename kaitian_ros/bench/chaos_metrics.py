"""Pure metrics of ``kaitian bench chaos`` (no clock, no I/O): frame accounting, recovery time,
output gaps, RSS deltas, counter increases across restarts, and the targets per fault.

Definitions (also in docs/chaos.md):

- A *frame* is a camera message the bench's probe received (``/camera/image_raw``), keyed by its
  header stamp; an *answer* is a ``/kaitian/fused`` message, matched to its frame by the same
  stamp. Times are the probe's receipt times (one monotonic clock).
- A fault's frames are those received in its accounting window ``[start, end)``; an answer
  counts when it arrives within ``answer_s`` of its frame.
- ``complete``: frames with at least one complete answer. ``incomplete``: frames whose answers
  are all ``complete=false`` (the coordinator's request timed out). ``unanswered``: no answer.
- ``duplicated``: answers beyond the first for the same frame.
- ``out_of_order``: answers (of the window's frames, in arrival order) whose frame is older than
  the frame of an answer that arrived before them.
- ``coordinator_down``: unanswered frames received while no coordinator process could take them
  (from its kill until the respawned one finished starting): not lost, nobody was there.
- ``lost`` = ``incomplete`` + ``unanswered`` - ``coordinator_down``: frames published while a
  coordinator was up that got no complete result, whatever the reason - what a consumer of
  ``/kaitian/fused`` misses.
- ``dropped_by_design``: how many of the lost frames the coordinator dropped on purpose, read
  from its /diagnostics counters over the window (``dropped_busy``: a newer frame replaced one
  waiting for an in-flight slot, ``max_in_flight`` backpressure; ``dropped_no_plan``: no plan
  yet), at most the unanswered frames. ``lost_not_by_design`` = ``lost`` -
  ``dropped_by_design``: frames the graph took on and did not answer, or that vanished. Frames
  the best-effort camera topic dropped before the coordinator took them (sensor-data QoS keeps
  the newest 5) count there too: they are not told apart from frames lost inside the graph.
- Recovery: ``first_complete_s`` is the time from the reference (the kill, or the end of a
  fault that lasts) to the first complete answer after it; ``latency_back_s`` to the last answer
  of the first ``ROLLING`` consecutive complete answers whose median end-to-end latency is within
  ``RECOVER_FACTOR`` x the pre-fault median; ``recover_s`` = the later of the two (None: not
  within the observation).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RECOVER_FACTOR = 1.10
ROLLING = 3

Stamp = tuple[int, int]


@dataclass(frozen=True)
class Frame:
    """A camera frame as the probe received it."""

    stamp: Stamp
    t: float


@dataclass(frozen=True)
class Answer:
    """A FusedOutput as the probe received it; ``latency_ms`` is end to end (camera frame
    received by the probe -> answer received by the probe), None when its frame was not seen."""

    stamp: Stamp
    t: float
    complete: bool
    latency_ms: float | None = None


@dataclass(frozen=True)
class FrameCounts:
    frames: int
    complete: int
    incomplete: int
    unanswered: int
    duplicated: int
    out_of_order: int
    coordinator_down: int
    lost: int
    dropped_by_design: int
    lost_not_by_design: int

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def in_any(t: float, intervals: Iterable[tuple[float, float]]) -> bool:
    return any(a <= t < b for a, b in intervals)


def count_frames(frames: Sequence[Frame], answers: Sequence[Answer], start: float, end: float, *,
                 answer_s: float, down: Sequence[tuple[float, float]] = (), by_design: int = 0) -> FrameCounts:
    """Frame accounting of the window ``[start, end)`` (definitions in the module docstring).
    ``answers`` in arrival order."""
    window = {f.stamp: f for f in frames if start <= f.t < end}
    got: dict[Stamp, list[Answer]] = {s: [] for s in window}
    ordered: list[Answer] = []
    for a in answers:
        f = window.get(a.stamp)
        if f is not None and a.t - f.t <= answer_s:
            got[a.stamp].append(a)
            ordered.append(a)
    complete = sum(1 for s in window if any(a.complete for a in got[s]))
    incomplete = sum(1 for s in window if got[s] and not any(a.complete for a in got[s]))
    unanswered_frames = [window[s] for s in window if not got[s]]
    duplicated = sum(max(0, len(v) - 1) for v in got.values())
    out_of_order = 0
    newest: Stamp | None = None
    for a in ordered:
        if newest is not None and a.stamp < newest:
            out_of_order += 1
        elif newest is None or a.stamp > newest:
            newest = a.stamp
    down_n = sum(1 for f in unanswered_frames if in_any(f.t, down))
    unanswered = len(unanswered_frames)
    designed = min(by_design, unanswered - down_n)  # counters are read once a second: never more than missing
    lost = incomplete + unanswered - down_n
    return FrameCounts(len(window), complete, incomplete, unanswered, duplicated, out_of_order, down_n, lost,
                       designed, lost - designed)


@dataclass(frozen=True)
class Recovery:
    first_complete_s: float | None
    latency_back_s: float | None

    @property
    def recover_s(self) -> float | None:
        if self.first_complete_s is None or self.latency_back_s is None:
            return None
        return max(self.first_complete_s, self.latency_back_s)


def recovery(answers: Sequence[Answer], ref_t: float, baseline_ms: float | None, *,
             factor: float = RECOVER_FACTOR, rolling: int = ROLLING, until: float | None = None) -> Recovery:
    """Recovery after ``ref_t`` from the answers (arrival order) up to ``until``."""
    after = [a for a in answers if a.complete and a.t > ref_t and (until is None or a.t <= until)]
    first = after[0].t - ref_t if after else None
    timed = [(a.t, a.latency_ms) for a in after if a.latency_ms is not None]
    back = None
    if baseline_ms is not None and baseline_ms > 0:
        for k in range(len(timed) - rolling + 1):
            group = timed[k:k + rolling]
            if statistics.median(ms for _, ms in group) <= factor * baseline_ms:
                back = group[-1][0] - ref_t
                break
    return Recovery(first, back)


def max_gap(times: Sequence[float], start: float, end: float) -> float:
    """The longest time in ``[start, end]`` without an event of ``times`` (sorted), counting the
    edges: how long consumers waited for an output at worst."""
    inside = [t for t in times if start <= t <= end]
    edges = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def median_or_none(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


@dataclass(frozen=True)
class RssDelta:
    pre_mb: float | None
    peak_mb: float | None
    settled_mb: float | None

    @property
    def peak_delta_mb(self) -> float | None:
        return None if self.pre_mb is None or self.peak_mb is None else self.peak_mb - self.pre_mb

    @property
    def settled_delta_mb(self) -> float | None:
        return None if self.pre_mb is None or self.settled_mb is None else self.settled_mb - self.pre_mb


def rss_delta(samples: Sequence[tuple[float, float]], pre: tuple[float, float], during: tuple[float, float],
              settled_at: float, *, span_s: float = 2.0) -> RssDelta:
    """One process (or node name, across respawns) from (time, RSS MB) samples: the median of
    the pre-fault window, the peak during the fault and its observation, and the median of the
    samples within ``span_s`` before ``settled_at``."""
    pre_mb = median_or_none(mb for t, mb in samples if pre[0] <= t <= pre[1])
    peak = [mb for t, mb in samples if during[0] <= t <= during[1]]
    settled = median_or_none(mb for t, mb in samples if settled_at - span_s <= t <= settled_at)
    return RssDelta(pre_mb, max(peak) if peak else None, settled)


def counter_increase(series: Sequence[tuple[Any, int]]) -> int:
    """How much a counter grew over ``series`` of (process identity, value) readings in time
    order, the first being the baseline: a new identity, or a value below the previous one, is
    a restarted process counting from 0 again."""
    total = 0
    prev_id, prev = series[0] if series else (None, 0)
    for ident, value in series[1:]:
        if ident != prev_id or value < prev:
            total += value
        else:
            total += value - prev
        prev_id, prev = ident, value
    return total


def rejected_counts(values: Mapping[str, str]) -> dict[str, int]:
    """``rejected.<reason>`` counts of one /diagnostics status."""
    out = {}
    for k, v in values.items():
        if k.startswith("rejected."):
            with contextlib.suppress(ValueError):
                out[k[len("rejected."):]] = int(v)
    return out


def reason_increase(readings: Sequence[tuple[Any, Mapping[str, str]]]) -> dict[str, int]:
    """Per reason, how many rejects a node counted over (identity, /diagnostics values) readings
    (the first is the baseline)."""
    reasons = sorted({r for _, v in readings for r in rejected_counts(v)})
    out = {}
    for r in reasons:
        n = counter_increase([(i, rejected_counts(v).get(r, 0)) for i, v in readings])
        if n:
            out[r] = n
    return out


@dataclass(frozen=True)
class Target:
    what: str
    value: Any
    met: bool | None  # None: not measured


def _le(x: Any, limit: float) -> bool | None:
    return None if x is None else x <= limit


def targets(kind: str, fault: Mapping[str, Any]) -> list[Target]:
    """The issue's targets for a fault of ``kind`` (kill_compute, kill_authority, flood,
    forge, forge_secure, fuzz, link_collapse) measured in ``fault`` (its JSON)."""
    if fault.get("skipped"):
        return [Target("(not run)", fault.get("reason"), None)]
    if kind == "kill_compute":
        return [Target("lost == 0", fault["lost"], None if fault["lost"] is None else fault["lost"] == 0),
                Target("recover_s <= 2", fault["recover_s"], _le(fault["recover_s"], 2.0))]
    if kind == "kill_authority":
        first = fault.get("first_complete_s")
        adapt = fault.get("adaptation")
        return [Target("complete frame back <= 5 s", first, _le(first, 5.0)),
                Target("adaptation from the new run", adapt, adapt)]
    if kind == "flood":
        gap = fault.get("output_gap_s")
        return [Target("peak RSS <= +300 MB per node", fault["peak_rss_delta_mb"],
                       _le(fault["peak_rss_delta_mb"], 300)),
                Target(f"settled RSS <= +50 MB ({fault.get('settle_s')} s later)", fault["settled_rss_delta_mb"],
                       _le(fault["settled_rss_delta_mb"], 50)),
                Target("output gap <= 1 s", gap, _le(gap, 1.0))]
    if kind == "forge":
        variants = [v for v in fault.get("variants", []) if v.get("implausible")]
        bad = [v["name"] for v in variants if not (v.get("counted") and v.get("effect") is False)]
        return [Target("implausible forgeries rejected and counted",
                       f"{len(variants) - len(bad)}/{len(variants)}" + (f" (not: {', '.join(bad)})" if bad else ""),
                       None if not variants else not bad)]
    if kind == "forge_secure":
        eff = fault.get("forgery_effect")
        out = [Target("no effect", eff, None if eff is None else eff is False)]
        if "forgery_effect_compute_certificate" in fault:  # a compromised compute node: no target
            out.append(Target("(reported) effect with a compute certificate",
                              fault["forgery_effect_compute_certificate"], None))
        return out
    if kind == "fuzz":
        crashes, hangs, uncounted = fault.get("crashes"), fault.get("hangs"), fault.get("uncounted")
        return [Target("0 crashes", crashes, None if crashes is None else crashes == 0),
                Target("0 hangs", hangs, None if hangs is None else hangs == 0),
                Target("every reject counted by reason", uncounted,
                       None if uncounted is None else uncounted == 0)]
    return [Target("none (reported)", None, None)]


def fault_kind(name: str) -> str:
    """The target family of a fault name."""
    if name == "kill_compute":
        return "kill_compute"
    if name in ("kill_coordinator", "kill_scheduler", "kill_router"):
        return "kill_authority"
    if name.startswith("forge_"):
        return "forge_secure" if name.endswith("_secure") else "forge"
    return name
