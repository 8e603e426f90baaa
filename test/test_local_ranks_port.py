"""`ports.on_free_port`, and `training.local_ranks.run_local` when another process takes rank
0's rendezvous port between `free_port` and the listen (parallel test workers and benchmarks
pick theirs at the same moment): it starts the ranks again on another port instead of failing."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from kaitian_ros import ports as ports_module
from kaitian_ros.ports import PortTaken, free_port, on_free_port
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

    monkeypatch.setattr(ports_module, "free_port", port_chooser_double)
    try:
        assert local_ranks.run_local(_world_sum, 2, timeout_s=30.0) == [3, 3]
        assert not ports  # the taken port was tried
    finally:
        taken.close()


def test_on_free_port_tries_another_port_while_one_is_taken_and_gives_up_after_its_attempts() -> None:
    tried: list[int] = []

    def taken_twice(port: int) -> str:
        tried.append(port)
        if len(tried) < 3:
            raise PortTaken(f"port {port}")
        return f"listening on {port}"

    assert on_free_port(taken_twice, 3, first=1234) == f"listening on {tried[-1]}"
    assert tried[0] == 1234 and len(set(tried)) == 3  # the chosen port first, then fresh ones

    tried.clear()
    with pytest.raises(PortTaken, match="the store could not listen on a free port 2 times"):
        on_free_port(taken_twice, 2, what="the store")
    assert len(tried) == 2

    def refused(port: int) -> None:  # any other error is the caller's: no retry
        tried.append(port)
        raise ValueError("bad address")

    tried.clear()
    with pytest.raises(ValueError, match="bad address"):
        on_free_port(refused)
    assert len(tried) == 1
