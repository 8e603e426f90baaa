"""Optional dependencies (setup.cfg extras) missing: one clear line naming the extra to install,
before any work starts. The missing package is simulated by hiding it from the import system
(the adapter under test is the command's own check), the rest is the real command."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kaitian_ros.cli import main


def test_bench_without_matplotlib_names_the_extra(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "inference", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kaitian_ros[bench]" in err[0], err


def test_digits_without_scikit_learn_names_the_extra(monkeypatch) -> None:
    from kaitian_ros.training.data import load_data

    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn -> ImportError
    with pytest.raises(ValueError, match=r"kaitian_ros\[digits\]"):
        load_data("digits")
