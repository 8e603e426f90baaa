"""Authentication and access control of the embedded runtime, as plain values (no zenoh here).

With ``KAITIAN_SECURITY=<cert dir>`` every zenoh session of the process (router, peers, CLI
tools) uses TLS endpoints with mutual authentication against the directory's ``ca.pem``, and
access control: a session only accepts a put on a protected topic (``PROTECTED_TOPICS``: plan,
assignment, fused results, telemetry, profiles, tensor chunks) from a link whose certificate
names one of the topic's owner roles. ``KAITIAN_SECURITY_ROLE`` picks which certificate the
process presents (``node`` by default). ``zenoh_session.open_session`` turns these values into a
zenoh config; ``kaitian certs create`` makes a matching directory.
docs/security.md says what this guarantees and what it does not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_DIR = "KAITIAN_SECURITY"        # certificate directory; unset or empty: security off
ENV_ROLE = "KAITIAN_SECURITY_ROLE"  # which certificate this process presents

COORDINATOR, SCHEDULER, COMPUTE, NODE = "coordinator", "scheduler", "compute", "node"
ROLES = (COORDINATOR, SCHEDULER, COMPUTE, NODE)  # also the certificates' common names
CA_CERT = "ca.pem"
CA_KEY = "ca.key"  # only `kaitian certs create` needs it; a running graph never reads it

# Topics only their owner roles may publish (least privilege: camera, tools, router, launcher,
# monitor and trainers hold `node` and publish none of these). A name ending in ``/**`` stands
# for every topic under it. Keys are rmw_zenoh data keys ``<domain>/<topic>/<type>/<hash>``;
# ``protected_key`` covers every ROS_DOMAIN_ID and every type name and hash.
PROTECTED_TOPICS: dict[str, tuple[str, ...]] = {
    "/kaitian/plan": (COORDINATOR,),           # plan versions every compute node executes
    "/kaitian/assignment": (SCHEDULER,),       # the shares the coordinator adopts
    "/kaitian/fused": (COORDINATOR, COMPUTE),  # the graph's results (direct path: the node's own)
    "/kaitian/telemetry": (COMPUTE,),          # what the scheduler moves shares by
    "/kaitian/profiles": (COMPUTE,),           # the costs the coordinator's planner plans with
    "/kaitian/chunks/**": (COORDINATOR, COMPUTE),  # image rows in, halos between nodes, rows out
}

# What a zenoh message can do on a key expression (zenoh 1.x access-control message kinds).
ALL_MESSAGES = ("put", "delete", "declare_subscriber", "query", "declare_queryable", "reply",
                "liveliness_token", "declare_liveliness_subscriber", "liveliness_query")
# The ways a session can hand a subscriber data on a key: put/delete directly, or answer a
# latched subscriber's query (declare a queryable, send a reply)
PUBLISHING_MESSAGES = ("put", "delete", "declare_queryable", "reply")
# Wildcards never match a chunk starting with '@' (zenoh's verbatim chunks), so the key spaces
# the runtime uses there are allowed by name: liveliness (graph), parameters, zenoh's admin space
ALL_KEYS = ("**", "@ros2_lv/**", "@kaitian/**", "@/**")


class SecurityError(ValueError):
    """A security setting that cannot be used (missing files, unknown role); one line."""


@dataclass(frozen=True)
class Security:
    """Run a session on TLS + access control with ``cert_dir``, presenting ``role``'s certificate."""

    cert_dir: Path
    role: str = NODE

    @property
    def ca_cert(self) -> Path:
        return self.cert_dir / CA_CERT

    @property
    def cert(self) -> Path:
        return self.cert_dir / f"{self.role}.pem"

    @property
    def key(self) -> Path:
        return self.cert_dir / f"{self.role}.key"


def role_for_executable(executable: str) -> str:
    """The certificate a launched process presents: its own for the publishers of protected
    topics (coordinator, scheduler, compute), ``node`` for every other process (camera, monitor,
    trainers, router, launcher, tools)."""
    return executable if executable in (COORDINATOR, SCHEDULER, COMPUTE) else NODE


def from_env(env: Mapping[str, str] | None = None) -> Security | None:
    """The process's setting from ``KAITIAN_SECURITY``/``KAITIAN_SECURITY_ROLE``; None if off."""
    env = os.environ if env is None else env
    directory = env.get(ENV_DIR, "").strip()
    if not directory:
        return None
    role = env.get(ENV_ROLE, "").strip() or NODE
    if role not in ROLES:
        raise SecurityError(f"{ENV_ROLE} must be one of {', '.join(ROLES)}, got {role!r}")
    return Security(Path(directory).expanduser().resolve(), role)


def missing_files(cert_dir: Path, roles: tuple[str, ...] = ROLES) -> list[str]:
    """Names of the files ``roles`` need that ``cert_dir`` lacks (or cannot be read as PEM)."""
    names = [CA_CERT] + [f"{role}.{ext}" for role in roles for ext in ("pem", "key")]
    missing = []
    for name in names:
        path = cert_dir / name
        try:
            with path.open("rb") as f:
                head = f.read(64)
        except OSError:
            missing.append(name)
            continue
        if b"-----BEGIN" not in head:
            missing.append(f"{name} (not PEM)")
    return missing


def check_cert_dir(cert_dir: str | os.PathLike[str], roles: tuple[str, ...] = ROLES) -> Path:
    """``cert_dir`` resolved, if it holds what ``roles`` need; else SecurityError saying what is missing."""
    text = str(cert_dir)
    if not text.strip():
        raise SecurityError("security: empty certificate directory")
    path = Path(text).expanduser().resolve()
    if not path.is_dir():
        raise SecurityError(f"security: {path} is not a directory (create one with `kaitian certs create {path}`)")
    missing = missing_files(path, roles)
    if missing:
        raise SecurityError(f"security: {path} lacks or cannot read {', '.join(missing)} "
                            f"(create them with `kaitian certs create {path} --force`)")
    return path


def check(security: Security) -> Security:
    """``security`` if its directory holds the CA and the role's certificate and key."""
    check_cert_dir(security.cert_dir, (security.role,))
    return security


def secure_endpoint(endpoint: str) -> str:
    """The TLS endpoint for ``endpoint``: ``tcp/`` becomes ``tls/`` (same address), ``tls/`` stays."""
    protocol, sep, rest = endpoint.partition("/")
    if not sep:
        raise SecurityError(f"security: not a zenoh endpoint: {endpoint!r}")
    if protocol == "tls":
        return endpoint
    if protocol == "tcp":
        return f"tls/{rest}"
    raise SecurityError(f"security: endpoint {endpoint!r} uses {protocol}/; with security on, "
                        f"endpoints must be tcp/ (run as tls/) or tls/")


def tls_config(security: Security) -> dict[str, Any]:
    """``transport/link/tls``: our CA as the only root, this role's certificate both when
    listening and when connecting, and client certificates required (mTLS)."""
    cert, key = str(security.cert), str(security.key)
    return {
        "root_ca_certificate": str(security.ca_cert),
        "enable_mtls": True,
        "listen_certificate": cert,
        "listen_private_key": key,
        "connect_certificate": cert,
        "connect_private_key": key,
        # the client checks the server's certificate names its address (SANs: localhost,
        # 127.0.0.1 and the hosts given to `kaitian certs create --host`)
        "verify_name_on_connect": True,
    }


def protected_key(topic: str) -> str:
    """Key expression of every rmw_zenoh data key of ``topic`` (or, for ``/prefix/**``, of every
    topic under the prefix) in every domain."""
    return f"*/{topic.strip('/').removesuffix('/**')}/**"


def owners_of(topic: str, protected: Mapping[str, tuple[str, ...]] | None = None) -> tuple[str, ...] | None:
    """The roles that may publish ``topic`` (a resolved ROS name), or None if every role may.
    Matches what ``protected_key`` covers: the name and every topic under it."""
    protected = PROTECTED_TOPICS if protected is None else protected
    for name, owners in protected.items():
        base = "/" + name.strip("/").removesuffix("/**")
        if topic == base or topic.startswith(base + "/"):
            return owners
    return None


def publish_refusal(topic: str, role: str) -> str:
    """'' if ``role`` may publish ``topic``, else one line saying why the graph drops it: a node
    started by hand with the wrong KAITIAN_SECURITY_ROLE otherwise fails silently."""
    owners = owners_of(topic)
    if owners is None or role in owners:
        return ""
    return (f"security: {topic} is published with role {role}, which the graph drops "
            f"(only {' or '.join(owners)} may publish it; set {ENV_ROLE})")


def _check_owners(topic: str, owners: tuple[str, ...]) -> None:
    if isinstance(owners, str) or not owners:
        raise SecurityError(f"security: {topic} needs a non-empty tuple of owner roles, got {owners!r}")
    unknown = [o for o in owners if o not in ROLES]
    if unknown:
        raise SecurityError(f"security: {topic} is owned by unknown role(s) {', '.join(map(repr, unknown))}")


def access_control_config(protected: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, Any]:
    """``access_control`` for every session of a secure graph.

    Zenoh matches each link to a subject by the common name of the certificate the remote end
    presented, and a deny rule wins over an allow rule. Everything is denied by default, so a
    link with a certificate of no known role gets nothing through; each role may send and
    receive anything, except that a link may only *publish* (put, delete, declare a queryable,
    reply) on a protected topic if its role is one of that topic's owners. The deny rules are
    ingress only: each session filters what reaches it, and peers talk to each other directly
    (gossip), so every session must enforce them, not the router alone.
    """
    protected = PROTECTED_TOPICS if protected is None else protected
    rules: list[dict[str, Any]] = [{
        "id": "allow_all", "permission": "allow", "flows": ["ingress", "egress"],
        "messages": list(ALL_MESSAGES), "key_exprs": list(ALL_KEYS),
    }]
    policies: list[dict[str, Any]] = [{"id": "members", "rules": ["allow_all"], "subjects": list(ROLES)}]
    for index, (topic, owners) in enumerate(sorted(protected.items())):
        _check_owners(topic, owners)
        others = [r for r in ROLES if r not in owners]
        if not others:  # every role owns it: nothing to deny, and no policy without subjects
            continue
        rule_id = f"only_{'_'.join(owners)}_publish_{index}"
        rules.append({"id": rule_id, "permission": "deny", "flows": ["ingress"],
                      "messages": list(PUBLISHING_MESSAGES), "key_exprs": [protected_key(topic)]})
        policies.append({"id": f"not_{'_'.join(owners)}_{index}", "rules": [rule_id], "subjects": others})
    return {
        "enabled": True,
        "default_permission": "deny",
        "rules": rules,
        "subjects": [{"id": role, "cert_common_names": [role]} for role in ROLES],
        "policies": policies,
    }


def zenoh_settings(security: Security) -> dict[str, Any]:
    """The zenoh config entries (path -> JSON value) a secure session adds to its config."""
    return {"transport/link/tls": tls_config(security), "access_control": access_control_config()}


def for_launch(directory: str = "", env: Mapping[str, str] | None = None) -> Security | None:
    """A launcher's own setting (role ``node``): ``directory`` (the scenario's ``security``), else
    ``KAITIAN_SECURITY``; None if neither. Checked for every role, since it starts them all."""
    env = os.environ if env is None else env
    chosen = directory or env.get(ENV_DIR, "").strip()
    if not chosen:
        return None
    return Security(check_cert_dir(chosen), NODE)


def child_env(security: Security | None, executable: str) -> dict[str, str]:
    """The variables a launched process needs to run with ``security`` under its own role."""
    if security is None:
        return {}
    return {ENV_DIR: str(security.cert_dir), ENV_ROLE: role_for_executable(executable)}
