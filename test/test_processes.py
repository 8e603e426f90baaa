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

# a child that ignores SIGTERM (SIGINT is held back by start_child), starts a grandchild in its
# group and prints the grandchild's pid
STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(g.pid, flush=True); time.sleep(60)")


def test_a_stop_escalates_to_sigkill_and_reaches_the_childs_own_children() -> None:
    p = start_child([sys.executable, "-c", STUBBORN], defer_sigint=True, stdout=subprocess.PIPE, text=True)
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


def test_deferring_sigint_needs_a_group_of_its_own() -> None:
    with pytest.raises(ValueError, match="own_group"):
        start_child([sys.executable, "-c", "pass"], own_group=False, defer_sigint=True)


# takes SIGINT only after a second of "start-up" (as a node importing torch does)
LATE_HANDLER = ("import signal, sys, time; from kaitian_ros.processes import accept_sigint; "
                "print('started', flush=True); time.sleep(1.0); "
                "signal.signal(signal.SIGINT, lambda *_: sys.exit(7)); accept_sigint(); time.sleep(60)")


def test_a_sigint_before_the_handler_is_held_back_not_lost() -> None:
    """A Ctrl-C forwarded while a node still starts reaches its handler once it takes SIGINT:
    no traceback from the start-up, and no wait for the SIGTERM escalation."""
    p = start_child([sys.executable, "-c", LATE_HANDLER], defer_sigint=True, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "started"
        p.send_signal(signal.SIGINT)  # the handler is not installed yet
        assert p.wait(timeout=30) == 7, p.stdout.read()
        assert "Traceback" not in p.stdout.read()
    finally:
        p.kill()
        p.wait()
