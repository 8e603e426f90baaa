"""Authentication and access control (docs/security.md) on real zenoh sessions in real processes.

A graph of small processes (router, one publisher per certificate role, a subscriber) checks
the access rules; outsiders (no certificate, another CA) try to join it; a secure
``kaitian launch hetero_inference`` delivers /kaitian/fused. Nothing here asserts a duration:
"never arrives" is checked by message order on one link (a publisher's later message arrived,
so its earlier one would have too) or while the graph demonstrably kept delivering.

Run as a script, this file is the child processes::

    python test/test_security.py publisher ROLE     # every protected topic + a marker, labelled ROLE
    python test/test_security.py subscriber         # prints what reaches it, one JSON line each
    python test/test_security.py outsider VARIANT   # raw zenoh: tcp | tls_no_cert | other_ca
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, Proc, child_env, free_port, pids_with_env, run_cli, wait_until

from kaitian_ros import certs
from kaitian_ros.runtime import security
from kaitian_ros.scenario import ScenarioError, load_scenario

_SAY_LOCK = threading.Lock()


def _say(record: dict) -> None:
    """One JSON line on stdout from any thread: print() writes the text and its newline
    separately, so two callbacks printing at once could share a line."""
    with _SAY_LOCK:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


PUBLISHER_ROLES = security.ROLES  # coordinator, scheduler, compute, node
OUTSIDERS = ("tcp", "tls_no_cert", "other_ca")


@dataclass(frozen=True)
class Topic:
    """A topic the test graph publishes, and the string field its messages carry a label in."""

    name: str
    topic: str
    msg_type: str
    field: str
    latched: bool = False  # the product's publisher is latched: late joiners ask its cache

    def make(self, label: str) -> Any:
        from kaitian_ros.runtime import interfaces
        return interfaces.make(self.msg_type, **{self.field: label})

    def label(self, msg: Any) -> str:
        return getattr(msg, self.field)


# one topic per protected topic (a chunk topic stands for every one), as the product's nodes type them
PROTECTED = (
    Topic("plan", "/kaitian/plan", "LoadAssignment", "reason", latched=True),
    Topic("assignment", "/kaitian/assignment", "LoadAssignment", "reason", latched=True),
    Topic("fused", "/kaitian/fused", "FusedOutput", "status"),
    Topic("telemetry", "/kaitian/telemetry", "NodeTelemetry", "node_id"),
    Topic("profiles", "/kaitian/profiles", "CostProfile", "node_id", latched=True),
    Topic("chunks", "/kaitian/chunks/compute_0", "TensorChunk", "producer"),
)
# published last in every round, on a topic every role may publish: its arrival proves the
# round's earlier messages were sent on the same link before it
MARKER = Topic("marker", "/security_test/marker", "String", "data")
TOPICS = {t.name: t for t in (*PROTECTED, MARKER)}

pytestmark = pytest.mark.skipif(not certs.openssl_available(), reason="needs the openssl command")


def _openssl(*args: str) -> str:
    result = subprocess.run(["openssl", *args], capture_output=True, check=False, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The graph's certificates, made by the command a user types."""
    directory = tmp_path_factory.mktemp("certs")
    result = run_cli("certs", "create", str(directory), "--host", "robot.local", "--host", "10.1.2.3")
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture(scope="module")
def other_ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates with the same role names from a different CA."""
    directory = tmp_path_factory.mktemp("other_ca")
    certs.create(directory)
    return directory


# --- certificates -------------------------------------------------------------------------------

@pytest.mark.e2e
def test_certs_create_makes_a_ca_and_one_certificate_per_role(cert_dir: Path) -> None:
    names = {p.name for p in cert_dir.iterdir()}
    assert names == {"ca.pem", "ca.key"} | {f"{r}.{e}" for r in security.ROLES for e in ("pem", "key")}
    for key in cert_dir.glob("*.key"):
        assert key.stat().st_mode & 0o777 == 0o600, key
    assert "CA:TRUE" in _openssl("x509", "-in", str(cert_dir / "ca.pem"), "-noout", "-ext", "basicConstraints")
    for role in security.ROLES:
        pem = str(cert_dir / f"{role}.pem")
        assert _openssl("verify", "-CAfile", str(cert_dir / "ca.pem"), pem).strip() == f"{pem}: OK"
        subject = _openssl("x509", "-in", pem, "-noout", "-subject", "-nameopt", "RFC2253").strip()
        assert subject == f"subject=CN={role}"
        ext = _openssl("x509", "-in", pem, "-noout", "-ext", "subjectAltName,extendedKeyUsage,basicConstraints")
        for san in ("DNS:localhost", "IP Address:127.0.0.1", "DNS:robot.local", "IP Address:10.1.2.3"):
            assert san in ext, ext
        assert "TLS Web Server Authentication" in ext and "TLS Web Client Authentication" in ext
        assert "CA:FALSE" in ext
        # the key is the certificate's
        key_pub = _openssl("pkey", "-in", str(cert_dir / f"{role}.key"), "-pubout")
        assert _openssl("x509", "-in", pem, "-noout", "-pubkey") == key_pub


@pytest.mark.e2e
def test_certs_create_refuses_to_overwrite_and_bad_arguments(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    assert run_cli("certs", "create", str(directory)).returncode == 0
    before = (directory / "ca.pem").read_bytes()
    again = run_cli("certs", "create", str(directory))
    assert again.returncode != 0
    assert len(again.stderr.strip().splitlines()) == 1 and "--force" in again.stderr, again.stderr
    assert (directory / "ca.pem").read_bytes() == before
    forced = run_cli("certs", "create", str(directory), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (directory / "ca.pem").read_bytes() != before
    for args in (["--host", "not a host"], ["--days", "0"]):
        bad = run_cli("certs", "create", str(tmp_path / "d"), *args)
        assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert not (tmp_path / "d" / "ca.key").exists()


# --- settings (no processes) ------------------------------------------------------------------

@pytest.mark.e2e
def test_cert_dir_check_names_what_is_missing(cert_dir: Path, tmp_path: Path) -> None:
    assert security.check_cert_dir(cert_dir) == cert_dir.resolve()
    (tmp_path / "ca.pem").write_bytes((cert_dir / "ca.pem").read_bytes())
    (tmp_path / "node.pem").write_text("not a certificate")
    with pytest.raises(security.SecurityError) as err:
        security.check_cert_dir(tmp_path)
    message = str(err.value)
    assert "\n" not in message
    for name in ("coordinator.pem", "coordinator.key", "scheduler.pem", "compute.pem", "compute.key",
                 "node.pem (not PEM)", "node.key"):
        assert name in message
    assert "ca.pem" not in message.split("lacks")[1].split("(create")[0]
    with pytest.raises(security.SecurityError, match="not a directory"):
        security.check_cert_dir(tmp_path / "nowhere")


@pytest.mark.e2e
def test_environment_and_endpoints(cert_dir: Path) -> None:
    assert security.from_env({}) is None
    assert security.from_env({security.ENV_DIR: str(cert_dir)}) == security.Security(cert_dir.resolve(), "node")
    chosen = security.from_env({security.ENV_DIR: str(cert_dir), security.ENV_ROLE: "scheduler"})
    assert chosen is not None and chosen.key == cert_dir.resolve() / "scheduler.key"
    with pytest.raises(security.SecurityError, match="KAITIAN_SECURITY_ROLE"):
        security.from_env({security.ENV_DIR: str(cert_dir), security.ENV_ROLE: "admin"})
    assert security.secure_endpoint("tcp/127.0.0.1:7447") == "tls/127.0.0.1:7447"
    assert security.secure_endpoint("tls/[::1]:0") == "tls/[::1]:0"
    with pytest.raises(security.SecurityError):
        security.secure_endpoint("udp/127.0.0.1:7447")
    executables = ("coordinator", "scheduler", "compute", "image_source", "monitor", "trainer", "router")
    assert [security.role_for_executable(e) for e in executables] == \
        ["coordinator", "scheduler", "compute", "node", "node", "node", "node"]
    chosen = security.from_env({security.ENV_DIR: str(cert_dir), security.ENV_ROLE: "compute"})
    assert chosen is not None and chosen.cert == cert_dir.resolve() / "compute.pem"


def test_protected_topics_are_the_ones_the_product_nodes_publish() -> None:
    """Least privilege: each protected topic's owners are the executables that publish it, and
    what the other processes publish (trainers, the bench's layer-wise workers: role node) is
    not protected, so a secure graph keeps working."""
    from kaitian_ros.bench import inference_graph
    from kaitian_ros.nodes import protocol as proto
    from kaitian_ros.nodes import trainer

    assert security.PROTECTED_TOPICS == {
        "/kaitian/plan": ("coordinator",), "/kaitian/assignment": ("scheduler",),
        "/kaitian/fused": ("coordinator", "compute"), "/kaitian/telemetry": ("compute",),
        "/kaitian/profiles": ("compute",), "/kaitian/chunks/**": ("coordinator", "compute")}
    owners = {proto.PLAN_TOPIC: ("coordinator",), proto.ASSIGNMENT_TOPIC: ("scheduler",),
              proto.FUSED_TOPIC: ("coordinator", "compute"),  # compute: on the direct path
              proto.TELEMETRY_TOPIC: ("compute",), proto.PROFILES_TOPIC: ("compute",),
              proto.chunk_topic("compute_7"): ("coordinator", "compute"),
              proto.chunk_topic(proto.COORDINATOR): ("coordinator", "compute")}
    for topic, expected in owners.items():
        assert security.owners_of(topic) == expected, topic
    for topic in (trainer.TELEMETRY_TOPIC, inference_graph.LW_TELEMETRY, inference_graph.lw_topic("w0"),
                  "/camera/image_raw", "/diagnostics", "/kaitian/chunksmith", "/kaitian/planner"):
        assert security.owners_of(topic) is None, topic
    assert {t.topic for t in PROTECTED if security.owners_of(t.topic) is None} == set()  # the test covers them all
    assert security.publish_refusal(proto.TELEMETRY_TOPIC, "compute") == ""
    refusal = security.publish_refusal(proto.TELEMETRY_TOPIC, "node")
    assert "\n" not in refusal and "only compute may publish" in refusal and "KAITIAN_SECURITY_ROLE" in refusal


def test_access_control_rules_deny_publishing_protected_topics_to_other_roles() -> None:
    acl = security.access_control_config()
    assert acl["enabled"] and acl["default_permission"] == "deny"
    rules = {r["id"]: r for r in acl["rules"]}
    denied = {}  # key expression -> roles that may not publish there
    for policy in acl["policies"]:
        for rule_id in policy["rules"]:
            rule = rules[rule_id]
            if rule["permission"] == "deny":
                assert rule["flows"] == ["ingress"]
                assert set(rule["messages"]) == {"put", "delete", "declare_queryable", "reply"}
                for key in rule["key_exprs"]:
                    denied[key] = set(policy["subjects"])
    assert denied == {
        "*/kaitian/plan/**": {"scheduler", "compute", "node"},
        "*/kaitian/assignment/**": {"coordinator", "compute", "node"},
        "*/kaitian/fused/**": {"scheduler", "node"},
        "*/kaitian/telemetry/**": {"coordinator", "scheduler", "node"},
        "*/kaitian/profiles/**": {"coordinator", "scheduler", "node"},
        "*/kaitian/chunks/**": {"scheduler", "node"},
    }
    assert {s["id"]: s["cert_common_names"] for s in acl["subjects"]} == {r: [r] for r in security.ROLES}
    members = [p for p in acl["policies"] if p["rules"] == ["allow_all"]]
    assert [p["subjects"] for p in members] == [list(security.ROLES)]
    for owners in ((), ("admin",), "compute"):
        with pytest.raises(security.SecurityError, match="/x"):
            security.access_control_config({"/x": owners})


def test_sros2_policy_denies_the_same_topics_as_the_embedded_rules() -> None:
    """The ROS 2 path's policy (docs/security.md) says what the embedded rules say: an enclave
    per role, and every enclave but the owner's is denied publishing a protected topic. Only
    checked as a file here: sros2 is not installable from PyPI."""
    import xml.etree.ElementTree as ET

    root = ET.parse(REPO / "config" / "kaitian_sros2.policy.xml").getroot()  # noqa: S314 - our own file
    assert root.tag == "policy" and root.get("version") == "0.2.0"
    enclaves = [e.get("path") for e in root.iter("enclave")]
    assert enclaves == [f"/kaitian/{role}" for role in security.ROLES]
    denied: dict[str, set[str]] = {}
    for enclave in root.iter("enclave"):
        role = enclave.get("path").removeprefix("/kaitian/")
        for topics in enclave.iter("topics"):
            if topics.get("publish") == "DENY":
                for topic in topics.iter("topic"):
                    denied.setdefault(topic.text, set()).add(role)
            else:
                assert [t.text for t in topics.iter("topic")] == ["/*"] and topics.get("subscribe") == "ALLOW"
    # a DDS topic expression's "*" matches across "/": /kaitian/chunks/* is every chunk topic
    expected = {topic.removesuffix("*"): set(security.ROLES) - set(owners)
                for topic, owners in security.PROTECTED_TOPICS.items()}
    assert denied == expected


@pytest.mark.e2e
def test_scenario_security_key_and_launch_argument(tmp_path: Path, cert_dir: Path) -> None:
    base = REPO / "config" / "camera_demo.yaml"
    assert load_scenario(str(base)).security == ""
    (tmp_path / "graph").mkdir()
    scenario = tmp_path / "graph" / "secure_demo.yaml"
    scenario.write_text("/**:\n  ros__parameters:\n    security: ../certs\n" + base.read_text())
    assert load_scenario(str(scenario)).security == str((tmp_path / "certs").resolve())
    assert load_scenario(str(scenario), [f"security:={cert_dir}"]).security == str(cert_dir.resolve())
    assert load_scenario(str(scenario), ["security:=''"]).security == ""
    with pytest.raises(ScenarioError, match="certificate directory"):
        load_scenario(str(base), ["security:=[1,2]"])


@pytest.mark.e2e
def test_launch_with_an_unusable_cert_dir_stops_before_any_process(tmp_path: Path, cert_dir: Path) -> None:
    (tmp_path / "ca.pem").write_bytes((cert_dir / "ca.pem").read_bytes())
    for args in (["--secure", str(tmp_path / "missing")], [f"security:={tmp_path}"]):
        result = run_cli("launch", "camera_demo", *args, "--no-view", "--duration", "5")
        assert result.returncode == 2, result.stdout + result.stderr
        assert "[launch] started" not in result.stdout
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kaitian launch camera_demo: security: "), result.stderr
    assert "coordinator.key" in lines[0] and "kaitian certs create" in lines[0]


@pytest.mark.e2e
def test_launch_with_a_cert_dir_from_before_the_compute_role_names_the_missing_files(
        tmp_path: Path, cert_dir: Path) -> None:
    """A directory made when there were three roles lacks compute.*: one line naming them and
    how to recreate the directory."""
    for path in cert_dir.iterdir():
        if not path.name.startswith("compute."):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    result = run_cli("launch", "camera_demo", "--secure", str(tmp_path), "--no-view", "--duration", "5")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[launch] started" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines == [(f"kaitian launch camera_demo: security: {tmp_path.resolve()} lacks or cannot read "
                      f"compute.pem, compute.key "
                      f"(create them with `kaitian certs create {tmp_path.resolve()} --force`)")]


# --- a secure graph of small processes ----------------------------------------------------------

def _plain_env(router: str) -> dict[str, str]:
    env = child_env(router)
    env.pop(security.ENV_DIR, None)
    env.pop(security.ENV_ROLE, None)
    return env


def _secure_env(router: str, cert_dir: Path, role: str) -> dict[str, str]:
    return child_env(router, KAITIAN_SECURITY=str(cert_dir), KAITIAN_SECURITY_ROLE=role)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kaitian_ros.cli", *args], env=env, capture_output=True, check=False,
                          text=True, timeout=60, cwd=str(REPO))


def _script(*args: str, env: dict[str, str]) -> Proc:
    return Proc([sys.executable, "-u", str(Path(__file__).resolve()), *args], env)


def _received(sub: Proc) -> list[dict[str, Any]]:
    return [json.loads(m.string) for m in sub.find(r'^\{"topic"')]


def _labels(sub: Proc, topic: str) -> list[str]:
    return [r["label"] for r in _received(sub) if r["topic"] == topic]


@pytest.fixture(scope="module")
def secure_graph(cert_dir: Path, other_ca_dir: Path):
    """A router (``kaitian router`` under KAITIAN_SECURITY), one publisher per role, outsiders
    that keep trying to join and inject, and a subscriber started last (a late joiner, so it
    also asks the latched publishers for their last plan/assignment)."""
    endpoint = f"tcp/127.0.0.1:{free_port()}"
    procs: list[Proc] = []
    try:
        router = Proc([sys.executable, "-u", "-m", "kaitian_ros.cli", "router", "--listen", endpoint],
                      _secure_env(endpoint, cert_dir, "node"))
        procs.append(router)
        router.wait_for(r"router listening on tls/127\.0\.0\.1:\d+ \(TLS \+ access control, role node\)")
        publishers = {role: _script("publisher", role, env=_secure_env(endpoint, cert_dir, role))
                      for role in PUBLISHER_ROLES}
        procs += publishers.values()
        outsiders = {v: _script("outsider", v, str(cert_dir), str(other_ca_dir),
                                env=_plain_env(endpoint)) for v in OUTSIDERS}
        procs += outsiders.values()
        for p in [*publishers.values(), *outsiders.values()]:
            p.ready()
        subscriber = _script("subscriber", env=_secure_env(endpoint, cert_dir, "node"))
        procs.append(subscriber)
        subscriber.ready()
        yield endpoint, publishers, outsiders, subscriber
    finally:
        _stop_all(procs)


def _stop_all(procs: list[Proc]) -> None:
    """SIGINT to all at once, then each is reaped (killed if it does not end)."""
    for p in procs:
        if p.alive():
            p.p.send_signal(signal.SIGINT)
    for p in procs:
        p.stop()


def _marker_index(sub: Proc, role: str) -> int:
    indices = [int(label.split(":")[1]) for label in _labels(sub, "marker") if label.startswith(role + ":")]
    return max(indices, default=-1)


def _roles_of(labels: list[str]) -> set[str]:
    return {label.split(":")[0] for label in labels}


@pytest.mark.e2e
@pytest.mark.parametrize("topic", [t.name for t in PROTECTED])
def test_only_the_owner_roles_publish_a_protected_topic(secure_graph, topic: str) -> None:
    """E.g. telemetry and chunks of a ``node`` holder (camera, tools) never arrive while a
    ``compute`` holder's do; a plan only arrives from the coordinator."""
    _, publishers, _, sub = secure_graph
    owners = set(security.owners_of(TOPICS[topic].topic) or ())
    # every publisher's marker gets through: each role's session is a member of the graph
    wait_until(lambda: all(_marker_index(sub, r) >= 5 for r in PUBLISHER_ROLES),
               f"markers from every role\n{sub.output()}")
    # A publisher puts each protected topic's message i, then marker i, on one link, in order:
    # its marker 5 arrived, so its messages 1..5 on every topic would have arrived if allowed
    # (and the owners' did: the wait below only guards against a slow subscriber callback)
    wait_until(lambda: _roles_of(_labels(sub, topic)) >= owners, f"{topic} from {sorted(owners)}\n{sub.output()}")
    assert _roles_of(_labels(sub, topic)) == owners, _labels(sub, topic)  # the wildcard puts' labels too
    for role in PUBLISHER_ROLES:
        assert publishers[role].alive(), publishers[role].output()


@pytest.mark.e2e
def test_a_publisher_of_a_topic_its_role_may_not_publish_is_warned(secure_graph) -> None:
    """The graph drops a non-owner's messages silently, so a node started by hand with the wrong
    KAITIAN_SECURITY_ROLE says so in its log (one warning per protected publisher it creates)."""
    _, publishers, _, _ = secure_graph
    for role, proc in publishers.items():
        warned = {m.group(1) for m in proc.find(r"security: (\S+) is published with role " + role + ",")}
        expected = {t.topic for t in PROTECTED if role not in (security.owners_of(t.topic) or ())}
        assert warned == expected, proc.output()


@pytest.mark.e2e
def test_latched_caches_answer_only_from_the_owner(secure_graph) -> None:
    """Every publisher has a latched cache (a queryable) on plan, assignment and profiles holding
    its sample 0; asked after all publishers' links are up, only the owners' caches answer: the
    others' queryable declarations and replies are refused like their puts."""
    _, _, _, sub = secure_graph
    answers = json.loads(sub.wait_for(r'^\{"latched"')[0].string)["latched"]
    assert answers == {"plan": ["coordinator:0"], "assignment": ["scheduler:0"], "profiles": ["compute:0"]}
    # the subscriptions' own late-joiner queries got the same
    wait_until(lambda: all(f"{owner}:0" in _labels(sub, name)
                           for name, owner in (("plan", "coordinator"), ("assignment", "scheduler"),
                                               ("profiles", "compute"))),
               f"the owners' latched samples\n{sub.output()}")


@pytest.mark.e2e
@pytest.mark.parametrize("variant", OUTSIDERS)
def test_outsiders_can_neither_join_nor_receive_nor_inject(secure_graph, variant: str) -> None:
    _, _, outsiders, sub = secure_graph
    outsider = outsiders[variant]
    # it has been trying (connecting and putting forged plans and telemetry) ...
    tries = outsider.wait_for(r'^\{"tried"', count=20)
    # ... while the graph kept delivering to the subscriber
    start = _marker_index(sub, "node")
    wait_until(lambda: _marker_index(sub, "node") >= start + 5, "markers while the outsiders try")
    last = json.loads(outsider.find(r'^\{"tried"')[-1].string)["tried"]
    assert last["routers"] == 0 and last["peers"] == 0, tries[-1].string   # never joined
    assert last["received"] == 0, last                                    # no data in
    assert not [r for r in _received(sub) if r["label"].startswith("outsider")]  # no data out


@pytest.mark.e2e
def test_cli_tools_need_the_certificate(secure_graph, cert_dir: Path) -> None:
    endpoint, _, _, _ = secure_graph
    listed = _cli("--router", endpoint, "node", "list", env=_secure_env(endpoint, cert_dir, "node"))
    assert listed.returncode == 0, listed.stderr
    assert {f"/pub_{role}" for role in PUBLISHER_ROLES} | {"/sub"} <= set(listed.stdout.split())
    params = _cli("--router", endpoint, "param", "list", "/sub", env=_secure_env(endpoint, cert_dir, "node"))
    assert (params.returncode, params.stdout.strip()) == (0, "/sub:"), params.stderr  # parameter queries pass
    refused = _cli("--router", endpoint, "node", "list", env=_plain_env(endpoint))  # no KAITIAN_SECURITY
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"cannot reach a router at {endpoint}"), refused.stderr


# --- a secure hetero_inference graph ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.e2e
def test_secure_hetero_inference_delivers_fused_results(cert_dir: Path) -> None:
    """Every process presents its role (compute nodes ``compute``): chunks, telemetry and
    profiles get through, so complete results arrive, and no process is told it publishes a
    topic its role may not."""
    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import NodeArgs

    endpoint = f"tcp/127.0.0.1:{free_port()}"
    # a smaller input than the file's 224x224: what is checked is who may publish, not the model
    launch = Proc([sys.executable, "-u", "-m", "kaitian_ros.cli", "--router", endpoint, "launch", "hetero_inference",
                   "compute_nodes:=2", "input_height:=128", "input_width:=128", "num_classes:=10", "--secure",
                   str(cert_dir), "--no-view"], _plain_env(endpoint))
    rt, spinner = None, None
    try:
        launch.wait_for(r"\[launch\] security on: TLS \+ access control")
        launch.wait_for(r"\] router listening on tls/")  # [launch] (in-process router) or [router] (child)
        launch.wait_for(r"\[launch\] started compute_1")
        rt = EmbeddedRuntime(NodeArgs("fused_probe"), router=endpoint, domain=0,
                             security=security.Security(cert_dir, "node"))
        fused: list[Any] = []
        rt.create_subscription("/kaitian/fused", "FusedOutput", fused.append)
        spinner = threading.Thread(target=rt.spin, daemon=True)
        spinner.start()
        wait_until(lambda: any(m.complete for m in fused), f"a complete /kaitian/fused\n{launch.output()}",
                   timeout_s=90)
        assert launch.alive(), launch.output()
        assert "Traceback" not in launch.output(), launch.output()
        assert "which the graph drops" not in launch.output(), launch.output()
    finally:
        if rt is not None:
            rt.shutdown()
            if spinner is not None:
                spinner.join(timeout=5.0)
            rt.close()
        launch.stop()
    assert pids_with_env("KAITIAN_ROUTER", endpoint) == [], launch.output()


# --- child processes ----------------------------------------------------------------------------

def _child_runtime(name: str) -> Any:
    import signal

    from kaitian_ros.runtime.embedded import EmbeddedRuntime
    from kaitian_ros.runtime.node_args import NodeArgs

    rt = EmbeddedRuntime(NodeArgs(name), domain=0)  # security from KAITIAN_SECURITY(_ROLE)
    signal.signal(signal.SIGINT, lambda *_: rt.shutdown())
    signal.signal(signal.SIGTERM, lambda *_: rt.shutdown())
    return rt


def _wildcard_keys() -> list[tuple[str, Topic]]:
    """Wildcard key expressions that intersect protected keys without being included in the
    access rules' (zs.is_concrete_key): zenoh delivers puts on them, the subscribers must drop
    them. The last is included in ``*/kaitian/chunks/**``, so the rules themselves refuse it."""
    from kaitian_ros.runtime import zenoh_session as zs

    def type_and_hash(t: Topic) -> str:
        return "/".join(zs.topic_key(0, t.topic, t.msg_type).split("/")[-2:])

    plan, telemetry, chunks = TOPICS["plan"], TOPICS["telemetry"], TOPICS["chunks"]
    return [(f"0/kaitian/*/{type_and_hash(plan)}", plan), (f"0/*/plan/{type_and_hash(plan)}", plan),
            (f"*/*/assignment/{type_and_hash(plan)}", plan),
            (f"0/*/telemetry/{type_and_hash(telemetry)}", telemetry),
            (f"0/*/chunks/compute_0/{type_and_hash(chunks)}", chunks),
            (f"0/kaitian/chunks/*/{type_and_hash(chunks)}", chunks)]


def _child_publisher(role: str) -> None:
    """Labelled messages: ``ROLE:0`` once on LATCHED plan/assignment/profiles publishers (a late
    joiner can only get it from their caches), then every 0.1 s ``ROLE:i`` on plain publishers of
    every protected topic followed by marker ``ROLE:i``, in that order, on one session."""
    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime import zenoh_session as zs
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime(f"pub_{role}")
    for t in PROTECTED:
        if t.latched:
            rt.create_publisher(t.topic, t.msg_type, QoS.LATCHED).publish(t.make(f"{role}:0"))
    live = [(t, rt.create_publisher(t.topic, t.msg_type, QoS.RELIABLE)) for t in PROTECTED]
    marker = rt.create_publisher(MARKER.topic, MARKER.msg_type, QoS.RELIABLE)
    wild = _wildcard_keys() if role == security.NODE else []
    count = {"i": 0}

    def tick() -> None:
        count["i"] += 1
        i = count["i"]
        for t, pub in live:
            pub.publish(t.make(f"{role}:{i}"))
        for key, t in wild:
            payload = bytes(interfaces.encode(t.make(f"{role}-wildcard:{i}"), t.msg_type))
            rt.session.put(key, payload, congestion_control=zs.CongestionControl.BLOCK)
        marker.publish(MARKER.make(f"{role}:{i}"))

    rt.create_timer(0.1, tick)
    _say({"ready": role})
    rt.spin()
    rt.close()


def _child_subscriber() -> None:
    """Prints every labelled message that reaches it; once markers of every role have arrived
    (so every publisher's earlier declarations, its latched caches' queryables among them,
    would have too), asks the latched caches itself and prints who answered."""
    import threading

    import zenoh

    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime import zenoh_session as zs
    from kaitian_ros.runtime.api import QoS

    rt = _child_runtime("sub")
    seen: set[str] = set()
    all_seen = threading.Event()

    def show(t: Topic, msg: Any) -> None:
        label = t.label(msg)
        _say({"topic": t.name, "label": label})
        if t is MARKER:
            seen.add(label.split(":")[0])
            if seen >= set(PUBLISHER_ROLES):
                all_seen.set()

    # the marker's subscription last: declarations travel in order, so a publisher that knows
    # it knows the others and sends each round's protected messages to this session too
    for t in (*PROTECTED, MARKER):
        rt.create_subscription(t.topic, t.msg_type, lambda m, t=t: show(t, m),
                               QoS.LATCHED if t.latched else QoS.RELIABLE)

    def ask_caches() -> None:
        all_seen.wait()
        answers = {}
        for t in PROTECTED:
            if t.latched:
                replies = rt.session.get(zs.topic_key(0, t.topic, t.msg_type),
                                         consolidation=zenoh.ConsolidationMode.NONE, timeout=10.0)
                answers[t.name] = sorted(t.label(interfaces.decode(r.ok.payload.to_bytes(), t.msg_type))
                                         for r in replies if r.ok is not None)
        _say({"latched": answers})

    threading.Thread(target=ask_caches, daemon=True).start()
    _say({"ready": "sub"})
    rt.spin()
    rt.close()


def _child_outsider(variant: str, cert_dir: str, other_ca_dir: str) -> None:
    """A session outside the graph, configured with plain zenoh so it stays up and keeps
    retrying (the package's sessions exit when they cannot connect): ``tcp`` has no TLS,
    ``tls_no_cert`` trusts the graph's CA but has no certificate, ``other_ca`` presents a
    coordinator certificate of another CA. It puts forged plans and telemetry and counts what
    it receives, and prints what it has done every 0.1 s."""
    import signal

    import zenoh

    from kaitian_ros.runtime import interfaces
    from kaitian_ros.runtime import zenoh_session as zs

    router = os.environ["KAITIAN_ROUTER"]
    config = zenoh.Config()
    config.insert_json5("mode", '"peer"')
    config.insert_json5("scouting/multicast/enabled", "false")
    config.insert_json5("listen/endpoints", '["tcp/127.0.0.1:0"]')
    connect = router if variant == "tcp" else security.secure_endpoint(router)
    config.insert_json5("connect/endpoints", json.dumps([connect]))
    config.insert_json5("connect/exit_on_failure", "false")
    tls: dict[str, Any] = {"root_ca_certificate": str(Path(cert_dir) / "ca.pem")}
    if variant == "other_ca":
        other = Path(other_ca_dir)
        tls.update(connect_certificate=str(other / "coordinator.pem"),
                   connect_private_key=str(other / "coordinator.key"))
    if variant != "tcp":
        config.insert_json5("transport/link/tls", json.dumps(tls))
    session = zenoh.open(config)
    received = {"n": 0}

    def count(sample: Any) -> None:  # what the graph sends it (its own puts reach it locally)
        if b"outsider-" not in sample.payload.to_bytes():
            received["n"] += 1

    subscriber = session.declare_subscriber("**", count)
    plan_key = zs.topic_key(0, TOPICS["plan"].topic, "LoadAssignment")
    telemetry_key = zs.topic_key(0, TOPICS["telemetry"].topic, "NodeTelemetry")
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("now", True))
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    _say({"ready": variant})
    i = 0
    while not stop["now"]:
        i += 1
        forged_plan = interfaces.make("LoadAssignment", version=10_000 + i, reason=f"outsider-{variant}:{i}")
        session.put(plan_key, bytes(interfaces.encode(forged_plan, "LoadAssignment")))
        forged_telemetry = interfaces.make("NodeTelemetry", node_id=f"outsider-{variant}:{i}")
        session.put(telemetry_key, bytes(interfaces.encode(forged_telemetry, "NodeTelemetry")))
        _say({"tried": {"puts": i, "received": received["n"],
                        "routers": len(list(session.info.routers_zid())),
                        "peers": len(list(session.info.peers_zid()))}})
        time.sleep(0.1)  # the outsider's pace of attempts (it runs until stopped), not a wait
    subscriber.undeclare()
    session.close()


if __name__ == "__main__":
    kind, rest = sys.argv[1], sys.argv[2:]
    if kind == "publisher":
        _child_publisher(rest[0])
    elif kind == "subscriber":
        _child_subscriber()
    elif kind == "outsider":
        _child_outsider(*rest)
    else:
        raise SystemExit(f"unknown child {kind}")
