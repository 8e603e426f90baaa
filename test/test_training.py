"""Training loop end to end: accuracy parity, failure of a rank, checkpoint/resume, CLI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import pid_running, wait_until

from kaitian_ros.training import launch
from kaitian_ros.training.config import TrainingConfig
from kaitian_ros.training.launch import main_train
from kaitian_ros.training.local_ranks import run_local
from kaitian_ros.training.results import TrainingStep
from kaitian_ros.training.trainer import RankTrainer


def _train(rank: int, world: int, cfg: TrainingConfig) -> dict:
    steps: list[TrainingStep] = []
    tr = RankTrainer(cfg, on_step=steps.append)
    res = tr.run()
    out = res.summary()
    out["local_batches"] = [s.local_batch for s in steps]
    out["emulated"] = [s.emulated for s in steps]
    return out



@pytest.mark.e2e
def test_adaptive_three_ranks_matches_single_process_accuracy() -> None:
    """Same global batches in the same order, exact weighting -> same model, same accuracy."""
    # cosine to 0: at a constant lr the final accuracy moved by 2 test samples (0.44 pp) with the
    # float summation order of the timing-dependent split alone (1 run in 5-6 failed, also before
    # this change); with the lr decayed the final model is settled (14 of 14 runs passed)
    base = dict(epochs=4, global_batch=64, seed=3, rebalance_every=3, lr=0.05, lr_schedule="cosine")
    single = run_local(_train, 1, TrainingConfig(**base), timeout_s=60)[0]
    cfg = TrainingConfig(**base, policy="adaptive", devices=("cpu:a", "cpu:b", "cpu:b"),
                         emulated_slowdown=(1.0, 3.0, 1.0))
    multi = run_local(_train, 3, cfg, timeout_s=60)
    # every rank's own view agrees (identical parameters after every epoch)
    assert len({m["test_accuracy"] for m in multi}) == 1
    assert abs(multi[0]["test_accuracy"] - single["test_accuracy"]) <= 0.003
    assert single["test_accuracy"] > 0.85  # it actually learned
    # the slow rank's share was reduced and its steps are flagged as emulated
    assert multi[0]["final_shares"][1] < multi[0]["final_shares"][0]
    assert all(multi[1]["emulated"]) and not any(multi[0]["emulated"])
    assert len(set(multi[0]["local_batches"])) > 1  # batches were rebalanced


# exec'ed with SIGINT ignored, as a shell starts a background job, and held back on top
SIGINT_IGNORED_AND_BLOCKED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                              "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
                              "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _spawn(args: list[str], env_extra: dict[str, str], sigint_ignored: bool = False) -> subprocess.Popen:
    env = dict(os.environ, KAITIAN_THREADS="1", **env_extra)
    prefix = ["-c", SIGINT_IGNORED_AND_BLOCKED, "-m"] if sigint_ignored else ["-m"]
    return subprocess.Popen([sys.executable, *prefix, "kaitian_ros.training.launch", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _process_state(pid: int) -> str:
    """A process's state, signal masks and kernel wait channel from /proc (for a failure message)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"{pid}: gone ({e.strerror})"
    keep = ("Name", "State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return f"{pid}: " + ", ".join(line for line in status if line.split(":")[0] in keep) + f", wchan {wchan}"


def _children(pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's children (read from /proc): CPU ranks are forks named
    kaitian-rankN; a rank started as a fresh interpreter has RANK in its environment."""
    out: dict[int, int] = {}
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        try:
            comm = Path(f"/proc/{k}/comm").read_text().strip()
            env = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if comm.startswith("kaitian-rank"):
            out[int(comm.removeprefix("kaitian-rank"))] = int(k)
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(k)
    return out


@pytest.mark.slow
@pytest.mark.e2e
def test_killed_rank_is_named_and_others_fail_then_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    args = ["--ranks", "3", "--devices", "cpu:a,cpu:b,cpu:b", "--epochs", "500",
            "--global-batch", "64", "--checkpoint-dir", str(ck), "--timeout", "20"]
    p = _spawn(args, {})
    try:
        def checkpointed() -> bool:
            assert p.poll() is None, p.communicate()[1]
            return (ck / "checkpoint.pt").exists()

        # a liveness bound (3 ranks start, import torch and train an epoch on 2 busy cores)
        wait_until(checkpointed, "a checkpoint", 120.0, interval_s=0.2)
        kids = _children(p.pid)
        assert sorted(kids) == [0, 1, 2]
        os.kill(kids[2], signal.SIGKILL)
        t_kill = time.monotonic()
        _, err = p.communicate(timeout=40)  # the run must end, not hang
        elapsed = time.monotonic() - t_kill
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert elapsed < 30, elapsed
    lines = [ln for ln in err.splitlines() if ln.startswith("kaitian train:")]
    # the launcher names the dead rank ...
    assert any("rank 2 (cpu:b) died (signal 9)" in ln for ln in lines), err
    # ... and so does each survivor, on its own (this is what works across hosts too)
    for r in (0, 1):
        assert any(ln.startswith(f"kaitian train: rank {r}: aborting, rank 2") for ln in lines), err
    assert "Traceback" not in err

    # resume from the checkpoint on 2 ranks and finish
    ep = torch.load(ck / "checkpoint.pt", weights_only=False)["epoch"]
    (tmp_path / "tmp").mkdir()
    p2 = _spawn(["--ranks", "2", "--devices", "cpu", "--epochs", str(ep + 2), "--global-batch",
                 "64", "--checkpoint-dir", str(ck), "--resume", "--json"],
                {"TMPDIR": str(tmp_path / "tmp")})
    out, err2 = p2.communicate(timeout=90)
    assert p2.returncode == 0, err2
    res = json.loads(out.strip().splitlines()[-1])
    assert res["epochs_completed"] == ep + 2
    assert len(res["accuracy_per_epoch"]) == ep + 2  # history carried over from the checkpoint
    # rank 0 told the epochs on stderr (the last one always), stdout kept for the result
    assert f"[progress] kaitian train epochs: {ep + 2}/{ep + 2} - test acc " in err2, err2
    assert "[progress]" not in out
    assert not list((tmp_path / "tmp").glob("kaitian-train-*"))  # results read, folder removed


@pytest.mark.parametrize("step", ["tie_own_group", "name_process"])
def test_a_ctrl_c_while_a_forked_rank_sets_itself_up_ends_it_with_130_not_a_traceback(monkeypatch, step):
    """The forwarded SIGINT can come before the rank runs (a clean-clone CI run caught one
    between naming the process and starting the rank). The process-group and naming calls are
    replaced by stand-ins here: the real ones would act on the test process."""
    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "tie_own_group", lambda: None)
    monkeypatch.setattr(launch, "name_process", lambda _name: None)
    monkeypatch.setattr(launch, step, interrupted)
    monkeypatch.setattr(launch, "_rank_main", lambda _cfg: pytest.fail("the rank ran after the Ctrl-C"))
    with pytest.raises(SystemExit) as ended:
        launch._forked_rank_main(None, {"RANK": "0"})
    assert ended.value.code == 130


@pytest.mark.e2e
def test_ctrl_c_stops_the_forked_ranks_in_one_line(tmp_path: Path) -> None:
    """CPU ranks are forks of `kaitian train` named kaitian-rankN; Ctrl-C (SIGINT to it) ends
    them all: exit 130, one line, no rank's traceback, no rank left, no temporary folder. Also
    when it was started with SIGINT ignored and blocked: a launcher that inherits that goes on
    training after the SIGINT, as this test saw twice in full suite runs (cause there unknown)."""
    p = _spawn(["--ranks", "2", "--devices", "cpu", "--epochs", "500", "--global-batch", "64"],
               {"TMPDIR": str(tmp_path)}, sigint_ignored=True)
    kids: dict[int, int] = {}  # the finally below kills them also when waiting for them failed
    try:
        kids = wait_until(lambda: _children(p.pid) if len(_children(p.pid)) == 2 else None, "two ranks", 60.0)
        assert sorted(Path(f"/proc/{k}/comm").read_text().strip() for k in kids.values()) == \
            ["kaitian-rank0", "kaitian-rank1"]
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            # say in what state the launcher and its ranks were (signal masks, where they wait)
            raise AssertionError("no exit 40 s after SIGINT:\n" + "\n".join(
                _process_state(pid) for pid in (p.pid, *kids.values()))) from None
    finally:
        if p.poll() is None:
            p.kill()
            for k in kids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "kaitian train: interrupted" and "Traceback" not in err, err
    assert not any(pid_running(k) for k in kids.values())
    assert not list(tmp_path.glob("kaitian-train-*"))  # the ranks' result folder went with them


@pytest.mark.e2e
def test_worker_alone_names_missing_peer_on_timeout(tmp_path: Path) -> None:
    """torchrun-style rank whose peer is killed: fails naming it (no launcher watching)."""
    from kaitian_ros.ports import free_port

    port = str(free_port())
    ck = tmp_path / "ck"
    common = ["--devices", "cpu", "--epochs", "500", "--checkpoint-dir", str(ck),
              "--timeout", "15"]
    ps = [_spawn(common, {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]
    try:
        def checkpointed() -> bool:
            assert ps[0].poll() is None and ps[1].poll() is None
            return (ck / "checkpoint.pt").exists()

        wait_until(checkpointed, "a checkpoint", 60.0, interval_s=0.2)
        ps[1].kill()
        _, err = ps[0].communicate(timeout=40)
    finally:
        for q in ps:
            if q.poll() is None:
                q.kill()
    assert ps[0].returncode != 0
    assert "rank 0: aborting, rank 1 (cpu) stopped responding" in err, err


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_train(["--policy", "fastest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kaitian train: error:")
    assert main_train(["--ranks", "3", "--devices", "cpu,cpu"]) == 2
    assert "2 devices given for 3 ranks" in capsys.readouterr().err
    assert main_train(["--slowdowns", "0.5"]) == 2
    assert main_train(["--config", "/nonexistent.yaml"]) == 2


def test_help_and_mistakes_answer_before_torch_is_imported() -> None:
    """--help and a bad option are answered from the parser alone: importing torch first took 2 s."""
    code = ("import sys\n"
            "from kaitian_ros.cli import main\n"
            "try:\n"
            "    rc = main(sys.argv[1:])\n"
            "except SystemExit as e:  # argparse's --help\n"
            "    rc = e.code\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported', rc)\n")
    for argv, rc in ((["train", "--help"], 0), (["train", "--epochs", "x"], 2)):
        r = subprocess.run([sys.executable, "-c", code, *argv], check=False, capture_output=True, text=True,
                           timeout=60)
        assert r.stdout.strip().splitlines()[-1] == f"torch not imported {rc}", (r.stdout, r.stderr)
        if rc == 0:
            assert "usage: kaitian train" in r.stdout
    assert r.stderr.strip().startswith("kaitian train: error: argument --epochs"), r.stderr


def test_config_roundtrip_and_validation() -> None:
    c = TrainingConfig.from_dict({"devices": ["cpu:a", "cpu:b"], "emulated_slowdown": [1, 3]})
    assert c.devices == ("cpu:a", "cpu:b") and c.emulated_slowdown == (1.0, 3.0)
    assert TrainingConfig.from_dict(c.to_dict()) == c
    assert TrainingConfig(devices=("cuda",)).device_for(1, local_rank=1) == "cuda:1"
    with pytest.raises(ValueError):
        TrainingConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError):
        TrainingConfig(policy="x")


def test_lr_schedule_and_image_size() -> None:
    from kaitian_ros.training.config import lr_at
    from kaitian_ros.training.data import load_data

    const = TrainingConfig(lr=0.1)
    assert [lr_at(const, k, 3) for k in (0, 7, 100)] == [0.1, 0.1, 0.1]
    warm = TrainingConfig(lr=0.1, warmup_steps=4)
    assert [round(lr_at(warm, k, 3), 6) for k in range(6)] == [0.025, 0.05, 0.075, 0.1, 0.1, 0.1]
    cos = TrainingConfig(lr=0.2, epochs=10, lr_schedule="cosine")  # 30 steps
    assert lr_at(cos, 0, 3) == pytest.approx(0.2)
    assert lr_at(cos, 15, 3) == pytest.approx(0.1)
    assert lr_at(cos, 30, 3) == pytest.approx(0.0, abs=1e-12)
    assert all(lr_at(cos, k + 1, 3) <= lr_at(cos, k, 3) for k in range(30))
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainingConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainingConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="image_size"):
        TrainingConfig(image_size=2)
    d = load_data("digits", None, 16)
    assert tuple(d.train[0].shape[1:]) == (1, 16, 16) and tuple(d.test[0].shape[1:]) == (1, 16, 16)
    assert float(d.train[0].min()) >= 0.0 and float(d.train[0].max()) <= 1.0 + 1e-6


def _slowdown_live(rank: int, world: int, cfg: TrainingConfig) -> list[tuple[float, bool]]:
    holder: dict[str, RankTrainer] = {}

    def on_step(s: TrainingStep) -> None:
        if s.step == 2 and rank == 1:
            holder["t"].set_emulated_slowdown(2.0)  # what a ROS parameter callback does

    holder["t"] = RankTrainer(cfg, on_step=on_step)
    return [(h.slowdown, h.emulated) for h in holder["t"].run().history]


def test_slowdown_is_settable_at_run_time() -> None:
    cfg = TrainingConfig(epochs=1, max_steps=5, devices=("cpu:a", "cpu:b"))
    out = run_local(_slowdown_live, 2, cfg, timeout_s=60)
    assert out[1] == [(1.0, False)] * 3 + [(2.0, True)] * 2
    assert all(s == (1.0, False) for s in out[0])


def test_optimizer_standardised_inputs_and_work_stealing_options() -> None:
    from kaitian_ros.training.data import load_data

    with pytest.raises(ValueError, match="optimizer"):
        TrainingConfig(optimizer="rmsprop")
    with pytest.raises(ValueError, match="work_stealing"):
        TrainingConfig(work_stealing="sometimes")
    assert not TrainingConfig(policy="adaptive").steals  # auto: off, measured slower
    assert not TrainingConfig(policy="equal").steals
    assert TrainingConfig(policy="equal", work_stealing=True).steals  # YAML true
    assert not TrainingConfig(policy="adaptive", work_stealing="off").steals
    d = load_data("digits", None, 16, standardize=True)
    x = d.train[0]
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1.0) < 1e-4
    raw = load_data("digits", None, 16)
    # the test set uses the training statistics: same affine map on both
    scale = float(raw.train[0].std())
    shift = float(raw.train[0].mean())
    assert torch.allclose(d.test[0], (raw.test[0] - shift) / scale, atol=1e-5)


def _train_counting_gathers(rank: int, world: int, cfg: TrainingConfig) -> dict:
    class CountingGathers(RankTrainer):
        """The product's trainer; counts its all-gathers of its own (outside the comm hook)."""
        gathers = 0

        def _gather(self, x):  # type: ignore[no-untyped-def]
            CountingGathers.gathers += 1
            return super()._gather(x)

    steps: list[TrainingStep] = []
    res = CountingGathers(cfg, on_step=steps.append).run()
    return {"gathers": CountingGathers.gathers, "shares": res.final_shares,
            "local_batches": [s.local_batch for s in steps]}


@pytest.mark.e2e
def test_rebalances_gather_with_the_gradient_not_after_the_step() -> None:
    """Rebalancing every step, the ranks all-gather their estimates inside the gradient
    reduction: the only gather of its own is the provisional split's after the warm-up step,
    and the shares still follow the emulated speeds, alike on every rank."""
    cfg = TrainingConfig(epochs=2, global_batch=64, seed=3, rebalance_every=1, policy="adaptive",
                         devices=("cpu:a", "cpu:b"), emulated_slowdown=(1.0, 3.0))
    outs = run_local(_train_counting_gathers, 2, cfg, timeout_s=60)
    assert [o["gathers"] for o in outs] == [1, 1]
    assert outs[0]["shares"] == outs[1]["shares"]
    assert outs[0]["shares"][1] < 0.4  # the rank 3x slower got well under half
    assert len(set(outs[0]["local_batches"][2:])) > 1  # rebalanced along the way
