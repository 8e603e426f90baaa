"""``kaitian train``'s command line: its options, the hosts' layout and the training configuration.

Kept apart from ``training.launch`` and free of torch, so that ``kaitian train --help`` and a
command-line mistake answer at once instead of after importing torch (about 2 s here).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kaitian_ros.ports import free_port
from kaitian_ros.training import netif

if TYPE_CHECKING:  # imports torch: at run time in config_from_args only
    from kaitian_ros.training.config import TrainingConfig


class ArgumentError(Exception):
    """A bad command line, in one line (``_Parser.error``)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump, no SystemExit(2)
        raise ArgumentError(message)


def train_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kaitian train", description="collaborative heterogeneous training")
    p.add_argument("--config", help="YAML file with TrainingConfig keys (ranks: N allowed)")
    p.add_argument("--ranks", "--nproc-per-node", dest="ranks", type=int,
                   help="number of ranks to spawn on this host")
    p.add_argument("--nnodes", type=int, default=1, help="hosts taking part, each running this command "
                                                         "with its own --node-rank (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index in [0, nnodes)")
    p.add_argument("--master-addr", help="address of node 0, where rank 0 hosts the rendezvous store "
                                         "(needed with --nnodes > 1)")
    p.add_argument("--master-port", type=int, help=f"its port (default: a free one on one host, "
                                                   f"{DEFAULT_MASTER_PORT} across hosts)")
    p.add_argument("--devices", help="comma list, one per rank (or one for all): cpu,cpu:b,cuda:0")
    p.add_argument("--slowdowns", help="comma list of emulated slowdown factors (>= 1) per rank")
    p.add_argument("--policy", choices=("adaptive", "equal", "profile_once"))
    p.add_argument("--epochs", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--model")
    p.add_argument("--dataset")
    p.add_argument("--image-size", type=int, help="resize images to this square size")
    p.add_argument("--lr", type=float)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"))
    p.add_argument("--optimizer", choices=("sgd", "adam"))
    p.add_argument("--standardize-inputs", action="store_true",
                   help="standardise images with the training set's mean and std")
    p.add_argument("--camera-inputs", action="store_true",
                   help="train on images as the inference nodes see camera frames of them "
                        "(uint8 pixels, their normalisation): for weights served with weights:=PATH")
    p.add_argument("--warmup-steps", type=int, help="linear lr warm-up steps")
    p.add_argument("--seed", type=int)
    p.add_argument("--work-stealing", choices=("auto", "on", "off"),
                   help="move slice boundaries inside a step (auto: off, measured slower here)")
    p.add_argument("--spin-wait", choices=("auto", "on", "off"),
                   help="wait for gloo collectives by polling (auto: where a rank has its own core)")
    p.add_argument("--slice-multiple", type=int,
                   help="slices in multiples of this many samples (default 8; 1: exact shares)")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--save-weights", metavar="PATH",
                   help="write the final model's state_dict here (what coordinator and compute "
                        "nodes load with weights:=PATH)")
    p.add_argument("--timeout", type=float, help="collective / failure timeout in seconds")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


@dataclass(frozen=True)
class Placement:
    """Where this host's ranks sit in the world: node ``node_rank`` of ``nnodes``, each host
    running ``ranks`` of them, all meeting at rank 0's store ``master_addr:master_port``."""

    nnodes: int
    node_rank: int
    ranks: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.ranks + local_rank

    def child_env(self, local_rank: int) -> dict[str, str]:
        """torchrun's environment for one of this host's ranks."""
        env = {"RANK": str(self.global_rank(local_rank)), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.ranks),
               "GROUP_RANK": str(self.node_rank), "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": str(self.master_port)}
        if self.nnodes > 1 and not os.environ.get("GLOO_SOCKET_IFNAME"):
            # gloo otherwise binds to what the host name resolves to, often loopback
            iface = netif.interface_toward(self.master_addr)
            if iface is not None:
                env["GLOO_SOCKET_IFNAME"] = iface
        return env


DEFAULT_MASTER_PORT = 29500  # torchrun's


def placement_from_args(a: argparse.Namespace, ranks: int) -> Placement:
    """The hosts' layout from --nnodes/--node-rank/--master-*; ValueError for a bad one."""
    if a.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        raise ValueError(f"--node-rank must be in [0, {a.nnodes}), got {a.node_rank}")
    if a.master_port is not None and not 0 < a.master_port < 65536:
        raise ValueError(f"--master-port must be a TCP port, got {a.master_port}")
    if a.nnodes == 1:
        return Placement(1, 0, ranks, a.master_addr or "127.0.0.1", a.master_port or free_port())
    if not a.master_addr:
        raise ValueError(f"--nnodes {a.nnodes} needs --master-addr: the address of node 0, where rank 0 "
                         "hosts the rendezvous store")
    return Placement(a.nnodes, a.node_rank, ranks, a.master_addr, a.master_port or DEFAULT_MASTER_PORT)


def config_from_args(a: argparse.Namespace) -> tuple[TrainingConfig, int]:
    from kaitian_ros.training.config import TrainingConfig

    d: dict[str, Any] = {}
    ranks = a.ranks
    if a.config:
        import yaml

        try:
            loaded = yaml.safe_load(Path(a.config).read_text()) or {}
        except OSError as e:
            raise ValueError(f"cannot read config {a.config}: {e.strerror}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config {a.config} must be a mapping")
        loaded = dict(loaded.get("training", loaded))  # allow a `training:` section
        if ranks is None and "ranks" in loaded:
            ranks = int(loaded["ranks"])
        loaded.pop("ranks", None)
        d.update(loaded)
    if a.devices:
        d["devices"] = tuple(x.strip() for x in a.devices.split(",") if x.strip())
    if a.slowdowns:
        try:
            d["emulated_slowdown"] = tuple(float(x) for x in a.slowdowns.split(","))
        except ValueError:
            raise ValueError(f"--slowdowns must be numbers, got {a.slowdowns!r}") from None
    for k_arg, k_cfg in (("policy", "policy"), ("epochs", "epochs"), ("global_batch", "global_batch"),
                         ("model", "model"), ("dataset", "dataset"), ("lr", "lr"),
                         ("image_size", "image_size"), ("lr_schedule", "lr_schedule"),
                         ("warmup_steps", "warmup_steps"), ("work_stealing", "work_stealing"),
                         ("spin_wait", "spin_wait"), ("optimizer", "optimizer"),
                         ("slice_multiple", "slice_multiple"),
                         ("seed", "seed"), ("checkpoint_dir", "checkpoint_dir"),
                         ("save_weights", "save_weights"),
                         ("timeout", "timeout_s")):
        v = getattr(a, k_arg)
        if v is not None:
            d[k_cfg] = v
    if a.resume:
        d["resume"] = True
    if a.standardize_inputs:
        d["standardize_inputs"] = True
    if a.camera_inputs:
        d["camera_inputs"] = True
    cfg = TrainingConfig.from_dict(d)
    if ranks is None:
        ranks = max(len(cfg.devices), len(cfg.emulated_slowdown))
    if ranks <= 0:
        raise ValueError("--ranks must be positive")
    world = ranks * max(a.nnodes, 1)  # the lists name every rank of the world, in rank order
    for name, lst in (("devices", cfg.devices), ("slowdowns", cfg.emulated_slowdown)):
        if len(lst) not in (1, world):
            raise ValueError(f"{len(lst)} {name} given for {world} ranks"
                             + (f" ({a.nnodes} hosts x {ranks}: list every rank of the world)"
                                if a.nnodes > 1 else ""))
    return cfg, ranks
