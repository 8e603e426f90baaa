"""One run of ``kaitian bench chaos``: the graph, the settings, the attackers and the results; how a
fault is observed and measured (what it injects is :mod:`kaitian_ros.bench.chaos_faults`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kaitian_ros.bench import chaos_metrics as cm
from kaitian_ros.bench.chaos_forgeries import Attacker, fuzz_topics
from kaitian_ros.bench.chaos_graph import ChaosGraph
from kaitian_ros.bench.chaos_report import rounded
from kaitian_ros.bench.chaos_settings import ANSWER_S, COMPUTE_CERT, INSTANT_S, LEAD_S, LIFTED, Settings


@dataclass
class Injected:
    """What a fault's injection reports: when it ended, the recovery reference, details, and
    (optionally) work to do after the observation (more details, intervals the coordinator was
    down)."""

    end: float
    ref: float
    details: dict[str, Any] = field(default_factory=dict)
    start: float | None = None  # when the fault really began (default: when inject was called)
    after: Callable[[float, float], dict[str, Any]] | None = None
    down: list[tuple[float, float]] = field(default_factory=list)
    repair: Callable[[], str] | None = None  # after the measurement: put the graph right again
    effect: bool | None = None  # forgeries
    top: dict[str, Any] = field(default_factory=dict)  # results that belong beside lost, recover_s, ...


class Run:
    """One bench run: the graph, the settings, the attacker and the results."""

    def __init__(self, g: ChaosGraph, s: Settings, secure_dir: str | None = None) -> None:
        self.g, self.s = g, s
        self.secure_dir = secure_dir  # the graph runs with the security option (these certificates)
        self.attacker: Attacker | None = None
        self.secure_attackers: list[tuple[str, Attacker | None, str]] = []
        self.baseline_ms: float | None = None
        self.results: dict[str, Any] = {}

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.g.t0, 3)

    def attacker_for(self) -> Attacker:
        if self.attacker is None:
            self.attacker = Attacker(self.g.endpoint, fuzz_topics(self.g))
        return self.attacker

    def attackers(self) -> list[tuple[str, Attacker | None, str]]:
        """(who, attacker or None, why it could not join): without the security option the one
        attacker; with it, one holding the graph's ``node`` certificate (a camera, a tool), one
        without any, and - reported apart, not judged by the target - one holding the
        ``compute`` certificate (what a compromised compute node holds)."""
        if self.secure_dir is None:
            return [("no certificate (security option off)", self.attacker_for(), "")]
        if not self.secure_attackers:
            envs: tuple[tuple[str, dict[str, str | None]], ...] = (
                ("no certificate", {"KAITIAN_SECURITY": None, "KAITIAN_SECURITY_ROLE": None}),
                ("node certificate", {"KAITIAN_SECURITY": self.secure_dir, "KAITIAN_SECURITY_ROLE": "node"}),
                (COMPUTE_CERT, {"KAITIAN_SECURITY": self.secure_dir, "KAITIAN_SECURITY_ROLE": "compute"}))
            for who, env in envs:
                try:
                    self.secure_attackers.append((who, Attacker(self.g.endpoint, fuzz_topics(self.g), env), ""))
                except RuntimeError as exc:  # refused by the graph: it sends nothing
                    self.secure_attackers.append((who, None, " ".join(str(exc).split())[:300]))
        return self.secure_attackers

    def close_attackers(self) -> None:
        for a in [self.attacker] + [a for _, a, _ in self.secure_attackers]:
            if a is not None:
                a.close()

    def run(self, name: str, inject: Callable[[], Injected],
            prepare: Callable[[], object] | None = None) -> dict[str, Any]:
        g, s = self.g, self.s
        healthy, waited = g.wait_healthy(s.healthy_timeout_s, self.baseline_ms)
        if prepare is not None:
            prepare()
        pre0 = time.monotonic()
        time.sleep(s.pre_s)
        called = time.monotonic()
        pre_lat = g.latencies(pre0, called)
        pre_ms = statistics.median(pre_lat) if pre_lat else self.baseline_ms
        inj = inject()
        start = inj.start if inj.start is not None else called
        until = inj.end + s.settle_s
        while time.monotonic() < until:
            g.check()
            time.sleep(0.2)
        _, answers = g.rec.snapshot()
        while cm.recovery(answers, inj.ref, pre_ms).recover_s is None and time.monotonic() < until + s.extra_s:
            g.check()
            time.sleep(0.5)
            _, answers = g.rec.snapshot()
        until = max(until, time.monotonic())
        details = dict(inj.details)
        if inj.after is not None:
            details.update(inj.after(start, until))
        result = self.measure(start, inj.end, until, inj.ref, pre0, pre_ms, inj.down)
        result["forgery_effect"] = inj.effect
        result.update(inj.top)
        result.update({k: details.pop(k) for k in LIFTED if k in details})
        result.update({"healthy_before": healthy, "waited_for_healthy_s": round(waited, 1), "details": details})
        if inj.repair is not None:
            result["repair"] = inj.repair()
        result["targets"] = [t.__dict__ for t in cm.targets(cm.fault_kind(name), result)]
        return result

    def measure(self, start: float, end: float, until: float, ref: float, pre0: float, pre_ms: float | None,
                down: Sequence[tuple[float, float]]) -> dict[str, Any]:
        g = self.g
        frames, answers = g.rec.snapshot()
        ws, we = start - LEAD_S, until - ANSWER_S
        counts = cm.count_frames(frames, answers, ws, we, answer_s=ANSWER_S, down=down,
                                 by_design=g.coordinator_drops(ws, we))
        rec = cm.recovery(answers, ref, pre_ms, until=until)
        rss: dict[str, Any] = {}
        for node, samples in sorted(g.rss_samples().items()):
            d = cm.rss_delta(samples, (pre0, start), (start, until), until)
            rss[node] = {"pre_mb": rounded(d.pre_mb), "peak_delta_mb": rounded(d.peak_delta_mb),
                         "settled_delta_mb": rounded(d.settled_delta_mb)}
        peaks = {n: v["peak_delta_mb"] for n, v in rss.items() if v["peak_delta_mb"] is not None}
        settled = {n: v["settled_delta_mb"] for n, v in rss.items() if v["settled_delta_mb"] is not None}
        peak_node = max(peaks, key=lambda n: peaks[n]) if peaks else None
        settled_node = max(settled, key=lambda n: settled[n]) if settled else None
        return {
            "lost": counts.lost, "duplicated": counts.duplicated, "out_of_order": counts.out_of_order,
            "recover_s": rounded(rec.recover_s, 2),
            "peak_rss_delta_mb": peaks[peak_node] if peak_node is not None else None,
            "settled_rss_delta_mb": settled[settled_node] if settled_node is not None else None, "forgery_effect": None,
            "frames": counts.as_dict(), "first_complete_s": rounded(rec.first_complete_s, 2),
            "latency_back_s": rounded(rec.latency_back_s, 2), "pre_latency_ms": rounded(pre_ms),
            "output_gap_s": rounded(cm.max_gap([a.t for a in answers if a.complete], start, until), 2),
            "latency_during_ms": rounded(cm.median_or_none(
                a.latency_ms for a in answers if a.complete and a.latency_ms is not None
                and start <= a.t <= max(end, start + INSTANT_S))),
            "latency_max_ms": rounded(max((a.latency_ms for a in answers if a.complete and a.latency_ms is not None
                                      and start <= a.t <= until), default=None)),
            "peak_rss_node": peak_node, "settled_rss_node": settled_node,
            "settle_s": rounded(until - end), "rss": rss,
            "window": {"pre": self.rel(pre0), "start": self.rel(start), "end": self.rel(end), "until": self.rel(until),
                       "frames_from": self.rel(ws), "frames_to": self.rel(we)},
        }
