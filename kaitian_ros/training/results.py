"""What a training run reports: each step (:class:`TrainingStep`, the trainer node publishes it
as telemetry), each finished epoch and the run's result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
