"""``kaitian bench training``: the runs it compares, how repeats are summarised and what the
JSON/table/PNG hold (structure and behaviour on synthetic records; no training here)."""

from __future__ import annotations

import pytest

from kaitian_ros.bench import training as bench
from kaitian_ros.bench.training_report import METRICS, plot, summarise, table, targets
from kaitian_ros.bench.training_runs import RunSpec, comm_breakdown, ideal_rate


def _record(eff: float, comm: float = 1.0, acc_pp: float = 0.0) -> dict:
    rec = dict.fromkeys(METRICS, 1.0)
    rec.update(efficiency=eff, comm_overhead_pct=comm, comm_overhead_min_pct=comm - 0.5,
               comm_overhead_max_pct=comm + 0.5, accuracy_minus_single_pp=acc_pp,
               final_accuracy=0.98, samples_per_s=1000.0 * eff, ideal_samples_per_s=1000.0,
               imbalance_pct=5.0, policy="adaptive", work_stealing="on", emulated_speeds="1:0.33",
               drift=None, final_shares=[0.75, 0.25], steps=10, wall_s=1.0,
               solo_samples_per_s_before_after={"1.0:3.0": [[900.0, 300.0], [800.0, 280.0]]})
    return rec


def test_every_combination_of_shares_and_stealing_is_compared():
    cfg = bench.base_config(bench.CONFIGS["digits"], epochs=1)
    specs = {s.name: s for s in bench.specs_for(bench.CONFIGS["digits"], 30)}
    steals = {n: (s.policy, s.config(cfg).steals) for n, s in specs.items() if s.slowdowns == (1.0, 3.0)}
    assert steals == {"equal": ("equal", False), "equal+stealing": ("equal", True),
                      "profile_once": ("profile_once", False),
                      "adaptive": ("adaptive", False), "adaptive+stealing": ("adaptive", True)}
    assert specs["adaptive+drift"].drift == (1, 15, 2.0)
    compute = [s.name for s in bench.specs_for(bench.CONFIGS["compute"], 30)]
    assert compute == ["equal", "equal+stealing", "profile_once", "adaptive", "adaptive+stealing"]
    # the compute-dominated configuration: same model and gradient, 4x the pixels
    assert bench.CONFIGS["compute"].image_size == 2 * bench.CONFIGS["digits"].image_size


def test_repeats_give_median_and_spread_and_targets():
    p = summarise([_record(0.95, comm=1.0), _record(0.85, comm=4.0), _record(0.92, comm=2.0)])
    assert p["efficiency"] == 0.92 and p["efficiency_min"] == 0.85 and p["efficiency_max"] == 0.95
    assert p["spread"]["comm_overhead_pct"] == [1.0, 4.0] and p["comm_overhead_pct"] == 2.0
    assert p["repeats"] == 3 and len(p["runs"]) == 3 and p["work_stealing"] == "on"
    t = targets(p)
    assert t == {"efficiency_ge_0.90": True, "efficiency_le_1_plus_spread": True,
                 "comm_mean_over_ranks_le_3pct": True, "accuracy_within_0.3pp": True}
    # above 1 by more than the spread: the ideal was not measured as the run was
    high = summarise([_record(1.10, acc_pp=-0.44), _record(1.12), _record(1.11, acc_pp=-0.44)])
    assert not targets(high)["efficiency_le_1_plus_spread"]
    assert not targets(high)["accuracy_within_0.3pp"]
    with pytest.raises(ValueError):
        summarise([])


def test_ideal_follows_the_drift_phase_by_phase():
    solo = {(1.0, 1.0): [100.0, 100.0], (1.0, 2.0): [100.0, 50.0]}
    sl = [[1.0, 1.0]] * 4 + [[1.0, 2.0]] * 2  # two warm-up steps left out
    rate = ideal_rate(sl, [200] * 6, solo)
    assert rate == pytest.approx(800 / (2 * 200 / 200 + 2 * 200 / 150))
    assert RunSpec("d", (1.0, 1.0), "adaptive", drift=(1, 3, 2.0)).phases() == [(1.0, 1.0), (1.0, 2.0)]


def test_table_and_plot_show_every_configuration(tmp_path):
    pol = {"equal": summarise([_record(0.5)]), "adaptive": summarise([_record(0.93), _record(0.91)])}
    cfg = {"policies": pol, "single_device_accuracy": 0.98, "repeats": 2, "targets": targets(pol["adaptive"]),
           "setup": {"model": "digits_cnn", "image_size": 16, "global_batch": 512, "epochs": 60},
           "accuracy_check": None}
    result = {"configs": {"digits": cfg, "compute": {**cfg, "setup": {**cfg["setup"], "image_size": 32}}}}
    text = table(result)
    assert "== digits" in text and "== compute" in text and "32x32" in text and "EMULATED" in text
    assert "0.920 [0.910-0.930]" in text  # median [min-max] of the adaptive efficiency
    png = tmp_path / "t.png"
    plot(result, {"digits": {"adaptive": [1.0] * 6}, "compute": {"adaptive": [2.0] * 6}}, png)
    assert png.stat().st_size > 1000


def test_bad_arguments_are_one_line(capsys):
    assert bench.main(["--repeats", "0"]) == 2
    assert bench.main(["--config", "huge"]) == 2
    err = capsys.readouterr().err
    assert "--repeats" in err


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_command_writes_medians_spread_and_every_rank_comm(tmp_path, monkeypatch):
    """A tiny real run (1 epoch at native 8x8, two of the compute configuration's runs, twice):
    the JSON's structure, not its timings."""
    import json

    every = bench.specs_for
    # two runs (one without, one with stealing) keep every process launch of the command
    # while the test stays short; the full list is checked above
    monkeypatch.setattr(bench, "specs_for", lambda bc, steps: [s for s in every(bc, steps)
                                                               if s.name in ("adaptive", "adaptive+stealing")])
    out = tmp_path / "t.json"
    assert bench.main(["--config", "compute", "--epochs", "1", "--image-size", "8",
                       "--repeats", "2", "--out-dir", str(tmp_path), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c = r["configs"]["compute"]
    assert r["repeats"] == 2 and r["emulated_speeds"] and r["policies"] == c["policies"]
    assert set(c["policies"]) == {"adaptive", "adaptive+stealing"}
    for name, p in c["policies"].items():
        assert p["repeats"] == 2 and len(p["runs"]) == 2
        assert p["efficiency_min"] <= p["efficiency"] <= p["efficiency_max"]
        assert p["comm_overhead_min_pct"] <= p["comm_overhead_pct"] <= p["comm_overhead_max_pct"]
        for run in p["runs"]:
            ranks = run["comm_overhead_by_rank_pct"]
            assert len(ranks) == 2 and run["comm_overhead_pct"] == pytest.approx(sum(ranks) / 2)
            assert run["solo_samples_per_s_before_after"]["1.0:3.0"][0][0] > 0
        assert p["work_stealing"] == ("on" if name == "adaptive+stealing" else "off")
    assert set(c["targets"]) == {"efficiency_ge_0.90", "efficiency_le_1_plus_spread",
                                 "comm_mean_over_ranks_le_3pct", "accuracy_within_0.3pp"}
    assert c["accuracy_check"] is None and c["setup"]["image_size"] == 8 and c["seconds"] > 0
    assert (tmp_path / "training_throughput.png").exists()


def test_comm_splits_into_transfer_and_waiting_systematic_or_noise():
    """Two ranks: the last to arrive is blocked only for the transfer (1 ms a step); the early
    one waits on top. Waiting that always falls on rank 0 is systematic; waiting that changes
    side every step is noise, although the waiting is as long."""
    always = comm_breakdown([[5.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 1.0]], wall_s=0.1)
    alternating = comm_breakdown([[5.0, 1.0, 5.0, 1.0], [1.0, 5.0, 1.0, 5.0]], wall_s=0.1)
    for b in (always, alternating):
        assert b["transfer_pct"] == pytest.approx(4.0)  # 4 x 1 ms of 100 ms
        assert b["imbalance_pct"] == pytest.approx(16.0)
    assert always["systematic_wait_pct"] == pytest.approx(16.0)
    assert alternating["systematic_wait_pct"] == pytest.approx(0.0)
    # mean comm over the ranks = transfer + wait / 2 with two ranks
    assert (sum(map(sum, [[5.0, 1.0, 5.0, 1.0], [1.0, 5.0, 1.0, 5.0]])) / 2 / 100 * 100
            == pytest.approx(alternating["transfer_pct"] + alternating["imbalance_pct"] / 2))
    assert comm_breakdown([], 0.0) == {"transfer_pct": 0.0, "imbalance_pct": 0.0,
                                       "systematic_wait_pct": 0.0}
