"""Process-group initialisation with heartbeats: the torchrun-style environment of a rank
(:class:`DistEnv`), the rendezvous TCPStore and the heartbeat every rank keeps in it, so that a
failed collective names the rank whose heartbeat stopped (:class:`RankFailure`)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:  # imported at run time where used, as the functions below do
    pass


HEARTBEAT_S = 0.5
STALE_S = 2.5  # a heartbeat older than this means the rank is gone
# what a TCPStore call raises when its host is gone or slow: c10d's DistError family (RuntimeError
# subclasses: DistNetworkError, DistStoreError), or a socket error as such
STORE_ERRORS = (RuntimeError, OSError)


class RankFailure(RuntimeError):
    """Another rank died or stopped responding; the message names it."""


@dataclass(frozen=True)
class DistEnv:
    """The torchrun-compatible environment of one rank."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @staticmethod
    def from_environ(environ: dict[str, str] | None = None) -> DistEnv:
        e = os.environ if environ is None else environ
        try:
            return DistEnv(rank=int(e["RANK"]), world_size=int(e["WORLD_SIZE"]),
                           local_rank=int(e.get("LOCAL_RANK", e["RANK"])),
                           master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                           master_port=int(e["MASTER_PORT"]))
        except KeyError as k:
            raise RuntimeError(f"environment variable {k.args[0]} is not set") from None


class Heartbeat:
    """Writes ``kaitian/hb/<rank>`` = wall time into the rendezvous store every HEARTBEAT_S.

    Uses its own store client (TCPStore clients are not meant to be shared across
    threads), so it keeps beating while the main thread is blocked in a collective.
    """

    def __init__(self, env: DistEnv, timeout_s: float) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                    is_master=False, timeout=timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        self._store.set(f"kaitian/hb/{env.rank}", repr(time.time()))
        self._thread = threading.Thread(target=self._run, name="kaitian-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.set(f"kaitian/hb/{self.env.rank}", repr(time.time()))
            except STORE_ERRORS:  # store host gone: diagnose() will report it
                return

    def stop(self, state: str = "done") -> None:
        self._stop.set()
        with contextlib.suppress(*STORE_ERRORS):  # store host gone: nobody left to tell
            self._store.set(f"kaitian/state/{self.env.rank}", state)
            self._store.set(f"kaitian/final/{self.env.rank}", state)  # done with the store

    def _heartbeat_age(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s last heartbeat, None if it never sent one."""
        key = f"kaitian/hb/{rank}"
        if not self._store.check([key]):
            return None
        return now - float(self._store.get(key).decode())

    def wait_for_peers(self, max_s: float) -> None:
        """Wait (at most ``max_s``) until every other rank is done with the store (it has
        stopped, after its own diagnosis) or its heartbeat is stale."""
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            try:
                now, pending = time.time(), 0
                for r in range(self.env.world_size):
                    if r == self.env.rank or self._store.check([f"kaitian/final/{r}"]):
                        continue
                    age = self._heartbeat_age(r, now)
                    if age is not None and age <= STALE_S:
                        pending += 1
            except STORE_ERRORS:
                return
            if not pending:
                return
            time.sleep(HEARTBEAT_S / 2)

    def diagnose(self, labels: Sequence[str] | None = None, wait_s: float = STALE_S * 2) -> str:
        """Name the rank(s) that stopped; waits up to ``wait_s`` for heartbeats to go stale.

        A peer killed a moment ago still has a fresh heartbeat, hence the wait. Ranks that
        are themselves aborting (state ``aborting``) are alive and are not blamed.
        """
        try:
            self._store.set(f"kaitian/state/{self.env.rank}", "aborting")
        except STORE_ERRORS:
            return ("rank 0 is unreachable (it hosts the rendezvous store at "
                    f"{self.env.master_addr}:{self.env.master_port}); it died or its host is down")
        deadline = time.monotonic() + wait_s
        while True:
            dead = []
            try:
                now = time.time()
                for r in range(self.env.world_size):
                    if r == self.env.rank:
                        continue
                    if self._store.check([f"kaitian/state/{r}"]):
                        st = self._store.get(f"kaitian/state/{r}").decode()
                        if st in ("aborting", "done"):
                            continue
                    age = self._heartbeat_age(r, now)
                    if age is None or age > STALE_S:
                        dead.append((r, age))
            except STORE_ERRORS:
                return ("rank 0 is unreachable (it hosts the rendezvous store at "
                        f"{self.env.master_addr}:{self.env.master_port}); it died or its host is down")
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(HEARTBEAT_S / 2)
        if not dead:
            return "no peer is known dead (collective failed or timed out with all heartbeats fresh)"

        def name(r: int) -> str:
            return f"rank {r}" + (f" ({labels[r]})" if labels and r < len(labels) else "")
        return "; ".join(
            f"{name(r)} never sent a heartbeat" if age is None
            else f"{name(r)} stopped responding (no heartbeat for {age:.1f} s)"
            for r, age in dead)


def init_distributed(env: DistEnv, *, timeout_s: float = 60.0,
                     backend: str = "gloo") -> Heartbeat:
    """Initialise the default (world) process group from ``env`` and start heartbeating.

    The world group is gloo: it carries control traffic (step times, metadata) and the
    DDP constructor's checks, which must work across vendors. Vendor backends are used in
    the intra-group groups built by :func:`kaitian_ros.training.groups.build_groups`.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=env.rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    # keep the master store object alive for the process lifetime
    global _STORE
    _STORE = store
    return Heartbeat(env, timeout_s)


_STORE: Any = None


def shutdown_distributed(hb: Heartbeat | None, state: str = "done") -> None:
    if hb is not None:
        hb.stop(state)
        if state == "aborting" and hb.env.rank == 0:
            # rank 0 hosts the store: the other ranks read it to name the dead peer, so it
            # stays up until each of them has said it is aborting/done or has gone stale
            hb.wait_for_peers(STALE_S * 2 + 1.0)
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):  # c10d errors after a peer died
            dist.destroy_process_group()
