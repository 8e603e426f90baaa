"""ROS 2 style node command-line arguments, so both runtimes start nodes the same way.

Accepted (the subset launch_ros passes): ``--ros-args``, ``-r __node:=NAME``, ``-r __ns:=/NS``,
``-r from:=to`` (topic remapping), ``--params-file FILE``, ``-p name:=value``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class NodeArgsError(ValueError):
    """A malformed node command line or parameter file."""


@dataclass(frozen=True)
class NodeArgs:
    node_name: str
    namespace: str = "/"
    remaps: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)  # overrides, files then -p in order

    @property
    def fqn(self) -> str:
        return (self.namespace.rstrip("/") + "/" + self.node_name) if self.namespace != "/" else "/" + self.node_name


def parse_value(text: str) -> Any:
    """``-p`` values are YAML, as in ROS 2 (``3.0`` is a double, ``[1, 2]`` an integer array)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parameters_from_file(path: str | Path, node_name: str, namespace: str = "/") -> dict[str, Any]:
    """Parameters for one node from a ROS 2 parameter file (``/**`` wildcard, plain or full names)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise NodeArgsError(f"cannot read parameter file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise NodeArgsError(f"parameter file {path} is not a mapping of node names")
    fqn = (namespace.rstrip("/") + "/" + node_name) if namespace != "/" else "/" + node_name
    out: dict[str, Any] = {}
    # wildcard first so that a node's own section wins
    for key in ("/**", "**", node_name, fqn.lstrip("/"), fqn):
        section = data.get(key)
        if isinstance(section, dict):
            out.update(flatten_parameters(section.get("ros__parameters", {}) or {}))
    return out


def flatten_parameters(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameter dicts become dotted names, as ROS 2 does."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_parameters(value, name + "."))
        else:
            out[name] = value
    return out


def parse_node_args(argv: Sequence[str], default_name: str) -> NodeArgs:
    """Parse ROS-style arguments; anything outside ``--ros-args`` is ignored like rclpy does."""
    argv = list(argv)
    name, namespace = default_name, "/"
    remaps: dict[str, str] = {}
    files: list[str] = []
    inline: list[tuple[str, Any]] = []
    in_ros = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--ros-args":
            in_ros = True
        elif arg == "--":
            in_ros = False
        elif in_ros and arg in ("-r", "--remap", "-p", "--param", "--params-file"):
            if i + 1 >= len(argv):
                raise NodeArgsError(f"{arg} needs a value")
            value = argv[i + 1]
            i += 1
            if arg == "--params-file":
                files.append(value)
            elif ":=" not in value:
                raise NodeArgsError(f"{arg} expects name:=value, got {value!r}")
            else:
                key, val = value.split(":=", 1)
                if arg in ("-p", "--param"):
                    inline.append((key, parse_value(val)))
                elif key == "__node" or key == "__name":
                    name = val
                elif key == "__ns":
                    namespace = val if val.startswith("/") else "/" + val
                else:
                    remaps[key] = val
        i += 1
    params: dict[str, Any] = {}
    for path in files:
        params.update(parameters_from_file(path, name, namespace))
    params.update(dict(inline))
    return NodeArgs(node_name=name, namespace=namespace, remaps=remaps, parameters=params)


def resolve_topic(topic: str, namespace: str, node_name: str, remaps: dict[str, str]) -> str:
    """Fully qualified topic name after remapping (ROS name resolution, ``~`` = node's private ns)."""
    for candidate in (topic, topic.lstrip("/")):
        if candidate in remaps:
            topic = remaps[candidate]
            break
    if topic.startswith("~"):
        base = (namespace.rstrip("/") + "/" + node_name)
        topic = base + topic[1:]
    elif not topic.startswith("/"):
        topic = namespace.rstrip("/") + "/" + topic
    if "//" in topic or topic.endswith("/") or not topic[1:]:
        raise NodeArgsError(f"invalid topic name {topic!r}")
    return topic
