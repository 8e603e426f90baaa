"""Start collaborative training: one process per device on this host, or one rank under torchrun.

``main_train(argv)`` is the ``kaitian train`` entry point. Without RANK/WORLD_SIZE in the
environment it spawns one child per configured device with a torchrun-compatible
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and monitors them;
with those variables set (torchrun, several hosts) it runs as that single rank.

Several hosts without torchrun: the same command on every host with torchrun's options
``--nnodes N --node-rank K --master-addr ADDR --master-port PORT``; host K spawns global ranks
``K * ranks .. K * ranks + ranks - 1`` and all rendezvous in the TCPStore that rank 0 hosts at
ADDR:PORT (env://). ``--devices``/``--slowdowns`` list the whole world's ranks in rank order
(or one for all), so the command is the same everywhere but for ``--node-rank``.

Failure handling, two layers:

* every rank heartbeats into the rendezvous TCPStore; when a collective fails or times
  out, the rank looks up whose heartbeat stopped and fails with an error naming that rank
  (this also works across hosts under torchrun, where no parent of ours watches);
* on one host the parent additionally watches its children: when one dies, it gives the
  others a grace period to report, then terminates them, prints one line naming the dead
  rank and returns non-zero.

Ranks on CPUs are forked from this process (`_fork_rank`): a fresh interpreter per rank spent
about 3 s of CPU here importing torch and the optimizer's lazily imported torch._dynamo before
its first step, more than a short run's training. A fork is safe while this process runs no
thread and has not touched CUDA or run a tensor op (the parent only parses the configuration);
ranks with another device are started as fresh interpreters, as torchrun does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kaitian_ros.ports import PORT_ATTEMPTS, PortTaken, on_free_port
from kaitian_ros.processes import name_process, start_child, stop_children, take_sigint, tie_own_group
from kaitian_ros.training.affinity import pin_local_rank
from kaitian_ros.training.arguments import ArgumentError, Placement, config_from_args, placement_from_args, train_parser

if TYPE_CHECKING:  # torch and what imports it: at run time, after the command line parsed (--help)
    from kaitian_ros.training.process_group import DistEnv


_CHILD_RESULT_ENV = "KAITIAN_RESULT_PATH"

# rank 0 found its rendezvous port taken (errno EADDRINUSE): where this process chose the port
# (one host, no --master-port), another process bound it after `free_port`; the ranks start
# again on another port, up to PORT_ATTEMPTS times (as `local_ranks.run_local` does)
PORT_TAKEN_EXIT = 98


def store_reachable(env: DistEnv, timeout_s: float) -> bool:
    """Whether rank 0's rendezvous store accepts a connection within ``timeout_s``: checked
    before joining it, since torch's own timeout there prints a C++ stack per attempt."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=1.0):
                return True
        except OSError:  # refused (rank 0 not up yet), unreachable, no route: try again until due
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


class EpochProgress:
    """``kaitian train``'s progress: one step per epoch, with the accuracy and shares so far."""

    def __init__(self, cfg: Any) -> None:
        from kaitian_ros.progress import Progress

        self.progress = Progress("kaitian train epochs", cfg.epochs)
        self.emulated = " EMULATED" if any(s != 1.0 for s in cfg.emulated_slowdown) else ""

    def epoch_done(self, e: Any) -> None:
        accuracy = "" if e.test_accuracy is None else f"test acc {e.test_accuracy:.4f}, "
        self.progress.update(e.epoch + 1, f"{accuracy}{e.samples_per_s:.0f} samples/s{self.emulated}, "
                                          f"shares {'/'.join(f'{x:.2f}' for x in e.shares)}")

    def close(self) -> None:
        self.progress.close()


def _run_one_rank(cfg: Any) -> int:
    """Run as one rank from the torchrun environment; errors as one stderr line."""
    import torch
    import torch.distributed as dist

    from kaitian_ros.training.process_group import DistEnv, init_distributed, shutdown_distributed
    from kaitian_ros.training.trainer import RankTrainer

    threads = int(os.environ.get("KAITIAN_THREADS", "1"))
    torch.set_num_threads(threads)
    env = DistEnv.from_environ()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if 0 <= env.local_rank < local_world:  # torchrun and `kaitian train` tell how many share this host
        pin_local_rank(env.local_rank, local_world, threads)
    hb = None
    trainer = None
    if env.rank != 0 and not store_reachable(env, cfg.timeout_s):
        print(f"kaitian train: rank {env.rank}: no rendezvous store at {env.master_addr}:{env.master_port} "
              f"within {cfg.timeout_s:g} s (is rank 0 running there, e.g. `kaitian train --node-rank 0 ...` "
              f"on that host, and is port {env.master_port}/tcp open?)", file=sys.stderr, flush=True)
        return 1
    try:
        hb = init_distributed(env, timeout_s=cfg.timeout_s)
        # rank 0 tells the epochs (stderr: --json's result stays alone on stdout)
        progress = EpochProgress(cfg) if env.rank == 0 else None
        trainer = RankTrainer(cfg, local_rank=env.local_rank, on_epoch=progress.epoch_done if progress else None)
        try:
            res = trainer.run()
        finally:
            if progress is not None:
                progress.close()
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - a rank: any failure is one line naming the cause, then exit 1
        first = str(e).splitlines()[0] if str(e) else ""
        msg = f"rank {env.rank}: {type(e).__name__}: {first}"
        # RuntimeError covers gloo/c10d failures (DistBackendError is a subclass): find
        # out whose fault it is. Other errors (bad config, bad model) are reported as is.
        if hb is not None and isinstance(e, RuntimeError):
            labels = [cfg.device_for(r) for r in range(env.world_size)] \
                if len(cfg.devices) in (1, env.world_size) else None
            why = hb.diagnose(labels)
            if not why.startswith("no peer"):
                msg = f"rank {env.rank}: aborting, {why} ({type(e).__name__})"
        print(f"kaitian train: {msg}", file=sys.stderr, flush=True)
        shutdown_distributed(hb, "aborting")
        taken = hb is None and env.rank == 0 and "EADDRINUSE" in str(e)  # its store could not listen
        os._exit(PORT_TAKEN_EXIT if taken else 1)  # don't let a half-dead process group hang interpreter shutdown
    out = os.environ.get(_CHILD_RESULT_ENV)
    if out:
        Path(out).write_text(json.dumps(res.summary()))
    shutdown_distributed(hb)
    return 0


class _ForkedRank:
    """A rank forked from this process, with the part of ``subprocess.Popen`` the watch loop
    and ``stop_children`` use (``poll`` gives -N for a signal N, as Popen does)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def _forked_rank_main(cfg: Any, env: dict[str, str]) -> None:
    # one handler from the rank's first line on: a Ctrl-C forwarded while the fork still sets
    # itself up (it is visible by name from `name_process` on) ends it with 130 too, not with
    # multiprocessing's traceback of the KeyboardInterrupt
    try:
        tie_own_group()  # as start_child's children: ended with this process, Ctrl-C forwarded by it
        name_process(f"kaitian-rank{env['RANK']}")  # in ps and top (a fork keeps its parent's name)
        os.environ.clear()
        os.environ.update(env)
        code = _rank_main(cfg)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _rank_main(cfg: Any) -> int:
    """One rank, forked or a fresh interpreter: its exit code, its failure in one line."""
    try:
        return _run_one_rank(cfg)
    except KeyboardInterrupt:  # Ctrl-C, forwarded by the parent, which says so: no traceback
        return 130
    except Exception as e:  # noqa: BLE001 - e.g. a bad MASTER_PORT: one error line, exit code 1
        print(f"kaitian train: error: {e}", file=sys.stderr)
        return 1


def _can_fork_ranks(cfg: Any) -> bool:
    """Whether this process may fork its ranks (module docstring)."""
    import torch

    return threading.active_count() == 1 and not torch.cuda.is_initialized() and \
        all(str(d).split(":")[0] == "cpu" for d in cfg.devices)


def _fork_rank(cfg: Any, env: dict[str, str]) -> _ForkedRank:
    # daemon: should this process end otherwise than through the watch loop, multiprocessing
    # terminates the ranks at exit instead of waiting for them to finish training
    process = multiprocessing.get_context("fork").Process(target=_forked_rank_main, args=(cfg, env),
                                                          name="kaitian-rank", daemon=True)
    process.start()
    return _ForkedRank(process)


def _spawn_local(argv: list[str], cfg: Any, placement: Placement, as_json: bool, retry_port: bool = False) -> int:
    """Spawn this host's ranks with torchrun env; watch them; aggregate their results.
    `retry_port`: this process chose the rendezvous port (`PORT_TAKEN_EXIT`)."""
    if cfg.save_weights:
        try:  # before minutes of training, not after
            Path(cfg.save_weights).resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"kaitian train: error: cannot write --save-weights {cfg.save_weights}: "
                  f"{e.strerror}", file=sys.stderr)
            return 2
    # Ctrl-C stops the run even when this process started with SIGINT ignored or held back (a
    # shell's background job, a parent that blocked it): its ranks would otherwise train on
    try:
        take_sigint()
    except KeyboardInterrupt:
        print("kaitian train: interrupted", file=sys.stderr)
        return 130
    tmp = Path(tempfile.mkdtemp(prefix="kaitian-train-"))  # where each rank leaves its result
    try:
        def attempt(port: int) -> int:
            code = _run_ranks(argv, cfg, dataclasses.replace(placement, master_port=port), as_json, tmp, retry_port)
            if code is None:
                raise PortTaken(f"port {port}")
            return code

        try:
            return on_free_port(attempt, PORT_ATTEMPTS if retry_port else 1, first=placement.master_port,
                                what="rank 0's rendezvous store")
        except PortTaken as exc:
            print(f"kaitian train: error: {exc}", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_ranks(argv: list[str], cfg: Any, placement: Placement, as_json: bool, tmp: Path,
               retry_port: bool) -> int | None:
    """Start this host's ranks, watch them, and print their aggregated result; None when rank
    0's rendezvous port was taken and `retry_port` (the ranks are stopped: start them again)."""
    ranks = placement.ranks
    procs: list[subprocess.Popen | _ForkedRank] = []
    fork = _can_fork_ranks(cfg)
    if fork:  # what every rank imports to train, imported once for all of them
        from kaitian_ros.training.trainer import import_lazy_dependencies

        import_lazy_dependencies()
    first_dead: tuple[int, int] | None = None
    dead_at = 0.0
    try:  # from the first rank on: a Ctrl-C while the others start stops the started ones
        for r in range(ranks):
            env = dict(os.environ, **placement.child_env(r))
            env[_CHILD_RESULT_ENV] = str(tmp / f"rank{r}.json")
            # tied to this process (no orphan rank when it dies), in process groups of their own
            # (a terminal's Ctrl-C reaches this process, which forwards it below)
            procs.append(_fork_rank(cfg, env) if fork else
                         start_child([sys.executable, "-m", "kaitian_ros.training.launch", *argv], env=env))
        while True:
            codes = [p.poll() for p in procs]
            if first_dead is None:
                for r, c in enumerate(codes):
                    if c not in (None, 0):
                        first_dead, dead_at = (r, c), time.monotonic()
                        break
            if all(c is not None for c in codes):
                break
            if retry_port and first_dead == (0, PORT_TAKEN_EXIT):
                break  # the others wait for a store that never listens: stopped below, at once
            # the survivors normally notice through their own collectives within seconds;
            # past the grace period the parent stops them so nothing hangs
            if first_dead is not None and time.monotonic() - dead_at > min(cfg.timeout_s, 15.0):
                stop_children(procs, ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)))
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        # a rank in Python stops on SIGINT at once; one blocked in C++ (its rendezvous waiting
        # for a peer that stopped first, a collective with a peer gone) only when that call times
        # out: SIGTERM (no handler in a rank: the default action) ends it there
        stop_children(procs, ((signal.SIGINT, 2.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)))
        print("kaitian train: interrupted", file=sys.stderr)
        return 130
    if first_dead is not None and retry_port and first_dead == (0, PORT_TAKEN_EXIT):
        stop_children(procs, ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)))  # waiting for rank 0's store
        return None
    if first_dead is not None:
        local, c = first_dead
        r = placement.global_rank(local)
        how = f"signal {-c}" if c < 0 else f"exit code {c}"
        print(f"kaitian train: rank {r} ({cfg.device_for(r)}) died ({how}); "
              "training stopped" + (", resume with --resume" if cfg.checkpoint_dir else ""),
              file=sys.stderr)
        return 1
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(ranks)]
    r0 = results[0]
    own = [placement.global_rank(r) for r in range(ranks)]  # this host's ranks
    summary = {"ranks": ranks, "world_size": placement.world_size, "node_rank": placement.node_rank,
               "nnodes": placement.nnodes, "groups": r0["groups"],
               "devices": [x["device"] for x in results],
               "emulated_slowdown": [cfg.slowdown_for(r) for r in own],
               "policy": cfg.policy, "test_accuracy": r0["test_accuracy"],
               "accuracy_per_epoch": r0["accuracy_per_epoch"],
               "samples_per_s": r0["samples_per_s"], "train_seconds": r0["train_seconds"],
               "comm_seconds": [x["comm_seconds"] for x in results],
               "final_shares": r0["final_shares"], "epochs_completed": r0["epochs_completed"],
               "weights": cfg.save_weights if placement.node_rank == 0 else ""}
    if as_json:
        print(json.dumps(summary))
    else:
        emu = any(s != 1.0 for s in summary["emulated_slowdown"])
        where = (f"{ranks} ranks" if placement.nnodes == 1 else
                 f"rank{'s' if ranks > 1 else ''} {own[0]}{f'-{own[-1]}' if ranks > 1 else ''} of "
                 f"{placement.world_size} (host {placement.node_rank} of "
                 f"{placement.nnodes}; groups {summary['groups']})")
        print(f"trained {summary['epochs_completed']} epochs on {where} "
              f"({', '.join(summary['devices'])}; slowdowns {summary['emulated_slowdown']}"
              f"{' EMULATED' if emu else ''}), policy {cfg.policy}: test accuracy "
              f"{summary['test_accuracy']:.4f}, {summary['samples_per_s']:.0f} samples/s, "
              f"final shares {[round(s, 3) for s in summary['final_shares']]}"
              + (f"; weights in {summary['weights']}" if summary["weights"] else ""))
    return 0


def main_train(argv: list[str]) -> int:
    """``kaitian train``: spawn local ranks, or run as one rank under torchrun."""
    try:
        a = train_parser().parse_args(argv)
        cfg, ranks = config_from_args(a)
        placement = placement_from_args(a, ranks)
    except (ArgumentError, ValueError, TypeError) as e:
        print(f"kaitian train: error: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(cfg)
    return _spawn_local(argv, cfg, placement, a.json, retry_port=a.nnodes == 1 and a.master_port is None)


if __name__ == "__main__":
    sys.exit(main_train(sys.argv[1:]))
