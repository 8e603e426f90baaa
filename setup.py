"""pip build of kaitian_ros (no ROS needed). On ROS 2, colcon uses CMakeLists.txt instead."""

from pathlib import Path

from setuptools import find_packages, setup

PACKAGE = "kaitian_ros"
NODES = ("image_source", "compute", "coordinator", "scheduler", "trainer", "monitor", "perception_example")


def share_files(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).glob("*") if p.is_file())


setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/msg", share_files("msg")),
        (f"share/{PACKAGE}/config", share_files("config")),
        (f"share/{PACKAGE}/launch", share_files("launch")),
    ],
    entry_points={
        "console_scripts": [f"kaitian = {PACKAGE}.cli:main"]
        + [f"{PACKAGE}_{node} = {PACKAGE}.nodes.{node}:main" for node in NODES],
    },
)
