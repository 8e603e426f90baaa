"""The share policy's values (docs/policy.md): telemetry samples, per-node estimates, published
assignments and the :class:`PolicyState` threaded through :mod:`kaitian_ros.core.policy`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class TelemetrySample:
    """What one node reports for one request.

    ``work`` is the model cost (e.g. flops) the node actually computed, halo included.
    ``wait_ms`` is only used as a fixed cost when ``wait_as_fixed`` is set (see docs).
    """

    node_id: str
    request_id: int
    rows: int
    work: float
    compute_ms: float
    transfer_ms: float
    wait_ms: float
    bytes_in: int
    bytes_out: int
    stamp_s: float
    share: float = 0.0  # the node's share of the plan it ran; 0 = look it up in the history


@dataclass(frozen=True)
class NodeEstimate:
    """EWMA view of one node. speed/link are ratios of EWMAs (robust to one tiny sample)."""

    node_id: str
    speed: float = 0.0            # work per ms of compute; 0.0 = unknown
    link_rate: float = math.inf   # bytes per ms of transfer; inf = no transfer observed
    fixed_ms: float = 0.0         # EWMA of wait_ms (share-independent cost, if enabled)
    samples: int = 0              # valid telemetry samples folded in
    last_seen_s: float | None = None
    # EWMA moments the ratios come from (kept so the estimate is a pure fold over samples).
    ew_work: float = 0.0
    ew_compute_ms: float = 0.0
    ew_bytes: float = 0.0
    ew_transfer_ms: float = 0.0
    link_samples: int = 0
    # change detection: consecutive samples whose speed is off the estimate by change_ratio
    # in one direction (+n faster, -n slower); samples left in the settling window after one
    surprise: int = 0
    settle: int = 0


MAX_REQUEST_ID = 2**64 - 1


@dataclass(frozen=True)
class Assignment:
    """A published plan. Shares align with node_ids and sum to 1."""

    version: int
    effective_from_request: int
    node_ids: tuple[str, ...]
    shares: tuple[float, ...]
    policy: str
    reason: str
    predicted_makespan_ms: float  # 0.0 = unknown (no telemetry yet)


@dataclass(frozen=True)
class PolicyState:
    """Everything the policy remembers. Mappings are read-only views; never mutate."""

    order: tuple[str, ...] = ()                                   # plan order of node ids
    estimates: Mapping[str, NodeEstimate] = field(default_factory=lambda: MappingProxyType({}))
    members: frozenset[str] = frozenset()                         # warm, full members
    dead: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    assignment: Assignment | None = None                          # last published
    history: tuple[Assignment, ...] = ()                          # newest last
    roles: tuple[tuple[str, bool], ...] = ()                      # (node, is_member) published
    published_estimates: Mapping[str, NodeEstimate] = field(
        default_factory=lambda: MappingProxyType({}))
    profile: Mapping[str, NodeEstimate] = field(default_factory=lambda: MappingProxyType({}))
    last_publish_s: float | None = None
    changed: frozenset[str] = frozenset()  # nodes whose speed changed since the last publish
    work_total: float = 0.0     # EWMA model cost of a whole request; 0.0 = unknown
    bytes_total: float = 0.0    # EWMA bytes of a whole request
    totals_samples: int = 0


def frozen_map(d: dict) -> Mapping:
    return MappingProxyType(d)
