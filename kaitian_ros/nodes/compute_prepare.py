"""A compute node prepared in a warm interpreter (`kaitian_ros.warm_start`).

Before the interpreter is told which node to become, `prepare` builds the model and measures
the start-up costs a compute node started with given arguments would; the compute node it
becomes takes them from `PREPARED` (`kaitian_ros.nodes.compute`) instead of doing that again.
`drop_prepared` forgets them when it becomes another kind of node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kaitian_ros.core import profiling
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes.compute_params import PARAMETERS
from kaitian_ros.runtime import memory


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


PREPARED: dict[PreparedKey, Prepared] = {}  # this process's, by `prepare`; a node takes its own


def prepare(argv: list[str]) -> str:
    """In a warm interpreter, before it is told which node to become: build the model and
    measure the start-up costs a compute node started with `argv` would (the same parameter
    resolution, at slowdown 1), so a compute node respawned here starts in a fraction of a
    second instead of ~2 s. Returns what was done, for the interpreter's log; a parameter a node
    would refuse prepares nothing (the node then refuses it itself)."""
    from kaitian_ros.runtime.api import coerce_parameter
    from kaitian_ros.runtime.node_args import parse_node_args

    args = parse_node_args(argv, "compute")
    params = {}
    for d in PARAMETERS:
        value = args.parameters.get(d.name, d.default)
        if d.check(value):
            return f"not prepared: {d.check(value)}"
        params[d.name] = coerce_parameter(d.type, value)
    key = PreparedKey.of(params)
    if key in PREPARED:
        return f"{key.spec.name} on {key.device}: already prepared"
    device = ic.check_device(key.device)
    torch.set_num_threads(key.threads)
    graph = ic.build_graph(key.spec, key.device)
    costs, inputs = profiling.measure_profile(graph, ic.busy_clock(device), slowdown=1.0,
                                              budget_s=key.profile_budget_s)
    PREPARED[key] = Prepared(graph, costs, inputs)
    memory.trim_heap()  # the measurement's activations are freed: give their pages back while it waits
    return f"{key.spec.name} {key.spec.input_shape} on {key.device}: built, costs measured ({costs.trunk_ms:.1f} ms)"


def drop_prepared() -> None:
    """Forget what `prepare` built (an interpreter that becomes another kind of node must not
    carry a compute node's model) and give its pages back."""
    PREPARED.clear()
    memory.trim_heap()
