"""Shared test utilities: free ports, a router per test, child processes, an in-process probe node.

The ``router`` fixtures built on `Router` are in conftest.py. Run as a script, this file is
also the small "other process" the transport tests talk to::

    python test/helpers.py echo TYPE [TYPE ...]      # re-encode /rt_in/<T> onto /rt_out/<T>
    python test/helpers.py latched_pub TOPIC TEXT... # publish Strings on a latched topic, then spin
    python test/helpers.py sub_print TOPIC QOS N     # print the first N Strings received, exit
    python test/helpers.py qos_pub                   # Strings on /qos/reliable and /qos/best_effort
    python test/helpers.py fused_pub N TOPIC[,TOPIC] # a plan, then N FusedOutputs (+ diagnostics, images)
                                                     # once every TOPIC has a subscriber
    python test/helpers.py slow_param SECONDS        # a node whose parameter `level` takes SECONDS to set

Every child prints one JSON line ``{"ready": ...}`` once its entities are declared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve()
DEADLINE_S = 20.0  # liveness deadline for "eventually" waits (never a performance assertion)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# --- ports, routers, environments ---------------------------------------------------------

# after the sys.path insert above: this file also runs as a script from a source tree
from kaitian_ros.ports import PortTaken, free_port, on_free_port  # noqa: E402, F401 - shared with the package; the tests import free_port from here
from kaitian_ros.processes import DEFAULT_ESCALATION  # noqa: E402 - the launcher's stop escalation


def child_env(router: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, KAITIAN_ROUTER=router, KAITIAN_RUNTIME="embedded", ROS_DOMAIN_ID="0",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("KAITIAN_LOG_LEVEL", None)
    env.update(extra)
    return env


class Router:
    """A zenoh router session hosted in the test process on a fresh loopback port."""

    def __init__(self) -> None:
        from kaitian_ros.runtime import zenoh_session as zs

        def attempt(port: int) -> None:
            self.endpoint = f"tcp/127.0.0.1:{port}"
            try:
                self.session = zs.open_session("router", listen=self.endpoint)
            except zs.SessionError as exc:  # pragma: no cover - rare race
                raise PortTaken(str(exc)) from exc

        on_free_port(attempt, what="the test's router")

    def close(self) -> None:
        self.session.close()


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S,
               interval_s: float = 0.02) -> Any:
    """Poll until ``predicate()`` is truthy; fail naming ``what`` if it never becomes so."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def wait_routed(pub: Any, what: str = "", timeout_s: float = DEADLINE_S) -> None:
    """Until a subscriber in another session matches ``pub`` (an EmbeddedPublisher): what is
    published from then on is routed to it. Instead of sleeping "to let a route settle"; a
    subscriber in the publisher's own session (a test's collector) does not count."""
    import zenoh

    check = pub._rt.session.declare_publisher(pub.key, allowed_destination=zenoh.Locality.REMOTE)
    try:
        wait_until(lambda: check.matching_status.matching, what or f"a remote subscriber of {pub.topic}", timeout_s)
    finally:
        check.undeclare()


# --- child processes ----------------------------------------------------------------------

class Proc:
    """A child process whose merged output is collected line by line on a thread."""

    def __init__(self, cmd: list[str], env: dict[str, str], *, new_session: bool = False) -> None:
        self.cmd = cmd
        self.p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True, bufsize=1, cwd=str(REPO),
                                  start_new_session=new_session)
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.p.pid

    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def find(self, pattern: str) -> list[re.Match]:
        rx = re.compile(pattern)
        with self._lock:
            return [m for m in (rx.search(line) for line in self.lines) if m]

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = DEADLINE_S) -> list[re.Match]:
        def seen() -> list[re.Match] | None:
            found = self.find(pattern)
            if len(found) >= count:
                return found
            if self.p.poll() is not None:
                self._reader.join(timeout=1.0)
                found = self.find(pattern)
                if len(found) >= count:
                    return found
                raise AssertionError(f"{self.cmd[1:4]} exited ({self.p.returncode}) before printing "
                                     f"{pattern!r}:\n{self.output()}")
            return None

        try:
            return wait_until(seen, f"{pattern!r} in the output of {self.cmd[1:4]}", timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- output ---\n{self.output()}") from None

    def ready(self, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
        match = self.wait_for(r'^\{"ready"', timeout_s=timeout_s)[0]
        return json.loads(match.string)["ready"]

    def alive(self) -> bool:
        return self.p.poll() is None

    def wait(self, timeout_s: float = DEADLINE_S) -> int:
        code = self.p.wait(timeout=timeout_s)
        self._reader.join(timeout=2.0)
        return code

    def stop(self) -> None:
        """SIGINT, then SIGKILL if it does not end within what a launcher may take to stop its
        nodes (its own SIGINT, SIGTERM, SIGKILL escalation, and a margin): killed earlier, it
        would leave them to die on their own, after a test's check that nothing is left;
        always reaps."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(timeout=sum(grace for _, grace in DEFAULT_ESCALATION) + 3.0)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._reader.join(timeout=2.0)


def spawn_helper(role: str, *args: str, router: str) -> Proc:
    return Proc([sys.executable, "-u", str(HELPERS), role, *args], child_env(router))


def spawn_node(module: str, name: str, router: str, *params: str) -> Proc:
    """A node executable as ``launch`` starts it: ``python -m kaitian_ros.nodes.X --ros-args ...``."""
    cmd = [sys.executable, "-u", "-m", f"kaitian_ros.nodes.{module}", "--ros-args", "-r", f"__node:={name}"]
    for p in params:
        cmd += ["-p", p]
    return Proc(cmd, child_env(router))


def run_cli(*args: str, router: str | None = None, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """``kaitian ARGS`` as a user types it (the console script's module, in a fresh interpreter)."""
    cmd = [sys.executable, "-m", "kaitian_ros.cli"]
    if router is not None:
        cmd += ["--router", router]
    env = child_env(router or "tcp/127.0.0.1:1")
    return subprocess.run(cmd + list(args), env=env, capture_output=True, check=False, text=True, timeout=timeout_s,
                          cwd=str(REPO))


def run_clis(*calls: tuple[str, ...], router: str | None = None,
             timeout_s: float = 30.0) -> list[subprocess.CompletedProcess]:
    """``run_cli`` for each tuple of ARGS in ``calls``, all at once (each its own interpreter):
    independent commands overlap their start-ups and waits instead of queueing them. The
    results in the order of ``calls``."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda args: run_cli(*args, router=router, timeout_s=timeout_s), calls))


# --- process inspection (no psutil on this box: /proc) -------------------------------------

def pid_running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def pids_with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment has ``key=value`` (finds every descendant we spawned)."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_running(int(entry.name)):
            found.append(int(entry.name))
    return found


# --- an in-process probe node ----------------------------------------------------------------

class Collector:
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.lock = threading.Lock()

    def __call__(self, item: Any) -> None:
        with self.lock:
            self.items.append(item)

    def snapshot(self) -> list[Any]:
        with self.lock:
            return list(self.items)

    def __len__(self) -> int:
        with self.lock:
            return len(self.items)


class Probe:
    """An EmbeddedRuntime node in the test process, spinning on a thread."""

    def __init__(self, router: str, name: str = "probe") -> None:
        from kaitian_ros.runtime.embedded import EmbeddedRuntime
        from kaitian_ros.runtime.node_args import NodeArgs

        self.rt = EmbeddedRuntime(NodeArgs(name), router=router, domain=0)
        self.thread = threading.Thread(target=self.rt.spin, daemon=True)
        self.thread.start()

    def collect(self, topic: str, msg_type: str, qos: Any = None) -> Collector:
        from kaitian_ros.runtime.api import QoS

        sink = Collector()
        self.rt.create_subscription(topic, msg_type, sink, qos or QoS.RELIABLE)
        return sink

    def close(self) -> None:
        self.rt.shutdown()
        self.thread.join(timeout=5.0)
        self.rt.close()


def raw_session(router: str) -> Any:
    """A plain zenoh peer session (to publish bytes no kaitian publisher would produce)."""
    from kaitian_ros.runtime import zenoh_session as zs

    return zs.open_session("peer", connect=router)


# --- child roles --------------------------------------------------------------------------------

def _child_runtime(name: str) -> Any:
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import NodeArgs

    rt = EmbeddedRuntime(NodeArgs(name), domain=0)
    signal.signal(signal.SIGINT, lambda *_: rt.shutdown())
    signal.signal(signal.SIGTERM, lambda *_: rt.shutdown())
    return rt


def _ready(**info: Any) -> None:
    print(json.dumps({"ready": info}), flush=True)


def _role_echo(types: list[str]) -> None:
    """Decode what arrives on /rt_in/<T> and publish it re-encoded on /rt_out/<T>."""
    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime("echo")
    gids = {}
    for name in types:
        short = name.rsplit("/", 1)[-1]
        pub = rt.create_publisher(f"/rt_out/{short}", name, QoS.RELIABLE)
        gids[short] = pub.gid.hex()

        def forward(msg: Any, pub: Any = pub, name: str = name) -> None:
            pub.publish_raw(interfaces.encode(msg, name))

        rt.create_subscription(f"/rt_in/{short}", name, forward, QoS.RELIABLE)
    _ready(gids=gids)
    rt.spin()
    rt.close()


def _role_latched_pub(topic: str, texts: list[str]) -> None:
    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime("latched_pub")
    pub = rt.create_publisher(topic, "String", QoS.LATCHED)
    for text in texts:
        pub.publish(interfaces.make("String", data=text))
    _ready(published=texts)
    rt.spin()
    rt.close()


def _role_sub_print(topic: str, qos: str, count: int) -> None:
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime("sub_print")
    got: list[str] = []

    def on_msg(msg: Any) -> None:
        got.append(msg.data)
        print(json.dumps({"data": msg.data}), flush=True)
        if len(got) >= count:
            rt.shutdown()

    rt.create_subscription(topic, "String", on_msg, QoS(qos))
    _ready(topic=topic)
    rt.spin()
    rt.close()


def _role_qos_pub() -> None:
    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime("qos_pub")
    pubs = {q: rt.create_publisher(f"/qos/{q.value}", "String", q) for q in (QoS.RELIABLE, QoS.BEST_EFFORT)}
    index = {"n": 0}

    def tick() -> None:
        index["n"] += 1
        for q, pub in pubs.items():
            pub.publish(interfaces.make("String", data=f"{q.value} {index['n']}"))

    rt.create_timer(0.02, tick)
    _ready(topics=[p.topic for p in pubs.values()])
    rt.spin()
    rt.close()


FUSED_PUB_TOPICS = {"fused": "/kaitian/fused", "plan": "/kaitian/plan", "diagnostics": "/diagnostics",
                    "image": "/camera/image_raw"}


FUSED_LABELS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def fused_output_fields(i: int) -> dict[str, Any]:
    """The i-th FusedOutput fused_pub sends: every 5th (i % 5 == 3) incomplete, the others a
    (1, 10) float32 logits tensor with top_class/top_score as the coordinator computes them."""
    import numpy as np

    fields: dict[str, Any] = {"request_id": 1_000_000 + i, "plan_version": 2, "latency_ms": 10.0 + 1.25 * i}
    if i % 5 == 3:
        return fields | {"complete": False, "top_class": -1, "top_score": 0.0,
                         "status": "timeout: missing rows 4-6 from compute_1"}
    logits = np.random.default_rng(i).normal(size=(1, 10)).astype(np.float32)
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    return fields | {"complete": True, "top_class": int(probs.argmax()), "top_score": float(probs.max()),
                     "top_label": FUSED_LABELS[int(probs.argmax())],
                     "status": "ok", "node_ids": ["compute_0", "compute_1"], "node_rows": [4, 3],
                     "dtype_code": 2, "dtype_bits": 32, "shape": [1, 10], "data": logits.tobytes()}


def _role_fused_pub(count: int, wait_for: list[str]) -> None:
    """A latched plan (version 1) at once; when every topic in ``wait_for`` has a subscriber,
    plan version 2, then ``count`` FusedOutputs and, with every other one, a DiagnosticArray and
    a small Image. Prints what it sent, with the sha256 of each payload, then spins."""
    import hashlib

    import numpy as np

    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime("fused_pub")
    pubs = {"fused": rt.create_publisher(FUSED_PUB_TOPICS["fused"], "FusedOutput", QoS.RELIABLE),
            "plan": rt.create_publisher(FUSED_PUB_TOPICS["plan"], "LoadAssignment", QoS.LATCHED),
            "diagnostics": rt.create_publisher(FUSED_PUB_TOPICS["diagnostics"], "DiagnosticArray", QoS.RELIABLE),
            "image": rt.create_publisher(FUSED_PUB_TOPICS["image"], "Image", QoS.BEST_EFFORT)}
    sent: dict[str, list[Any]] = {name: [] for name in pubs}
    hashes: dict[str, list[str]] = {FUSED_PUB_TOPICS[name]: [] for name in pubs}

    def send(name: str, msg: Any, record: Any) -> None:
        cdr = interfaces.encode(msg, pubs[name].msg_type)
        hashes[FUSED_PUB_TOPICS[name]].append(hashlib.sha256(bytes(cdr)).hexdigest())
        pubs[name].publish_raw(cdr)
        sent[name].append(record)

    def plan(version: int) -> Any:
        return interfaces.make("LoadAssignment", incarnation=7, version=version, node_ids=["compute_0", "compute_1"],
                               shares=np.array([0.5, 0.5]), policy="static", strategy="stripes",
                               reason=f"test plan {version}")

    send("plan", plan(1), 1)
    _ready(topics=FUSED_PUB_TOPICS)
    try:
        wait_until(lambda: all(pubs[name]._pub.matching_status.matching for name in wait_for),
                   f"a subscriber on each of {wait_for}", interval_s=0.05)
    except AssertionError:
        print(json.dumps({"error": f"no subscriber on {wait_for}"}), flush=True)
        rt.close()
        return
    # a late joiner (the recorder) queries the cached plan 1 when it subscribes; that query is
    # answered by zenoh inside this process, with nothing here to wait on: a grace period
    time.sleep(0.5)
    send("plan", plan(2), 2)
    for i in range(count):
        fields = fused_output_fields(i)
        msg_fields = dict(fields)
        for key, dtype in (("shape", np.int64), ("node_rows", np.uint32)):
            if key in msg_fields:
                msg_fields[key] = np.asarray(msg_fields[key], dtype)
        if "data" in msg_fields:
            msg_fields["data"] = np.frombuffer(msg_fields["data"], np.uint8)
        send("fused", interfaces.make("FusedOutput", header=interfaces.header("camera"), **msg_fields),
             {k: v for k, v in fields.items() if k != "data"})
        if i % 2 == 0:
            status = interfaces.make("DiagnosticStatus", level=0, name=f"fused_pub: {i}", message="ok")
            send("diagnostics", interfaces.make("DiagnosticArray", header=interfaces.header(), status=[status]),
                 f"fused_pub: {i}")
            send("image", interfaces.make("Image", header=interfaces.header(f"frame {i}"), height=2, width=3,
                                          encoding="rgb8", step=9, data=np.full(18, i, np.uint8)), f"frame {i}")
        time.sleep(0.02)  # a camera's pace, not a burst: the best-effort images are not dropped
    print(json.dumps({"sent": sent, "sha256": hashes}), flush=True)
    rt.spin()
    rt.close()


def _role_slow_param(seconds: float) -> None:
    """A node whose on-set callback takes `seconds` (as a coordinator re-planning inside a set
    on a loaded machine)."""
    from kaitian_ros.runtime.api import ParameterDescriptor, ParameterType, SetParametersResult

    rt = _child_runtime("slow_param")
    rt.declare_parameters([ParameterDescriptor("level", ParameterType.INTEGER, 0, "any level", 0, 10)])

    def slowly(changes: dict[str, Any]) -> SetParametersResult:
        time.sleep(seconds)
        return SetParametersResult(True)

    rt.add_on_set_parameters_callback(slowly)
    _ready(node="slow_param")
    rt.spin()
    rt.close()


def main(argv: list[str]) -> int:
    role, args = argv[0], argv[1:]
    if role == "echo":
        _role_echo(args)
    elif role == "latched_pub":
        _role_latched_pub(args[0], args[1:])
    elif role == "sub_print":
        _role_sub_print(args[0], args[1], int(args[2]))
    elif role == "qos_pub":
        _role_qos_pub()
    elif role == "fused_pub":
        _role_fused_pub(int(args[0]), args[1].split(","))
    elif role == "slow_param":
        _role_slow_param(float(args[0]))
    else:
        print(f"unknown role {role}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
