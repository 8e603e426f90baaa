"""Shared pytest setup: keep torch to one thread per test process (CI has 2 cores), and the
fixtures that host a Zenoh router for a test (``router``) or a module (``module_router``)."""

from collections.abc import Iterator

import pytest
import torch
from helpers import Router

torch.set_num_threads(1)


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
