"""``kaitian bench transport``: TensorChunk throughput of the embedded runtime vs plain Zenoh.

Two processes on loopback (a publisher and a subscriber, both peers of a router this command
hosts on a free port). In the same run, between the same two processes, it measures

- ``ours``: ``EmbeddedPublisher.publish(TensorChunk)`` (fast_cdr encode into a reused buffer, SHM
  buffer for large chunks, attachment, put) to an ``EmbeddedSubscription`` (cached key check + copy
  out of zenoh + fast_cdr decode + executor hand-off to the node callback),
- ``raw``: plain zenoh ``put`` of a prebuilt payload of the same size to a plain zenoh subscriber
  that copies the payload out (``to_bytes()``), the least any Python receiver does. On the same
  payload path as ours: a payload of ``zenoh_session.SHM_PUT_MIN_BYTES`` or more is copied into
  a buffer of the same kind of shared-memory provider first, as ours does (a plain ``put`` of
  bytes would make zenoh copy it into shared memory itself, a different path),

for 4 MiB chunks (GB/s) and 256-byte chunks (messages/s). A second publisher/subscriber pair
runs with ``KAITIAN_SHM=0`` (no shared memory: every byte crosses the loopback TCP link, as in
the inference graph, whose chunks must cross the emulated links) for the 4 MiB rows
``raw_4mib_tcp`` and ``ours_4mib_tcp``; 256-byte messages never use shared memory, so their one
row is already that path. Rates are taken at the subscriber (first to last arrival of a trial);
the reported figure is the median over repeats, with min and max.

With ``--runtime ros`` a second pair of processes runs the same publish/subscribe on the rclpy
runtime (``RosRuntime``: the same codec, raw CDR through rclpy and the RMW, Fast DDS here), in the
same run, side by side. It needs rclpy and this package's generated messages importable (a
sourced ROS 2 workspace, or ``tools/ros2_from_pypi.sh`` then ``source .ros2/env.sh``). A reliable
keep-last-10 DDS writer may overwrite samples a slow reader has not taken: the rclpy rows report
what arrived (``lost``) once nothing more arrived for ``IDLE_S`` after the publisher finished.

Usage: ``kaitian bench transport [--json PATH] [--quick] [--repeats N] [--runtime embedded|ros]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kaitian_ros.bench import BenchArgumentParser
from kaitian_ros.bench.transport_report import ROS_MODES, plot, summarise, table
from kaitian_ros.ports import free_port
from kaitian_ros.processes import start_child, stop_children

BIG = 4 * 1024 * 1024
SMALL = 256
RAW_KEY = "bench/raw"
OURS_TOPIC = "/bench/chunks"
MODES = ("raw_4mib", "ours_4mib", "raw_256b", "ours_256b")
TCP_MODES = ("raw_4mib_tcp", "ours_4mib_tcp")  # the pair without shared memory
ROS_HINT = ("--runtime ros needs rclpy and this package's generated messages: source a ROS 2 workspace "
            "with kaitian_ros built, or run tools/ros2_from_pypi.sh and source .ros2/env.sh")
# after the publisher is done, a trial that still misses samples ends once nothing arrived for
# IDLE_S (a lost sample never comes: keep-last DDS writers overwrite them), at most SETTLE_S
IDLE_S = 1.0
SETTLE_S = 5.0


def _size(mode: str) -> int:
    return BIG if "4mib" in mode else SMALL


def _path_suffix() -> str:
    """``_tcp`` in a child started with KAITIAN_SHM=0 (no shared memory), else ``""``."""
    return "_tcp" if os.environ.get("KAITIAN_SHM", "1") == "0" else ""


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _commands() -> queue.SimpleQueue[dict[str, Any]]:
    """stdin lines (JSON commands from the orchestrator) on a queue."""
    q: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        for line in sys.stdin:
            if line.strip():
                q.put(json.loads(line))
        q.put({"cmd": "quit"})

    threading.Thread(target=pump, daemon=True).start()
    return q


def _runtime(name: str, kind: str) -> Any:
    if kind == "ros":
        from kaitian_ros.runtime.ros import RosRuntime

        return RosRuntime(name, [])
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import NodeArgs

    return EmbeddedRuntime(NodeArgs(name), domain=0)


def ros_available() -> bool:
    """rclpy and the generated kaitian_ros messages import here (checked in a child process:
    importing rclpy in the orchestrator would tie it to one ROS context for nothing)."""
    code = "import rclpy, kaitian_ros.msg; kaitian_ros.msg.TensorChunk"
    return subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, check=False).returncode == 0


# --- subscriber process ------------------------------------------------------------------------

class _Trials:
    """Arrival counting per trial id; reports when a trial's expected count is reached."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.expect: dict[int, tuple[int, str]] = {}
        self.state: dict[int, list[float]] = {}  # trial -> [count, first, last]
        self.warm: set[str] = set()

    def arrived(self, trial: int, mode: str) -> None:
        now = time.perf_counter()
        with self.lock:
            if trial == 0:
                if mode not in self.warm:
                    self.warm.add(mode)
                    _emit({"warm": mode})
                return
            st = self.state.setdefault(trial, [0, now, now])
            st[0] += 1
            st[2] = now
            goal = self.expect.get(trial)
            if goal is not None and st[0] == goal[0]:
                self._report(trial)

    def settle(self, trial: int, idle_s: float, max_s: float) -> None:
        """Wait until the trial is reported, or report it with what arrived once nothing came for
        ``idle_s`` (at most ``max_s`` from now): some samples were lost."""
        start = time.perf_counter()
        while True:
            now = time.perf_counter()
            with self.lock:
                if trial not in self.expect:
                    return
                last = max(self.state.get(trial, [0, start, start])[2], start)
                if now - last >= idle_s or now - start >= max_s:
                    self._report(trial)
                    return
            time.sleep(0.02)

    def _report(self, trial: int) -> None:
        n, mode = self.expect.pop(trial)
        got, first, last = self.state.pop(trial, [0, 0.0, 0.0])
        elapsed = max(last - first, 1e-9)
        rate = (got - 1) / elapsed if got > 1 else 0.0
        _emit({"trial": trial, "mode": mode, "n": got, "lost": n - got, "seconds": elapsed,
               "msgs_per_s": rate, "gbytes_per_s": rate * _size(mode) / 1e9})


def _role_sub(kind: str) -> int:
    from kaitian_ros.runtime.api import QoS

    rt = _runtime("bench_sub", kind)
    trials = _Trials()
    prefix = "ros" if kind == "ros" else "ours"
    suffix = _path_suffix()

    def on_raw(sample: Any) -> None:
        data = sample.payload.to_bytes()
        trials.arrived(int.from_bytes(data[:8], "little"), f"raw_4mib{suffix}" if len(data) == BIG else "raw_256b")

    def on_ours(msg: Any) -> None:
        trials.arrived(int(msg.request_id), f"{prefix}_4mib{suffix}" if len(msg.data) == BIG else f"{prefix}_256b")

    raw_sub = rt.session.declare_subscriber(RAW_KEY, on_raw) if kind == "embedded" else None
    rt.create_subscription(OURS_TOPIC, "TensorChunk", on_ours, QoS.RELIABLE)
    commands = _commands()

    def control() -> None:
        while True:
            cmd = commands.get()
            if cmd["cmd"] == "expect":
                with trials.lock:
                    trials.expect[cmd["trial"]] = (cmd["n"], cmd["mode"])
            elif cmd["cmd"] == "settle":
                trials.settle(cmd["trial"], IDLE_S, SETTLE_S)
            elif cmd["cmd"] == "quit":
                rt.shutdown()
                return

    threading.Thread(target=control, daemon=True).start()
    _emit({"ready": "sub"})
    rt.spin()
    del raw_sub
    rt.close()
    return 0


# --- publisher process -------------------------------------------------------------------------

def _role_pub(kind: str) -> int:
    import numpy as np

    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime.api import QoS

    rt = _runtime("bench_pub", kind)
    ours = rt.create_publisher(OURS_TOPIC, "TensorChunk", QoS.RELIABLE)
    from kaitian_ros.runtime import zenoh_session as zs

    raw = None
    if kind == "embedded":
        raw = rt.session.declare_publisher(RAW_KEY, congestion_control=zs.CongestionControl.BLOCK)
    tensors = {size: np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8) for size in (BIG, SMALL)}

    def chunk(trial: int, size: int) -> Any:
        data = tensors[size]
        return interfaces.make("TensorChunk", request_id=trial, plan_version=1, producer="bench_pub",
                               consumer="bench_sub", role=0, total_rows=size, dtype_code=1, dtype_bits=8,
                               shape=np.array([size], np.int64), data=data)

    def raw_payload(trial: int, size: int) -> bytes:
        return trial.to_bytes(8, "little") + tensors[size][8:].tobytes()

    def send(mode: str, trial: int, n: int, stop: threading.Event | None = None) -> None:
        size = _size(mode)
        if mode.startswith("raw"):
            assert raw is not None  # raw modes run on the embedded runtime only
            payload = raw_payload(trial, size)
            for _ in range(n):
                if stop is not None and stop.is_set():
                    return
                # ours' payload path (EmbeddedPublisher): large payloads copied into our SHM
                # provider's buffer, put as they are; None where shared memory is off
                shm = zs.shm_payload(payload) if size >= zs.SHM_PUT_MIN_BYTES else None
                raw.put(shm if shm is not None else payload)
                if stop is not None:
                    time.sleep(0.02)
        else:
            msg = chunk(trial, size)
            for _ in range(n):
                if stop is not None and stop.is_set():
                    return
                ours.publish(msg)
                if stop is not None:
                    time.sleep(0.02)

    commands = _commands()
    _emit({"ready": "pub"})
    while True:
        cmd = commands.get()
        if cmd["cmd"] == "warm":
            stop = threading.Event()
            warm = threading.Thread(target=send, args=(cmd["mode"], 0, 10_000, stop), daemon=True)
            warm.start()
            while True:
                nxt = commands.get()
                if nxt["cmd"] in ("stop", "quit"):
                    break
            stop.set()
            warm.join()
            _emit({"warmed": cmd["mode"]})
            if nxt["cmd"] == "quit":
                break
        elif cmd["cmd"] == "run":
            start = time.perf_counter()
            send(cmd["mode"], cmd["trial"], cmd["n"])
            _emit({"sent": cmd["trial"], "pub_msgs_per_s": cmd["n"] / max(time.perf_counter() - start, 1e-9)})
        elif cmd["cmd"] == "quit":
            break
    rt.close()
    return 0


# --- orchestrator -------------------------------------------------------------------------------

class _Child:
    def __init__(self, role: str, env: dict[str, str], kind: str = "embedded") -> None:
        self.role = f"{role} ({kind})"
        # rclpy children start outside the source tree: the installed package (with its
        # generated messages) must not be shadowed by a source checkout in the working directory
        # tied to the bench (no orphan when it dies), in its process group as before: Ctrl-C
        # reaches both
        self.p = start_child([sys.executable, "-u", "-m", "kaitian_ros.bench.transport", "--role", role,
                              "--runtime", kind], own_group=False, env=dict(env, KAITIAN_RUNTIME=kind),
                             cwd="/" if kind == "ros" else None,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            line = raw.strip()
            if line.startswith("{"):
                self.q.put(json.loads(line))
        self.q.put({"eof": True})

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def expect(self, key: str, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"bench {self.role}: no '{key}' within {timeout_s:.0f} s") from None
            if "eof" in msg:
                raise RuntimeError(f"bench {self.role} process exited (code {self.p.wait()})")
            if key in msg:
                return msg

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.send(cmd="quit")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout=10)
        stop_children([self.p], ((signal.SIGKILL, 10.0),))


def _pair_of(mode: str) -> str:
    return "ros" if mode in ROS_MODES else "tcp" if mode in TCP_MODES else "embedded"


def measure(repeats: int, n_big: int, n_small: int, log: Any = print,
            runtimes: tuple[str, ...] = ("embedded",)) -> dict[str, list[dict[str, Any]]]:
    """Per mode, one result per repeat; the modes interleave so drift hits every path alike."""
    from kaitian_ros.runtime import zenoh_session as zs

    endpoint = f"tcp/127.0.0.1:{free_port()}"
    router = zs.open_session("router", listen=endpoint)
    env = dict(os.environ, KAITIAN_ROUTER=endpoint, ROS_DOMAIN_ID=os.environ.get("ROS_DOMAIN_ID", "0"),
               PYTHONUNBUFFERED="1")
    pairs: dict[str, tuple[_Child, _Child]] = {}
    modes = MODES + TCP_MODES + (ROS_MODES if "ros" in runtimes else ())
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for kind in runtimes:
            pairs[kind] = (_Child("sub", env, kind), _Child("pub", env, kind))
        tcp = dict(env, KAITIAN_SHM="0")  # the pair whose every byte crosses the TCP link
        pairs["tcp"] = (_Child("sub", tcp), _Child("pub", tcp))
        for sub, pub in pairs.values():
            sub.expect("ready")
            pub.expect("ready")
        for mode in modes:  # routes (peers' direct links, DDS discovery) exist before anything is timed
            sub, pub = pairs[_pair_of(mode)]
            pub.send(cmd="warm", mode=mode)
            sub.expect("warm")
            time.sleep(0.3)
            pub.send(cmd="stop")
            pub.expect("warmed")
        trial = 0
        for rep in range(repeats):
            for mode in modes:
                trial += 1
                sub, pub = pairs[_pair_of(mode)]
                n = n_big if "4mib" in mode else n_small
                sub.send(cmd="expect", trial=trial, n=n, mode=mode)
                time.sleep(0.05)
                pub.send(cmd="run", mode=mode, trial=trial, n=n)
                sent = pub.expect("sent")
                sub.send(cmd="settle", trial=trial)  # the trial as it is, if samples were lost
                result = sub.expect("gbytes_per_s")
                result["pub_msgs_per_s"] = sent["pub_msgs_per_s"]
                results[mode].append(result)
                lost = f", {result['lost']} lost" if result["lost"] else ""
                log(f"  repeat {rep + 1}/{repeats} {mode:10s} {result['gbytes_per_s']:7.3f} GB/s "
                    f"{result['msgs_per_s']:10.0f} msg/s (publisher loop {result['pub_msgs_per_s']:.0f} msg/s{lost})")
    finally:
        for sub, pub in pairs.values():
            pub.close()
            sub.close()
        router.close()
    return results


def main(argv: list[str]) -> int:
    parser = BenchArgumentParser(prog="kaitian bench transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench/results/transport.json", help="output JSON (PNG written next to it)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter trials (smoke run)")
    parser.add_argument("--repeats", type=int, help="repeats per path (default 5, --quick 2)")
    parser.add_argument("--runtime", choices=["embedded", "ros"], default="embedded",
                        help="ros: also measure the rclpy runtime side by side (needs a ROS 2 environment)")
    parser.add_argument("--role", choices=["pub", "sub"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "sub":
        return _role_sub(args.runtime)
    if args.role == "pub":
        return _role_pub(args.runtime)
    if args.runtime == "ros" and not ros_available():
        print(f"kaitian bench transport: {ROS_HINT}", file=sys.stderr)
        return 2
    repeats = args.repeats or (2 if args.quick else 5)
    n_big, n_small = (60, 10_000) if args.quick else (250, 40_000)
    runtimes = ("embedded", "ros") if args.runtime == "ros" else ("embedded",)
    config = {"repeats": repeats, "messages_4mib": n_big, "messages_256b": n_small, "quick": args.quick,
              "cpus": os.cpu_count(), "python": sys.version.split()[0], "runtimes": list(runtimes),
              "rmw": os.environ.get("RMW_IMPLEMENTATION", "default (rmw_fastrtps_cpp)") if "ros" in runtimes else None}
    print(f"kaitian bench transport: {repeats} repeats, {n_big} x 4 MiB and {n_small} x 256 B per trial, "
          f"runtimes: {', '.join(runtimes)}")
    try:
        results = measure(repeats, n_big, n_small, runtimes=runtimes)
    except RuntimeError as exc:
        print(f"kaitian bench transport: {exc}", file=sys.stderr)
        return 1
    summary = summarise(results, config)
    print(table(summary))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(summary, png)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
