"""DDP communication hooks: batch-weighted hierarchical all-reduce and a flat baseline.

Each rank's gradient is the mean over its own ``b_i`` samples. Scaling it by ``b_i / B``
and summing over ranks gives the mean over the global batch of ``B = sum b_i`` samples,
i.e. exactly the gradient a single process would compute on the union batch, whatever
the split. (Averaging unweighted over ranks or groups, as KAITIAN's public code does, is
only right when every rank has the same batch.)

The hierarchical path: scale -> SUM-reduce inside the group to its leader (vendor
backend) -> SUM all-reduce among leaders over gloo on host copies -> broadcast inside the
group. Communication runs synchronously inside the hook so that the time spent blocked
in it is measurable per step; on the CPU/gloo setups this package targets there is
nothing to overlap with anyway, and on fast accelerators the blocked time is the honest
cost.

Waiting by spinning (``spin=True``, :func:`wait_for`): a rank that arrives first at a gloo
collective otherwise blocks, its core goes idle, and when the peer's data arrives the kernel
must wake it on that idle core. On a virtual machine an idle virtual CPU is halted and handed
back to the host, and waking it took milliseconds: between two processes pinned to a core each,
a 150 KB all-reduce that one of them entered 5 ms late blocked the late one for 2.7 ms (median
of 200; 0.27 ms when both entered together), 0.38 ms while the cores were kept busy. Polling the
work with ``sched_yield`` keeps the waiting rank's core running, and gloo's own threads, which
do the transfer on that core, run whenever they are ready. Worth it only where the rank has its
core to itself (``TrainingConfig.spin_wait``); elsewhere it would take CPU from a neighbour.

Riding along (``HookState.exchange``): the sampler's rebalance needs every rank's speed
estimate. The hooks all-gather it beside the first bucket's reduction of the step before a
rebalance, where the ranks meet anyway, instead of in a collective of its own after the step.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kaitian_ros.training.groups import CommGroups


def wait_for(work: Any, spin: bool = False) -> None:
    """Wait for a collective's ``work``; with ``spin``, poll it (yielding the core to any other
    ready thread) instead of blocking. Errors and timeouts surface from ``work.wait()`` alike."""
    if spin:
        while not work.is_completed():
            os.sched_yield()
    work.wait()


def spins_on(group: Any, spin: bool) -> bool:
    """Spin only on gloo: an NCCL work completes on the GPU, where waiting costs no core."""
    return spin and dist.get_backend(group) == "gloo"


def hierarchical_all_reduce(tensor: torch.Tensor, groups: CommGroups,
                            weight: float = 1.0, spin: bool = False) -> torch.Tensor:
    """In place: ``tensor <- sum over ranks of weight_r * tensor_r`` via group leaders.

    Collective over the world: every rank calls it with its own ``weight``. ``spin``: wait
    for gloo transfers by polling (:func:`wait_for`).
    """
    topo = groups.topology
    if weight != 1.0:
        tensor.mul_(weight)
    single_group = len(topo.groups) == 1
    in_group = len(topo.group_ranks) > 1
    spin_intra = in_group and spins_on(groups.intra, spin)
    if in_group:
        # reduce/broadcast take *global* ranks for dst/src.
        wait_for(dist.reduce(tensor, dst=topo.leader, op=dist.ReduceOp.SUM, group=groups.intra,
                             async_op=True), spin_intra)
    if topo.is_leader and not single_group:
        # gloo between vendors: work on a host copy unless the tensor already lives there.
        host = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
        wait_for(dist.all_reduce(host, op=dist.ReduceOp.SUM, group=groups.inter, async_op=True), spin)
        if host is not tensor:
            tensor.copy_(host)
    if in_group:
        wait_for(dist.broadcast(tensor, src=topo.leader, group=groups.intra, async_op=True), spin_intra)
    return tensor


def flat_all_reduce(tensor: torch.Tensor, weight: float = 1.0,
                    group: Any = None, spin: bool = False) -> torch.Tensor:
    """In place: ``tensor <- sum over ranks of weight_r * tensor_r`` in one all-reduce."""
    if weight != 1.0:
        tensor.mul_(weight)
    wait_for(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True),
             spins_on(group, spin))
    return tensor


@dataclass
class HookState:
    """Mutable per-rank state shared by the hook and the training loop.

    ``set_batch`` must be called before every backward: batch sizes change at each
    rebalance and the last batch of an epoch is short. ``comm_seconds`` accumulates the
    time blocked in communication (it includes waiting for slower ranks, which is how load
    imbalance shows up); ``take_comm_seconds`` reads and resets it once per step.
    """

    groups: CommGroups | None = None  # None -> flat all-reduce over ``flat_group``
    flat_group: Any = None
    local_batch: int = 0
    global_batch: int = 0
    spin: bool = False  # wait for gloo transfers by polling (``wait_for``)
    # values every rank all-gathers with the next gradient reduction (the sampler's
    # ``exchange_payload``) over ``exchange_group``, and the gathered ones (rank order)
    exchange: tuple[float, ...] | None = None
    exchange_group: Any = None
    exchanged: list[tuple[float, ...]] | None = None
    comm_seconds: float = 0.0
    total_comm_seconds: float = 0.0
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_batch(self, local_batch: int, global_batch: int) -> None:
        if global_batch <= 0 or not 0 <= local_batch <= global_batch:
            raise ValueError(f"bad batch sizes local={local_batch} global={global_batch}")
        self.local_batch, self.global_batch = int(local_batch), int(global_batch)

    @property
    def weight(self) -> float:
        if self.global_batch <= 0:
            raise RuntimeError("HookState.set_batch() was not called before backward")
        return self.local_batch / self.global_batch

    def add_comm(self, seconds: float) -> None:
        with self._lock:
            self.comm_seconds += seconds
            self.total_comm_seconds += seconds
            self.calls += 1

    def take_comm_seconds(self) -> float:
        with self._lock:
            s, self.comm_seconds = self.comm_seconds, 0.0
        return s

    def take_exchanged(self) -> list[tuple[float, ...]] | None:
        """The values all-gathered with this step's gradient (None if none were); resets."""
        got, self.exchanged = self.exchanged, None
        return got


def start_all_gather(values: Sequence[float], group: Any = None) -> tuple[Any, list[torch.Tensor]]:
    """Launch the all-gather of a float vector (the same length on every rank) over ``group``;
    ``finish_all_gather`` waits for it."""
    own = torch.tensor(list(values), dtype=torch.float64)
    out = [torch.empty_like(own) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(out, own, group=group, async_op=True), out


def finish_all_gather(started: tuple[Any, list[torch.Tensor]], group: Any = None,
                      spin: bool = False) -> list[tuple[float, ...]]:
    """Every rank's vector (rank order) of a ``start_all_gather``; ``spin``: poll (``wait_for``)."""
    work, out = started
    wait_for(work, spins_on(group, spin))
    return [tuple(o.tolist()) for o in out]


def _start_exchange(state: HookState, bucket: dist.GradBucket) -> tuple[Any, list[torch.Tensor]] | None:
    """Launch the all-gather of ``state.exchange`` beside the first bucket's reduction.

    The ranks meet in that reduction anyway, so the gather costs a transfer and no wait of its
    own; launched first, its transfer overlaps the gradient's."""
    if state.exchange is None or bucket.index() != 0:
        return None
    return start_all_gather(state.exchange, state.exchange_group)


def _finish_exchange(state: HookState, started: tuple[Any, list[torch.Tensor]] | None) -> None:
    if started is None:
        return
    state.exchanged = finish_all_gather(started, state.exchange_group, state.spin)
    state.exchange = None


def _done(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def hierarchical_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: batch-weighted hierarchical all-reduce of one gradient bucket."""
    if state.groups is None:
        raise RuntimeError("hierarchical_hook needs HookState.groups")
    buf = bucket.buffer()
    t0 = time.perf_counter()
    started = _start_exchange(state, bucket)
    hierarchical_all_reduce(buf, state.groups, state.weight, state.spin)
    _finish_exchange(state, started)
    state.add_comm(time.perf_counter() - t0)
    return _done(buf)


def flat_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook baseline: batch-weighted flat all-reduce over one group."""
    buf = bucket.buffer()
    t0 = time.perf_counter()
    started = _start_exchange(state, bucket)
    flat_all_reduce(buf, state.weight, state.flat_group, state.spin)
    _finish_exchange(state, started)
    state.add_comm(time.perf_counter() - t0)
    return _done(buf)


HOOKS: dict[str, Callable[[HookState, dist.GradBucket], torch.futures.Future[torch.Tensor]]] = {
    "hierarchical": hierarchical_hook,
    "flat": flat_hook,
}
