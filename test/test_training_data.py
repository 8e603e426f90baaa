"""The digits split: made once with scikit-learn, then read from the user's cache directory
(the same arrays, bit for bit); a damaged cache file is made again."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from kaitian_ros.training import data


def test_the_cached_digits_split_is_scikit_learns_split_and_needs_no_scikit_learn(tmp_path, monkeypatch) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = data._digits_split(0)
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None, :, :]
    want = train_test_split(x, d.target.astype(np.int64), test_size=0.25, random_state=0, stratify=d.target)
    (cache,) = (tmp_path / "kaitian_ros").glob("digits-split0-sklearn*.npz")
    again = data._digits_split(0)
    for a, b, w in zip(made, again, want):
        assert a.dtype == b.dtype == w.dtype and np.array_equal(a, w) and np.array_equal(b, w)
    # read back in a fresh interpreter: scikit-learn is not imported
    probe = ("import sys; from kaitian_ros.training import data; "
             "s = data._digits_split(0); print(len(s[1]), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path)),
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["450", "False"], out
    cache.write_bytes(b"not an npz")  # damaged: made again, the same split
    for a, w in zip(data._digits_split(0), want):
        assert np.array_equal(a, w)
    assert np.load(cache)["y_test"].shape == (450,)
