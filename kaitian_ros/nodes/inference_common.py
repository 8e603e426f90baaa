"""What the coordinator and compute nodes share beyond the protocol (`protocol`): model
parameters, the model and its plans, cost profiles and tensor chunks.

Both sides build the same model from the same parameters (the scenario file gives every
inference node the same ``model``/``input_*``/``seed``/``weights``) and the same plan from a plan
version's spec (strategy, nodes, cuts, per-segment shares), so a chunk only needs to carry its
plan version.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaitian_ros.core.costs import DeviceProfile, LinkEstimate, OpCost, model_key
from kaitian_ros.core.graph import ModelGraph
from kaitian_ros.core.models import build_model
from kaitian_ros.core.plan import Plan, PlanSpec, build_plan
from kaitian_ros.core.split import split_model
from kaitian_ros.core.strategy_names import STRATEGIES
from kaitian_ros.nodes.protocol import ROLE_INPUT, ROLE_TICKET, assignment_from_msg
from kaitian_ros.runtime import interfaces

MAX_LABELS_FILE_BYTES = 16 << 20
MAX_LABEL_CHARS = 256


def load_labels(names: Sequence[str], path: str, num_classes: int) -> tuple[str, ...]:
    """The class names by class index: `names` (the ``labels`` parameter) or the lines of the
    file at `path` (``labels_file``, UTF-8, one name per line); () when neither is given.
    ValueError saying what is wrong: both given, an unreadable or empty file, an empty or
    overlong name, or a count other than `num_classes`."""
    if names and path:
        raise ValueError("give labels or labels_file, not both")
    if path:
        try:
            raw = Path(path).read_bytes()[:MAX_LABELS_FILE_BYTES + 1]
        except OSError as exc:
            raise ValueError(f"labels_file {path!r}: {exc.strerror or exc}") from None
        if len(raw) > MAX_LABELS_FILE_BYTES:
            raise ValueError(f"labels_file {path!r} is over {MAX_LABELS_FILE_BYTES >> 20} MB")
        try:
            lines = [line.strip() for line in raw.decode("utf-8").splitlines()]
        except UnicodeDecodeError:
            raise ValueError(f"labels_file {path!r} is not UTF-8 text") from None
        while lines and not lines[-1]:
            lines.pop()
        names, where = lines, f"labels_file {path!r}"
    else:
        where = "labels"
    if not names:
        return ()
    for i, name in enumerate(names):
        if not name or len(name) > MAX_LABEL_CHARS:
            raise ValueError(f"{where}: class {i} has {'an empty' if not name else 'an overlong'} name "
                             f"(1-{MAX_LABEL_CHARS} characters)")
    if len(names) != num_classes:
        raise ValueError(f"{where} has {len(names)} names, the model has num_classes {num_classes}")
    return tuple(names)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    input_shape: tuple[int, int, int]
    num_classes: int
    seed: int
    weights: str

    @property
    def key(self) -> str:
        """What a cost profile must have been measured on to be used for this model."""
        return model_key(self.name, self.input_shape)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ModelSpec:
        return cls(params["model"], (params["input_channels"], params["input_height"], params["input_width"]),
                   params["num_classes"], params["seed"], params["weights"])


def build_graph(spec: ModelSpec, device: str = "cpu") -> ModelGraph:
    """Model in eval mode on `device`, traced and split into trunk and head (raises ValueError
    clearly)."""
    if torch.device(device).type == "cuda":
        full_float32_on_cuda()
    try:
        model = build_model(spec.name, num_classes=spec.num_classes, in_channels=spec.input_shape[0],
                            seed=spec.seed, state_dict_path=spec.weights or None)
        return split_model(model.to(device), spec.input_shape)
    except (ImportError, AttributeError, FileNotFoundError, RuntimeError) as exc:
        raise ValueError(f"cannot build model {spec.name!r}: {exc}") from None


def full_float32_on_cuda() -> None:
    """Turn off TF32 in cuDNN convolutions and cuBLAS matmuls for this process.

    PyTorch lets cuDNN use TF32 (a 10-bit mantissa) for float32 convolutions by default. A
    stripe then differs from the same rows computed whole by about 1e-3 of the output's
    magnitude, and a split on a GPU node would no longer equal the single-device result
    within the 1e-4 the exactness tests hold every strategy to (docs/planner.md)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def check_device(name: str) -> torch.device:
    """The torch device `name`, or ValueError saying why it cannot be used on this machine."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device {name!r} is not a torch device string: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available to this torch "
                             f"({torch.__version__}) on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        try:  # vendor back ends (npu, mlu, xpu, ...) register on import; try a tensor there
            torch.empty(1, device=dev)
        except Exception as exc:  # noqa: BLE001 - any failure means unusable here
            raise ValueError(f"device {name!r} is not usable here: {exc}") from None
    return dev


def busy_clock(device: torch.device) -> Callable[[], float]:
    """A clock of this node's device work, in seconds, for compute times in telemetry.

    On a CPU device it is CPU time, not wall time: co-located nodes (the emulated devices here,
    the coordinator) share cores, and in wall time a node's measured speed would include the
    time it waited for a core - which depends on the other nodes' shares. A node with the
    larger share runs alone at the end of a request, looks faster, gets more rows: positive
    feedback that pulled equal nodes apart to 0.16/0.77 (docs/policy.md "Compute time"). With
    one torch thread the ops run on the calling thread, so it is that thread's CPU time (the
    middleware's threads do not count); with more, the process's per torch thread.
    Accelerators are timed in wall time (the caller synchronises).
    """
    if device.type == "cpu":
        def cpu_clock() -> float:
            n = torch.get_num_threads()
            return time.thread_time() if n == 1 else time.process_time() / n
        return cpu_clock
    return time.perf_counter


def sleep_until(deadline: float) -> None:
    """Sleep until perf_counter() reaches `deadline` (at once if it has passed): an EMULATED
    slower device releases its rows only then."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def spec_from_msg(msg: Any) -> PlanSpec:
    """The plan spec a /kaitian/plan message carries (ValueError with the reason).

    An empty ``segment_shares`` means ``shares`` in every segment; an empty ``strategy``
    means stripes."""
    a = assignment_from_msg(msg)
    strategy = msg.strategy or "stripes"
    if strategy not in STRATEGIES:
        raise ValueError(f"plan v{a.version}: unknown strategy {strategy!r}")
    cuts = tuple(int(c) for c in msg.cut_values)
    n, segs = len(a.node_ids), len(cuts) + 1
    flat = [float(x) for x in msg.segment_shares]
    if not flat:
        rows = (a.shares,) * segs
    elif len(flat) != n * segs:
        raise ValueError(f"plan v{a.version}: {len(flat)} segment shares for {segs} segments x {n} nodes")
    else:
        rows = tuple(tuple(flat[k * n:(k + 1) * n]) for k in range(segs))
    for row in rows:
        if any(not math.isfinite(x) or x < 0 for x in row) or sum(row) <= 0:
            raise ValueError(f"plan v{a.version}: invalid segment shares {row}")
    return PlanSpec(strategy, a.node_ids, cuts, rows)


def plan_from_msg(graph: ModelGraph, msg: Any, slab_rows: int) -> Plan:
    """The plan a /kaitian/plan message describes (ValueError with the reason); `slab_rows`
    where the message names no slab size."""
    return build_plan(graph, spec_from_msg(msg), slab_rows=int(msg.slab_rows) or slab_rows,
                      estimated_ms=float(msg.predicted_makespan_ms))


def profile_msg(p: DeviceProfile) -> Any:
    links = sorted(p.links.items())
    return interfaces.make(
        "CostProfile", node_id=p.node_id, version=p.version, model=p.model, device=p.device,
        emulated=p.emulated, emulated_slowdown=p.emulated_slowdown, trunk_ms=p.trunk_ms,
        op_call_ms=np.asarray([c.call_ms for c in p.op_costs], np.float64),
        op_row_ms=np.asarray([c.row_ms for c in p.op_costs], np.float64), message_ms=p.message_ms,
        min_run_rows=p.min_run_rows, run_ms=p.run_ms,
        run_samples=p.run_samples, link_sources=[s for s, _ in links],
        link_bytes_per_ms=np.asarray([e.bytes_per_ms for _, e in links], np.float64),
        link_latency_ms=np.asarray([e.latency_ms for _, e in links], np.float64),
        link_samples=np.asarray([e.samples for _, e in links], np.uint32))


def profile_from_msg(msg: Any) -> DeviceProfile:
    """The profile a CostProfile message carries (ValueError when its arrays disagree)."""
    calls, rows = list(msg.op_call_ms), list(msg.op_row_ms)
    if len(calls) != len(rows):
        raise ValueError(f"profile of {msg.node_id}: {len(calls)} call times but {len(rows)} row times")
    srcs = list(msg.link_sources)
    if not (len(srcs) == len(msg.link_bytes_per_ms) == len(msg.link_latency_ms) == len(msg.link_samples)):
        raise ValueError(f"profile of {msg.node_id}: link arrays of different lengths")
    links = {s: LinkEstimate(float(r), float(lat), int(n)) for s, r, lat, n in
             zip(srcs, msg.link_bytes_per_ms, msg.link_latency_ms, msg.link_samples)}
    return DeviceProfile(msg.node_id, int(msg.version), msg.model, msg.device, float(msg.emulated_slowdown),
                         tuple(OpCost(float(c), float(r)) for c, r in zip(calls, rows)), float(msg.trunk_ms),
                         float(msg.message_ms), int(msg.min_run_rows), float(msg.run_ms), int(msg.run_samples),
                         links)


def chunk_message(*, request_id: int, plan_version: int, producer: str, consumer: str, segment: int,
                  role: int, row_offset: int, total_rows: int, rows: torch.Tensor, slab_index: int = 0,
                  last_slab: bool = False, frame_id: str = "", stamp: Any = None, image_crc32: int = 0) -> Any:
    return interfaces.make("TensorChunk", header=interfaces.header(frame_id, stamp), request_id=request_id,
                           plan_version=plan_version, producer=producer, consumer=consumer,
                           segment=segment, role=role, row_offset=row_offset, total_rows=total_rows,
                           slab_index=slab_index, image_crc32=image_crc32, last_slab=last_slab,
                           **interfaces.tensor_fields(rows))


NO_ROWS = torch.empty(0, dtype=torch.uint8)  # a ticket carries no tensor


def ticket_message(*, request_id: int, plan_version: int, producer: str, consumer: str, frame_id: str,
                   stamp: Any, image_crc32: int, total_rows: int = 0) -> Any:
    """A TensorChunk of role TICKET (the direct path): the coordinator's to the node taking the
    camera images, or the node's giving it back; the header is the camera image's, and with the
    CRC-32 of its data it names the image."""
    return chunk_message(request_id=request_id, plan_version=plan_version, producer=producer, consumer=consumer,
                         segment=0, role=ROLE_TICKET, row_offset=0, total_rows=total_rows, rows=NO_ROWS,
                         frame_id=frame_id, stamp=stamp, image_crc32=image_crc32)


FRAME_BATCH = 1  # a request is one camera frame: every chunk of it carries batch size 1


def chunk_shape_problem(graph: ModelGraph, plan: Plan, msg: Any) -> str:
    """Why a compute node's chunk cannot belong to ``plan`` ('' if it can), read from the
    header fields alone: checked before its rows are decoded or any buffer is allocated, so a
    forged shape (batch 64, a huge width) costs nothing."""
    segment = int(msg.segment)
    if not 0 <= segment < plan.num_segments:
        return f"segment {segment} not in v{int(msg.plan_version)} (0..{plan.num_segments - 1})"
    c, h, w = graph.value_shapes[plan.segments[segment].in_value]
    shape = tuple(int(d) for d in msg.shape)
    if len(shape) != 4:
        return f"chunk shape {shape} is not (N,C,rows,W)"
    n, rc, r, rw = shape
    offset = int(msg.row_offset)
    if n != FRAME_BATCH or rc != c or rw != w or r < 1 or offset + r > h or int(msg.total_rows) != h:
        return (f"chunk shape {shape} at row {offset} of {int(msg.total_rows)} does not fit segment {segment} "
                f"of v{int(msg.plan_version)}: ({FRAME_BATCH},{c},rows,{w}) within {h} rows")
    return ""


def chunk_rows(msg: Any) -> torch.Tensor:
    """The rows a chunk carries (N, C, r, W); DecodeError if inconsistent.

    Float rows everywhere, except INPUT chunks which may carry uint8 pixel rows."""
    rows = interfaces.tensor_from_fields(msg)
    if rows.dim() != 4:
        raise interfaces.DecodeError(f"chunk shape {tuple(rows.shape)} is not (N,C,rows,W)")
    pixels = rows.dtype == torch.uint8 and msg.role == ROLE_INPUT
    if not rows.is_floating_point() and not pixels:
        raise interfaces.DecodeError(f"chunk dtype {rows.dtype} is not floating point")
    return rows


def fused_message(*, request_id: int, plan_version: int, frame_id: str, image_stamp: Any, latency_ms: float,
                  result: torch.Tensor | None, labels: Sequence[str], node_ids: Sequence[str],
                  node_rows: Sequence[int], status: str) -> Any:
    """The FusedOutput of a request (`result` None: it did not complete): the coordinator's, or
    on the direct path the one node's that computed it."""
    top_class, top_score = -1, 0.0
    fields: dict[str, Any] = {}
    if result is not None:
        flat = result.reshape(result.shape[0], -1)
        if result.dim() == 2 and flat.shape[1] > 1:
            probs = torch.softmax(flat[0], dim=0)
            top_class, top_score = int(probs.argmax()), float(probs.max())
        fields = interfaces.tensor_fields(result.contiguous())
    return interfaces.make(
        "FusedOutput", header=interfaces.header(frame_id, image_stamp), request_id=request_id,
        plan_version=plan_version, complete=result is not None, top_class=top_class, top_score=top_score,
        top_label=labels[top_class] if 0 <= top_class < len(labels) else "",
        latency_ms=latency_ms, node_ids=list(node_ids), node_rows=np.asarray(node_rows, np.uint32),
        status=status, **fields)
