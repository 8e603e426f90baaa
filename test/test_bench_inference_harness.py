"""The inference benchmark's bookkeeping around a run (the run itself is a command, not a test)."""

from __future__ import annotations

from pathlib import Path

from kaitian_ros.bench.inference_harness import Series, _keep_or_remove_logs


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "kaitian_bench_inf_x"
    run.mkdir()
    (run / "coordinator.log").write_text("plan v1: single compute_0\n")
    return run


def test_the_processes_logs_are_removed_unless_kept(tmp_path: Path) -> None:
    said: list[str] = []
    run = _run_folder(tmp_path)
    _keep_or_remove_logs(run, None, "default", said.append)
    assert not run.exists() and said == []

    run = _run_folder(tmp_path)
    _keep_or_remove_logs(run, tmp_path / "logs", "robot_edge", said.append)
    assert not run.exists()
    assert (tmp_path / "logs" / "robot_edge" / "coordinator.log").read_text().startswith("plan v1")
    assert said == [f"[bench] process logs in {tmp_path / 'logs' / 'robot_edge'}"]


def test_ours_reports_what_each_plan_took() -> None:
    s = Series("ours", {})
    for ms, plan in ((50.0, "single a"), (70.0, "stripes a/b"), (52.0, "single a"), (54.0, "single a")):
        s.add({"ok": True, "ms": ms, "predicted_ms": 51.0, "plan": plan})
    out = s.summary()
    assert out["plans_ran"] == {"single a": 3, "stripes a/b": 1}
    assert out["plans_ran_median_ms"] == {"single a": 52.0, "stripes a/b": 70.0}
