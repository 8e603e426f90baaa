"""The constants and settings of ``kaitian bench chaos`` (:mod:`kaitian_ros.bench.chaos`): the
faults, the windows frames are counted in, the emulated link, and how long each phase lasts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path("bench/results/chaos.json")
SCENARIO = "hetero_inference"
CAMERA_TOPIC = "/camera/image_raw"
FAULTS = ("kill_compute", "kill_scheduler", "kill_coordinator", "kill_router", "flood", "link_collapse",
          "forge_plan", "forge_assignment", "forge_telemetry", "fuzz")
RETIRED = "retired incarnation"  # a listener's reason for a message of an incarnation it left
SECURE_FAULTS = ("forge_plan_secure", "forge_assignment_secure", "forge_telemetry_secure")
ANSWER_S = 6.0  # a frame unanswered this long is unanswered (the coordinator's request timeout is 5 s)
LEAD_S = 1.0  # a fault's frames start this long before it: frames in flight when it hit count
RSS_PERIOD_S = 0.25
MEM_FLOOR_MB = 2048  # the flood is stopped if the machine's available memory falls below this
LINK_NODE = "compute_0"
LINK_NAMES: dict[str, Any] = {"netns_prefix": "kaitian_chaos", "veth_prefix": "kc", "subnet": "10.232"}
INSTANT_S = 5.0  # the latency "during" a fault without duration: its first seconds
LIFTED = ("adaptation", "variants")  # details that targets read: kept beside the metrics
COMPUTE_CERT = "compute certificate (reported apart)"
# the line each node logs once its subscriptions exist (the end of its constructor)
READY_MARK = {"coordinator": " -> trunk ", "compute": ", slowdown ", "scheduler": ": policy "}


class GraphFailed(RuntimeError):
    """The graph stopped (a node died for good): the run ends with what it measured."""


@dataclass(frozen=True)
class Settings:
    quick: bool
    pre_s: float
    settle_s: float
    extra_s: float  # the observation is extended by at most this while not recovered
    warmup_s: float
    flood_s: float
    flood_rate: float
    flood_whole_stripes: bool  # each flood chunk a whole stripe input (a request the node computes)
    collapse_s: float
    link_mbit: float
    collapse_mbit: float
    fuzz_count: int
    fuzz_msgs_per_s: float
    fuzz_bytes_per_s: float
    variant_s: float  # observation after each forged message (>= two /diagnostics periods)
    healthy_timeout_s: float

    @classmethod
    def make(cls, quick: bool, **over: Any) -> Settings:
        base: dict[str, Any] = dict(quick=quick, pre_s=4.0 if quick else 6.0, settle_s=10.0 if quick else 30.0,
                    extra_s=10.0 if quick else 15.0, warmup_s=6.0 if quick else 10.0,
                    flood_s=8.0 if quick else 20.0, flood_rate=1000.0, flood_whole_stripes=False,
                    collapse_s=8.0 if quick else 20.0,
                    link_mbit=1000.0, collapse_mbit=1.0, fuzz_count=1000 if quick else 10_000,
                    fuzz_msgs_per_s=2000.0, fuzz_bytes_per_s=50e6, variant_s=2.5,
                    healthy_timeout_s=30.0)
        base.update({k: v for k, v in over.items() if v is not None})
        return cls(**base)
