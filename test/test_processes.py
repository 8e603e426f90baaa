"""The one child-process module (``kaitian_ros.processes``) the launcher, the benchmarks and
``kaitian train`` start and stop their children with: no orphans, escalating stops that reach a
child's own children, and a child left in our process group stopped alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, pid_running, wait_until

from kaitian_ros.processes import start_child, stop_children

# a child that ignores SIGTERM (SIGINT is ignored by start_child), starts a grandchild in its
# group and prints the grandchild's pid
STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(g.pid, flush=True); time.sleep(60)")


def test_a_stop_escalates_to_sigkill_and_reaches_the_childs_own_children() -> None:
    p = start_child([sys.executable, "-c", STUBBORN], ignore_sigint=True, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        grandchild = int(p.stdout.readline())
        assert os.getpgid(p.pid) == p.pid != os.getpgrp()  # a process group of its own
        t0 = time.monotonic()
        stop_children([p], ((signal.SIGINT, 0.3), (signal.SIGTERM, 0.3), (signal.SIGKILL, 5.0)))
        assert p.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5.0
        wait_until(lambda: not pid_running(grandchild), "the grandchild gone with its group", 5.0)
    finally:
        p.kill()
        p.wait()


def test_a_child_in_our_group_is_stopped_alone() -> None:
    p = start_child([sys.executable, "-c", "import time; time.sleep(60)"], own_group=False)
    assert os.getpgid(p.pid) == os.getpgrp()
    stop_children([p], ((signal.SIGTERM, 5.0),))  # must not signal our own group (we would die)
    assert p.returncode == -signal.SIGTERM


def test_a_child_dies_with_its_parent() -> None:
    """The parent SIGKILLed (no cleanup of its own): the kernel ends the child."""
    parent_code = ("import subprocess, sys, time; from kaitian_ros.processes import start_child; "
                   "c = start_child([sys.executable, '-c', 'import time; time.sleep(60)']); "
                   "print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert pid_running(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: not pid_running(child), "the orphan ended by the kernel", 5.0)
    finally:
        parent.kill()
        parent.wait()


def test_ignoring_sigint_needs_a_group_of_its_own() -> None:
    with pytest.raises(ValueError, match="own_group"):
        start_child([sys.executable, "-c", "pass"], own_group=False, ignore_sigint=True)
