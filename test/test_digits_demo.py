"""Trained digits end to end (docs/digits_demo.md): ``kaitian train --camera-inputs
--save-weights`` writes what the inference nodes load, the image source's ``digits`` frames become
exactly the trainer's test samples on the compute nodes, and the digits_demo graph's fused results
score what the same weights score on one device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kaitian_ros.bench import digits as bench
from kaitian_ros.core.tensors import image_to_array, normalise_input, resize_pixels
from kaitian_ros.nodes import image_source
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.runtime import interfaces
from kaitian_ros.scenario import load_scenario
from kaitian_ros.training.data import load_data

REPO = Path(__file__).resolve().parents[1]


def _demo_params() -> tuple[dict[str, Any], dict[str, Any]]:
    """The coordinator's and the image source's parameters in config/digits_demo.yaml."""
    scenario = load_scenario("digits_demo")
    return scenario.node("coordinator").parameters, scenario.node("image_source").parameters


def test_a_rendered_digit_frame_becomes_the_training_sample_exactly() -> None:
    """Image source frame -> wire -> the coordinator's conversion and resize -> the compute nodes'
    normalisation: bitwise the tensor ``kaitian train --camera-inputs`` trained and tested on,
    for every held-out digit."""
    coordinator, camera = _demo_params()
    c, h, w = coordinator["input_channels"], coordinator["input_height"], coordinator["input_width"]
    assert (camera["height"], camera["width"]) != (h, w)  # the coordinator's resize is exercised
    test_x, test_y = load_data("digits", camera=True).test
    for i in range(len(test_y)):
        pixels, frame_id = image_source.digit_frame(i, camera["height"], camera["width"])
        wire = interfaces.encode(image_source.image_message(pixels, frame_id), "Image")
        msg = interfaces.decode(bytes(wire), "Image")
        assert msg.encoding == "mono8"
        rows = resize_pixels(image_to_array(msg.data, msg.height, msg.width, msg.encoding, msg.step), h, w, c)
        x = normalise_input(rows, c, coordinator["normalise"])
        assert torch.equal(x[0], test_x[i]), f"held-out digit {i}"
        assert image_source.parse_digit_frame_id(msg.header.frame_id) == (int(test_y[i]), i)
    # what the mapping is: digit value v (0..16) -> pixel round(255 v / 16) -> (p / 255 - 0.5) / 0.25
    raw_x = load_data("digits").test[0]
    assert float((test_x - (raw_x - 0.5) / 0.25).abs().max()) <= 0.5 / 255 / 0.25 + 1e-6


def test_image_source_publishes_labelled_mono8_digits_and_refuses_odd_sizes() -> None:
    published: list[Any] = []

    class Stub:  # the few Runtime calls ImageSource makes
        logger = type("L", (), {"info": staticmethod(lambda text: None)})()

        def declare_parameters(self, descriptors: Any) -> dict[str, Any]:
            given = {"source": "digits", "width": 16, "height": 24, "loop": False}
            return {d.name: given.get(d.name, d.default) for d in descriptors}

        def create_publisher(self, topic: str, msg_type: str, qos: Any) -> Any:
            return type("P", (), {"topic": topic, "publish": staticmethod(published.append)})()

        def create_timer(self, period_s: float, callback: Any) -> Any:
            return None

        def add_on_set_parameters_callback(self, callback: Any) -> None:
            pass

    node = image_source.ImageSource(Stub())  # type: ignore[arg-type]
    count = len(image_source.held_out_digits()[1])
    for _ in range(count + 3):  # loop: false stops at the end of the split
        node._tick()
    assert len(published) == count
    pixels, labels = image_source.held_out_digits()
    for i in (0, 1, count - 1):
        msg = published[i]
        assert (msg.encoding, msg.height, msg.width, msg.step) == ("mono8", 24, 16, 16)
        frame = np.asarray(msg.data).reshape(24, 16)
        assert np.array_equal(frame[::3, ::2], pixels[i])  # 3x2 blocks of the digit's 8x8 pixels
        assert msg.header.frame_id == f"digit:{labels[i]}:idx:{i}"
    with pytest.raises(ValueError, match="multiples of 8"):
        image_source.DigitFrames(60, 64, True)
    assert image_source.parse_digit_frame_id("camera") is None


def test_camera_inputs_exclude_standardised_ones() -> None:
    from kaitian_ros.training.config import TrainingConfig

    with pytest.raises(ValueError, match="exclude each other"):
        TrainingConfig(camera_inputs=True, standardize_inputs=True)
    cfg = TrainingConfig.from_dict({"camera_inputs": True, "save_weights": "weights/w.pt"})
    assert TrainingConfig.from_dict(cfg.to_dict()) == cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``kaitian train`` with the bench's recipe and quick schedule: 2 real ranks, EMULATED 1:1/3."""
    weights = tmp_path_factory.mktemp("digits") / "digits_cnn.pt"
    summary = bench.train(weights, bench.QUICK_EPOCHS)
    assert weights.is_file() and summary["weights"] == str(weights)
    return weights, summary


@pytest.mark.slow
@pytest.mark.e2e
def test_saved_weights_load_in_the_inference_build_path_with_the_trainers_accuracy(
        trained: tuple[Path, dict[str, Any]]) -> None:
    weights, summary = trained
    coordinator, _ = _demo_params()
    graph = ic.build_graph(ic.ModelSpec.from_params(coordinator | {"weights": str(weights)}))
    test_x, test_y = load_data("digits", camera=True).test
    with torch.no_grad():  # the trunk as compute nodes run it, the head as the coordinator does
        top = torch.cat([graph.run_head(graph.run_trunk(x[None])) for x in test_x]).argmax(1)
    accuracy = int((top == test_y).sum()) / len(test_y)  # as the trainer's evaluate() counts
    assert accuracy == summary["test_accuracy"]
    assert accuracy >= 0.95, summary


@pytest.mark.e2e
def test_bench_digits_fused_accuracy_equals_single_device(trained: tuple[Path, dict[str, Any]],
                                                          tmp_path: Path) -> None:
    weights, _ = trained
    out = tmp_path / "digits.json"
    done = subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "bench", "digits", "--quick", "--weights",
                           str(weights), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    assert r["frames"] == bench.QUICK_FRAMES and r["incomplete"] == 0
    assert r["inputs_equal_training_samples"] == bench.QUICK_FRAMES
    assert r["fused_accuracy"] == r["single_device_accuracy"] and r["agree"] == 1.0
    assert r["fused_accuracy"] >= 0.95
    assert r["emulated"] is True and set(r["strategies"]) == {"stripes"}
    assert (tmp_path / "digits.png").is_file()
    assert "fused (/kaitian/fused)" in done.stdout


@pytest.mark.e2e
def test_launch_without_the_weights_file_is_one_line(tmp_path: Path) -> None:
    """digits_demo reads digits_cnn.pt from the current directory: missing, nothing starts."""
    done = subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "launch", "digits_demo", "--no-view"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "weights file 'digits_cnn.pt' does not exist" in lines[0] and "--save-weights" in lines[0]
    assert "compute_0" in lines[0] and "[launch] started" not in done.stdout


@pytest.mark.e2e
def test_bench_digits_help_and_mistakes() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kaitian_ros.cli", "bench", "digits", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)

    helped = cli("--help")
    assert helped.returncode == 0 and "--weights" in helped.stdout and "--quick" in helped.stdout
    missing = cli("--weights", "/nonexistent/digits.pt")
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "no such file" in missing.stderr
