"""The launch view and the run summary: state kept only for the scenario's compute nodes,
control characters from the wire escaped, what the graph waits for said instead of NaN, the
plan's strategy named, plain lines without escape codes off a terminal; the summary's counts
and percentiles from known inputs (messages fed to the handlers directly; no graph needed)."""

from __future__ import annotations

import io
import re

import pytest
from helpers import free_port, run_cli
from rich.console import Console

from kaitian_ros import run_summary as rs
from kaitian_ros import view_render as vr
from kaitian_ros.live_view import LiveView
from kaitian_ros.runtime import interfaces
from kaitian_ros.scenario import load_scenario

ANSI = re.compile(r"\x1b\[")


def _view(**options) -> LiveView:
    return LiveView("tcp/127.0.0.1:1", load_scenario("hetero_inference", ["compute_nodes:=2"]), **options)


def _telemetry(node_id: str, **fields) -> object:
    fields = {"request_id": 7, "rows": 8, "compute_ms": 12.5} | fields
    return interfaces.make("NodeTelemetry", node_id=node_id, **fields)


def _plan(version: int, node_ids: list[str], shares: list[float], strategy: str = "stripes", **fields) -> object:
    return interfaces.make("LoadAssignment", incarnation=5, version=version, node_ids=node_ids, shares=shares,
                           strategy=strategy, predicted_makespan_ms=40.0, **fields)


def _fused(latency_ms: float, complete: bool = True, status: str = "ok", **fields) -> object:
    return interfaces.make("FusedOutput", latency_ms=latency_ms, complete=complete, status=status,
                           top_class=fields.pop("top_class", 3 if complete else -1), **fields)


def _coordinator_status(**values: str) -> object:
    kv = [interfaces.make("KeyValue", key=k, value=v) for k, v in values.items()]
    status = interfaces.make("DiagnosticStatus", name="kaitian: coordinator", message="", values=kv)
    return interfaces.make("DiagnosticArray", status=[status])


def _rich_text(renderable) -> str:
    console = Console(file=io.StringIO(), width=200, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


# --- the view's state --------------------------------------------------------------------------

def test_view_ignores_unknown_node_ids_and_escapes_control_characters():
    view = _view()
    for i in range(5000):  # a flood of made-up node ids
        view._on_telemetry(_telemetry(f"ghost_{i}"), 0)
    view._on_telemetry(_telemetry("compute_0", device="cpu\x1b[2J\x07"), 0)
    assert set(view.nodes) == {"compute_0"}
    text = view.render()
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text, text
    assert "5000 telemetry messages from nodes not in the scenario" in text
    assert "ghost" not in text
    table = _rich_text(vr.rich_view(view.snapshot()))
    assert "\x1b" not in table and "\x07" not in table and "\\x1b[2J" in table, table


def test_startup_says_loading_model_not_nan():
    view = _view()
    text = view.render()
    assert "loading model" in text and "nan" not in text.lower(), text
    # every compute node listed, none with numbers it does not have yet
    assert "compute_0    loading model" in text and "compute_1    loading model" in text
    assert "loading model" in _rich_text(vr.rich_view(view.snapshot()))
    # the coordinator reports before any compute node: it waits for them
    view._on_diagnostics(_coordinator_status(planner="starting"), 0)
    assert "waiting for compute nodes" in view.render()
    view._on_telemetry(_telemetry("compute_0", request_id=0, rows=0), 0)  # a heartbeat
    text = view.render()
    assert "waiting for the first plan" in text and "nan" not in text.lower(), text
    view._on_plan(_plan(1, ["compute_0", "compute_1"], [1.0, 0.0], strategy="single"), 0)
    assert "waiting for the first frame" in view.render()


def test_view_names_the_strategy_and_plan():
    view = _view()
    view._on_telemetry(_telemetry("compute_0"), 0)
    view._on_telemetry(_telemetry("compute_1", emulated=True, emulated_slowdown=3.0), 0)
    view._on_plan(_plan(4, ["compute_0", "compute_1"], [0.67, 0.33], runner_up="single compute_0",
                        runner_up_ms=55.0), 0)
    view._on_fused(_fused(42.0, top_label="cat", top_score=0.9), 0)
    text = view.render()
    assert "plan v4: stripes compute_0 0.67/compute_1 0.33, predicted 40.0 ms" in text, text
    assert "runner-up single compute_0 55.0 ms" in text
    assert "last result: class 3 (cat), score 0.90" in text
    assert "EMULATED x3.0" in text  # emulated speed is labelled as such
    assert "latency p50 42.0 ms" in text and "nan" not in text.lower()
    # the coordinator's re-prediction of the running version wins over the plan's own
    view._on_diagnostics(_coordinator_status(plan_version="4", predicted_ms="47.5"), 0)
    assert "predicted 47.5 ms" in view.render()

    layerwise = _plan(5, ["compute_0", "compute_1"], [0.5, 0.5], strategy="layerwise", cut_values=[9],
                      segment_shares=[1.0, 0.0, 0.0, 1.0])
    view._on_plan(layerwise, 0)
    assert "plan v5: layerwise compute_0 [value 9] -> compute_1" in view.render()
    view._on_plan(_plan(6, ["compute_0"], [1.0], strategy="single"), 0)
    assert "plan v6: single compute_0" in view.render()
    assert "single" in _rich_text(vr.rich_view(view.snapshot()))


def test_a_forged_plan_is_shown_as_unreadable_not_raised():
    view = _view()
    view._on_plan(_plan(2, ["compute_0", "compute_1"], [0.5, 0.5], strategy="sideways"), 0)
    assert "unreadable plan v2" in view.render()


def test_node_table_shows_share_rows_ms_link_and_drops():
    view = _view()
    view._on_telemetry(_telemetry("compute_0", rejected_count=2, last_reject_reason="stale plan"), 0)
    view._on_plan(_plan(1, ["compute_0"], [1.0], strategy="single"), 0)
    view._on_diagnostics(_coordinator_status(links_in="compute_0:800Mbit/0.12ms", dropped_busy="4"), 0)
    text = view.render()
    line = next(x for x in text.splitlines() if "compute_0 " in x and "share" in x)
    assert "share 1.00" in line and "rows    8" in line and "12.5 ms" in line, line
    assert "link 800Mbit/0.12ms" in line and "dropped 2 (last: stale plan)" in line, line
    assert "frames (coordinator busy) 4" in text


def test_plain_lines_off_a_terminal_have_no_escape_codes():
    stream = io.StringIO()
    view = _view(tty=False, stream=stream, refresh_s=0.0)
    view._connect = lambda: None  # no graph here
    view._on_telemetry(_telemetry("compute_0"), 0)
    view._on_plan(_plan(1, ["compute_0"], [1.0], strategy="single"), 0)
    view._on_fused(_fused(10.0), 0)
    view.tick()
    view.tick()
    out = stream.getvalue()
    assert len(re.findall(r"^\[view\] \d+ s \| ", out, re.MULTILINE)) == 2, out  # one block per tick
    assert "plan v1: single compute_0" in out and all(line.startswith("[view]") for line in out.splitlines())
    assert not ANSI.search(out) and "\x1b" not in out
    assert view.output is stream  # the launcher's lines go straight to the stream
    view.close()


def test_no_view_counts_but_prints_nothing():
    stream = io.StringIO()
    view = _view(show=False, tty=False, stream=stream, refresh_s=0.0)
    view._connect = lambda: None
    view._on_fused(_fused(10.0), 0)
    view.tick()
    assert stream.getvalue() == ""
    assert view.summary().frames == 1


# --- the summary --------------------------------------------------------------------------------

def test_percentile_is_nearest_rank_and_none_when_empty():
    assert rs.percentile([], 0.5) is None
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert rs.percentile(values, 0.5) == 51.0 and rs.percentile(values, 0.95) == 96.0
    assert rs.percentile([7.0], 0.95) == 7.0


def test_summary_counts_frames_latency_drops_and_plan_changes():
    tally = rs.RunTally()
    for ms in range(10, 110, 10):  # 10 complete frames: 10..100 ms
        tally.add_fused(float(ms), True, "ok")
    tally.add_fused(0.0, False, "timeout: missing rows 28-55 from compute_1")
    tally.add_fused(0.0, False, "timeout: missing rows 0-3 from compute_0")
    tally.add_fused(0.0, False, "")
    tally.add_fused(float("nan"), True, "ok")  # a complete frame whose latency is unusable
    for version, text in ((1, "single compute_0"), (1, "single compute_0"), (2, "stripes a 0.5/b 0.5"),
                          (3, "single compute_1")):
        tally.add_plan(9, version, text)
    s = tally.summary(12.5, {"frames (coordinator busy)": 3, "frames (no plan yet)": 0})
    assert (s.frames, s.complete, s.incomplete_count) == (14, 11, 3)
    assert s.incomplete == (("timeout", 2), ("unknown", 1))
    assert (s.p50_ms, s.p95_ms) == (60.0, 100.0)
    assert s.drops == (("frames (coordinator busy)", 3),)  # zero counts left out
    assert (s.plans, s.plan_changes, s.last_plan) == (3, 2, "single compute_1")  # re-delivery counted once
    text = rs.format_summary(s)
    assert "12.5 s, 14 frames fused: 11 complete, 3 incomplete (2 timeout, 1 unknown)" in text, text
    assert "latency p50 60.0 ms, p95 100.0 ms" in text
    assert "dropped: frames (coordinator busy) 3" in text
    assert "plans: 3 (2 changes), last: single compute_1" in text
    assert all(line.startswith("[summary] ") for line in text.splitlines())


def test_summary_of_a_run_without_results():
    s = rs.RunTally().summary(3.0)
    assert (s.frames, s.p50_ms, s.p95_ms, s.plans) == (0, None, None, 0)
    text = rs.format_summary(s)
    assert "0 frames fused" in text and "p50 -" in text and "dropped: none" in text and "plans: none came" in text
    assert "nan" not in text.lower()


def test_summary_escapes_names_from_the_wire():
    tally = rs.RunTally()
    tally.add_plan(1, 1, "single evil\x1b[2J")
    text = rs.format_summary(tally.summary(1.0, {"messages rejected by x\x07": 1}))
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text and "\\x07" in text


@pytest.mark.parametrize("status, reason", [("timeout: missing rows 1-2 from c", "timeout"), ("", "unknown"),
                                            ("lost rows", "lost rows")])
def test_incomplete_reason(status: str, reason: str):
    assert rs.incomplete_reason(status) == reason


def test_view_summary_takes_the_coordinators_and_nodes_drop_counts():
    view = _view()
    view._on_diagnostics(_coordinator_status(dropped_busy="2", dropped_no_plan="1", rejected="inf"), 0)
    view._on_telemetry(_telemetry("compute_1", rejected_count=4), 0)
    view._on_fused(_fused(20.0), 0)
    view._on_fused(_fused(0.0, complete=False, status="timeout: missing rows 0-1 from compute_1"), 0)
    s = view.summary()
    assert dict(s.drops) == {"frames (coordinator busy)": 2, "frames (no plan yet)": 1,
                             "messages rejected by compute_1": 4}  # "inf" is not a count
    assert (s.frames, s.complete, s.incomplete) == (2, 1, (("timeout", 1),))


@pytest.mark.e2e
def test_launch_prints_the_summary_at_exit_also_without_the_view():
    """A whole graph for a few seconds: the summary block comes at the --duration end, with
    --no-view no [view] lines, and nothing on stdout has escape codes (not a terminal)."""
    done = run_cli("launch", "hetero_inference", "compute_nodes:=2", "input_height:=64", "input_width:=64",
                   "--duration", "4", "--no-view",
                   router=f"tcp/127.0.0.1:{free_port()}", timeout_s=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("[summary] ")]
    assert len(summary) == 4 and re.match(r"\[summary\] [\d.]+ s, \d+ frames fused: ", summary[0]), summary
    assert "[view]" not in done.stdout and "\x1b" not in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == summary[-1]  # after every node line: the last thing said
