"""What ``kaitian bench chaos`` sends through its attacker process (:mod:`kaitian_ros.bench.chaos_attack`):
the handle on that process, the forged control messages of each kind and the fuzz seeds of each
subscribed topic."""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kaitian_ros.bench.chaos_graph import ChaosGraph, diag_float, incarnation_hex
from kaitian_ros.bench.chaos_settings import CAMERA_TOPIC
from kaitian_ros.processes import start_child


# =========================================================================== the attacker
class Attacker:
    """A ``chaos_attack serve`` process: publishes what the bench hands it, fuzzes."""

    def __init__(self, endpoint: str, topics: dict[str, str], env: dict[str, str | None] | None = None) -> None:
        """``env``: variables set for the attacker (None: removed, e.g. its certificate)."""
        cmd = [sys.executable, "-u", "-m", "kaitian_ros.bench.chaos_attack", "serve"]
        for topic, type_name in topics.items():
            cmd += ["--topic", f"{topic}={type_name}"]
        full = dict(os.environ, KAITIAN_ROUTER=endpoint)
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        self.proc = start_child(cmd, own_group=False, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, bufsize=1)
        ready = self._reply(60.0)
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"attacker did not start: {ready.get('error') or ready}")

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        box: list[str] = []
        stdout, stderr = self.proc.stdout, self.proc.stderr
        assert stdout is not None and stderr is not None  # started with pipes
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            err = stderr.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"no answer from the attacker within {timeout_s:.0f} s {err[-800:]}")
        return json.loads(box[0])

    def command(self, timeout_s: float = 60.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None  # started with pipes
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"attacker: {reply.get('error')}")
        return reply

    def publish(self, topic: str, cdr: bytes, copies: int = 1) -> None:
        self.command(op="publish", topic=topic, cdr_b64=base64.b64encode(cdr).decode(), copies=copies)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5.0)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _encode(msg: Any, type_name: str) -> bytes:
    from kaitian_ros.runtime import interfaces

    return bytes(interfaces.encode(msg, type_name))


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    implausible: bool
    topic: str
    cdr: bytes
    listeners: tuple[str, ...]
    reason: str  # the rejected.<reason> each listener must count ("" for a plausible one)
    marker: Callable[[float], bool | None]  # the listeners took it at some time after the given one
    consequence: str


def forgery_variants(g: ChaosGraph, kind: str) -> list[Variant]:
    """The forged messages of one kind, implausible first, then the plausible one."""
    from kaitian_ros.core.authority import new_incarnation
    from kaitian_ros.core.policy_state import Assignment
    from kaitian_ros.nodes import protocol as proto
    from kaitian_ros.runtime import interfaces

    computes = tuple(g.compute_names)
    slow = computes[-1]
    if kind == "plan":
        real = g.latest_plan()
        inc, ver = int(real.incarnation), int(real.version)

        def plan(incarnation: int, version: int, shares: tuple[float, ...] = (1.0,), nodes: tuple[str, ...] = (slow,),
                 strategy: str = "single") -> bytes:
            msg = proto.assignment_msg(Assignment(version, 0, nodes, shares, "adaptive", "chaos forgery", 1.0),
                                    incarnation)
            return _encode(_with(msg, strategy=strategy), "LoadAssignment")

        def has_version(v: int) -> Callable[[float], bool]:
            return lambda since: any(str(v) in d.get("plans", "").split(",") for n in computes
                                     for d in g.diag_since(n, since))

        def follows(incarnation: int) -> Callable[[float], bool]:
            # a compute node logs each coordinator restart it follows: seen even if undone at once
            return lambda since: g.logged_since(
                computes, since, f"restarted: incarnation {incarnation_hex(incarnation)}") or any(
                d.get("coordinator_incarnation") == incarnation_hex(incarnation)
                for n in computes for d in g.diag_since(n, since))

        fake = new_incarnation()
        return [
            Variant("version_jump", f"the coordinator's incarnation, v{ver + 2**31} (a jump of 2**31)", True,
                    proto.PLAN_TOPIC, plan(inc, ver + 2**31), computes, "implausible version", has_version(ver + 2**31),
                    "compute nodes would run a plan the coordinator never made"),
            Variant("no_incarnation", "incarnation 0", True, proto.PLAN_TOPIC, plan(0, ver + 500), computes,
                    "no incarnation", has_version(ver + 500), "compute nodes would follow no authority"),
            Variant("bad_shares", "the coordinator's incarnation, a NaN share", True, proto.PLAN_TOPIC,
                    plan(inc, ver + 700, (math.nan, 1.0), computes[:2], "stripes"), computes, "bad plan",
                    has_version(ver + 700), "compute nodes would build a plan from NaN shares"),
            Variant("new_incarnation", f"a new incarnation from v1: all rows to {slow}", False, proto.PLAN_TOPIC,
                    plan(fake, 1), computes, "", follows(fake),
                    "compute nodes follow the forged coordinator run and refuse the real one's plans as retired: "
                    "every frame times out until the coordinator restarts"),
        ]
    if kind == "assignment":
        real = g.latest_assignment()
        inc, ver = int(real.incarnation), int(real.version)
        nxt = g.latest_request_id() + 1

        def proposal(incarnation: int, version: int, effective: int, shares: tuple[float, ...]) -> bytes:
            return _encode(proto.assignment_msg(Assignment(version, effective, computes, shares, "adaptive",
                                                        "chaos forgery", 1.0), incarnation), "LoadAssignment")

        def coordinator_has(key: str, value: str) -> Callable[[float], bool]:
            return lambda since: (key == "scheduler_incarnation" and g.logged_since(
                ["coordinator"], since, f"restarted: incarnation {value}")) or any(
                d.get(key) == value for d in g.diag_since("coordinator", since))

        fake = new_incarnation()
        only_slow = tuple(1.0 if n == slow else 0.0 for n in computes)
        return [
            Variant("version_jump", f"the scheduler's incarnation, v{ver + 2**31}", True, proto.ASSIGNMENT_TOPIC,
                    proposal(inc, ver + 2**31, nxt, only_slow), ("coordinator",), "implausible version",
                    coordinator_has("scheduler_version", str(ver + 2**31)),
                    "the coordinator would refuse every later real proposal as stale"),
            Variant("effective_far_ahead", "effective from a request 10**9 ahead", True, proto.ASSIGNMENT_TOPIC,
                    proposal(inc, ver + 300, nxt + 10**9, only_slow), ("coordinator",),
                    "implausible effective_from_request", coordinator_has("scheduler_version", str(ver + 300)),
                    "the coordinator would hold a proposal forever"),
            Variant("negative_share", "a negative share", True, proto.ASSIGNMENT_TOPIC,
                    proposal(inc, ver + 400, nxt, (-1.0,) + (1.0,) * (len(computes) - 1)), ("coordinator",),
                    "bad assignment", coordinator_has("scheduler_version", str(ver + 400)),
                    "the coordinator would plan with a negative share"),
            Variant("no_incarnation", "incarnation 0", True, proto.ASSIGNMENT_TOPIC,
                    proposal(0, ver + 500, nxt, only_slow), ("coordinator",), "no incarnation",
                    coordinator_has("scheduler_incarnation", incarnation_hex(0)),
                    "the coordinator would follow no authority"),
            Variant("new_incarnation", f"a new incarnation from v1: all rows to {slow}", False, proto.ASSIGNMENT_TOPIC,
                    proposal(fake, 1, nxt + 2, only_slow), ("coordinator",), "",
                    coordinator_has("scheduler_incarnation", incarnation_hex(fake)),
                    "the coordinator follows the forged scheduler run and retires the real one: adaptation stops "
                    "until the scheduler restarts"),
        ]
    # telemetry: the scheduler decides from it (the coordinator takes heartbeats only)
    idle = g.idle_compute()
    busy = g.busiest_compute()

    def telemetry(node: str, request_id: int, **fields: Any) -> bytes:
        base = dict(node_id=node, device="cpu", request_id=request_id, plan_version=1, rows=10, work=1e9, share=0.5,
                    compute_ms=40.0, transfer_ms=1.0, wait_ms=1.0, bytes_in=1000, bytes_out=1000)
        base.update(fields)
        return _encode(interfaces.make("NodeTelemetry", **base), "NodeTelemetry")

    def scheduler_value(key: str, value: str) -> Callable[[float], bool]:
        return lambda since: any(d.get(key) == value for d in g.diag_since("scheduler", since))

    def speed_not_finite(node: str) -> Callable[[float], bool]:
        # what taking the sample does: the node's speed estimate becomes NaN. Not a rising sample
        # count: an idle node's count also rises when real work reaches it.
        def seen(since: float) -> bool:
            return any(not math.isfinite(diag_float(d.get(f"{node}.speed_flops_per_ms", "0")))
                       or any(k.startswith("share.") and not math.isfinite(diag_float(v)) for k, v in d.items())
                       for d in g.diag_since("scheduler", since))
        return seen

    ahead = int((time.time() + 1800) * 1e6)  # half an hour ahead: inside the one-hour clock skew allowed
    nxt = g.latest_request_id() + 1
    return [
        Variant("request_id_max", "request id 2**64-1", True, proto.TELEMETRY_TOPIC, telemetry(busy, 2**64 - 1),
                ("scheduler",), "implausible request id", scheduler_value("newest_request", str(2**64 - 1)),
                "every later assignment would take effect at an impossible request"),
        Variant("nan_compute_ms", f"NaN compute time for {idle or 'an idle node (none)'}", True, proto.TELEMETRY_TOPIC,
                telemetry(idle or busy, nxt, compute_ms=math.nan), ("scheduler",), "implausible telemetry",
                speed_not_finite(idle or busy), "the scheduler would estimate a speed from NaN"),
        Variant("request_id_ahead", "a request id half an hour ahead of the clock (plausible)", False,
                proto.TELEMETRY_TOPIC, telemetry(busy, ahead), ("scheduler",), "",
                scheduler_value("newest_request", str(ahead)),
                "the scheduler's assignments take effect half an hour of requests ahead; the coordinator refuses "
                "them as implausible: adaptation stops until the scheduler restarts"),
    ]


def _with(msg: Any, **fields: Any) -> Any:
    import dataclasses

    return dataclasses.replace(msg, **fields)


def fuzz_topics(g: ChaosGraph) -> dict[str, str]:
    from kaitian_ros.nodes import protocol as proto

    topics = {CAMERA_TOPIC: "Image", proto.chunk_topic(proto.COORDINATOR): "TensorChunk"}
    topics.update({proto.chunk_topic(n): "TensorChunk" for n in g.compute_names})
    topics.update({proto.PROFILES_TOPIC: "CostProfile", proto.TELEMETRY_TOPIC: "NodeTelemetry",
                   proto.ASSIGNMENT_TOPIC: "LoadAssignment", proto.PLAN_TOPIC: "LoadAssignment"})
    return topics


def fuzz_seeds(g: ChaosGraph) -> dict[str, tuple[str, bytes, tuple[str, ...]]]:
    """Per subscribed topic: (type, a valid message as the graph sends it, its subscribers), in
    the order fuzzed (the plan last: a fuzzed plan can take the compute nodes away from the
    real coordinator)."""
    import numpy as np
    import torch

    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.nodes import protocol as proto
    from kaitian_ros.runtime import interfaces

    p = g.scenario.node("coordinator").parameters
    h, w, slab = int(p["input_height"]), int(p["input_width"]), int(p["slab_rows"])
    plan = g.latest_plan()
    version = int(plan.version) if plan is not None else 1
    # not the camera's frame_id nor a recent stamp: the probe must not take fuzzed frames for real ones
    stamp = interfaces.msg_class("Time")(sec=1, nanosec=0)
    image = interfaces.make("Image", header=interfaces.header("chaos_fuzz", stamp), height=h, width=w, encoding="rgb8",
                            step=w * 3, data=np.zeros(h * w * 3, np.uint8))
    seeds: dict[str, tuple[str, bytes, tuple[str, ...]]] = {
        CAMERA_TOPIC: ("Image", _encode(image, "Image"), ("coordinator",))}
    out_rows = torch.zeros(1, 512, 1, 7)
    seeds[proto.chunk_topic(proto.COORDINATOR)] = ("TensorChunk", _encode(ic.chunk_message(
        request_id=g.latest_request_id() + 1, plan_version=version, producer=g.compute_names[0],
        consumer=proto.COORDINATOR,
        segment=0, role=proto.ROLE_OUTPUT, row_offset=0, total_rows=7, rows=out_rows), "TensorChunk"), ("coordinator",))
    for n in g.compute_names:
        rows = torch.zeros(1, 3, slab, w, dtype=torch.uint8)
        seeds[proto.chunk_topic(n)] = ("TensorChunk", _encode(ic.chunk_message(
            request_id=g.latest_request_id() + 1, plan_version=version, producer=proto.COORDINATOR, consumer=n,
            segment=0, role=proto.ROLE_INPUT, row_offset=0, total_rows=h, rows=rows), "TensorChunk"), (n,))
    with g.rec.lock:
        profile = next(iter(g.rec.profiles.values()), None)
        telemetry = g.rec.telemetry_sample
    if profile is not None:
        seeds[proto.PROFILES_TOPIC] = ("CostProfile", _encode(profile, "CostProfile"), ("coordinator",))
    if telemetry is not None:
        seeds[proto.TELEMETRY_TOPIC] = ("NodeTelemetry", _encode(telemetry, "NodeTelemetry"),
                                        ("scheduler", "coordinator"))
    assignment = g.latest_assignment()
    if assignment is not None:
        seeds[proto.ASSIGNMENT_TOPIC] = ("LoadAssignment", _encode(assignment, "LoadAssignment"), ("coordinator",))
    if plan is not None:
        seeds[proto.PLAN_TOPIC] = ("LoadAssignment", _encode(plan, "LoadAssignment"), tuple(g.compute_names))
    return seeds
