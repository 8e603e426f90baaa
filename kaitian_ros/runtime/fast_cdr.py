"""A hand-written CDR codec for ``kaitian_ros/msg/TensorChunk``: the same bytes rosbags writes.

rosbags' generated (de)serializers cost ~20 us per TensorChunk, which caps 256-byte chunks near
17k msg/s. This module encodes and decodes that one type with precompiled ``struct.Struct``
objects - byte-identical to ``typestore().serialize_cdr`` (XCDR1, little endian, alignment
relative to the byte after the 4-byte encapsulation header, zero padding) and returning the
same rosbags dataclasses with ``shape``/``data`` as zero-copy numpy views. There is still ONE
wire format; ``test/test_fast_cdr.py`` checks equality with rosbags property by property.

Layout (offsets relative to the end of the encapsulation header ``00 01 00 00``)::

    int32 sec, uint32 nanosec, string frame_id, [pad 8] uint64 request_id, uint32 plan_version,
    string producer, [pad 4] string consumer, [pad 2] uint16 segment, uint8 role, [pad 4]
    uint32 row_offset, total_rows, slab_index, image_crc32, bool last_slab, uint8 dtype_code, dtype_bits,
    [pad 4] uint32 len(shape), [pad 8 if len > 0] int64 shape[], uint32 len(data), uint8 data[]

(a string is uint32 length incl. NUL, the UTF-8 bytes, NUL). Everything up to and including the
data length depends only on the lengths of the three strings and of ``shape``, so one
``struct.Struct`` per such length tuple writes it in a single ``pack_into``; the data is then
copied once into the same buffer.

``encode``/``encode_into`` return None for input they do not handle exactly like rosbags
(callers then use rosbags, which also raises rosbags' errors); ``decode`` returns None for
big-endian payloads and raises ``interfaces.DecodeError`` for anything rosbags would reject.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

TYPE_NAME = "kaitian_ros/msg/TensorChunk"
_LITTLE = sys.byteorder == "little"  # rosbags serializes in host order; we only do LE hosts
_INT64 = np.dtype(np.int64)
_UINT8 = np.dtype(np.uint8)
_ndarray = np.ndarray
_frombuffer = np.frombuffer

# decode-side structs (absolute offsets into the payload, encapsulation header included)
_U32 = struct.Struct("<I")
_STAMP_FLEN = struct.Struct("<iII")        # sec, nanosec, len(frame_id)
_REQ_PLAN_PLEN = struct.Struct("<QII")     # request_id, plan_version, len(producer)
_SEG_ROLE = struct.Struct("<HB")
# row_offset, total_rows, slab_index, image_crc32, last_slab, dtype_code, dtype_bits
_ROWS_FLAGS = struct.Struct("<IIII?BB")

class DecodeError(ValueError):
    """A payload that is not a valid CDR message of the expected type (``interfaces.DecodeError``)."""


_classes: tuple[Any, Any, Any] | None = None
_layouts: dict[tuple[int, int, int, int], tuple[struct.Struct, int]] = {}
_MAX_LAYOUTS = 4096  # distinct (frame_id, producer, consumer, ndim) length tuples kept


def _types() -> tuple[Any, Any, Any]:
    """(TensorChunk, Header, Time) rosbags dataclasses of the process-wide type store."""
    global _classes
    if _classes is None:
        from kaitian_ros.runtime import interfaces

        types = interfaces.typestore().types
        _classes = (types[TYPE_NAME], types["std_msgs/msg/Header"], types["builtin_interfaces/msg/Time"])
    return _classes


def _pad(fmt: list[str], pos: int, align: int) -> int:
    aligned = (pos + align - 1) & -align
    if aligned > pos:
        fmt.append(f"{aligned - pos}x")
    return aligned


def _layout(nf: int, np_: int, nc: int, ndim: int) -> tuple[struct.Struct, int]:
    """Struct writing the encapsulation header and every field before the data bytes."""
    fmt = ["<BBxx"]
    pos = 0  # relative to the end of the encapsulation header
    fmt.append(f"iII{nf + 1}s")                   # stamp, frame_id (NUL from 's' padding)
    pos += 12 + nf + 1
    pos = _pad(fmt, pos, 8)
    fmt.append(f"QII{np_ + 1}s")                  # request_id, plan_version, producer
    pos += 16 + np_ + 1
    pos = _pad(fmt, pos, 4)
    fmt.append(f"I{nc + 1}s")                     # consumer
    pos += 4 + nc + 1
    pos = _pad(fmt, pos, 2)
    fmt.append("HB")                              # segment, role
    pos += 3
    pos = _pad(fmt, pos, 4)
    fmt.append("IIII?BB")                         # rows, image_crc32, last_slab, dtype
    pos += 19
    pos = _pad(fmt, pos, 4)
    fmt.append("I")                               # len(shape)
    pos += 4
    if ndim:
        pos = _pad(fmt, pos, 8)
        fmt.append(f"{ndim}q")
        pos += 8 * ndim
    fmt.append("I")                               # len(data); pos is 4-aligned here
    pos += 4
    st = struct.Struct("".join(fmt))
    assert st.size == 4 + pos
    return st, st.size


def _prepare(msg: Any) -> tuple[struct.Struct, int, tuple, Any] | None:
    """(struct, offset of the data, values to pack, data array) or None if not ours to handle."""
    try:
        shape = msg.shape
        data = msg.data
        if (type(shape) is not _ndarray or type(data) is not _ndarray or shape.dtype != _INT64
                or data.dtype != _UINT8 or shape.ndim != 1 or data.ndim != 1
                or not data.flags.c_contiguous):
            return None
        head = msg.header
        stamp = head.stamp
        f = head.frame_id.encode()
        p = msg.producer.encode()
        c = msg.consumer.encode()
        ndim = len(shape)
        key = (len(f), len(p), len(c), ndim)
        lay = _layouts.get(key)
        if lay is None:
            if len(_layouts) >= _MAX_LAYOUTS:
                _layouts.clear()
            lay = _layouts[key] = _layout(*key)
        n = len(data)
        values = (0, 1, stamp.sec, stamp.nanosec, key[0] + 1, f,
                  msg.request_id, msg.plan_version, key[1] + 1, p, key[2] + 1, c,
                  msg.segment, msg.role, msg.row_offset, msg.total_rows, msg.slab_index,
                  msg.image_crc32, msg.last_slab, msg.dtype_code, msg.dtype_bits, ndim,
                  *(shape.tolist() if ndim else ()), n)
        return lay[0], lay[1], values, data
    except (AttributeError, TypeError, UnicodeError):
        return None


def size_of(prep: tuple[struct.Struct, int, tuple, Any]) -> int:
    return prep[1] + len(prep[3])


def write(buf: bytearray, prep: tuple[struct.Struct, int, tuple, Any]) -> bool:
    """Write a prepared message into ``buf`` (exactly ``size_of(prep)`` long); False on bad values."""
    st, off, values, data = prep
    try:
        st.pack_into(buf, 0, *values)
    except struct.error:  # out-of-range integer, non-int field...: rosbags decides what to raise
        return False
    if len(data):
        memoryview(buf)[off:] = data
    return True


def encode(msg: Any) -> bytearray | None:
    """CDR bytes of a TensorChunk in a fresh bytearray, or None (use rosbags) if unsupported."""
    if not _LITTLE:
        return None
    prep = _prepare(msg)
    if prep is None:
        return None
    buf = bytearray(prep[1] + len(prep[3]))
    return buf if write(buf, prep) else None


class Encoder:
    """Reuses one bytearray across messages of the same size (zenoh copies it in ``put``).

    Only for callers that hand the result to something that copies it before the next call.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def encode(self, msg: Any) -> bytearray | None:
        if not _LITTLE:
            return None
        prep = _prepare(msg)
        if prep is None:
            return None
        size = prep[1] + len(prep[3])
        buf = self._buf
        if len(buf) != size:
            buf = self._buf = bytearray(size)
        return buf if write(buf, prep) else None


def _string(buf: Any, pos: int, end: int) -> tuple[str, int]:
    """Decode a CDR string whose uint32 length is at absolute ``pos``; returns (text, next pos)."""
    if pos + 4 > end:
        raise DecodeError("truncated string length")
    (length,) = _U32.unpack_from(buf, pos)
    stop = pos + 4 + length
    if length < 1 or stop > end or buf[stop - 1] != 0:
        raise DecodeError(f"invalid string length {length} at offset {pos - 4}")
    return str(buf[pos + 4:stop - 1], "utf-8"), stop


def decode(payload: Any) -> Any:
    """TensorChunk from little-endian CDR; None for other encapsulations (rosbags handles them).

    Raises DecodeError exactly where rosbags' deserializer would raise.
    """
    try:
        end = len(payload)
        if end < 4 or payload[0] != 0 or payload[1] != 1:
            return None
        chunk_cls, header_cls, time_cls = _classes or _types()
        # header: stamp + frame_id
        if end < 16:
            raise DecodeError("truncated header")
        sec, nanosec, length = _STAMP_FLEN.unpack_from(payload, 4)
        stop = 16 + length
        if length < 1 or stop > end or payload[stop - 1] != 0:
            raise DecodeError(f"invalid frame_id length {length}")
        frame_id = str(payload[16:stop - 1], "utf-8")
        pos = ((stop - 4 + 7) & -8) + 4
        if pos + 16 > end:
            raise DecodeError("truncated request_id/plan_version/producer")
        request_id, plan_version, length = _REQ_PLAN_PLEN.unpack_from(payload, pos)
        pos += 12
        stop = pos + 4 + length
        if length < 1 or stop > end or payload[stop - 1] != 0:
            raise DecodeError(f"invalid producer length {length}")
        producer = str(payload[pos + 4:stop - 1], "utf-8")
        pos = ((stop - 4 + 3) & -4) + 4
        consumer, pos = _string(payload, pos, end)
        pos = ((pos - 4 + 1) & -2) + 4
        if pos + 3 > end:
            raise DecodeError("truncated segment/role")
        segment, role = _SEG_ROLE.unpack_from(payload, pos)
        pos = ((pos - 4 + 3 + 3) & -4) + 4
        if pos + 23 > end:
            raise DecodeError("truncated row fields / shape length")
        (row_offset, total_rows, slab_index, image_crc32, last_slab, dtype_code,
         dtype_bits) = _ROWS_FLAGS.unpack_from(payload, pos)
        pos = ((pos - 4 + 19 + 3) & -4) + 4
        (ndim,) = _U32.unpack_from(payload, pos)
        pos += 4
        if ndim:
            pos = ((pos - 4 + 7) & -8) + 4
        if pos + 8 * ndim > end:
            raise DecodeError(f"invalid shape length {ndim}")
        shape = _frombuffer(payload, _INT64, ndim, pos)
        pos += 8 * ndim
        if pos + 4 > end:
            raise DecodeError("truncated data length")
        (n,) = _U32.unpack_from(payload, pos)
        pos += 4
        if pos + n > end:
            raise DecodeError(f"invalid data length {n}")
        data = _frombuffer(payload, _UINT8, n, pos)
        if pos + n + 3 < end:  # rosbags tolerates up to 3 bytes of trailing padding
            raise DecodeError("CDR message size mismatch")
        return chunk_cls(header_cls(time_cls(sec, nanosec), frame_id), request_id, plan_version,
                         producer, consumer, segment, role, row_offset, total_rows, slab_index,
                         image_crc32, last_slab, dtype_code, dtype_bits, shape, data)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - UnicodeDecodeError, struct.error, ...: never anything but DecodeError
        raise DecodeError(f"malformed {TYPE_NAME}: {type(exc).__name__}: {exc}") from None
