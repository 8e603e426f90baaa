"""image_source node: publishes sensor_msgs/Image (rgb8) from a video, an image folder, or a
synthetic moving pattern (the default, so the graph runs with no files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kaitian_ros.runtime import interfaces, run_node
from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T
from kaitian_ros.runtime.api import QoS, Runtime, SetParametersResult

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff")
MAX_SOURCE_BYTES = 4096  # PATH_MAX on Linux

PARAMETERS = (
    P("source", T.STRING, "synthetic", "'synthetic', a video file, or a folder of images"),
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
            ok, bgr = self._video.read()
            if not ok:
                if not self.loop:
                    return None
                self._video.set(cv2.CAP_PROP_POS_FRAMES, 0)
                ok, bgr = self._video.read()
                if not ok:
                    return None
        bgr = cv2.resize(bgr, (self.width, self.height), interpolation=cv2.INTER_AREA)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def image_message(rgb: np.ndarray, frame_id: str) -> Any:
    height, width, _ = rgb.shape
    return interfaces.make("Image", header=interfaces.header(frame_id), height=height, width=width,
                           encoding="rgb8", is_bigendian=0, step=width * 3,
                           data=np.ascontiguousarray(rgb).reshape(-1))


class ImageSource:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.params = rt.declare_parameters(PARAMETERS)
        self.pub = rt.create_publisher(self.params["topic"], "Image", QoS.BEST_EFFORT)
        self.reader = self._make_reader(self.params)
        self.index = 0
        self.timer = rt.create_timer(1.0 / self.params["rate_hz"], self._tick)
        rt.add_on_set_parameters_callback(self._on_set)
        rt.logger.info(f"publishing {self.params['width']}x{self.params['height']} rgb8 from "
                       f"{self.params['source']} at {self.params['rate_hz']} Hz on {self.pub.topic}")

    @staticmethod
    def _make_reader(params: dict[str, Any]) -> FrameReader | None:
        if params["source"] == "synthetic":
            return None
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
        if self.reader is None:
            rgb = synthetic_frame(self.index, self.params["height"], self.params["width"])
        else:
            rgb = self.reader.next()
            if rgb is None:
                return
        self.pub.publish(image_message(rgb, self.params["frame_id"]))
        self.index += 1


def main(argv: list[str] | None = None) -> int:
    return run_node(ImageSource, "image_source", argv)


if __name__ == "__main__":
    raise SystemExit(main())
