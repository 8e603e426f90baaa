"""A compute node prepared in a warm interpreter (`kaitian_ros.warm_start`) or in the fork
server its process is forked from (`kaitian_ros.fork_server`).

Before the interpreter is told which node to become, `prepare` builds the model and measures
the start-up costs a compute node started with given arguments would; the compute node it
becomes takes them from `PREPARED` (`kaitian_ros.nodes.compute`) instead of doing that again.
In the fork server that is done once for all the compute nodes of one model, device and thread
count: each is forked with it. `drop_prepared` forgets them when it becomes another kind of node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kaitian_ros import heap
from kaitian_ros.core import profiling
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes.compute_params import PARAMETERS
from kaitian_ros.nodes.preparation import Preparation, refused


@dataclass(frozen=True)
class PreparedKey:
    """What a compute node's model and start-up costs depend on (not its name, speed or links:
    costs are measured at slowdown 1 and scaled)."""

    spec: ic.ModelSpec
    device: str
    threads: int
    profile_budget_s: float

    @staticmethod
    def of(params: dict[str, Any]) -> PreparedKey:
        return PreparedKey(ic.ModelSpec.from_params(params), params["device"], params["threads"],
                           params["profile_budget_s"])


@dataclass(frozen=True)
class Prepared:
    graph: Any  # core.graph.ModelGraph
    costs: profiling.MeasuredCosts  # at slowdown 1
    probe_inputs: list
    by: str  # who measured them, for the node's log


PREPARED: dict[PreparedKey, Prepared] = {}  # this process's, by `prepare`; a node takes its own
# a fork server serves launch after launch (the test suite's, one per worker): the models of
# the latest few stay (ResNet-18 at 224x224 costs about 200 MB)
MAX_PREPARED = 2


def prepare(argv: list[str], by: str = "the warm interpreter before this respawn",
            cpu_only: bool = False) -> Preparation:
    """In a warm interpreter or a fork server, before it is told which node to become: build the
    model and measure the start-up costs a compute node started with `argv` would (the same
    parameter resolution, at slowdown 1), so a compute node started from here starts in a
    fraction of a second instead of ~2 s. Returns what was done (`Preparation`); a
    parameter a node would refuse prepares nothing (the node then refuses it itself), nor does
    another device than a CPU with `cpu_only` (a process that forks must not initialise CUDA: its
    children could not use it)."""
    from kaitian_ros.runtime.api import coerce_parameter
    from kaitian_ros.runtime.node_args import parse_node_args

    args = parse_node_args(argv, "compute")
    params = {}
    for d in PARAMETERS:
        value = args.parameters.get(d.name, d.default)
        if why := d.check(value):
            return refused(why)
        params[d.name] = coerce_parameter(d.type, value)
    key = PreparedKey.of(params)
    if key in PREPARED:
        return Preparation("already", f"{key.spec.name} on {key.device}: already prepared")
    if cpu_only and torch.device(key.device).type != "cpu":
        return refused(f"{key.device} is not a CPU (a process that forks must not initialise it)")
    while len(PREPARED) >= MAX_PREPARED:
        del PREPARED[next(iter(PREPARED))]
    device = ic.check_device(key.device)
    torch.set_num_threads(key.threads)
    graph = ic.build_graph(key.spec, key.device)
    costs, inputs = profiling.measure_profile(graph, ic.busy_clock(device), slowdown=1.0,
                                              budget_s=key.profile_budget_s)
    PREPARED[key] = Prepared(graph, costs, inputs, by)
    heap.trim_heap()  # the measurement's activations are freed: give their pages back while it waits
    return Preparation("built", f"{key.spec.name} {key.spec.input_shape} on {key.device}: built, costs measured "
                                f"({costs.trunk_ms:.1f} ms)")


def take_graph(spec: ic.ModelSpec, device: str) -> Any:
    """A prepared model graph of `spec` on `device` (a coordinator forked from the fork server,
    and its planner, need the model the compute nodes run), else None; forgets the rest."""
    graph = next((p.graph for k, p in PREPARED.items() if k.spec == spec and k.device == device), None)
    drop_prepared()
    return graph


def drop_prepared() -> None:
    """Forget what `prepare` built (an interpreter that becomes another kind of node must not
    carry a compute node's model) and give its pages back."""
    if PREPARED:
        PREPARED.clear()
        heap.trim_heap()
