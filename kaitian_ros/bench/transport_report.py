"""``kaitian bench transport``'s summary: medians, min-max and ratios of the paths measured
(`kaitian_ros.bench.transport`), the text table and the PNG."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

TARGET_RATIO = 0.75
TARGET_MSGS = 50_000
TARGET_RATIO_256B = 0.5  # a goal: per-message Python work on both ends bounds small messages
ROS_MODES = ("ros_4mib", "ros_256b")


def summarise(results: dict[str, list[dict[str, Any]]], config: dict[str, Any]) -> dict[str, Any]:
    med = {m: {"gbytes_per_s": statistics.median(r["gbytes_per_s"] for r in rs),
               "msgs_per_s": statistics.median(r["msgs_per_s"] for r in rs)} for m, rs in results.items()}
    spread = {m: {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k in ("gbytes_per_s", "msgs_per_s")}
              for m, rs in results.items() if rs}
    ours_big = med["ours_4mib"]["gbytes_per_s"]
    raw_big = med["raw_4mib"]["gbytes_per_s"]
    ours_tcp, raw_tcp = med["ours_4mib_tcp"]["gbytes_per_s"], med["raw_4mib_tcp"]["gbytes_per_s"]
    out = {
        "gbytes_per_s_4mib": ours_big,
        "msgs_per_s_256b": med["ours_256b"]["msgs_per_s"],
        "raw_zenoh_gbytes_per_s_4mib": raw_big,
        "ratio_to_raw": ours_big / raw_big if raw_big > 0 else 0.0,
        "raw_zenoh_msgs_per_s_256b": med["raw_256b"]["msgs_per_s"],
        "ratio_to_raw_256b": (med["ours_256b"]["msgs_per_s"] / med["raw_256b"]["msgs_per_s"]
                              if med["raw_256b"]["msgs_per_s"] > 0 else 0.0),
        # every byte over loopback TCP (KAITIAN_SHM=0 on both sides): the inference graph's path
        "tcp": {"gbytes_per_s_4mib": ours_tcp, "raw_zenoh_gbytes_per_s_4mib": raw_tcp,
                "ratio_to_raw": ours_tcp / raw_tcp if raw_tcp > 0 else 0.0},
        "targets": {"ratio_to_raw": TARGET_RATIO, "msgs_per_s_256b": TARGET_MSGS,
                    "ratio_to_raw_256b": TARGET_RATIO_256B},
        "medians": med,
        "min_max": spread,
        "repeats": {m: [{k: r[k] for k in ("gbytes_per_s", "msgs_per_s", "pub_msgs_per_s", "n", "lost", "seconds")}
                         for r in rs]
                    for m, rs in results.items()},
        "config": config,
    }
    out["meets_targets"] = {"ratio_to_raw": out["ratio_to_raw"] >= TARGET_RATIO,
                            "ratio_to_raw_tcp": out["tcp"]["ratio_to_raw"] >= TARGET_RATIO,
                            "msgs_per_s_256b": out["msgs_per_s_256b"] >= TARGET_MSGS,
                            "ratio_to_raw_256b": out["ratio_to_raw_256b"] >= TARGET_RATIO_256B}
    if "ros_4mib" in med:  # the rclpy path: no target, side by side with the embedded one
        out["ros"] = {"gbytes_per_s_4mib": med["ros_4mib"]["gbytes_per_s"],
                      "msgs_per_s_256b": med["ros_256b"]["msgs_per_s"],
                      "lost": {m: sum(r["lost"] for r in results[m]) for m in ROS_MODES},
                      "ratio_to_embedded_4mib": med["ros_4mib"]["gbytes_per_s"] / ours_big if ours_big > 0 else 0.0,
                      "ratio_to_embedded_256b": (med["ros_256b"]["msgs_per_s"] / med["ours_256b"]["msgs_per_s"]
                                                 if med["ours_256b"]["msgs_per_s"] > 0 else 0.0)}
    return out


def _met(summary: dict[str, Any], key: str) -> str:
    return "met" if summary["meets_targets"][key] else "NOT met"


def table(summary: dict[str, Any]) -> str:
    med, tcp = summary["medians"], summary["tcp"]
    lines = [f"{'path':22s} {'4 MiB GB/s':>11s} {'256 B msg/s':>12s} {'4 MiB GB/s, TCP only':>21s}",
             (f"{'raw zenoh':22s} {med['raw_4mib']['gbytes_per_s']:11.3f} {med['raw_256b']['msgs_per_s']:12.0f} "
              f"{tcp['raw_zenoh_gbytes_per_s_4mib']:21.3f}"),
             (f"{'embedded runtime':22s} {med['ours_4mib']['gbytes_per_s']:11.3f} "
              f"{med['ours_256b']['msgs_per_s']:12.0f} {tcp['gbytes_per_s_4mib']:21.3f}"),
             (f"{'ours / raw':22s} {summary['ratio_to_raw']:11.2f} {summary['ratio_to_raw_256b']:12.2f} "
              f"{tcp['ratio_to_raw']:21.2f}"),
             *([(f"{'rclpy runtime':22s} {med['ros_4mib']['gbytes_per_s']:11.3f} "
                 f"{med['ros_256b']['msgs_per_s']:12.0f}"
                 f"   (samples lost: {summary['ros']['lost']['ros_4mib']} x 4 MiB, "
                 f"{summary['ros']['lost']['ros_256b']} x 256 B)")] if "ros" in summary else []),
             (f"targets: 4 MiB ratio >= {TARGET_RATIO} ({_met(summary, 'ratio_to_raw')}; TCP only "
              f"{_met(summary, 'ratio_to_raw_tcp')}), 256 B ratio >= {TARGET_RATIO_256B} "
              f"({_met(summary, 'ratio_to_raw_256b')}), >= {TARGET_MSGS} msg/s at 256 B "
              f"({_met(summary, 'msgs_per_s_256b')})")]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med, reps = summary["medians"], summary["repeats"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    with_ros = "ros_4mib" in med
    ros_big, ros_small = (("ros_4mib",), ("ros_256b",)) if with_ros else ((), ())
    names = ["raw zenoh", "embedded runtime", "rclpy runtime"]
    for ax, paths, key, unit, title in (
            (axes[0], ("raw_4mib", "ours_4mib") + ros_big, "gbytes_per_s", "GB/s (4 MiB chunks)",
             f"4 MiB, shared memory: ours/raw = {summary['ratio_to_raw']:.2f}"),
            (axes[1], ("raw_4mib_tcp", "ours_4mib_tcp"), "gbytes_per_s", "GB/s (4 MiB chunks)",
             f"4 MiB, TCP only: ours/raw = {summary['tcp']['ratio_to_raw']:.2f}"),
            (axes[2], ("raw_256b", "ours_256b") + ros_small, "msgs_per_s", "messages/s (256 B chunks)",
             f"256 B: ours/raw = {summary['ratio_to_raw_256b']:.2f}")):
        values = [med[m][key] for m in paths]
        ax.bar(names[:len(paths)], values, color=["#888888", "#2a7ab9", "#d9822b"][:len(paths)])
        for x, mode in enumerate(paths):
            ax.scatter([x] * len(reps[mode]), [r[key] for r in reps[mode]], color="k", s=10, zorder=3)
        ratio = TARGET_RATIO_256B if key == "msgs_per_s" else TARGET_RATIO
        ax.axhline(ratio * values[0], color="r", ls="--", lw=1, label=f"{ratio} x raw")
        ax.legend(loc="upper right")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
    fig.suptitle("TensorChunk transport, two processes on loopback, raw on the same payload path "
                 "(median, dots = repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
