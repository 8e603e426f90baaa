"""Shared pytest setup: keep torch to one thread per test process (CI has 2 cores), the
fixtures that host a Zenoh router for a test (``router``) or a module (``module_router``), and
the order of the test files: the longest first, so that the pytest-xdist workers (setup.cfg,
``-n 3 --dist loadfile``: a file's tests, and its module fixtures, stay on one worker) do not
end with one of them running a long file alone."""

from collections.abc import Iterator

import pytest
import torch
from helpers import Router

torch.set_num_threads(1)

# seconds each took on 2 cores (pytest --durations), longest first; files not named come after
# these in their usual order. The order only schedules: the tests of a file are independent of
# the files run before them. (A run of ee1a884; test_ros_real.py first: in a clean clone it
# also builds the ROS 2 environment.)
LONGEST_FILES = ("test_ros_real.py", "test_cli_launch.py", "test_two_hosts.py", "test_training.py",
                 "test_security.py", "test_lateness_e2e.py", "test_scheduler_e2e.py", "test_control_plane_faults.py",
                 "test_trainer_node.py", "test_runtime_embedded.py", "test_digits_demo.py", "test_inference_e2e.py",
                 "test_inference_faults.py", "test_fork_server.py", "test_live_view.py", "test_bag.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: the tests of one file keep their order


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router()
    yield r
    r.close()


@pytest.fixture(scope="module")
def module_router() -> Iterator[Router]:
    r = Router()
    yield r
    r.close()
