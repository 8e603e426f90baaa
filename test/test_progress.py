"""Progress of long commands: plain lines without escape codes off a terminal (throttled, the
last step always told), a bar on a terminal, names from outside escaped; and `kaitian train`'s
per-epoch notes."""

from __future__ import annotations

import io
from types import SimpleNamespace

from kaitian_ros.progress import Progress
from kaitian_ros.training.launch import EpochProgress
from kaitian_ros.training.results import EpochDone


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_one_per_step_without_escape_codes():
    out = io.StringIO()
    progress = Progress("bench runs", 3, stream=out, plain_every_s=0.0)
    for name in ("equal", "adaptive", "evil\x1b[2J"):
        progress.advance(f"{name} done")
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == ["[progress] bench runs: 1/3 - equal done", "[progress] bench runs: 2/3 - adaptive done",
                     "[progress] bench runs: 3/3 - evil\\x1b[2J done"]
    assert "\x1b" not in out.getvalue()


def test_plain_lines_are_throttled_but_the_last_step_is_told():
    out = io.StringIO()
    progress = Progress("epochs", 500, stream=out, plain_every_s=3600.0)
    for epoch in range(1, 501):
        progress.update(epoch, f"epoch {epoch}")
    lines = out.getvalue().splitlines()
    assert lines == ["[progress] epochs: 1/500 - epoch 1", "[progress] epochs: 500/500 - epoch 500"]


def test_a_terminal_gets_a_bar_that_ends_complete():
    out = _Terminal()
    progress = Progress("epochs", 4, stream=out)
    for epoch in range(1, 5):
        progress.update(epoch, "test acc 0.9")
    progress.close()
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text  # drawn by rich, in place
    assert "4/4" in text and "[progress]" not in text


def test_bad_counts_do_not_crash():
    out = io.StringIO()
    progress = Progress("x", -3, stream=out, plain_every_s=0.0)
    progress.update(7, "")
    progress.update(-1, "")
    assert out.getvalue().splitlines() == ["[progress] x: 7", "[progress] x: 0"]


def test_train_epoch_notes_name_accuracy_speed_shares_and_emulation(capsys):
    cfg = SimpleNamespace(epochs=2, emulated_slowdown=(1.0, 3.0))
    progress = EpochProgress(cfg)
    progress.progress.plain_every_s = 0.0
    progress.epoch_done(EpochDone(epoch=0, epochs=2, test_accuracy=None, samples_per_s=812.4, shares=(0.5, 0.5)))
    progress.epoch_done(EpochDone(epoch=1, epochs=2, test_accuracy=0.93, samples_per_s=901.0, shares=(0.75, 0.25)))
    progress.close()
    err = capsys.readouterr().err.splitlines()
    assert err == ["[progress] kaitian train epochs: 1/2 - 812 samples/s EMULATED, shares 0.50/0.50",
                   "[progress] kaitian train epochs: 2/2 - test acc 0.9300, 901 samples/s EMULATED, shares 0.75/0.25"]
