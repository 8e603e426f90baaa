"""Scenario files: one YAML per scenario in ROS 2 parameter-file form, read by both launchers.

Each top-level key is a node name with ``ros__parameters``; the extra parameter ``executable``
names the node program (ROS nodes ignore parameters they do not declare, so the same file is
passed to them unchanged). Three more extra keys are launch settings, named as launch_ros names
them: ``respawn`` (restart the node when it exits), ``respawn_delay`` (seconds before a restart)
and ``respawn_max_retries`` (restarts allowed over the launch's life). By default compute nodes,
the coordinator and the scheduler respawn (1 s delay, 5 restarts), the others do not. Launch
arguments ``name:=value`` override parameters:

- ``param:=value`` sets ``param`` in every node that has it in the file,
- ``node.param:=value`` sets it in one node,
- ``compute_nodes:=N`` keeps/clones ``compute_*`` nodes to exactly N (clones copy the last one),
- ``ranks:=N`` does the same for ``trainer_*`` nodes and renumbers ``rank``/``world_size``,
- ``slowdowns:=[1.0,2.0,...]`` sets ``emulated_slowdown`` of the compute nodes in order,
- ``respawn:=false`` (``respawn_delay``, ``respawn_max_retries``) sets a launch setting of every
  node, ``node.respawn:=false`` of one.

One launch setting is for the whole graph: ``security``, a certificate directory (made by
``kaitian certs create``) that runs the embedded graph on TLS with access control
(docs/security.md). It lives in the file's ``/**`` section, which ROS 2 reads as parameters of
every node (nodes ignore it: none declares it), so the file stays a valid parameter file::

    /**:
      ros__parameters:
        security: certs        # relative to this file's directory

``security:=DIR`` (relative to the current directory) overrides it, ``security:=''`` turns it off.

Three more whole-graph settings say where the graph's router is, for a graph that spans hosts
(docs/deployment.md), with the meaning of ``kaitian launch``'s flags of the same names, which
override them: ``router`` (the endpoint this launch hosts the router on), ``connect`` (host
none, join the router at that endpoint) and ``listen`` (this host's address the nodes listen
on). ``connect`` and ``router`` exclude each other. Like ``security`` they may also be given as
``router:=...`` launch arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kaitian_ros.runtime.interfaces import find_share_file
from kaitian_ros.runtime.node_args import parse_value

EXECUTABLES = ("image_source", "compute", "coordinator", "scheduler", "trainer", "monitor", "perception_example")
RESPAWNED_BY_DEFAULT = ("compute", "coordinator", "scheduler")
RESPAWN_KEYS = ("respawn", "respawn_delay", "respawn_max_retries")
ALL_NODES = ("/**", "**")  # the parameter-file sections that apply to every node
SECURITY_KEY = "security"
ROUTER_KEYS = ("router", "connect", "listen")  # where the graph's router is: see the module docstring
GRAPH_KEYS = (SECURITY_KEY, *ROUTER_KEYS)  # whole-graph launch settings: never a node's parameter
COMPUTE_RESPAWN_DELAY_S = 0.2


@dataclass(frozen=True)
class Respawn:
    """What a launcher does when the node's process exits while the graph runs."""

    enabled: bool = False
    delay_s: float = 1.0
    max_retries: int = 5

    @staticmethod
    def default_for(executable: str) -> Respawn:
        # a missing compute node costs every frame until it is back (the plan runs on the
        # slower rest), and its restart is cheap from a warm interpreter; the retry cap, not
        # the delay, is what stops a node that fails at start-up
        return Respawn(enabled=executable in RESPAWNED_BY_DEFAULT,
                       delay_s=COMPUTE_RESPAWN_DELAY_S if executable == "compute" else 1.0)

    def with_setting(self, key: str, value: Any, where: str) -> Respawn:
        """This policy with one ``RESPAWN_KEYS`` setting changed (ScenarioError if invalid)."""
        if key == "respawn":
            if not isinstance(value, bool):
                raise ScenarioError(f"{where}: respawn must be true or false, got {value!r}")
            return Respawn(value, self.delay_s, self.max_retries)
        if key == "respawn_delay":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 3600.0:
                raise ScenarioError(f"{where}: respawn_delay must be seconds in [0, 3600], got {value!r}")
            return Respawn(self.enabled, float(value), self.max_retries)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
            raise ScenarioError(f"{where}: respawn_max_retries must be an integer in [0, 1000000], got {value!r}")
        return Respawn(self.enabled, self.delay_s, value)


_COMPUTE = re.compile(r"^compute_(\d+)$")


class ScenarioError(ValueError):
    """A scenario that cannot be loaded or an override that does not apply."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    executable: str
    parameters: dict[str, Any] = field(default_factory=dict)
    respawn: Respawn = Respawn()


@dataclass(frozen=True)
class Scenario:
    name: str
    path: Path
    nodes: tuple[NodeSpec, ...]
    overrides: tuple[tuple[str, Any], ...] = ()
    security: str = ""  # absolute certificate directory for TLS + access control; '' = off
    router: str = ""  # zenoh endpoint to host the graph's router on ('' = the default)
    connect: str = ""  # zenoh endpoint of another host's router to join instead ('' = host one)
    listen: str = ""  # this host's address the nodes listen on ('' = loopback)

    def node(self, name: str) -> NodeSpec:
        for spec in self.nodes:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def compute_nodes(self) -> tuple[NodeSpec, ...]:
        return tuple(n for n in self.nodes if n.executable == "compute")

    def parameter_file_dict(self) -> dict[str, Any]:
        """The resolved graph in ROS 2 parameter-file form (what nodes receive)."""
        return {n.name: {"ros__parameters": {"executable": n.executable} | n.parameters} for n in self.nodes}


def scenario_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    try:
        return find_share_file("config", f"{name_or_path}.yaml")
    except FileNotFoundError:
        raise ScenarioError(f"unknown scenario '{name_or_path}' (give a name from config/ or a .yaml path; "
                            f"available: {', '.join(available_scenarios()) or 'none'})") from None


def available_scenarios() -> list[str]:
    from kaitian_ros.runtime.interfaces import share_dirs

    names: set[str] = set()
    for base in share_dirs():
        names.update(p.stem for p in (base / "config").glob("*.yaml"))
    return sorted(names)


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    out = []
    for arg in args:
        if ":=" not in arg:
            raise ScenarioError(f"launch arguments look like name:=value, got '{arg}'")
        key, value = arg.split(":=", 1)
        if not key:
            raise ScenarioError(f"empty launch argument name in '{arg}'")
        out.append((key, parse_value(value)))
    return out


def load_scenario(name_or_path: str, overrides: Sequence[tuple[str, Any]] | Sequence[str] = ()) -> Scenario:
    path = scenario_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not a text file (byte {exc.start} is not UTF-8); a scenario is "
                            f"YAML in ROS 2 parameter-file form") from None
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict) or not data:
        raise ScenarioError(f"{path}: expected a mapping of node names to ros__parameters")
    nodes: list[NodeSpec] = []
    security = ""
    where: dict[str, str] = {}  # ROUTER_KEYS
    for name, section in data.items():
        if name in ALL_NODES:
            params = section.get("ros__parameters") if isinstance(section, dict) else None
            if isinstance(params, dict):
                if SECURITY_KEY in params:
                    security = _security_dir(params[SECURITY_KEY], path.parent, f"{path}: {name} {SECURITY_KEY}")
                where |= {key: _router_setting(key, params[key], f"{path}: {name} {key}")
                          for key in ROUTER_KEYS if key in params}
            continue
        if not isinstance(section, dict) or not isinstance(section.get("ros__parameters"), dict):
            raise ScenarioError(f"{path}: node '{name}' has no ros__parameters mapping")
        params = dict(section["ros__parameters"])
        executable = params.pop("executable", None)
        if executable not in EXECUTABLES:
            raise ScenarioError(f"{path}: node '{name}' needs 'executable' in {list(EXECUTABLES)}, got {executable!r}")
        respawn = Respawn.default_for(executable)
        for key in RESPAWN_KEYS:
            if key in params:
                respawn = respawn.with_setting(key, params.pop(key), f"{path}: node '{name}'")
        nodes.append(NodeSpec(name, executable, params, respawn))
    pairs: list[tuple[str, Any]] = []
    for item in overrides:  # "key:=value" strings (a command line) or (key, value) pairs
        if isinstance(item, str):
            pairs += parse_overrides([item])
        else:
            key, value = item
            pairs.append((key, value))
    for key, value in pairs:
        if key == SECURITY_KEY:
            security = _security_dir(value, Path.cwd(), f"{SECURITY_KEY}:=")
        elif key in ROUTER_KEYS:
            where[key] = _router_setting(key, value, f"{key}:=")
    if where.get("router") and where.get("connect"):
        raise ScenarioError(f"{path}: router (host the graph's router here) and connect (join the router on "
                            f"another host) exclude each other")
    nodes = apply_overrides(nodes, [(k, v) for k, v in pairs if k not in GRAPH_KEYS])
    return Scenario(path.stem, path, tuple(nodes), tuple(pairs), security, **where)


def _router_setting(key: str, value: Any, where: str) -> str:
    """A ROUTER_KEYS value: a string ('' or an empty launch argument = unset); ScenarioError otherwise."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: {key} must be a zenoh endpoint or address string, got {value!r}")
    return value.strip()


def select_nodes(scenario: Scenario, only: Sequence[str] = (), exclude: Sequence[str] = ()) -> Scenario:
    """The part of ``scenario`` that runs on this host: the ``only`` nodes (all when empty)
    minus the ``exclude`` ones. Parameters stay those of the whole graph (the coordinator
    still lists every compute node, wherever it runs). ScenarioError for an unknown name or
    an empty selection."""
    names = [n.name for n in scenario.nodes]
    unknown = [name for name in (*only, *exclude) if name not in names]
    if unknown:
        raise ScenarioError(f"{scenario.name} has no node {', '.join(repr(u) for u in unknown)} "
                            f"(its nodes: {', '.join(names)})")
    kept = tuple(n for n in scenario.nodes if (not only or n.name in only) and n.name not in exclude)
    if not kept:
        raise ScenarioError(f"no node of {scenario.name} left to run here (--only/--exclude select none)")
    return dataclasses.replace(scenario, nodes=kept)


def _security_dir(value: Any, base: Path, where: str) -> str:
    """The absolute certificate directory a ``security`` setting names ('' = off). Whether it
    holds usable certificates is checked by the launcher, before it starts anything."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ScenarioError(f"{where} must be a certificate directory (a path), got {value!r}")
    text = str(value)
    if "\0" in text:
        raise ScenarioError(f"{where}: a path cannot contain a NUL character")
    return str((base / Path(text).expanduser()).resolve())


def apply_overrides(nodes: list[NodeSpec], overrides: Sequence[tuple[str, Any]]) -> list[NodeSpec]:
    nodes = [NodeSpec(n.name, n.executable, copy.deepcopy(n.parameters), n.respawn) for n in nodes]
    for key, value in overrides:
        node_name, _, setting = key.rpartition(".")
        if setting in RESPAWN_KEYS and (not node_name or node_name in {n.name for n in nodes}):
            nodes = [dataclasses.replace(n, respawn=n.respawn.with_setting(setting, value, f"{key}:="))
                     if node_name in ("", n.name) else n for n in nodes]
        elif key == "compute_nodes":
            nodes = _resize(nodes, "compute", "compute_nodes", value)
        elif key == "ranks":
            nodes = _resize(nodes, "trainer", "ranks", value)
            trainers = [n for n in nodes if n.executable == "trainer"]
            for rank, spec in enumerate(trainers):
                spec.parameters["rank"] = rank
                spec.parameters["world_size"] = len(trainers)
        elif key == "slowdowns":
            computes = [n for n in nodes if n.executable == "compute"]
            if not isinstance(value, list) or len(value) != len(computes):
                raise ScenarioError(f"slowdowns:= needs a list of {len(computes)} numbers (one per compute node)")
            for spec, slowdown in zip(computes, value):
                spec.parameters["emulated_slowdown"] = float(slowdown)
        elif "." in key and key.split(".", 1)[0] in {n.name for n in nodes}:
            node_name, param = key.split(".", 1)
            next(n for n in nodes if n.name == node_name).parameters[param] = value
        else:
            # the nodes whose file sets it, else those whose executable declares it (weights:=PATH)
            hits = [n for n in nodes if key in n.parameters] or \
                [n for n in nodes if key in declared_parameters(n.executable)]
            if not hits:
                raise ScenarioError(f"launch argument '{key}' matches no parameter of any node "
                                    f"(use node.param:=value to add one to a node)")
            for spec in hits:
                spec.parameters[key] = value
    _sync_compute_lists(nodes)
    return nodes


def declared_parameters(executable: str) -> frozenset[str]:
    """Names of the parameters a node executable declares: from its `<executable>_params`
    module where it has one (the coordinator and the compute node, whose own modules import
    torch: seconds of CPU in the launcher for a `name:=value` not in the scenario's file), else
    from the node module."""
    import importlib
    import importlib.util

    name = f"kaitian_ros.nodes.{executable}"
    module = importlib.import_module(name + "_params" if importlib.util.find_spec(name + "_params") else name)
    return frozenset(d.name for d in module.PARAMETERS)


def _resize(nodes: list[NodeSpec], executable: str, argument: str, count: Any) -> list[NodeSpec]:
    """Keep the first ``count`` nodes of one executable, cloning the last as ``<executable>_<i>``."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 64:
        raise ScenarioError(f"{argument}:= must be an integer in [1, 64], got {count!r}")
    group = [n for n in nodes if n.executable == executable]
    if not group:
        raise ScenarioError(f"{argument}:= given but the scenario has no {executable} node")
    others = [n for n in nodes if n.executable != executable]
    template = group[-1]
    resized = group[:count]
    for index in range(len(resized), count):
        resized.append(NodeSpec(f"{executable}_{index}", executable, copy.deepcopy(template.parameters),
                                template.respawn))
    first = nodes.index(group[0])
    before = [n for n in others if nodes.index(n) < first]
    after = [n for n in others if nodes.index(n) > first]
    return before + resized + after


def _sync_compute_lists(nodes: list[NodeSpec]) -> None:
    """Coordinator/scheduler list the compute nodes; keep those lists equal to the graph's."""
    names = [n.name for n in nodes if n.executable == "compute"]
    for spec in nodes:
        if "compute_nodes" in spec.parameters and spec.executable != "compute":
            spec.parameters["compute_nodes"] = list(names)
        if spec.executable in ("coordinator", "scheduler") and "static_shares" in spec.parameters:
            shares = spec.parameters["static_shares"]
            if isinstance(shares, list) and len(shares) != len(names):
                spec.parameters["static_shares"] = [1.0] * len(names)
