"""Image -> model input tensor (pure numpy/torch), shared by the coordinator and the tests
that compare the collaborative result with a single-device run on the same input."""

from __future__ import annotations

import numpy as np
import torch

# ImageNet statistics: the reference CNNs are ImageNet-shaped; random weights do not care,
# but trained state_dicts loaded by users do.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ENCODINGS = ("rgb8", "bgr8", "mono8")


class ImageFormatError(ValueError):
    """An image whose encoding, size or data length cannot be converted."""


def image_to_array(data: np.ndarray, height: int, width: int, encoding: str, step: int) -> np.ndarray:
    """HxWxC uint8 RGB (or HxWx1 mono) view of sensor_msgs/Image fields; validates sizes."""
    if encoding not in ENCODINGS:
        raise ImageFormatError(f"unsupported encoding {encoding!r} (supported: {', '.join(ENCODINGS)})")
    channels = 1 if encoding == "mono8" else 3
    if height <= 0 or width <= 0:
        raise ImageFormatError(f"empty image {width}x{height}")
    if step < width * channels or len(data) < step * height:
        raise ImageFormatError(f"image data {len(data)} bytes too short for {width}x{height} "
                               f"{encoding} with step {step}")
    rows = np.asarray(data[: step * height], dtype=np.uint8).reshape(height, step)
    pixels = rows[:, : width * channels].reshape(height, width, channels)
    if encoding == "bgr8":
        pixels = pixels[:, :, ::-1]
    return pixels


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] -> uint8 pixels ``round(255 x)`` (half to even), what a camera
    delivering them would publish. Training on ``normalise_input(to_pixels(x))`` (the trainer's
    ``camera_inputs``) makes a model's training samples the very tensors the compute nodes feed
    it for those frames."""
    return torch.round(images.to(torch.float32) * 255.0).clamp_(0.0, 255.0).to(torch.uint8)


def resize_pixels(pixels: np.ndarray, out_height: int, out_width: int, in_channels: int = 3) -> torch.Tensor:
    """uint8 HxWxC -> uint8 (1, C, out_height, out_width): what the coordinator streams.

    Rows stay uint8 on the wire (4x fewer bytes than float32); ``normalise_input`` turns them
    into model input on the compute node. Every step after the resize is per pixel, so a slab
    normalised on its own equals the same rows of the whole normalised image.
    """
    if pixels.shape[2] == 1 and in_channels == 3:
        pixels = np.repeat(pixels, 3, axis=2)
    if pixels.shape[0] != out_height or pixels.shape[1] != out_width:
        import cv2  # only to resize: a camera at the model's size never loads OpenCV

        pixels = cv2.resize(np.ascontiguousarray(pixels), (out_width, out_height),
                            interpolation=cv2.INTER_AREA)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(np.transpose(pixels, (2, 0, 1))[None]))


def warm_resize() -> None:
    """Load OpenCV and run one resize now: the first image a process resizes otherwise pays
    about 25 ms for them (the import 17 ms, the library's first call 8 ms, measured here)."""
    resize_pixels(np.zeros((2, 2, 3), np.uint8), 1, 1)


def normalise_input(rows: torch.Tensor, in_channels: int = 3, normalise: bool = True) -> torch.Tensor:
    """uint8 (N, C, r, W) pixel rows -> float32 (N, in_channels, r, W) model input rows."""
    x = rows.to(torch.float32).div_(255.0)
    if in_channels == 1 and x.shape[1] == 3:
        x = x.mean(dim=1, keepdim=True)
    if normalise:
        if x.shape[1] == 3:
            mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
            std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        else:
            mean, std = torch.tensor(0.5).view(1, 1, 1, 1), torch.tensor(0.25).view(1, 1, 1, 1)
        x = (x - mean) / std
    return x.contiguous()


def preprocess(pixels: np.ndarray, out_height: int, out_width: int, in_channels: int = 3,
               normalise: bool = True) -> torch.Tensor:
    """uint8 HxWxC -> float32 (1, in_channels, out_height, out_width), resized and normalised:
    exactly what the compute nodes feed the trunk (the single-device reference input)."""
    return normalise_input(resize_pixels(pixels, out_height, out_width, in_channels), in_channels, normalise)


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """max |result - reference| / max |reference|: the invariant's error measure."""
    scale = float(reference.abs().max())
    return float((result - reference).abs().max()) / (scale if scale > 0 else 1.0)
