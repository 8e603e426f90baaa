"""Adaptive batch split for heterogeneous data-parallel training (docs/training.md).

Every epoch has one deterministic permutation of the dataset, a pure function of
(seed, epoch), so every rank computes the same one without communication. It is cut into
consecutive global batches of ``global_batch`` samples (the last one may be short) and
each global batch into contiguous per-rank slices sized by the current shares. Hence every
sample is used exactly once per epoch whatever the shares are, and the union of the
slices of a step is the same batch a single process would train on.

Shares come from measured speed: every ``rebalance_every`` steps the ranks all-gather
their step-time model and each computes the same new shares from the same gathered
vector with a pure function -- no coordinator. The model of rank r is
``t_r(b) = c_r * (b + beta_r)``: a per-sample cost ``c_r`` (EWMA, follows drift) and a
fixed per-step cost expressed in samples, ``beta_r = a_r / c_r`` (least squares of
``t = a + c b`` over recent steps of different batch sizes, exponentially forgotten).
Writing the fixed cost in samples makes it invariant when a device becomes uniformly
slower (all of ``a`` and ``c`` scale), so drift only moves the fast EWMA. Shares then
equalise the finish times including the fixed cost (:func:`shares_from_model`); with
``beta = 0`` (no batch-size spread measured yet, or ``model="proportional"``) they are
proportional to speed (:func:`shares_from_times`), as in KAITIAN.

Policies: ``equal`` (plain DDP split, never rebalanced), ``profile_once`` (rebalanced once
after the first ``rebalance_every`` steps, then frozen, like KAITIAN's profiling run) and
``adaptive`` (rebalanced every ``rebalance_every`` steps, follows drift).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

POLICIES = ("adaptive", "equal", "profile_once")
MODELS = ("affine", "proportional")  # step time a + c b, or c b


def shares_from_times(seconds_per_sample: Sequence[float]) -> tuple[float, ...]:
    """Shares proportional to speed (1 / seconds per sample), summing to 1.

    Ranks without a measurement (``nan``/``<= 0``, e.g. they had empty slices so far) get
    the mean speed of the measured ones, so they are probed rather than starved forever.
    """
    t = np.asarray(seconds_per_sample, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no ranks")
    ok = np.isfinite(t) & (t > 0)
    if not ok.any():
        return tuple([1.0 / t.size] * t.size)
    speed = _speeds(t, ok)
    s = speed / speed.sum()
    return tuple(float(x) for x in s)


def _speeds(seconds_per_sample: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """1 / seconds per sample; unmeasured ranks get the mean speed of the measured ones."""
    speed = np.zeros_like(seconds_per_sample)
    speed[measured] = 1.0 / seconds_per_sample[measured]
    speed[~measured] = speed[measured].mean()
    return speed


def shares_from_model(per_sample_s: Sequence[float], fixed_samples: Sequence[float],
                      global_batch: int) -> tuple[float, ...]:
    """Shares that make every rank finish a step of ``global_batch`` at the same time.

    Rank r takes ``c_r * (b_r + beta_r)`` seconds for ``b_r`` samples. Equal finish time T
    with ``sum b_r = B`` gives ``b_r = T / c_r - beta_r`` and ``T = (B + sum beta) /
    sum(1 / c)``. A rank whose fixed cost alone exceeds T (``b_r < 0``) is left out
    (share 0: it would only delay everyone) and T is recomputed for the others. Ranks
    without a measurement get the mean speed and mean fixed cost of the measured ones.
    """
    c = np.asarray(per_sample_s, dtype=np.float64)
    beta = np.asarray(fixed_samples, dtype=np.float64)
    if c.size == 0 or c.size != beta.size:
        raise ValueError("need one per-sample time and one fixed cost per rank")
    if global_batch <= 0:
        raise ValueError("global_batch must be positive")
    ok = np.isfinite(c) & (c > 0)
    if not ok.any():
        return tuple([1.0 / c.size] * c.size)
    speed = _speeds(c, ok)
    beta = np.where(np.isfinite(beta) & (beta > 0), beta, 0.0)
    beta[~ok] = beta[ok].mean()
    active = np.ones(c.size, dtype=bool)
    while True:
        t = (global_batch + beta[active].sum()) / speed[active].sum()
        b = np.where(active, t * speed - beta, 0.0)
        neg = active & (b < 0)
        if not neg.any():
            break
        active &= ~neg  # at least the fastest-finishing rank always stays
    s = np.clip(b, 0.0, None)
    s = s / s.sum()
    return tuple(float(x) for x in s)


def split_counts(batch: int, shares: Sequence[float], multiple: int = 1) -> tuple[int, ...]:
    """Integer slice sizes summing to ``batch``, proportional to ``shares``.

    Largest-remainder rounding: each rank gets ``floor(share * batch)`` plus at most one
    more, so a rank whose share is at least one sample never gets an empty slice; ties
    go to the lower rank so the result is deterministic.

    ``multiple``: where every rank's share is at least that many samples, the slices are
    split in units of ``multiple`` samples (the same rounding), and the ``batch % multiple``
    samples left over go to the largest share (the lowest rank among equals). Slices then take
    few distinct sizes while the shares wander with the measurements: every new size is a new
    input shape of the rank's last pass, and oneDNN builds its kernels for a shape the first
    time it sees it (1.6-1.9 ms for ``digits_cnn``'s forward and backward here, 5-6 ms on a
    rank emulating a device 3x slower).
    """
    if batch < 0:
        raise ValueError("negative batch")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    s = np.asarray(shares, dtype=np.float64)
    if s.size == 0 or (s < 0).any() or not np.isfinite(s).all() or s.sum() <= 0:
        raise ValueError(f"bad shares {list(shares)}")
    s = s / s.sum()
    if multiple > 1 and (s * batch).min() >= multiple:
        units = split_counts(batch // multiple, s)
        counts_m = [u * multiple for u in units]
        counts_m[int(np.argmax(s))] += batch % multiple
        return tuple(counts_m)
    exact = s * batch
    counts = np.floor(exact + 1e-9).astype(np.int64)  # 1e-9: 0.3*10 must floor to 3
    rest = batch - int(counts.sum())
    if rest > 0:
        frac = exact - counts
        order = sorted(range(s.size), key=lambda i: (-frac[i], i))
        for i in order[:rest]:
            counts[i] += 1
    elif rest < 0:  # only possible through the epsilon; take back from the largest
        order = sorted(range(s.size), key=lambda i: (-(counts[i] - exact[i]), i))
        for i in order[:-rest]:
            counts[i] -= 1
    return tuple(int(c) for c in counts)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The deterministic sample order of one epoch."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_samples)


@dataclass(frozen=True)
class StepSlice:
    """This rank's part of one global batch."""

    epoch: int
    step: int  # global step counter across epochs
    batch: tuple[int, ...]  # the whole global batch (work stealing moves the boundaries)
    offset: int  # start of this rank's slice inside the global batch
    local_batch: int
    global_batch: int
    counts: tuple[int, ...]  # slice size of every rank

    @property
    def indices(self) -> tuple[int, ...]:
        """This rank's planned slice of the global batch."""
        return self.batch[self.offset:self.offset + self.local_batch]


class AdaptiveBatchSampler:
    """Per-rank sampler; all ranks construct it with the same arguments except ``rank``.

    Drive it as: ``for sl in sampler.epoch(e): ...train...; sampler.record(compute_s,
    sl.local_batch, sl.global_batch)`` (optional: skip warm-up steps) ``;
    sampler.maybe_rebalance(gather)`` where ``gather(x)`` all-gathers this rank's
    ``(c, beta)`` estimate from every rank (rank order). Shares may change between steps of an epoch; the
    iterator reads them lazily, and coverage stays exact because the permutation and the
    global batch boundaries do not depend on shares.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int,
                 *, seed: int = 0, policy: str = "adaptive", rebalance_every: int = 10,
                 ewma_alpha: float = 0.5, drop_last: bool = False,
                 initial_shares: Sequence[float] | None = None,
                 model: str = "affine", fit_forget: float = 0.9, slice_multiple: int = 1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        if global_batch <= 0 or num_samples <= 0 or rebalance_every <= 0:
            raise ValueError("num_samples, global_batch, rebalance_every must be positive")
        if not 0 < ewma_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1]")
        if model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {model!r}")
        if not 0 < fit_forget <= 1:
            raise ValueError("fit_forget must be in (0, 1]")
        if slice_multiple < 1:
            raise ValueError(f"slice_multiple must be >= 1, got {slice_multiple}")
        # the equal split never moves, so its slice sizes stay few anyway: plain DDP's split
        self.slice_multiple = 1 if policy == "equal" else slice_multiple
        self.model, self.fit_forget = model, fit_forget
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size = rank, world_size
        self.seed, self.policy = seed, policy
        self.rebalance_every, self.ewma_alpha = rebalance_every, ewma_alpha
        self.drop_last = drop_last
        self.shares: tuple[float, ...] = (
            tuple(initial_shares) if initial_shares is not None
            else tuple([1.0 / world_size] * world_size))
        if len(self.shares) != world_size:
            raise ValueError("initial_shares needs one share per rank")
        self.step = 0  # global steps taken (advanced by the iterator)
        self.rebalances = 0
        self._since_rebalance = 0
        self._ewma: float = math.nan  # c: compute seconds per sample (beyond the fixed cost)
        self._beta: float = 0.0  # fixed per-step cost in samples (a / c)
        # per-sample cost of the epoch's short last batch over the full batches' c (EWMA)
        self._short_ratio: float = math.nan
        # seconds per sample of the first (warm-up) step: only for the provisional split
        self._warmup_per_sample: float = math.nan
        self._provisional_done = False
        # forgotten sums: w, w b, w t, w b^2, w b t, w t^2, w^2 (for the effective count)
        self._fit = np.zeros(7)
        self._fit_updates = 0
        # the (c, beta, short ratio) of every rank behind the current shares (short batches use it)
        self._gathered: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None = None

    # -- iteration -----------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def epoch(self, epoch: int, start_step_in_epoch: int = 0) -> Iterator[StepSlice]:
        perm = epoch_permutation(self.num_samples, self.seed, epoch)
        for k in range(start_step_in_epoch, self.steps_per_epoch()):
            batch = perm[k * self.global_batch:(k + 1) * self.global_batch]
            counts = split_counts(len(batch), self._shares_for(len(batch)), self.slice_multiple)
            sl = StepSlice(epoch=epoch, step=self.step, batch=tuple(int(i) for i in batch),
                           offset=sum(counts[:self.rank]), local_batch=counts[self.rank],
                           global_batch=len(batch), counts=counts)
            self.step += 1
            yield sl

    def _shares_for(self, batch: int) -> tuple[float, ...]:
        """Shares for a global batch of ``batch`` samples.

        ``self.shares`` equalise finish times for the full ``global_batch``. With fixed
        costs the balanced split depends on the batch size (``b_r = T/c_r - beta_r``), so a
        short batch (end of epoch) is split from the same gathered model at its own size;
        every rank holds the same gathered vector, so all compute the same counts. Where every
        rank has measured short batches, its per-sample cost there is ``c_r`` times its short
        ratio: the fixed cost is often too noisy to fit (then beta is 0), and the slow rank of
        a 1 : 0.33 run, given its full-batch share of the short batch, finished it 4-10 ms
        after the fast one on average (``compute`` configuration, docs/training.md).
        """
        m = self._gathered
        if batch >= self.global_batch or m is None:
            return self.shares
        times, betas, ratios = m
        if all(math.isfinite(r) and r > 0 for r in ratios):
            return shares_from_model([c * r for c, r in zip(times, ratios)], betas, batch)
        if not any(b > 0 for b in betas):
            return self.shares
        return shares_from_model(times, betas, batch)

    # -- measurement and rebalancing ---------------------------------------------------
    def record(self, compute_seconds: float, local_batch: int,
               global_batch: int | None = None) -> None:
        """Feed this rank's compute time of one step (without time blocked in comm).

        Every non-empty step feeds the fixed-cost fit (short end-of-epoch batches help:
        they spread the batch sizes). Steps of a short global batch do not feed the
        per-sample EWMA when ``global_batch`` is given (the shares are for full batches),
        except the first, when the EWMA has nothing else; they feed the short ratio (their
        per-sample cost over that EWMA), which splits the next short batch. A ratio, not a
        cost: short batches come once an epoch, and a device that slows down uniformly
        keeps its ratio while the EWMA follows it.
        """
        if local_batch <= 0 or not compute_seconds > 0:
            return  # no information about speed from an empty slice
        b, t = float(local_batch), float(compute_seconds)
        if self.model == "affine":
            self._fit[:6] *= self.fit_forget
            self._fit[6] *= self.fit_forget ** 2
            self._fit += (1.0, b, t, b * b, b * t, t * t, 1.0)
            beta = self._fixed_samples()
            if beta != self._beta:
                self._beta = beta
                self._fit_updates += 1
        x = t / (b + self._beta)
        a = self.ewma_alpha
        if global_batch is not None and global_batch < self.global_batch and not math.isnan(self._ewma):
            r = x / self._ewma
            self._short_ratio = r if math.isnan(self._short_ratio) else a * r + (1 - a) * self._short_ratio
            return
        self._ewma = x if math.isnan(self._ewma) else a * x + (1 - a) * self._ewma

    def record_warmup(self, compute_seconds: float, local_batch: int) -> None:
        """Feed a warm-up step's compute time: not a speed sample (lazy allocation, DDP's
        bucket rebuild), but the first step's ratio between ranks is close enough to split the
        next steps better than equally (see ``maybe_rebalance``)."""
        if local_batch > 0 and compute_seconds > 0:
            self._warmup_per_sample = float(compute_seconds) / local_batch

    def _fixed_samples(self) -> float:
        """beta = a / c from the forgotten least-squares fit of t = a + c b.

        Kept unchanged while the fit cannot separate a from c: batch sizes hardly differ,
        or the slope is uncertain (standard error > 20 % of it, e.g. timing noise on a
        shared machine). New estimates are smoothed and capped at half a global batch.
        """
        w, sb, st, sbb, sbt, stt, w2 = self._fit
        if w <= 0:
            return self._beta
        mb, mt = sb / w, st / w
        var = sbb / w - mb * mb
        if var <= (0.05 * mb) ** 2:  # batch sizes hardly differ: a and c not separable
            return self._beta
        c = (sbt / w - mb * mt) / var
        if c <= 0:
            return self._beta
        a = mt - c * mb
        n_eff = w * w / w2 if w2 > 0 else 0.0
        if n_eff < 4:
            return self._beta
        resid = max(stt / w - mt * mt - c * c * var, 0.0)  # weighted residual variance
        dof = max(n_eff - 2, 1.0)
        se_c = math.sqrt(resid / (var * dof))
        if se_c > 0.2 * c:
            return self._beta
        # the intercept is extrapolated from batch sizes far from 0: its error is the slope's
        # times the mean batch, so a slope known to 20 % still leaves the fixed cost unknown
        # (on this machine's noise: 85 samples fitted where the steps showed none, and the
        # fast rank then waited 15 % of every step). A fixed cost within three standard errors
        # of 0 counts as none (few steps make heavy tails).
        se_a = math.sqrt(resid / dof * (1.0 + mb * mb / var))
        beta = min(a / c, 0.5 * self.global_batch) if a > 3.0 * se_a else 0.0
        return beta if self._fit_updates == 0 else 0.5 * self._beta + 0.5 * beta

    @property
    def fixed_samples(self) -> float:
        """This rank's fixed per-step cost in samples (``a / c``; 0 until measurable)."""
        return self._beta

    @property
    def seconds_per_sample(self) -> float:
        """Per-sample cost ``c`` (seconds; nan before the first measurement)."""
        return self._ewma

    @property
    def short_ratio(self) -> float:
        """Per-sample cost on the epoch's short last batch over ``c`` (nan before measured)."""
        return self._short_ratio

    def estimate(self) -> tuple[float, float, float]:
        """What a rebalance all-gathers from this rank: (c, beta, short ratio)."""
        return (self._ewma, self._beta if self.model == "affine" else 0.0, self._short_ratio)

    def due(self, since: int | None = None) -> bool:
        """Whether this step is a rebalancing point (same answer on every rank); ``since``:
        asked for a count of steps since the last rebalance other than the current one."""
        since = self._since_rebalance if since is None else since
        if self.policy == "equal" or since < self.rebalance_every:
            return False
        return not (self.policy == "profile_once" and self.rebalances >= 1)

    def _provisional_due(self, since: int | None = None) -> bool:
        """After the first step of a fresh run (same answer on every rank): the one split from
        warm-up times, before any measured step. Without it the first measured step ran at the
        equal split: in a 1 : 0.33 run of the ``compute`` configuration the fast rank waited
        200-250 ms in it, 2 % of its 20 epochs."""
        since = self._since_rebalance if since is None else since
        return (self.policy != "equal" and not self._provisional_done and self.rebalances == 0
                and since == 1 and math.isnan(self._ewma))

    def exchange_payload(self) -> tuple[float, float, float] | None:
        """This rank's estimate, when the ``maybe_rebalance`` that ends the step in progress
        will gather estimates; else None. Called before the step, so that the ranks can
        all-gather it with the step's gradient (``training.hooks``) and pass the result to
        ``maybe_rebalance(gather, exchanged)``: a gather after the step was a synchronisation
        of its own, in which the fast rank waited for the slow one's optimizer step (2-3 ms
        every third step of ``digits``). The estimate is then one step older when it is used.
        Not for the provisional split, which gathers warm-up times once, on its own."""
        since = self._since_rebalance + 1
        if self._provisional_due(since) or not self.due(since):
            return None
        return self.estimate()

    def maybe_rebalance(self, gather: Callable[[tuple[float, float, float]], Sequence],
                        exchanged: Sequence | None = None) -> bool:
        """Count the step; collective when due: all ranks must call it after every step.

        ``gather(estimate)`` all-gathers this rank's ``(c, beta, short ratio)`` in rank order;
        an entry may also be ``(c, beta)`` or a bare float (seconds per sample, no fixed cost).
        ``exchanged``: the estimates already all-gathered during the step (what every rank's
        ``exchange_payload`` returned before it); a rebalance due now uses them instead of
        calling ``gather``.
        """
        self._since_rebalance += 1
        if self._provisional_due():
            self._provisional_done = True
            first = [float(g[0] if isinstance(g, (tuple, list, np.ndarray)) else g)
                     for g in gather((self._warmup_per_sample, 0.0, math.nan))]
            if not all(math.isfinite(t) and t > 0 for t in first):
                return False  # a rank without samples in it: its speed is not known yet
            # shares only: the model (_gathered) waits for measured steps, and this split does
            # not count as profile_once's one rebalance
            self.shares = shares_from_times(first)
            return True
        if not self.due():
            return False
        got = list(exchanged) if exchanged is not None else list(gather(self.estimate()))
        if len(got) != self.world_size:
            raise RuntimeError(f"gather returned {len(got)} values for {self.world_size} ranks")
        times, betas, ratios = [], [], []
        for g in got:
            if isinstance(g, (tuple, list, np.ndarray)):
                times.append(float(g[0]))
                betas.append(float(g[1]) if len(g) > 1 else 0.0)
                ratios.append(float(g[2]) if len(g) > 2 else math.nan)
            else:
                times.append(float(g))
                betas.append(0.0)
                ratios.append(math.nan)
        measured = [math.isfinite(t) and t > 0 for t in times]
        # Same gathered vector on every rank -> same decision everywhere. Without data
        # (warm-up, only short batches so far) keep the shares and don't spend the one
        # profile of profile_once on nothing.
        if not all(measured) if self.policy == "profile_once" else not any(measured):
            return False
        self.shares = shares_from_model(times, betas, self.global_batch)
        self._gathered = (tuple(times), tuple(betas), tuple(ratios))
        self.rebalances += 1
        self._since_rebalance = 0
        return True

    def state_dict(self) -> dict:
        return {"shares": list(self.shares), "step": self.step, "rebalances": self.rebalances,
                "ewma": self._ewma, "beta": self._beta, "short_ratio": self._short_ratio,
                "fit": self._fit.tolist(),
                "fit_updates": self._fit_updates, "provisional_done": self._provisional_done,
                "gathered": None if self._gathered is None else [list(x) for x in self._gathered]}

    def load_state_dict(self, state: dict) -> None:
        self.shares = tuple(float(x) for x in state["shares"])
        self.step = int(state["step"])
        self.rebalances = int(state["rebalances"])
        self._ewma = float(state.get("ewma", math.nan))
        self._beta = float(state.get("beta", 0.0))
        self._short_ratio = float(state.get("short_ratio", math.nan))
        fit = np.asarray(state.get("fit", [0.0] * 7), dtype=np.float64)
        self._fit = fit if fit.shape == (7,) else np.zeros(7)
        self._fit_updates = int(state.get("fit_updates", 0))
        self._provisional_done = bool(state.get("provisional_done", True))
        g = state.get("gathered")
        self._gathered = (None if g is None else
                          (tuple(float(x) for x in g[0]), tuple(float(x) for x in g[1]),
                           tuple(float(x) for x in g[2]) if len(g) > 2 else (math.nan,) * len(g[0])))
        self._since_rebalance = 0
