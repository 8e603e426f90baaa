"""The one place that imports zenoh: sessions, keys and attachments in rmw_zenoh's format."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import zenoh
import zenoh.shm

from kaitian_ros.runtime import interfaces
from kaitian_ros.runtime import security as security_

DEFAULT_ROUTER = "tcp/127.0.0.1:7447"
LIVELINESS_PREFIX = "@ros2_lv"
PARAM_PREFIX = "@kaitian/params"
CONNECT_TIMEOUT_MS = 5000  # a peer gives up on an unreachable router after this
# what zenoh raises (closed session, unreachable router, bad endpoint): the layers above catch it
# by this name, so that this module stays the one that imports zenoh
SessionError = zenoh.ZError


def router_endpoint() -> str:
    """Router to connect to: ``KAITIAN_ROUTER`` (a zenoh endpoint) or the default."""
    return os.environ.get("KAITIAN_ROUTER", DEFAULT_ROUTER)


# addresses a router may listen on that mean "every interface": this host's own processes reach
# such a router at loopback (other hosts at one of the host's addresses)
_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}  # noqa: S104 - recognises the address, binds nothing


def split_endpoint(endpoint: str) -> tuple[str, str, str]:
    """(protocol, address, port) of ``proto/address:port`` (an IPv6 address in brackets);
    ValueError for anything else."""
    proto, sep, rest = endpoint.partition("/")
    address, colon, port = rest.split("?")[0].split("#")[0].rpartition(":")  # less zenoh's metadata/config
    if not (sep and proto and colon and address and port.isdigit() and int(port) < 65536):
        raise ValueError(f"not a zenoh endpoint like tcp/192.168.1.10:7447: {endpoint!r}")
    return proto, address, port


def local_endpoint(endpoint: str) -> str:
    """Where this host's own processes connect to a router listening on ``endpoint``: the
    same, except loopback for an any-address (``tcp/0.0.0.0:7447`` -> ``tcp/127.0.0.1:7447``)."""
    for any_address, loopback in _ANY_ADDRESS.items():
        if f"/{any_address}:" in endpoint:
            return endpoint.replace(f"/{any_address}:", f"/{loopback}:", 1)
    return endpoint


def peer_listen_endpoint(address_or_endpoint: str) -> str:
    """A peer's listen endpoint from a bare address (``192.168.1.20`` -> ``tcp/192.168.1.20:0``,
    port 0: the kernel picks one per process) or a whole endpoint (kept as it is)."""
    text = address_or_endpoint.strip()
    if "/" in text:
        split_endpoint(text)
        return text
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"not an address or zenoh endpoint: {address_or_endpoint!r}")
    host = f"[{text}]" if ":" in text and not text.startswith("[") else text  # bare IPv6
    return f"tcp/{host}:0"


def domain_id() -> int:
    try:
        return int(os.environ.get("ROS_DOMAIN_ID", "0"))
    except ValueError:
        raise ValueError(f"ROS_DOMAIN_ID must be an integer, got {os.environ['ROS_DOMAIN_ID']!r}") from None


FROM_ENV = "env"  # open_session's default: security as KAITIAN_SECURITY / KAITIAN_SECURITY_ROLE say


def resolve_security(security: security_.Security | str | None = FROM_ENV) -> security_.Security | None:
    """``security`` itself, or for FROM_ENV what KAITIAN_SECURITY(_ROLE) say (None: off)."""
    if isinstance(security, str):
        if security != FROM_ENV:
            raise TypeError(f"security must be a Security, None or {FROM_ENV!r}, got {security!r}")
        return security_.from_env()
    return security


def open_session(mode: str = "peer", *, connect: str | None = None, listen: str | None = None,
                 security: security_.Security | str | None = FROM_ENV) -> Any:
    """A zenoh session like rmw_zenoh's defaults: multicast scouting off, loopback only.

    Peers connect to the router for discovery and then talk to each other directly
    (gossip scouting), so chunks do not take a detour through the router.

    ``security`` (default: from the environment, see ``runtime/security.py``): TLS endpoints
    instead of TCP ones (a ``tcp/`` endpoint given here is used as ``tls/`` at the same
    address), mutual certificate authentication and access control on this session.
    SecurityError if its files are missing.
    """
    security = resolve_security(security)
    if security is not None:
        security_.check(security)

    def endpoint(ep: str) -> str:
        return ep if security is None else security_.secure_endpoint(ep)

    config = zenoh.Config()
    config.insert_json5("mode", json.dumps(mode))
    config.insert_json5("scouting/multicast/enabled", "false")
    if mode == "router":
        config.insert_json5("listen/endpoints", json.dumps([endpoint(listen or router_endpoint())]))
    else:
        config.insert_json5("connect/endpoints", json.dumps([endpoint(connect or router_endpoint())]))
        # KAITIAN_LISTEN: this peer's own endpoint, e.g. its address inside a network namespace
        # (bench link emulation); peers connect to each other there directly
        config.insert_json5("listen/endpoints", json.dumps([endpoint(listen or os.environ.get("KAITIAN_LISTEN")
                                                                     or "tcp/127.0.0.1:0")]))
        # fail fast when no router is running instead of waiting forever
        config.insert_json5("connect/timeout_ms", str(CONNECT_TIMEOUT_MS))
        config.insert_json5("connect/exit_on_failure", "true")
    # KAITIAN_SHM=0: no shared-memory transport. Zenoh otherwise moves messages > 3 KB between
    # processes of one host through /dev/shm, bypassing the network - and any emulated link.
    if os.environ.get("KAITIAN_SHM", "1") == "0":
        config.insert_json5("transport/shared_memory/enabled", "false")
    else:
        # zenoh's own pool serves messages between 3 KB and SHM_PUT_MIN_BYTES only (larger ones go
        # through ours): a small one, since a receiver never unmaps a departed sender's pool
        config.insert_json5("transport/shared_memory/transport_optimization/pool_size",
                            str(TRANSPORT_SHM_POOL_BYTES))
    # large tensor chunks: bigger batches; never drop reliable data locally
    config.insert_json5("transport/link/tx/batch_size", "65535")
    if security is not None:
        for key, value in security_.zenoh_settings(security).items():
            config.insert_json5(key, json.dumps(value))
    return zenoh.open(config)


def _tcp_answer(endpoint: str) -> str:
    """How the host of a TCP-based endpoint (``tcp/`` or ``tls/``) answers a plain connection to
    its port: "refused" (nobody listens: a peer session would only say so after its connect
    timeout, retrying all along), "timeout" (no answer within that timeout, which the session
    would wait out again) or "" (it accepted, or the session's own attempt says what is wrong)."""
    try:
        proto, address, port = split_endpoint(endpoint)
    except ValueError:
        return ""
    if proto not in ("tcp", "tls"):
        return ""
    try:
        with socket.create_connection((address.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_MS / 1000):
            return ""
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError:  # unreachable, unresolvable: the session's own attempt says so
        return ""


def router_problem(endpoint: str, security: security_.Security | str | None = FROM_ENV) -> str:
    """'' when a peer session connects to the router at ``endpoint``, else one line saying
    why not (checked before starting nodes that would each fail to connect on their own)."""
    unreachable = (f"no router reachable at {endpoint} within {CONNECT_TIMEOUT_MS / 1000:g} s (is the other "
                   f"host's `kaitian launch --router ...` running, and its port open in the firewall?)")
    answer = _tcp_answer(endpoint)
    if answer == "refused":
        return (f"no router reachable at {endpoint}: connection refused (is the other host's "
                f"`kaitian launch --router ...` running on that port?)")
    if answer == "timeout":
        return unreachable
    try:
        session = open_session("peer", connect=endpoint, listen="tcp/127.0.0.1:0", security=security)
    except zenoh.ZError as exc:
        first = " ".join(str(exc).split())
        if "Timeout" in first or "Unable to connect" in first:
            return unreachable
        return f"cannot connect to the router at {endpoint}: {first.split(' at /')[0]}"
    session.close()
    return ""


def mangle(text: str) -> str:
    """rmw_zenoh liveliness fields: '/' becomes '%', empty becomes '%'."""
    return text.replace("/", "%") if text else "%"


def topic_key(domain: int, topic: str, msg_type: str) -> str:
    """``<domain>/<topic without leading slash>/<dds type name>/<RIHS01 hash>``."""
    return f"{domain}/{topic.lstrip('/')}/{interfaces.dds_type_name(msg_type)}/{interfaces.type_hash(msg_type)}"


def topic_key_any_type(domain: int, topic: str) -> str:
    """Key expression matching the topic with any type name and hash (to count mismatches)."""
    return f"{domain}/{topic.lstrip('/')}/*/*"


def is_concrete_key(key: str) -> bool:
    """False for a key expression with wildcards. Publishers put on their one data key; a put on
    a wildcard key expression reaches every subscriber whose key intersects it, and zenoh's
    access control only applies a rule whose key expression *includes* the message's, so
    ``0/kaitian/*/<type>/<hash>`` passes a deny rule on ``*/kaitian/plan/**``. Subscribers drop
    such samples instead (docs/security.md)."""
    return "*" not in key


def parse_topic_key(key: str) -> tuple[int, str, str, str]:
    """(domain, topic, dds type name, hash) of a data key."""
    parts = key.split("/")
    if len(parts) < 4:
        raise ValueError(f"not a topic key: {key}")
    return int(parts[0]), "/" + "/".join(parts[1:-2]), parts[-2], parts[-1]


def node_token(domain: int, zid: str, node_id: int, namespace: str, name: str) -> str:
    return f"{LIVELINESS_PREFIX}/{domain}/{zid}/{node_id}/{node_id}/NN/%/{mangle(namespace.strip('/'))}/{name}"


def endpoint_token(domain: int, zid: str, node_id: int, entity_id: int, kind: str, namespace: str,
                   name: str, topic: str, msg_type: str, qos: str) -> str:
    """kind: MP (publisher) or MS (subscriber)."""
    return (f"{LIVELINESS_PREFIX}/{domain}/{zid}/{node_id}/{entity_id}/{kind}/%/"
            f"{mangle(namespace.strip('/'))}/{name}/{mangle(topic)}/"
            f"{interfaces.dds_type_name(msg_type)}/{interfaces.type_hash(msg_type)}/{qos}")


@dataclass(frozen=True)
class LivelinessEntry:
    kind: str            # NN, MP, MS
    namespace: str
    node_name: str
    topic: str = ""
    dds_type: str = ""
    type_hash: str = ""
    qos: str = ""        # rmw_zenoh's "reliability:durability:history,depth..." ('' = defaults)

    @property
    def latched(self) -> bool:
        """Transient local (durability 1 in rmw's enum): the publisher serves its last sample."""
        fields = self.qos.split(":")
        return len(fields) > 1 and fields[1] == "1"

    @property
    def best_effort(self) -> bool:
        """Reliability 2 in rmw's enum."""
        return self.qos.split(":")[0] == "2"

    @property
    def node_fqn(self) -> str:
        ns = "" if self.namespace in ("", "/") else self.namespace
        return f"{ns}/{self.node_name}"

    @property
    def type_name(self) -> str:
        """``pkg::msg::dds_::Name_`` -> ``pkg/msg/Name``."""
        pkg, kind, _, short = self.dds_type.split("::")
        return f"{pkg}/{kind}/{short.rstrip('_')}"


def parse_liveliness(key: str) -> LivelinessEntry | None:
    parts = key.split("/")
    if len(parts) < 9 or parts[0] != LIVELINESS_PREFIX:
        return None
    kind = parts[5]
    ns = "/" + parts[7].replace("%", "/") if parts[7] != "%" else "/"
    if kind == "NN":
        return LivelinessEntry(kind, ns, parts[8])
    if kind in ("MP", "MS") and len(parts) >= 12:
        return LivelinessEntry(kind, ns, parts[8], "/" + parts[9].replace("%", "/").lstrip("/"),
                               parts[10], parts[11], parts[12] if len(parts) > 12 else "")
    return None


CONFIRM_QUERIES = 2  # liveliness queries that must find no holder before a departure is reported
CONFIRM_PAUSE_S = 0.2


def watch_departures(session: Any, domain: int, on_gone: Any) -> Any:
    """A liveliness subscriber calling ``on_gone(entry)`` (a LivelinessEntry, kind NN) when a
    node's token disappears - its session closed, or its process died and the link with it.

    Called on a thread of its own, after asking whether anyone still holds that token: anyone can
    declare and undeclare a copy of a node's token key, which must not pass for the node leaving.
    Asked twice, `CONFIRM_PAUSE_S` apart, before a departure is reported: on a loaded 2-core
    machine one query in about fifteen runs of the copied-token test found no holder of a live
    node's token right after the copy was withdrawn, and the live node was reported gone (the
    ROS runtime polls the graph every 0.25 s, so a departure reported 0.2 s later is no slower
    than there).
    """
    def held(key: str) -> bool | None:
        try:
            return any(reply.ok is not None for reply in session.liveliness().get(key, timeout=1.0))
        except zenoh.ZError:  # session closing
            return None

    def confirm(key: str, entry: LivelinessEntry) -> None:
        for attempt in range(CONFIRM_QUERIES):
            if attempt:
                time.sleep(CONFIRM_PAUSE_S)
            answer = held(key)
            if answer is None or answer:
                return  # closing, or still held: not a departure
        on_gone(entry)

    def handler(sample: Any) -> None:
        if sample.kind != zenoh.SampleKind.DELETE:
            return
        key = str(sample.key_expr)
        entry = parse_liveliness(key)
        if entry is not None and entry.kind == "NN":
            threading.Thread(target=confirm, args=(key, entry), daemon=True).start()

    return session.liveliness().declare_subscriber(f"{LIVELINESS_PREFIX}/{domain}/**", handler)


_ATTACHMENT_HEAD = struct.Struct("<qqB")


def make_attachment(sequence: int, timestamp_ns: int, gid: bytes) -> bytes:
    """rmw_zenoh attachment: int64 sequence, int64 source timestamp (ns), GID (len byte + 16 bytes)."""
    return _ATTACHMENT_HEAD.pack(sequence, timestamp_ns, len(gid)) + gid


class AttachmentWriter:
    """Per-publisher attachment buffer: the GID is written once, each message packs 16 bytes.

    ``put`` copies the attachment, so one bytearray serves every message of the publisher.
    """

    __slots__ = ("_buf", "_gid_len", "_pack_into")

    def __init__(self, gid: bytes) -> None:
        self._buf = bytearray(_ATTACHMENT_HEAD.size + len(gid))
        self._buf[_ATTACHMENT_HEAD.size:] = gid
        self._pack_into = _ATTACHMENT_HEAD.pack_into
        self._gid_len = len(gid)

    def __call__(self, sequence: int, timestamp_ns: int) -> bytearray:
        self._pack_into(self._buf, 0, sequence, timestamp_ns, self._gid_len)
        return self._buf


def parse_attachment(raw: bytes) -> tuple[int, int, bytes]:
    if len(raw) < 17:
        raise ValueError("attachment too short")
    sequence, stamp, n = _ATTACHMENT_HEAD.unpack_from(raw)
    return sequence, stamp, bytes(raw[17:17 + n])


def attachment_stamp(raw: bytes) -> tuple[int, int]:
    """(sequence, source timestamp ns) of an rmw_zenoh attachment; ValueError if too short."""
    if len(raw) < 17:
        raise ValueError("attachment too short")
    sequence, stamp, _ = _ATTACHMENT_HEAD.unpack_from(raw)
    return sequence, stamp


# A node answers a parameter request on its executor, after the callback running there (a
# coordinator re-plans inside a `set`: a search over a few nodes, seconds on a loaded machine);
# past PARAM_SERVE_TIMEOUT_S it answers "node busy". The asking side waits longer than that, so
# that a slow answer still arrives: a client that gave up first reported a node "not found"
# whose parameter was then set.
PARAM_SERVE_TIMEOUT_S = 5.0
PARAM_QUERY_TIMEOUT_S = PARAM_SERVE_TIMEOUT_S + 2.0


def param_key(domain: int, node_fqn: str, op: str) -> str:
    return f"{PARAM_PREFIX}/{domain}/{node_fqn.strip('/')}/{op}"


def as_zenoh_payload(cdr: bytes | bytearray | memoryview) -> bytes | bytearray:
    """zenoh's put takes bytes/bytearray; hand over the serializer's buffer without a copy."""
    if isinstance(cdr, memoryview):
        base = cdr.obj
        if isinstance(base, (bytes, bytearray)) and cdr.contiguous and len(base) == cdr.nbytes:
            return base
        return cdr.tobytes()
    return cdr


# --- shared-memory publishing -----------------------------------------------------------------
# put(bytearray) copies the payload into a zenoh buffer, and zenoh's transport then copies a
# large message once more into shared memory for a peer on the same host. Writing the encoded
# message into a buffer of our own SHM provider costs one copy and put sends it as it is
# (measured in docs/transport.md: publisher loop ~2x, 4 MiB GB/s ~1.5x). KAITIAN_SHM=0 or
# KAITIAN_SHM_PUT=0 turns it off; KAITIAN_SHM_POOL_MB sizes the pool (default 16).
#
# Pools are sized small on purpose: zenoh (1.10) never unmaps a sender's pool in a receiver, even
# after the sender exits (upstream eclipse-zenoh/zenoh#2787), so every restart of a publisher
# costs each of its receivers up to the publisher's pool in resident memory. 16 MB holds a dozen
# 1 MB slabs in flight, more than a graph has.
SHM_PUT_MIN_BYTES = 64 * 1024
SHM_POOL_MB_DEFAULT = 16
TRANSPORT_SHM_POOL_BYTES = 4 * 1024 * 1024
_shm_provider: Any = None
_shm_failed = False


def shm_payload(buf: bytes | bytearray) -> Any:
    """A ZShmMut holding a copy of ``buf``, or None (no SHM here, pool full): put ``buf`` itself."""
    global _shm_provider, _shm_failed
    if _shm_failed:
        return None
    try:
        if _shm_provider is None:
            if os.environ.get("KAITIAN_SHM", "1") == "0" or os.environ.get("KAITIAN_SHM_PUT", "1") == "0":
                _shm_failed = True
                return None
            pool = int(os.environ.get("KAITIAN_SHM_POOL_MB", str(SHM_POOL_MB_DEFAULT))) * 1024 * 1024
            _shm_provider = zenoh.shm.ShmProvider.default_backend(pool)
        shm = _shm_provider.alloc(len(buf), policy=zenoh.shm.GarbageCollect())
    except Exception:  # noqa: BLE001 - optional fast path: whatever fails (no /dev/shm, pool exhausted by in-flight messages, ...), a plain put
        if _shm_provider is None:
            _shm_failed = True
        return None
    shm[:] = buf
    return shm


CongestionControl = zenoh.CongestionControl
Priority = zenoh.Priority


def query_latched(session: Any, key: str, on_reply: Any, timeout_s: float) -> None:
    """Ask every latched publisher on ``key`` for its cached last sample, as a late-joining
    transient-local subscriber does. No reply consolidation: all publishers of one topic share
    its key, and zenoh's default keeps one reply per key, which would hand a late joiner the
    cache of one publisher only (e.g. one compute node's cost profile of several)."""
    session.get(key, on_reply, consolidation=zenoh.ConsolidationMode.NONE, timeout=timeout_s)
