"""The share policy's parameters and configuration (docs/policy.md): the scheduler node's
parameter descriptors and the validated :class:`PolicyConfig` built from them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

POLICIES: tuple[str, ...] = ("adaptive", "static", "equal", "profile_once")


StaticShares = tuple[float, ...] | Mapping[str, float]


@dataclass(frozen=True)
class ParamDescriptor:
    """One live-tunable parameter; the scheduler node declares ROS parameters from these.

    ``type`` is one of "string", "double", "integer", "bool", "double_array". ``min``/``max``
    are inclusive (ROS ranges are inclusive); for "double_array" they bound each element.
    """

    name: str
    type: str
    description: str
    min: float | None
    max: float | None
    default: object
    choices: tuple[str, ...] = ()


PARAMETERS: tuple[ParamDescriptor, ...] = (
    ParamDescriptor("policy", "string",
                    "share policy: adaptive | static | equal | profile_once",
                    None, None, "adaptive", POLICIES),
    ParamDescriptor("ewma_alpha", "double",
                    "weight of the newest telemetry sample in the EWMA estimates",
                    0.01, 1.0, 0.3),
    ParamDescriptor("min_gain", "double",
                    "relative predicted-makespan improvement needed to publish a new plan",
                    0.0, 1.0, 0.05),
    ParamDescriptor("min_interval_s", "double",
                    "minimum seconds between two load-driven plan changes",
                    0.0, 3600.0, 0.5),
    ParamDescriptor("change_ratio", "double",
                    "a node whose speed differs from its estimate by this factor in "
                    "change_samples consecutive samples changed: its estimate restarts from "
                    "the new samples and may be acted on before min_interval_s (1 = off)",
                    1.0, 100.0, 1.6),
    ParamDescriptor("change_samples", "integer",
                    "consecutive surprising samples that confirm a change (see change_ratio)",
                    1, 100, 2),
    ParamDescriptor("dead_after_s", "double",
                    "a node silent (no heartbeat, no telemetry) this long leaves the plan",
                    0.05, 3600.0, 2.0),
    ParamDescriptor("warmup_requests", "integer",
                    "telemetry samples a node must deliver before it is a full member",
                    1, 1000, 3),
    ParamDescriptor("probe_share", "double",
                    "share a warming-up newcomer gets so that it produces telemetry",
                    0.01, 0.5, 0.05),
    ParamDescriptor("wait_as_fixed", "bool",
                    "use reported wait_ms as share-independent fixed cost in the model",
                    None, None, False),
    ParamDescriptor("static_shares", "double_array",
                    "shares for policy=static, in plan node order (normalised to sum 1)",
                    0.0, 1.0e6, ()),
)

_DESC = {p.name: p for p in PARAMETERS}


def _check_range(name: str, value: float) -> None:
    d = _DESC[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if d.min is not None and value < d.min:
        raise ValueError(f"{name}={value} below minimum {d.min}")
    if d.max is not None and value > d.max:
        raise ValueError(f"{name}={value} above maximum {d.max}")


@dataclass(frozen=True)
class PolicyConfig:
    """Validated policy parameters; constructing (or ``dataclasses.replace``) an invalid one
    raises ValueError with the reason, so a refused ``param set`` can quote it verbatim."""

    policy: str = "adaptive"
    ewma_alpha: float = 0.3
    min_gain: float = 0.05
    min_interval_s: float = 0.5
    change_ratio: float = 1.6
    change_samples: int = 2
    dead_after_s: float = 2.0
    warmup_requests: int = 3
    probe_share: float = 0.05
    wait_as_fixed: bool = False
    # tuple: share k belongs to the k-th node of the plan order (initial node_ids first, then
    # first appearance); mapping: node_id -> share. Normalised to sum 1 over live nodes.
    static_shares: StaticShares = ()

    def __post_init__(self) -> None:
        # Freeze a mapping so the config stays immutable and comparable.
        if isinstance(self.static_shares, Mapping):
            object.__setattr__(self, "static_shares",
                               MappingProxyType(dict(self.static_shares)))
        elif not isinstance(self.static_shares, tuple):
            object.__setattr__(self, "static_shares", tuple(self.static_shares))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid parameter."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("ewma_alpha", "min_gain", "min_interval_s", "change_ratio", "dead_after_s",
                     "probe_share"):
            _check_range(name, getattr(self, name))
        for name in ("warmup_requests", "change_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            _check_range(name, v)
        if not isinstance(self.wait_as_fixed, bool):
            raise ValueError(f"wait_as_fixed must be a bool, got {self.wait_as_fixed!r}")
        values = (list(self.static_shares.values()) if isinstance(self.static_shares, Mapping)
                  else list(self.static_shares))
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"static_shares must be finite and >= 0, got {v!r}")
        if isinstance(self.static_shares, Mapping):
            for k in self.static_shares:
                if not isinstance(k, str) or not k:
                    raise ValueError(f"static_shares keys must be node ids, got {k!r}")
        if self.policy == "static" and not (values and sum(values) > 0):
            raise ValueError("policy 'static' needs static_shares with a positive sum "
                             "(set static_shares before switching policy)")


def config_from_params(params: Mapping[str, object], base: PolicyConfig | None = None
                       ) -> PolicyConfig:
    """Build a config from ROS-style parameter values (lists -> tuples, ints -> floats).

    Unknown names raise ValueError so a typo in a parameter file is not silently ignored.
    """
    base = base if base is not None else PolicyConfig()
    changes: dict[str, Any] = {}  # typed per name by _DESC; PolicyConfig checks the values
    for name, value in params.items():
        d = _DESC.get(name)
        if d is None:
            raise ValueError(f"unknown policy parameter {name!r}")
        if d.type == "double" and isinstance(value, int) and not isinstance(value, bool):
            changes[name] = float(value)
        elif d.type == "double_array" and isinstance(value, Sequence) \
                and not isinstance(value, str):
            changes[name] = tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                                  for v in value)
        else:
            changes[name] = value
    return replace(base, **changes)
