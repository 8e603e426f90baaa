"""trainer node: one rank of collaborative heterogeneous training as a ROS 2 node (docs/training.md).

ROS is only the control plane here. Gradients travel over torch.distributed (gloo / the
vendor backend, ``kaitian_ros.training``); the node publishes one ``TrainingTelemetry`` per
training step on ``/kaitian/training/telemetry``, a ``/diagnostics`` status every
``diagnostics_period_s``, and takes parameters:

* ``emulated_slowdown`` (>= 1.0, live): this rank behaves like a device that many times
  slower (after each step's real compute it sleeps (s-1) x that compute); applied through
  :meth:`RankTrainer.set_emulated_slowdown` from the next step on. Telemetry says so.
* the training configuration (model, dataset, global_batch, epochs, policy, ...),
  read-only: every rank must use the same values.

Rank and rendezvous: parameters ``rank``, ``world_size``, ``master_addr``, ``master_port``;
a ``rank``/``world_size``/``master_port`` left at its "unset" value (-1 / 0 / 0) comes from
the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ``LOCAL_RANK``), so the
same node runs from a scenario file (``kaitian launch hetero_training``) or under torchrun.

Threads: training runs in a worker thread (it blocks in collectives); the runtime spins on
the main thread and runs every callback there. The worker hands step records over a
``queue.SimpleQueue``; a timer on the spin thread drains it and publishes, so publishing
never happens concurrently with other callbacks. When training ends the node publishes a
final status and shuts the runtime down: exit code 0 after success, 1 after a failure
(e.g. a peer rank died: the message names it).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Any

from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime, SetParametersResult
from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher, Level

TELEMETRY_TOPIC = "/kaitian/training/telemetry"
_POLICIES = ("adaptive", "equal", "profile_once")
_HOOKS = ("hierarchical", "flat")

PARAMETERS = (
    # live
    P("emulated_slowdown", T.DOUBLE, 1.0,
      "emulate a device this many times slower (sleep (s-1) x real compute per step)", 1.0, 1000.0),
    P("stall_timeout_s", T.DOUBLE, 10.0, "diagnostics WARN when no step finished for this long",
      0.1, 3600.0),
    P("diagnostics_period_s", T.DOUBLE, 1.0, "seconds between /diagnostics reports", 0.05, 60.0),
    # rank / rendezvous (read-only)
    P("rank", T.INTEGER, -1, "torch.distributed rank (-1: from $RANK)", -1, 65535, read_only=True),
    P("world_size", T.INTEGER, 0, "number of ranks (0: from $WORLD_SIZE)", 0, 65536, read_only=True),
    P("local_rank", T.INTEGER, -1, "index among this host's ranks (-1: $LOCAL_RANK or rank)",
      -1, 65535, read_only=True),
    P("master_addr", T.STRING, "", "rendezvous host (rank 0's; '': $MASTER_ADDR or 127.0.0.1)",
      read_only=True),
    P("master_port", T.INTEGER, 0, "rendezvous TCP port (0: from $MASTER_PORT)", 0, 65535,
      read_only=True),
    P("device", T.STRING, "cpu", "this rank's device: cpu, cuda:0, or cpu:<tag> to emulate a "
      "device type on the CPU", read_only=True),
    P("threads", T.INTEGER, 1, "torch intra-op threads of this rank", 1, 1024, read_only=True),
    # training configuration (read-only, identical on every rank)
    P("model", T.STRING, "digits_cnn", "model name (kaitian_ros.core.models)", read_only=True),
    P("dataset", T.STRING, "digits", "'digits' or 'package.module:callable'", read_only=True),
    P("image_size", T.INTEGER, 0, "resize images to this square size (0: as the dataset has "
      "them)", 0, 4096, read_only=True),
    P("global_batch", T.INTEGER, 64, "samples per step over all ranks", 1, 2**31 - 1,
      read_only=True),
    P("epochs", T.INTEGER, 5, "epochs to train", 1, 2**31 - 1, read_only=True),
    P("max_steps", T.INTEGER, 0, "stop after this many steps (0: no limit)", 0, 2**31 - 1,
      read_only=True),
    P("lr", T.DOUBLE, 0.05, "SGD learning rate", 0.0, 1e6, read_only=True),
    P("momentum", T.DOUBLE, 0.9, "SGD momentum", 0.0, 1.0, read_only=True),
    P("lr_schedule", T.STRING, "constant", "learning-rate schedule", read_only=True,
      choices=("constant", "cosine")),
    P("optimizer", T.STRING, "sgd", "sgd (with momentum) or adam", read_only=True,
      choices=("sgd", "adam")),
    P("standardize_inputs", T.BOOL, False, "standardise images with the training set's "
      "mean and std", read_only=True),
    P("camera_inputs", T.BOOL, False, "train on images as the inference nodes see camera frames "
      "of them (uint8 pixels, their normalisation)", read_only=True),
    P("warmup_steps", T.INTEGER, 0, "linear lr warm-up steps", 0, 2**31 - 1, read_only=True),
    P("seed", T.INTEGER, 0, "seed of weights and sample order", 0, 2**31 - 1, read_only=True),
    P("policy", T.STRING, "adaptive", "batch split policy", read_only=True, choices=_POLICIES),
    P("work_stealing", T.STRING, "auto", "move slice boundaries inside a step to the rank "
      "that finishes first (auto: off, measured slower)", read_only=True,
      choices=("auto", "on", "off")),
    P("spin_wait", T.STRING, "auto", "wait for gloo collectives by polling instead of blocking "
      "(auto: where the rank was pinned to a core of its own)", read_only=True,
      choices=("auto", "on", "off")),
    P("micro_batch", T.INTEGER, 0, "forward/backward passes of at most this many samples, the "
      "gradient accumulated (0: the whole slice; not with work stealing)", 0, 2**31 - 1, read_only=True),
    P("rebalance_every", T.INTEGER, 5, "steps between share updates", 1, 2**31 - 1,
      read_only=True),
    P("slice_multiple", T.INTEGER, 8, "slices in multiples of this many samples, where every "
      "rank gets that many (few new input shapes as shares move; 1: exact shares)", 1, 2**31 - 1,
      read_only=True),
    P("ewma_alpha", T.DOUBLE, 0.5, "EWMA weight of the newest step time", 0.01, 1.0,
      read_only=True),
    P("hook", T.STRING, "hierarchical", "gradient all-reduce", read_only=True, choices=_HOOKS),
    P("checkpoint_dir", T.STRING, "", "rank 0 saves checkpoint.pt here per epoch ('': none)",
      read_only=True),
    P("save_weights", T.STRING, "", "rank 0 writes the final state_dict here, the file inference "
      "nodes load with weights:=PATH ('': none)", read_only=True),
    P("resume", T.BOOL, False, "continue from the checkpoint", read_only=True),
    P("timeout_s", T.DOUBLE, 60.0, "collective / rendezvous timeout (failure detection)", 1.0,
      86400.0, read_only=True),
    P("telemetry_topic", T.STRING, TELEMETRY_TOPIC, "TrainingTelemetry output", read_only=True),
)

_CONFIG_KEYS = ("model", "dataset", "global_batch", "epochs", "lr", "momentum", "lr_schedule",
                "warmup_steps", "seed", "policy", "work_stealing", "spin_wait", "micro_batch", "optimizer",
                "standardize_inputs", "camera_inputs",
                "rebalance_every", "slice_multiple", "ewma_alpha", "hook", "timeout_s")


def rank_environment(params: dict[str, Any], environ: Any = None) -> dict[str, Any]:
    """rank, world_size, local_rank, master_addr, master_port from parameters, else the env.

    Raises ValueError naming what is missing or inconsistent.
    """
    env = os.environ if environ is None else environ

    def pick(param: str, unset: Any, var: str) -> Any:
        if params[param] != unset:
            return params[param]
        if var in env:
            try:
                return int(env[var]) if isinstance(unset, int) else env[var]
            except ValueError:
                raise ValueError(f"${var}={env[var]!r} is not an integer") from None
        return None

    rank = pick("rank", -1, "RANK")
    world = pick("world_size", 0, "WORLD_SIZE")
    port = pick("master_port", 0, "MASTER_PORT")
    missing = [n for n, v in (("rank", rank), ("world_size", world), ("master_port", port))
               if v is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: give the parameter(s) or the torchrun "
                         "environment (RANK, WORLD_SIZE, MASTER_PORT)")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    local = params["local_rank"] if params["local_rank"] >= 0 else int(env.get("LOCAL_RANK", rank))
    addr = params["master_addr"] or env.get("MASTER_ADDR", "127.0.0.1")
    return {"rank": int(rank), "world_size": int(world), "local_rank": int(local),
            "master_addr": str(addr), "master_port": int(port)}


def training_config(params: dict[str, Any]) -> Any:
    """The TrainingConfig of this rank from its parameters (ValueError if invalid)."""
    from kaitian_ros.training.config import TrainingConfig

    d = {k: params[k] for k in _CONFIG_KEYS}
    d["devices"] = (params["device"],)
    d["emulated_slowdown"] = (params["emulated_slowdown"],)
    d["checkpoint_dir"] = params["checkpoint_dir"] or None
    d["save_weights"] = params["save_weights"] or None
    d["resume"] = params["resume"]
    d["max_steps"] = params["max_steps"] or None
    d["image_size"] = params["image_size"] or None
    return TrainingConfig.from_dict(d)


class TrainerNode:
    """One training rank: worker thread trains, the spin thread publishes and serves params."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        self.dist = rank_environment(self.params)
        self.config = training_config(self.params)  # ValueError -> run_node exits 2
        self.rank = self.dist["rank"]
        self.pub = rt.create_publisher(self.params["telemetry_topic"], "TrainingTelemetry",
                                       QoS.RELIABLE)
        self.diagnostics = DiagnosticsPublisher(rt, hardware_id=self.params["device"])
        rt.add_on_set_parameters_callback(self._on_set)

        self._lock = threading.Lock()  # guards _trainer/_slowdown hand-over with the worker
        self._trainer: Any = None
        self._slowdown = float(self.params["emulated_slowdown"])
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self.error: str | None = None
        self.result: Any = None
        self.phase = "rendezvous"
        self.last: Any = None  # last published TrainingStep
        self.steps_published = 0
        self.started = time.monotonic()
        self.last_step_at: float | None = None
        self._finished_reported = False
        self._last_report = 0.0

        self.worker = threading.Thread(target=self._work, name="kaitian-trainer", daemon=True)
        self.timer = rt.create_timer(0.05, self._tick)
        rt.logger.info(
            f"rank {self.rank}/{self.dist['world_size']} on {self.params['device']} "
            f"(emulated slowdown {self._slowdown:g}{' EMULATED' if self._slowdown != 1 else ''}), "
            f"policy {self.config.policy}, rendezvous {self.dist['master_addr']}:"
            f"{self.dist['master_port']}")
        self.worker.start()

    # -- parameters (spin thread) ------------------------------------------------------
    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        if "emulated_slowdown" in changes:
            s = float(changes["emulated_slowdown"])
            with self._lock:
                self._slowdown = s
                if self._trainer is not None:
                    self._trainer.set_emulated_slowdown(s)
            self.rt.logger.info(f"emulated slowdown {s:g} from the next step on"
                                + (" (EMULATED speed)" if s != 1.0 else ""))
        if "diagnostics_period_s" in changes or "stall_timeout_s" in changes:
            pass  # read on every tick
        self.params = dict(self.params) | changes
        return SetParametersResult(True)

    # -- worker thread -----------------------------------------------------------------
    def _work(self) -> None:
        import torch
        import torch.distributed as dist

        from kaitian_ros.training.process_group import DistEnv, init_distributed, shutdown_distributed
        from kaitian_ros.training.trainer import RankTrainer

        torch.set_num_threads(int(self.params["threads"]))
        d = self.dist
        env = DistEnv(rank=d["rank"], world_size=d["world_size"], local_rank=d["local_rank"],
                      master_addr=d["master_addr"], master_port=d["master_port"])
        hb = None
        try:
            hb = init_distributed(env, timeout_s=self.config.timeout_s)
            trainer = RankTrainer(self.config, local_rank=env.local_rank,
                                  on_step=self._steps.put)
            with self._lock:
                trainer.set_emulated_slowdown(self._slowdown)
                self._trainer = trainer
            self.phase = "training"
            self.result = trainer.run()
            dist.barrier()
            shutdown_distributed(hb)
            self.phase = "finished"
        except BaseException as e:  # noqa: BLE001 - report anything, never hang silently
            first = str(e).splitlines()[0] if str(e) else ""
            msg = f"rank {env.rank}: {type(e).__name__}: {first}"
            if hb is not None and isinstance(e, RuntimeError):
                why = hb.diagnose()
                if not why.startswith("no peer"):
                    msg = f"rank {env.rank}: aborting, {why} ({type(e).__name__})"
            self.error = msg
            self.phase = "failed"
            shutdown_distributed(hb, "aborting")
        finally:
            self._done.set()

    # -- spin thread -------------------------------------------------------------------
    def _telemetry(self, s: Any) -> Any:
        return interfaces.make(
            "TrainingTelemetry", header=interfaces.header(self.rt.node_name), rank=s.rank,
            device=s.device, emulated=bool(s.emulated), emulated_slowdown=float(s.slowdown),
            epoch=s.epoch, step=s.step, local_batch=s.local_batch, global_batch=s.global_batch,
            share=float(s.share), step_ms=float(s.step_ms), compute_ms=float(s.compute_ms),
            comm_ms=float(s.comm_ms), loss=float(s.loss),
            samples_per_s=s.global_batch / (s.step_ms / 1e3) if s.step_ms > 0 else 0.0)

    def _tick(self) -> None:
        done = self._done.is_set()  # read before draining: no step can follow it
        while True:
            try:
                s = self._steps.get_nowait()
            except queue.Empty:
                break
            self.pub.publish(self._telemetry(s))
            self.last, self.last_step_at = s, time.monotonic()
            self.steps_published += 1
        now = time.monotonic()
        if done and not self._finished_reported:
            self._finished_reported = True
            self._report()
            if self.error:
                self.rt.logger.error(f"training failed: {self.error}")
            else:
                r = self.result
                self.rt.logger.info(
                    f"training finished: {r.steps} steps, {r.epochs_completed} epochs, test "
                    f"accuracy {r.test_accuracy:.4f}, {r.samples_per_s:.0f} samples/s, final "
                    f"shares {[round(x, 3) for x in r.final_shares]}"
                    + (f", weights in {self.config.save_weights}"
                       if self.config.save_weights and self.rank == 0 else ""))
            self.rt.shutdown()
            return
        if now - self._last_report >= self.params["diagnostics_period_s"]:
            self._report()

    def status(self) -> tuple[Level, str, dict[str, Any]]:
        """The current /diagnostics level, message and values."""
        now = time.monotonic()
        s = self._slowdown
        values: dict[str, Any] = {
            "rank": self.rank, "world_size": self.dist["world_size"],
            "device": self.params["device"], "policy": self.config.policy, "phase": self.phase,
            "emulated": s != 1.0, "emulated_slowdown": s, "steps": self.steps_published}
        last = self.last
        if last is not None:
            values |= {"epoch": last.epoch, "step": last.step, "local_batch": last.local_batch,
                       "share": f"{last.share:.3f}", "step_ms": f"{last.step_ms:.1f}",
                       "comm_ms": f"{last.comm_ms:.1f}", "loss": f"{last.loss:.4f}"}
        emu = " (EMULATED speed)" if s != 1.0 else ""
        if self.phase == "failed":
            return Level.ERROR, f"failed: {self.error}", values
        if self.phase == "finished" and self.result is not None:
            values["test_accuracy"] = f"{self.result.test_accuracy:.4f}"
            return Level.OK, (f"finished: {self.result.steps} steps, test accuracy "
                              f"{self.result.test_accuracy:.4f}"), values
        stall = self.params["stall_timeout_s"]
        since = now - (self.last_step_at if self.last_step_at is not None else self.started)
        if self.phase == "rendezvous":
            level = Level.WARN if since > stall else Level.OK
            return level, (f"waiting for {self.dist['world_size']} ranks at "
                           f"{self.dist['master_addr']}:{self.dist['master_port']} "
                           f"({since:.0f} s)"), values
        if since > stall:
            return Level.WARN, f"stalled: no step for {since:.1f} s{emu}", values
        if last is None:
            return Level.OK, f"training started{emu}", values
        return Level.OK, (f"epoch {last.epoch} step {last.step}: {last.local_batch}/"
                          f"{last.global_batch} samples, {last.step_ms:.1f} ms/step{emu}"), values

    def _report(self) -> None:
        self._last_report = time.monotonic()
        level, text, values = self.status()
        self.diagnostics.publish(level, text, values)

    def close(self) -> None:
        self.timer.cancel()


def main(argv: list[str] | None = None) -> int:
    box: dict[str, TrainerNode] = {}

    def factory(rt: Runtime) -> TrainerNode:
        box["node"] = node = TrainerNode(rt)
        return node

    code = run_node(factory, "trainer", argv)
    node = box.get("node")
    if node is None:
        return code
    if node.error is not None:
        code = 1
    if node.worker.is_alive():
        # Interrupted (SIGINT/SIGTERM) mid-training: the worker may be blocked inside a
        # collective that cannot be cancelled, and interpreter shutdown would wait on it.
        # Peers notice the missing heartbeat and fail naming this rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
