"""Per-rank training loop for heterogeneous data parallelism (pure torch.distributed).

No middleware here: a ROS trainer node wraps :class:`RankTrainer`, passes ``on_step`` to
publish telemetry and calls :meth:`RankTrainer.set_emulated_slowdown` from a parameter
callback. The process group must already be initialised (see ``training.launch``).

One step on rank r: take this rank's contiguous slice (b_r samples) of the global batch
(``training.sampler``), forward/backward with the loss averaged over the local slice, the DDP
hook scales by b_r/B and all-reduces hierarchically (``training.hooks``), optimizer step --
which makes every rank's update the single-process update on the union batch. With work
stealing (``work_stealing``, on for the adaptive policy) the slice is only where the rank
starts: it claims chunks at run time (``training.stealing``), accumulates them without
communication and weighs the sum by 1/B, so the update stays exact. If the
rank emulates a slower device (factor s), it sleeps (s-1) x its real compute time, and
does so *before* each communication (for the compute since the previous one) and after the
optimizer step (for that step): a real slow device arrives late at the all-reduce. Sleeping
only after the step would let an emulated-slow rank reach the all-reduce early and pay its
debt afterwards; any extra synchronisation (the rebalance all-gather) then makes it wait
for the fast rank's compute *and* makes the fast rank wait for its sleep.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kaitian_ros import heap
from kaitian_ros.training.affinity import pinned_cores
from kaitian_ros.training.config import CHECKPOINT_NAME, TrainingConfig, lr_at, make_optimizer, set_lr
from kaitian_ros.training.data import DataSplit, dataset_size, evaluate, gather_batch, load_data
from kaitian_ros.training.groups import CommGroups, build_groups, parse_device
from kaitian_ros.training.hooks import HOOKS, HookState, finish_all_gather, start_all_gather
from kaitian_ros.training.results import EpochDone, TrainingResult, TrainingStep
from kaitian_ros.training.sampler import AdaptiveBatchSampler
from kaitian_ros.training.stealing import StepClaims, forget_step

WARMUP_STEPS = 2  # steps per run not used as speed measurements


def import_lazy_dependencies() -> None:
    """Import what a rank imports only once it trains: DDP's constructor and the optimizer's
    first step import torch._dynamo (about 1.5 s of CPU here, more than a short run's
    training). A process that forks ranks calls this first, so they share one import."""
    import torch._dynamo  # noqa: F401


def slow_down(seconds: float, busy: bool = False) -> None:
    """The extra time of an emulated slower device. ``busy``: keep the core running (yielding
    it to any other ready thread) instead of sleeping, as a device that computes does. On this
    virtual machine a rank that slept two thirds of every step (1 : 0.33) then computed its
    next samples with about twice the spread of the step time (residual 5-10 ms against 9-22
    ms in four interleaved pairs of 20-epoch ``compute`` runs): its idle core had been handed
    back to the host. Where a rank has no core of its own, sleeping leaves it to the others."""
    if seconds <= 0:
        return
    if not busy:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        os.sched_yield()


def micro_slices(n: int, micro_batch: int) -> list[tuple[int, int]]:
    """[start, end) ranges that cover a slice of `n` samples in passes of at most `micro_batch`
    samples (`TrainingConfig.micro_batch`); one pass when it is 0, also for an empty slice."""
    if micro_batch <= 0 or n <= micro_batch:
        return [(0, n)]
    return [(a, min(a + micro_batch, n)) for a in range(0, n, micro_batch)]


def build_training_model(cfg: TrainingConfig, data: DataSplit) -> nn.Module:
    from kaitian_ros.core.models import build_model

    return build_model(cfg.model, num_classes=data.num_classes, in_channels=data.in_channels,
                       seed=cfg.seed)


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
class RankTrainer:
    """One rank of a collaborative training run. Call :meth:`run` on every rank."""

    def __init__(self, config: TrainingConfig, *, rank: int | None = None,
                 world_size: int | None = None, local_rank: int | None = None,
                 on_step: Callable[[TrainingStep], None] | None = None,
                 data: DataSplit | None = None,
                 on_epoch: Callable[[EpochDone], None] | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (use kaitian_ros.training.launch)")
        self.config = config
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.device_label = config.device_for(self.rank, local_rank)
        self.device, self.group_label = parse_device(self.device_label)
        self.on_step = on_step
        self.on_epoch = on_epoch
        self._data = data
        self._slowdown = config.slowdown_for(self.rank)
        self._lock = threading.Lock()
        self.groups: CommGroups | None = None
        self.model: nn.Module | None = None  # the trained module, once run() built it

    # -- live tuning (thread-safe; read once per step) ----------------------------------
    def set_emulated_slowdown(self, factor: float) -> None:
        """Make this rank emulate a device ``factor`` times slower, from the next step on."""
        if not (factor >= 1.0 and math.isfinite(factor)):
            raise ValueError("emulated slowdown must be finite and >= 1")
        with self._lock:
            self._slowdown = float(factor)

    @property
    def emulated_slowdown(self) -> float:
        with self._lock:
            return self._slowdown

    # -- helpers -----------------------------------------------------------------------
    def _claims_store(self) -> Any:
        """The rendezvous store, for the per-step claim counters of work stealing."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError) as e:  # initialised without a store
            raise RuntimeError(f"work stealing needs the rendezvous store: {e}; set "
                               "work_stealing: off") from None
        return dist.PrefixStore("kaitian/steal", store)

    @property
    def spins(self) -> bool:
        """Whether this rank waits for gloo collectives by polling (``spin_wait``, resolved:
        "auto" spins where ``training.affinity`` pinned this process to cores of its own)."""
        return self.config.spins(bool(pinned_cores()))

    def _gather(self, x: float | Sequence[float]) -> list[Any]:
        """All-gather a float or a fixed-length float vector from every rank (rank order)."""
        group = self.groups.world if self.groups else None
        if isinstance(x, (int, float)):
            return [g[0] for g in finish_all_gather(start_all_gather([x], group), group, self.spins)]
        return list(finish_all_gather(start_all_gather(x, group), group, self.spins))

    def _checkpoint_path(self) -> Path | None:
        d = self.config.checkpoint_dir
        return Path(d) / CHECKPOINT_NAME if d else None

    def _save(self, model: nn.Module, opt: torch.optim.Optimizer,
              sampler: AdaptiveBatchSampler, epoch: int, accs: list[float]) -> None:
        path = self._checkpoint_path()
        if path is None or self.rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(), "accuracy_per_epoch": accs,
                    "config": self.config.to_dict(), "world_size": self.world_size}, tmp)
        os.replace(tmp, path)  # atomic: a crash mid-save never leaves a torn checkpoint

    def _save_weights(self, model: nn.Module) -> None:
        """The final state_dict in the form ``core.models.build_model(state_dict_path=...)``
        loads (plain tensors, no DDP prefix); every rank holds the same parameters."""
        if not self.config.save_weights or self.rank != 0:
            return
        path = Path(self.config.save_weights)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, path)  # a reader never sees a half-written file

    def _load(self) -> dict | None:
        """Rank 0 reads the checkpoint and broadcasts it (other hosts need no shared disk)."""
        path = self._checkpoint_path()
        box: list[Any] = [None]
        assert self.groups is not None  # run() builds the groups before it loads
        if self.rank == 0 and path is not None and path.exists():
            box[0] = torch.load(path, map_location="cpu", weights_only=False)
        dist.broadcast_object_list(box, src=0, group=self.groups.world)
        return box[0]

    # -- run ---------------------------------------------------------------------------
    def run(self) -> TrainingResult:
        cfg = self.config
        # activations and gradients of several MiB would otherwise be an mmap, page faults and
        # zeroing each time they are allocated: 20-25 % of a step here, and most of its spread
        heap.tune_allocator()
        torch.manual_seed(cfg.seed)
        data = self._data or load_data(cfg.dataset, cfg.num_classes, cfg.image_size,
                                       standardize=cfg.standardize_inputs,
                                       camera=cfg.camera_inputs)
        self.groups = build_groups(self.group_label, timeout_s=cfg.timeout_s)
        model = build_training_model(cfg, data).to(self.device).train()
        self.model = model
        # init_sync=False: every rank builds identical weights from the seed (and resume
        # broadcasts the checkpoint), so DDP's own broadcast -- which would need one
        # backend for all vendors' devices -- is unnecessary.
        ddp_kw: dict[str, Any] = {}
        if self.device.type != "cpu" and self.device.index is not None:
            ddp_kw["device_ids"] = [self.device.index]
        # broadcast_buffers=False: buffers (BN stats) stay rank-local; syncing them would
        # need a backend spanning all vendors in the forward pass. The kwarg is deprecated
        # in favour of forward_sync_buffers, which however still syncs at init.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DDP(model, process_group=self.groups.world, init_sync=False,
                      broadcast_buffers=False, gradient_as_bucket_view=True, **ddp_kw)
        spins = self.spins
        state = HookState(groups=self.groups, flat_group=self.groups.world, spin=spins,
                          exchange_group=self.groups.world)
        hook = HOOKS[cfg.hook]
        # emulated slowdown of this step and the end of the last compute interval
        emu = {"s": 1.0, "mark": 0.0}

        def emulate() -> None:
            """Sleep (s-1) x the real compute since the last mark (no comm in between)."""
            now = time.perf_counter()
            if emu["s"] > 1.0:
                slow_down((emu["s"] - 1.0) * max(now - emu["mark"], 0.0), busy=spins)

        def slowed_hook(st, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            emulate()  # a slow device is late *at* the all-reduce, not after it
            fut = hook(st, bucket)
            emu["mark"] = time.perf_counter()
            return fut

        ddp.register_comm_hook(state, slowed_hook)
        claims_store = self._claims_store() if cfg.steals and self.world_size > 1 else None

        def forward_backward(indices: Any, d: int) -> float:
            """One pass over the samples `indices`: their summed loss / d backpropagated (d the
            slice's planned size: the gradient is the slice's mean share); the summed loss."""
            x, y = gather_batch(data.train, indices)
            x, y = x.to(self.device), y.to(self.device)
            loss = nn.functional.cross_entropy(ddp(x), y, reduction="sum")
            (loss / d).backward()
            return float(loss.item())

        def stolen_forward_backward(sl: Any) -> tuple[int, float]:
            """This rank's share of the step with run-time boundaries (``training.stealing``).

            Chunks are accumulated without communication; an empty forward/backward then
            runs the comm hook on the sum. Each chunk's summed loss is divided by the
            *planned* slice size d and the hook weighs by d / B, so the reduced gradient is
            (sum over the samples this rank computed) / B: exact for any final counts.
            """
            assert claims_store is not None  # only called where cfg.steals with several ranks
            d = max(sl.local_batch, 1)
            state.set_batch(d, sl.global_batch)
            # with a pass size set, claims stay between a quarter of it and it: the tail's
            # small claims were passes of 6-16 samples, up to 1.25x the best cost per sample.
            # The quarter is the fastest rank's; a slower rank's smallest claim is smaller by
            # its planned share, so that the last claims take about the same *time* on every
            # rank: 64 samples on a rank 3x slower were half a step that the others waited for.
            mb = cfg.micro_batch
            scale = sl.counts[self.rank] / max(*sl.counts, 1)
            claims = StepClaims(claims_store, str(sl.step), sl.counts, self.rank,
                                min_chunk=max(1, round(mb // 4 * scale)), max_chunk=mb)
            loss_sum = 0.0
            with ddp.no_sync():
                # a claim is a round trip to the store: communication, which a slower device
                # does not slow down; only the chunks' compute is emulated (the mark is set after
                # every claim, the last one, that finds nothing left, included)
                while (rng := claims.next()) is not None:
                    emu["mark"] = time.perf_counter()
                    loss_sum += forward_backward(sl.batch[rng[0]:rng[1]], d)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    emulate()  # at the emulated pace, so the slow rank claims late
            emu["mark"] = time.perf_counter()
            x, y = gather_batch(data.train, [])
            loss = nn.functional.cross_entropy(ddp(x.to(self.device)), y.to(self.device),
                                               reduction="sum")
            loss.backward()  # the comm hook runs inside, on the accumulated gradient
            if self.rank == 0 and sl.step > 0:
                # every rank has left the previous step (its all-reduce just completed)
                forget_step(claims_store, str(sl.step - 1), self.world_size - 1)
            return claims.count, loss_sum
        opt = make_optimizer(cfg, model)
        sampler = AdaptiveBatchSampler(dataset_size(data.train), cfg.global_batch, self.rank,
                                       self.world_size, seed=cfg.seed, policy=cfg.policy,
                                       rebalance_every=cfg.rebalance_every,
                                       ewma_alpha=cfg.ewma_alpha, model=cfg.share_model,
                                       slice_multiple=cfg.slice_multiple)
        start_epoch, accs = 0, []
        if cfg.resume:
            ck = self._load()
            if ck is not None:
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["optimizer"])
                if int(ck.get("world_size", -1)) == self.world_size:
                    sampler.load_state_dict(ck["sampler"])
                # else: resumed on a different set of ranks; shares start equal again
                start_epoch, accs = int(ck["epoch"]) + 1, list(ck["accuracy_per_epoch"])

        # Size-1 dims (in_channels=1 convs) give grads "different" strides than the bucket
        # view; harmless, but the reducer warns on every run.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view")
        history: list[TrainingStep] = []
        train_s = comm_s = 0.0
        samples = 0
        steps = 0
        epoch = start_epoch - 1
        stop = False
        for epoch in range(start_epoch, cfg.epochs):
            for sl in sampler.epoch(epoch):
                if cfg.max_steps is not None and steps >= cfg.max_steps:
                    stop = True
                    break
                t0 = time.perf_counter()
                emu["s"], emu["mark"] = self.emulated_slowdown, t0
                opt.zero_grad(set_to_none=False)
                # a rebalance due after this step gathers the estimates with its gradient
                state.exchange = sampler.exchange_payload() if self.world_size > 1 else None
                if claims_store is not None:
                    count, loss_sum = stolen_forward_backward(sl)
                else:
                    state.set_batch(sl.local_batch, sl.global_batch)
                    parts = micro_slices(len(sl.indices), cfg.micro_batch)
                    loss_sum = 0.0
                    for k, (a, b) in enumerate(parts):
                        # the last pass reduces the accumulated gradient (the comm hook runs in it);
                        # sum / b: mean over the local slice, and an exact zero for an empty one
                        with ddp.no_sync() if k + 1 < len(parts) else contextlib.nullcontext():
                            loss_sum += forward_backward(sl.indices[a:b], max(sl.local_batch, 1))
                    count = sl.local_batch
                set_lr(opt, lr_at(cfg, sl.step, sampler.steps_per_epoch()))
                opt.step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                emulate()  # the rest: optimizer step (and all compute if no hook ran)
                comm = state.take_comm_seconds()
                s = emu["s"]
                wall = time.perf_counter() - t0
                compute = wall - comm
                # The first two steps of a run are not speed samples: lazy allocation, and
                # DDP's bucket rebuild in step 1 runs a collective outside the hook that
                # would count a fast rank's wait for a slow one as its compute.
                if steps >= WARMUP_STEPS:
                    sampler.record(compute, count, sl.global_batch)
                else:
                    sampler.record_warmup(compute, count)
                t_sync = time.perf_counter()
                # a collective only for the provisional split (or where no hook ran)
                sampler.maybe_rebalance(self._gather, state.take_exchanged())
                # part of the step and of its communication (a rank waits in it for the others),
                # never of the compute the shares are fitted to
                sync = time.perf_counter() - t_sync
                wall += sync
                comm += sync
                train_s += wall
                comm_s += comm
                samples += sl.global_batch
                steps += 1
                rec = TrainingStep(
                    rank=self.rank, device=self.device_label, epoch=epoch, step=sl.step,
                    local_batch=count, global_batch=sl.global_batch,
                    share=count / sl.global_batch, step_ms=wall * 1e3,
                    compute_ms=compute * 1e3, comm_ms=comm * 1e3,
                    loss=loss_sum / count if count else math.nan,
                    samples_per_s=count / wall if wall > 0 else 0.0,
                    emulated=s != 1.0, slowdown=s)
                history.append(rec)
                if self.on_step is not None:
                    self.on_step(rec)
            if stop:
                break
            evaluated = cfg.evaluate_every_epoch or epoch == cfg.epochs - 1
            if evaluated:
                accs.append(evaluate(model, data.test, self.device))
            self._save(model, opt, sampler, epoch, accs)
            if self.on_epoch is not None:
                self.on_epoch(EpochDone(epoch=epoch, epochs=cfg.epochs, test_accuracy=accs[-1] if evaluated else None,
                                        samples_per_s=samples / train_s if train_s > 0 else 0.0,
                                        shares=tuple(sampler.shares)))
        acc = evaluate(model, data.test, self.device)
        self._save_weights(model)
        return TrainingResult(
            rank=self.rank, world_size=self.world_size, device=self.device_label,
            epochs_completed=max(epoch + (0 if stop else 1), 0), steps=steps,
            test_accuracy=acc, samples_per_s=samples / train_s if train_s > 0 else 0.0,
            train_seconds=train_s, comm_seconds=comm_s, final_shares=sampler.shares,
            accuracy_per_epoch=tuple(accs), history=tuple(history),
            groups=self.groups.topology.describe() if self.groups else "")
