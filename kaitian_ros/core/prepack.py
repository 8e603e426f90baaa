"""oneDNN packing heuristics for CPU convs: the activation layout between trunk ops and convs
whose weights are packed once (and packed again for input shapes that stay slow), so that a
stripe of a few rows does not pay a weight reorder on every call (docs/architecture-core.md)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# Activations between trunk ops on a CPU (`ModelGraph.activation_format`). Measured on this CPU
# (ResNet-18 224, one thread, interleaved medians): channels-last with every conv
# prepacked made the whole trunk 10 % faster than NCHW (53.9 -> 48.4 ms), a streamed
# single-node stripe 10 % and the two stripes of a 0.7/0.3 split 11-12 %.
CPU_ACTIVATION_FORMAT = torch.channels_last


# A first call at an input shape that stays this many times slower than its share of the
# whole-map call (plus the slack) gets weights packed for that shape (see `PrepackedConv`).
SLOW_PACK_FACTOR = 3.0
SLOW_PACK_SLACK_S = 0.5e-3
REPACK_MIN_SPEEDUP = 2.0  # ... and keeps them only if they are at least this much faster


class PrepackedConv:
    """A CPU float32 conv with its weights reordered into oneDNN's blocked layout once, not
    on every call.

    Why: the default CPU conv reorders the whole weight tensor on every call. For a stripe of
    a few rows of a weight-heavy layer that reorder is most of the cost - a 1-row call of a
    512-channel 3x3 conv (9.4 MB of weights) took 7.1 ms, as long as all 7 rows (7.3 ms);
    prepacked it takes 0.26 ms and 4.6 ms (docs/architecture-core.md). Row splits pay that
    fixed cost once per node and per run, so it decides whether splitting pays at all.

    oneDNN chooses the blocked layout by input shape. The one packed for the whole map suits
    nearly every row count, but for a few shapes oneDNN wants another and converts between
    the two on every call, 4-150x slower (ResNet-18 at 448: a layer4 conv on 12 of
    its 14 rows took 155 ms instead of 9; MobileNetV2 at 224, 1x1 convs on 2-3 of 7 rows took
    10-25 ms instead of 0.1-0.3). So the first call at each (batch, rows) shape is timed
    against the whole-map call; a shape that is still far slower on a second call gets weights
    packed for itself, kept if they give the same result at least twice as fast.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, padding: Sequence[int],
                 stride: Sequence[int], dilation: Sequence[int], groups: int,
                 input_shape: tuple[int, int, int, int]) -> None:
        """Packs for `input_shape` (the whole map), checks the packed op against ``F.conv2d``
        on channels-last input, as the trunk runs it (ValueError on a mismatch), and times it.
        """
        self._weight, self._bias = weight, bias
        self._args = (list(padding), list(stride), list(dilation), groups)
        with torch.no_grad():
            self._default = self._pack(input_shape)
            probe = torch.randn(input_shape, generator=torch.Generator().manual_seed(0))
            probe = probe.contiguous(memory_format=torch.channels_last)
            want = F.conv2d(probe, weight, bias, stride, padding, dilation, groups)
            got = self._run(probe, self._default)
            if got.shape != want.shape or not _close(got, want):
                raise ValueError("packed conv differs from F.conv2d")
            t0 = time.perf_counter()
            self._run(probe, self._default)  # the first call built oneDNN's kernel: time the second
            self._s_per_row = (time.perf_counter() - t0) / got.shape[2]  # per output row, one image
        self._by_shape: dict[tuple[int, int, int], Tensor] = {
            (input_shape[0], input_shape[2], self._args[0][0]): self._default}

    def __call__(self, x: Tensor, pad_h: int | None = None) -> Tensor:
        """The conv of `x`; `pad_h` overrides the H padding it was built with (the weights
        packed for one padding serve another: checked against ``F.conv2d`` in the tests)."""
        pad = self._args[0][0] if pad_h is None else int(pad_h)
        key = (x.shape[0], x.shape[2], pad)
        packed = self._by_shape.get(key)
        if packed is not None:
            return self._run(x, packed, pad)
        self._by_shape[key] = self._default
        y, took = self._timed(x, self._default, pad)
        if not self._slow(y, took):
            return y
        y, took = self._timed(x, self._default, pad)  # the first call at a shape also builds a kernel
        if not self._slow(y, took):
            return y
        try:
            own = self._pack(tuple(x.shape), pad)
            self._run(x, own, pad)  # builds the kernel for this layout
            mine, took_own = self._timed(x, own, pad)
        except RuntimeError:  # refused for this shape: keep the (slow but right) layout
            return y
        # kept only where it is right and clearly faster: a call that was merely descheduled
        # must not leave a second copy of the weights behind
        if mine.shape == y.shape and _close(mine, y) and took_own * REPACK_MIN_SPEEDUP < took:
            self._by_shape[key] = own
        return y

    @property
    def repacked_shapes(self) -> tuple[tuple[int, int], ...]:
        """(batch, input rows) shapes that got weights packed for themselves."""
        return tuple(k[:2] for k, p in self._by_shape.items() if p is not self._default)

    def _timed(self, x: Tensor, packed: Tensor, pad_h: int) -> tuple[Tensor, float]:
        t0 = time.perf_counter()
        y = self._run(x, packed, pad_h)
        return y, time.perf_counter() - t0

    def _slow(self, y: Tensor, took: float) -> bool:
        """Far slower than this many output rows' share of the whole-map call."""
        return took > SLOW_PACK_FACTOR * self._s_per_row * y.shape[0] * y.shape[2] + SLOW_PACK_SLACK_S

    def _args_with(self, pad_h: int | None) -> tuple:
        """The conv's (padding, stride, dilation, groups), its H padding `pad_h` if given."""
        padding, *rest = self._args
        return ([pad_h, padding[1]] if pad_h is not None else padding, *rest)

    def _pack(self, input_shape: Sequence[int], pad_h: int | None = None) -> Tensor:
        return torch.ops.mkldnn._reorder_convolution_weight(self._weight, *self._args_with(pad_h), list(input_shape))

    def _run(self, x: Tensor, packed: Tensor, pad_h: int | None = None) -> Tensor:
        return torch.ops.mkldnn._convolution_pointwise(x, packed, self._bias, *self._args_with(pad_h), "none", [], "")


def _close(got: Tensor, want: Tensor) -> bool:
    """Equal within float32 noise of the output's scale, NaNs where `want` has them: the tests
    trace receptive fields with NaN rows, and a call descheduled on busy cores tries its own
    packing on such data (a NaN scale once made allclose raise)."""
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)


def prepacked_conv(weight: Tensor, bias: Tensor | None, padding: tuple[int, int],
                   stride: Sequence[int], dilation: Sequence[int], groups: int,
                   input_shape: tuple[int, int, int, int]) -> PrepackedConv | None:
    """The conv with prepacked weights (`PrepackedConv`), or None where that path does not
    apply, is unavailable in this torch build, or differs from ``F.conv2d``."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or groups != 1
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return PrepackedConv(weight, bias, padding, stride, dilation, groups, input_shape)
    except (RuntimeError, AttributeError, TypeError, ValueError):  # op missing, refused or wrong
        return None
