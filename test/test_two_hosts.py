"""Two hosts, played by two network namespaces joined through the root namespace by veth
pairs (``bench/netns.py``): an inference graph split across them (router, camera, coordinator,
scheduler and compute_0 on host A; compute_1 on host B), and one training run with a rank on
each host, checked against the same run on one host. Every process is a real one started by
the ``kaitian`` command line, as a user would on a robot and an edge box (docs/deployment.md).

Needs root and ``ip``/``tc`` (skipped otherwise, saying so). The namespaces, veths and subnet
are named after this process, so a concurrent run or benchmark keeps its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import yaml
from helpers import Proc

from kaitian_ros.bench import netns

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
DOMAIN = "42"  # both hosts use the same ROS_DOMAIN_ID, as ROS 2 hosts of one graph must
ROUTER_PORT = 7447  # each namespace has its own ports: the default one is free in there
# robot_edge at a small size: both compute nodes take rows of every frame (stripes)
GRAPH = ["model:=resnet18", "input_height:=64", "input_width:=64", "width:=64", "height:=64",
         "num_classes:=10", "strategy:=stripes", "slowdowns:=[1.0,1.0]", "rate_hz:=4.0"]
STARTUP_S = 120.0  # liveness bound on 2 busy cores (imports of torch in 7 processes), not a perf check
FUSED = 5


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.Links]:
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"two-host tests need network namespaces: {why}")
    tag = os.getpid() % 100000
    links = netns.Links(2, mbit=1000.0, netns_prefix=f"kt2h{tag}_", veth_prefix=f"kh{tag}",
                        subnet=f"10.{240 + tag % 15}")
    links.open()  # as root with ip/tc a failure here is a failure, not a skip
    try:
        yield links
    finally:
        links.close()


def _env(**extra: str) -> dict[str, str]:
    # PYTHONPATH: the processes in the namespaces import this checkout, whatever is installed;
    # KAITIAN_SHM=0: the namespaces share /dev/shm, which would carry the tensors past the link
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, ROS_DOMAIN_ID=DOMAIN, KAITIAN_SHM="0", KAITIAN_THREADS="1",
                **extra)


class Host(Proc):
    """A ``kaitian`` command running in one namespace, its output collected line by line."""

    def __init__(self, links: netns.Links, index: int, args: Sequence[str], env: dict[str, str]) -> None:
        super().__init__([*links.exec_prefix(index), sys.executable, "-u", "-m", "kaitian_ros.cli", *args], env,
                         new_session=True)
        self.process = self.p

    def wait_for_text(self, text: str, timeout_s: float) -> None:
        self.wait_for(re.escape(text), timeout_s=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C, as a user stops a launch; the exit code."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self._reader.join(timeout=5)
        return code


def test_inference_graph_split_across_two_hosts(hosts: netns.Links) -> None:
    a_ip, b_ip = hosts.device_ip(0), hosts.device_ip(1)
    router = f"tcp/{a_ip}:{ROUTER_PORT}"
    host_a = Host(hosts, 0, ["launch", "robot_edge", *GRAPH, "--router", f"tcp/0.0.0.0:{ROUTER_PORT}",
                             "--listen", a_ip, "--exclude", "compute_1", "--no-view"], _env())
    host_b = None
    try:
        host_a.wait_for_text("router listening on", STARTUP_S)
        host_b = Host(hosts, 1, ["launch", "robot_edge", *GRAPH, "--connect", router, "--listen", b_ip,
                                 "--only", "compute_1", "--no-view"], _env())
        # a tool on host B reads host A's results through the same router, until compute_1 took
        # part (the coordinator starts with the nodes it has; compute_1 joins when host B is up)
        deadline = time.monotonic() + STARTUP_S
        seen: list[list[str]] = []
        remote: list[dict] = []
        while not remote:
            assert time.monotonic() < deadline, (
                f"no fused output with compute_1 within {STARTUP_S:g} s; node_ids seen {seen}\n"
                f"host A:\n{host_a.output()}\nhost B:\n{host_b.output()}")
            fused = _echo_fused(hosts, router, b_ip)
            assert all(m["complete"] for m in fused), fused
            seen += [m["node_ids"] for m in fused]
            remote = [m for m in fused if "compute_1" in m["node_ids"]]
        # node_ids are the plan's active nodes: compute_1 computed rows on host B that crossed the
        # link to host A - trunk-output rows, or, under a stripes plan with a solo tail on
        # compute_0, the rows it feeds that tail (then its node_rows, output rows only, is 0)
        for m in remote:
            assert m["complete"] and sum(m["node_rows"]) > 0, m
        # host A started no compute_1, host B nothing but compute_1
        assert not any("started compute_1" in ln for ln in host_a.lines), host_a.output()
        started_b = [ln for ln in host_b.lines if "[launch] started" in ln]
        assert len(started_b) == 1 and "compute_1" in started_b[0], host_b.output()
    finally:
        codes = [h.stop() for h in (host_b, host_a) if h is not None]
    assert codes == [0, 0], f"exit codes {codes}\nhost A:\n{host_a.output()}"


def _echo_fused(links: netns.Links, router: str, listen_ip: str) -> list[dict]:
    """FUSED /kaitian/fused messages as ``kaitian topic echo`` prints them on host B."""
    echo = subprocess.run(
        [*links.exec_prefix(1), sys.executable, "-m", "kaitian_ros.cli", "topic", "echo", "/kaitian/fused",
         "kaitian_ros/msg/FusedOutput", "--router", router, "--count", str(FUSED), "--timeout", str(STARTUP_S)],
        env=_env(KAITIAN_LISTEN=f"tcp/{listen_ip}:0"), capture_output=True, text=True, timeout=STARTUP_S + 30,
        check=False)
    fused = [m for m in yaml.safe_load_all(echo.stdout) if m]
    assert echo.returncode == 0 and len(fused) == FUSED, f"{len(fused)} fused outputs seen\n{echo.stderr}"
    return fused


def _train(links: netns.Links | None, index: int, args: Sequence[str], host: str) -> Host | Proc:
    """``kaitian train`` in namespace ``index`` (or here, in the root namespace, when links is None)."""
    common = ["train", "--devices", "cpu", "--policy", "equal", "--epochs", "1", "--global-batch", "64",
              "--seed", "3", "--json", *args]
    env = _env(KAITIAN_HOST=host)
    if links is None:
        return Proc([sys.executable, "-m", "kaitian_ros.cli", *common], env)
    return Host(links, index, common, env)


def _summary(lines: Sequence[str]) -> dict:
    return json.loads(next(ln for ln in reversed(lines) if ln.startswith("{")))


@pytest.mark.slow
def test_training_across_two_hosts_equals_one_host(hosts: netns.Links, tmp_path: Path) -> None:
    """One rank per host, gloo between the hosts: the same weights as both ranks on one host."""
    master = hosts.device_ip(0)
    ranks = [_train(hosts, i, ["--nnodes", "2", "--node-rank", str(i), "--master-addr", master,
                               "--master-port", "29500", "--ranks", "1", "--save-weights",
                               str(tmp_path / "two_hosts.pt")], f"host{i}")
             for i in (0, 1)]
    # the same run with both ranks on one host, meanwhile (the root namespace, a free master port):
    # the weights do not depend on what else runs
    one_host = _train(None, 0, ["--ranks", "2", "--save-weights", str(tmp_path / "one_host.pt")], "host0")
    try:
        codes = [r.p.wait(timeout=300) for r in ranks]
        one_code = one_host.wait(timeout_s=300)
    finally:
        for r in ranks:
            r.stop(timeout_s=10)
        one_host.stop()
    outputs = [r.output() for r in ranks]
    assert codes == [0, 0], "\n---\n".join(outputs)
    summaries = [_summary(r.lines) for r in ranks]
    for i, s in enumerate(summaries):
        assert (s["node_rank"], s["world_size"], s["ranks"]) == (i, 2, 1), s
        # one (host, device) group per host, their leaders joined over gloo
        assert s["groups"] == "cpu@host0[0]/gloo | cpu@host1[1]/gloo ; leaders over gloo", s
    assert summaries[0]["test_accuracy"] == summaries[1]["test_accuracy"]

    assert one_code == 0, one_host.output()
    one = _summary(one_host.lines)
    assert one["groups"] == "cpu@host0[0, 1]/gloo ; leaders over gloo", one
    two_hosts = torch.load(tmp_path / "two_hosts.pt", weights_only=True)
    one_host_weights = torch.load(tmp_path / "one_host.pt", weights_only=True)
    assert two_hosts.keys() == one_host_weights.keys()
    for name, value in one_host_weights.items():
        assert torch.allclose(two_hosts[name], value, rtol=0.0, atol=1e-6), name
    assert summaries[0]["test_accuracy"] == one["test_accuracy"]


def test_unreachable_router_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Joining a router nobody runs: one line naming it, exit 1, no node started, no traceback."""
    from kaitian_ros.ports import free_port

    endpoint = f"tcp/127.0.0.1:{free_port()}"
    # the --connect option and the scenario's own setting (connect:= as a launch argument, or its
    # /** section), both at once: each waits out the connect timeout, the two waits overlap
    launches = [subprocess.Popen([sys.executable, "-m", "kaitian_ros.cli", "launch", "robot_edge", *args, "--only",
                                  "compute_1", "--no-view"], env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for args in (["--connect", endpoint], [f"connect:={endpoint}"])]
    try:
        (out, err), (_, by_key_err) = (p.communicate(timeout=120) for p in launches)
    finally:
        for p in launches:
            if p.poll() is None:
                p.kill()
                p.wait()
    proc, by_key = launches
    assert proc.returncode == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and endpoint in lines[0] and "no router reachable" in lines[0], err
    assert "Traceback" not in out + err
    assert "started" not in out, out
    assert by_key.returncode == 1 and "no router reachable" in by_key_err and endpoint in by_key_err, by_key_err


def test_unreachable_master_is_one_line_per_rank() -> None:
    """Node 1 of 2 whose node 0 never comes: its rank says so in one line, the launcher that it
    stopped, exit 1, no traceback (torch's own connect timeout would print a C++ stack)."""
    from kaitian_ros.ports import free_port

    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "train", "--nnodes", "2", "--node-rank", "1",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), "--ranks", "1",
                           "--devices", "cpu", "--timeout", "3"], env=_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == (f"kaitian train: rank 1: no rendezvous store at 127.0.0.1:{port} within 3 s (is rank 0 "
                        f"running there, e.g. `kaitian train --node-rank 0 ...` on that host, and is port "
                        f"{port}/tcp open?)"), proc.stderr
    assert lines[1:] == ["kaitian train: rank 1 (cpu) died (exit code 1); training stopped"], proc.stderr


def test_host_split_options_say_what_is_wrong() -> None:
    """--only/--exclude naming no node of the scenario, --router with --connect, a bad --listen."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "launch", "robot_edge", *args], env=_env(),
                              capture_output=True, text=True, timeout=120, check=False)

    for args, says in ((["--only", "compute_9"], "has no node 'compute_9'"),
                       (["--exclude", "image_source,coordinator,scheduler,compute_0,compute_1"], "no node"),
                       (["--router", "tcp/127.0.0.1:7447", "--connect", "tcp/127.0.0.1:7447"], "exclude each other"),
                       (["--connect", "192.168.1.10"], "not a zenoh endpoint"),
                       (["--listen", "a b"], "not an address"),
                       (["--listen", "tcp/127.0.0.1:7450"], "port of its own")):
        proc = run(*args)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
