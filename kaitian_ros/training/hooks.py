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
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kaitian_ros.training.groups import CommGroups


def hierarchical_all_reduce(tensor: torch.Tensor, groups: CommGroups,
                            weight: float = 1.0) -> torch.Tensor:
    """In place: ``tensor <- sum over ranks of weight_r * tensor_r`` via group leaders.

    Collective over the world: every rank calls it with its own ``weight``.
    """
    topo = groups.topology
    if weight != 1.0:
        tensor.mul_(weight)
    single_group = len(topo.groups) == 1
    if len(topo.group_ranks) > 1:
        # reduce/broadcast take *global* ranks for dst/src.
        dist.reduce(tensor, dst=topo.leader, op=dist.ReduceOp.SUM, group=groups.intra)
    if topo.is_leader and not single_group:
        # gloo between vendors: work on a host copy unless the tensor already lives there.
        host = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
        dist.all_reduce(host, op=dist.ReduceOp.SUM, group=groups.inter)
        if host is not tensor:
            tensor.copy_(host)
    if len(topo.group_ranks) > 1:
        dist.broadcast(tensor, src=topo.leader, group=groups.intra)
    return tensor


def flat_all_reduce(tensor: torch.Tensor, weight: float = 1.0,
                    group: Any = None) -> torch.Tensor:
    """In place: ``tensor <- sum over ranks of weight_r * tensor_r`` in one all-reduce."""
    if weight != 1.0:
        tensor.mul_(weight)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
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
    hierarchical_all_reduce(buf, state.groups, state.weight)
    state.add_comm(time.perf_counter() - t0)
    return _done(buf)


def flat_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook baseline: batch-weighted flat all-reduce over one group."""
    buf = bucket.buffer()
    t0 = time.perf_counter()
    flat_all_reduce(buf, state.weight, state.flat_group)
    state.add_comm(time.perf_counter() - t0)
    return _done(buf)


HOOKS: dict[str, Callable[[HookState, dist.GradBucket], torch.futures.Future[torch.Tensor]]] = {
    "hierarchical": hierarchical_hook,
    "flat": flat_hook,
}
