"""The configuration of a training run (:class:`TrainingConfig`, the same on every rank) and what
it specifies beyond the loop: the optimizer and the learning-rate schedule (docs/training.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from kaitian_ros.training.hooks import HOOKS
from kaitian_ros.training.sampler import MODELS, POLICIES

CHECKPOINT_NAME = "checkpoint.pt"
LR_SCHEDULES = ("constant", "cosine")
AUTO_ON_OFF = ("auto", "on", "off")  # work_stealing, spin_wait
OPTIMIZERS = ("sgd", "adam")


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
    # slices in multiples of this many samples where every rank gets at least that many (not
    # for "equal"): few distinct slice sizes, so few new input shapes for oneDNN to build
    # kernels for while the shares move (``sampler.split_counts``); 1: exact shares
    slice_multiple: int = 8
    # slice boundaries settled at run time by claims (``training.stealing``): "on", "off", or
    # "auto" = off: in 8 of the 10 configuration medians of the full `kaitian bench training`
    # runs measured, the adaptive shares alone trained faster than with stealing (docs/training.md)
    work_stealing: str = "auto"
    # wait for gloo collectives by polling instead of blocking ("on", "off", or "auto" = on
    # where the rank was pinned to cores of its own by ``training.affinity``): a blocked rank's
    # idle core took milliseconds to wake on a virtual machine (``training.hooks``)
    spin_wait: str = "auto"
    hook: str = "hierarchical"
    devices: tuple[str, ...] = ("cpu",)
    emulated_slowdown: tuple[float, ...] = (1.0,)
    checkpoint_dir: str | None = None
    # rank 0 writes the final model's state_dict here: the file inference nodes load (weights:=PATH)
    save_weights: str | None = None
    resume: bool = False
    timeout_s: float = 60.0
    max_steps: int | None = None  # stop after this many steps in total (benchmarks)
    # a rank computes its slice in forward/backward passes of at most this many samples,
    # accumulating the gradient (same gradient; 0: the whole slice in one pass). With work
    # stealing every claim is one pass: claims are then between a quarter of this and this
    micro_batch: int = 0
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
        for name in ("work_stealing", "spin_wait"):
            value = getattr(self, name)
            if isinstance(value, bool):  # YAML true/false
                value = "on" if value else "off"
                object.__setattr__(self, name, value)
            if value not in AUTO_ON_OFF:
                raise ValueError(f"{name} must be one of {', '.join(AUTO_ON_OFF)}, got {value!r}")
        if self.camera_inputs and self.standardize_inputs:
            raise ValueError("camera_inputs and standardize_inputs exclude each other: camera "
                             "inputs are normalised as the inference nodes do it")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.slice_multiple < 1:
            raise ValueError(f"slice_multiple must be >= 1, got {self.slice_multiple}")
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0 (0: the whole slice at once), got {self.micro_batch}")
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
        return self.work_stealing == "on"  # "auto": off (the field's comment)

    def spins(self, pinned: bool) -> bool:
        """Whether a rank waits for gloo collectives by polling (``spin_wait`` resolved;
        ``pinned``: the rank has cores of its own, ``training.affinity.pinned_cores``)."""
        return self.spin_wait == "on" or (self.spin_wait == "auto" and pinned)

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
