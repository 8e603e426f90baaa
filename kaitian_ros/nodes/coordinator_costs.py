"""What the coordinator's planner prices plans with: the compute nodes' measured profiles and
links, and priors for what has not been measured yet."""

from __future__ import annotations

from collections.abc import Mapping

from kaitian_ros.core.cost_model import CostModel, prior_op_cost
from kaitian_ros.core.costs import COORDINATOR, Costs, DeviceProfile, LinkEstimate, LinkMeter
from kaitian_ros.core.graph import ModelGraph

# Prior latency of an unmeasured link: the cost model's per-exchange latency (CostModel).
LINK_PRIOR_LATENCY_MS = CostModel().exchange_ms


def planning_costs(graph: ModelGraph, model_key: str, profiles: Mapping[str, DeviceProfile],
                   meters: Mapping[str, LinkMeter], nodes: tuple[str, ...], shares: tuple[float, ...], *,
                   plan_link_mbit: float, slab_rows: int, pre_ms: float, post_ms: float,
                   send_ms_per_mb: float) -> tuple[Costs, list[str]]:
    """(costs, nodes priced with priors): the measured profiles of `nodes` and the links the
    coordinator measured (`meters`: compute node -> its OUTPUT chunks); a node without a
    profile yet gets the flop-based prior (`CostModel`), faster in proportion to its share."""
    known = {n: p for n, p in profiles.items() if n in nodes}
    missing = [n for n in nodes if n not in known]
    if missing:
        prior = CostModel()
        active = [s for s in shares if s > 0] or [1.0]
        mean = sum(active) / len(active)
        for n, share in zip(nodes, shares):
            if n in missing:
                scale = mean / share if share > 0 else 10.0
                ops = tuple(prior_op_cost(op, prior, scale) for op in graph.ops)
                known[n] = DeviceProfile(n, 0, model_key, "?", 1.0, ops,
                                         sum(c.ms(op.out_shape[1]) for c, op in zip(ops, graph.ops)), 0.05)
    links = {(n, COORDINATOR): est for n, m in meters.items() if (est := m.estimate()) is not None}
    link_prior = LinkEstimate(plan_link_mbit * 1e3 / 8, LINK_PRIOR_LATENCY_MS)
    costs = Costs(known, links, link_prior, slab_rows=slab_rows, pre_ms=pre_ms, post_ms=post_ms,
                  send_ms_per_mb=send_ms_per_mb)
    return costs.with_links_from_profiles(), missing
