"""The processes of ``kaitian bench inference``: the bench-only layer-wise worker node (its
messages are ``BenchChunk``: a whole tensor and the route of workers still to run it) and the
graph of router + product nodes + workers (remote devices in their network namespaces).

The worker runs as ``python -m kaitian_ros.bench.inference_graph --ros-args ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kaitian_ros.bench.inference_scenarios import BenchScenario
from kaitian_ros.ports import free_port

LW_TOPIC_PREFIX = "/kaitian/bench/lw/"
LW_TELEMETRY = "/kaitian/bench/lw_telemetry"
DRIVER = "bench"


def lw_topic(name: str) -> str:
    return LW_TOPIC_PREFIX + name


# =========================================================================== layer-wise worker
def _worker_parameters() -> tuple:
    from kaitian_ros.nodes.model_params import MODEL_PARAMETERS
    from kaitian_ros.runtime.api import ParameterDescriptor as P
    from kaitian_ros.runtime.api import ParameterType as T

    return MODEL_PARAMETERS + (
        P("threads", T.INTEGER, 1, "torch CPU threads", 1, 256),
        P("emulated_slowdown", T.DOUBLE, 1.0, "EMULATED slower device: sleep (s-1)x each compute",
          1.0, 100.0),
    )


@dataclass(frozen=True)
class Hop:
    """What a BenchChunk asks of its addressee: run trunk values [first, stop) and send the
    result to ``to``, carrying the rest of the route."""

    first: int
    stop: int
    to: str
    route: tuple[str, ...]          # the workers after this one
    stop_values: tuple[int, ...]    # their stop values, same order


def hop_of(msg: Any, node: str, output_value: int, cut_values: Any) -> Hop:
    """The hop ``msg`` asks of worker ``node`` (ValueError when the route is not one a trunk of
    ``output_value`` values cut at ``cut_values`` can run, or not addressed to ``node``)."""
    route, stops, first = list(msg.route), [int(v) for v in msg.stop_values], int(msg.value)
    if not route or route[0] != node:
        raise ValueError(f"route {route} is not addressed to {node}")
    if len(stops) != len(route):
        raise ValueError(f"{len(route)} workers but {len(stops)} stop values")
    bounds = [first, *stops]
    if not all(a < b for a, b in itertools.pairwise(bounds)) or stops[-1] > output_value:
        raise ValueError(f"bad range: values {bounds} of a trunk ending at {output_value}")
    if first and first not in cut_values:
        raise ValueError(f"value {first} is not a cut value")
    to = route[1] if len(route) > 1 else msg.reply_to
    return Hop(first, stops[0], to, tuple(route[1:]), tuple(stops[1:]))


def bench_chunk(*, request_id: int, sender: str, value: int, route: list[str] | tuple[str, ...],
                stop_values: list[int] | tuple[int, ...], reply_to: str, tensor: Any) -> Any:
    """A BenchChunk carrying ``tensor`` (trunk value ``value``) along ``route``."""
    import numpy as np

    from kaitian_ros.runtime import interfaces

    return interfaces.make("BenchChunk", header=interfaces.header(), request_id=request_id, sender=sender,
                           value=value, route=list(route), stop_values=np.asarray(stop_values, np.uint16),
                           reply_to=reply_to, **interfaces.tensor_fields(tensor))


def bench_tensor(msg: Any) -> Any:
    """The tensor a BenchChunk carries (N, C, H, W): float, or uint8 pixels at value 0
    (DecodeError otherwise)."""
    import torch

    from kaitian_ros.runtime import interfaces

    x = interfaces.tensor_from_fields(msg)
    if x.dim() != 4:
        raise interfaces.DecodeError(f"tensor shape {tuple(x.shape)} is not (N,C,H,W)")
    if not x.is_floating_point() and not (x.dtype == torch.uint8 and int(msg.value) == 0):
        raise interfaces.DecodeError(f"tensor dtype {x.dtype} at value {int(msg.value)}")
    return x


class LayerwiseWorker:
    """Bench-only node: runs the trunk values a BenchChunk's route gives it on the chunk's tensor
    in one call (fused ops, whole rows) and sends the result on along the route (next worker or
    the bench driver). Two of them chained are the Neurosurgeon-style layer-wise split; one alone
    is a single device running the whole trunk.

    It reports each hop on ``LW_TELEMETRY`` as a NodeTelemetry with the fields a compute node
    fills for a request (``plan_version`` 0: it runs no plan), and a heartbeat (request 0) every
    0.5 s so that the driver knows it is up."""

    def __init__(self, rt: Any) -> None:
        import torch

        from kaitian_ros.nodes import inference_common as ic

        self.rt, self.ic, self.torch = rt, ic, torch
        self.params = rt.declare_parameters(_worker_parameters())
        torch.set_num_threads(self.params["threads"])
        self.graph = ic.build_graph(ic.ModelSpec.from_params(self.params))
        self.pubs: dict[str, Any] = {}
        self.telemetry = rt.create_publisher(LW_TELEMETRY, "NodeTelemetry")
        rt.create_subscription(lw_topic(rt.node_name), "BenchChunk", self._on_chunk)
        rt.create_timer(0.5, self._heartbeat)

    def _heartbeat(self) -> None:
        from kaitian_ros.runtime import interfaces

        self.telemetry.publish(interfaces.make("NodeTelemetry", node_id=self.rt.node_name, request_id=0))

    def _on_chunk(self, msg: Any) -> None:
        from kaitian_ros.runtime import interfaces

        g = self.graph
        try:
            hop = hop_of(msg, self.rt.node_name, g.output_value, g.cut_values)
            x = bench_tensor(msg)
            if x.dtype == self.torch.uint8:  # pixels, like the product's INPUT chunks
                from kaitian_ros.core.tensors import normalise_input

                x = normalise_input(x, g.input_shape[0])
        except (ValueError, interfaces.DecodeError) as exc:
            self.rt.rejected.count(f"bad chunk: {exc}")
            return
        t0 = time.perf_counter()
        with self.torch.no_grad():
            y = g.run_ops(x, hop.first, hop.stop)
            if not hop.route and hop.stop == g.output_value and g.pooled_head:
                # the head needs only the mean: sent as the product's nodes send their rows' sum
                y = y.mean(dim=(2, 3), keepdim=True)
        spent = time.perf_counter() - t0
        s = self.params["emulated_slowdown"]
        if s > 1.0:
            time.sleep((s - 1.0) * spent)
            spent *= s
        pub = self.pubs.get(hop.to)
        if pub is None:
            pub = self.pubs[hop.to] = self.rt.create_publisher(lw_topic(hop.to), "BenchChunk")
        pub.publish(bench_chunk(request_id=int(msg.request_id), sender=self.rt.node_name, value=hop.stop,
                                route=hop.route, stop_values=hop.stop_values, reply_to=msg.reply_to, tensor=y))
        self.telemetry.publish(interfaces.make(
            "NodeTelemetry", node_id=self.rt.node_name, request_id=int(msg.request_id), rows=y.shape[2],
            compute_ms=spent * 1e3, emulated=s != 1.0, emulated_slowdown=s, bytes_in=len(msg.data),
            bytes_out=y.numel() * y.element_size()))


def worker_main(argv: list[str]) -> int:
    from kaitian_ros.runtime import run_node

    return run_node(LayerwiseWorker, "lw_worker", argv)


WORKER_MODULE = "kaitian_ros.bench.inference_graph"


# =========================================================================== processes
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


def _scheduler_parameters(compute: list[str]) -> dict[str, Any]:
    """The scheduler of config/hetero_inference.yaml (adaptive policy), over these nodes."""
    from kaitian_ros.scenario import load_scenario

    params = dict(load_scenario("hetero_inference", [f"compute_nodes:={len(compute)}"]).node("scheduler").parameters)
    params["compute_nodes"] = list(compute)
    # the bench's CPU is shared by 2 processes per device, the coordinator and the driver: a
    # heartbeat can be late by more than the product's 1.5 s here (the coordinator waits 10 s too)
    params["dead_after_s"] = 10.0
    return params


class Graph:
    """Router + node processes (remote devices in namespaces when links are emulated); stop()
    cleans up."""

    def __init__(self, args: argparse.Namespace, sc: BenchScenario, links: Any, tmp: Path) -> None:
        self.args, self.sc, self.links, self.tmp = args, sc, links, tmp
        self.procs: list[Proc] = []
        self.router: Any = None
        n = len(sc.devices)
        self.compute = [f"compute_{i}" for i in range(n)]
        self.workers = [f"lw_{i}" for i in range(n)]
        self.host = links.root_ip() if links is not None else "127.0.0.1"
        self.router_ep = f"tcp/{self.host}:{free_port()}"

    def params_file(self) -> Path:
        import yaml

        a, sc = self.args, self.sc
        model = {"model": sc.model, "input_height": sc.height, "input_width": sc.width, "num_classes": 1000,
                 "seed": 0, "slab_rows": a.slab_rows}
        # the coordinator starts as the product runs (scheduler on, strategy auto) so that it
        # adopts the scheduler's first, latched assignment; the variants are set live
        doc: dict[str, Any] = {"coordinator": {"ros__parameters": model | {
            "compute_nodes": self.compute, "static_shares": [1.0] * len(self.compute),
            "use_scheduler": True, "strategy": "auto", "plan_link_mbit": float(sc.mbit), "max_in_flight": 1,
            "request_timeout_s": 30.0, "dead_after_s": 10.0, "threads": 1}},
            "scheduler": {"ros__parameters": _scheduler_parameters(self.compute)}}
        for i, d in enumerate(sc.devices):
            doc[self.compute[i]] = {"ros__parameters": model | {
                "device": "cpu", "threads": 1, "emulated_slowdown": float(d.slowdown), "request_timeout_s": 60.0,
                "min_run_rows": a.min_run_rows}}
            doc[self.workers[i]] = {"ros__parameters": model | {"threads": 1, "emulated_slowdown": float(d.slowdown)}}
        path = self.tmp / "bench_inference.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def start(self) -> None:
        from kaitian_ros.runtime import zenoh_session as zs

        if self.links is not None:
            os.environ["KAITIAN_SHM"] = "0"  # this process's sessions too (router, driver)
        self.router = zs.open_session("router", listen=self.router_ep)
        pf = self.params_file()
        base = dict(os.environ, KAITIAN_ROUTER=self.router_ep, KAITIAN_RUNTIME="embedded",
                    PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        base.pop("KAITIAN_LISTEN", None)
        if self.links is not None:  # zenoh's shared-memory transport would bypass the links
            base["KAITIAN_SHM"] = "0"
        root_env = dict(base)
        if self.links is not None:  # reachable from every namespace
            root_env["KAITIAN_LISTEN"] = f"tcp/{self.host}:0"
        jobs = [("coordinator", self._cmd("kaitian_ros.nodes.coordinator", "coordinator", pf), root_env),
                ("scheduler", self._cmd("kaitian_ros.nodes.scheduler", "scheduler", pf), root_env)]
        for i in range(len(self.compute)):
            env, prefix = dict(base), []
            if self.links is not None:  # a local device: root namespace, root's address, no prefix
                env["KAITIAN_LISTEN"] = f"tcp/{self.links.device_ip(i)}:0"
                prefix = self.links.exec_prefix(i)
            jobs.append((self.compute[i], prefix + self._cmd("kaitian_ros.nodes.compute", self.compute[i], pf), env))
            jobs.append((self.workers[i], prefix + self._cmd(WORKER_MODULE, self.workers[i], pf), env))
        for name, cmd, env in jobs:
            self._spawn(name, cmd, env)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        from kaitian_ros.processes import start_child

        log = self.tmp / f"{name}.log"
        with open(log, "w") as fh:
            p = start_child(cmd, defer_sigint=True, env=env, stdout=fh, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
        self.procs.append(Proc(name, p, log))

    @staticmethod
    def _cmd(module: str, name: str, pf: Path) -> list[str]:
        return [sys.executable, "-u", "-m", module, "--ros-args", "-r", f"__node:={name}", "--params-file", str(pf)]

    def check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                tail = p.log.read_text()[-1500:] if p.log.exists() else ""
                raise RuntimeError(f"{p.name} exited with code {p.popen.returncode}:\n{tail}")

    def stop(self) -> None:
        from kaitian_ros.processes import stop_children

        stop_children([p.popen for p in self.procs], ((signal.SIGINT, 4.0), (signal.SIGKILL, 2.0)))
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=2.0)
        if self.router is not None:
            from kaitian_ros.runtime import zenoh_session as zs

            with contextlib.suppress(zs.SessionError):
                self.router.close()
            self.router = None


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
