"""trainer node end to end: `kaitian launch` of two trainer ranks, telemetry, live parameter."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import child_env, free_port, wait_until

pytestmark = pytest.mark.e2e

pytest.importorskip("sklearn")


def _scenario(tmp: Path, master_port: int, epochs: int) -> Path:
    common = {"executable": "trainer", "world_size": 2, "master_addr": "127.0.0.1",
              "master_port": master_port, "model": "digits_cnn", "dataset": "digits",
              "global_batch": 64, "epochs": epochs, "lr": 0.05, "policy": "adaptive",
              "rebalance_every": 3, "timeout_s": 30.0, "diagnostics_period_s": 0.5}
    data = {"trainer_0": {"ros__parameters": common | {"rank": 0, "device": "cpu:a",
                                                       "emulated_slowdown": 1.0}},
            "trainer_1": {"ros__parameters": common | {"rank": 1, "device": "cpu:b",
                                                       "emulated_slowdown": 1.0}}}
    path = tmp / "two_trainers.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _wait(pred: Any, timeout: float, what: str, proc: subprocess.Popen, out: list[str]) -> None:
    def done() -> bool:
        if pred():
            return True
        if proc.poll() is not None and not pred():
            raise AssertionError(f"launch ended (code {proc.returncode}) before {what}:\n" + "".join(out[-40:]))
        return False

    try:
        wait_until(done, what, timeout, interval_s=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n" + "".join(out[-40:])) from None


@pytest.mark.slow
def test_two_trainer_nodes_via_kaitian_launch(tmp_path: Path) -> None:
    from kaitian_ros import cli
    from kaitian_ros.runtime.graph_client import GraphClient, GraphError

    router = f"tcp/127.0.0.1:{free_port()}"
    # 24 epochs x 22 steps: long enough (several seconds on 2 shared cores) to retune it live
    scenario = _scenario(tmp_path, free_port(), epochs=24)
    env = child_env(router)
    proc = subprocess.Popen([sys.executable, "-m", "kaitian_ros.cli", "--router", router,
                             "launch", str(scenario)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    pump = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")),
                            daemon=True)
    pump.start()
    msgs: list[Any] = []
    diags: list[Any] = []
    lock = threading.Lock()
    client = None
    try:
        def connected() -> GraphClient | None:
            try:
                return GraphClient(router)
            except GraphError:
                assert proc.poll() is None, "".join(out)
                return None

        client = wait_until(connected, f"a GraphClient on {router}", interval_s=0.2)

        def on_tel(msg: Any, size: int) -> None:
            if msg is not None:
                with lock:
                    msgs.append(msg)

        def on_diag(msg: Any, size: int) -> None:
            if msg is not None:
                with lock:
                    diags.extend(msg.status)

        client.subscribe("/kaitian/training/telemetry", "TrainingTelemetry", on_tel)
        client.subscribe("/diagnostics", "DiagnosticArray", on_diag)

        def ranks_seen() -> set[int]:
            with lock:
                return {int(m.rank) for m in msgs}

        _wait(lambda: ranks_seen() == {0, 1}, 40, "telemetry from both ranks", proc, out)

        # live retune of rank 1, through the same code as `kaitian param set`
        assert cli.main(["--router", router, "param", "set", "/trainer_1",
                         "emulated_slowdown", "2.0"]) == 0

        def retuned() -> bool:
            with lock:
                return any(int(m.rank) == 1 and m.emulated and m.emulated_slowdown == 2.0
                           for m in msgs)

        _wait(retuned, 20, "rank 1 telemetry with emulated slowdown 2.0", proc, out)
        assert proc.wait(timeout=40) == 0, "".join(out)
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=15)
        pump.join(timeout=5)
    text = "".join(out)
    assert "[launch] all nodes finished" in text, text
    assert "training finished" in text

    with lock:
        by_step: dict[int, dict[int, Any]] = {}
        for m in msgs:
            by_step.setdefault(int(m.step), {})[int(m.rank)] = m
    both = {s: v for s, v in by_step.items() if len(v) == 2}
    assert len(both) >= 10
    for per_rank in both.values():
        # the two slices of a step partition the global batch
        assert per_rank[0].local_batch + per_rank[1].local_batch == per_rank[0].global_batch
        assert per_rank[0].global_batch == per_rank[1].global_batch <= 64
    # before the retune nothing was emulated; after it rank 1 says so, rank 0 never does
    r1 = [both[s][1] for s in sorted(both)]
    assert not r1[0].emulated and r1[0].emulated_slowdown == 1.0
    assert not any(both[s][0].emulated for s in both)
    assert all(m.device in ("cpu:a", "cpu:b") for v in both.values() for m in v.values())
    # the slowed rank ends with the smaller share (adaptive policy), checked on the last full
    # batch (the epoch's 3-sample tail is split by the same shares)
    last = both[max(s for s in both if both[s][0].global_batch == 64)]
    assert last[1].local_batch < last[0].local_batch, (last[0].local_batch, last[1].local_batch)
    with lock:
        names = {d.name for d in diags}
    assert {"kaitian: trainer_0", "kaitian: trainer_1"} <= names, names
    with lock:
        final = [d for d in diags if d.message.startswith("finished")]
    assert final and all(d.level == 0 for d in final)


def test_rank_from_parameters_or_torchrun_environment() -> None:
    from kaitian_ros.nodes.trainer import PARAMETERS, rank_environment, training_config

    params = {p.name: p.default for p in PARAMETERS}
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_PORT": "29400", "MASTER_ADDR": "10.0.0.1",
           "LOCAL_RANK": "0"}
    assert rank_environment(params, env) == {"rank": 2, "world_size": 3, "local_rank": 0,
                                             "master_addr": "10.0.0.1", "master_port": 29400}
    # parameters win over the environment
    mine = params | {"rank": 1, "world_size": 2, "master_port": 29501, "master_addr": "h"}
    assert rank_environment(mine, env) == {"rank": 1, "world_size": 2, "local_rank": 0,
                                           "master_addr": "h", "master_port": 29501}
    with pytest.raises(ValueError, match="rank, world_size, master_port not set"):
        rank_environment(params, {})
    with pytest.raises(ValueError, match="outside world"):
        rank_environment(params | {"rank": 3, "world_size": 3, "master_port": 1}, {})
    cfg = training_config(params | {"device": "cpu:b", "emulated_slowdown": 2.5,
                                    "policy": "profile_once", "max_steps": 0})
    assert cfg.devices == ("cpu:b",) and cfg.slowdown_for(5) == 2.5
    assert cfg.policy == "profile_once" and cfg.max_steps is None and cfg.checkpoint_dir is None
