"""The coordinator's ROS parameters (`kaitian_ros.nodes.coordinator`)."""

from __future__ import annotations

from kaitian_ros.core.strategy_names import STRATEGY_CHOICES
from kaitian_ros.nodes import protocol as proto
from kaitian_ros.nodes.model_params import MODEL_PARAMETERS
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T

# the parameters that shape plans: setting one plans again (the plan that ran last under the
# new values resumes unless clearly beaten)
PLAN_SETTINGS = ("static_shares", "use_scheduler", "strategy", "slab_rows", "share_search")

PARAMETERS = MODEL_PARAMETERS + (
    P("input_topic", T.STRING, "/camera/image_raw", "camera topic (sensor_msgs/Image)", read_only=True),
    P("compute_nodes", T.STRING_ARRAY, ["compute_0", "compute_1"], "compute node ids in row order",
      read_only=True),
    P("static_shares", T.DOUBLE_ARRAY, [1.0, 1.0], "shares used until/unless a scheduler assigns (one per node)",
      0.0, 1e6),
    P("use_scheduler", T.BOOL, True, "adopt LoadAssignment from /kaitian/assignment when one is published"),
    P("assignment_warn_s", T.DOUBLE, 15.0,
      "with use_scheduler, WARN on /diagnostics when no assignment was accepted this long", 1.0, 3600.0),
    P("max_in_flight", T.INTEGER, 2, "requests dispatched but not finished", 1, 64),
    P("request_timeout_s", T.DOUBLE, 5.0, "publish complete=false after this long", 0.05, 600.0),
    P("dead_after_s", T.DOUBLE, 1.5, "a compute node silent this long leaves the plan (>= 2 heartbeats)",
      proto.MIN_DEAD_AFTER_S, 600.0),
    P("late_after_s", T.DOUBLE, 0.5,
      "a compute node that still owes rows of a request this long after its inputs went out (and 4x the plan's "
      "predicted latency) leaves the plan for a while, the request goes to the others (0 = never)", 0.0, 600.0),
    P("input_pacing_ms", T.DOUBLE, 0.0,
      "EMULATED slow input link: pause between input slabs (0 = send at once)", 0.0, 10000.0),
    P("threads", T.INTEGER, 1, "torch CPU threads for preprocessing and the head", 1, 256),
    P("strategy", T.STRING, "auto", "plan strategy: auto (fastest predicted) | single | layerwise | stripes",
      choices=STRATEGY_CHOICES),
    P("share_search", T.BOOL, True,
      "with the scheduler's adaptive policy, also try stripes by measured speed over every subset of "
      "nodes (false: stripes use the scheduler's shares as proposed)"),
    P("min_plan_gain", T.DOUBLE, 0.1,
      "switch plans, or prefer a more complex strategy (single < layerwise < stripes), only for a predicted "
      "latency gain of at least this fraction", 0.0, 1.0),
    P("trial_share", T.DOUBLE, 0.05,
      "share of the requests that plans known only by their prediction may take while the coordinator searches "
      "plans itself (trials; a few are always allowed, and any after a node joins, leaves or changes speed); "
      "1 = no bound", 0.0, 1.0),
    P("replan_period_s", T.DOUBLE, 5.0, "re-predict the candidates this often with the newest measurements",
      0.1, 3600.0),
    # on by default: interleaved A/Bs measured it 2-4 ms faster than through the coordinator (docs/benchmarks.md)
    P("direct_single", T.BOOL, True,
      "when a plan computes the whole image on one compute node, that node takes the camera images itself "
      "and publishes FusedOutput; the coordinator only tickets the images it accepts (the direct path)"),
    P("plan_link_mbit", T.DOUBLE, 1000.0,
      "prior rate of a link nobody has measured yet (Mbit/s); measured rates replace it", 1.0, 1e6,
      read_only=True),
)
