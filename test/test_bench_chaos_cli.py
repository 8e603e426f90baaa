"""``kaitian bench chaos`` on the command line (no graph is started): its help shows its real
options, a wrong option is one line with exit code 2; and the attacker's fuzz classes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_cli

from kaitian_ros.bench.chaos_attack import FUZZ_CLASSES, WRONG_TYPE, decodable, fuzz_payloads, mutate_fields
from kaitian_ros.runtime import interfaces


def _one_line(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.e2e
def test_help_shows_the_chaos_options():
    result = run_cli("bench", "chaos", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--json", "--faults", "--settle", "--flood-rate", "--flood-whole-stripes",
                   "--fuzz-count"):
        assert option in result.stdout, result.stdout


@pytest.mark.e2e
def test_wrong_options_are_one_line():
    assert "unknown faults ['nope']" in _one_line(run_cli("bench", "chaos", "--faults", "kill_compute,nope"))
    assert "--settle must be at least" in _one_line(run_cli("bench", "chaos", "--settle", "3"))
    assert "--flood-rate must be > 0" in _one_line(run_cli("bench", "chaos", "--flood-rate", "0"))


def test_fuzz_classes_in_turn_random_and_truncated_never_decode():
    seed = bytes(interfaces.encode(interfaces.make("NodeTelemetry", node_id="compute_0", request_id=5),
                                   "NodeTelemetry"))
    out = list(fuzz_payloads(seed, "NodeTelemetry", 60, np.random.default_rng(1)))
    assert [c for c, _ in out[:len(FUZZ_CLASSES)]] == list(FUZZ_CLASSES)
    for cls, payload in out:
        if cls in ("random", "truncated"):
            assert not decodable(payload, "NodeTelemetry"), cls
        if cls == "wrong_type":
            assert interfaces.decode(payload, WRONG_TYPE).data == "fuzz"


def test_hostile_field_values_still_encode():
    msg = interfaces.make("LoadAssignment", incarnation=3, version=1, node_ids=["compute_0"],
                          shares=np.asarray([1.0]))
    rng = np.random.default_rng(2)
    encoded = 0
    for _ in range(50):
        try:
            interfaces.encode(mutate_fields(msg, "LoadAssignment", rng), "LoadAssignment")
            encoded += 1
        except Exception:  # noqa: BLE001, S110 - as the fuzzer: a value the type cannot carry is skipped
            pass
    assert encoded > 25
