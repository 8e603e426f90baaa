"""`kaitian train` on one host when another process takes rank 0's rendezvous port between
`free_port` and the listen: the ranks start again on another port instead of the run failing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

# `kaitian train` with its port chooser replaced by a double whose first port is held open
_TRAIN_WITH_A_TAKEN_PORT = """
import socket, sys
from kaitian_ros.ports import free_port
from kaitian_ros.training import arguments, launch
taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
taken.bind(("127.0.0.1", 0))
taken.listen()
ports = [taken.getsockname()[1]]
def port_chooser_double():  # the first call returns the taken port, later ones free ports
    return ports.pop(0) if ports else free_port()
arguments.free_port = port_chooser_double  # where the command line's placement takes its port
code = launch.main_train(sys.argv[1:])
print("taken port tried:", not ports, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.e2e
def test_kaitian_train_starts_its_ranks_again_on_another_port() -> None:
    proc = subprocess.run([sys.executable, "-c", _TRAIN_WITH_A_TAKEN_PORT, "--ranks", "2", "--devices", "cpu",
                           "--policy", "equal", "--epochs", "1", "--global-batch", "64", "--json"],
                          check=False, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "taken port tried: True" in proc.stderr
    assert "EADDRINUSE" in proc.stderr  # rank 0 said why it stopped the first time
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["epochs_completed"] == 1
