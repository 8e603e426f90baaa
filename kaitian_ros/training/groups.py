"""Process-group topology for heterogeneous collaborative training (docs/training.md).

Ranks are grouped by (host, device label). Inside a group the device's own vendor
collective library is used (nccl for cuda, gloo for cpu, a registered plug-in name for
others); between groups, the group leaders (lowest rank of each group) talk over gloo on
host memory, because no vendor library spans two vendors' devices.

Device strings are ``type[:suffix]``:

* an integer suffix is a device index (``cuda:1``): torch device ``cuda:1``, label ``cuda``;
* any other suffix is an emulation tag (``cpu:a``): torch device ``cpu``, label ``cpu:a``.
  Tags let one CPU host emulate several device *types* (two groups of different sizes)
  so the hierarchical path is testable without accelerators.

Vendors add a backend in two steps (see docs/training.md):

1. make torch know the backend: ``torch.distributed.Backend.register_backend("cncl",
   create_fn, devices=["mlu"])`` (usually done by importing the vendor's torch plug-in,
   e.g. ``torch_mlu``), and
2. map the device type to it here: ``register_device_backend("mlu", "cncl")``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Device type -> collective backend for the intra-group process group. hccl (Huawei
# Ascend "npu") and cncl (Cambricon "mlu") are the names their torch plug-ins register;
# they only work once that plug-in is imported (step 1 in the module docstring).
_DEVICE_BACKENDS: dict[str, str] = {
    "cpu": "gloo",
    "cuda": "nccl",
    "npu": "hccl",
    "mlu": "cncl",
}


def register_device_backend(device_type: str, backend: str) -> None:
    """Map a torch device type (e.g. ``"mlu"``) to its collective backend name."""
    if not device_type or ":" in device_type:
        raise ValueError(f"device type must be a bare type like 'mlu', got {device_type!r}")
    _DEVICE_BACKENDS[device_type] = backend


def device_backends() -> dict[str, str]:
    """A copy of the device-type -> backend table."""
    return dict(_DEVICE_BACKENDS)


def parse_device(device: str) -> tuple[torch.device, str]:
    """``"cuda:1"`` -> (device('cuda:1'), 'cuda'); ``"cpu:a"`` -> (device('cpu'), 'cpu:a')."""
    dtype_, _, suffix = device.partition(":")
    if not dtype_:
        raise ValueError(f"empty device string {device!r}")
    if suffix == "" or suffix.isdigit():
        return torch.device(device), dtype_
    return torch.device(dtype_), device


def backend_for_device(device_label: str) -> str:
    """Collective backend for a device label (``cpu:a`` -> gloo, ``cuda`` -> nccl)."""
    base = device_label.split(":", 1)[0]
    try:
        return _DEVICE_BACKENDS[base]
    except KeyError:
        raise ValueError(
            f"no collective backend known for device type {base!r}; call "
            f"kaitian_ros.training.groups.register_device_backend({base!r}, '<backend>') "
            "after registering the backend with torch.distributed.Backend.register_backend"
        ) from None


def host_name() -> str:
    """This host's name; ``KAITIAN_HOST`` overrides it (to emulate hosts in tests)."""
    return os.environ.get("KAITIAN_HOST") or socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """Who is in which group; identical on every rank (a pure function of the members)."""

    rank: int
    members: tuple[tuple[str, str], ...]  # (host, device label) per rank, index = rank
    groups: tuple[tuple[int, ...], ...]  # ranks of each group, groups in first-rank order
    backends: tuple[str, ...]  # intra-group backend per group

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def group_index(self) -> int:
        for i, ranks in enumerate(self.groups):
            if self.rank in ranks:
                return i
        raise AssertionError("rank not in any group")

    @property
    def group_ranks(self) -> tuple[int, ...]:
        return self.groups[self.group_index]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.groups)

    @property
    def leader(self) -> int:
        return self.group_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def describe(self) -> str:
        parts = []
        for ranks, backend in zip(self.groups, self.backends):
            host, label = self.members[ranks[0]]
            parts.append(f"{label}@{host}{list(ranks)}/{backend}")
        return " | ".join(parts) + " ; leaders over gloo"


def plan_topology(members: Sequence[tuple[str, str]], rank: int) -> Topology:
    """Group ranks by (host, device label); groups ordered by their lowest rank."""
    members = tuple((str(h), str(d)) for h, d in members)
    if not 0 <= rank < len(members):
        raise ValueError(f"rank {rank} outside world of {len(members)}")
    order: dict[tuple[str, str], list[int]] = {}
    for r, key in enumerate(members):
        order.setdefault(key, []).append(r)
    groups = tuple(tuple(ranks) for ranks in order.values())
    backends = tuple(backend_for_device(members[g[0]][1]) for g in groups)
    return Topology(rank=rank, members=members, groups=groups, backends=backends)


@dataclass(frozen=True, eq=False)
class CommGroups:
    """The built process groups for this rank.

    ``intra`` is this rank's group (vendor backend); ``inter`` the gloo group of leaders,
    None on non-leaders (they never touch it). ``world`` is the gloo world group used for
    control traffic (step times, shares, metadata).
    """

    topology: Topology
    intra: Any
    inter: Any
    world: Any


def build_groups(device_label: str, *, timeout_s: float = 60.0,
                 host: str | None = None) -> CommGroups:
    """Build intra-group and leader groups. Collective: every rank must call it.

    The default process group must already be initialised (any backend whose world group
    can run ``all_gather_object``: gloo, or a ``cpu:gloo,...`` multi-backend).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (host or host_name(), device_label)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, me)
    topo = plan_topology([tuple(m) for m in gathered], rank)
    timeout = timedelta(seconds=timeout_s)
    # new_group is collective over the world: every rank creates every group in the
    # same order, and keeps only its own.
    intra = None
    for ranks, backend in zip(topo.groups, topo.backends):
        pg = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            intra = pg
    inter_pg = dist.new_group(list(topo.leaders), backend="gloo", timeout=timeout)
    inter = inter_pg if topo.is_leader else None
    world_pg = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    return CommGroups(topology=topo, intra=intra, inter=inter, world=world_pg)
