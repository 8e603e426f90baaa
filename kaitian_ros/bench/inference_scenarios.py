"""The scenarios of ``kaitian bench inference`` (``--scenario NAME``, ``--matrix``): one table.

A scenario says which model runs at which input size on which devices, and how fast the links
of the remote ones are. Device speeds are EMULATED (``emulated_slowdown``: a node sleeps (s-1)x
each real compute); a *local* device is co-located with the coordinator (the robot's own
processor: same network namespace, no link), a remote one sits behind an emulated link
(``bench/netns.py``). Command-line flags (``--slowdowns``, ``--mbit``, ``--model``, ``--size``,
``--height``, ``--width``, ``--local``) override the chosen scenario through
:func:`with_overrides`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    slowdown: float       # EMULATED: 1.0 = this CPU's real speed
    local: bool = False   # co-located with the coordinator: no namespace, no link

    def describe(self) -> str:
        return f"{'local' if self.local else 'remote'} x{self.slowdown:g}"


@dataclass(frozen=True)
class BenchScenario:
    name: str
    model: str
    height: int
    width: int
    devices: tuple[Device, ...]  # compute_0, compute_1, ... in this order
    mbit: float                  # rate of every remote device's link, both directions
    about: str = ""

    @property
    def slowdowns(self) -> tuple[float, ...]:
        return tuple(d.slowdown for d in self.devices)

    @property
    def local(self) -> tuple[int, ...]:
        """Indices of the local devices."""
        return tuple(i for i, d in enumerate(self.devices) if d.local)

    @property
    def n_remote(self) -> int:
        return sum(not d.local for d in self.devices)

    @property
    def size_text(self) -> str:
        return f"{self.width}x{self.height}"

    def describe(self) -> str:
        devices = ", ".join(f"compute_{i} {d.describe()}" for i, d in enumerate(self.devices))
        return (f"{self.name}: {self.model} {self.size_text} (WxH), devices {devices} (speeds EMULATED), "
                f"remote links {self.mbit:g} Mbit/s")


def _devices(local: Sequence[float] = (), remote: Sequence[float] = ()) -> tuple[Device, ...]:
    """Local devices first (compute_0, ...), then the remote ones: the launch files' order."""
    return tuple(Device(float(s), True) for s in local) + tuple(Device(float(s), False) for s in remote)


SCENARIOS: dict[str, BenchScenario] = {s.name: s for s in (
    BenchScenario("default", "resnet18", 224, 224, _devices(remote=(1.0, 2.0)), 200.0,
                  "two remote devices, the second twice as slow"),
    BenchScenario("robot_edge", "resnet18", 224, 224, _devices(local=(4.0,), remote=(1.0,)), 50.0,
                  "the robot's own slow processor + an edge box behind a 50 Mbit/s link"),
    BenchScenario("robot_two_edges", "mobilenet_v2", 240, 320, _devices(local=(3.0,), remote=(1.0, 1.5)), 100.0,
                  "the robot's processor + two edge boxes over 100 Mbit/s, a 320x240 camera"),
    BenchScenario("wide_link", "vgg11", 224, 224, _devices(remote=(1.0, 1.3)), 400.0,
                  "a heavy model, two similar remote devices on a fast link"),
)}
DEFAULT_SCENARIO = "default"


def with_overrides(base: BenchScenario, *, slowdowns: Sequence[float] | None = None, mbit: float | None = None,
                   model: str | None = None, height: int | None = None, width: int | None = None,
                   local: int | None = None) -> BenchScenario:
    """`base` with the flags the user gave (None = keep the scenario's value).

    New `slowdowns` keep each position's locality (extra devices are remote); `local` = N makes
    the first N devices local and the rest remote."""
    devices = base.devices
    if slowdowns is not None:
        devices = tuple(Device(float(s), devices[i].local if i < len(devices) else False)
                        for i, s in enumerate(slowdowns))
    if local is not None:
        devices = tuple(Device(d.slowdown, i < local) for i, d in enumerate(devices))
    return dataclasses.replace(base, devices=devices, mbit=base.mbit if mbit is None else float(mbit),
                               model=model or base.model, height=height or base.height, width=width or base.width)


def scenario_problem(s: BenchScenario) -> str:
    """'' when the bench can run `s`, else why not (one line)."""
    if len(s.devices) < 2:
        return f"scenario {s.name}: needs at least 2 devices, has {len(s.devices)}"
    if any(d.slowdown < 1.0 for d in s.devices):
        return f"scenario {s.name}: every slowdown must be >= 1.0, got {list(s.slowdowns)}"
    if s.mbit <= 0:
        return f"scenario {s.name}: the link rate must be > 0 Mbit/s, got {s.mbit:g}"
    if min(s.height, s.width) < 8:
        return f"scenario {s.name}: input {s.size_text} is smaller than 8 pixels"
    return ""
