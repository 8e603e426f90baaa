"""rosbag2 bags of an embedded graph (MCAP storage): recording topics, and a bag's summary.

The recorder is a graph tool like ``kaitian topic echo``: a GraphClient session whose
subscriptions hand over each sample's CDR bytes, and those bytes go into the bag as they
arrived - no decode, no re-encode - so a bag holds exactly what the nodes exchanged. A message's
time in the bag is the wall clock when the recorder received it, as ``ros2 bag record`` stamps
it (rosbags' writer takes one time per message and writes it as both MCAP log and publish time).

Every type's definition goes into the bag (the MCAP schema, encoding ``ros2msg``): our own
interfaces as the text of their ``msg/*.msg`` files, comments included, followed by the
definitions they use, as rosbag2 writes them; ROS 2 standard types from rosbags' Jazzy type
store. A reader needs neither this package nor ROS to decode the bag.

This module is the one place that imports rosbags' rosbag2 storage (``interfaces`` owns its
type store and CDR codec).
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime.graph_client import DISCOVERY_WAIT_S, GraphClient, RawSample
from kaitian_ros.runtime.zenoh_session import LivelinessEntry

STORAGE = "mcap"
BAG_VERSION: Final = 9  # rosbag2's metadata version since Jazzy
# The data plane (tensor rows, up to MiBs per message at frame rate) is left out of "every topic":
# a recorder that subscribes to it slows the graph it records. Naming such a topic records it.
CHUNK_PREFIX = "/kaitian/chunks/"
REDISCOVER_S = 1.0  # "every topic": how often the graph is asked for topics that appeared since
_DEFINITION_SEPARATOR = "=" * 80 + "\n"


class BagError(Exception):
    """A bag that cannot be written or read, said in one line for the user."""


@dataclass(frozen=True)
class RecordedTopic:
    name: str
    msg_type: str       # pkg/msg/Name
    latched: bool       # its publisher serves the last sample to late joiners (transient local)
    best_effort: bool


@dataclass(frozen=True)
class RecordSummary:
    path: Path
    duration_s: float
    counts: tuple[tuple[str, int], ...]   # (topic, messages written), by topic name

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)


@dataclass(frozen=True)
class TopicSummary:
    name: str
    msg_type: str
    count: int
    latched: bool


@dataclass(frozen=True)
class BagInfo:
    path: Path
    storage: str
    files: tuple[str, ...]
    size_bytes: int
    start_ns: int
    duration_ns: int
    message_count: int
    topics: tuple[TopicSummary, ...]


def default_output(now: datetime.datetime | None = None) -> Path:
    """``rosbag2_YYYY_MM_DD-HH_MM_SS``, the folder name ``ros2 bag record`` picks."""
    return Path((now or datetime.datetime.now()).strftime("rosbag2_%Y_%m_%d-%H_%M_%S"))


def message_definition(msg_type: str) -> str:
    """The definition rosbag2 stores for ``msg_type``: its text, then each type it uses after
    a line of 80 '=' and ``MSG: pkg/msg/Name``."""
    full = interfaces.full_type_name(msg_type)
    generated, _ = interfaces.typestore().generate_msgdef(full, ros_version=2)
    package, _, name = full.split("/")
    if package != interfaces.PACKAGE:
        return generated
    # rosbags regenerates a definition without its comments; ours are the documentation of the
    # fields, so the bag carries the file itself, as rosbag2 does
    own = interfaces.find_share_file("msg", f"{name}.msg").read_text()
    _, separator, used = generated.partition(_DEFINITION_SEPARATOR)
    return own.rstrip("\n") + "\n" + separator + used


def _offered_qos(topic: RecordedTopic) -> Any:
    """The api.QoS profile of the topic's publishers, in rosbag2's terms (``ros2 bag play``
    offers it again: a latched topic stays latched)."""
    from rosbags.interfaces import (
        Qos,
        QosDurability,
        QosHistory,
        QosLiveliness,
        QosReliability,
        QosTime,
    )

    unspecified = QosTime(0, 0)
    depth = 1 if topic.latched else (5 if topic.best_effort else 10)
    return Qos(QosHistory.KEEP_LAST, depth,
               QosReliability.BEST_EFFORT if topic.best_effort else QosReliability.RELIABLE,
               QosDurability.TRANSIENT_LOCAL if topic.latched else QosDurability.VOLATILE,
               unspecified, unspecified, QosLiveliness.AUTOMATIC, unspecified, False)


def published_topics(client: GraphClient) -> dict[str, list[LivelinessEntry]]:
    """The graph's publishers (liveliness tokens), by topic."""
    found: dict[str, list[LivelinessEntry]] = {}
    for entry in client.liveliness():
        if entry.kind == "MP":
            found.setdefault(entry.topic, []).append(entry)
    return found


def recordable(topic: str, publishers: list[LivelinessEntry]) -> RecordedTopic | str:
    """The topic as it can be recorded, or why it cannot: its type must be one this package's
    type store knows, with the same definition (hash), or the bag would mislabel the bytes."""
    problems = []
    for entry in sorted(publishers, key=lambda e: e.type_name):
        try:
            full = interfaces.full_type_name(entry.type_name)
        except KeyError:
            problems.append(f"its type {entry.type_name} is not in this package's type store")
            continue
        if entry.type_hash != interfaces.type_hash(full):
            problems.append(f"its publisher's {full} has another definition ({entry.type_hash})")
            continue
        same = [e for e in publishers if e.type_name == entry.type_name]
        return RecordedTopic(topic, full, any(e.latched for e in same), all(e.best_effort for e in same))
    return f"topic '{topic}' cannot be recorded: {'; '.join(dict.fromkeys(problems))}"


class Recorder:
    """Writes what the graph publishes on ``topics`` (none: every topic but the tensor chunks,
    including topics that appear while it records) into a new bag folder ``output``.

    ``start`` resolves the topics and opens the bag; ``run`` records until ``stop`` is set or
    ``duration_s`` passed, then closes the bag (metadata.yaml written). Samples arrive on
    zenoh's threads and are written on the thread that calls ``run``.
    """

    def __init__(self, client: GraphClient, output: Path | str, topics: Sequence[str] = (), *,
                 include_chunks: bool = False, log: Callable[[str], None] = lambda line: None) -> None:
        self.client = client
        self.output = Path(output)
        self.wanted = [t if t.startswith("/") else "/" + t for t in topics]
        self.include_chunks = include_chunks
        self.log = log
        self.topics: dict[str, RecordedTopic] = {}
        self._connections: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._subscriptions: list[Any] = []
        self._skipped: set[str] = set()  # topics of "every topic" that cannot be recorded, said once
        self._samples: queue.SimpleQueue[tuple[str, RawSample]] = queue.SimpleQueue()
        # a latched topic's cache answer repeats the live sample when that came first: per
        # (topic, publisher GID), the last live payload
        self._last_live: dict[tuple[str, bytes], bytes] = {}
        self._writer: Any = None
        self._started_s = 0.0

    # --- setting up -------------------------------------------------------------------------
    def start(self) -> list[RecordedTopic]:
        from rosbags.rosbag2 import StoragePlugin, Writer, WriterError

        if self.output.exists() or self.output.is_symlink():
            raise BagError(f"{self.output} exists already (a bag is never overwritten: choose another -o)")
        topics = self._named_topics() if self.wanted else self._new_topics()
        try:
            self._writer = Writer(self.output, version=BAG_VERSION, storage_plugin=StoragePlugin.MCAP)
            self._writer.open()
        except WriterError as exc:
            raise BagError(str(exc)) from None
        except OSError as exc:
            raise BagError(f"cannot create {self.output}: {exc.strerror or exc}") from None
        self._started_s = time.monotonic()
        try:
            for topic in topics:
                self._add(topic)
        except BaseException:
            self._close()  # a bag that says what it holds rather than a half-written folder
            raise
        return topics

    def _named_topics(self) -> list[RecordedTopic]:
        deadline = time.monotonic() + DISCOVERY_WAIT_S  # a fresh session may not have every token yet
        while True:
            found = published_topics(self.client)
            missing = [t for t in self.wanted if t not in found]
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise BagError(f"topic '{missing[0]}' not found (is its publisher running?)")
            time.sleep(0.2)
        topics = []
        for name in dict.fromkeys(self.wanted):
            topic = recordable(name, found[name])
            if isinstance(topic, str):
                raise BagError(topic)
            topics.append(topic)
        return topics

    def _new_topics(self) -> list[RecordedTopic]:
        """Topics of the graph not recorded yet (for "every topic")."""
        topics = []
        for name, publishers in sorted(published_topics(self.client).items()):
            if name in self.topics or name in self._skipped:
                continue
            if name.startswith(CHUNK_PREFIX) and not self.include_chunks:
                continue
            topic = recordable(name, publishers)
            if isinstance(topic, str):
                self._skipped.add(name)
                self.log(f"not recording {name}: {topic}")
                continue
            topics.append(topic)
        return topics

    def _add(self, topic: RecordedTopic) -> None:
        self._connections[topic.name] = self._writer.add_connection(
            topic.name, topic.msg_type, msgdef=message_definition(topic.msg_type),
            rihs01=interfaces.type_hash(topic.msg_type), offered_qos_profiles=[_offered_qos(topic)])
        self.topics[topic.name] = topic
        self._counts[topic.name] = 0
        name = topic.name

        def put(sample: RawSample) -> None:
            self._samples.put((name, sample))

        self._subscriptions.append(self.client.subscribe_raw(topic.name, topic.msg_type, put,
                                                             latched=topic.latched))

    # --- recording --------------------------------------------------------------------------
    def run(self, stop: threading.Event, duration_s: float | None = None) -> RecordSummary:
        """Record (after ``start``) until ``stop`` is set or ``duration_s`` passed since ``start``."""
        next_discovery = time.monotonic() + REDISCOVER_S
        try:
            while not stop.is_set():
                now = time.monotonic()
                if duration_s is not None and now - self._started_s >= duration_s:
                    break
                if not self.wanted and now >= next_discovery:
                    for topic in self._new_topics():
                        self._add(topic)
                        self.log(f"recording {topic.name} too")
                    next_discovery = time.monotonic() + REDISCOVER_S
                wait_s = 0.1 if duration_s is None else min(0.1, max(0.0, self._started_s + duration_s - now))
                self._write_pending(wait_s)
        finally:
            self._close()
        return RecordSummary(self.output, time.monotonic() - self._started_s, tuple(sorted(self._counts.items())))

    def _write_pending(self, wait_s: float) -> None:
        try:
            item = self._samples.get(timeout=wait_s) if wait_s > 0 else self._samples.get_nowait()
        except queue.Empty:
            return
        while True:
            self._write(*item)
            try:
                item = self._samples.get_nowait()
            except queue.Empty:
                return

    def _write(self, topic: str, sample: RawSample) -> None:
        if self.topics[topic].latched:
            key = (topic, sample.gid)
            if sample.cached:
                if self._last_live.get(key) == sample.payload:
                    return
            else:
                self._last_live[key] = sample.payload
        try:
            self._writer.write(self._connections[topic], sample.received_ns, sample.payload)
        except OSError as exc:
            raise BagError(f"cannot write {self.output}: {exc.strerror or exc}") from None
        self._counts[topic] += 1

    def _close(self) -> None:
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):  # the session may be closing already
                sub.undeclare()
        self._subscriptions.clear()
        if self._writer is None:
            return
        try:
            self._write_pending(0.0)  # what arrived before the subscriptions ended
        finally:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError as exc:
                raise BagError(f"cannot finish {self.output}: {exc.strerror or exc}") from None


def read_info(path: Path | str) -> BagInfo:
    """What ``ros2 bag info`` shows, read back with rosbags' reader."""
    from rosbags.interfaces import ConnectionExtRosbag2
    from rosbags.rosbag2 import Reader, ReaderError

    path = Path(path)
    if not path.exists():
        raise BagError(f"{path}: no such bag")
    try:
        with Reader(path) as reader:
            topics = tuple(
                TopicSummary(c.topic, c.msgtype, c.msgcount,
                             isinstance(c.ext, ConnectionExtRosbag2)  # always, from a rosbag2 reader
                             and any(q.durability.name == "TRANSIENT_LOCAL" for q in c.ext.offered_qos_profiles))
                for c in sorted(reader.connections, key=lambda c: c.topic))
            start_ns = reader.start_time if reader.message_count else 0
            duration_ns = max(0, reader.end_time - reader.start_time - 1) if reader.message_count else 0
            message_count = reader.message_count
    except (ReaderError, OSError, KeyError, ValueError) as exc:
        raise BagError(f"{path}: not a readable rosbag2: {exc}") from None
    if path.is_dir():
        metadata = yaml.safe_load((path / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
        storage = str(metadata.get("storage_identifier", ""))
        files = tuple(Path(f).name for f in metadata.get("relative_file_paths", []))
        size = sum((path / f).stat().st_size for f in files if (path / f).exists())
    else:
        storage = {".mcap": "mcap", ".db3": "sqlite3"}.get(path.suffix, path.suffix.lstrip("."))
        files, size = (path.name,), path.stat().st_size
    return BagInfo(path, storage, files, size, start_ns, duration_ns, message_count, topics)
