"""A compute node's costs (`kaitian_ros.nodes.compute`): measured at start-up (or by the warm
interpreter that prepared the node), refined from the runs it computes, from short probes while
idle and from its incoming links, and published on the latched ``/kaitian/profiles`` whenever
they moved by ``profile_change``: the coordinator's planner plans with these numbers."""

from __future__ import annotations

import time
from typing import Any

from kaitian_ros.core import profiling
from kaitian_ros.core.costs import CostRefiner, DeviceProfile, LinkMeter, next_probe_period
from kaitian_ros.core.graph import ModelGraph
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.nodes.compute_prepare import Prepared
from kaitian_ros.nodes.compute_requests import RequestTable
from kaitian_ros.runtime.api import Publisher, Runtime


class NodeCosts:
    """The cost half of `ComputeNode` (its state is set up by the node)."""

    rt: Runtime
    node_id: str
    params: dict[str, Any]
    spec: ic.ModelSpec
    graph: ModelGraph
    prepared: Prepared | None
    busy_clock: Any
    requests: RequestTable
    profile_pub: Publisher

    @property
    def emulated(self) -> bool:
        return self.params["emulated_slowdown"] != 1.0

    def _measure_costs(self) -> None:
        slowdown = self.params["emulated_slowdown"]
        if self.prepared is not None:
            self.measured = self.prepared.costs.scaled(slowdown)
            self.probe_inputs = self.prepared.probe_inputs
        else:
            # device time (on a CPU this thread's CPU time: nodes start together and share cores);
            # live runs, in wall time, then scale it to what a request really waits for
            self.measured, self.probe_inputs = profiling.measure_profile(
                self.graph, self.busy_clock, slowdown=slowdown, budget_s=self.params["profile_budget_s"])
        # a request that computed less than a tenth of the trunk: its fixed costs dominate
        self.refiner = CostRefiner(self.measured.op_costs, self.measured.run_ms,
                                   min_feed_ms=0.1 * self.measured.trunk_ms)
        self.meters: dict[str, LinkMeter] = {}
        self.message_ms = 0.05  # prior until measured: decode + bookkeeping of one chunk here
        self.profile_version = 0
        self.published: DeviceProfile | None = None
        self.published_at = 0.0
        self._feed_predicted = 0.0  # start-up cost of the runs of the feed in progress
        self.last_run_s = 0.0
        where = f" by {self.prepared.by}" if self.prepared is not None else ""
        self.rt.logger.info(f"costs measured{where} in {self.measured.elapsed_s:.1f} s: trunk "
                            f"{self.measured.trunk_ms:.1f} ms" + (" (EMULATED)" if self.emulated else ""))

    def _profile(self) -> DeviceProfile:
        ops = self.refiner.current()
        trunk = self.measured.trunk_ms * self.refiner.device_ratio
        links = {src: est for src, m in self.meters.items() if (est := m.estimate()) is not None}
        return DeviceProfile(self.node_id, self.profile_version, self.spec.key, self.params["device"],
                             self.params["emulated_slowdown"], ops, trunk, self.message_ms,
                             self.params["min_run_rows"], self.refiner.current_run_ms(), self.refiner.samples,
                             links)

    def _publish_profile(self, why: str) -> None:
        self.profile_version += 1
        p = self._profile()
        self.profile_pub.publish(ic.profile_msg(p))
        self.published = p
        self.published_at = time.monotonic()
        self.rt.logger.debug(f"profile v{p.version} ({why}): trunk {p.trunk_ms:.1f} ms")

    def _maybe_publish_profile(self) -> None:
        """Publish when the costs moved by `profile_change` (at most once a second: every new
        profile makes the coordinator re-plan) or by three times that (at once: a device that
        changed speed)."""
        if self.published is None:
            return
        now = self._profile()
        old = self.published
        limit = self.params["profile_change"]

        def moved(a: float, b: float) -> float:
            return abs(a - b) / max(abs(b), 1e-9)

        change = moved(sum(c.ms(op.out_shape[1]) for c, op in zip(now.op_costs, self.graph.ops)),
                       sum(c.ms(op.out_shape[1]) for c, op in zip(old.op_costs, self.graph.ops)))
        why = f"compute costs moved {change:.0%}" if change > limit else ""
        for src, est in now.links.items():
            was = old.links.get(src)
            if was is None or moved(est.bytes_per_ms, was.bytes_per_ms) > limit or \
                    abs(est.latency_ms - was.latency_ms) > max(1.0, limit * was.latency_ms):
                why = why or f"link from {src} measured"
        if why and (change > 3 * limit or time.monotonic() - self.published_at >= 1.0):
            self._publish_profile(why)

    def _on_run(self, op: int, rows: int, seconds: float) -> None:
        self._feed_predicted += self.refiner.predicted_run_ms(op, rows)

    def _probe_timer(self) -> Any:
        period = self.params["probe_period_s"]
        self.probe_interval, self.last_probe_s = period, 0.0
        return self.rt.create_timer(period, self._probe) if period > 0 else None

    def _probe(self) -> None:
        """Idle: time the probe op, so that a device with no rows still shows a speed change;
        less often while the probes see none (`costs.next_probe_period`)."""
        now, base = time.monotonic(), self.params["probe_period_s"]
        if self.requests or now - self.last_run_s < base:
            self.probe_interval = base  # computing: once idle again, probe at the full rate
            return
        if now - self.last_probe_s < self.probe_interval - 0.5 * base:  # (timer ticks jitter)
            return
        self.last_probe_s, level = now, self.refiner.probe_ratio
        ms = profiling.probe(self.graph, self.measured, self.busy_clock, self.params["emulated_slowdown"],
                             self.probe_inputs)
        self.refiner.observe_probe(ms, self.measured.probe_base_ms)
        self.probe_interval = next_probe_period(self.probe_interval, base, self.params["probe_max_period_s"],
                                                self.refiner.probe_ratio != level)
        self._maybe_publish_profile()
