"""Running a Python function on N local ranks, each a process of its own with an initialised
process group (the tests and ``kaitian bench training``)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kaitian_ros.ports import PortTaken, on_free_port
from kaitian_ros.processes import tie_to_parent
from kaitian_ros.training.affinity import pin_local_rank
from kaitian_ros.training.process_group import DistEnv, init_distributed, shutdown_distributed


def _local_child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple,
                 env: dict[str, str], timeout_s: float, q: Any) -> None:
    tie_to_parent()  # daemon processes end with a parent that exits; this also with one killed
    torch.set_num_threads(1)
    pin_local_rank(rank, world)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.update(env)
    hb = None
    try:
        hb = init_distributed(DistEnv.from_environ(), timeout_s=timeout_s)
        out = fn(rank, world, *args)
        dist.barrier()
        # as bytes: torch's queue pickler would pass tensors as file descriptors that the
        # parent can only fetch while this process still lives (it may have exited by then)
        q.put((rank, True, pickle.dumps(out)))
        shutdown_distributed(hb)
    except BaseException as e:  # noqa: BLE001 - a rank's child process: report anything, never hang the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        shutdown_distributed(hb, "aborting")


def run_local(fn: Callable[..., Any], world_size: int, *args: Any,
              env_per_rank: Sequence[dict[str, str]] | None = None,
              timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes with gloo.

    Without CUDA the ranks are forked (fast: no second import of torch, and what training
    imports lazily is imported here first, once). Where CUDA exists
    they are spawned: a forked child can neither use CUDA once this process has initialised
    it, nor run autograd once this process has (autograd then keeps a thread per device), so
    ``fn`` and ``args`` must be picklable (a module-level function) for code that may run
    there. ``fn`` returns picklable values. Returns the results in rank order; raises
    RuntimeError with the first failing rank's error.
    """
    return on_free_port(functools.partial(_run_local_once, fn, world_size, args, env_per_rank, timeout_s),
                        what="rank 0's rendezvous store")


def _run_local_once(fn: Callable[..., Any], world_size: int, args: tuple,
                    env_per_rank: Sequence[dict[str, str]] | None, timeout_s: float, port: int) -> list[Any]:
    fork = not torch.cuda.is_available()
    ctx = mp.get_context("fork") if fork else mp.get_context("spawn")
    if fork:  # each rank would import it on its own, per run (bench: a dozen runs)
        from kaitian_ros.training.trainer import import_lazy_dependencies

        import_lazy_dependencies()
    q = ctx.Queue()
    procs = []
    for r in range(world_size):
        env = dict(env_per_rank[r]) if env_per_rank else {}
        p = ctx.Process(target=_local_child, args=(fn, r, world_size, port, args, env,
                                                   timeout_s, q), daemon=True)
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s * 2 + 30
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"ranks timed out; finished: {sorted(results)}")
            try:
                r, ok, out = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in results and i not in errors]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code "
                                       f"{procs[dead[0]].exitcode}") from None
                continue
            if ok:
                results[r] = pickle.loads(out)  # noqa: S301 - bytes our own child pickled
            elif "EADDRINUSE" in out:
                # a free port is only free until someone binds it: parallel test workers and
                # benchmarks pick theirs at the same moment; the other ranks are stopped below
                raise PortTaken(out)
            else:
                errors[r] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        r = min(errors)
        raise RuntimeError(f"rank {r} failed: {errors[r]}")
    return [results[r] for r in range(world_size)]
