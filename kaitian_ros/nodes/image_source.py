"""image_source node: publishes sensor_msgs/Image (rgb8) from a video, an image folder, or a
synthetic moving pattern (the default, so the graph runs with no files); with ``source:
digits``, the held-out scikit-learn digits as mono8 frames labelled in ``header.frame_id``."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime, SetParametersResult

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff")
MAX_SOURCE_BYTES = 4096  # PATH_MAX on Linux
DIGITS_SOURCE = "digits"
DIGIT_SIZE = 8  # scikit-learn's digits are 8x8
_DIGIT_FRAME_ID = re.compile(r"^digit:(\d):idx:(\d+)$")

PARAMETERS = (
    P("source", T.STRING, "synthetic",
      "'synthetic', 'digits' (the trainer's held-out digits, labelled), a video file, or a folder of images"),
    P("rate_hz", T.DOUBLE, 10.0, "frames published per second", 0.1, 1000.0),
    P("width", T.INTEGER, 224, "published image width (pixels)", 8, 8192),
    P("height", T.INTEGER, 224, "published image height (pixels)", 8, 8192),
    P("loop", T.BOOL, True, "restart the video/folder at its end (else stop publishing)"),
    P("frame_id", T.STRING, "camera", "header.frame_id of published images"),
    P("topic", T.STRING, "/camera/image_raw", "output topic", read_only=True),
    P("max_frames", T.INTEGER, 0, "stop after this many frames (0 = unlimited)", 0, 2**31 - 1),
)


def synthetic_frame(index: int, height: int, width: int) -> np.ndarray:
    """A deterministic moving colour pattern (bars + a travelling disc), rgb8."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    t = index * 0.15
    r = 127.5 * (1 + np.sin(x / max(width, 1) * 6.28 * 2 + t))
    g = 127.5 * (1 + np.sin(y / max(height, 1) * 6.28 * 3 - t))
    cx, cy = width * (0.5 + 0.35 * np.cos(t)), height * (0.5 + 0.35 * np.sin(t))
    disc = ((x - cx) ** 2 + (y - cy) ** 2) < (min(height, width) * 0.15) ** 2
    b = np.where(disc, 255.0, 40.0)
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def held_out_digits() -> tuple[np.ndarray, np.ndarray]:
    """(N, 8, 8) uint8 pixels and the labels of the trainer's test split of the digits (its split
    is fixed, whatever the training seed): the pixels are ``core.tensors.to_pixels`` of the very
    images the trainer evaluates on, so a model trained with ``camera_inputs`` sees exactly its
    test samples when the compute nodes normalise these frames."""
    from kaitian_ros.core.tensors import to_pixels
    from kaitian_ros.training.data import load_data

    x, y = load_data("digits").test
    return to_pixels(x)[:, 0].numpy(), y.numpy()


def digit_frame_id(label: int, index: int) -> str:
    """The ``header.frame_id`` of held-out digit ``index``: the coordinator copies it into its
    FusedOutput, so a checker reads the true label there."""
    return f"digit:{label}:idx:{index}"


def parse_digit_frame_id(frame_id: str) -> tuple[int, int] | None:
    """(label, index) of a digit frame's ``frame_id``; None for any other frame."""
    m = _DIGIT_FRAME_ID.match(frame_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


def digit_frame(index: int, height: int, width: int) -> tuple[np.ndarray, str]:
    """Held-out digit ``index`` (modulo the split's size) as an HxWx1 mono8 frame and its
    ``frame_id``. Each digit pixel becomes an (H/8)x(W/8) block: the coordinator's area resize
    back to 8x8 averages equal values, which returns them unchanged."""
    if height % DIGIT_SIZE or width % DIGIT_SIZE:
        raise ValueError(f"digits frames are 8x8 pixels scaled by a whole factor: width and height "
                         f"must be multiples of 8, got {width}x{height}")
    pixels, labels = held_out_digits()
    i = index % len(labels)
    frame = np.repeat(np.repeat(pixels[i], height // DIGIT_SIZE, 0), width // DIGIT_SIZE, 1)
    return frame[:, :, None], digit_frame_id(int(labels[i]), i)


class DigitFrames:
    """The held-out digits in split order as mono8 frames (``digit_frame``)."""

    def __init__(self, height: int, width: int, loop: bool) -> None:
        digit_frame(0, height, width)  # refuses a size that is not a multiple of 8
        self.height, self.width, self.loop = height, width, loop
        self.count = len(held_out_digits()[1])
        self._index = 0

    def next(self) -> tuple[np.ndarray, str] | None:
        if self._index >= self.count and not self.loop:
            return None
        frame = digit_frame(self._index, self.height, self.width)
        self._index += 1
        return frame


class FrameReader:
    """Frames from a video file or a folder of images, resized to (height, width), rgb8."""

    def __init__(self, source: str, height: int, width: int, loop: bool) -> None:
        import cv2  # only needed for file sources

        # a source path is refused with a reason, never with an exception from the OS

        self._cv2 = cv2
        self.height, self.width, self.loop = height, width, loop
        if len(source.encode()) > MAX_SOURCE_BYTES:
            raise ValueError(f"source path is {len(source.encode())} bytes long, at most {MAX_SOURCE_BYTES}")
        if any(ord(c) < 32 or ord(c) == 127 for c in source):
            raise ValueError(f"source path {source!r} contains control characters")
        path = Path(source)
        self._files: list[Path] = []
        self._video = None
        try:
            kind = "dir" if path.is_dir() else "file" if path.is_file() else ""
        except OSError as exc:  # too long a component, no permission, ...
            raise ValueError(f"source {source!r}: {exc.strerror}") from None
        if kind == "dir":
            self._files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not self._files:
                raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in folder {source}")
        elif kind == "file":
            self._video = cv2.VideoCapture(str(path))
            if not self._video.isOpened():
                raise ValueError(f"cannot open video {source}")
        else:
            raise ValueError(f"source {source!r} is neither 'synthetic', a file, nor a folder")
        self._index = 0

    def next(self) -> np.ndarray | None:
        cv2 = self._cv2
        if self._files:
            if self._index >= len(self._files):
                if not self.loop:
                    return None
                self._index = 0
            bgr = cv2.imread(str(self._files[self._index]), cv2.IMREAD_COLOR)
            self._index += 1
            if bgr is None:
                return self.next()
        else:
            video = self._video
            assert video is not None  # a source is a folder (files) or a video file
            ok, bgr = video.read()
            if not ok:
                if not self.loop:
                    return None
                video.set(cv2.CAP_PROP_POS_FRAMES, 0)
                ok, bgr = video.read()
                if not ok:
                    return None
        bgr = cv2.resize(bgr, (self.width, self.height), interpolation=cv2.INTER_AREA)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def image_message(pixels: np.ndarray, frame_id: str, stamp: Any = None) -> Any:
    """sensor_msgs/Image of HxWx3 rgb8 or HxWx1 mono8 pixels (stamped now unless ``stamp``)."""
    height, width, channels = pixels.shape
    return interfaces.make("Image", header=interfaces.header(frame_id, stamp), height=height, width=width,
                           encoding="mono8" if channels == 1 else "rgb8", is_bigendian=0,
                           step=width * channels, data=np.ascontiguousarray(pixels).reshape(-1))


class ImageSource:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        self.pub = rt.create_publisher(self.params["topic"], "Image", QoS.BEST_EFFORT)
        self.reader = self._make_reader(self.params)
        self.index = 0
        self.timer = rt.create_timer(1.0 / self.params["rate_hz"], self._tick)
        rt.add_on_set_parameters_callback(self._on_set)
        encoding = "mono8" if isinstance(self.reader, DigitFrames) else "rgb8"
        rt.logger.info(f"publishing {self.params['width']}x{self.params['height']} {encoding} from "
                       f"{self.params['source']} at {self.params['rate_hz']} Hz on {self.pub.topic}")

    @staticmethod
    def _make_reader(params: dict[str, Any]) -> FrameReader | DigitFrames | None:
        if params["source"] == "synthetic":
            return None
        if params["source"] == DIGITS_SOURCE:
            return DigitFrames(params["height"], params["width"], params["loop"])
        return FrameReader(params["source"], params["height"], params["width"], params["loop"])

    def _on_set(self, changes: dict[str, Any]) -> SetParametersResult:
        merged = dict(self.params) | changes
        if "source" in changes or "width" in changes or "height" in changes or "loop" in changes:
            try:
                reader = self._make_reader(merged)
            except ValueError as exc:
                return SetParametersResult(False, str(exc))
            self.reader = reader
        if "rate_hz" in changes:
            self.timer.cancel()
            self.timer = self.rt.create_timer(1.0 / changes["rate_hz"], self._tick)
        self.params = merged
        return SetParametersResult(True)

    def _tick(self) -> None:
        limit = self.params["max_frames"]
        if limit and self.index >= limit:
            return
        frame_id = self.params["frame_id"]
        pixels: np.ndarray | None
        if self.reader is None:
            pixels = synthetic_frame(self.index, self.params["height"], self.params["width"])
        elif isinstance(self.reader, DigitFrames):
            got = self.reader.next()
            if got is None:
                return
            pixels, frame_id = got  # the label travels in frame_id, to the fused result
        else:
            pixels = self.reader.next()
            if pixels is None:
                return
        self.pub.publish(image_message(pixels, frame_id))
        self.index += 1


def main(argv: list[str] | None = None) -> int:
    return run_node(ImageSource, "image_source", argv)


if __name__ == "__main__":
    raise SystemExit(main())
