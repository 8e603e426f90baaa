"""The strategy-complete planner: predict every candidate plan, run the fastest.

For the live nodes (in row order) and what they measured (`costs.Costs`), `choose_plan`
builds the candidates of every strategy and predicts each one's latency with the simulator:

* ``single``: the whole trunk on one node, for each node (a remote one pays the image's way
  there and the trunk output's way back: its links are in the costs);
* ``layerwise``: every cut, every ordered pair of nodes - the first runs the trunk up to the
  cut, the second the rest, the activation streamed between them;
* ``stripes``: row stripes over two or more nodes, with the cuts the cost-model dynamic
  programme picks, every solo tail, no cuts and every cut; shares from the scheduler and, when
  the caller allows it, shares in proportion to measured speed and tilted towards the faster
  nodes (speed ** gamma), over every subset of two or more nodes.

Forcing a strategy (``single``, ``layerwise``, ``stripes``) restricts the candidates to it.
The result names the best candidate and the runner-up (the best of another strategy, or with
a forced strategy the second best).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .costs import Costs
from .graph import ModelGraph
from .plan import STRATEGIES, Plan, PlanSpec, _choose_cuts, build_plan, normalise_shares
from .simulate import simulate

STRATEGY_CHOICES = ("auto", *STRATEGIES)
GAMMAS = (1.0, 1.5, 2.0, 3.0)  # share_i ~ speed_i ** gamma (gamma > 1 favours fast nodes)
MAX_SUBSET_NODES = 4  # beyond this many nodes only the whole set and its halves are tried


@dataclass(frozen=True)
class Candidate:
    spec: PlanSpec
    predicted_ms: float
    label: str


@dataclass(frozen=True)
class Choice:
    best: Candidate
    runner_up: Candidate | None
    candidates: tuple[Candidate, ...]  # fastest first

    def plan(self, graph: ModelGraph, slab_rows: int) -> Plan:
        return build_plan(graph, self.best.spec, slab_rows=slab_rows, estimated_ms=self.best.predicted_ms)

    def summary(self) -> str:
        text = f"{self.best.label}: predicted {self.best.predicted_ms:.1f} ms"
        if self.runner_up is not None:
            text += f"; runner-up {self.runner_up.label}: {self.runner_up.predicted_ms:.1f} ms"
        return text


def predict(graph: ModelGraph, spec: PlanSpec, costs: Costs, *, slab_rows: int) -> float:
    """Predicted latency (ms) of `spec`; inf when it cannot run (a node without a profile)."""
    plan = build_plan(graph, spec, slab_rows=slab_rows)
    if any(n not in costs.profiles for n in plan.active_nodes()):
        return math.inf
    return simulate(graph, plan, costs).latency_ms


def speed_shares(node_ids: Sequence[str], costs: Costs, gamma: float = 1.0) -> tuple[float, ...]:
    """Shares in proportion to measured speed (1 / trunk time) to the power `gamma`."""
    w = [(1.0 / costs.profiles[n].trunk_ms) ** gamma for n in node_ids]
    return tuple(x / sum(w) for x in w)


def stripe_specs(graph: ModelGraph, node_ids: Sequence[str], shares: Sequence[float],
                 costs: Costs) -> list[PlanSpec]:
    """Stripes over `node_ids` by `shares`: the DP's cuts with every solo tail, no cuts, every cut."""
    pairs = [(n, float(x)) for n, x in zip(node_ids, normalise_shares(shares, len(node_ids))) if x > 0]
    if len(pairs) < 2:
        return []
    ids = tuple(n for n, _ in pairs)  # a node without a share is not part of the plan
    norm = tuple(x for _, x in pairs)
    active = list(range(len(ids)))
    view = costs.for_nodes(ids)
    dp_cuts, _ = _choose_cuts(graph, norm, view, None)
    fastest = min(active, key=lambda i: (costs.profiles[ids[i]].trunk_ms, i))
    out: list[PlanSpec] = []
    for cuts in (tuple(dp_cuts), (), tuple(graph.cut_values)):
        out.append(PlanSpec.stripes(ids, norm, cuts))
        for t in range(len(cuts), 0, -1):
            out.append(PlanSpec.stripes(ids, norm, cuts[:t], solo_from=t, solo_node=fastest))
    seen: set = set()
    unique = []
    for s in out:
        key = (s.cuts, s.segment_shares)
        if key not in seen:
            seen.add(key)
            unique.append(s)
    return unique


def _subsets(ids: tuple[str, ...]) -> list[tuple[str, ...]]:
    if len(ids) <= MAX_SUBSET_NODES:
        return [c for k in range(len(ids), 1, -1) for c in itertools.combinations(ids, k)]
    return [ids]


def candidate_specs(graph: ModelGraph, node_ids: Sequence[str], costs: Costs, *, strategy: str = "auto",
                    shares: Sequence[float] | None = None, adapt_shares: bool = True) -> list[PlanSpec]:
    """Every candidate for `strategy` over the nodes that have profiles (see module docstring).

    `shares` (aligned with `node_ids`, e.g. the scheduler's) are always tried for stripes; with
    `adapt_shares` also measured-speed shares over every subset of nodes."""
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGY_CHOICES)}, got {strategy!r}")
    ids = tuple(n for n in node_ids if n in costs.profiles)
    specs: list[PlanSpec] = []
    if strategy in ("auto", "single"):
        specs += [PlanSpec.single(n) for n in ids]
    if strategy in ("auto", "layerwise"):
        specs += [PlanSpec.layerwise(a, b, c) for a, b in itertools.permutations(ids, 2)
                  for c in graph.cut_values]
    if strategy in ("auto", "stripes"):
        if shares is not None:
            table = dict(zip(node_ids, shares))
            given = [float(table.get(n, 0.0)) for n in ids]
            if sum(given) > 0:
                specs += stripe_specs(graph, ids, given, costs)
        if adapt_shares or shares is None:
            for subset in _subsets(ids):
                for gamma in GAMMAS:
                    sub = speed_shares(subset, costs, gamma)
                    specs += stripe_specs(graph, ids, [sub[subset.index(n)] if n in subset else 0.0
                                                       for n in ids], costs)
    return specs


def choose_plan(graph: ModelGraph, node_ids: Sequence[str], costs: Costs, *, slab_rows: int,
                strategy: str = "auto", shares: Sequence[float] | None = None,
                adapt_shares: bool = True) -> Choice:
    """The fastest predicted candidate (ValueError when no node has a profile)."""
    specs = candidate_specs(graph, node_ids, costs, strategy=strategy, shares=shares, adapt_shares=adapt_shares)
    if not specs and strategy in ("layerwise", "stripes"):
        # one node left: the forced strategy has no plan, the node runs everything
        specs = candidate_specs(graph, node_ids, costs, strategy="single")
    seen: set = set()
    cands: list[Candidate] = []
    for spec in specs:
        key = (spec.strategy, spec.node_ids, spec.cuts, spec.segment_shares)
        if key in seen:
            continue
        seen.add(key)
        ms = predict(graph, spec, costs, slab_rows=slab_rows)
        if math.isfinite(ms):
            cands.append(Candidate(spec, ms, spec.describe(graph)))
    if not cands:
        raise ValueError(f"no plan for strategy {strategy!r}: no node of {list(node_ids)} has a cost profile")
    # fastest first; ties: simpler strategies first, then fewer segments
    order = {"single": 0, "layerwise": 1, "stripes": 2}
    cands.sort(key=lambda c: (c.predicted_ms, order[c.spec.strategy], len(c.spec.cuts)))
    best = cands[0]
    other = [c for c in cands[1:] if c.spec.strategy != best.spec.strategy]
    runner_up = other[0] if other else (cands[1] if len(cands) > 1 else None)
    return Choice(best, runner_up, tuple(cands))
