"""The results of ``kaitian bench chaos`` as text and a plot: rounding, the plan in words, the
table, the latency and RSS series, and the nulls of a fault that could not run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaitian_ros.bench import chaos_metrics as cm
from kaitian_ros.bench.chaos_graph import ChaosGraph


def plan_text(m: Any) -> str | None:
    if m is None:
        return None
    nodes = "/".join(f"{n} {float(s):.2f}" for n, s in zip(m.node_ids, m.shares))
    return f"v{int(m.version)} {m.strategy or 'stripes'} {nodes}"


def plan_lines(plans: Sequence[tuple[float, Any]], t0: float, limit: int = 12) -> list[str]:
    """Each plan after `t0` with why it came (the head of its reason: e.g. `compute_0 late`,
    `compute_1 lost`, `periodic re-prediction`)."""
    return [f"+{t - t0:.2f} s {plan_text(m)} ({str(m.reason).split(':', 1)[0]})" for t, m in plans[:limit]]


def rounded(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


def run_series(g: ChaosGraph) -> dict[str, Any]:
    """Latency and RSS over the run (seconds since the graph started), for the plot and JSON."""
    _, answers = g.rec.snapshot()
    lat = [[round(a.t - g.t0, 2), None if a.latency_ms is None else round(a.latency_ms, 1), a.complete]
           for a in answers]
    rss: dict[str, list[list[float]]] = {}
    for node, samples in g.rss_samples().items():
        last = -math.inf
        for t, mb in samples:  # one a second is plenty for the record
            if t - last >= 1.0:
                rss.setdefault(node, []).append([round(t - g.t0, 1), round(mb, 1)])
                last = t
    return {"answers": lat, "rss_mb": rss}


def plot(summary: dict[str, Any], path: Path) -> None:
    """Latency and RSS over time per graph (the plain one, and the secured one when it ran),
    each fault's window shaded (dark: the fault; light: its observation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(title, run_series, {n: f for n, f in summary["faults"].items() if (f.get("graph") == "secure") == secure})
             for title, run_series, secure in (("", summary["series"], False),
                                           ("security option on: ", summary.get("series_secure"), True))
             if run_series and run_series["answers"]]
    if not parts:
        return
    fig, axes = plt.subplots(2 * len(parts), 1, figsize=(13, 7.5 * len(parts)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] * len(parts)})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (title, run_series, faults) in enumerate(parts):
        ax, ax2 = axes[2 * k, 0], axes[2 * k + 1, 0]
        ax2.sharex(ax)
        ok = [(t, ms) for t, ms, complete in run_series["answers"] if complete and ms is not None]
        bad = [t for t, _, complete in run_series["answers"] if not complete]
        if ok:
            ts, ms = zip(*ok)
            ax.plot(ts, ms, "k.", ms=2.5, label="complete frame: end-to-end latency")
            top = max(ms) * 1.6  # log scale: a collapsed link's seconds and the usual tens of ms both show
            ax.set_yscale("log")
            ax.set_ylim(min(ms) * 0.8, top)
            for t in bad:
                ax.plot([t], [top / 1.25], "rx", ms=5)
            if bad:
                ax.plot([], [], "rx", label="incomplete (coordinator timeout)")
        for j, (name, f) in enumerate(faults.items()):
            w = f.get("window")
            if not w:
                continue
            c = colours[j % len(colours)]
            for a in (ax, ax2):
                a.axvspan(w["start"], max(w["end"], w["start"] + 0.3), color=c, alpha=0.35)
                a.axvspan(max(w["end"], w["start"] + 0.3), w["until"], color=c, alpha=0.08)
            ax.text(w["start"], ax.get_ylim()[1] / 1.1, name, rotation=90, fontsize=7, va="top", ha="right")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{title}{summary['setup']['graph']}", loc="left", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        for node, pts in sorted(run_series["rss_mb"].items()):
            ts, mb = zip(*pts)
            ax2.plot(ts, mb, lw=1, label=node)
        ax2.set_ylabel("RSS (MB)")
        ax2.set_xlabel("seconds since the graph started (fault: dark; observation: light)")
        ax2.legend(fontsize=7, loc="upper left", ncol=4)
    setup = summary["setup"]
    fig.suptitle(f"kaitian bench chaos{' --quick' if setup['quick'] else ''}: {setup['graph']} "
                 f"(EMULATED device speeds), "
                 f"commit {setup['commit']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.1f}"
    return str(x)


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nchaos ({summary['setup']['graph']}; EMULATED device speeds)")
    print(f"{'fault':<25}{'lost':>5}{'(drop)':>7}{'dup':>5}{'ooo':>5}{'recover_s':>10}{'peak MB':>9}"
          f"{'settled MB':>11}{'forged':>8}   target: value (met)")
    for name, f in summary["faults"].items():
        dropped = (f.get("frames") or {}).get("dropped_by_design")
        head = (f"{name:<25}{cell(f['lost']):>5}{'(' + cell(dropped) + ')':>7}{cell(f['duplicated']):>5}"
                f"{cell(f['out_of_order']):>5}"
                f"{cell(f['recover_s']):>10}{cell(f['peak_rss_delta_mb']):>9}{cell(f['settled_rss_delta_mb']):>11}"
                f"{cell(f['forgery_effect']):>8}   ")
        parts = [f"{t['what']}: {cell(t['value'])} ({'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'})"
                 for t in f["targets"]]
        print(head + ("; ".join(parts)))


def print_one(name: str, f: dict[str, Any]) -> None:
    if f.get("skipped"):
        print(f"  {name}: null ({f['reason']})", flush=True)
        return
    met = ", ".join(f"{t['what']}: {'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'}"
                    for t in f["targets"])
    print(f"  {name}: lost {f['lost']} ({f['frames']['dropped_by_design']} of them dropped by design), "
          f"duplicated {f['duplicated']}, out of order {f['out_of_order']}, "
          f"recover {cell(f['recover_s'])} s (first complete {cell(f['first_complete_s'])} s), output gap "
          f"{cell(f['output_gap_s'])} s, peak RSS +{cell(f['peak_rss_delta_mb'])} MB ({f['peak_rss_node']}), settled "
          f"+{cell(f['settled_rss_delta_mb'])} MB, forgery effect {cell(f['forgery_effect'])} | {met}", flush=True)


METRIC_KEYS = ("lost", "duplicated", "out_of_order", "recover_s", "peak_rss_delta_mb", "settled_rss_delta_mb",
               "forgery_effect")


def skipped(name: str, reason: str) -> dict[str, Any]:
    """A fault that could not run here: every metric null, with the reason."""
    out: dict[str, Any] = dict.fromkeys(METRIC_KEYS)
    out.update({"skipped": True, "reason": reason})
    out["targets"] = [t.__dict__ for t in cm.targets(cm.fault_kind(name), out)]
    return out
