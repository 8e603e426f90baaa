"""The compute node's ROS parameters (`kaitian_ros.nodes.compute`)."""

from __future__ import annotations

from kaitian_ros.nodes import protocol as proto
from kaitian_ros.nodes.model_params import MODEL_PARAMETERS
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T

PARAMETERS = MODEL_PARAMETERS + (
    P("device", T.STRING, "cpu", "torch device this node computes on (cpu, cuda:0, ...; checked at start)",
      read_only=True),
    P("threads", T.INTEGER, 1, "torch CPU threads for this node", 1, 256),
    P("emulated_slowdown", T.DOUBLE, 1.0,
      "emulate a slower device: rows are released at s x their compute time (1.0 = real speed)", 1.0, 100.0),
    P("min_run_rows", T.INTEGER, 16, "defer conv runs shorter than this while more rows are coming", 1, 4096),
    P("heartbeat_hz", T.DOUBLE, 4.0, "heartbeat telemetry rate", proto.MIN_HEARTBEAT_HZ, 100.0),
    P("request_timeout_s", T.DOUBLE, 10.0, "forget an unfinished request after this long", 0.1, 3600.0),
    P("max_plans", T.INTEGER, 8, "plan versions kept for requests still in flight", 2, 1000),
    # default: the coordinator's largest max_in_flight, so a real graph never evicts its own
    P("max_requests", T.INTEGER, 64,
      "requests held at once; a new one beyond this evicts the one fed least recently", 1, 1024),
    # default: two requests in flight of the models here at most 60 MB together (MobileNetV2 at
    # 320x240 streamed in slabs holds up to 30 MB), with room for re-dispatched ones
    P("max_held_mb", T.INTEGER, 128,
      "activation MiB unfinished requests may hold; beyond it the one fed least recently is evicted", 1, 65536),
    P("pending_timeout_s", T.DOUBLE, 2.0, "hold chunks of a not-yet-known plan this long", 0.0, 60.0),
    P("max_queue_wait_s", T.DOUBLE, 2.0,
      "drop (as stale) an input or halo chunk that waited longer than this in this node's queue", 0.05, 3600.0),
    P("profile_budget_s", T.DOUBLE, 10.0, "time limit of the start-up cost measurement", 0.5, 120.0,
      read_only=True),
    P("probe_period_s", T.DOUBLE, 0.1, "while idle, time a probe (about 1 ms of ops) this often (0 = never)",
      0.0, 60.0),
    P("probe_max_period_s", T.DOUBLE, 0.5,
      "while idle probes see no change, their period doubles up to this (<= probe_period_s: no backoff)",
      0.0, 60.0),
    P("image_wait_s", T.DOUBLE, 0.25,
      "direct path: give a ticket back to the coordinator when its camera image has not arrived this long",
      0.01, 10.0),
    P("profile_change", T.DOUBLE, 0.1,
      "publish a new cost profile when the costs moved by this fraction (trunk time or a link)", 0.01, 10.0),
)
