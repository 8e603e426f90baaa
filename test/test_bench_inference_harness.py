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
    # every frame in the order measured, with the plan that ran it: drift and switches are visible
    assert out["frames_ms"] == [50.0, 70.0, 52.0, 54.0]
    assert out["frames_plan"] == ["single a", "stripes a/b", "single a", "single a"]


class _RecordingParameterClient:
    """Test double of the GraphClient for the driver's parameter calls (an adapter unit test):
    records each call; a compute node that gets a new `min_run_rows` answers with a profile
    carrying it, as the real node publishes one from its parameter callback."""

    def __init__(self, driver) -> None:
        self.driver, self.calls = driver, []

    def set_parameters(self, node: str, values: dict) -> tuple[bool, str]:
        from types import SimpleNamespace

        profiled = {n: int(m.min_run_rows) for n, m in self.driver.profiles.items()}
        self.calls.append((node, dict(values), profiled))
        if "min_run_rows" in values:
            self.driver._on_profile(SimpleNamespace(node_id=node, min_run_rows=values["min_run_rows"]))
        return True, ""


def test_a_variant_sets_the_compute_nodes_before_the_coordinator_replans() -> None:
    """The coordinator re-plans inside its parameter call: by then every compute node's profile
    carries the variant's min_run_rows (else `ours` was planned with `no_stream`'s 4096)."""
    import threading
    from types import SimpleNamespace

    from kaitian_ros.bench.inference_driver import Driver, ProductConfig

    driver = Driver.__new__(Driver)  # no middleware: only the parameter sequence is under test
    driver.gp = SimpleNamespace(compute=["compute_0", "compute_1"])
    driver.lock, driver.profiles, driver.profiles_seen, driver.min_run_rows = threading.Lock(), {}, set(), {}
    driver.client = client = _RecordingParameterClient(driver)
    driver.configure(ProductConfig("stripes", True, (1.0, 1.0), 4096, 4096))
    driver.configure(ProductConfig("auto", True, (1.0, 1.0), 64, 32))
    driver.configure(ProductConfig("single", True, (1.0, 0.0), 64, 32))  # nodes unchanged: not set again
    order = [(node, values.get("min_run_rows", values.get("strategy"))) for node, values, _ in client.calls]
    assert order == [("compute_0", 4096), ("compute_1", 4096), ("coordinator", "stripes"),
                     ("compute_0", 32), ("compute_1", 32), ("coordinator", "auto"), ("coordinator", "single")]
    seen_by_coordinator = [profiled for node, _, profiled in client.calls if node == "coordinator"]
    assert seen_by_coordinator == [{"compute_0": 4096, "compute_1": 4096}, {"compute_0": 32, "compute_1": 32},
                                   {"compute_0": 32, "compute_1": 32}]


def test_ours_and_its_coordinator_twin_swap_places_every_other_round() -> None:
    """Whichever of the two product variants runs second continues the other's settled plan:
    alternating their order keeps that out of `direct_gain_ms`."""
    from kaitian_ros.bench.inference_driver import ProductConfig
    from kaitian_ros.bench.inference_harness import _round_order

    ours = ProductConfig("auto", True, (1.0, 1.0), 64, 32)
    cfgs = {"equal": ProductConfig("stripes", False, (1.0, 1.0), 64, 32), "ours": ours,
            "ours_via_coordinator": ProductConfig("auto", True, (1.0, 1.0), 64, 32, direct_single=False)}
    assert [k for k, _ in _round_order(cfgs, 0)] == ["equal", "ours", "ours_via_coordinator"]
    assert [k for k, _ in _round_order(cfgs, 1)] == ["equal", "ours_via_coordinator", "ours"]
    assert [k for k, _ in _round_order(cfgs, 2)] == ["equal", "ours", "ours_via_coordinator"]
    assert dict(_round_order(cfgs, 1))["ours"] is ours
    assert [k for k, _ in _round_order({"ours": ours}, 1)] == ["ours"]
