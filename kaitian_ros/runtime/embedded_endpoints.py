"""The endpoints of the embedded runtime: a publisher (with the publisher-side cache of a latched
topic), a subscription (decoded on Zenoh's threads, queued bounded and delivered on the node's
executor thread) and a timer."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kaitian_ros import heap
from kaitian_ros.runtime import fast_cdr, interfaces
from kaitian_ros.runtime import zenoh_session as zs
from kaitian_ros.runtime.api import MessageInfo, QoS

if TYPE_CHECKING:  # the runtime creates its endpoints: a run-time import would be circular
    from kaitian_ros.runtime.embedded import EmbeddedRuntime

DELIVER_BATCH = 64  # messages one executor task hands to a subscription before yielding
BEST_EFFORT_DEPTH = 5  # qos_profile_sensor_data keeps the last 5
# A reliable subscription whose node falls behind queues what arrives; past these bounds the new
# message is dropped and counted ("queue full"), so a flood costs a bounded amount of memory
# instead of growing a node by gigabytes (a 20 s flood of chunks once took a compute node to 4 GB).
QUEUE_MAX_MESSAGES = 4096
QUEUE_MAX_BYTES = 128 * 1024 * 1024


class EmbeddedPublisher:
    def __init__(self, rt: EmbeddedRuntime, topic: str, msg_type: str, qos: QoS) -> None:
        self.topic = topic
        self.msg_type = interfaces.full_type_name(msg_type)
        self.qos = qos
        self._rt = rt
        self.key = zs.topic_key(rt.domain, topic, msg_type)
        congestion = zs.CongestionControl.DROP if qos is QoS.BEST_EFFORT else zs.CongestionControl.BLOCK
        self._pub = rt.session.declare_publisher(self.key, congestion_control=congestion)
        self._sequence = itertools.count(1)
        self.gid = rt.zid_bytes[:12] + next(rt.entity_ids).to_bytes(4, "little")
        self._last: bytes | bytearray | None = None
        self._queryable = None
        if qos is QoS.LATCHED:
            # transient local: late joiners query the publisher-side cache
            self._queryable = rt.session.declare_queryable(self.key, self._serve_cache)
        self._token = rt.declare_endpoint_token("MP", topic, msg_type, qos)
        self._attachment = zs.AttachmentWriter(self.gid)
        # TensorChunk: encode into one reused buffer (put copies it); latched keeps its own copy
        self._encoder = (fast_cdr.Encoder() if self.msg_type == fast_cdr.TYPE_NAME and qos is not QoS.LATCHED
                         else None)
        self._lock = threading.Lock()  # the reused buffers: publish may come from any thread

    def _serve_cache(self, query: Any) -> None:
        last = self._last
        if last is not None:
            query.reply(self.key, last, attachment=zs.make_attachment(0, time.time_ns(), self.gid))

    def publish(self, msg: Any) -> None:
        if self._encoder is not None:
            with self._lock:
                cdr = self._encoder.encode(msg)
                if cdr is not None:  # put copies payload and attachment before returning
                    if len(cdr) >= zs.SHM_PUT_MIN_BYTES:  # large: one copy into shared memory, none in put
                        cdr = zs.shm_payload(cdr) or cdr
                    self._pub.put(cdr, attachment=self._attachment(next(self._sequence), time.time_ns()))
                    return
        self.publish_raw(interfaces.encode(msg, self.msg_type))

    def publish_raw(self, cdr: bytes | bytearray | memoryview) -> None:
        payload = zs.as_zenoh_payload(cdr)
        if self.qos is QoS.LATCHED:
            self._last = payload
        with self._lock:
            self._pub.put(payload, attachment=self._attachment(next(self._sequence), time.time_ns()))


class EmbeddedSubscription:
    def __init__(self, rt: EmbeddedRuntime, topic: str, msg_type: str,
                 callback: Callable[..., None], qos: QoS, with_info: bool = False) -> None:
        self.topic = topic
        self.with_info = with_info
        self.msg_type = interfaces.full_type_name(msg_type)
        self.callback = callback
        self.qos = qos
        self._rt = rt
        self.expected_type = interfaces.dds_type_name(msg_type)
        self.expected_hash = interfaces.type_hash(msg_type)
        depth = BEST_EFFORT_DEPTH if qos is QoS.BEST_EFFORT else None
        self.pending: collections.deque = collections.deque(maxlen=depth)
        self._bounded = qos is not QoS.BEST_EFFORT  # best effort: the deque keeps the newest few
        self._max_messages, self._max_bytes = QUEUE_MAX_MESSAGES, QUEUE_MAX_BYTES
        self._queued_bytes = 0
        self._overflowed = False  # dropped "queue full" since the queue was last empty
        self._bytes_lock = threading.Lock()
        self._scheduled = False
        self._key_verdict: dict[str, str | None] = {}  # key -> None (accepted) or reject reason
        # latched: the publishers (GIDs) whose live samples have arrived. Their cache's answer to
        # the query below, when it comes after one of those, holds nothing newer - and may be
        # older: the node would see an old plan after a new one, and count it as stale
        self._live_sources: set[bytes] | None = set() if qos is QoS.LATCHED else None
        self.destroyed = False
        self._sub = rt.session.declare_subscriber(zs.topic_key_any_type(rt.domain, topic), self._on_sample)
        self._token = rt.declare_endpoint_token("MS", topic, msg_type, qos)
        if qos is QoS.LATCHED:
            zs.query_latched(rt.session, zs.topic_key_any_type(rt.domain, topic), self._on_reply, 3.0)

    def destroy(self) -> None:
        """Stop receiving: undeclare the subscriber and its graph token; samples already queued
        are not delivered."""
        if self.destroyed:
            return
        self.destroyed = True
        self._sub.undeclare()
        self._rt.forget(self, self._token)
        self.pending.clear()
        with self._bytes_lock:
            self._queued_bytes = 0

    def _on_reply(self, reply: Any) -> None:
        if reply.ok is not None:
            self._on_sample(reply.ok, cached=True)

    @staticmethod
    def _source(sample: Any) -> bytes | None:
        attachment = sample.attachment
        if attachment is None:
            return None
        try:
            return zs.parse_attachment(attachment.to_bytes())[2] or None
        except ValueError:
            return None

    def _on_sample(self, sample: Any, cached: bool = False) -> None:
        # runs on a zenoh thread: validate + decode here, run the callback on the executor
        received_s = time.time()
        if self.destroyed:
            return
        key = str(sample.key_expr)
        try:
            verdict = self._key_verdict[key]
        except KeyError:  # first sample on this key: parse and check it once
            verdict = self._check_key(key)
            if len(self._key_verdict) < 1024:
                self._key_verdict[key] = verdict
        if verdict is not None:
            self._rt.reject(verdict)
            return
        if self._live_sources is not None:
            source = self._source(sample)
            if cached and source in self._live_sources:
                return  # superseded by that publisher's live samples (see __init__)
            if not cached and source is not None and len(self._live_sources) < 1024:
                self._live_sources.add(source)
        raw = sample.payload.to_bytes()
        size = len(raw)
        if self._bounded:
            with self._bytes_lock:
                if len(self.pending) >= self._max_messages or self._queued_bytes + size > self._max_bytes:
                    full = True
                else:
                    full = False
                    self._queued_bytes += size
            if full:
                self._overflowed = True
                self._rt.reject(f"queue full: {len(self.pending)} messages, {self._queued_bytes} bytes waiting "
                                f"on {self.topic} (node behind or flooded)")
                return
        try:
            msg = interfaces.decode(raw, self.msg_type)
        except interfaces.DecodeError as exc:
            self._unqueue(size)
            self._rt.reject(f"malformed: {exc} on {self.topic}")
            return
        if not self.with_info:  # nobody asked for delivery facts: skip the attachment
            self.pending.append((msg, None, size))
            if not self._scheduled:
                self._scheduled = True
                self._rt.post(self._deliver)
            return
        source_s, sequence = 0.0, 0
        attachment = sample.attachment
        if attachment is not None:
            try:
                sequence, stamp_ns = zs.attachment_stamp(attachment.to_bytes())
                source_s = stamp_ns * 1e-9
            except ValueError:
                pass  # foreign publishers may attach nothing useful; the message still counts
        self.pending.append((msg, MessageInfo(received_s, source_s, sequence), size))
        if not self._scheduled:  # one executor task drains a burst: fewer queue hand-offs
            self._scheduled = True
            self._rt.post(self._deliver)

    def _unqueue(self, size: int) -> None:
        if self._bounded:
            with self._bytes_lock:
                self._queued_bytes -= size

    def _check_key(self, key: str) -> str | None:
        """None if samples on ``key`` are ours to decode, else the reason to reject them."""
        if not zs.is_concrete_key(key):  # a wildcard put only intersects our key: forged or foreign
            return f"wildcard key: {key}"
        try:
            _, _, dds_type, type_hash = zs.parse_topic_key(key)
        except ValueError:
            return f"bad key: {key}"
        if dds_type != self.expected_type:
            return f"wrong type: {dds_type} on {self.topic}, expected {self.expected_type}"
        if type_hash != self.expected_hash:
            return f"type hash mismatch: {type_hash} on {self.topic}"
        return None

    def _deliver(self) -> None:
        # clear the flag before draining: a sample appended after this line posts a new task
        self._scheduled = False
        for _ in range(DELIVER_BATCH):
            try:
                msg, info, size = self.pending.popleft()
            except IndexError:  # drained (a best-effort queue may also have dropped the oldest)
                break
            self._unqueue(size)
            if self.destroyed:
                break
            try:
                if self.with_info:
                    self.callback(msg, info)
                else:
                    self.callback(msg)
            except Exception:  # same policy as any callback: log, keep the node running
                self._rt.logger.exception("callback raised")
        if self.pending:
            if not self._scheduled:  # let timers and other subscriptions run too
                self._scheduled = True
                self._rt.post(self._deliver)
        elif self._overflowed:  # a flood is over: give its memory back
            self._overflowed = False
            heap.trim_heap()


class EmbeddedTimer:
    def __init__(self, period_s: float, callback: Callable[[], None]) -> None:
        if period_s <= 0:
            raise ValueError(f"timer period must be > 0, got {period_s}")
        self.period_s = period_s
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
