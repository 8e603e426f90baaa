"""`training.local_ranks.run_local` when another process takes rank 0's rendezvous port between
`free_port` and the listen (parallel test workers and benchmarks pick theirs at the same moment):
it starts the ranks again on another port instead of failing."""

from __future__ import annotations

import socket

import torch.distributed as dist

from kaitian_ros.ports import free_port
from kaitian_ros.training import local_ranks


def _world_sum(rank: int, world: int) -> int:
    import torch

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def test_a_taken_rendezvous_port_is_replaced_by_another(monkeypatch) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]  # the first port handed out is already someone's

    def port_chooser_double() -> int:  # the first call returns the taken port, later ones free ports
        return ports.pop(0) if ports else free_port()

    monkeypatch.setattr(local_ranks, "free_port", port_chooser_double)
    try:
        assert local_ranks.run_local(_world_sum, 2, timeout_s=30.0) == [3, 3]
        assert not ports  # the taken port was tried
    finally:
        taken.close()
