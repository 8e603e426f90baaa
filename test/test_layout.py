"""The house rules that the code itself can be checked for (docs/architecture.md): layers point
down only (launchers and benchmarks -> nodes -> runtime -> core), core is pure computation
(no middleware, threads, sockets or processes), and no module grows past MAX_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kaitian_ros"
MAX_LINES = 500
# what core must not import: it is pure torch/numpy, called by the layers above
NOT_IN_CORE = {"zenoh", "rclpy", "threading", "socket", "subprocess", "multiprocessing", "asyncio", "signal"}
# the layers above each of these, which it must not import (package-relative module names)
ABOVE = {
    "core": {"nodes", "runtime", "bench", "training", "launcher", "cli", "cli_graph", "live_view", "fork_server",
             "warm_start", "ros_launch", "processes"},
    "runtime": {"nodes", "bench", "launcher", "cli", "cli_graph", "live_view", "fork_server", "warm_start",
                "ros_launch"},
    "nodes": {"bench", "launcher", "cli", "cli_graph", "live_view", "ros_launch"},
}


def _modules(sub: str = "") -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


def _imports(path: Path, package_dir: Path = PACKAGE) -> set[str]:
    """Absolute module names `path` imports (relative imports resolved within the package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_no_module_is_longer_than_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_core_imports_no_middleware_threads_or_processes() -> None:
    found = {str(p.relative_to(PACKAGE)): sorted(m for m in _imports(p) if m.split(".")[0] in NOT_IN_CORE)
             for p in _modules("core")}
    assert not {k: v for k, v in found.items() if v}, found


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    above = {f"kaitian_ros.{name}" for name in ABOVE[layer]}
    found = {}
    for p in _modules(layer):
        up = sorted(m for m in _imports(p) if any(m == a or m.startswith(a + ".") for a in above))
        if up:
            found[str(p.relative_to(PACKAGE))] = up
    assert not found, f"{layer} imports from the layers above it: {found}"


def test_the_import_scan_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    """The checks above are not vacuous: the scan finds each kind of upward import."""
    fake = tmp_path / "kaitian_ros" / "core" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import threading\nfrom ..nodes import compute\nfrom kaitian_ros.runtime import api\n")
    names = _imports(fake, tmp_path / "kaitian_ros")
    assert {"threading", "kaitian_ros.nodes", "kaitian_ros.nodes.compute", "kaitian_ros.runtime"} <= names
