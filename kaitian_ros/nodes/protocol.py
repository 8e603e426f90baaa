"""The inference graph's protocol, without torch: its topics, chunk roles, request ids, and how
a node builds and checks the control messages (plans and assignments, telemetry).

Nodes that never touch a tensor - the scheduler, a perception node, the benchmarks' attackers -
import this instead of `inference_common`, which builds models: importing torch costs a process
about 1.5 s of CPU and 200 MB at start-up.
"""

from __future__ import annotations

import hashlib
import math
import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from kaitian_ros.core.authority import AuthorityTracker, ImpersonationGuard, Verdict
from kaitian_ros.core.policy_state import Assignment
from kaitian_ros.runtime import interfaces

if TYPE_CHECKING:
    from kaitian_ros.core.plan import Plan

COORDINATOR = "coordinator"
CHUNK_TOPIC_PREFIX = "/kaitian/chunks/"
TELEMETRY_TOPIC = "/kaitian/telemetry"
PLAN_TOPIC = "/kaitian/plan"              # the plan versions actually executed (coordinator, latched)
ASSIGNMENT_TOPIC = "/kaitian/assignment"  # the scheduler's proposals (latched)
PROFILES_TOPIC = "/kaitian/profiles"      # compute nodes' measured costs (latched)
FUSED_TOPIC = "/kaitian/fused"
ROLE_INPUT, ROLE_HALO, ROLE_OUTPUT, ROLE_OUTPUT_SUM, ROLE_TICKET = 0, 1, 2, 3, 4  # msg/TensorChunk.msg
ROLE_NAMES = {ROLE_INPUT: "INPUT", ROLE_HALO: "HALO", ROLE_OUTPUT: "OUTPUT", ROLE_OUTPUT_SUM: "OUTPUT_SUM",
              ROLE_TICKET: "TICKET"}
ROLE_OF_NAME = {v: k for k, v in ROLE_NAMES.items()}

# Request ids: a coordinator numbers its requests from its start time in microseconds, so the ids
# of a restarted coordinator continue above the old ones (no run makes a request per microsecond)
# and no id is ever far ahead of the wall clock: anything beyond REQUEST_ID_SKEW_S ahead is forged
# or corrupt (one telemetry message with id 2**64-1 once wedged the scheduler for good).
# compute nodes send heartbeats at heartbeat_hz >= MIN_HEARTBEAT_HZ; a node counts as dead after
# dead_after_s of silence, which must span two of the slowest heartbeats or live nodes flap in
# and out of the plan (a dead_after_s below the heartbeat period once made 106 flaps in 12 s)
MIN_HEARTBEAT_HZ = 2.0
MIN_DEAD_AFTER_S = 2.0 / MIN_HEARTBEAT_HZ
REQUEST_ID_SKEW_S = 3600.0  # clocks of the graph's hosts may differ by this much
MAX_EFFECTIVE_LEAD = 10_000  # an assignment takes effect at most this many requests ahead


def first_request_id() -> int:
    return time.time_ns() // 1000


def request_id_problem(request_id: int, now_s: float | None = None) -> str:
    """'' if ``request_id`` could come from a coordinator, else why not."""
    limit = int(((time.time() if now_s is None else now_s) + REQUEST_ID_SKEW_S) * 1e6)
    if not 0 < request_id <= limit:
        return f"implausible request id: {request_id} (ids are a coordinator's start time in us plus a count)"
    return ""


def chunk_topic(node_id: str) -> str:
    return CHUNK_TOPIC_PREFIX + node_id


def assignment_msg(a: Assignment, incarnation: int, plan: Plan | None = None, runner_up: str = "",
                   runner_up_ms: float = 0.0, image_topic: str = "") -> Any:
    """LoadAssignment message of a scheduler proposal, or with `plan` of an executed plan, from
    the publisher's run `incarnation` (`core.authority`); `image_topic`: the camera topic the
    plan's one node takes its images from itself (the direct path)."""
    fields: dict[str, Any] = {}
    if plan is not None:
        spec = plan.spec
        uniform = all(row == spec.segment_shares[0] for row in spec.segment_shares)
        fields = {"strategy": spec.strategy, "cut_values": np.asarray(spec.cuts, np.uint16),
                  "segment_shares": np.asarray([] if uniform and spec.strategy == "stripes" else
                                               [x for row in spec.segment_shares for x in row], np.float64),
                  "runner_up": runner_up, "runner_up_ms": float(runner_up_ms), "slab_rows": plan.slab_rows,
                  "image_topic": image_topic}
    return interfaces.make("LoadAssignment", incarnation=incarnation, version=a.version,
                           effective_from_request=a.effective_from_request,
                           node_ids=list(a.node_ids), shares=np.asarray(a.shares, np.float64),
                           policy=a.policy, reason=a.reason, predicted_makespan_ms=a.predicted_makespan_ms,
                           **fields)


def image_crc32(data: Any) -> int:
    """CRC-32 of a camera image's data (any buffer: numpy, array.array, bytes)."""
    return zlib.crc32(data)


def image_key(header: Any, crc32: int) -> tuple[int, int, str, int]:
    """What names a camera image between the coordinator and a node taking it itself: its
    header's stamp and frame_id and the CRC-32 of its data (`core.tickets`)."""
    return int(header.stamp.sec), int(header.stamp.nanosec), str(header.frame_id), int(crc32)


def accept_versioned(rt: Any, tracker: AuthorityTracker, msg: Any) -> Verdict | None:
    """The tracker's verdict on a LoadAssignment's (incarnation, version) if accepted (a restart
    is logged); None if not, a refusal counted with its reason (a re-delivery is not)."""
    verdict = tracker.check(int(msg.incarnation), int(msg.version))
    if not verdict.accept:
        if verdict.rejected:
            rt.rejected.count(verdict.reason)
        return None
    if verdict.reset:
        rt.logger.info(verdict.reason)
    return verdict


def assignment_from_msg(msg: Any) -> Assignment:
    """Validated assignment from a LoadAssignment message (ValueError with the reason)."""
    shares = tuple(float(s) for s in msg.shares)
    node_ids = tuple(msg.node_ids)
    if len(shares) != len(node_ids) or not node_ids:
        raise ValueError(f"assignment v{msg.version}: {len(node_ids)} nodes but {len(shares)} shares")
    if any(not math.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"assignment v{msg.version}: invalid shares {shares}")
    return Assignment(int(msg.version), int(msg.effective_from_request), node_ids, shares, msg.policy,
                      msg.reason, float(msg.predicted_makespan_ms))


def members(assignment: Any) -> frozenset[str]:
    """The nodes an assignment gives rows: an `Assignment`, or a LoadAssignment message (a plan
    or a proposal), alike."""
    return frozenset(n for n, x in zip(assignment.node_ids, assignment.shares) if x > 0)


def static_shares_problem(shares: list[float], nodes: list[str], *, empty_ok: bool = False) -> str:
    """'' if ``shares`` fit ``nodes`` (one per node, not all zero), else why not: the
    coordinator and the scheduler refuse the same values with the same words."""
    if empty_ok and not shares:
        return ""
    if len(shares) != len(nodes):
        return f"static_shares has {len(shares)} values for {len(nodes)} compute nodes"
    if sum(shares) <= 0:
        return "static_shares must not all be zero"
    return ""


MAX_TELEMETRY_MS = 3_600_000.0  # an hour: no request measures more


def telemetry_problem(msg: Any) -> str:
    """Why a request's NodeTelemetry cannot be a real measurement ('' if it can): every number
    the scheduler's estimates are built from must be finite and in range (a NaN compute time
    would poison the speed estimate for good)."""
    for name in ("compute_ms", "transfer_ms", "wait_ms"):
        value = float(getattr(msg, name))
        if not (math.isfinite(value) and 0.0 <= value <= MAX_TELEMETRY_MS):
            return f"implausible telemetry: {name} {value!r}"
    work = float(msg.work)
    if not (math.isfinite(work) and work >= 0.0):
        return f"implausible telemetry: work {work!r}"
    share = float(msg.share)
    if not (math.isfinite(share) and 0.0 <= share <= 1.0):
        return f"implausible telemetry: share {share!r}"
    if int(msg.rows) > 1_000_000:
        return f"implausible telemetry: rows {int(msg.rows)}"
    return ""


def assignment_digest(msg: Any) -> bytes:
    """A LoadAssignment's identity as an authority checks it: the digest of its CDR bytes (a
    decoded message encodes to the same bytes, field for field)."""
    return hashlib.blake2b(bytes(interfaces.encode(msg, "LoadAssignment")), digest_size=16).digest()


def answer_on_own_topic(rt: Any, guard: ImpersonationGuard, msg: Any, topic: str,
                        now_s: float) -> tuple[str, int | None]:
    """What an authority (coordinator, scheduler) makes of a LoadAssignment on its own topic:
    ('', None) for its own; else why it is forged (counted as rejected) and the incarnation to
    re-announce under (None while the guard's rate bound holds: it owes one then)."""
    try:
        reason = guard.check(int(msg.incarnation), int(msg.version), assignment_digest(msg))
    except (ValueError, OverflowError, TypeError) as exc:  # a decoded message re-encodes; be safe
        reason = f"impostor: unencodable message on {topic}: {exc}"
    if not reason:
        return "", None
    rt.rejected.count(reason)
    return reason, guard.answer(now_s)
