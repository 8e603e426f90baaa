"""Batch-weighted hierarchical all-reduce: exactness against one process, and against flat.

Runs real gloo process groups on forked local ranks; device *types* are emulated with
labels (cpu:a, cpu:b) so two groups of different sizes exist on one CPU host.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kaitian_ros.training.groups import build_groups
from kaitian_ros.training.hooks import (
    HookState,
    flat_all_reduce,
    flat_hook,
    hierarchical_all_reduce,
    hierarchical_hook,
)
from kaitian_ros.training.local_ranks import run_local

BATCHES = (5, 17, 42)
LR = 0.1


def _model() -> nn.Module:
    # No BatchNorm: with BN, per-rank batch statistics make uneven splits inexact.
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 16), nn.Tanh(), nn.Linear(16, 10)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = sum(BATCHES)
    return (torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g))


def _single_step() -> list[torch.Tensor]:
    m = _model()
    x, y = _data()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    return [p.detach().clone() for p in m.parameters()]


def _ddp_step(rank: int, world: int, labels: list[str], hook_name: str,
              spin: bool = False) -> list[torch.Tensor]:
    groups = build_groups(labels[rank], timeout_s=30)
    m = _model()
    ddp = DDP(m, process_group=groups.world, init_sync=False)
    state = HookState(groups=groups, flat_group=groups.world, spin=spin)
    ddp.register_comm_hook(state, hierarchical_hook if hook_name == "hier" else flat_hook)
    x, y = _data()
    lo = sum(BATCHES[:rank])
    xb, yb = x[lo:lo + BATCHES[rank]], y[lo:lo + BATCHES[rank]]
    state.set_batch(len(yb), sum(BATCHES))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    nn.functional.cross_entropy(ddp(xb), yb).backward()  # mean over the local batch
    opt.step()
    assert state.take_comm_seconds() > 0
    return [p.detach().clone() for p in m.parameters()]


def _kaitian_unweighted_step(rank: int, world: int, labels: list[str]) -> list[torch.Tensor]:
    """KAITIAN's public scheme: mean inside a group, mean over groups, batch sizes ignored."""
    groups = build_groups(labels[rank], timeout_s=30)
    topo = groups.topology
    m = _model()
    x, y = _data()
    lo = sum(BATCHES[:rank])
    nn.functional.cross_entropy(m(x[lo:lo + BATCHES[rank]]), y[lo:lo + BATCHES[rank]]).backward()
    for p in m.parameters():
        g = p.grad
        dist.all_reduce(g, group=groups.intra)
        g.div_(len(topo.group_ranks))
        if topo.is_leader:
            dist.all_reduce(g, group=groups.inter)
            g.div_(len(topo.groups))
        dist.broadcast(g, src=topo.leader, group=groups.intra)
    torch.optim.SGD(m.parameters(), lr=LR).step()
    return [p.detach().clone() for p in m.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((u - v).abs().max()) for u, v in zip(a, b))


@pytest.mark.parametrize("labels", [
    ["cpu", "cpu", "cpu"],          # one group of 3
    ["cpu:a", "cpu:b", "cpu:b"],    # two groups of different sizes (1 and 2)
    ["cpu:a", "cpu:b", "cpu:c"],    # three singleton groups: all traffic between leaders
], ids=["one-group", "groups-1+2", "groups-1+1+1"])
def test_hierarchical_step_equals_single_process(labels: list[str]) -> None:
    ref = _single_step()
    outs = run_local(_ddp_step, 3, labels, "hier", timeout_s=30)
    for params in outs:  # every rank ends with the same parameters as one process
        assert _max_diff(params, ref) < 1e-9
    # a step actually happened (the parameters moved)
    assert _max_diff(ref, [p.detach() for p in _model().parameters()]) > 1e-4


def test_waiting_by_spinning_gives_the_same_step() -> None:
    """spin_wait: the collectives are polled instead of blocked on; the update is the same (a
    group of two exercises the intra-group reduce and broadcast as well)."""
    ref = _single_step()
    for hook_name in ("hier", "flat"):
        for params in run_local(_ddp_step, 3, ["cpu:a", "cpu:b", "cpu:b"], hook_name, True, timeout_s=30):
            assert _max_diff(params, ref) < 1e-9


def test_spin_wait_resolves_to_the_rank_having_its_own_core() -> None:
    from kaitian_ros.training.config import TrainingConfig

    assert TrainingConfig(spin_wait="auto").spins(pinned=True)
    assert not TrainingConfig(spin_wait="auto").spins(pinned=False)
    assert TrainingConfig(spin_wait="on").spins(pinned=False)
    assert not TrainingConfig(spin_wait=False).spins(pinned=True)  # YAML false
    with pytest.raises(ValueError, match="spin_wait"):
        TrainingConfig(spin_wait="sometimes")


def test_busy_emulated_slowdown_lasts_as_long_as_the_sleep() -> None:
    import time

    from kaitian_ros.training.trainer import slow_down

    cpu = {}
    for busy in (False, True):
        t0, c0 = time.thread_time(), time.perf_counter()
        slow_down(0.05, busy=busy)
        assert 0.05 <= time.perf_counter() - c0 < 1.0
        cpu[busy] = time.thread_time() - t0
    # busy keeps running whenever the core is free (on a loaded machine that may be seldom)
    assert cpu[False] < 0.01 and cpu[True] > cpu[False], cpu
    slow_down(-1.0, busy=True)  # nothing owed: returns at once


def _ddp_step_on_device(rank: int, world: int, labels: list[str]) -> list[torch.Tensor]:
    """`_ddp_step` with each rank's model and batch on its label's torch device (the CUDA
    rank's intra group is nccl, the leaders' group gloo on host memory)."""
    device = torch.device("cuda:0" if labels[rank] == "cuda" else "cpu")
    groups = build_groups(labels[rank], timeout_s=30)
    m = _model().to(device)
    ddp = DDP(m, process_group=groups.world, init_sync=False)
    state = HookState(groups=groups, flat_group=groups.world)
    ddp.register_comm_hook(state, hierarchical_hook)
    x, y = _data()
    lo = sum(BATCHES[:rank])
    xb, yb = x[lo:lo + BATCHES[rank]].to(device), y[lo:lo + BATCHES[rank]].to(device)
    state.set_batch(len(yb), sum(BATCHES))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    nn.functional.cross_entropy(ddp(xb), yb).backward()
    opt.step()
    return [p.detach().cpu().clone() for p in m.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_rank_and_cpu_ranks_step_equals_single_process() -> None:
    """Real heterogeneous training: one rank on the GPU (nccl group of one), two on the CPU
    (gloo); the batch-weighted step equals one process's step on the whole batch."""
    ref = _single_step()
    for params in run_local(_ddp_step_on_device, 3, ["cuda", "cpu", "cpu"], timeout_s=60):
        assert _max_diff(params, ref) < 1e-9


def test_flat_weighted_step_equals_single_process() -> None:
    ref = _single_step()
    for params in run_local(_ddp_step, 3, ["cpu:a", "cpu:b", "cpu:b"], "flat", timeout_s=30):
        assert _max_diff(params, ref) < 1e-9


def test_unweighted_averaging_is_wrong_for_uneven_groups() -> None:
    """The same split with KAITIAN's unweighted averaging does not match one process."""
    ref = _single_step()
    outs = run_local(_kaitian_unweighted_step, 3, ["cpu:a", "cpu:b", "cpu:b"], timeout_s=30)
    assert _max_diff(outs[0], outs[1]) < 1e-12  # consistent across ranks, just wrong
    assert _max_diff(outs[0], ref) > 1e-4


def _reduce_compare(rank: int, world: int, labels: list[str]) -> list[tuple[str, float, float]]:
    groups = build_groups(labels[rank], timeout_s=30)
    out = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2)):
        for n in (1, 7, 1000):
            g = torch.Generator().manual_seed(100 * n + rank)
            base = torch.randn(n, generator=g, dtype=torch.float64)
            w = (rank + 1) / 10
            hier = hierarchical_all_reduce(base.to(dtype), groups, w)
            flat = flat_all_reduce(base.to(dtype), w, groups.world)
            # exact reference, computed identically on every rank
            ref = sum(torch.randn(n, generator=torch.Generator().manual_seed(100 * n + r),
                                  dtype=torch.float64) * ((r + 1) / 10) for r in range(world))
            out.append((str(dtype), float((hier.double() - flat.double()).abs().max()),
                        float((hier.double() - ref).abs().max()) / tol))
    return out


def test_hierarchical_equals_flat_on_random_tensors_and_dtypes() -> None:
    labels = ["cpu:a", "cpu:b", "cpu:b", "cpu:a"]  # groups {0,3} and {1,2}
    for rank_out in run_local(_reduce_compare, 4, labels, timeout_s=30):
        for dtype, diff_flat, rel_ref in rank_out:
            tol = {"torch.float32": 1e-5, "torch.float64": 1e-12}.get(dtype, 3e-2)
            assert diff_flat <= tol * 4, (dtype, diff_flat)  # summation order differs
            assert rel_ref <= 4, (dtype, rel_ref)


def test_hook_state_validates_batches() -> None:
    s = HookState()
    with pytest.raises(RuntimeError):
        _ = s.weight
    with pytest.raises(ValueError):
        s.set_batch(5, 0)
    s.set_batch(0, 10)  # an empty slice is legal: weight 0
    assert s.weight == 0.0
    s.add_comm(0.25)
    assert s.take_comm_seconds() == 0.25 and s.take_comm_seconds() == 0.0
    assert s.total_comm_seconds == 0.25
