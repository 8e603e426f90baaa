"""The ROS 2 launch files and their shared builder (kaitian_ros/ros_launch.py), without ROS.

launch / launch_ros cannot be installed here, so: every launch file must compile and define
generate_launch_description; the pure part (Scenario -> Node keyword dicts, which launch
arguments count as overrides) is checked directly; and the launch wiring is exercised against
FakeLaunch, a test double of the few launch/launch_ros classes used. None of this proves that
``ros2 launch`` runs on a real ROS 2 installation.
"""

from __future__ import annotations

import ast
import py_compile
import runpy
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kaitian_ros import ros_launch
from kaitian_ros.scenario import ScenarioError, load_scenario

REPO = Path(__file__).resolve().parents[1]
LAUNCH_FILES = sorted((REPO / "launch").glob("*.launch.py"))


def test_the_launch_files_exist() -> None:
    names = {p.name for p in LAUNCH_FILES}
    assert {"hetero_inference.launch.py", "camera_demo.launch.py", "hetero_training.launch.py",
            "robot_edge.launch.py", "digits_demo.launch.py"} <= names


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_file_compiles_and_names_an_existing_scenario(path: Path, tmp_path: Path) -> None:
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)
    tree = ast.parse(path.read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "generate_launch_description" in functions
    scenario = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                    and n.targets[0].id == "SCENARIO")
    assert path.name == f"{scenario}.launch.py"
    assert (REPO / "config" / f"{scenario}.yaml").exists(), f"config/{scenario}.yaml missing"
    assert scenario in ros_launch.LAUNCH_ARGUMENTS


def test_every_node_executable_is_installed_by_every_build() -> None:
    """A launch file names an executable that ``ros2 run``/launch_ros finds through CMake's
    install(PROGRAMS scripts/...), pip through setup.py's NODES, and ``kaitian launch`` through
    scenario.EXECUTABLES: one list each, so they must agree."""
    from kaitian_ros.scenario import EXECUTABLES

    setup_nodes = ast.literal_eval(next(
        n.value for n in ast.parse((REPO / "setup.py").read_text()).body
        if isinstance(n, ast.Assign) and n.targets[0].id == "NODES"))
    cmake = (REPO / "CMakeLists.txt").read_text()
    programs = cmake[cmake.index("install(PROGRAMS"):].split(")", 1)[0].split()
    scripts = {p.name for p in (REPO / "scripts").iterdir()} - {"kaitian"}
    assert set(setup_nodes) == set(EXECUTABLES) == scripts
    assert {f"scripts/{name}" for name in scripts} | {"scripts/kaitian"} == \
        {p for p in programs if p.startswith("scripts/")}
    for name in scripts:
        assert f"from kaitian_ros.nodes.{name} import main" in (REPO / "scripts" / name).read_text()
        assert "def main(" in (REPO / "kaitian_ros" / "nodes" / f"{name}.py").read_text()


def test_hetero_inference_with_three_compute_nodes() -> None:
    if not (REPO / "config" / "hetero_inference.yaml").exists():
        pytest.skip("config/hetero_inference.yaml not written yet")
    kwargs = ros_launch.node_kwargs(load_scenario("hetero_inference", ["compute_nodes:=3"]))
    by_name = {k["name"]: k for k in kwargs}
    assert set(by_name) == {"image_source", "coordinator", "scheduler", "compute_0", "compute_1", "compute_2"}
    assert {n: k["executable"] for n, k in by_name.items()} == {
        "image_source": "image_source", "coordinator": "coordinator", "scheduler": "scheduler",
        "compute_0": "compute", "compute_1": "compute", "compute_2": "compute"}
    for k in kwargs:
        assert k["package"] == "kaitian_ros" and k["output"] == "screen"
        assert k["additional_env"] == {"KAITIAN_RUNTIME": "ros"}
        (params,) = k["parameters"]
        assert "executable" not in params
    # launch_ros respawns what `kaitian launch` respawns: the compute nodes, coordinator, scheduler
    assert {n: k["respawn"] for n, k in by_name.items()} == {
        "image_source": False, "coordinator": True, "scheduler": True,
        "compute_0": True, "compute_1": True, "compute_2": True}
    # a compute node's absence costs every frame: it is back sooner than the authorities
    assert {n: k["respawn_delay"] for n, k in by_name.items() if k["respawn"]} == {
        "coordinator": 1.0, "scheduler": 1.0, "compute_0": 0.2, "compute_1": 0.2, "compute_2": 0.2}
    assert all(k["respawn_max_retries"] == 5 for k in kwargs)
    computes = ["compute_0", "compute_1", "compute_2"]
    assert by_name["coordinator"]["parameters"][0]["compute_nodes"] == computes
    assert by_name["scheduler"]["parameters"][0]["compute_nodes"] == computes


def test_hetero_inference_overrides_resize_and_retune() -> None:
    if not (REPO / "config" / "hetero_inference.yaml").exists():
        pytest.skip("config/hetero_inference.yaml not written yet")
    kwargs = ros_launch.node_kwargs(load_scenario(
        "hetero_inference", ["compute_nodes:=2", "slowdowns:=[1.0,4.0]", "policy:=equal"]))
    by_name = {k["name"]: k["parameters"][0] for k in kwargs}
    assert [n for n in by_name if n.startswith("compute_")] == ["compute_0", "compute_1"]
    assert [by_name[n]["emulated_slowdown"] for n in ("compute_0", "compute_1")] == [1.0, 4.0]
    assert by_name["scheduler"]["policy"] == "equal"
    assert by_name["coordinator"]["compute_nodes"] == ["compute_0", "compute_1"]
    with pytest.raises(ScenarioError):
        load_scenario("hetero_inference", ["compute_nodes:=0"])


def test_robot_edge_local_slow_processor_and_edge_device() -> None:
    kwargs = ros_launch.node_kwargs(load_scenario("robot_edge"))
    by_name = {k["name"]: k["parameters"][0] for k in kwargs}
    assert {k["name"]: k["executable"] for k in kwargs} == {
        "image_source": "image_source", "coordinator": "coordinator", "scheduler": "scheduler",
        "compute_0": "compute", "compute_1": "compute"}
    assert [by_name[n]["emulated_slowdown"] for n in ("compute_0", "compute_1")] == [4.0, 1.0]
    assert by_name["coordinator"]["strategy"] == "auto" and by_name["coordinator"]["use_scheduler"] is True
    assert by_name["coordinator"]["compute_nodes"] == by_name["scheduler"]["compute_nodes"] == ["compute_0",
                                                                                              "compute_1"]
    assert by_name["scheduler"]["policy"] == "adaptive"
    models = {p["model"] for p in by_name.values() if "model" in p}
    assert models == {"resnet18"}


def test_robot_edge_overrides_strategy_and_slowdowns() -> None:
    kwargs = ros_launch.node_kwargs(load_scenario(
        "robot_edge", ["strategy:=stripes", "slowdowns:=[3.0,1.0]", "model:=mobilenet_v2"]))
    by_name = {k["name"]: k["parameters"][0] for k in kwargs}
    assert by_name["coordinator"]["strategy"] == "stripes"
    assert "strategy" not in by_name["compute_0"]  # only the coordinator plans
    assert [by_name[n]["emulated_slowdown"] for n in ("compute_0", "compute_1")] == [3.0, 1.0]
    assert {by_name[n]["model"] for n in ("coordinator", "compute_0", "compute_1")} == {"mobilenet_v2"}


def test_digits_demo_serves_trained_weights_on_two_nodes() -> None:
    """The camera renders the held-out digits at a size the coordinator resizes to the model's 8x8
    mono input; every inference node loads the same weights file (weights:=PATH replaces it)."""
    kwargs = ros_launch.node_kwargs(load_scenario("digits_demo", ["weights:=/models/d.pt", "rate_hz:=2.0"]))
    by_name = {k["name"]: k["parameters"][0] for k in kwargs}
    assert {k["name"]: k["executable"] for k in kwargs} == {
        "image_source": "image_source", "coordinator": "coordinator", "scheduler": "scheduler",
        "compute_0": "compute", "compute_1": "compute"}
    camera = by_name["image_source"]
    assert camera["source"] == "digits" and camera["rate_hz"] == 2.0
    assert camera["width"] % 8 == 0 and camera["height"] % 8 == 0
    inference = ("coordinator", "compute_0", "compute_1")
    assert {by_name[n]["weights"] for n in inference} == {"/models/d.pt"}
    assert {(by_name[n]["model"], by_name[n]["input_channels"], by_name[n]["input_height"],
             by_name[n]["input_width"], by_name[n]["normalise"]) for n in inference} == {("digits_cnn", 1, 8, 8, True)}
    assert [by_name[n]["emulated_slowdown"] for n in ("compute_0", "compute_1")] == [1.0, 3.0]
    assert by_name["coordinator"]["strategy"] == "stripes"
    assert by_name["coordinator"]["labels"][7] == "seven" and len(by_name["coordinator"]["labels"]) == 10
    assert load_scenario("digits_demo").node("compute_0").parameters["weights"] == "digits_cnn.pt"


def test_camera_demo_nodes() -> None:
    kwargs = ros_launch.node_kwargs(load_scenario("camera_demo", ["rate_hz:=30.0"]))
    assert [(k["name"], k["executable"]) for k in kwargs] == [("image_source", "image_source"),
                                                              ("monitor", "monitor")]
    assert kwargs[0]["parameters"][0]["rate_hz"] == 30.0
    assert kwargs[1]["parameters"][0]["input_topic"] == "/camera/image_raw"


def test_tmp_scenario_drops_empty_lists_and_keeps_order(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "src:\n  ros__parameters:\n    executable: image_source\n    rate_hz: 2.0\n"
        "coordinator:\n  ros__parameters:\n    executable: coordinator\n    compute_nodes: [compute_0]\n"
        "    static_shares: []\n    model: resnet18\n    topics: []\n"
        "compute_0:\n  ros__parameters:\n    executable: compute\n    emulated_slowdown: 1.0\n")
    kwargs = ros_launch.node_kwargs(load_scenario(str(path), ["compute_nodes:=3", "model:=tiny_cnn"]))
    assert [k["name"] for k in kwargs] == ["src", "coordinator", "compute_0", "compute_1", "compute_2"]
    coordinator = kwargs[1]["parameters"][0]
    assert "topics" not in coordinator  # empty list: left to the node's default
    assert coordinator["static_shares"] == [1.0, 1.0, 1.0]  # resized with the compute nodes
    assert all(v != [] for k in kwargs for v in k["parameters"][0].values())
    assert coordinator["model"] == "tiny_cnn"
    assert coordinator["compute_nodes"] == ["compute_0", "compute_1", "compute_2"]


def test_respawn_settings_from_defaults_file_and_launch_arguments(tmp_path: Path) -> None:
    path = tmp_path / "respawn.yaml"
    path.write_text(
        "src:\n  ros__parameters:\n    executable: image_source\n    respawn: true\n    respawn_delay: 0.5\n"
        "coordinator:\n  ros__parameters:\n    executable: coordinator\n    compute_nodes: [compute_0]\n"
        "compute_0:\n  ros__parameters:\n    executable: compute\n    respawn_max_retries: 2\n")
    scenario = load_scenario(str(path))
    got = {n.name: (n.respawn.enabled, n.respawn.delay_s, n.respawn.max_retries) for n in scenario.nodes}
    assert got == {"src": (True, 0.5, 5), "coordinator": (True, 1.0, 5), "compute_0": (True, 0.2, 2)}
    # launch settings, not node parameters: nodes never see them
    assert all(not set(n.parameters) & {"respawn", "respawn_delay", "respawn_max_retries"} for n in scenario.nodes)
    assert all(not set(sec["ros__parameters"]) & {"respawn"} for sec in scenario.parameter_file_dict().values())
    off = load_scenario(str(path), ["respawn:=false", "compute_0.respawn_delay:=2.5", "compute_nodes:=2"])
    assert {n.name: (n.respawn.enabled, n.respawn.delay_s) for n in off.nodes} == {
        "src": (False, 0.5), "coordinator": (False, 1.0), "compute_0": (False, 2.5), "compute_1": (False, 2.5)}
    defaults = load_scenario("hetero_inference")
    assert {n.name for n in defaults.nodes if n.respawn.enabled} == {
        "coordinator", "scheduler", "compute_0", "compute_1", "compute_2"}
    for bad, words in (("respawn:=maybe", "respawn must be true or false"),
                       ("respawn_max_retries:=-1", "respawn_max_retries"),
                       ("compute_0.respawn_delay:=1e9", "respawn_delay")):
        with pytest.raises(ScenarioError, match=words):
            load_scenario(str(path), [bad])


def test_a_declared_parameter_not_in_the_file_is_a_launch_argument() -> None:
    """weights:=PATH reaches every node that declares `weights` (coordinator, compute nodes),
    though the scenario file does not list it; an unknown name is still refused."""
    scenario = load_scenario("hetero_inference", ["weights:=/models/resnet18.pt"])
    got = {n.name for n in scenario.nodes if n.parameters.get("weights") == "/models/resnet18.pt"}
    assert got == {"coordinator", "compute_0", "compute_1", "compute_2"}
    with pytest.raises(ScenarioError, match="matches no parameter"):
        load_scenario("hetero_inference", ["no_such_parameter:=1"])


def test_only_user_set_arguments_become_overrides() -> None:
    names = ["compute_nodes", "model", "policy", "slowdowns"]
    values = {"compute_nodes": "3", "model": "", "policy": "  ", "slowdowns": "[1.0, 2.0, 3.0]"}
    assert ros_launch.overrides_from_values(values, names) == ["compute_nodes:=3",
                                                              "slowdowns:=[1.0, 2.0, 3.0]"]
    assert ros_launch.overrides_from_values({}, names) == []


# --- launch wiring against a test double ----------------------------------------------------

class FakeLaunch:
    """Test double: the launch / launch_ros names ros_launch.py uses, recording what it builds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class Node:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs

        class DeclareLaunchArgument:
            def __init__(self, name: str, default_value: str = "", description: str = "") -> None:
                self.name, self.default_value, self.description = name, default_value, description

        class OpaqueFunction:
            def __init__(self, function: Any) -> None:
                self.function = function

        class LaunchConfiguration:
            def __init__(self, name: str) -> None:
                self.name = name

            def perform(self, context: dict[str, str]) -> str:
                return context.get(self.name, "")

        class LaunchDescription:
            def __init__(self, entities: list) -> None:
                self.entities = entities

        def mod(name: str, **attrs: Any) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, m)
            return m

        mod("launch", LaunchDescription=LaunchDescription)
        mod("launch.actions", DeclareLaunchArgument=DeclareLaunchArgument, OpaqueFunction=OpaqueFunction)
        mod("launch.substitutions", LaunchConfiguration=LaunchConfiguration)
        mod("launch_ros")
        mod("launch_ros.actions", Node=Node)
        fake.Node = Node


def _run_launch_file(path: Path, context: dict[str, str]) -> tuple[list, list]:
    namespace = runpy.run_path(str(path), run_name="launch_file")
    description = namespace["generate_launch_description"]()
    declared = [e for e in description.entities if hasattr(e, "default_value")]
    (opaque,) = [e for e in description.entities if hasattr(e, "function")]
    return declared, opaque.function(context)


def test_launch_file_builds_nodes_from_launch_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeLaunch(monkeypatch)
    declared, nodes = _run_launch_file(REPO / "launch" / "camera_demo.launch.py", {"rate_hz": "25.0"})
    assert {d.name for d in declared} == {"source", "rate_hz"}
    assert all(d.default_value == "" for d in declared)
    assert [n.kwargs["name"] for n in nodes] == ["image_source", "monitor"]
    assert nodes[0].kwargs["parameters"][0]["rate_hz"] == 25.0
    assert nodes[0].kwargs["parameters"][0]["source"] == "synthetic"  # unset: the file's value


def test_hetero_inference_launch_file_with_compute_nodes_3(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (REPO / "config" / "hetero_inference.yaml").exists():
        pytest.skip("config/hetero_inference.yaml not written yet")
    FakeLaunch(monkeypatch)
    declared, nodes = _run_launch_file(REPO / "launch" / "hetero_inference.launch.py",
                                       {"compute_nodes": "3", "policy": "static"})
    assert {d.name for d in declared} == {"compute_nodes", "model", "input_height", "input_width",
                                          "policy", "slowdowns"}
    assert [n.kwargs["name"] for n in nodes if n.kwargs["executable"] == "compute"] == [
        "compute_0", "compute_1", "compute_2"]
    scheduler = next(n for n in nodes if n.kwargs["name"] == "scheduler")
    assert scheduler.kwargs["parameters"][0]["policy"] == "static"


def test_robot_edge_launch_file_declares_the_inference_arguments_and_strategy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeLaunch(monkeypatch)
    declared, nodes = _run_launch_file(REPO / "launch" / "robot_edge.launch.py", {"strategy": "layerwise"})
    assert {d.name for d in declared} == {"compute_nodes", "model", "input_height", "input_width",
                                          "policy", "slowdowns", "strategy"}
    assert [n.kwargs["name"] for n in nodes if n.kwargs["executable"] == "compute"] == ["compute_0", "compute_1"]
    coordinator = next(n for n in nodes if n.kwargs["name"] == "coordinator")
    assert coordinator.kwargs["parameters"][0]["strategy"] == "layerwise"


def test_digits_demo_launch_file_takes_weights_and_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeLaunch(monkeypatch)
    declared, nodes = _run_launch_file(REPO / "launch" / "digits_demo.launch.py",
                                       {"weights": "/models/d.pt", "strategy": "auto"})
    assert {d.name for d in declared} == {"weights", "strategy", "policy", "slowdowns", "rate_hz"}
    params = {n.kwargs["name"]: n.kwargs["parameters"][0] for n in nodes}
    assert params["coordinator"]["strategy"] == "auto"
    assert {params[n]["weights"] for n in ("coordinator", "compute_0", "compute_1")} == {"/models/d.pt"}
    assert params["image_source"]["source"] == "digits"


def test_where_the_router_is_can_be_a_scenario_setting_and_never_reaches_a_node(tmp_path) -> None:
    path = tmp_path / "two_hosts.yaml"
    path.write_text("/**:\n  ros__parameters:\n    connect: tcp/10.0.0.1:7447\n    listen: 10.0.0.2\n"
                    "coordinator:\n  ros__parameters:\n    executable: coordinator\n    compute_nodes: [compute_0]\n"
                    "compute_0:\n  ros__parameters:\n    executable: compute\n")
    scenario = load_scenario(str(path))
    assert (scenario.router, scenario.connect, scenario.listen) == ("", "tcp/10.0.0.1:7447", "10.0.0.2")
    assert all(not set(n.parameters) & {"router", "connect", "listen"} for n in scenario.nodes)
    hosting = load_scenario(str(path), ["connect:=", "router:=tcp/0.0.0.0:7447"])
    assert (hosting.router, hosting.connect) == ("tcp/0.0.0.0:7447", "")
    with pytest.raises(ScenarioError, match="exclude each other"):
        load_scenario(str(path), ["router:=tcp/0.0.0.0:7447"])
    with pytest.raises(ScenarioError, match="connect must be"):
        load_scenario(str(path), ["connect:=7447"])
