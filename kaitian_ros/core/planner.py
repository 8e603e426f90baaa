"""The strategy-complete planner: predict every candidate plan, run the fastest.

For the live nodes (in row order) and what they measured (`costs.Costs`), `choose_plan`
builds the candidates of every strategy and predicts each one's latency with the simulator:

* ``single``: the whole trunk on one node, for each node (a remote one pays the image's way
  there and the trunk output's way back: its links are in the costs);
* ``layerwise``: every cut, every ordered pair of nodes - the first runs the trunk up to the
  cut, the second the rest, the activation streamed between them;
* ``stripes``: row stripes over two or more nodes, with the cuts the cost-model dynamic
  programme picks, every solo tail, no cuts and every cut; shares from the scheduler and, when
  the caller allows it, shares in proportion to measured speed to the power gamma, over every
  subset of two or more nodes.

The simulator costs a few ms per candidate, so not everything is simulated: see `choose_plan`.

Forcing a strategy (``single``, ``layerwise``, ``stripes``) restricts the candidates to it.
The result names the best candidate and the runner-up (the best of another strategy, or with
a forced strategy the second best).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .costs import Costs
from .graph import ModelGraph
from .plan import Plan, PlanSpec, build_plan, choose_cuts, normalise_shares, split_rows
from .simulate import simulate
from .strategy_names import STRATEGY_CHOICES

# share_i ~ speed_i ** gamma: gamma > 1 favours fast nodes (their thicker stripes pay less
# per-call and halo cost), gamma < 1 slow ones (a local device that needs no link)
GAMMAS = (0.5, 1.0, 2.0)
MAX_SUBSET_NODES = 4  # beyond this many nodes only the whole set is tried
LAYERWISE_SIMULATED = 6
SHARE_VECTORS_REFINED = 3
SLAB_REFINED = 4
MODEL_ERROR_MAX = 3.0  # a measured/predicted ratio applied to untried plans is clamped to [1/3, 3]
_LAYERWISE = "layerwise"  # the key of every layer-wise plan's error (like a node count for splits)
_LAYERWISE_NODE = "layerwise:"  # prefix of the nodes of a layer-wise plan's error key


def error_key(spec: PlanSpec, active: Sequence[str] | frozenset[str]) -> frozenset[str]:
    """The key of a plan's model error (measured / predicted): the set of nodes computing at
    once. A layer-wise plan computes a request on one node after the other, so it does not
    contend for cores as a split of the same nodes does, nor does a split's error say how far
    the model is off for it: its key is its own (node names, which never hold a colon, prefixed)."""
    if spec.strategy == "layerwise":
        return frozenset(_LAYERWISE_NODE + n for n in active)
    return frozenset(active)


def _is_layerwise_key(key: frozenset[str]) -> bool:
    return any(n.startswith(_LAYERWISE_NODE) for n in key)


def _error_group(key: frozenset[str]) -> int | str:
    """The group whose errors an untried plan without its own falls back on: every layer-wise
    plan, else every plan with the same number of nodes at once."""
    return _LAYERWISE if _is_layerwise_key(key) else len(key)


@dataclass(frozen=True)
class Candidate:
    spec: PlanSpec
    predicted_ms: float
    label: str
    measured_ms: float | None = None  # the latency this plan really had lately, if it ran
    slab_rows: int = 8  # image rows per input slab the coordinator streams
    model_error: float = 1.0  # measured / predicted of plans that ran on the same nodes

    @property
    def expected_ms(self) -> float:
        """What the choice goes by: the measured latency where there is one (the model may be
        wrong, the measurement is what users get), else the prediction times the model's error
        on plans that ran on the same set of nodes."""
        return self.predicted_ms * self.model_error if self.measured_ms is None else self.measured_ms

    def describe_ms(self) -> str:
        text = f"predicted {self.predicted_ms:.1f} ms"
        if self.measured_ms is not None:
            return text + f", measured {self.measured_ms:.1f} ms"
        return text if self.model_error == 1.0 else text + f" (x{self.model_error:.2f} as measured on these nodes)"


@dataclass(frozen=True)
class Choice:
    best: Candidate
    runner_up: Candidate | None
    candidates: tuple[Candidate, ...]  # fastest first

    @functools.cached_property
    def by_key(self) -> dict[tuple, Candidate]:
        """The candidates by `spec_key` (the fastest of a key). Built once per choice: a key
        costs tens of microseconds for a split with many cuts, and the coordinator looks its
        running plan's twin up after every measured request (a scan of 79 candidates took
        2.6 ms on the 2026-12-06 machine)."""
        table: dict[tuple, Candidate] = {}
        for c in self.candidates:
            table.setdefault(spec_key(c.spec, c.slab_rows), c)
        return table

    def switched_to(self, to: Candidate) -> Choice:
        """This round's candidates with `to` run instead of its best: the best becomes the
        runner-up, unless `to` is that same plan (then the runner-up stays)."""
        same = spec_key(to.spec, to.slab_rows) == spec_key(self.best.spec, self.best.slab_rows)
        return Choice(to, self.runner_up if same else self.best, self.candidates)

    def plan(self, graph: ModelGraph) -> Plan:
        return build_plan(graph, self.best.spec, slab_rows=self.best.slab_rows, estimated_ms=self.best.predicted_ms)

    def summary(self) -> str:
        text = f"{self.best.label}: {self.best.describe_ms()}"
        if self.runner_up is not None:
            text += f"; runner-up {self.runner_up.label}: {self.runner_up.describe_ms()}"
        return text


class MeasuredPlan(NamedTuple):
    """A plan that ran lately and the latency it really had (keyed by `spec_key`)."""

    spec: PlanSpec
    slab_rows: int
    ms: float


def measured_margin(margin: float) -> float:
    """The margin between two measurements: half the one a prediction must clear. Both are what
    users got, so less is needed to tell them apart; still above a five-request median's noise
    here, so equal plans do not alternate."""
    return margin / 2


def worth_switching(running_ms: float, running_measured: bool, best: Candidate, min_gain: float) -> bool:
    """Whether to leave the running plan, expected to take `running_ms`, for `best`.

    For a gain of `min_gain`: a switch on a prediction's noise gains nothing and costs the
    new plan's first requests, and near-equal plans would alternate. Between two measurements
    - the running plan measured (`running_measured`) and `best` measured too - half of it: both
    are what users got. A plan switched to on a prediction that then measured worse than the
    measured plan it replaced goes back; with the full margin it stayed for being within the
    tolerance given to predictions (the benchmark's default and robot_edge scenarios ran such a
    plan for whole rounds)."""
    gain = measured_margin(min_gain) if running_measured and best.measured_ms is not None else min_gain
    return running_ms > best.expected_ms * (1.0 + gain)


def worth_leaving(choice: Choice | None, running_key: tuple, running_ms: float, min_gain: float) -> Candidate | None:
    """The fastest candidate of the newest planning round other than the running plan (its
    `spec_key`), if what the running plan now measures (`running_ms`) makes it worth switching
    to (`worth_switching`); else None. A plan kept or resumed on an earlier measurement that
    has since grown slower was only looked at again by the periodic round, seconds later: in
    robot_two_edges a resumed single device measured 76 ms, then 85, for a whole round while
    the layer-wise plan was expected at 70."""
    if choice is None:
        return None
    other = next((c for c in choice.candidates if spec_key(c.spec, c.slab_rows) != running_key), None)
    return other if other is not None and worth_switching(running_ms, True, other, min_gain) else None


def resuming(choice: Choice, resume: MeasuredPlan | None, min_gain: float) -> Choice:
    """`choice`, or the measured plan `resume` that ran last under the parameters just set again
    (`PlanMemory.resumable`) while `choice.best` is not worth switching to from it. Without this
    every return of the parameters was a fresh search that tried each plan predicted a little
    faster than the measured best for a few requests: in the benchmark, which sets the
    product's parameters at the start of each round, most of a round in one run of three."""
    if resume is None:
        return choice
    key = spec_key(resume.spec, resume.slab_rows)
    if spec_key(choice.best.spec, choice.best.slab_rows) == key:
        return choice
    again = choice.by_key.get(key)
    if again is None or worth_switching(again.expected_ms, again.measured_ms is not None, choice.best, min_gain):
        return choice
    return Choice(again, choice.best, choice.candidates)


def streaming_twin(choice: Choice | None, spec: PlanSpec, slab_rows: int, measured_ms: float, *,
                   whole: int, streamed: int, measured: Collection[tuple], min_gain: float) -> Candidate | None:
    """The running plan (`spec`, `slab_rows`) with its input sent the other way - the whole
    image in one slab if it streams, in `streamed`-row slabs if it does not - when that twin is
    worth a trial: no measurement of it (`measured`: `spec_key`s with one) and the newest
    round (`choice`) predicting it within `min_gain` of what the running plan measures
    (`measured_ms`), as a prediction and as corrected by the model's error on these nodes.

    Between the two the model cannot choose: it prices each slab's extra runs from isolated
    per-op calls, which put ResNet-18's streamed single device 1-2 % over its whole image,
    while the executor measured 8 % (short runs of the first layers, rows copied together) and
    streaming hides a link of a few ms; which wins moves with the machine's speed. Measured,
    the faster of the two is kept (`Candidate.expected_ms`), as between any two plans."""
    if choice is None or streamed >= whole:
        return None
    twin_key = spec_key(spec, whole if slab_rows < whole else streamed)
    if twin_key in measured:
        return None
    twin = choice.by_key.get(twin_key)
    if twin is None or max(twin.predicted_ms, twin.expected_ms) > measured_ms * (1.0 + min_gain):
        return None
    return twin


def measured_return(choice: Choice | None, measured: Mapping[tuple, MeasuredPlan], running_key: tuple,
                    running_ms: float, min_gain: float) -> Candidate | None:
    """The fastest plan that measured lately (`measured`, by `spec_key`) and is a candidate of
    the newest round (`choice`, for its prediction), when the running plan (`running_key`,
    measuring `running_ms`) is worth leaving for it (`worth_switching`, both measured); else
    None. Going back to what users measured needs no search: a twin that measured worse in
    its trial, or a plan tried on a prediction that measured worse than the one it replaced,
    went back only after a full planning round, which on a slow machine outlasted the
    benchmark's rounds (`robot_two_edges` ran such plans for whole rounds)."""
    if choice is None:
        return None
    seen = [dataclasses.replace(c, measured_ms=measured[k].ms) for k, c in choice.by_key.items()
            if k in measured and k != running_key]
    best = min(seen, key=lambda c: c.expected_ms, default=None)
    return best if best is not None and worth_switching(running_ms, True, best, min_gain) else None


def simpler_margin(simpler: Candidate, fastest: Candidate, margin: float) -> float:
    """How much slower than the `fastest` candidate a candidate of a `simpler` strategy may be
    expected and still be chosen. `margin` while the fastest is only predicted: a plan with
    more nodes and messages has more ways to be slower than predicted. Once it has measured,
    that risk is gone: half the margin against a measured simpler plan (two measurements: the
    same margin as `worth_switching`), none against a predicted one. With the full margin
    robot_two_edges chose the edge device alone, measured 86 ms, over the layer-wise plan it
    had measured at 80 ms."""
    if fastest.measured_ms is None:
        return margin
    return measured_margin(margin) if simpler.measured_ms is not None else 0.0


def spec_key(spec: PlanSpec, slab_rows: int) -> tuple:
    """A plan's identity for remembering what it measured: strategy, nodes, cuts, shares to 0.05
    (the scheduler's shares move a little from proposal to proposal: still the same plan) and
    the input slab size."""
    return (spec.strategy, spec.node_ids, spec.cuts,
            tuple(tuple(round(20 * x / (sum(row) or 1.0)) for x in row) for row in spec.segment_shares),
            int(slab_rows))


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
    """Stripes over the nodes of `node_ids` with a positive share: the cost model's cuts (first),
    the same with every solo tail, no cuts, and every cut."""
    pairs = [(n, float(x)) for n, x in zip(node_ids, normalise_shares(shares, len(node_ids))) if x > 0]
    if len(pairs) < 2:
        return []
    ids = tuple(n for n, _ in pairs)  # a node without a share is not part of the plan
    norm = tuple(x for _, x in pairs)
    dp_cuts, _ = choose_cuts(graph, norm, costs.for_nodes(ids), None)
    fastest = min(range(len(ids)), key=lambda i: (costs.profiles[ids[i]].trunk_ms, i))
    out = [PlanSpec.stripes(ids, norm, dp_cuts)]
    out += [PlanSpec.stripes(ids, norm, dp_cuts[:t], solo_from=t, solo_node=fastest)
            for t in range(len(dp_cuts), 0, -1)]
    out += [PlanSpec.stripes(ids, norm, ()), PlanSpec.stripes(ids, norm, graph.cut_values)]
    unique: dict = {}
    for spec in out:
        unique.setdefault((spec.cuts, spec.segment_shares), spec)
    return list(unique.values())


def _subsets(ids: tuple[str, ...]) -> list[tuple[str, ...]]:
    if len(ids) <= MAX_SUBSET_NODES:
        return [c for k in range(len(ids), 1, -1) for c in itertools.combinations(ids, k)]
    return [ids]


def _layerwise_quick_ms(graph: ModelGraph, first: str, second: str, cut: int, costs: Costs) -> float:
    """Layer-wise latency without overlap: a quick ranking before the simulator sees the best."""
    a, b = costs.profiles[first], costs.profiles[second]
    full = [op.out_shape[1] for op in graph.ops]
    c, h, w = graph.value_shapes[cut]
    ci, hi, wi = graph.value_shapes[0]
    return (costs.link("coordinator", first).ms(ci * hi * wi) + sum(a.op_costs[j].ms(full[j]) for j in range(cut))
            + costs.link(first, second).ms(c * h * w * 4)
            + sum(b.op_costs[j].ms(full[j]) for j in range(cut, len(full)))
            + costs.link(second, "coordinator").ms(graph.output_values_sent * 4))


def owning_shares(graph: ModelGraph, shares: Sequence[float]) -> tuple[float, ...]:
    """`shares` renormalised so that every positive share owns at least one trunk-output row.

    Rows are whole, so a share below the row granularity (a newcomer's probe share, a very slow
    node) would round to nothing: that node would get no work and send no telemetry, and the
    scheduler would never see it warm up or speed up again. Such a share is doubled (then all
    renormalised) until it owns a row."""
    h = graph.trunk_output_shape[1]
    out = normalise_shares(shares, len(shares))
    for _ in range(20):
        rows = split_rows(h, out)
        starved = [i for i, x in enumerate(out) if x > 0 and rows[i][0] >= rows[i][1]]
        if not starved or sum(1 for x in out if x > 0) > h:
            break
        raised = [x * 2 if i in starved else x for i, x in enumerate(out)]
        out = tuple(x / sum(raised) for x in raised)
    return out


def _share_vectors(graph: ModelGraph, ids: tuple[str, ...], costs: Costs, shares: Sequence[float] | None,
                   adapt_shares: bool) -> list[tuple[float, ...]]:
    """Share vectors (aligned with `ids`) for stripes: the given ones (every positive share
    owning rows), and with `adapt_shares` measured speed ** gamma over every subset of two or
    more nodes."""
    out: list[tuple[float, ...]] = []
    if shares is not None and sum(shares) > 0:
        out.append(owning_shares(graph, shares))
    if adapt_shares or shares is None:
        for subset in _subsets(ids):
            for gamma in GAMMAS:
                sub = speed_shares(subset, costs, gamma)
                out.append(tuple(sub[subset.index(n)] if n in subset else 0.0 for n in ids))
    return out


def choose_plan(graph: ModelGraph, node_ids: Sequence[str], costs: Costs, *, slab_rows: int,
                strategy: str = "auto", shares: Sequence[float] | None = None,
                adapt_shares: bool = True, margin: float = 0.0,
                measured: Mapping[tuple, MeasuredPlan] | None = None,
                earlier_errors: Mapping[frozenset, float] | None = None,
                whole_image: bool = True) -> Choice:
    """The fastest predicted candidate (ValueError when no node has a profile) - or, when the
    best of a simpler strategy (single < layerwise < stripes) is predicted within `margin` of
    it, that one: a plan with more nodes and messages has more ways to be slower than
    predicted, so it must promise a clear gain (less once it measured: `simpler_margin`).

    Every single-node plan is simulated; of the layer-wise ones the `LAYERWISE_SIMULATED` best
    by a quick estimate without overlap; of the stripes the cost model's cuts for every share
    vector, then every cut variant of the `SHARE_VECTORS_REFINED` best vectors (and always of
    the given shares). `shares` align with `node_ids` (e.g. the scheduler's).

    Streaming is a choice too: the `SLAB_REFINED` best candidates are also predicted with the
    whole image in one slab (streaming overlaps a slow input link with compute, but every slab
    means more, shorter runs: a fast device on a fast link can be better off without it);
    `whole_image` False keeps every plan at `slab_rows`.

    `measured` maps `spec_key`s of plans that ran lately to their `MeasuredPlan`:
    those plans are candidates too (if their strategy, nodes and slab size fit), and every candidate with a
    measured latency is compared by it rather than by its prediction.

    `earlier_errors` maps a set of nodes computing at once to the measured / predicted latency
    of the plan that ran on them last, also where that measurement no longer counts as a
    latency (a node of it changed speed since): what the model misses on a set of nodes - cores
    they share, per-message costs - is a property of the machine, not of a node's speed. A set
    without a current measurement takes it."""
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGY_CHOICES)}, got {strategy!r}")
    ids = tuple(n for n in node_ids if n in costs.profiles)
    given = None
    if shares is not None:
        table = dict(zip(node_ids, shares))
        given = [float(table.get(n, 0.0)) for n in ids]
    cands: dict[tuple, Candidate] = {}

    measured = measured or {}
    # error key (or the number of nodes at once, or _LAYERWISE) -> measured / predicted
    errors: dict[frozenset | int | str, float] = {}
    active_of: dict[tuple, frozenset] = {}  # candidate key -> its error key (the nodes it keeps busy)

    def model_error(active: frozenset) -> float:
        if active in errors:
            return errors[active]
        if _is_layerwise_key(active):
            # an untried layer-wise plan misses as the layer-wise plans that ran did, else as
            # the single-node plans (one node computing at a time), not as the splits
            return errors.get(_LAYERWISE, errors.get(1, 1.0))
        if len(active) in errors:
            return errors[len(active)]
        # more nodes at once miss at least as much as fewer did (more contention)
        fewer = [errors[k] for k in errors if isinstance(k, int) and 2 <= k < len(active)]
        if fewer or len(active) < 2:
            return max(fewer, default=1.0)
        # a split over fewer nodes than any that ran: the nearest larger split's error is the
        # best evidence of what splitting costs here (1.0 sent the search through every
        # untried pair after a three-node split had measured 1.5x its prediction)
        larger = [k for k in errors if isinstance(k, int) and k > len(active)]
        return errors[min(larger)] if larger else 1.0

    def evaluate(spec: PlanSpec, slab: int = slab_rows) -> float:
        key = spec_key(spec, slab)
        if key not in cands:
            plan = build_plan(graph, spec, slab_rows=slab)
            active = plan.active_nodes()
            active_of[key] = error_key(spec, active)
            if spec.strategy != "single" and len(active) < 2:
                ms = math.inf  # rows too few to split: a single-node plan under another name
            elif any(n not in costs.profiles for n in active):
                ms = math.inf
            else:
                ms = simulate(graph, plan, costs).latency_ms
            seen = measured.get(key)
            label = spec.describe(graph) + (", whole image" if slab >= whole else "")
            cands[key] = Candidate(spec, ms, label, seen.ms if seen is not None and math.isfinite(ms) else None,
                                   slab, model_error(active_of[key]))
        return cands[key].expected_ms

    whole = graph.input_shape[1]
    # the slab sizes the parameters allow: the one set, and the whole image where that may be chosen
    slabs = {min(slab_rows, whole), whole} if whole_image else {min(slab_rows, whole)}
    for spec, slab, _ in measured.values():
        if strategy not in ("auto", spec.strategy) or not set(spec.node_ids) <= set(ids):
            continue
        if min(slab, whole) not in slabs:
            # it ran under another slab_rows: a user who set 64 rows got the plan of 8-row slabs
            # back, because it measured faster than the whole image was predicted under load
            continue
        if spec.strategy == "stripes" and not adapt_shares:
            # fixed shares: only stripes by those shares (the search builds them, and they get
            # their measurement through their key); one that ran with other shares is no candidate
            continue
        evaluate(spec, slab)
    # The model's error on the plans that ran, per set of nodes computing at once (what the
    # model misses most - nodes contending for shared cores, a slow path - depends on which
    # nodes work together), else per number of such nodes (or fewer, for more nodes at once):
    # unmeasured plans are expected to miss as badly as the worst of those did, so an
    # optimistic model does not send the search from one untried plan (or pair of nodes) to
    # the next: the model ranks plans on the same nodes less well than it ranks nodes (with
    # the median, the search still went through eight stripes plans over the same two nodes).
    by_nodes: dict[frozenset | int | str, list[float]] = {}
    for key, c in cands.items():
        if c.measured_ms is not None and math.isfinite(c.predicted_ms) and c.predicted_ms > 0:
            nodes = active_of[key]
            by_nodes.setdefault(nodes, []).append(c.measured_ms / c.predicted_ms)
            by_nodes.setdefault(_error_group(nodes), []).append(c.measured_ms / c.predicted_ms)
    for nodes, ratio in (earlier_errors or {}).items():
        if nodes not in by_nodes and math.isfinite(ratio) and ratio > 0:
            by_nodes[nodes] = [ratio]
            by_nodes.setdefault(_error_group(nodes), []).append(ratio)
    errors.update({k: min(MODEL_ERROR_MAX, max(1.0 / MODEL_ERROR_MAX, *v)) for k, v in by_nodes.items()})

    if strategy in ("auto", "single"):
        for n in ids:
            evaluate(PlanSpec.single(n))
    if strategy in ("auto", "layerwise"):
        quick = sorted((_layerwise_quick_ms(graph, a, b, cut, costs), a, b, cut)
                       for a, b in itertools.permutations(ids, 2) for cut in graph.cut_values)
        for _, a, b, cut in quick[:LAYERWISE_SIMULATED]:
            evaluate(PlanSpec.layerwise(a, b, cut))
    if strategy in ("auto", "stripes"):
        vectors = _share_vectors(graph, ids, costs, given, adapt_shares)
        first = []
        for k, vec in enumerate(vectors):
            specs = stripe_specs(graph, ids, vec, costs)
            if specs:
                first.append((evaluate(specs[0]), k, specs))
        first.sort()
        refine = first[:SHARE_VECTORS_REFINED] + [f for f in first if f[1] == 0 and given is not None]
        for _, _, specs in refine:
            for spec in specs[1:]:
                evaluate(spec)
    if whole_image and slab_rows < whole:
        for c in sorted((c for c in cands.values() if math.isfinite(c.expected_ms)),
                        key=lambda c: c.expected_ms)[:SLAB_REFINED]:
            evaluate(c.spec, whole)
    ok = [c for c in cands.values() if math.isfinite(c.predicted_ms)]
    if not ok and strategy in ("layerwise", "stripes"):
        # a forced layer-wise or stripes plan needs two nodes: with one left it runs everything
        for n in ids:
            evaluate(PlanSpec.single(n))
        ok = [c for c in cands.values() if math.isfinite(c.predicted_ms)]
    if not ok:
        raise ValueError(f"no plan for strategy {strategy!r}: no node of {list(node_ids)} has a cost profile")
    # fastest first; ties: simpler strategies first, then fewer segments
    order = {"single": 0, "layerwise": 1, "stripes": 2}
    ok.sort(key=lambda c: (c.expected_ms, order[c.spec.strategy], len(c.spec.cuts)))
    best = ok[0]
    for c in ok:  # the simplest strategy within `margin` of the fastest
        if order[c.spec.strategy] < order[best.spec.strategy] and \
                c.expected_ms <= ok[0].expected_ms * (1 + simpler_margin(c, ok[0], margin)):
            best = c
    other = [c for c in ok if c.spec.strategy != best.spec.strategy]
    runner_up = other[0] if other else next((c for c in ok if c is not best), None)
    return Choice(best, runner_up, tuple(ok))
