"""The attacker of ``kaitian bench chaos``: a process of its own on the graph's router (its own
Zenoh session, its own identity when the security option is on), so that what it sends is
what any other process on the network could send.

Two modes (the router comes from ``KAITIAN_ROUTER``, like every node)::

    python -m kaitian_ros.bench.chaos_attack flood --node compute_0 --seconds 20 --rate 1000 ...
    python -m kaitian_ros.bench.chaos_attack serve --topic /kaitian/plan=LoadAssignment ...

``flood`` publishes unsolicited, valid-looking INPUT TensorChunks at one compute node's chunk
topic: pixel rows of the node's part of the newest plan that uses it (its version, its rows,
the model's width), each chunk a request id of its own in the range a coordinator uses, for
``--seconds`` at ``--rate`` chunks per second; it prints one JSON line with what it sent
(``--wait-go``: first ``{"ready": ...}`` once set up, and the flood starts on a line on stdin).

``serve`` declares a publisher per ``--topic`` (and one of another type on the same name, for
wrong-type messages), prints ``{"ready": ...}`` and then takes JSON commands on stdin, one per
line, answering each with one JSON line:

- ``{"op": "publish", "topic": T, "cdr_b64": ..., "copies": n}``: publish these bytes;
- ``{"op": "fuzz", "topic": T, "seed_b64": ..., "count": n, "rate": r, "seed": s}``: publish
  ``n`` messages derived from a valid one (random bytes, truncations, flipped bytes, huge length
  fields, hostile field values, another type), and say how many of each class went out and how
  many of them this package's decoder refuses (those must each be counted as malformed by every
  subscriber);
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

FUZZ_CLASSES = ("random", "truncated", "flipped", "length", "fields", "wrong_type")
WRONG_TYPE = "String"  # what a wrong-type message on a topic is (its key names another type)


def _say(obj: dict[str, Any]) -> None:
    # one write: print() sends the text and its newline separately
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _runtime(name: str) -> Any:
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import NodeArgs

    rt = EmbeddedRuntime(NodeArgs(name))
    threading.Thread(target=rt.spin, daemon=True).start()
    return rt


# =========================================================================== flood
def flood(args: argparse.Namespace) -> int:
    import torch

    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.nodes import protocol as proto
    from kaitian_ros.runtime.api import QoS

    spec = ic.ModelSpec(args.model, (args.channels, args.height, args.width), args.num_classes, 0, "")
    graph = ic.build_graph(spec)
    rt = _runtime("chaos_flood")
    plans: list[Any] = []
    lock = threading.Lock()

    def on_plan(msg: Any) -> None:
        with lock:
            plans.append(msg)

    rt.create_subscription(proto.PLAN_TOPIC, "LoadAssignment", on_plan, QoS.LATCHED)
    pub = rt.create_publisher(proto.chunk_topic(args.node), "TensorChunk", QoS.RELIABLE)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    deadline = time.monotonic() + 10.0
    while not plans and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let the new publisher's route to the node settle

    def target() -> tuple[int, int, int] | None:
        """(version, first row, last row) of the victim in the newest plan that gives it rows."""
        with lock:
            recent = list(reversed(plans))
        for msg in recent:
            try:
                plan = ic.plan_from_msg(graph, msg, args.slab_rows)
            except ValueError:
                continue
            if args.node in plan.active_nodes():
                lo, hi = plan.input_rows_for(args.node)
                return int(msg.version), lo, hi
        return None

    aim = target()
    if aim is None:
        _say({"error": f"no plan gives {args.node} rows within 10 s", "sent": 0})
        rt.shutdown()
        rt.close()
        return 1
    if args.wait_go:  # set up (imports, model, plan) outside the measured windows; flood on "go"
        _say({"ready": {"node": args.node, "plan_version": aim[0], "rows": [aim[1], aim[2]]}})
        if not sys.stdin.readline():
            rt.shutdown()
            rt.close()
            return 0
    rng = np.random.default_rng(args.seed)
    pixels = torch.from_numpy(rng.integers(0, 256, (1, args.channels, args.height, args.width), dtype=np.uint8))
    first_id = proto.first_request_id() + 10_000_000  # a coordinator's id range, ahead of its own
    sent, bytes_sent = 0, 0
    period = 1.0 / args.rate
    start = time.monotonic()
    end = start + args.seconds
    next_aim = start + 0.5
    while not stop.is_set():
        now = time.monotonic()
        if now >= end:
            break
        if now >= next_aim:  # follow re-plans: an unsolicited chunk should look current
            aim = target() or aim
            next_aim = now + 0.5
        version, lo, hi = aim
        slab = hi - lo if args.whole_stripes else args.slab_rows
        a = lo + int(rng.integers(0, max(1, hi - lo)))
        a = min(a, max(lo, hi - slab))
        z = min(hi, a + slab)
        msg = ic.chunk_message(request_id=first_id + sent, plan_version=version, producer=proto.COORDINATOR,
                               consumer=args.node, segment=0, role=proto.ROLE_INPUT, row_offset=a,
                               total_rows=args.height, rows=pixels[:, :, :z - a], slab_index=0,
                               last_slab=z >= hi, frame_id="camera")
        pub.publish(msg)
        sent += 1
        bytes_sent += len(msg.data)
        wait = start + sent * period - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    # the flood is over: a SIGTERM from now on must not kill us before we report. Python puts
    # its own handlers back to the default as the interpreter finalises, an ignored signal it keeps
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    took = time.monotonic() - start
    _say({"sent": sent, "seconds": round(took, 2), "rate": round(sent / took, 1) if took else 0.0,
          "payload_mb": round(bytes_sent / 1e6, 1), "stopped_early": stop.is_set()})
    rt.shutdown()
    rt.close()
    return 0


# =========================================================================== fuzz
_INT_RANGES = {"int8": (-2**7, 2**7 - 1), "uint8": (0, 2**8 - 1), "byte": (0, 255), "char": (0, 255),
               "int16": (-2**15, 2**15 - 1), "uint16": (0, 2**16 - 1), "int32": (-2**31, 2**31 - 1),
               "uint32": (0, 2**32 - 1), "int64": (-2**63, 2**63 - 1), "uint64": (0, 2**64 - 1)}
_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308, -1e-308, 3.5)
_STRINGS = ("", "compute_0", "compute_1", "coordinator", "scheduler", "x" * 5000, "\x00", "\u00e9\u4e2d",
            "/kaitian/plan", "stripes", "single", "layerwise", "rgb8", "mono16", "32FC1")


def _hostile_scalar(base: str, rng: np.random.Generator) -> Any:
    if base in _INT_RANGES:
        lo, hi = _INT_RANGES[base]
        return int(rng.choice([lo, hi, 0, 1, hi - 1, int(rng.integers(0, min(hi, 2**62) + 1))]))
    if base in ("float32", "float64"):
        return float(rng.choice(_FLOATS)) if rng.random() < 0.7 else float(rng.normal(0, 1e6))
    if base == "bool":
        return bool(rng.integers(0, 2))
    if base == "string":
        return str(rng.choice(_STRINGS))
    return 0


def _hostile_array(base: str, length: int, rng: np.random.Generator) -> Any:
    from kaitian_ros.runtime.interfaces import NUMPY_OF_ROS

    n = int(rng.choice([0, 1, max(0, length - 1), length + 1, 2 * length + 3, int(rng.integers(0, 64))]))
    if base == "string":
        return [str(rng.choice(_STRINGS)) for _ in range(n)]
    dtype = NUMPY_OF_ROS[base]
    if base in ("float32", "float64"):
        pool: np.ndarray = np.asarray(_FLOATS + tuple(rng.normal(0, 1e6, 8)), dtype=dtype)
        return rng.choice(pool, n)
    if base == "bool":
        return rng.integers(0, 2, n).astype(dtype)
    lo, hi = _INT_RANGES[base]
    out = rng.integers(lo, hi, n, dtype=dtype, endpoint=True)
    if n:  # and the extremes somewhere
        out[rng.integers(0, n, max(1, n // 8))] = rng.choice(np.asarray([lo, hi, 0, 1], dtype=dtype))
    return out


def mutate_fields(msg: Any, type_name: str, rng: np.random.Generator, p: float = 0.4) -> Any:
    """A copy of ``msg`` whose fields are, each with probability ``p``, replaced by hostile
    values of the field's own type (extremes, NaN/inf, empty or odd strings, arrays of the
    wrong length), so that the message still encodes."""
    from kaitian_ros.runtime import interfaces

    _, fielddefs = interfaces.typestore().fielddefs[interfaces.full_type_name(type_name)]
    changes: dict[str, Any] = {}
    for name, (kind, detail) in fielddefs:
        if rng.random() >= p:
            continue
        if kind.name == "BASE":
            changes[name] = _hostile_scalar(detail[0], rng)
        elif kind.name == "NAME":
            changes[name] = mutate_fields(getattr(msg, name), detail, rng, p)
        elif kind.name in ("SEQUENCE", "ARRAY"):
            inner_kind, inner = detail[0]
            if inner_kind.name == "BASE" and kind.name == "SEQUENCE":
                changes[name] = _hostile_array(inner[0], len(getattr(msg, name)), rng)
    return dataclasses.replace(msg, **changes)


def fuzz_payloads(seed: bytes, type_name: str, count: int, rng: np.random.Generator) -> Iterator[tuple[str, bytes]]:
    """``count`` (class, bytes) derived from the valid CDR ``seed``, the classes in turn."""
    from kaitian_ros.runtime import interfaces

    valid = interfaces.decode(seed, type_name)
    wrong = bytes(interfaces.encode(interfaces.make(WRONG_TYPE, data="fuzz"), WRONG_TYPE))
    n = len(seed)
    for k in range(count):
        cls = FUZZ_CLASSES[k % len(FUZZ_CLASSES)]
        if cls == "random":
            out = rng.integers(0, 256, int(rng.integers(0, 2 * n + 8)), dtype=np.uint8).tobytes()
        elif cls == "truncated":
            out = seed[:int(rng.integers(0, n))]
        elif cls == "flipped":
            buf = bytearray(seed)
            for i in rng.integers(0, n, int(rng.integers(1, 9))):
                buf[i] ^= int(rng.integers(1, 256))
            out = bytes(buf)
        elif cls == "length":  # a huge uint32 where lengths live (4-aligned after the header)
            buf = bytearray(seed)
            at = 4 + 4 * int(rng.integers(0, max(1, (n - 8) // 4)))
            buf[at:at + 4] = int(rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 0x10000000, n * 4])).to_bytes(4, "little")
            out = bytes(buf)
        elif cls == "fields":
            try:
                out = bytes(interfaces.encode(mutate_fields(valid, type_name, rng), type_name))
            except Exception:  # noqa: BLE001 - rosbags' encoder raises assorted errors for a value the type cannot carry: a flipped byte instead
                buf = bytearray(seed)
                buf[int(rng.integers(0, n))] ^= 0xFF
                out = bytes(buf)
        else:
            out = wrong
        yield cls, out


def decodable(payload: bytes, type_name: str) -> bool:
    """Whether this package's decoder takes ``payload`` (as a subscriber would)."""
    from kaitian_ros.runtime import interfaces

    try:
        interfaces.decode(payload, type_name)
    except interfaces.DecodeError:
        return False
    return True


# =========================================================================== serve
def serve(args: argparse.Namespace) -> int:
    from kaitian_ros.runtime.api import QoS

    try:
        rt = _runtime("chaos_attacker")
        pubs: dict[str, tuple[str, Any, Any]] = {}
        for spec in args.topic:
            topic, _, type_name = spec.partition("=")
            pubs[topic] = (type_name, rt.create_publisher(topic, type_name, QoS.RELIABLE),
                           rt.create_publisher(topic, WRONG_TYPE, QoS.RELIABLE))
    except Exception as exc:  # noqa: BLE001 - e.g. refused by a secured router: any failure goes to the bench as a line
        _say({"ready": False, "error": " ".join(str(exc).split())})
        return 1
    time.sleep(0.5)  # let the publishers' routes settle before the first command
    _say({"ready": {"topics": sorted(pubs)}})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "exit":
                break
            type_name, pub, wrong_pub = pubs[cmd["topic"]]
            if op == "publish":
                payload = base64.b64decode(cmd["cdr_b64"])
                for _ in range(int(cmd.get("copies", 1))):
                    pub.publish_raw(payload)
                _say({"ok": True, "sent": int(cmd.get("copies", 1))})
            elif op == "fuzz":
                _say(_fuzz(cmd, type_name, pub, wrong_pub))
            else:
                _say({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - one bad command must not end the attacker
            _say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    rt.shutdown()
    rt.close()
    return 0


def _fuzz(cmd: dict[str, Any], type_name: str, pub: Any, wrong_pub: Any) -> dict[str, Any]:
    rng = np.random.default_rng(int(cmd.get("seed", 0)))
    seed = base64.b64decode(cmd["seed_b64"])
    count, rate = int(cmd["count"]), float(cmd.get("rate", 2000.0))
    by_class = dict.fromkeys(FUZZ_CLASSES, 0)
    undecodable = 0
    start = time.monotonic()
    for k, (cls, payload) in enumerate(fuzz_payloads(seed, type_name, count, rng)):
        if cls == "wrong_type":
            wrong_pub.publish_raw(payload)
        else:
            undecodable += not decodable(payload, type_name)
            pub.publish_raw(payload)
        by_class[cls] += 1
        wait = start + (k + 1) / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    sent = sum(by_class.values())
    took = time.monotonic() - start
    return {"ok": True, "sent": sent, "by_class": by_class, "undecodable": undecodable,
            "wrong_type": by_class["wrong_type"], "decodable": sent - undecodable - by_class["wrong_type"],
            "seconds": round(took, 2)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kaitian_ros.bench.chaos_attack")
    sub = p.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("flood")
    f.add_argument("--node", required=True)
    f.add_argument("--seconds", type=float, default=20.0)
    f.add_argument("--rate", type=float, default=1000.0)
    f.add_argument("--model", default="resnet18")
    f.add_argument("--channels", type=int, default=3)
    f.add_argument("--height", type=int, default=224)
    f.add_argument("--width", type=int, default=224)
    f.add_argument("--num-classes", type=int, default=1000)
    f.add_argument("--slab-rows", type=int, default=64)
    f.add_argument("--whole-stripes", action="store_true",
                   help="each chunk carries the node's whole input stripe: a request it computes and finishes "
                        "(--slab-rows slabs of a plan that sends its input whole cost it only their bookkeeping)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--wait-go", action="store_true",
                   help="print {\"ready\": ...} when set up, flood after a line on stdin")
    s = sub.add_parser("serve")
    s.add_argument("--topic", action="append", default=[], help="TOPIC=Type, repeated")
    args = p.parse_args(argv)
    return flood(args) if args.mode == "flood" else serve(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
