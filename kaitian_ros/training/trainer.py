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

import importlib
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kaitian_ros.training.groups import CommGroups, build_groups, parse_device
from kaitian_ros.training.hooks import HOOKS, HookState
from kaitian_ros.training.sampler import MODELS, POLICIES, AdaptiveBatchSampler
from kaitian_ros.training.stealing import StepClaims, forget_step

CHECKPOINT_NAME = "checkpoint.pt"
LR_SCHEDULES = ("constant", "cosine")
WORK_STEALING = ("auto", "on", "off")
OPTIMIZERS = ("sgd", "adam")
WARMUP_STEPS = 2  # steps per run not used as speed measurements


@dataclass(frozen=True)
class TrainingConfig:
    """Everything that defines a training run; identical on every rank.

    ``devices`` and ``emulated_slowdown`` are per rank (a single entry applies to all).
    A device ``cpu:a`` is the CPU labelled as its own device type (see ``training.groups``).
    ``emulated_slowdown`` s >= 1 makes a rank behave like a device s times slower.
    """

    model: str = "digits_cnn"
    dataset: str = "digits"  # or "package.module:callable" -> Dataset or (train, test)
    num_classes: int | None = None  # None: 10 for digits, else inferred from labels
    # square input size the images are resized to (bilinear); None: as the dataset has them.
    # Digits are 8x8: a larger size gives the same task more compute per sample (and the
    # same gradient size), the regime of real image models where communication is small.
    image_size: int | None = None
    global_batch: int = 64
    epochs: int = 5
    lr: float = 0.05
    momentum: float = 0.9
    lr_schedule: str = "constant"  # or "cosine": decay to 0 over all epochs' steps
    optimizer: str = "sgd"  # "sgd" (with ``momentum``) or "adam" (default betas, no decay)
    # standardise inputs with the training set's pixel mean and std (after resizing)
    standardize_inputs: bool = False
    # train on what the compute nodes feed the model for a camera frame of the image: pixels
    # quantised to uint8 and normalised as the nodes do (normalise: true), so weights saved
    # with ``save_weights`` see at inference exactly the tensors they were trained on
    camera_inputs: bool = False
    warmup_steps: int = 0  # linear ramp of the lr over the first steps (both schedules)
    seed: int = 0
    policy: str = "adaptive"
    rebalance_every: int = 5
    ewma_alpha: float = 0.5
    share_model: str = "affine"  # step time a + c b per rank ("proportional": c b)
    # slice boundaries settled at run time by claims (``training.stealing``): "on", "off", or
    # "auto" = on for the adaptive policy, off for the baselines (equal = plain DDP,
    # profile_once = KAITIAN's profiling)
    work_stealing: str = "auto"
    hook: str = "hierarchical"
    devices: tuple[str, ...] = ("cpu",)
    emulated_slowdown: tuple[float, ...] = (1.0,)
    checkpoint_dir: str | None = None
    # rank 0 writes the final model's state_dict here: the file inference nodes load (weights:=PATH)
    save_weights: str | None = None
    resume: bool = False
    timeout_s: float = 60.0
    max_steps: int | None = None  # stop after this many steps in total (benchmarks)
    evaluate_every_epoch: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.share_model not in MODELS:
            raise ValueError(f"share_model must be one of {', '.join(MODELS)}, "
                             f"got {self.share_model!r}")
        if self.hook not in HOOKS:
            raise ValueError(f"hook must be one of {', '.join(HOOKS)}, got {self.hook!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if isinstance(self.work_stealing, bool):  # YAML true/false
            object.__setattr__(self, "work_stealing", "on" if self.work_stealing else "off")
        if self.work_stealing not in WORK_STEALING:
            raise ValueError(f"work_stealing must be one of {', '.join(WORK_STEALING)}, "
                             f"got {self.work_stealing!r}")
        if self.camera_inputs and self.standardize_inputs:
            raise ValueError("camera_inputs and standardize_inputs exclude each other: camera "
                             "inputs are normalised as the inference nodes do it")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.global_batch <= 0 or self.epochs <= 0 or self.rebalance_every <= 0:
            raise ValueError("global_batch, epochs and rebalance_every must be positive")
        if not self.devices:
            raise ValueError("devices must not be empty")
        if self.image_size is not None and not 4 <= int(self.image_size) <= 4096:
            raise ValueError(f"image_size must be in 4..4096 or None, got {self.image_size}")
        if any(not (s >= 1.0 and math.isfinite(s)) for s in self.emulated_slowdown):
            raise ValueError("emulated_slowdown factors must be finite and >= 1")
        # tuples even when built from YAML/JSON lists (frozen: use object.__setattr__)
        object.__setattr__(self, "devices", tuple(str(d) for d in self.devices))
        object.__setattr__(self, "emulated_slowdown",
                           tuple(float(s) for s in self.emulated_slowdown))

    @property
    def steals(self) -> bool:
        """Whether ranks steal work inside a step (``work_stealing``, resolved)."""
        if self.work_stealing == "auto":
            return self.policy == "adaptive"
        return self.work_stealing == "on"

    def device_for(self, rank: int, local_rank: int | None = None) -> str:
        if len(self.devices) == 1:
            d = self.devices[0]
            # one bare accelerator type for all ranks: one device per local rank (torchrun)
            if d in ("cuda", "npu", "mlu", "xpu") and local_rank is not None:
                return f"{d}:{local_rank}"
            return d
        if rank >= len(self.devices):
            raise ValueError(f"rank {rank} has no device: devices={list(self.devices)}")
        return self.devices[rank]

    def slowdown_for(self, rank: int) -> float:
        s = self.emulated_slowdown
        if not s:
            return 1.0
        if len(s) == 1:
            return s[0]
        if rank >= len(s):
            raise ValueError(f"rank {rank} has no emulated_slowdown entry: {list(s)}")
        return s[rank]

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TrainingConfig:
        names = {f.name for f in fields(TrainingConfig)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown training config keys: {', '.join(sorted(unknown))}")
        d = dict(d)
        for k in ("devices", "emulated_slowdown"):
            if k in d and isinstance(d[k], (str, int, float)):
                d[k] = (d[k],)
        return TrainingConfig(**d)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["devices"], out["emulated_slowdown"] = list(self.devices), list(self.emulated_slowdown)
        return out


@dataclass(frozen=True)
class TrainingStep:
    """Telemetry of one step on one rank (what a trainer node publishes)."""

    rank: int
    device: str
    epoch: int
    step: int
    local_batch: int
    global_batch: int
    share: float
    step_ms: float  # wall time of the whole step on this rank
    compute_ms: float  # step_ms - comm_ms (includes the emulated slowdown)
    comm_ms: float  # blocked in gradient communication (incl. waiting for slower ranks)
    loss: float  # mean loss over this rank's slice (nan for an empty slice)
    samples_per_s: float  # this rank's local_batch / step time
    emulated: bool  # True when the speed of this rank is emulated (slowdown != 1)
    slowdown: float


@dataclass(frozen=True)
class EpochDone:
    """One finished epoch, as a rank saw it (what progress reports show)."""

    epoch: int                    # 0-based
    epochs: int                   # of the whole run
    test_accuracy: float | None   # None where the epoch was not evaluated
    samples_per_s: float          # global samples per second of training so far
    shares: tuple[float, ...]     # every rank's share of the global batch now


@dataclass(frozen=True)
class TrainingResult:
    rank: int
    world_size: int
    device: str
    epochs_completed: int
    steps: int
    test_accuracy: float
    samples_per_s: float  # global samples / training wall time (eval and checkpoints excluded)
    train_seconds: float
    comm_seconds: float
    final_shares: tuple[float, ...]
    accuracy_per_epoch: tuple[float, ...]
    history: tuple[TrainingStep, ...] = field(repr=False, default=())
    groups: str = ""  # the (host, device) groups the ranks formed (Topology.describe)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("history")
        d["final_shares"] = list(self.final_shares)
        d["accuracy_per_epoch"] = list(self.accuracy_per_epoch)
        return d


def lr_at(cfg: TrainingConfig, step: int, steps_per_epoch: int) -> float:
    """Learning rate of global step `step` (0-based): the same on every rank and in a
    single-process replay, so schedules keep the split exact."""
    lr = cfg.lr
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        lr *= (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        total = max(1, cfg.epochs * steps_per_epoch)
        lr *= 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    return lr


def make_optimizer(cfg: TrainingConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names; the learning rate is set per step by :func:`set_lr`."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DataSplit:
    """Train and test sets; tensors when the dataset fits in memory as such."""

    train: Any
    test: Any
    num_classes: int
    in_channels: int


def _digits(seed_split: int = 0) -> DataSplit:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None, :, :]  # (N, 1, 8, 8) in [0, 1]
    y = d.target.astype(np.int64)
    # fixed random_state: the split must not depend on the training seed
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed_split,
                                          stratify=y)
    return DataSplit(train=(torch.from_numpy(xtr), torch.from_numpy(ytr)),
                     test=(torch.from_numpy(xte), torch.from_numpy(yte)),
                     num_classes=10, in_channels=1)


class _Resized(torch.utils.data.Dataset):
    """Items of `base` with the image resized to `size` x `size` (bilinear)."""

    def __init__(self, base: Any, size: int) -> None:
        self.base, self.size = base, size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        x, y = self.base[i]
        return _resize(torch.as_tensor(x)[None], self.size)[0], y


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if tuple(x.shape[-2:]) == (size, size):
        return x
    return torch.nn.functional.interpolate(x.float(), size=(size, size), mode="bilinear",
                                           align_corners=False)


def resize_split(data: DataSplit, size: int | None) -> DataSplit:
    """`data` with every image resized to `size` x `size` (None: unchanged)."""
    if size is None:
        return data

    def one(ds: Any) -> Any:
        if isinstance(ds, tuple):
            return (_resize(ds[0], size).contiguous(), ds[1])
        return _Resized(ds, size)

    return DataSplit(one(data.train), one(data.test), data.num_classes, data.in_channels)


def standardize_split(data: DataSplit) -> DataSplit:
    """Train and test images as ``(x - mean) / std`` with the training set's pixel statistics.

    Only for in-memory ``(x, y)`` tensor sets (the test set uses the *training* statistics).
    """
    if not isinstance(data.train, tuple) or not isinstance(data.test, tuple):
        raise ValueError("standardize_inputs needs an in-memory (x, y) tensor dataset")
    x = data.train[0].float()
    mean, std = float(x.mean()), float(x.std())
    if not std > 0:
        raise ValueError("cannot standardise: the training images are constant")

    def one(ds: tuple) -> tuple:
        return ((ds[0].float() - mean) / std, ds[1])

    return DataSplit(one(data.train), one(data.test), data.num_classes, data.in_channels)


def camera_split(data: DataSplit) -> DataSplit:
    """Train and test images as the compute nodes see a camera frame of them: quantised to
    uint8 pixels (``core.tensors.to_pixels``, images in [0, 1]) and turned into model input by
    the nodes' own ``core.tensors.normalise_input`` (``normalise: true``).

    Only for in-memory ``(x, y)`` tensor sets.
    """
    from kaitian_ros.core.tensors import normalise_input, to_pixels

    if not isinstance(data.train, tuple) or not isinstance(data.test, tuple):
        # a configuration mistake: ValueError, which the CLI and the node report as one line
        raise ValueError("camera_inputs needs an in-memory (x, y) tensor dataset")

    def one(ds: tuple) -> tuple:
        return (normalise_input(to_pixels(ds[0]), data.in_channels), ds[1])

    return DataSplit(one(data.train), one(data.test), data.num_classes, data.in_channels)


def load_data(spec: str, num_classes: int | None = None, image_size: int | None = None,
              *, standardize: bool = False, camera: bool = False) -> DataSplit:
    """``"digits"`` or ``"package.module:callable"`` returning a Dataset or (train, test).

    A single Dataset is split 75/25 deterministically. Items are ``(x, label)``. With
    `image_size` every image is resized (bilinear) to that square size; with `standardize`
    then standardised (:func:`standardize_split`), with `camera` made camera inputs
    (:func:`camera_split`).
    """
    if standardize:
        return standardize_split(load_data(spec, num_classes, image_size))
    if camera:
        return camera_split(load_data(spec, num_classes, image_size))
    if spec == "digits":
        return resize_split(_digits(), image_size)
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"dataset must be 'digits' or 'package.module:callable', got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import dataset {spec!r}: {e}") from None
    got = obj()
    if isinstance(got, tuple) and len(got) == 2:
        train, test = got
    else:
        n = len(got)
        perm = np.random.default_rng(0).permutation(n)
        cut = round(n * 0.75)
        train = torch.utils.data.Subset(got, perm[:cut].tolist())
        test = torch.utils.data.Subset(got, perm[cut:].tolist())
    x0, _ = train[0]
    in_ch = int(torch.as_tensor(x0).shape[0])
    if num_classes is None:
        labels = {int(train[i][1]) for i in range(len(train))}
        num_classes = max(labels) + 1
    return resize_split(DataSplit(train=train, test=test, num_classes=num_classes,
                                  in_channels=in_ch), image_size)


def _size(ds: Any) -> int:
    return int(ds[1].shape[0]) if isinstance(ds, tuple) else len(ds)


def _batch(ds: Any, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(ds, tuple):
        t = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ds[0][t], ds[1][t]
    if not idx:
        x0, _ = ds[0]
        x0 = torch.as_tensor(x0)
        return x0.new_zeros((0, *x0.shape)), torch.zeros(0, dtype=torch.long)
    items = [ds[i] for i in idx]
    return (torch.stack([torch.as_tensor(x) for x, _ in items]),
            torch.as_tensor([int(y) for _, y in items], dtype=torch.long))


@torch.no_grad()
def evaluate(model: nn.Module, test: Any, device: torch.device, batch: int = 512) -> float:
    """Top-1 accuracy on the test set."""
    model.eval()
    n, correct = _size(test), 0
    for lo in range(0, n, batch):
        x, y = _batch(test, list(range(lo, min(n, lo + batch))))
        correct += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    model.train()
    return correct / max(n, 1)


def _build_model(cfg: TrainingConfig, data: DataSplit) -> nn.Module:
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

    def _gather(self, x: float | Sequence[float]) -> list[Any]:
        """All-gather a float or a fixed-length float vector from every rank (rank order)."""
        scalar = isinstance(x, (int, float))
        t = torch.tensor([x] if isinstance(x, (int, float)) else list(x), dtype=torch.float64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.groups.world if self.groups else None)
        return [float(o.item()) if scalar else tuple(o.tolist()) for o in out]

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
        torch.manual_seed(cfg.seed)
        data = self._data or load_data(cfg.dataset, cfg.num_classes, cfg.image_size,
                                       standardize=cfg.standardize_inputs,
                                       camera=cfg.camera_inputs)
        self.groups = build_groups(self.group_label, timeout_s=cfg.timeout_s)
        model = _build_model(cfg, data).to(self.device).train()
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
        state = HookState(groups=self.groups, flat_group=self.groups.world)
        hook = HOOKS[cfg.hook]
        # emulated slowdown of this step and the end of the last compute interval
        emu = {"s": 1.0, "mark": 0.0}

        def emulate() -> None:
            """Sleep (s-1) x the real compute since the last mark (no comm in between)."""
            now = time.perf_counter()
            if emu["s"] > 1.0:
                time.sleep((emu["s"] - 1.0) * max(now - emu["mark"], 0.0))

        def slowed_hook(st, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            emulate()  # a slow device is late *at* the all-reduce, not after it
            fut = hook(st, bucket)
            emu["mark"] = time.perf_counter()
            return fut

        ddp.register_comm_hook(state, slowed_hook)
        claims_store = self._claims_store() if cfg.steals and self.world_size > 1 else None

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
            claims = StepClaims(claims_store, str(sl.step), sl.counts, self.rank)
            loss_sum = 0.0
            with ddp.no_sync():
                while (rng := claims.next()) is not None:
                    x, y = _batch(data.train, sl.batch[rng[0]:rng[1]])
                    x, y = x.to(self.device), y.to(self.device)
                    loss = nn.functional.cross_entropy(ddp(x), y, reduction="sum")
                    (loss / d).backward()
                    loss_sum += float(loss.item())
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    emulate()  # at the emulated pace, so the slow rank claims late
                    emu["mark"] = time.perf_counter()
            x, y = _batch(data.train, [])
            loss = nn.functional.cross_entropy(ddp(x.to(self.device)), y.to(self.device),
                                               reduction="sum")
            loss.backward()  # the comm hook runs inside, on the accumulated gradient
            if self.rank == 0 and sl.step > 0:
                # every rank has left the previous step (its all-reduce just completed)
                forget_step(claims_store, str(sl.step - 1), self.world_size - 1)
            return claims.count, loss_sum
        opt = make_optimizer(cfg, model)
        sampler = AdaptiveBatchSampler(_size(data.train), cfg.global_batch, self.rank,
                                       self.world_size, seed=cfg.seed, policy=cfg.policy,
                                       rebalance_every=cfg.rebalance_every,
                                       ewma_alpha=cfg.ewma_alpha, model=cfg.share_model)
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
                if claims_store is not None:
                    count, loss_sum = stolen_forward_backward(sl)
                else:
                    x, y = _batch(data.train, sl.indices)
                    x, y = x.to(self.device), y.to(self.device)
                    state.set_batch(sl.local_batch, sl.global_batch)
                    out = ddp(x)
                    # sum / b: mean over the local slice, and an exact zero for an empty one
                    loss = nn.functional.cross_entropy(out, y, reduction="sum") / max(sl.local_batch, 1)
                    loss.backward()  # the comm hook runs inside
                    count, loss_sum = sl.local_batch, float(loss.item()) * sl.local_batch
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
                sampler.maybe_rebalance(self._gather)  # collective when due
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
