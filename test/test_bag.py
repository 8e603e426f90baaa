"""``kaitian bag record`` / ``kaitian bag info`` against a real embedded graph, every party its own
process: a publisher (test/helpers.py ``fused_pub``: a latched plan, FusedOutputs, diagnostics,
camera images), a latched topic that appears during the recording, the recorder as a user
starts it, and the bag read back with the ``mcap`` package and its ROS 2 decoder - a reader that
shares no code with rosbags or with this package.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    REPO,
    Proc,
    Router,
    child_env,
    fused_output_fields,
    run_cli,
    spawn_helper,
)

pytestmark = pytest.mark.e2e

mcap_reader = pytest.importorskip("mcap.reader", reason="the test extra installs mcap (pip install -e '.[test]')")
mcap_ros2_decoder = pytest.importorskip("mcap_ros2.decoder", reason="the test extra installs mcap-ros2-support")

FUSED_COUNT = 30
LATE_TOPIC = "/kaitian/late"
TOPICS = {"/kaitian/fused": "kaitian_ros/msg/FusedOutput", "/kaitian/plan": "kaitian_ros/msg/LoadAssignment",
          "/diagnostics": "diagnostic_msgs/msg/DiagnosticArray", "/camera/image_raw": "sensor_msgs/msg/Image"}


@dataclass(frozen=True)
class Recording:
    router: Router
    publisher: Proc
    bag: Path
    sent: dict[str, Any]
    sha256: dict[str, list[str]]
    recorder_output: str


def _record_cmd(router: Router, *args: str) -> list[str]:
    return [sys.executable, "-u", "-m", "kaitian_ros.cli", "--router", router.endpoint, "bag", "record", *args]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    """Every topic recorded while the publisher sends, stopped with Ctrl-C (SIGINT)."""
    router = Router()
    publisher = spawn_helper("fused_pub", str(FUSED_COUNT), "fused,plan,diagnostics,image", router=router.endpoint)
    bag = tmp_path_factory.mktemp("bags") / "all_topics"
    recorder = late = None
    try:
        publisher.ready()
        recorder = Proc(_record_cmd(router, "-o", str(bag)), child_env(router.endpoint))
        recorder.wait_for(r"^recording 4 topics")
        # a topic that appears while recording is found and recorded too (its latched sample)
        late = spawn_helper("latched_pub", LATE_TOPIC, "first", "last", router=router.endpoint)
        late.ready()
        recorder.wait_for(rf"^recording {LATE_TOPIC} too")
        sent = json.loads(publisher.wait_for(r'^\{"sent"')[0].string)
        # the publisher sent only once every topic had a subscriber (the recorder's) and its
        # messages are reliable: give delivery a moment on a busy machine, then Ctrl-C. A grace
        # period, not a condition: the recorder (another process) reports nothing until it stops,
        # and a subscriber of the test's own would change when the publisher starts sending
        time.sleep(1.5)
        recorder.p.send_signal(signal.SIGINT)
        assert recorder.wait() == 0, recorder.output()
        yield Recording(router, publisher, bag, sent["sent"], sent["sha256"], recorder.output())
    finally:
        for proc in (recorder, late):
            if proc is not None:
                proc.stop()
        publisher.stop()
        router.close()


def _read_mcap(bag: Path) -> tuple[Any, list[tuple[Any, Any, Any, Any]]]:
    (path,) = bag.glob("*.mcap")
    with path.open("rb") as f:
        reader = mcap_reader.make_reader(f, decoder_factories=[mcap_ros2_decoder.DecoderFactory()])
        summary = reader.get_summary()
        return summary, list(reader.iter_decoded_messages())


def test_every_published_message_is_in_the_bag_as_its_bytes(recording: Recording) -> None:
    assert (recording.bag / "metadata.yaml").is_file(), "the bag was not closed (no metadata.yaml)"
    summary_line = recording.recorder_output.splitlines()[-1]
    assert summary_line.startswith("recorded "), recording.recorder_output
    summary, messages = _read_mcap(recording.bag)
    assert {c.topic: c.message_encoding for c in summary.channels.values()} == \
        dict.fromkeys([*TOPICS, LATE_TOPIC], "cdr")
    by_topic: dict[str, list[Any]] = {t: [] for t in [*TOPICS, LATE_TOPIC]}
    for _schema, channel, message, decoded in messages:
        by_topic[channel.topic].append((message, decoded))
    for topic in TOPICS:
        # the bytes as published, each once: no decode/re-encode, no duplicate of a latched sample
        got = Counter(hashlib.sha256(m.data).hexdigest() for m, _ in by_topic[topic])
        assert got == Counter(recording.sha256[topic]), f"{topic}: bag and publisher differ"
        assert f"{topic} {len(recording.sha256[topic])}" in summary_line
    fused_ids = sorted(d.request_id for _, d in by_topic["/kaitian/fused"])
    assert fused_ids == sorted(f["request_id"] for f in recording.sent["fused"]) and len(fused_ids) == FUSED_COUNT
    # plan 1 was published before the recorder started: it is in the bag because the latched
    # publisher's cache was asked for, as a late-joining transient-local subscriber does
    assert sorted(d.version for _, d in by_topic["/kaitian/plan"]) == [1, 2]
    assert [d.status[0].name for _, d in by_topic["/diagnostics"]] == recording.sent["diagnostics"]
    assert [d.header.frame_id for _, d in by_topic["/camera/image_raw"]] == recording.sent["image"]
    assert [d.data for _, d in by_topic[LATE_TOPIC]] == ["last"]
    times = [m.log_time for m, _ in by_topic["/kaitian/fused"]]
    assert times == sorted(times) and all(m.log_time == m.publish_time for m, _ in by_topic["/kaitian/fused"])


def test_message_definitions_are_embedded(recording: Recording) -> None:
    summary, _ = _read_mcap(recording.bag)
    schemas = {s.name: s for s in summary.schemas.values()}
    assert set(schemas) == {*TOPICS.values(), "std_msgs/msg/String"}
    assert {s.encoding for s in schemas.values()} == {"ros2msg"}
    for name in ("FusedOutput", "LoadAssignment"):
        text = schemas[f"kaitian_ros/msg/{name}"].data.decode()
        own = (REPO / "msg" / f"{name}.msg").read_text().rstrip("\n")
        assert text.startswith(own), f"{name}: the bag does not carry msg/{name}.msg as written"
        assert "\nMSG: std_msgs/Header\n" in text and "\nMSG: builtin_interfaces/Time\n" in text
    image = schemas["sensor_msgs/msg/Image"].data.decode()
    assert "uint32 height" in image and "MSG: std_msgs/Header" in image
    assert "MSG: diagnostic_msgs/KeyValue" in schemas["diagnostic_msgs/msg/DiagnosticArray"].data.decode()


def test_a_fused_output_decodes_to_the_published_fields(recording: Recording) -> None:
    _, messages = _read_mcap(recording.bag)
    fused = {d.request_id: d for _, c, _, d in messages if c.topic == "/kaitian/fused"}
    for i, sent in enumerate(recording.sent["fused"]):
        got = fused[sent["request_id"]]
        assert (got.complete, got.top_class, got.status, got.plan_version) == \
            (sent["complete"], sent["top_class"], sent["status"], sent["plan_version"])
        assert got.top_score == pytest.approx(sent["top_score"], rel=1e-6)  # float32 on the wire
        assert got.latency_ms == sent["latency_ms"]
        assert got.header.frame_id == "camera"
        if sent["complete"]:
            assert list(got.node_ids) == sent["node_ids"] and list(got.node_rows) == sent["node_rows"]
            assert list(got.shape) == [1, 10] and (got.dtype_code, got.dtype_bits) == (2, 32)
            logits = np.frombuffer(bytes(got.data), np.float32)
            assert logits.tobytes() == fused_output_fields(i)["data"]
            assert int(logits.argmax()) == sent["top_class"]
        else:
            assert len(got.data) == 0 and len(got.shape) == 0


def test_bag_info_reads_the_bag_back(recording: Recording) -> None:
    result = run_cli("bag", "info", str(recording.bag))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Storage id:        mcap" in out and "Files:             all_topics.mcap" in out
    total = sum(len(h) for h in recording.sha256.values()) + 1  # + the late topic's latched sample
    assert f"Messages:          {total}" in out
    for topic, msg_type in TOPICS.items():
        count = len(recording.sha256[topic])
        assert f"Topic: {topic} | Type: {msg_type} | Count: {count} |" in out
    assert ("Topic: /kaitian/plan | Type: kaitian_ros/msg/LoadAssignment | Count: 2 | Serialization Format: cdr"
            " | latched") in out


def test_named_topic_for_a_duration_gets_the_latched_sample(recording: Recording, tmp_path: Path) -> None:
    """A recorder started after everything was sent: the latched plan (its last version) is all
    there is to record, and --duration ends the recording by itself."""
    bag = tmp_path / "plan_only"
    result = run_cli("bag", "record", "kaitian/plan", "-o", str(bag), "--duration", "1.5",
                     router=recording.router.endpoint)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(f"recording 1 topic to {bag}")
    assert "to " + str(bag) + ": /kaitian/plan 1" in result.stdout.splitlines()[-1]
    _, messages = _read_mcap(bag)
    assert [(c.topic, d.version) for _, c, _, d in messages] == [("/kaitian/plan", 2)]


def test_sigterm_closes_the_bag(recording: Recording, tmp_path: Path) -> None:
    bag = tmp_path / "terminated"
    recorder = Proc(_record_cmd(recording.router, "/kaitian/plan", "-o", str(bag)),
                    child_env(recording.router.endpoint))
    try:
        recorder.wait_for(r"^recording 1 topic")
        recorder.p.send_signal(signal.SIGTERM)
        assert recorder.wait() == 0, recorder.output()
    finally:
        recorder.stop()
    assert recorder.find(r"^recorded \d+ messages in .*: /kaitian/plan \d"), recorder.output()
    assert (bag / "metadata.yaml").is_file()


def _one_line_error(result: Any, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_bad_input_is_one_line_and_a_non_zero_exit(recording: Recording, tmp_path: Path) -> None:
    router = recording.router.endpoint
    existing = tmp_path / "existing"
    existing.mkdir()
    _one_line_error(run_cli("bag", "record", "-o", str(existing)), "exists already")
    missing = tmp_path / "never_written"
    _one_line_error(run_cli("bag", "record", "/no/such/topic", "-o", str(missing), router=router),
                    "/no/such/topic", "not found")
    assert not missing.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    _one_line_error(run_cli("bag", "record", "-o", str(a_file / "bag"), "--duration", "1", router=router),
                    "cannot create")
    _one_line_error(run_cli("bag", "record", "--duration", "0", "-o", str(missing)), "--duration")
    _one_line_error(run_cli("bag", "info", str(tmp_path / "nothing_here")), "no such bag")
    _one_line_error(run_cli("bag", "info", str(existing)), "not a readable rosbag2")
    _one_line_error(run_cli("bag"), "kaitian bag")


def test_bag_help_shows_the_real_options() -> None:
    result = run_cli("bag", "--help")
    assert result.returncode == 0 and "record" in result.stdout and "info" in result.stdout
    result = run_cli("bag", "record", "--help")
    assert result.returncode == 0
    for option in ("-o DIR, --output DIR", "--duration S", "--include-chunks", "TOPIC"):
        assert option in result.stdout, result.stdout
    result = run_cli("bag", "info", "--help")
    assert result.returncode == 0 and "DIR" in result.stdout
