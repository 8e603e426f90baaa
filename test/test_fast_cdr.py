"""The hand-written TensorChunk codec (runtime/fast_cdr.py) is byte-identical to rosbags.

One wire format: every encode is compared with rosbags' ``serialize_cdr`` byte for byte, every
decode with rosbags' ``deserialize_cdr`` field for field, and malformed input must be refused
(as DecodeError) exactly where rosbags refuses it.
"""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kaitian_ros.runtime import fast_cdr, interfaces

TYPE = "kaitian_ros/msg/TensorChunk"
FIELDS = ("request_id", "plan_version", "producer", "consumer", "segment", "role", "row_offset",
          "total_rows", "slab_index", "image_crc32", "last_slab", "dtype_code", "dtype_bits")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ts():
    return interfaces.typestore()


def chunk(*, frame_id="cam", sec=1, nanosec=2, shape=(1, 2, 3), data=b"\x01\x02\x03", **fields):
    Time = ts().types["builtin_interfaces/msg/Time"]
    Header = ts().types["std_msgs/msg/Header"]
    values = dict(request_id=7, plan_version=3, producer="compute_0", consumer="coordinator", segment=1,
                  role=2, row_offset=4, total_rows=224, slab_index=5, image_crc32=0xDEADBEEF, last_slab=True,
                  dtype_code=2, dtype_bits=32)
    values.update(fields)
    return ts().types[TYPE](header=Header(stamp=Time(sec=sec, nanosec=nanosec), frame_id=frame_id),
                            shape=np.asarray(shape, dtype=np.int64).reshape(-1),
                            data=np.frombuffer(bytearray(data), np.uint8), **values)


def rosbags_bytes(msg) -> bytes:
    return bytes(ts().serialize_cdr(msg, TYPE, little_endian=True))


def assert_same_message(ours, ref) -> None:
    assert type(ours) is type(ref)
    assert type(ours.header) is type(ref.header) and type(ours.header.stamp) is type(ref.header.stamp)
    assert (ours.header.stamp.sec, ours.header.stamp.nanosec, ours.header.frame_id) == \
        (ref.header.stamp.sec, ref.header.stamp.nanosec, ref.header.frame_id)
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(ref, name)
        assert type(a) is type(b) and a == b, name
    for name in ("shape", "data"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a, b), name


def rosbags_decode(payload):
    """('ok', msg) or ('error', None) as rosbags (through interfaces' normalisation) sees it."""
    try:
        buf = memoryview(payload)
        if len(buf) < 4 or buf[0] != 0 or buf[1] not in (0, 1):
            return "error", None
        return "ok", ts().deserialize_cdr(buf, TYPE)
    except Exception:  # noqa: BLE001 - as interfaces.decode: any error of rosbags means malformed
        return "error", None


def fast_decode(payload):
    try:
        return "ok", interfaces.decode(payload, TYPE)
    except interfaces.DecodeError:
        return "error", None


def u(bits: int) -> st.SearchStrategy[int]:
    return st.integers(0, 2**bits - 1)


text = st.text(max_size=24)  # any unicode (surrogates excluded: not UTF-8 encodable)

chunks = st.builds(
    lambda frame_id, sec, nanosec, shape, data, fields: chunk(frame_id=frame_id, sec=sec, nanosec=nanosec,
                                                               shape=shape, data=data, **fields),
    frame_id=text, sec=st.integers(-2**31, 2**31 - 1), nanosec=u(32),
    shape=st.lists(st.integers(-2**63, 2**63 - 1), max_size=6),
    data=st.binary(max_size=300),
    fields=st.fixed_dictionaries(dict(
        request_id=u(64), plan_version=u(32), producer=text, consumer=text, segment=u(16), role=u(8),
        row_offset=u(32), total_rows=u(32), slab_index=u(32), image_crc32=u(32), last_slab=st.booleans(),
        dtype_code=u(8), dtype_bits=u(8))),
)


# --- encode ------------------------------------------------------------------------------------

@SETTINGS
@given(chunks)
def test_encode_is_rosbags_byte_for_byte(msg):
    ref = rosbags_bytes(msg)
    assert bytes(fast_cdr.encode(msg)) == ref
    assert bytes(interfaces.encode(msg, "TensorChunk")) == ref
    enc = fast_cdr.Encoder()
    assert bytes(enc.encode(msg)) == ref
    assert bytes(enc.encode(msg)) == ref  # reused buffer: padding rewritten, not left over


def test_alignment_edges_all_small_string_lengths():
    """Every residue of the three string lengths mod 8, with 0, 1 and 2 shape entries."""
    for nf in range(9):
        for np_ in range(9):
            for nc in range(9):
                for ndim in range(3):
                    msg = chunk(frame_id="f" * nf, producer="p" * np_, consumer="c" * nc,
                                shape=list(range(1, ndim + 1)), data=b"\xff" * (nf + nc))
                    ref = rosbags_bytes(msg)
                    assert bytes(fast_cdr.encode(msg)) == ref, (nf, np_, nc, ndim)
                    assert_same_message(fast_cdr.decode(ref), ts().deserialize_cdr(memoryview(ref), TYPE))


def test_reused_encoder_buffer_has_zero_padding_after_dirty_use():
    enc = fast_cdr.Encoder()
    dirty = chunk(frame_id="x", producer="y", shape=[9, 9], data=b"\xff" * 8)
    out = enc.encode(dirty)
    out[:] = b"\xee" * len(out)  # the caller scribbles over the buffer
    assert bytes(enc.encode(dirty)) == rosbags_bytes(dirty)


def test_multibyte_unicode_and_embedded_nul():
    msg = chunk(frame_id="caméra-\u4e2d\U0001f600", producer="a\x00b", consumer="ü" * 5)
    ref = rosbags_bytes(msg)
    assert bytes(fast_cdr.encode(msg)) == ref
    assert_same_message(fast_cdr.decode(ref), ts().deserialize_cdr(memoryview(ref), TYPE))


def test_unhandled_input_falls_back_to_rosbags():
    # int8 data and uint64 shape: rosbags accepts them (viewed as bytes) - fast path declines
    odd = chunk()
    odd.data = np.arange(-3, 3, dtype=np.int8)
    odd.shape = np.array([6], np.uint64)
    assert fast_cdr.encode(odd) is None
    assert bytes(interfaces.encode(odd, "TensorChunk")) == rosbags_bytes(odd)
    # non-contiguous data
    strided = chunk()
    strided.data = np.arange(10, dtype=np.uint8)[::2]
    assert fast_cdr.encode(strided) is None
    # values rosbags refuses: the same error comes out of interfaces.encode
    for bad in (dict(request_id=-1), dict(segment=70000), dict(producer=b"bytes"), dict(role="x")):
        msg = chunk(**bad) if "producer" not in bad else chunk()
        if "producer" in bad:
            msg.producer = bad["producer"]
        assert fast_cdr.encode(msg) is None
        with pytest.raises(Exception) as ours:
            interfaces.encode(msg, "TensorChunk")
        with pytest.raises(Exception) as ref:
            ts().serialize_cdr(msg, TYPE)
        assert type(ours.value) is type(ref.value)
    lst = chunk()
    lst.shape = [1, 2]
    assert fast_cdr.encode(lst) is None


# --- decode ------------------------------------------------------------------------------------

@SETTINGS
@given(chunks)
def test_decode_equals_rosbags(msg):
    wire = rosbags_bytes(msg)
    ref = ts().deserialize_cdr(memoryview(wire), TYPE)
    for payload in (wire, bytearray(wire), memoryview(wire)):
        ours = interfaces.decode(payload, "TensorChunk")
        assert_same_message(ours, ref)
    assert_same_message(fast_cdr.decode(wire), ref)


def test_decode_is_zero_copy():
    msg = chunk(shape=[2, 4], data=bytes(range(8)))
    wire = bytearray(rosbags_bytes(msg))
    out = interfaces.decode(wire, "TensorChunk")
    assert not out.data.flags.owndata and not out.shape.flags.owndata
    assert np.shares_memory(out.data, np.frombuffer(wire, np.uint8))
    wire[-1] = 99  # a view: changes show through
    assert out.data[-1] == 99
    ro = interfaces.decode(bytes(wire), "TensorChunk")
    assert not ro.data.flags.writeable  # bytes payload -> read-only view, as with rosbags


def test_big_endian_payload_goes_to_rosbags():
    msg = chunk()
    be = bytes(ts().serialize_cdr(msg, TYPE, little_endian=False))
    assert fast_cdr.decode(be) is None
    assert_same_message(interfaces.decode(be, "TensorChunk"), ts().deserialize_cdr(memoryview(be), TYPE))


@SETTINGS
@given(chunks, st.data())
def test_truncated_and_padded_like_rosbags(msg, data):
    wire = rosbags_bytes(msg)
    cut = data.draw(st.integers(0, len(wire)))
    extra = data.draw(st.integers(0, 6))
    for payload in (wire[:cut], wire + b"\x00" * extra):
        ours, ref = fast_decode(payload), rosbags_decode(payload)
        assert ours[0] == ref[0], (len(payload), len(wire))
        if ref[0] == "ok":
            assert_same_message(ours[1], ref[1])


def test_every_prefix_of_a_message():
    wire = rosbags_bytes(chunk(frame_id="ab", producer="xyz", consumer="", shape=[3], data=b"abc"))
    for cut in range(len(wire) + 1):
        ours, ref = fast_decode(wire[:cut]), rosbags_decode(wire[:cut])
        assert ours[0] == ref[0], cut
    assert fast_decode(wire)[0] == "ok"


@SETTINGS
@given(chunks, st.data())
def test_corrupted_like_rosbags(msg, data):
    """Random byte overwrites: same accept/refuse verdict and, when accepted, the same message."""
    wire = bytearray(rosbags_bytes(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(wire) - 1))
        wire[pos] = data.draw(st.integers(0, 255))
    ours, ref = fast_decode(bytes(wire)), rosbags_decode(bytes(wire))
    assert ours[0] == ref[0]
    if ref[0] == "ok":
        assert_same_message(ours[1], ref[1])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_decode_error(payload):
    for candidate in (payload, b"\x00\x01\x00\x00" + payload):
        with contextlib.suppress(interfaces.DecodeError):  # the only exception allowed
            interfaces.decode(candidate, "TensorChunk")


def test_huge_lengths_are_decode_errors():
    wire = bytearray(rosbags_bytes(chunk(frame_id="", producer="", consumer="", shape=[], data=b"")))
    for pos in range(4, len(wire) - 3):
        bad = bytearray(wire)
        struct.pack_into("<I", bad, pos, 0xFFFFFFFF)
        ours, ref = fast_decode(bytes(bad)), rosbags_decode(bytes(bad))
        assert ours[0] == ref[0], pos


# --- through the embedded runtime (the reused encode buffer and the SHM put) --------------------

@pytest.mark.e2e
def test_large_chunks_arrive_intact_through_the_runtime():
    """Consecutive 1 MiB chunks (SHM put, reused encode buffer) and a small one arrive unchanged."""
    import threading

    from helpers import Router, wait_until

    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import NodeArgs

    router = Router()
    pub_rt = EmbeddedRuntime(NodeArgs("fast_pub"), router=router.endpoint, domain=0)
    sub_rt = EmbeddedRuntime(NodeArgs("fast_sub"), router=router.endpoint, domain=0)
    got: list = []
    try:
        sub_rt.create_subscription("/fast", "TensorChunk", got.append)
        threading.Thread(target=sub_rt.spin, daemon=True).start()
        pub = pub_rt.create_publisher("/fast", "TensorChunk")
        rng = np.random.default_rng(1)
        sent = [chunk(request_id=i, shape=[n], data=rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                for i, n in enumerate([1 << 20, 1 << 20, 1 << 20, 300])]
        def probe_through() -> bool:  # routes up: a probe chunk gets through
            pub.publish(chunk(request_id=99))
            return bool(got)

        wait_until(probe_through, "a probe chunk through the router", interval_s=0.1)
        for msg in sent:
            pub.publish(msg)
        # probes still in flight may arrive after the first real chunk: they are left out
        wait_until(lambda: len([m for m in got if m.request_id != 99]) >= len(sent), f"{len(sent)} chunks")
        received = [m for m in got if m.request_id != 99]
        assert [m.request_id for m in received] == [m.request_id for m in sent]
        for ours, ref in zip(received, sent):
            assert_same_message(ours, ref)
    finally:
        pub_rt.close()
        sub_rt.close()
        router.close()
