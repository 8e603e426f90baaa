"""Message types and the one codec (rosbags CDR) shared by both runtimes.

Our interfaces are registered at run time from the ``.msg`` files in ``msg/`` into a
rosbags type store for ROS 2 Jazzy, so the embedded runtime and rclpy see the same
bytes, and RIHS01 type hashes equal those rosidl computes.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.runtime import fast_cdr

PACKAGE = "kaitian_ros"
OWN_TYPES = ("TensorChunk", "LoadAssignment", "NodeTelemetry", "FusedOutput", "TrainingTelemetry", "CostProfile",
             "BenchChunk")

# Short names nodes use; the full rosidl names are what goes on the wire.
TYPE_ALIASES = {name: f"{PACKAGE}/msg/{name}" for name in OWN_TYPES} | {
    "Image": "sensor_msgs/msg/Image",
    "String": "std_msgs/msg/String",
    "Header": "std_msgs/msg/Header",
    "DiagnosticArray": "diagnostic_msgs/msg/DiagnosticArray",
    "DiagnosticStatus": "diagnostic_msgs/msg/DiagnosticStatus",
    "KeyValue": "diagnostic_msgs/msg/KeyValue",
    "Time": "builtin_interfaces/msg/Time",
}


# A payload that is not a valid CDR message of the expected type (a ValueError). Defined next
# to the hand-written TensorChunk codec, which raises it too.
DecodeError = fast_cdr.DecodeError


def share_dirs() -> list[Path]:
    """Candidate ``share/kaitian_ros`` folders: source tree first, then installed prefixes."""
    candidates = [Path(__file__).resolve().parents[2]]  # repository root (source / editable install)
    candidates.append(Path(sys.prefix) / "share" / PACKAGE)
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if prefix:
            candidates.append(Path(prefix) / "share" / PACKAGE)
    return [c for c in candidates if (c / "msg").is_dir()]


def find_share_file(kind: str, name: str) -> Path:
    """Locate ``<share>/<kind>/<name>`` (kind: msg, config, launch) or raise FileNotFoundError."""
    for base in share_dirs():
        path = base / kind / name
        if path.exists():
            return path
    raise FileNotFoundError(f"{kind}/{name} not found in any of: {[str(p) for p in share_dirs()]}")


@functools.lru_cache(maxsize=1)
def typestore() -> Any:
    """The process-wide rosbags type store (Jazzy + kaitian_ros interfaces)."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_JAZZY)
    types: dict = {}
    for name in OWN_TYPES:
        text = find_share_file("msg", f"{name}.msg").read_text()
        types.update(get_types_from_msg(text, f"{PACKAGE}/msg/{name}"))
    store.register(types)
    return store


def full_type_name(name: str) -> str:
    """``TensorChunk`` / ``kaitian_ros/msg/TensorChunk`` -> ``kaitian_ros/msg/TensorChunk``."""
    full = TYPE_ALIASES.get(name, name)
    if full not in typestore().types:
        raise KeyError(f"unknown message type {name!r}")
    return full


def msg_class(name: str) -> type:
    """The rosbags dataclass of a message type."""
    return typestore().types[full_type_name(name)]


def dds_type_name(name: str) -> str:
    """``pkg/msg/Name`` -> ``pkg::msg::dds_::Name_`` (rmw naming used in zenoh keys)."""
    pkg, kind, short = full_type_name(name).split("/")
    return f"{pkg}::{kind}::dds_::{short}_"


@functools.cache
def type_hash(name: str) -> str:
    """RIHS01 type hash as rosidl computes it."""
    return typestore().hash_rihs01(full_type_name(name))


_FAST_TYPE = f"{PACKAGE}/msg/TensorChunk"  # the hot type: hand-written codec, same bytes


def encode(msg: Any, name: str) -> memoryview | bytearray:
    """CDR bytes (with the 4-byte encapsulation header) of ``msg``.

    TensorChunk goes through ``fast_cdr`` (byte-identical to rosbags, ~10x faster); anything it
    does not handle, and every other type, through rosbags. That includes the bench's
    BenchChunk: one whole tensor per message, where rosbags' cost is the copy of the data, as
    the fast path's (78 against 72 us for 800 KB).
    """
    full = full_type_name(name)
    if full == _FAST_TYPE:
        out = fast_cdr.encode(msg)
        if out is not None:
            return out
    return typestore().serialize_cdr(msg, full)


def decode(payload: bytes | bytearray | memoryview, name: str) -> Any:
    """Message from CDR bytes; primitive arrays are zero-copy numpy views into ``payload``.

    Raises DecodeError (never anything else) for malformed or truncated input.
    """
    full = full_type_name(name)
    if full == _FAST_TYPE and (type(payload) is bytes or type(payload) is bytearray
                               or (type(payload) is memoryview and payload.format == "B"
                                   and payload.ndim == 1 and payload.c_contiguous)):
        msg = fast_cdr.decode(payload)  # raises DecodeError where rosbags would refuse
        if msg is not None:
            return msg
    try:
        buf = payload if isinstance(payload, memoryview) else memoryview(payload)
        if len(buf) < 4 or buf[0] != 0 or buf[1] not in (0, 1):
            raise DecodeError("not CDR: bad encapsulation header")
        return typestore().deserialize_cdr(buf, full)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - rosbags raises assorted errors on garbage: normalise them
        raise DecodeError(f"malformed {name}: {type(exc).__name__}: {exc}") from None


# --- message construction helpers -------------------------------------------------------

def stamp_now() -> Any:
    """builtin_interfaces/Time of the wall clock now."""
    ns = time.time_ns()
    return msg_class("Time")(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def stamp_to_s(stamp: Any) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def stamp_key(stamp: Any) -> tuple[int, int]:
    """A builtin_interfaces/Time as a hashable key: a camera frame's identity, which every
    FusedOutput of that frame carries in its header."""
    return int(stamp.sec), int(stamp.nanosec)


def header(frame_id: str = "", stamp: Any = None) -> Any:
    return msg_class("Header")(stamp=stamp or stamp_now(), frame_id=frame_id)


def make(msg_type: str, /, **fields: Any) -> Any:
    """Build a message, defaulting every field the caller leaves out (a header stamps now)."""
    full = full_type_name(msg_type)
    _, fielddefs = typestore().fielddefs[full]
    unknown = set(fields) - {f for f, _ in fielddefs}
    if unknown:
        raise TypeError(f"{full} has no field(s) {sorted(unknown)}")
    values = {f: fields[f] if f in fields else _default_value(desc) for f, desc in fielddefs}
    return msg_class(full)(**values)


def _default_value(desc: Any) -> Any:
    kind, detail = desc
    if kind.name == "BASE":
        base = detail[0]
        return "" if base == "string" else (False if base == "bool" else 0)
    if kind.name == "NAME":
        return header() if detail == "std_msgs/msg/Header" else make(detail)
    inner_kind, inner_detail = detail[0]
    if inner_kind.name == "BASE" and inner_detail[0] != "string":
        length = detail[1] if kind.name == "ARRAY" else 0
        return np.zeros(length, dtype=NUMPY_OF_ROS[inner_detail[0]])
    if kind.name == "ARRAY":
        return [_default_value(detail[0]) for _ in range(detail[1])]
    return []


NUMPY_OF_ROS = {
    "bool": np.bool_, "byte": np.uint8, "char": np.uint8, "int8": np.int8, "uint8": np.uint8,
    "int16": np.int16, "uint16": np.uint16, "int32": np.int32, "uint32": np.uint32,
    "int64": np.int64, "uint64": np.uint64, "float32": np.float32, "float64": np.float64,
}


# --- tensors <-> ExperimentalTensor-style fields -----------------------------------------

_DLPACK_OF_NUMPY: dict[np.dtype[Any], tuple[int, int]] = {
    np.dtype(np.float32): (2, 32), np.dtype(np.float64): (2, 64), np.dtype(np.float16): (2, 16),
    np.dtype(np.int8): (0, 8), np.dtype(np.int16): (0, 16), np.dtype(np.int32): (0, 32),
    np.dtype(np.int64): (0, 64), np.dtype(np.uint8): (1, 8), np.dtype(np.uint16): (1, 16),
    np.dtype(np.uint32): (1, 32), np.dtype(np.uint64): (1, 64), np.dtype(np.bool_): (6, 8),
}
_NUMPY_OF_DLPACK = {v: k for k, v in _DLPACK_OF_NUMPY.items()}


def tensor_fields(tensor: Any) -> dict[str, Any]:
    """dtype_code, dtype_bits, shape, data for a torch tensor or numpy array (no copy if contiguous)."""
    try:
        import torch

        if isinstance(tensor, torch.Tensor):
            if tensor.dtype == torch.bfloat16:
                raw = tensor.detach().contiguous().cpu().view(torch.uint16).numpy()
                return {"dtype_code": 4, "dtype_bits": 16, "shape": np.asarray(raw.shape, np.int64),
                        "data": raw.reshape(-1).view(np.uint8)}
            tensor = tensor.detach().cpu().contiguous().numpy()
    except ImportError:  # torch is optional for pure message tools
        pass
    arr = np.ascontiguousarray(tensor)
    code, bits = _DLPACK_OF_NUMPY[arr.dtype]
    return {"dtype_code": code, "dtype_bits": bits, "shape": np.asarray(arr.shape, np.int64),
            "data": arr.reshape(-1).view(np.uint8)}


def array_from_fields(msg: Any) -> np.ndarray:
    """numpy view of a message's tensor fields (zero copy; read-only if the payload was bytes)."""
    shape = tuple(int(s) for s in msg.shape)
    key = (int(msg.dtype_code), int(msg.dtype_bits))
    dtype: np.dtype[Any]
    if key == (4, 16):
        dtype = np.dtype(np.uint16)
    elif key in _NUMPY_OF_DLPACK:
        dtype = _NUMPY_OF_DLPACK[key]
    else:
        raise DecodeError(f"unsupported dtype code {key[0]} bits {key[1]}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if any(s < 0 for s in shape) or len(msg.data) != expected:
        raise DecodeError(f"tensor data is {len(msg.data)} bytes, shape {shape} needs {expected}")
    return np.asarray(msg.data).view(dtype).reshape(shape)


def tensor_from_fields(msg: Any) -> Any:
    """torch tensor sharing memory with the message (callers must not write to it)."""
    import torch

    arr = array_from_fields(msg)
    with warnings.catch_warnings():
        # Read-only buffers are fine: nodes never write into received rows.
        warnings.simplefilter("ignore", UserWarning)
        out = torch.from_numpy(arr)
    if (int(msg.dtype_code), int(msg.dtype_bits)) == (4, 16):
        out = out.view(torch.bfloat16)
    return out
