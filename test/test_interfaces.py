"""Wire format: CDR bytes, keys, attachments, and tensor fields.

The cross-process round trip sends every message type to a child process, which decodes it
and publishes it re-encoded; the bytes that come back must be identical to what was sent.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import torch
from helpers import REPO, raw_session, spawn_helper, wait_until

from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime import zenoh_session as zs

CHATTER_KEY = ("0/chatter/std_msgs::msg::dds_::String_/"
               "RIHS01_df668c740482bbd48fb39d76a70dfd4bd59db1288021743503259e948f6b1a18")
ALL_TYPES = ("kaitian_ros/msg/TensorChunk", "kaitian_ros/msg/LoadAssignment", "kaitian_ros/msg/NodeTelemetry",
             "kaitian_ros/msg/FusedOutput", "kaitian_ros/msg/TrainingTelemetry", "kaitian_ros/msg/BenchChunk",
             "sensor_msgs/msg/Image", "std_msgs/msg/String")


def _stamp(sec: int, nanosec: int):
    return interfaces.msg_class("Time")(sec=sec, nanosec=nanosec)


def sample_messages() -> dict[str, object]:
    """One message per type with every field away from its default (so a dropped field shows)."""
    hdr = interfaces.header("camera", _stamp(1_700_000_123, 456_789))
    rows = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) / 7
    logits = np.linspace(-3, 3, 10, dtype=np.float32).reshape(1, 10)
    return {
        "kaitian_ros/msg/TensorChunk": interfaces.make(
            "TensorChunk", header=hdr, request_id=2**40 + 3, plan_version=7, producer="compute_1",
            consumer="coordinator", segment=2, role=1, row_offset=56, total_rows=224, slab_index=3,
            last_slab=True, **interfaces.tensor_fields(rows)),
        "kaitian_ros/msg/LoadAssignment": interfaces.make(
            "LoadAssignment", header=hdr, version=12, effective_from_request=345,
            node_ids=["compute_0", "compute_1", "compute_2"], shares=np.array([0.5, 0.3, 0.2]),
            policy="adaptive", reason="compute_1 slowed down: 31.2 ms -> 55.0 ms",
            predicted_makespan_ms=41.5, strategy="stripes", cut_values=np.array([5, 12], dtype=np.uint16),
            segment_shares=np.array([0.5, 0.3, 0.2, 0.5, 0.3, 0.2, 1.0, 0.0, 0.0]),
            runner_up="single compute_0", runner_up_ms=48.25),
        "kaitian_ros/msg/NodeTelemetry": interfaces.make(
            "NodeTelemetry", header=hdr, node_id="compute_1", device="cpu", emulated=True,
            emulated_slowdown=2.5, request_id=99, plan_version=3, rows=28, work=1.25e9, compute_ms=12.5,
            share=0.375, transfer_ms=1.5, wait_ms=0.25, bytes_in=123456, bytes_out=654321, first_input_s=1.7e9 + 0.1,
            last_input_s=1.7e9 + 0.2, first_output_s=1.7e9 + 0.3, last_output_s=1.7e9 + 0.4, queue_depth=2,
            rejected_count=5, last_reject_reason="malformed: truncated"),
        "kaitian_ros/msg/FusedOutput": interfaces.make(
            "FusedOutput", header=hdr, request_id=77, plan_version=4, complete=True,
            **interfaces.tensor_fields(logits), top_class=9, top_score=0.875, latency_ms=33.25,
            node_ids=["compute_0", "compute_1"], node_rows=np.array([3, 4], dtype=np.uint32), status="ok"),
        "kaitian_ros/msg/TrainingTelemetry": interfaces.make(
            "TrainingTelemetry", header=hdr, rank=1, device="cuda:0", emulated=False, emulated_slowdown=1.0,
            epoch=2, step=1234, local_batch=48, global_batch=128, share=0.375, step_ms=210.5,
            compute_ms=180.25, comm_ms=30.25, loss=1.5, samples_per_s=608.0),
        "kaitian_ros/msg/CostProfile": interfaces.make(
            "CostProfile", header=hdr, node_id="compute_1", version=4, model="resnet18 3x224x224",
            device="cpu", emulated=True, emulated_slowdown=2.0, trunk_ms=95.5,
            op_call_ms=np.array([0.05, 0.125, 0.0]), op_row_ms=np.array([0.25, 0.5, 0.75]), message_ms=0.125,
            min_run_rows=32, run_samples=1234, link_sources=["coordinator", "compute_0"],
            link_bytes_per_ms=np.array([25000.0, 12500.0]), link_latency_ms=np.array([0.25, 0.5]),
            link_samples=np.array([40, 7], dtype=np.uint32)),
        "kaitian_ros/msg/BenchChunk": interfaces.make(
            "BenchChunk", header=hdr, request_id=2**33 + 5, sender="lw_0", value=12, route=["lw_1", "lw_2"],
            stop_values=np.array([30, 61], dtype=np.uint16), reply_to="bench", **interfaces.tensor_fields(rows)),
        "sensor_msgs/msg/Image": interfaces.make(
            "Image", header=hdr, height=4, width=5, encoding="rgb8", is_bigendian=0, step=15,
            data=(np.arange(60) * 7 % 256).astype(np.uint8)),
        "std_msgs/msg/String": interfaces.make("String", data="héllo, chatter"),
    }


def fresh_store():
    """A rosbags type store built here from the .msg files, independent of interfaces.typestore()."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_JAZZY)
    types = {}
    for path in sorted((REPO / "msg").glob("*.msg")):
        types.update(get_types_from_msg(path.read_text(), f"kaitian_ros/msg/{path.stem}"))
    store.register(types)
    return store


# --- in-process codec checks --------------------------------------------------------------------

def test_sample_messages_cover_every_msg_file():
    names = {f"kaitian_ros/msg/{p.stem}" for p in (REPO / "msg").glob("*.msg")}
    assert names <= set(sample_messages()), "a msg/ type has no round-trip sample"


@pytest.mark.parametrize("name", ALL_TYPES)
def test_encode_equals_rosbags_serialize_cdr(name):
    msg = sample_messages()[name]
    store = fresh_store()
    ours = bytes(interfaces.encode(msg, name))
    assert ours == bytes(store.serialize_cdr(msg, name))
    assert ours[:4] == b"\x00\x01\x00\x00"  # CDR little-endian encapsulation header
    assert interfaces.type_hash(name) == store.hash_rihs01(name)
    again = bytes(interfaces.encode(interfaces.decode(ours, name), name))
    assert again == ours


def test_string_cdr_layout_by_hand():
    # header, uint32 length incl. NUL, bytes, NUL (rmw's own layout for std_msgs/String)
    assert bytes(interfaces.encode(interfaces.make("String", data="hello"), "String")) == \
        b"\x00\x01\x00\x00" + struct.pack("<I", 6) + b"hello\x00"


def test_chatter_key_is_rmw_zenoh_exact():
    assert zs.topic_key(0, "/chatter", "std_msgs/msg/String") == CHATTER_KEY
    assert zs.topic_key(0, "chatter", "String") == CHATTER_KEY
    assert zs.topic_key(3, "/robot1/chatter", "String").startswith("3/robot1/chatter/std_msgs::msg::dds_::String_/")
    assert interfaces.dds_type_name("TensorChunk") == "kaitian_ros::msg::dds_::TensorChunk_"


def test_attachment_layout():
    gid = bytes(range(16))
    raw = zs.make_attachment(5, 1_700_000_000_123_456_789, gid)
    assert raw == struct.pack("<q", 5) + struct.pack("<q", 1_700_000_000_123_456_789) + b"\x10" + gid
    assert zs.parse_attachment(raw) == (5, 1_700_000_000_123_456_789, gid)


# --- tensor helpers ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.uint8, torch.bfloat16])
def test_tensor_round_trip_through_cdr(dtype):
    src = (torch.arange(2 * 3 * 5 * 7) - 50).reshape(2, 3, 5, 7)
    src = (src.abs() if dtype == torch.uint8 else src / (4 if dtype.is_floating_point else 1)).to(dtype)
    msg = interfaces.make("TensorChunk", **interfaces.tensor_fields(src))
    decoded = interfaces.decode(bytearray(interfaces.encode(msg, "TensorChunk")), "TensorChunk")
    out = interfaces.tensor_from_fields(decoded)
    assert out.dtype == dtype and tuple(out.shape) == (2, 3, 5, 7)
    assert torch.equal(out, src)


def test_numpy_tensor_fields_round_trip():
    arr = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float64)
    msg = interfaces.decode(interfaces.encode(interfaces.make("TensorChunk", **interfaces.tensor_fields(arr)),
                                              "TensorChunk"), "TensorChunk")
    np.testing.assert_array_equal(interfaces.array_from_fields(msg), arr)


def test_decoded_tensor_is_a_zero_copy_view_of_the_payload():
    src = torch.arange(4096, dtype=torch.float32).reshape(1, 4, 32, 32)
    payload = bytearray(interfaces.encode(interfaces.make("TensorChunk", **interfaces.tensor_fields(src)),
                                          "TensorChunk"))
    msg = interfaces.decode(payload, "TensorChunk")
    arr = interfaces.array_from_fields(msg)
    assert np.shares_memory(arr, np.frombuffer(payload, dtype=np.uint8))
    out = interfaces.tensor_from_fields(msg)
    assert out.data_ptr() == arr.ctypes.data
    # write through the payload: the decoded tensor sees it (same memory, no copy)
    offset = arr.ctypes.data - np.frombuffer(payload, np.uint8).ctypes.data
    payload[offset:offset + 4] = struct.pack("<f", -123.5)
    assert out.flatten()[0].item() == -123.5


def test_tensor_fields_do_not_copy_a_contiguous_array():
    arr = np.zeros((8, 8), np.float32)
    fields = interfaces.tensor_fields(arr)
    assert np.shares_memory(fields["data"], arr)


def test_size_mismatch_raises_decode_error():
    msg = interfaces.make("TensorChunk", dtype_code=2, dtype_bits=32, shape=np.array([2, 3], np.int64),
                          data=np.zeros(20, np.uint8))
    with pytest.raises(interfaces.DecodeError, match="24"):
        interfaces.array_from_fields(interfaces.decode(interfaces.encode(msg, "TensorChunk"), "TensorChunk"))
    with pytest.raises(interfaces.DecodeError):
        interfaces.tensor_from_fields(msg)
    bad_dtype = interfaces.make("TensorChunk", dtype_code=9, dtype_bits=32, shape=np.array([1], np.int64),
                                data=np.zeros(4, np.uint8))
    with pytest.raises(interfaces.DecodeError, match="unsupported"):
        interfaces.array_from_fields(bad_dtype)


@pytest.mark.parametrize("payload", [b"", b"\x00\x01", bytes(range(200)), b"\x00\x01\x00\x00\xff\xff\xff\xff"])
def test_decode_raises_only_decode_error(payload):
    with pytest.raises(interfaces.DecodeError):
        interfaces.decode(payload, "Image")


# --- between two real processes -------------------------------------------------------------------

@pytest.mark.e2e
def test_every_type_round_trips_byte_exact_between_processes(router):
    """Child decodes each message and publishes it re-encoded: the bytes that return are ours."""
    child = spawn_helper("echo", *ALL_TYPES, router=router.endpoint)
    session = raw_session(router.endpoint)
    try:
        gids = child.ready()["gids"]
        sent = {name: bytes(interfaces.encode(msg, name)) for name, msg in sample_messages().items()}
        received: dict[str, tuple[str, bytes, bytes]] = {}

        def on_sample(sample):
            key = str(sample.key_expr)
            att = sample.attachment.to_bytes() if sample.attachment is not None else b""
            received.setdefault(key, (key, sample.payload.to_bytes(), att))

        sub = session.declare_subscriber("0/rt_out/**", on_sample)
        pubs = {name: session.declare_publisher(zs.topic_key(0, f"/rt_in/{name.rsplit('/', 1)[-1]}", name))
                for name in ALL_TYPES}
        out_keys = {name: zs.topic_key(0, f"/rt_out/{name.rsplit('/', 1)[-1]}", name) for name in ALL_TYPES}
        before_ns = time.time_ns()

        def all_back() -> bool:
            missing = [n for n in ALL_TYPES if out_keys[n] not in received]
            for name in missing:  # resend until routes exist (a put before discovery may go nowhere)
                pubs[name].put(sent[name], attachment=zs.make_attachment(1, time.time_ns(), bytes(16)))
            return not missing

        wait_until(all_back, "every type echoed back", interval_s=0.2)
        for name in ALL_TYPES:
            _, payload, attachment = received[out_keys[name]]
            assert payload == sent[name], f"{name}: bytes changed on the round trip"
            # rmw_zenoh attachment: int64 seq LE, int64 source timestamp ns LE, GID length 16 + 16 bytes
            assert len(attachment) == 8 + 8 + 1 + 16, name
            seq, stamp = struct.unpack_from("<qq", attachment)
            assert seq >= 1
            assert before_ns - 60e9 < stamp < time.time_ns() + 60e9
            assert attachment[16] == 16
            assert attachment[17:].hex() == gids[name.rsplit("/", 1)[-1]]
        assert out_keys["std_msgs/msg/String"] == (
            "0/rt_out/String/std_msgs::msg::dds_::String_/"
            "RIHS01_df668c740482bbd48fb39d76a70dfd4bd59db1288021743503259e948f6b1a18")
        del sub
    finally:
        session.close()
        child.stop()
