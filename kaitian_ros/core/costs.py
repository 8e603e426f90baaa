"""Measured costs: what each device takes per trunk op, and what each link takes per byte.

Pure values and estimators (time comes in as arguments; nothing here reads a clock):

* `OpCost` - one op's time as ``call_ms + row_ms * rows`` per call, fitted from timed calls;
* `DeviceProfile` - a compute node's costs for one model and input size, emulated slowdown
  included (what it publishes on ``/kaitian/profiles``), checked by `profile_problem`;
* `CostRefiner` - folds the times of live runs (and idle probes) into a profile: per op and for
  the device as a whole, the ratio of measured to predicted time;
* `LinkMeter` / `LinkEstimate` - a link's rate and latency from the chunks it really delivered;
* `Costs` - the planner's view of all of it (`cost_model.PlanCosts` for a node order).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

# Plausibility limits of a published profile: beyond them a message is corrupt or forged, not
# a slow device (a whole trunk in over 10 minutes could not serve a camera anyway).
MAX_TRUNK_MS = 600_000.0
MAX_OP_MS = 600_000.0
MAX_LINK_BYTES_PER_MS = 1e9  # 1 TB/s
MAX_LINK_LATENCY_MS = 60_000.0


@dataclass(frozen=True)
class OpCost:
    """Time of one call of an op over `rows` output rows: ``call_ms + row_ms * rows``."""

    call_ms: float
    row_ms: float

    def ms(self, rows: int) -> float:
        return self.call_ms + self.row_ms * rows if rows > 0 else 0.0

    def scaled(self, factor: float) -> OpCost:
        return OpCost(self.call_ms * factor, self.row_ms * factor)


def fit_op_cost(samples: Sequence[tuple[int, float]]) -> OpCost:
    """Least-squares ``ms = call + row * rows`` over (rows, ms) samples, both terms >= 0."""
    pts = [(float(r), float(t)) for r, t in samples if r > 0 and math.isfinite(t) and t >= 0]
    if not pts:
        raise ValueError("no valid (rows, ms) samples")
    n = len(pts)
    mr = sum(r for r, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    var = sum((r - mr) ** 2 for r, _ in pts)
    if var <= 0:  # one row count: all of it per row
        return OpCost(0.0, mt / mr)
    row = sum((r - mr) * (t - mt) for r, t in pts) / var
    call = mt - row * mr
    if row <= 0:
        return OpCost(max(mt, 0.0), 0.0)
    if call < 0:
        return OpCost(0.0, sum(t for _, t in pts) / sum(r for r, _ in pts))
    return OpCost(call, row)


@dataclass(frozen=True)
class DeviceProfile:
    """A compute node's measured costs for one model and input (see module docstring).

    Every time includes the node's emulated slowdown exactly as the node applies it (rows are
    released at s x their compute time). `links` are the node's *incoming* links, measured from
    the chunks each sender delivered to it.
    """

    node_id: str
    version: int
    model: str  # `model_key(...)`: a profile is only valid for the model it was measured on
    device: str
    emulated_slowdown: float
    op_costs: tuple[OpCost, ...]
    trunk_ms: float  # the whole trunk, one call per op
    message_ms: float  # per received chunk, outside compute (decode, copy, bookkeeping)
    min_run_rows: int = 8  # the node's stripe executor defers runs shorter than this
    run_ms: float = 0.0  # the stripe executor's own bookkeeping per run (finding it, its rows)
    run_samples: int = 0  # live runs and probes folded in since start-up
    links: Mapping[str, LinkEstimate] = field(default_factory=dict)

    @property
    def emulated(self) -> bool:
        return self.emulated_slowdown != 1.0

    def op_ms(self, op: int, rows: int, run_rows: int) -> float:
        """`rows` rows of `op` in runs of about `run_rows` rows."""
        if rows <= 0:
            return 0.0
        c = self.op_costs[op]
        calls = -(-rows // max(1, run_rows))
        return calls * c.call_ms + rows * c.row_ms



def model_key(model: str, input_shape: Sequence[int]) -> str:
    return f"{model} {'x'.join(str(int(d)) for d in input_shape)}"


def profile_problem(p: DeviceProfile, *, n_ops: int, model: str, known_nodes: Sequence[str]) -> str:
    """'' when `p` is usable by a planner for `model` over `known_nodes`, else why not, as
    ``category: detail`` (categories: unknown node, wrong model, wrong op count, implausible
    value, bad link)."""
    who = f"profile of {p.node_id!r}"
    if p.node_id not in known_nodes:
        return f"unknown node: {who} (known: {', '.join(known_nodes)})"
    if p.model != model:
        return f"wrong model: {who} is for {p.model!r}, this graph runs {model!r}"
    if len(p.op_costs) != n_ops:
        return f"wrong op count: {who} has {len(p.op_costs)} op costs, the trunk has {n_ops} ops"

    def implausible(what: str, value: object) -> str:
        return f"implausible value: {who}: {what} {value!r}"

    if not (math.isfinite(p.emulated_slowdown) and 1.0 <= p.emulated_slowdown <= 1e3):
        return implausible("emulated_slowdown", p.emulated_slowdown)
    if not (math.isfinite(p.trunk_ms) and 0.0 < p.trunk_ms <= MAX_TRUNK_MS):
        return implausible("trunk_ms", p.trunk_ms)
    if not (math.isfinite(p.message_ms) and 0.0 <= p.message_ms <= MAX_OP_MS):
        return implausible("message_ms", p.message_ms)
    if not 1 <= p.min_run_rows <= 1_000_000:
        return implausible("min_run_rows", p.min_run_rows)
    if not (math.isfinite(p.run_ms) and 0.0 <= p.run_ms <= MAX_OP_MS):
        return implausible("run_ms", p.run_ms)
    for j, c in enumerate(p.op_costs):
        for name, v in (("call_ms", c.call_ms), ("row_ms", c.row_ms)):
            if not (math.isfinite(v) and 0.0 <= v <= MAX_OP_MS):
                return implausible(f"op {j} {name}", v)
    if sum(c.call_ms + c.row_ms for c in p.op_costs) <= 0:
        return f"implausible value: {who}: every op costs nothing"
    for src, link in p.links.items():
        if not src:
            return f"bad link: {who}: a link with no sender"
        if not (math.isfinite(link.bytes_per_ms) and 0.0 < link.bytes_per_ms <= MAX_LINK_BYTES_PER_MS):
            return f"bad link: {who}: link from {src} rate {link.bytes_per_ms!r}"
        if not (math.isfinite(link.latency_ms) and 0.0 <= link.latency_ms <= MAX_LINK_LATENCY_MS):
            return f"bad link: {who}: link from {src} latency {link.latency_ms!r}"
    return ""


# --------------------------------------------------------------------------- live refinement
@dataclass
class CostRefiner:
    """Turns a start-up profile into a current one: the start-up costs give each op's share of
    the work, what the node really takes scales them all.

    Live work: the device time of a request's feeds (runs and bookkeeping on the node's device
    clock, the emulated slowdown applied; not publishing) against the start-up cost of the runs
    they computed, once per request. The EWMA of the two sums is the device ratio. Device time,
    not wall time: on cores shared with other processes a node also waits for a core, more so
    while a plan keeps every node busy at once, and a ratio learnt under one plan would price
    every other plan as slow (the coordinator's measured plan latencies carry that wait). Per-op
    ratios are not kept: a single run's time is too noisy for that, a request's is not. A
    request whose runs cost less than `min_feed_ms` at start-up says little about the device:
    its feeds' fixed costs (decoding bookkeeping, interval algebra over every op) dominate, and
    a node running a layer-wise tail of a few small ops read as 2.5x slower than it is. Two
    requests in a row at more than `jump` times the current ratio (either way) are a device
    that changed speed: the EWMA starts over from them instead of taking several requests to
    follow; one such request alone is held back and, unless the next one confirms it, folded
    in as usual.

    Idle probes: a node with nothing to compute times a few ops now and then. Probes see other
    conditions than live feeds (an idle node has its core and caches to itself), so a probe
    does not set the ratio; what moves it is the probe level's *drift* since the last live
    feed: a device that got faster or slower while idle (throttling, another workload, a new
    emulated slowdown) shows it without being given work first. A new speed the live feeds
    saw moves the level the probes are expected at by the same factor (it is no drift). Other
    processes on the same cores only ever make a probe slower, so the level is the *fastest* of the last
    `probe_window` probes, and it moves only past `probe_deadband`: a device that really slowed
    down shows it once a whole window of probes was slow, one that got faster at once. Measured
    on the 2-core benchmark machine while the other nodes computed: single probes 0.8x to 4x
    their start-up time, the fastest of five up to 1.6x for seconds on end (shared caches and
    memory bandwidth slow the CPU time itself) - hence a deadband of 2: the changes probes are
    for (a device 3x slower or faster, an emulated slowdown set live) pass it.
    """

    base: tuple[OpCost, ...]
    run_ms: float = 0.0  # start-up bookkeeping cost per run
    min_feed_ms: float = 0.0  # requests whose runs cost less at start-up are not folded in
    alpha: float = 0.3
    jump: float = 2.0
    held: tuple[float, float] | None = None  # a request far from the ratio, awaiting the next
    probe_deadband: float = 2.0
    probe_window: int = 5
    measured_ms: float = 0.0  # EWMA of feed wall times
    predicted_ms: float = 0.0  # EWMA of the start-up costs of the same feeds
    feed_probe_ref: float = 1.0  # probe level at the last live feed
    live_samples: int = 0
    probe_ratio: float = 1.0  # level of probe time / its start-up time
    recent_probes: list[float] = field(default_factory=list)
    probe_samples: int = 0

    @property
    def samples(self) -> int:
        return self.live_samples + self.probe_samples

    def predicted_run_ms(self, op: int, rows: int) -> float:
        return self.base[op].ms(rows) + self.run_ms

    def observe_feed(self, measured_ms: float, predicted_ms: float) -> None:
        """Feeds (a request's, or one) took `measured_ms`; their runs cost `predicted_ms` at
        start-up."""
        if predicted_ms <= 0 or predicted_ms < self.min_feed_ms or not math.isfinite(measured_ms) \
                or measured_ms < 0:
            return
        self.live_samples += 1
        probes_moved, self.feed_probe_ref = self.feed_probe_ref != self.probe_ratio, self.probe_ratio
        if self.live_samples == 1 or probes_moved:
            # first feed, or the first since probes saw the device change: start from here
            self.measured_ms, self.predicted_ms, self.held = measured_ms, predicted_ms, None
            return
        ratio, now = measured_ms / predicted_ms, self.measured_ms / self.predicted_ms
        if abs(math.log(ratio / now)) > math.log(self.jump):
            held = self.held
            if held is not None and (held[0] / held[1] > now) == (ratio > now):
                # the second request in a row far from the ratio, the same way: a new speed
                self.measured_ms, self.predicted_ms = held[0] + measured_ms, held[1] + predicted_ms
                self.held = None
                # the probes will see the new speed too: move their expected level with it, or
                # the first idle window after a change seen live counted it a second time (a
                # node slowed 3x while computing read 9x, and back at 1x still 3x)
                moved = (self.measured_ms / self.predicted_ms) / now
                self.probe_ratio *= moved
                self.feed_probe_ref *= moved
                self.recent_probes = []  # taken at the old speed
            else:  # held back: noise unless the next request confirms it
                self.held = (measured_ms, predicted_ms)
            return
        for m, p in ([self.held] if self.held is not None else []) + [(measured_ms, predicted_ms)]:
            self.measured_ms = (1 - self.alpha) * self.measured_ms + self.alpha * m
            self.predicted_ms = (1 - self.alpha) * self.predicted_ms + self.alpha * p
        self.held = None

    def observe_probe(self, ms: float, base_ms: float) -> None:
        """A probe took `ms`; at start-up it took `base_ms`."""
        if base_ms <= 0 or not math.isfinite(ms) or ms <= 0:
            return
        self.recent_probes = (self.recent_probes + [ms / base_ms])[-self.probe_window:]
        self.probe_samples += 1
        if len(self.recent_probes) < self.probe_window:
            return
        level = min(self.recent_probes)
        if abs(math.log(level / self.probe_ratio)) > math.log(self.probe_deadband):
            self.probe_ratio = level

    @property
    def device_ratio(self) -> float:
        if self.live_samples == 0 or self.predicted_ms <= 0:
            return self.probe_ratio
        return self.measured_ms / self.predicted_ms * self.probe_ratio / self.feed_probe_ref

    def current(self) -> tuple[OpCost, ...]:
        r = min(50.0, max(0.02, self.device_ratio))
        return tuple(c.scaled(r) for c in self.base)

    def current_run_ms(self) -> float:
        return self.run_ms * min(50.0, max(0.02, self.device_ratio))


def next_probe_period(period_s: float, base_s: float, max_s: float, level_moved: bool) -> float:
    """The idle probes' next period: `base_s` again after a probe that moved the probe level
    (`CostRefiner.observe_probe`: the device changed speed while idle, so the next probes
    should come soon), else twice the last period, up to `max_s` (no backoff where `max_s` is
    not above `base_s`). At 0.1 s each idle node spent about 10 % of a core on its probes on
    the 2-core benchmark machine, beside the node that computes (docs/planner.md)."""
    if level_moved or max_s <= base_s:
        return base_s
    return min(max_s, 2.0 * period_s)


# --------------------------------------------------------------------------- links
@dataclass(frozen=True)
class LinkEstimate:
    bytes_per_ms: float
    latency_ms: float
    samples: int = 0

    def ms(self, nbytes: float) -> float:
        return self.latency_ms + (nbytes / self.bytes_per_ms if nbytes > 0 else 0.0)


@dataclass
class LinkMeter:
    """One sender's link to this receiver, from the chunks it delivered.

    A chunk that arrived later after the previous one than it was sent after it (its arrival
    gap more than twice its send gap) was held up by the link: it streamed in behind the
    previous one, and while chunks do that the link is busy. The bytes of such a run of chunks
    after its first one, over the time from its first arrival to its last, are the rate. Both
    times are the receiver's and both gaps are differences on one clock, so the rate does not
    depend on the hosts' clocks agreeing; chunks the sender spaced out (halo rows sent as they
    are computed) say nothing about the rate and start a new run. A receiver busy computing
    stamps some arrivals late, which moves single runs either way: the rate is the median of the
    last `window` runs. The latency is the lowest ``transit - bytes / rate`` of runs' first
    chunks, comparing the sender's clock (source timestamp) with the receiver's: across hosts as
    good as their synchronisation (NTP). Without any timed run, a chunk of at least
    `min_single_bytes` gives bytes over its whole transit (latency included: on the safe side);
    with only smaller chunks the link counts as unmeasured.
    """

    window: int = 16
    min_bytes: int = 4096  # runs carrying less after their first chunk are not timed
    min_single_bytes: int = 16384
    last_sent_s: float = -math.inf
    last_arrival_s: float = -math.inf
    first_arrival_s: float = 0.0
    bytes_after_first: int = 0
    run_rated: bool = False  # the current run has its entry in `rates`
    rates: list[float] = field(default_factory=list)  # bytes/ms per run
    firsts: list[tuple[float, float]] = field(default_factory=list)  # runs' first chunks: (bytes, ms)
    samples: int = 0

    def observe(self, nbytes: int, sent_s: float, arrived_s: float) -> None:
        if not (math.isfinite(sent_s) and math.isfinite(arrived_s)) or nbytes <= 0 or arrived_s <= sent_s:
            return
        self.samples += 1
        send_gap, arrival_gap = sent_s - self.last_sent_s, arrived_s - self.last_arrival_s
        self.last_sent_s, self.last_arrival_s = sent_s, max(arrived_s, self.last_arrival_s)
        if not (arrival_gap > 0 and send_gap < 0.5 * arrival_gap):  # onto an idle link: a new run
            self.first_arrival_s, self.bytes_after_first, self.run_rated = arrived_s, 0, False
            self.firsts = (self.firsts + [(float(nbytes), (arrived_s - sent_s) * 1e3)])[-self.window:]
            return
        self.bytes_after_first += nbytes
        span_ms = (arrived_s - self.first_arrival_s) * 1e3
        if self.bytes_after_first < self.min_bytes or span_ms <= 0:
            return
        rate = self.bytes_after_first / span_ms
        if self.run_rated:
            self.rates[-1] = rate  # the run's newest chunk: its longest span
        else:
            self.rates = (self.rates + [rate])[-self.window:]
            self.run_rated = True

    def estimate(self) -> LinkEstimate | None:
        big = [(b, t) for b, t in self.firsts if b >= self.min_single_bytes]
        if self.rates:
            rate = min(MAX_LINK_BYTES_PER_MS, statistics.median(self.rates))
        elif big:
            rate = min(MAX_LINK_BYTES_PER_MS, max(b / t for b, t in big))
        else:
            return None
        latency = min((t - b / rate for b, t in self.firsts), default=0.0)
        return LinkEstimate(rate, min(MAX_LINK_LATENCY_MS, max(0.0, latency)), self.samples)


# --------------------------------------------------------------------------- planner view
COORDINATOR = "coordinator"
DIRECT_LINK_FLOOR = 0.5  # a node-to-node rate below this x its measured legs' is not believed
# A link to or from the coordinator measured below this x the other direction's rate is not
# believed: a receiver whose interpreter was busy stamped the chunks late (below)
REVERSE_LINK_FLOOR = 0.1


MAX_METERED_SENDERS = 64  # links metered per receiver: anyone can name a producer


def observe_link(meters: dict[str, LinkMeter], sender: str, nbytes: int, sent_s: float, arrived_s: float) -> None:
    """Feed `sender`'s meter in `meters`, made on its first chunk (up to MAX_METERED_SENDERS)."""
    meter = meters.get(sender)
    if meter is None and len(meters) < MAX_METERED_SENDERS:
        meter = meters[sender] = LinkMeter()
    if meter is not None:
        meter.observe(nbytes, sent_s, arrived_s)


@dataclass(frozen=True)
class Costs:
    """Everything measured, as a planner reads it.

    `profiles` by node id; `links` by (sender, receiver) - the coordinator is ``coordinator``.
    An unmeasured link between two compute nodes is taken as the slower of the two legs through
    the coordinator's host (sender -> coordinator, coordinator -> receiver) with both
    latencies, which is what it is in a star topology (a robot and edge boxes on one access
    point); an unmeasured leg is `link_prior`.
    """

    profiles: Mapping[str, DeviceProfile]
    links: Mapping[tuple[str, str], LinkEstimate]
    link_prior: LinkEstimate
    slab_rows: int = 8  # the coordinator's input slabs: runs are rarely shorter
    pre_ms: float = 0.0  # coordinator: image received -> preprocessed, ready to send
    post_ms: float = 0.0  # coordinator: last output chunk received -> result published
    send_ms_per_mb: float = 0.0  # publishing cost per MB of chunk payload (every sender)

    def link(self, src: str, dst: str) -> LinkEstimate:
        got = self.links.get((src, dst))
        if src == COORDINATOR or dst == COORDINATOR:
            back = self.links.get((dst, src))
            if got is None:
                # e.g. a pooled head's outputs: a few kB per request, too small to time a rate
                # (LinkMeter.min_single_bytes); the other direction's measurement beats the prior
                return back if back is not None else self.link_prior
            if back is not None and got.bytes_per_ms < REVERSE_LINK_FLOOR * back.bytes_per_ms:
                # The coordinator measured a remote device's output chunks at 5-8 Mbit/s on a
                # 200 Mbit/s link whose other direction the device measured at 150-250: chunks
                # sent back to back and stamped on arrival only once the coordinator's busy
                # interpreter got to them. That priced the device alone at 150-220 ms (it ran in
                # 40) whenever its measurement lapsed, and sent the search to worse plans.
                # Links of robots and edge boxes are not 10x asymmetric: the other direction's
                # rate stands (with this direction's latency).
                return LinkEstimate(back.bytes_per_ms, got.latency_ms, got.samples)
            return got
        up, down = self.links.get((src, COORDINATOR)), self.links.get((COORDINATOR, dst))
        legs = LinkEstimate(min((up or self.link_prior).bytes_per_ms, (down or self.link_prior).bytes_per_ms),
                            (up or self.link_prior).latency_ms + (down or self.link_prior).latency_ms)
        if got is None:
            return legs
        if up is not None and down is not None and got.bytes_per_ms < DIRECT_LINK_FLOOR * legs.bytes_per_ms:
            # Traffic between two compute nodes is sparse, small halo chunks, and a receiver
            # stamps a chunk when its busy interpreter gets to it: measured here as 1 kB/ms on
            # links whose legs both carried 12 kB/ms. A direct rate far below what both legs
            # measured is that delay, not the link, and would keep the planner off the link for
            # good (nothing then corrects it): the legs' estimate stands.
            return legs
        return got

    def for_nodes(self, node_ids: Sequence[str]) -> NodeCosts:
        missing = [n for n in node_ids if n not in self.profiles]
        if missing:
            raise ValueError(f"no cost profile for {missing}")
        return NodeCosts(self, tuple(node_ids))

    def with_links_from_profiles(self) -> Costs:
        """Merge each profile's incoming links into `links` (the receiver measured them)."""
        merged = dict(self.links)
        for dst, p in self.profiles.items():
            for src, est in p.links.items():
                merged.setdefault((src, dst), est)
        return replace(self, links=merged)


@dataclass(frozen=True)
class NodeCosts:
    """`cost_model.PlanCosts` over a fixed node order."""

    costs: Costs
    node_ids: tuple[str, ...]

    def op_ms(self, node: int, op: int, rows: int) -> float:
        p = self.costs.profiles[self.node_ids[node]]
        return p.op_ms(op, rows, max(p.min_run_rows, self.costs.slab_rows))

    def transfer_ms(self, src: int, dst: int, nbytes: float) -> float:
        return self.costs.link(self.node_ids[src], self.node_ids[dst]).ms(nbytes)
