"""One interpreter that imports torch once and forks the launcher's nodes from it (a zygote).

Every node process of a graph imports torch, numpy, the middleware and the package before it
does anything of its own: about 2 s of CPU each on this machine, 10 s for the five
torch-importing nodes of ``hetero_inference``, all at once on a robot's few cores. `kaitian
launch` instead starts one *fork server* that imports what the scenario's nodes import
(`preload_modules`: the node modules and the middleware; torch only where a node needs it) and
then forks each node: the node starts with its imports done, and its pages of imported code and
data stay shared with the server's until written.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (one message per datagram): the launcher sends an
order (JSON: module, argv, environment, working directory) with the write end of the node's
output pipe attached (and the read end of its input pipe, for a warm interpreter, which reads
the node it becomes from its standard input); the server forks, answers ``{"pid": N}``, and later ``{"exit": N,
"code": C}`` when it reaped that child (``C`` as ``Popen.returncode``: negative for a signal).
The child leads a process group of its own, gets SIGTERM when the server dies (the server gets
SIGTERM when the launcher dies: no orphans), has the order's environment, working directory
and output, and runs the node module's ``main`` as the warm interpreter does - or the warm
interpreter's own (``WARM``): the launcher's warm interpreter then costs a fork and its
preparation instead of a fresh interpreter's imports.

The launcher falls back to a fresh process per node whenever the server is unusable, and nodes
under a command prefix (a network namespace in the benchmarks) never fork from it: a fork cannot
enter another namespace.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from kaitian_ros.nodes.preparation import Preparation, refused
from kaitian_ros.processes import die_with_parent, name_process, start_child
from kaitian_ros.warm_start import NODE_IMPORTS, PRELOAD, check_node, run_node_main

READY = b"ready"
WARM = "kaitian_ros.warm_start"  # the modules an order may name besides the nodes': a warm interpreter,
PREFLIGHT = "kaitian_ros.preflight"  # the launch's checks (they need torch; the launcher does not import it)
# not forked: the server itself prepares what compute nodes forked from it take (`prepare`)
PREPARE = "kaitian_ros.nodes.compute_prepare"
# the nodes that take what the server prepared (a coordinator its model graph); others drop it
TAKES_PREPARED = ("kaitian_ros.nodes.compute", "kaitian_ros.nodes.coordinator", WARM)
MAX_MESSAGE = 1 << 20  # an order: argv and environment, far below this
REPLY_TIMEOUT_S = 10.0
# what an executable imports only once it runs, beside its module (a trainer imports torch when
# it builds its model)
RUNTIME_IMPORTS = {"trainer": ("torch",)}


def preload_modules(executables: Iterable[str]) -> tuple[str, ...]:
    """The modules a fork server imports for nodes of these executables: a camera and a monitor
    need no torch (1.4 s of CPU and ~100 MB the server would otherwise load for nothing)."""
    names = list(NODE_IMPORTS)
    for exe in dict.fromkeys(executables):
        names += [*RUNTIME_IMPORTS.get(exe, ()), f"kaitian_ros.nodes.{exe}"]
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class ForkOrder:
    """The node a forked child becomes."""

    module: str  # a kaitian_ros.nodes module with main(argv) -> int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the child's whole environment
    cwd: str
    name: str  # the process name `ps`/`top` show (the node's name)

    def to_bytes(self) -> bytes:
        return json.dumps({"module": self.module, "argv": list(self.argv), "env": dict(self.env),
                           "cwd": self.cwd, "name": self.name}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> ForkOrder:
        """The order in `data` (ValueError when it is not one)."""
        try:
            raw = json.loads(data)
            order = ForkOrder(raw["module"], tuple(raw["argv"]), dict(raw["env"]), raw["cwd"], raw["name"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not an order: {exc}") from None
        check_node(order.module, order.argv, order.env, also=(WARM, PREFLIGHT))
        return order


# =========================================================================== server side
def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _send(sock: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: the server ends on its next read
        sock.send(json.dumps(message).encode())


def _serve(sock: socket.socket) -> ForkOrder | None:
    """Fork a child per order until the launcher closes its end; returns the order in a forked
    child (which then becomes that node), None in the server when it is done."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes the wakeup fd
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except OSError:
                data, fds = b"", []
            if not data:  # the launcher closed its end (or died): the children go with this server
                return None
            try:
                order = ForkOrder.from_bytes(data)
                if len(fds) != (0 if order.module == PREPARE else 1 + (order.module == WARM)):
                    raise ValueError("an order needs the output pipe attached (a warm interpreter's also its input)")
            except ValueError as exc:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"error": str(exc)})
                continue
            if order.module == PREPARE:
                _send(sock, {"prepared": _prepare(order.argv).to_dict()})
                continue
            pid = os.fork()
            if pid == 0:
                _become_child(order, *fds)
                selector.close()
                sock.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                return order
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"pid": pid})
        for pid in list(children):  # reap: each exit goes to the launcher
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    continue
                children.discard(pid)
                _send(sock, {"exit": pid, "code": _returncode(status)})


def _prepare(argv: Sequence[str]) -> Preparation:
    """Build the model and measure the start-up costs of the compute node `argv` names, here,
    for every compute node forked after it (what was done, for the launcher's log)."""
    try:
        from kaitian_ros.nodes import compute_prepare

        return compute_prepare.prepare(list(argv), by="the fork server before this node started", cpu_only=True)
    except Exception as exc:  # noqa: BLE001 - the server must keep serving; the node then prepares itself
        return refused(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")


def _become_child(order: ForkOrder, out_fd: int, in_fd: int | None = None) -> None:
    """In the forked child: the process state a freshly started node would have."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    die_with_parent()  # tied to the server, its own process group, SIGINT held back: as launched
    if os.getppid() == 1:  # the server died between the fork and the tie
        os._exit(1)
    name_process(order.name)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    source = os.open(os.devnull, os.O_RDONLY) if in_fd is None else in_fd
    os.dup2(source, 0)
    os.close(source)
    os.environ.clear()
    os.environ.update(order.env)
    os.chdir(order.cwd)
    if order.module not in TAKES_PREPARED and PREPARE in sys.modules:
        sys.modules[PREPARE].drop_prepared()  # no compute model in its pages


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].isdigit():
        print("fork server: expects the launcher's socket descriptor (then the modules to import)", file=sys.stderr)
        return 2
    for name in args[1:] or PRELOAD:
        with contextlib.suppress(ImportError):  # a node that needs it reports it when it imports it
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the imported objects stay in shared pages: the collector would write them
    sock = socket.socket(fileno=int(args[0]))
    sock.send(READY)
    order = _serve(sock)
    if order is None:
        return 0
    return run_node_main(order.module, order.argv)


# =========================================================================== launcher side
def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie (an orphan init has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class ForkedProcess:
    """A node forked by the server, with the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, stdout: IO[str], server: ForkServer, stdin: IO[str] | None = None) -> None:
        self.pid = pid
        self.stdout: IO[str] | None = stdout
        self.stdin = stdin
        self.returncode: int | None = None
        self._server = server
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        if not self._exited.is_set() and not self._server.alive() and not _running(self.pid):
            # the server is gone and cannot report it: the kernel ended the child (SIGTERM)
            self._set_exit(-signal.SIGTERM)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._exited.wait(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's handle on a started fork server (`start` returns None when it cannot run)."""

    def __init__(self, process: subprocess.Popen, sock: socket.socket) -> None:
        self.process = process
        self._sock = sock
        self._lock = threading.Lock()  # one order and its reply at a time
        self._replies: list[dict] = []
        self._reply = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="kaitian-fork-server", daemon=True)
        self._reader.start()

    @staticmethod
    def start(env: Mapping[str, str], preload: Sequence[str] = (), timeout_s: float = 60.0) -> ForkServer | None:
        """A running server that imported ``preload`` (`preload_modules`; by default what every
        node may import, torch included), or None if it could not start."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = start_child([sys.executable, "-u", "-m", "kaitian_ros.fork_server", str(theirs.fileno()),
                                   *preload],
                                  defer_sigint=True, env=dict(env), pass_fds=(theirs.fileno(),),
                                  stdin=subprocess.DEVNULL)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        ours.settimeout(timeout_s)
        try:
            ready = ours.recv(64) == READY
        except OSError:
            ready = False
        if not ready:
            process.kill()
            process.wait()
            ours.close()
            return None
        ours.settimeout(None)
        return ForkServer(process, ours)

    def alive(self) -> bool:
        return self.process.poll() is None

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "exit" in message:
                with self._reply:
                    child = self._children.pop(message["exit"], None)
                    if child is None:  # its exit overtook the reply with its pid
                        self._early_exits[message["exit"]] = message["code"]
                if child is not None:
                    child._set_exit(message["code"])
                continue
            with self._reply:
                self._replies.append(message)
                self._reply.notify_all()
        with self._reply:
            self._reply.notify_all()

    def fork(self, module: str, argv: Sequence[str], env: Mapping[str, str], name: str) -> ForkedProcess | None:
        """The node (or with `module` ``WARM`` a warm interpreter, its ``stdin`` open for the
        order) forked, or None when the server cannot (the caller starts it the usual way)."""
        if not self.alive():
            return None
        read_fd, write_fd = os.pipe()
        theirs, ours = [write_fd], [read_fd]
        if module == WARM:
            child_in, feed = os.pipe()
            theirs.append(child_in)
            ours.append(feed)
        order = ForkOrder(module, tuple(argv), dict(env), os.getcwd(), name)
        with self._lock:
            try:
                socket.send_fds(self._sock, [order.to_bytes()], theirs)
            except OSError:
                for fd in ours:
                    os.close(fd)
                return None
            finally:
                for fd in theirs:
                    os.close(fd)
            with self._reply:
                reply = self._take("pid", REPLY_TIMEOUT_S)
                if "pid" not in reply:
                    for fd in ours:
                        os.close(fd)
                    return None
                stdin = os.fdopen(ours[1], "w", buffering=1) if len(ours) == 2 else None
                child = ForkedProcess(reply["pid"], os.fdopen(read_fd, "r", buffering=1, errors="replace"), self,
                                      stdin)
                early = self._early_exits.pop(child.pid, None)
                if early is None:
                    self._children[child.pid] = child
        if early is not None:
            child._set_exit(early)
        return child

    def _take(self, kind: str, timeout_s: float) -> dict:
        """The next reply with key `kind` (or ``error``), {} if none came in time; holding
        `_reply`. A reply of another kind is an earlier order's that came after its caller gave
        up on it: dropped."""
        def arrived() -> bool:
            while self._replies and kind not in self._replies[0] and "error" not in self._replies[0]:
                self._replies.pop(0)
            return bool(self._replies) or not self.alive()

        got = self._reply.wait_for(arrived, timeout_s)
        return self._replies.pop(0) if got and self._replies else {}

    def prepare(self, argv: Sequence[str], timeout_s: float) -> Preparation:
        """Have the server prepare a compute node started with `argv` (`compute_prepare.prepare`:
        its model built and start-up costs measured, once per model, device and thread count),
        so that the compute nodes forked from it afterwards start with them; what the server
        did, or why not."""
        if not self.alive():
            return refused("the fork server has ended")
        order = ForkOrder(PREPARE, tuple(argv), {}, os.getcwd(), "prepare")
        with self._lock:
            try:
                self._sock.send(order.to_bytes())
            except OSError as exc:
                return refused(str(exc))
            with self._reply:
                reply = self._take("prepared", timeout_s)
        if "prepared" not in reply:
            return refused(str(reply.get("error") or f"no answer within {timeout_s:g} s"))
        try:
            return Preparation.from_dict(reply["prepared"])
        except (ValueError, AttributeError) as exc:  # a reply of another shape: the node prepares itself
            return refused(str(exc))

    def close(self) -> None:
        """End the server (its children first get SIGTERM from the kernel, if any are left)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._sock.close()
        self._reader.join(timeout=1.0)


if __name__ == "__main__":
    sys.exit(main())
