"""The embedded runtime: ROS 2 nodes over Zenoh with rmw_zenoh keys and rosbags CDR.

Zenoh delivers samples on its own threads; we decode there (cheap, zero-copy) and hand the
message to a single executor thread so node callbacks never run concurrently.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kaitian_ros import heap
from kaitian_ros.runtime import zenoh_session as zs
from kaitian_ros.runtime.api import (
    ParameterDescriptor,
    ParametersCallback,
    ParameterValue,
    QoS,
    RejectCounter,
    SetParametersResult,
    coerce_parameter,
)
from kaitian_ros.runtime.embedded_endpoints import EmbeddedPublisher, EmbeddedSubscription, EmbeddedTimer
from kaitian_ros.runtime.node_args import NodeArgs, resolve_topic
from kaitian_ros.runtime.security import Security, publish_refusal

_QOS_TOKEN = {QoS.RELIABLE: "1:2:1,10", QoS.BEST_EFFORT: "2:2:1,5", QoS.LATCHED: "1:1:1,1"}


def make_logger(name: str) -> logging.Logger:
    """ROS-like log lines: ``[INFO] [1700000000.123] [compute_0]: message``."""
    logger = logging.getLogger(f"kaitian.{name}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)

        class _RosFormatter(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                level = {"WARNING": "WARN", "CRITICAL": "FATAL"}.get(record.levelname, record.levelname)
                line = f"[{level}] [{record.created:.3f}] [{name}]: {record.getMessage()}"
                if record.exc_info:
                    line += "\n" + self.formatException(record.exc_info)
                return line

        handler.setFormatter(_RosFormatter())
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(os.environ.get("KAITIAN_LOG_LEVEL", "INFO").upper())
    return logger


class EmbeddedRuntime:
    """A node's runtime on a zenoh peer session connected to the graph's router."""

    def __init__(self, args: NodeArgs, *, router: str | None = None, domain: int | None = None,
                 security: Security | str | None = zs.FROM_ENV) -> None:
        self.node_name = args.node_name
        self.namespace = args.namespace
        self.fqn = args.fqn
        self._remaps = dict(args.remaps)
        self._overrides = dict(args.parameters)
        self.domain = zs.domain_id() if domain is None else domain
        self.logger = make_logger(self.node_name)
        self.rejected = RejectCounter()
        heap.tune_allocator()  # multi-MiB message buffers stay in the heap
        self._reject_lock = threading.Lock()
        # security: a runtime/security.Security, None (off) or zs.FROM_ENV (KAITIAN_SECURITY)
        self.security = zs.resolve_security(security)
        self.session = zs.open_session("peer", connect=router or zs.router_endpoint(), security=self.security)
        self.zid = str(self.session.zid())
        self.zid_bytes = bytes.fromhex(self.zid.rjust(32, "0"))[:16]
        self.entity_ids = itertools.count(1)
        self._node_entity = next(self.entity_ids)
        self._tokens: list[Any] = []
        self._tokens.append(self.session.liveliness().declare_token(
            zs.node_token(self.domain, self.zid, self._node_entity, self.namespace, self.node_name)))
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._timers: list[tuple[float, int, EmbeddedTimer]] = []
        self._timer_seq = itertools.count()
        self._shutdown = threading.Event()
        self._executor_thread: threading.Thread | None = None
        self._descriptors: dict[str, ParameterDescriptor] = {}
        self._values: dict[str, ParameterValue] = {}
        self._on_set: list[ParametersCallback] = []
        self._keepalive: list[Any] = []
        for op in ("list", "get", "set"):
            self._keepalive.append(self.session.declare_queryable(
                zs.param_key(self.domain, self.fqn, op), self._param_query_handler(op)))

    # --- graph entities -----------------------------------------------------------------
    def resolve(self, topic: str) -> str:
        return resolve_topic(topic, self.namespace, self.node_name, self._remaps)

    def declare_endpoint_token(self, kind: str, topic: str, msg_type: str, qos: QoS) -> Any:
        token = self.session.liveliness().declare_token(zs.endpoint_token(
            self.domain, self.zid, self._node_entity, next(self.entity_ids), kind, self.namespace,
            self.node_name, topic, msg_type, _QOS_TOKEN[qos]))
        self._tokens.append(token)
        return token

    def create_publisher(self, topic: str, msg_type: str, qos: QoS = QoS.RELIABLE) -> EmbeddedPublisher:
        resolved = self.resolve(topic)
        refusal = "" if self.security is None else publish_refusal(resolved, self.security.role)
        if refusal:  # the graph's access control drops these messages without telling the sender
            self.logger.warning(refusal)
        return EmbeddedPublisher(self, resolved, msg_type, qos)

    def create_subscription(self, topic: str, msg_type: str, callback: Callable[..., None],
                            qos: QoS = QoS.RELIABLE, *, with_info: bool = False) -> EmbeddedSubscription:
        sub = EmbeddedSubscription(self, self.resolve(topic), msg_type, callback, qos, with_info)
        self._keepalive.append(sub)
        return sub

    def forget(self, entity: Any, token: Any) -> None:
        """A destroyed endpoint: undeclare its graph token, stop keeping it alive."""
        token.undeclare()
        self._tokens = [t for t in self._tokens if t is not token]
        self._keepalive = [k for k in self._keepalive if k is not entity]

    def create_timer(self, period_s: float, callback: Callable[[], None]) -> EmbeddedTimer:
        timer = EmbeddedTimer(period_s, callback)
        self.post(lambda: heapq.heappush(self._timers, (time.monotonic() + period_s, next(self._timer_seq), timer)))
        return timer

    def reject(self, reason: str) -> None:
        with self._reject_lock:
            self.rejected.count(reason)
        self.logger.debug(f"dropped message: {reason}")

    # --- parameters ---------------------------------------------------------------------
    def declare_parameter(self, descriptor: ParameterDescriptor) -> ParameterValue:
        if descriptor.name in self._descriptors:
            raise ValueError(f"parameter '{descriptor.name}' already declared")
        value = self._overrides.get(descriptor.name, descriptor.default)
        reason = descriptor.check(value)
        if reason:
            raise ValueError(f"invalid initial value: {reason}")
        self._descriptors[descriptor.name] = descriptor
        self._values[descriptor.name] = coerce_parameter(descriptor.type, value)
        return self._values[descriptor.name]

    def declare_parameters(self, descriptors: Sequence[ParameterDescriptor]) -> dict[str, ParameterValue]:
        return {d.name: self.declare_parameter(d) for d in descriptors}

    def get_parameter(self, name: str) -> ParameterValue:
        if name not in self._values:
            raise KeyError(f"parameter '{name}' is not declared")
        return self._values[name]

    def add_on_set_parameters_callback(self, callback: ParametersCallback) -> None:
        self._on_set.append(callback)

    def set_parameters(self, values: dict[str, ParameterValue]) -> SetParametersResult:
        """Validate all, ask the node's callbacks, then apply atomically (or nothing)."""
        proposed: dict[str, ParameterValue] = {}
        for name, value in values.items():
            desc = self._descriptors.get(name)
            if desc is None:
                return SetParametersResult(False, f"parameter '{name}' is not declared")
            if desc.read_only:
                return SetParametersResult(False, f"parameter '{name}' is read-only")
            reason = desc.check(value)
            if reason:
                return SetParametersResult(False, reason)
            proposed[name] = coerce_parameter(desc.type, value)
        for callback in self._on_set:
            result = callback(dict(proposed))
            if not result.successful:
                return result
        self._values.update(proposed)
        for name, value in proposed.items():
            self.logger.info(f"parameter {name} set to {value!r}")
        return SetParametersResult(True, "")

    def parameters_snapshot(self) -> list[dict[str, Any]]:
        return [self._descriptors[n].as_dict() | {"value": self._values[n]} for n in sorted(self._values)]

    def _param_query_handler(self, op: str) -> Callable[[Any], None]:
        def handle(query: Any) -> None:
            try:
                request = json.loads(query.payload.to_bytes() or b"{}") if query.payload else {}
                answer = self._call_on_executor(lambda: self._answer_param(op, request))
            except Exception as exc:  # noqa: BLE001 - any failure becomes an error reply, never a crash
                answer = {"successful": False, "reason": f"{type(exc).__name__}: {exc}"}
            query.reply(query.key_expr, json.dumps(answer).encode())
        return handle

    def _answer_param(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        if op == "list":
            return {"node": self.fqn, "parameters": self.parameters_snapshot()}
        if op == "get":
            names = request.get("names", [])
            missing = [n for n in names if n not in self._values]
            if missing:
                return {"successful": False, "reason": f"parameter(s) not declared: {missing}"}
            return {"successful": True, "values": {n: self._values[n] for n in names}}
        result = self.set_parameters(dict(request.get("values", {})))
        return {"successful": result.successful, "reason": result.reason}

    def _call_on_executor(self, fn: Callable[[], Any]) -> Any:
        if self._executor_thread is None or threading.current_thread() is self._executor_thread:
            return fn()
        done = threading.Event()
        box: dict[str, Any] = {}

        def task() -> None:
            try:
                box["value"] = fn()
            except Exception as exc:  # noqa: BLE001 - carried to the calling thread, which raises it
                box["error"] = exc
            done.set()

        self.post(task)
        if not done.wait(zs.PARAM_SERVE_TIMEOUT_S):
            raise TimeoutError("node busy: parameter request not served in time")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # --- executor -----------------------------------------------------------------------
    def on_node_gone(self, callback: Callable[[str], None]) -> None:
        def gone(entry: zs.LivelinessEntry) -> None:
            self.post(lambda: callback(entry.node_fqn))  # posted tasks run guarded (_run)

        self._keepalive.append(zs.watch_departures(self.session, self.domain, gone))

    def post(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def now(self) -> float:
        return time.time()

    def ok(self) -> bool:
        return not self._shutdown.is_set()

    def spin_once(self, timeout_s: float = 0.0) -> None:
        if self._executor_thread is None:
            self._executor_thread = threading.current_thread()
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            due, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            # schedule from the due time (no drift) but never in the past after a stall
            heapq.heappush(self._timers, (max(due + timer.period_s, now), next(self._timer_seq), timer))
            self._run(timer.callback)
        if self._timers:
            timeout_s = min(timeout_s, max(0.0, self._timers[0][0] - time.monotonic()))
        try:
            task = self._tasks.get(timeout=timeout_s) if timeout_s > 0 else self._tasks.get_nowait()
        except queue.Empty:
            return
        self._run(task)

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            # a node bug in one callback must not take the node down silently or loudly: log it
            self.logger.exception("callback raised")

    def spin(self) -> None:
        self._executor_thread = threading.current_thread()
        while not self._shutdown.is_set():
            self.spin_once(0.05)

    def shutdown(self) -> None:
        if self._shutdown.is_set():
            return
        self._shutdown.set()
        self.post(lambda: None)

    def close(self) -> None:
        self.shutdown()
        self._tokens.clear()
        self._keepalive.clear()
        with contextlib.suppress(zs.SessionError):
            self.session.close()
