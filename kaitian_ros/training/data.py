"""The data of a training run: the datasets as tensors (digits, resized or through the camera's
pixel path, standardised), batches gathered by index and test-set accuracy."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class DataSplit:
    """Train and test sets; tensors when the dataset fits in memory as such."""

    train: Any
    test: Any
    num_classes: int
    in_channels: int


def _digits(seed_split: int = 0) -> DataSplit:
    xtr, xte, ytr, yte = _digits_split(seed_split)
    return DataSplit(train=(torch.from_numpy(xtr), torch.from_numpy(ytr)),
                     test=(torch.from_numpy(xte), torch.from_numpy(yte)),
                     num_classes=10, in_channels=1)


DIGITS_SPLIT = ("x_train", "x_test", "y_train", "y_test")


def _digits_split(seed_split: int) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits, split; kept in the user's cache directory once made. Importing
    scikit-learn took 1.3 s of every training rank's start-up here (each rank is its own
    process), far more than the rank's first epoch; the cached split is read with numpy alone.
    The cache is keyed by scikit-learn's version: another version may split differently."""
    if importlib.util.find_spec("sklearn") is None:
        raise ValueError("the digits dataset comes with scikit-learn, which is not installed: "
                         "pip install 'kaitian_ros[digits]'")
    cache = _cache_dir() / f"digits-split{seed_split}-sklearn{importlib.metadata.version('scikit-learn')}.npz"
    try:
        with np.load(cache, allow_pickle=False) as f:
            return tuple(f[k] for k in DIGITS_SPLIT)
    except (OSError, ValueError, KeyError):  # not made yet, or unreadable: make it again
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None, :, :]  # (N, 1, 8, 8) in [0, 1]
    y = d.target.astype(np.int64)
    # fixed random_state: the split must not depend on the training seed
    split = tuple(train_test_split(x, y, test_size=0.25, random_state=seed_split, stratify=y))
    with contextlib.suppress(OSError):  # a read-only home: no cache, the same split every time
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npz")
        np.savez(partial, **dict(zip(DIGITS_SPLIT, split)))
        os.replace(partial, cache)  # whole or not at all: ranks start together and race
    return split


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kaitian_ros"


class _Resized(torch.utils.data.Dataset):
    """Items of `base` with the image resized to `size` x `size` (bilinear)."""

    def __init__(self, base: Any, size: int) -> None:
        self.base, self.size = base, size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        x, y = self.base[i]
        return _resize(torch.as_tensor(x)[None], self.size)[0], y


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if tuple(x.shape[-2:]) == (size, size):
        return x
    return torch.nn.functional.interpolate(x.float(), size=(size, size), mode="bilinear",
                                           align_corners=False)


def resize_split(data: DataSplit, size: int | None) -> DataSplit:
    """`data` with every image resized to `size` x `size` (None: unchanged)."""
    if size is None:
        return data

    def one(ds: Any) -> Any:
        if isinstance(ds, tuple):
            return (_resize(ds[0], size).contiguous(), ds[1])
        return _Resized(ds, size)

    return DataSplit(one(data.train), one(data.test), data.num_classes, data.in_channels)


def standardize_split(data: DataSplit) -> DataSplit:
    """Train and test images as ``(x - mean) / std`` with the training set's pixel statistics.

    Only for in-memory ``(x, y)`` tensor sets (the test set uses the *training* statistics).
    """
    if not isinstance(data.train, tuple) or not isinstance(data.test, tuple):
        raise ValueError("standardize_inputs needs an in-memory (x, y) tensor dataset")
    x = data.train[0].float()
    mean, std = float(x.mean()), float(x.std())
    if not std > 0:
        raise ValueError("cannot standardise: the training images are constant")

    def one(ds: tuple) -> tuple:
        return ((ds[0].float() - mean) / std, ds[1])

    return DataSplit(one(data.train), one(data.test), data.num_classes, data.in_channels)


def camera_split(data: DataSplit) -> DataSplit:
    """Train and test images as the compute nodes see a camera frame of them: quantised to
    uint8 pixels (``core.tensors.to_pixels``, images in [0, 1]) and turned into model input by
    the nodes' own ``core.tensors.normalise_input`` (``normalise: true``).

    Only for in-memory ``(x, y)`` tensor sets.
    """
    from kaitian_ros.core.tensors import normalise_input, to_pixels

    if not isinstance(data.train, tuple) or not isinstance(data.test, tuple):
        # a configuration mistake: ValueError, which the CLI and the node report as one line
        raise ValueError("camera_inputs needs an in-memory (x, y) tensor dataset")

    def one(ds: tuple) -> tuple:
        return (normalise_input(to_pixels(ds[0]), data.in_channels), ds[1])

    return DataSplit(one(data.train), one(data.test), data.num_classes, data.in_channels)


def load_data(spec: str, num_classes: int | None = None, image_size: int | None = None,
              *, standardize: bool = False, camera: bool = False) -> DataSplit:
    """``"digits"`` or ``"package.module:callable"`` returning a Dataset or (train, test).

    A single Dataset is split 75/25 deterministically. Items are ``(x, label)``. With
    `image_size` every image is resized (bilinear) to that square size; with `standardize`
    then standardised (:func:`standardize_split`), with `camera` made camera inputs
    (:func:`camera_split`).
    """
    if standardize:
        return standardize_split(load_data(spec, num_classes, image_size))
    if camera:
        return camera_split(load_data(spec, num_classes, image_size))
    if spec == "digits":
        return resize_split(_digits(), image_size)
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"dataset must be 'digits' or 'package.module:callable', got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import dataset {spec!r}: {e}") from None
    got = obj()
    if isinstance(got, tuple) and len(got) == 2:
        train, test = got
    else:
        n = len(got)
        perm = np.random.default_rng(0).permutation(n)
        cut = round(n * 0.75)
        train = torch.utils.data.Subset(got, perm[:cut].tolist())
        test = torch.utils.data.Subset(got, perm[cut:].tolist())
    x0, _ = train[0]
    in_ch = int(torch.as_tensor(x0).shape[0])
    if num_classes is None:
        labels = {int(train[i][1]) for i in range(len(train))}
        num_classes = max(labels) + 1
    return resize_split(DataSplit(train=train, test=test, num_classes=num_classes,
                                  in_channels=in_ch), image_size)


def dataset_size(ds: Any) -> int:
    return int(ds[1].shape[0]) if isinstance(ds, tuple) else len(ds)


def gather_batch(ds: Any, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(ds, tuple):
        t = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ds[0][t], ds[1][t]
    if not idx:
        x0, _ = ds[0]
        x0 = torch.as_tensor(x0)
        return x0.new_zeros((0, *x0.shape)), torch.zeros(0, dtype=torch.long)
    items = [ds[i] for i in idx]
    return (torch.stack([torch.as_tensor(x) for x, _ in items]),
            torch.as_tensor([int(y) for _, y in items], dtype=torch.long))


@torch.no_grad()
def evaluate(model: nn.Module, test: Any, device: torch.device, batch: int = 512) -> float:
    """Top-1 accuracy on the test set."""
    model.eval()
    n, correct = dataset_size(test), 0
    for lo in range(0, n, batch):
        x, y = gather_batch(test, list(range(lo, min(n, lo + batch))))
        correct += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    model.train()
    return correct / max(n, 1)
