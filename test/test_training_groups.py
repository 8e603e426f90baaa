"""Topology planning (pure) and process-group construction (gloo, emulated device types)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kaitian_ros.training.groups import (
    backend_for_device,
    build_groups,
    device_backends,
    parse_device,
    plan_topology,
    register_device_backend,
)
from kaitian_ros.training.local_ranks import run_local


def test_plan_groups_by_host_and_device() -> None:
    members = [("h1", "cuda"), ("h1", "mlu"), ("h1", "cuda"), ("h2", "cuda"), ("h1", "mlu")]
    t = plan_topology(members, 4)
    assert t.groups == ((0, 2), (1, 4), (3,))
    assert t.backends == ("nccl", "cncl", "nccl")
    assert t.leaders == (0, 1, 3)
    assert t.group_ranks == (1, 4) and t.leader == 1 and not t.is_leader
    assert plan_topology(members, 3).is_leader
    assert "cncl" in t.describe()


def test_backend_table_and_device_parsing() -> None:
    assert backend_for_device("cpu:a") == "gloo"
    assert backend_for_device("cuda") == "nccl"
    assert parse_device("cuda:1") == (torch.device("cuda:1"), "cuda")
    assert parse_device("cpu:b") == (torch.device("cpu"), "cpu:b")
    assert parse_device("cpu") == (torch.device("cpu"), "cpu")
    with pytest.raises(ValueError, match="register_device_backend"):
        backend_for_device("xpu")
    register_device_backend("xpu", "xccl")
    try:
        assert backend_for_device("xpu") == "xccl"
    finally:
        device_backends()  # copy; the table itself is module state
        import kaitian_ros.training.groups as g
        g._DEVICE_BACKENDS.pop("xpu")


def _build(rank: int, world: int, labels: list[str]) -> tuple:
    cg = build_groups(labels[rank], timeout_s=30)
    t = cg.topology
    # the intra group really contains the group: an all-reduce of ones counts its members
    x = torch.ones(1)
    dist.all_reduce(x, group=cg.intra)
    n_inter = None
    if cg.inter is not None:
        y = torch.ones(1)
        dist.all_reduce(y, group=cg.inter)
        n_inter = int(y.item())
    return t.groups, t.is_leader, int(x.item()), n_inter


def test_build_groups_two_device_types_of_different_sizes() -> None:
    labels = ["cpu:a", "cpu:b", "cpu:a", "cpu:a"]
    outs = run_local(_build, 4, labels, timeout_s=30)
    for r, (groups, leader, n_intra, n_inter) in enumerate(outs):
        assert groups == ((0, 2, 3), (1,))
        assert leader == (r in (0, 1))
        assert n_intra == (1 if r == 1 else 3)
        assert n_inter == (2 if leader else None)


def test_build_groups_separates_hosts() -> None:
    envs = [{"KAITIAN_HOST": "h1"}, {"KAITIAN_HOST": "h2"}]
    outs = run_local(_build, 2, ["cpu", "cpu"], env_per_rank=envs, timeout_s=30)
    assert outs[0][0] == ((0,), (1,))
