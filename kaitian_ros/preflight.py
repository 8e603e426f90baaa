"""The checks ``kaitian launch`` makes before it starts anything (docs/architecture.md): every
inference model can be built (a user model's import path, its weights file) and every compute
node's ``device`` exists on this host; a problem is one line, not a node dying at start.

The checks need torch (and may import a user's model module and load its weights). `kaitian
launch` runs them in a fork of its fork server (`forked_preflight`, this module's ``main``),
which has imported torch already, so the launching process itself never imports it: about
1.2 s of CPU and of start-up less here. Without a fork server they run in-process."""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kaitian_ros.scenario import Scenario

if TYPE_CHECKING:
    from kaitian_ros.fork_server import ForkServer


def forked_preflight(scenario: Scenario, server: ForkServer | None, env: Mapping[str, str]) -> str:
    """`preflight(scenario)` in a fork of `server` (in this process when there is none, or
    when the fork cannot run the checks)."""
    if server is not None:
        from kaitian_ros.fork_server import PREFLIGHT

        nodes = [[n.name, n.executable, dict(n.parameters)] for n in scenario.nodes]
        child = server.fork(PREFLIGHT, [json.dumps(nodes)], env, "preflight")
        if child is not None and child.stdout is not None:
            out = child.stdout.read()  # until the child's end (as the in-process checks, no time limit)
            if child.wait() == 0:
                return out.strip()
    return preflight(scenario)


def main(argv: Sequence[str]) -> int:
    """In a fork of the fork server: print `preflight`'s answer for the nodes in ``argv[0]``
    (JSON ``[[name, executable, parameters], ...]``)."""
    from kaitian_ros.scenario import NodeSpec

    nodes = tuple(NodeSpec(name, executable, params) for name, executable, params in json.loads(argv[0]))
    print(preflight(Scenario("preflight", Path("."), nodes)), flush=True)
    return 0


def preflight(scenario: Scenario) -> str:
    """'' if every node's ``model`` and ``device`` can be used on this machine, else one line
    saying which cannot and which nodes name it: checked before any process starts, so a typo
    is one clear error instead of every node refusing to start (the launcher starts all nodes
    on this host, so this host's devices are the ones that count)."""
    problems: dict[str, list[str]] = {}
    for spec in scenario.nodes:
        checks = [("model", _model_problem)]
        if spec.executable == "compute":  # trainers name devices their own way (cpu:<tag>)
            checks.append(("device", _device_problem))
        found = [problem for key, check in checks
                 if isinstance(value := spec.parameters.get(key), str) and (problem := check(value))]
        if not found and spec.executable in ("coordinator", "compute"):
            found = _inference_model_problems(spec.parameters)
        for problem in found:
            problems.setdefault(problem, []).append(spec.name)
    return "; ".join(f"{problem} (node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)})"
                     for problem, nodes in problems.items())


def _inference_model_problems(params: Mapping[str, Any]) -> list[str]:
    """A weights file that does not load into the model, labels that do not fit its classes."""
    from kaitian_ros.nodes import inference_common as ic
    from kaitian_ros.nodes.model_params import MODEL_PARAMETERS

    defaults = {p.name: p.default for p in MODEL_PARAMETERS}

    def get(key: str) -> Any:
        return params.get(key, defaults.get(key))

    out = []
    if params.get("labels") or params.get("labels_file"):
        try:
            ic.load_labels(params.get("labels") or [], params.get("labels_file") or "", int(get("num_classes")))
        except (ValueError, TypeError) as exc:
            out.append(str(exc))
    if get("weights"):
        out += _weights_problem(str(get("model")), str(get("weights")), int(get("num_classes")),
                                int(get("input_channels")))
    return out


_WEIGHTS_CHECKED: dict[tuple, list[str]] = {}  # every compute node names the same file: load it once


def _weights_problem(model: str, weights: str, num_classes: int, in_channels: int) -> list[str]:
    key = (model, weights, num_classes, in_channels)
    if key not in _WEIGHTS_CHECKED:
        from kaitian_ros.core.models import build_model

        try:
            build_model(model, num_classes=num_classes, in_channels=in_channels, state_dict_path=weights)
            _WEIGHTS_CHECKED[key] = []
        except FileNotFoundError:
            hint = "kaitian train --save-weights PATH writes one"
            _WEIGHTS_CHECKED[key] = [f"weights file {weights!r} does not exist ({hint})"]
        except Exception as exc:  # noqa: BLE001 - torch.load/load_state_dict raise many kinds; all mean unusable
            first = " ".join(str(exc).split())[:300]
            _WEIGHTS_CHECKED[key] = [(f"weights {weights!r} do not load into model {model!r} "
                                      f"({num_classes} classes, {in_channels} input channels): {first}")]
    return _WEIGHTS_CHECKED[key]


def _model_problem(name: str) -> str:
    from kaitian_ros.core.models import MODEL_NAMES

    if name in MODEL_NAMES:
        return ""
    if ":" not in name:
        return (f"unknown model '{name}' (valid: {', '.join(MODEL_NAMES)}, or a 'package.module:callable' "
                f"import path)")
    module, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        return f"model '{name}': cannot import {module!r}: {' '.join(str(exc).split())}"
    for part in attr.split("."):
        if not hasattr(obj, part):
            return f"model '{name}': module {module!r} has no attribute {attr!r}"
        obj = getattr(obj, part)
    return "" if callable(obj) else f"model '{name}' is not callable"


def _device_problem(name: str) -> str:
    from kaitian_ros.nodes.inference_common import check_device

    try:
        check_device(name)
    except ValueError as exc:
        return " ".join(str(exc).split())
    return ""
