"""``kaitian bench digits``: a model trained by ``kaitian train`` classifies held-out data through
the collaborative inference graph, and gets every frame right that the same weights on one device
get right.

1. Weights: ``--weights PATH``, or trained here by ``kaitian train`` itself (a child process
   ``python -m kaitian_ros.cli train``: 2 real torch.distributed ranks on gloo, EMULATED speeds
   1 : 1/3, adaptive shares, Adam on camera inputs, seeded; ``TRAIN_ARGS``).
2. The ``digits_demo`` graph from ``config/digits_demo.yaml`` (coordinator, scheduler, compute_0
   and compute_1 EMULATED 3x slower, row stripes) as real processes on a router of a free port
   (``AdaptivityGraph``), with ``weights:=PATH``. Its image source is left out: this process is the
   camera and publishes the same frames the image source's ``source: digits`` does
   (``nodes.image_source.digit_frame``: the trainer's held-out split, 64x64 mono8, the label in
   ``header.frame_id``), at most 2 unanswered, so the coordinator drops none as busy and exactly
   ``--frames`` are answered.
3. Every ``/kaitian/fused`` answer's top class is scored against the label its ``frame_id``
   carries (an incomplete answer counts as wrong). The single-device reference runs the whole
   model in this process on the same frames, preprocessed by the functions the coordinator and
   the compute nodes use (``core.tensors.image_to_array``, ``resize_pixels``,
   ``normalise_input``); that input is also compared with the trainer's test sample bitwise.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser

DEFAULT_DIR = Path("bench/results")
SCENARIO = "digits_demo"
FRAMES, QUICK_FRAMES = 300, 100
EPOCHS, QUICK_EPOCHS = 20, 12
# Adam lr 0.01 with a cosine decay: the training bench's recipe (docs/training.md) at
# the native 8x8 size, on camera inputs instead of standardised ones
TRAIN_ARGS = ("--ranks", "2", "--devices", "cpu:a,cpu:b", "--slowdowns", "1,3", "--policy", "adaptive",
              "--camera-inputs", "--optimizer", "adam", "--lr", "0.01", "--lr-schedule", "cosine",
              "--warmup-steps", "5", "--global-batch", "128", "--seed", "0")


def train(weights: Path, epochs: int) -> dict[str, Any]:
    """Run ``kaitian train`` (its CLI, its rank processes) writing ``weights``; its JSON summary."""
    cmd = [sys.executable, "-m", "kaitian_ros.cli", "train", *TRAIN_ARGS, "--epochs", str(epochs),
           "--save-weights", str(weights), "--json"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"kaitian train exited {done.returncode}: {why}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["command"] = "kaitian train " + " ".join(cmd[4:])
    summary["wall_s"] = time.monotonic() - t0
    return summary


def graph_config(weights: Path) -> tuple[dict[str, Any], tuple[int, int]]:
    """digits_demo in parameter-file form with ``weights:=PATH`` without its image source, and the
    (height, width) of the frames that image source publishes."""
    from kaitian_ros.scenario import load_scenario

    cfg = load_scenario(SCENARIO, [f"weights:={weights}"]).parameter_file_dict()
    camera = cfg.pop("image_source")["ros__parameters"]
    return cfg, (int(camera["height"]), int(camera["width"]))


def frame_message(index: int, height: int, width: int) -> Any:
    """Held-out digit ``index`` as the image source publishes it, stamped uniquely (the driver
    matches answers to frames by stamp)."""
    from kaitian_ros.nodes.image_source import digit_frame, image_message
    from kaitian_ros.runtime import interfaces

    pixels, frame_id = digit_frame(index, height, width)
    return image_message(pixels, frame_id, interfaces.msg_class("Time")(sec=1_000 + index, nanosec=7))


def model_input(msg: Any, input_shape: tuple[int, int, int], normalise: bool) -> Any:
    """The model input a frame becomes in the graph: the coordinator's conversion and resize, the
    compute nodes' normalisation, here on one device."""
    from kaitian_ros.core.tensors import image_to_array, preprocess

    c, h, w = input_shape
    pixels = image_to_array(msg.data, int(msg.height), int(msg.width), msg.encoding, int(msg.step))
    return preprocess(pixels, h, w, c, normalise)


def run_bench(*, frames: int, weights: Path | None, train_to: Path, epochs: int,
              echo: bool = False) -> dict[str, Any]:
    """The measurement; ``weights`` None: train with ``kaitian train`` into ``train_to`` first."""
    import numpy as np
    import torch

    from kaitian_ros.bench.adaptivity_graph import AdaptivityGraph
    from kaitian_ros.core.models import build_model
    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.nodes.image_source import parse_digit_frame_id
    from kaitian_ros.runtime import interfaces
    from kaitian_ros.training.data import evaluate, load_data

    torch.set_num_threads(1)
    result: dict[str, Any] = {"frames_requested": frames, "emulated": True}
    if weights is None:
        weights = train_to
        result["training"] = train(weights, epochs)
    result["weights"] = str(weights)
    cfg, (height, width) = graph_config(weights.resolve())
    p = cfg["coordinator"]["ros__parameters"]
    shape = (p["input_channels"], p["input_height"], p["input_width"])
    spec = ic.ModelSpec.from_params(p)
    model = build_model(spec.name, num_classes=spec.num_classes, in_channels=shape[0], seed=spec.seed,
                        state_dict_path=spec.weights)
    test_x, test_y = load_data("digits", camera=True).test
    result["weights_test_accuracy"] = evaluate(model, (test_x, test_y), torch.device("cpu"))
    model.eval()  # evaluate() leaves it in training mode
    result["graph"] = {
        "scenario": SCENARIO, "frame_size": [width, height], "model_input": list(shape),
        "strategy": p["strategy"], "scheduler_policy": cfg["scheduler"]["ros__parameters"]["policy"],
        "slowdowns": {n: cfg[n]["ros__parameters"]["emulated_slowdown"] for n in cfg if n.startswith("compute_")}}
    t0 = time.monotonic()
    with AdaptivityGraph(cfg, echo=echo, frames=lambda i: frame_message(i, height, width)) as g:
        g.wait_ready(timeout_s=180.0)
        result["startup_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        g.drive(answers=frames, window=2, timeout_s=60.0 + 2.0 * frames)
        result["stream_s"] = time.monotonic() - t1
        fused = [m for _, m in g.fused.snapshot()][:frames]
        plans = g.plan_table()
    sent = {}  # frame index -> the Image message (re-rendered: the same bytes the driver sent)
    rows = []
    for f in fused:
        parsed = parse_digit_frame_id(f.header.frame_id)
        if parsed is None:
            raise RuntimeError(f"answer with frame_id {f.header.frame_id!r}: not a digit frame")
        label, index = parsed
        if index not in sent:
            sent[index] = frame_message(index, height, width)
        rows.append((f, label, index))
    x = torch.cat([model_input(sent[i], shape, p["normalise"]) for _, _, i in rows])
    with torch.no_grad():
        single_logits = model(x)
    single_top = single_logits.argmax(1).tolist()
    same_input = sum(bool(torch.equal(x[k], test_x[i])) for k, (_, _, i) in enumerate(rows))
    fused_top = [int(f.top_class) if f.complete else -1 for f, _, _ in rows]
    labels = [label for _, label, _ in rows]
    diffs = [float(np.abs(interfaces.array_from_fields(f).reshape(-1) - single_logits[k].numpy()).max())
             for k, (f, _, _) in enumerate(rows) if f.complete]
    strategies: Counter[str] = Counter()
    nodes_used: Counter[str] = Counter()
    for f, _, _ in rows:
        plan = plans.get(int(f.plan_version))
        strategies[(plan.strategy or "stripes") if plan is not None else "unknown"] += 1
        nodes_used[" ".join(f"{n}:{int(r)}" for n, r in zip(f.node_ids, f.node_rows) if int(r) > 0)] += 1
    n = len(rows)
    per_class = {}
    for c in range(10):
        ks = [k for k in range(n) if labels[k] == c]
        per_class[str(c)] = {"frames": len(ks),
                             "fused_accuracy": sum(fused_top[k] == c for k in ks) / len(ks) if ks else None,
                             "single_device_accuracy": sum(single_top[k] == c for k in ks) / len(ks) if ks else None}
    latencies = [float(f.latency_ms) for f, _, _ in rows if f.complete]
    result |= {
        "frames": n,
        "distinct_frames": len(sent),
        "fused_accuracy": sum(t == y for t, y in zip(fused_top, labels)) / n if n else 0.0,
        "single_device_accuracy": sum(t == y for t, y in zip(single_top, labels)) / n if n else 0.0,
        "agree": sum(a == b for a, b in zip(fused_top, single_top)) / n if n else 0.0,
        "incomplete": sum(not f.complete for f, _, _ in rows),
        "inputs_equal_training_samples": same_input,
        "max_abs_logit_diff": max(diffs, default=0.0),
        "strategies": dict(strategies),
        "trunk_output_rows": dict(nodes_used),
        "latency_ms_median": statistics.median(latencies) if latencies else None,
        "per_class": per_class,
        "latencies_ms": latencies,
    }
    return result


def table(r: dict[str, Any]) -> str:
    g = r["graph"]
    slow = ", ".join(f"{k} x{v:g}" for k, v in g["slowdowns"].items())
    lines = [(f"digits_demo: digits_cnn on {g['model_input'][1]}x{g['model_input'][2]} from "
              f"{g['frame_size'][0]}x{g['frame_size'][1]} mono8 frames; {slow} (EMULATED); strategy "
              f"{g['strategy']}, {g['scheduler_policy']} shares"),
             f"{'':24} {'accuracy':>9} {'frames':>7}",
             f"{'fused (/kaitian/fused)':24} {r['fused_accuracy']:9.4f} {r['frames']:7d}",
             f"{'single device':24} {r['single_device_accuracy']:9.4f} {r['frames']:7d}",
             (f"agree {r['agree']:.4f}, incomplete {r['incomplete']}, model input == training sample for "
              f"{r['inputs_equal_training_samples']}/{r['frames']} frames, max |logit diff| "
              f"{r['max_abs_logit_diff']:.1e}, plans {r['strategies']}, "
              f"trunk output rows per node {r['trunk_output_rows']}, "
              f"median latency {r['latency_ms_median'] or 0:.1f} ms"),
             (f"weights {r['weights']}: test accuracy {r['weights_test_accuracy']:.4f} on the trainer's "
              "whole test split")]
    if "training" in r:
        t = r["training"]
        lines.append(f"trained here: {t['epochs_completed']} epochs on {t['ranks']} ranks {t['devices']}, "
                     f"slowdowns {t['emulated_slowdown']} (EMULATED), test accuracy {t['test_accuracy']:.4f}, "
                     f"{t['wall_s']:.0f} s")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    classes = list(r["per_class"])
    xs = range(len(classes))
    for dx, key, label in ((-0.2, "fused_accuracy", "fused (2 nodes)"),
                           (0.2, "single_device_accuracy", "single device")):
        a.bar([x + dx for x in xs], [r["per_class"][c][key] or 0.0 for c in classes], width=0.4, label=label)
    a.set_xticks(list(xs), classes)
    lowest = min((v[k] for v in r["per_class"].values() for k in ("fused_accuracy", "single_device_accuracy")
                  if v[k] is not None), default=1.0)
    a.set_ylim(min(0.8, lowest - 0.02), 1.0)
    a.set_xlabel("digit")
    a.set_ylabel("top-1 accuracy")
    a.set_title(f"fused {r['fused_accuracy']:.4f}, single {r['single_device_accuracy']:.4f} "
                f"({r['frames']} frames)")
    a.legend(fontsize=8, loc="lower right")
    b.plot(r["latencies_ms"], lw=0.8)
    b.set_xlabel("frame")
    b.set_ylabel("latency ms (coordinator)")
    b.set_title("slowdowns " + ", ".join(f"{k} x{v:g}" for k, v in r["graph"]["slowdowns"].items()) + " (EMULATED)")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``kaitian bench digits [--quick] [--json PATH] [--weights PATH] [--frames N]``."""
    p = BenchArgumentParser(prog="kaitian bench digits",
                            description="train digits_cnn with kaitian train (unless --weights), serve the "
                                        "held-out digits through the digits_demo graph, compare the fused "
                                        "accuracy with the same weights on one device")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_FRAMES} frames and {QUICK_EPOCHS} training epochs (default {FRAMES} and {EPOCHS})")
    p.add_argument("--weights", metavar="PATH",
                   help="state_dict of digits_cnn (kaitian train --camera-inputs --save-weights PATH); "
                        "default: train one here with kaitian train, into digits_cnn.pt next to the JSON")
    p.add_argument("--frames", type=int, help="held-out digit frames to stream (the test split has 450)")
    p.add_argument("--json", help=f"result JSON path (default {DEFAULT_DIR}/digits.json; PNG next to it)")
    p.add_argument("--echo", action="store_true", help="print the nodes' output")
    a = p.parse_args(argv)
    frames = a.frames if a.frames is not None else (QUICK_FRAMES if a.quick else FRAMES)
    if frames < 1:
        p.error(f"--frames must be >= 1, got {frames}")
    weights = Path(a.weights) if a.weights else None
    if weights is not None and not weights.is_file():
        p.error(f"--weights {a.weights}: no such file")
    json_path = Path(a.json) if a.json else DEFAULT_DIR / "digits.json"
    png_path = json_path.with_suffix(".png")
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        result = run_bench(frames=frames, weights=weights, train_to=json_path.with_name("digits_cnn.pt"),
                           epochs=QUICK_EPOCHS if a.quick else EPOCHS, echo=a.echo)
        result["bench_seconds"] = time.monotonic() - t0
        plot(result, png_path)
        result["plot"] = str(png_path)
        json_path.write_text(json.dumps(result, indent=2))
    except Exception as e:  # noqa: BLE001 - one line, whatever failed (a node's output tail is in the message)
        print(f"kaitian bench digits: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(table(result))
    print(f"wrote {json_path} and {png_path} ({result['bench_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
