"""Reference models: build, determinism, any input size, import paths, errors."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from kaitian_ros.core.models import MODEL_NAMES, build_model

torch.set_num_threads(1)


@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n != "digits_cnn"])
def test_reference_models_any_size_eval_deterministic(name: str) -> None:
    m = build_model(name, num_classes=7)
    assert not m.training
    x = torch.randn(1, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = m(x)
        y2 = build_model(name, num_classes=7)(x)
    assert y.shape == (1, 7) and torch.isfinite(y).all()
    assert torch.equal(y, y2)  # same seed -> same weights
    other = build_model(name, num_classes=7, seed=1)
    with torch.no_grad():
        assert not torch.equal(y, other(x))


def test_batchnorm_stats_are_non_trivial() -> None:
    m = build_model("resnet18")
    bns = [b for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)]
    assert bns and all(b.running_mean.abs().max() > 0 for b in bns)
    assert all((b.running_var - 1).abs().max() > 1e-3 for b in bns)


def test_digits_cnn_default_and_other_sizes() -> None:
    m = build_model("digits_cnn")
    assert not any(isinstance(b, torch.nn.modules.batchnorm._BatchNorm) for b in m.modules())
    with torch.no_grad():
        assert m(torch.randn(2, 1, 8, 8)).shape == (2, 10)
        assert build_model("digits_cnn", in_channels=3)(torch.randn(1, 3, 64, 64)).shape == (1, 10)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"resnet18.*mobilenet_v2.*vgg11.*digits_cnn"):
        build_model("resnet1000")


def test_import_path_and_state_dict(tmp_path, monkeypatch) -> None:
    (tmp_path / "kt_user_model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make(num_classes=4):
            return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    m = build_model("kt_user_model:make", num_classes=5, seed=3)
    assert not m.training and m[-1].out_features == 5
    path = tmp_path / "w.pt"
    torch.save(m.state_dict(), path)
    m2 = build_model("kt_user_model:make", num_classes=5, seed=9, state_dict_path=str(path))
    assert torch.equal(m2[0].weight, m[0].weight)
    with pytest.raises(ValueError):
        build_model("kt_user_model:nope")
    with pytest.raises(ValueError):
        build_model("no_such_module_kt:make")
    sys.modules.pop("kt_user_model", None)
