"""Fixtures of the checks that run inside the ROS 2 environment (real rclpy)."""

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def router() -> Iterator[Any]:
    """A zenoh router on a free loopback port, for an EmbeddedRuntime to compare with."""
    from kaitian_ros.ports import free_port
    from kaitian_ros.runtime import zenoh_session as zs

    endpoint = f"tcp/127.0.0.1:{free_port()}"
    session = zs.open_session("router", listen=endpoint)
    yield endpoint
    session.close()
