"""Shared body of the ``launch/*.launch.py`` files (``ros2 launch kaitian_ros ...``).

The node graph comes from the same scenario YAML as ``kaitian launch``
(:func:`kaitian_ros.scenario.load_scenario`), so both launchers start the same nodes with the
same parameters. Split in two:

- a pure part (no ROS needed, unit-tested): :func:`node_kwargs` turns a Scenario into one
  keyword dict per ``launch_ros.actions.Node``, and :func:`overrides_from_values` keeps only the
  launch arguments the user actually set;
- a thin ROS part: :func:`generate_nodes` builds the ``Node`` actions (launch_ros imported
  lazily), :func:`launch_description` the whole LaunchDescription with one
  ``DeclareLaunchArgument`` per override and an ``OpaqueFunction`` that resolves them at launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kaitian_ros.scenario import Scenario, load_scenario

PACKAGE = "kaitian_ros"

# Launch arguments of the collaborative inference scenarios (all optional; unset = the YAML's value).
_INFERENCE_ARGUMENTS = {
    "compute_nodes": "number of compute nodes (compute_0..compute_{N-1}); clones the last one",
    "model": "model of the trunk/head split (a reference model name or module:callable)",
    "input_height": "input image height fed to the model (pixels)",
    "input_width": "input image width fed to the model (pixels)",
    "policy": "share policy: adaptive | static | equal | profile_once",
    "slowdowns": "EMULATED slowdown per compute node, e.g. [1.0,3.0]",
}

# Launch arguments each scenario understands (all optional; unset = the YAML's value).
LAUNCH_ARGUMENTS: dict[str, dict[str, str]] = {
    "hetero_inference": dict(_INFERENCE_ARGUMENTS),
    "robot_edge": _INFERENCE_ARGUMENTS | {
        "strategy": "plan strategy: auto (fastest predicted) | single | layerwise | stripes",
    },
    "hetero_training": {
        "ranks": "number of training ranks (one process per device)",
        "policy": "batch split policy: adaptive | static | equal | profile_once",
    },
    "digits_demo": {
        "weights": "state_dict file of the trained digits_cnn (kaitian train --save-weights PATH)",
        "strategy": "plan strategy: auto (fastest predicted) | single | layerwise | stripes",
        "policy": "share policy: adaptive | static | equal | profile_once",
        "slowdowns": "EMULATED slowdown per compute node, e.g. [1.0,3.0]",
        "rate_hz": "digit frames published per second",
    },
    "camera_demo": {
        "source": "'synthetic', a video file, or a folder of images",
        "rate_hz": "frames published per second",
    },
}


def overrides_from_values(values: Mapping[str, str | None], names: Iterable[str]) -> list[str]:
    """``name:=value`` for each launch argument the user set (an empty string means unset)."""
    out = []
    for name in names:
        value = values.get(name)
        if value is not None and str(value).strip() != "":
            out.append(f"{name}:={str(value).strip()}")
    return out


def launch_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """A node's resolved parameters as launch_ros accepts them.

    Empty lists are left out (the node keeps its declared default): launch_ros cannot infer the
    element type of an empty sequence and rcl's YAML parser refuses empty arrays.
    """
    return {k: v for k, v in params.items() if not (isinstance(v, (list, tuple)) and len(v) == 0)}


def node_kwargs(scenario: Scenario, *, runtime: str = "ros") -> list[dict[str, Any]]:
    """One ``launch_ros.actions.Node(**kwargs)`` dict per node of the scenario, in graph order."""
    return [{
        "package": PACKAGE,
        "executable": spec.executable,
        "name": spec.name,
        "parameters": [launch_parameters(spec.parameters)],
        "output": "screen",
        "additional_env": {"KAITIAN_RUNTIME": runtime},
        "respawn": spec.respawn.enabled,
        "respawn_delay": spec.respawn.delay_s,
        "respawn_max_retries": spec.respawn.max_retries,
    } for spec in scenario.nodes]


def _has_respawn_max_retries() -> bool:
    """Whether this launch takes ``respawn_max_retries`` (Jazzy and later)."""
    try:
        import inspect

        from launch.actions import ExecuteProcess

        return "respawn_max_retries" in inspect.signature(ExecuteProcess.__init__).parameters
    except (ImportError, TypeError, ValueError):
        return False


def generate_nodes(scenario_name: str, overrides: Sequence[str] | Sequence[tuple[str, Any]] = ()) -> list:
    """``launch_ros.actions.Node`` actions for a scenario (a config/ name or a .yaml path)."""
    from launch_ros.actions import Node

    scenario = load_scenario(scenario_name, overrides)
    unsupported = () if _has_respawn_max_retries() else ("respawn_max_retries",)
    return [Node(**{k: v for k, v in kwargs.items() if k not in unsupported}) for kwargs in node_kwargs(scenario)]


def launch_description(scenario_name: str) -> Any:
    """LaunchDescription: the scenario's launch arguments + an OpaqueFunction building the nodes."""
    from launch.actions import DeclareLaunchArgument, OpaqueFunction
    from launch.substitutions import LaunchConfiguration

    from launch import LaunchDescription

    arguments = LAUNCH_ARGUMENTS.get(scenario_name, {})

    def build(context: Any, *args: Any, **kwargs: Any) -> list:
        values = {name: LaunchConfiguration(name).perform(context) for name in arguments}
        return generate_nodes(scenario_name, overrides_from_values(values, arguments))

    declared = [DeclareLaunchArgument(name, default_value="", description=f"{help_text} "
                                      f"(empty: the value in config/{scenario_name}.yaml)")
                for name, help_text in arguments.items()]
    return LaunchDescription(declared + [OpaqueFunction(function=build)])
