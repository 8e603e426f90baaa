"""Link emulation for benchmarks: one Linux network namespace per remote device, joined to the
root namespace by a veth pair whose both ends are rate limited with ``tc qdisc ... tbf``
(netem does not exist on these kernels, tbf does; docs/benchmarks.md). Needs root.

Topology (device i = 0, 1, ...)::

    root namespace (router, coordinator, bench driver, local devices)
      ktr<i>  10.231.<i>.1/24  --tbf-->  |  <--tbf--  ktn<i>  10.231.<i>.2/24   namespace kaitian_dev<i>

(Default names and subnet; a ``Links`` may choose its own, so that two benchmarks can run at
once.) Root forwards between the veths, so device-to-device traffic (halos) crosses both devices'
links and root-to-device traffic (input slabs, outputs) crosses one. A *local* device (the
robot's own processor, co-located with the coordinator) gets no namespace and no veth: its
processes run in the root namespace and listen on ``root_ip()``, so its traffic with the
coordinator stays on the host (loopback) and its traffic with a remote device crosses only that
device's link. Everything is removed on ``close()`` (also registered with ``atexit``); ``Links``
is a context manager.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "kaitian_dev"
SUBNET = "10.231"
VETH_PREFIX = "kt"  # root side <prefix>r<i>, namespace side <prefix>n<i> (interface names <= 15 chars)


# The token bucket's size. A bucket lets that many bytes through at the veth's own speed after
# the link was idle, so it must be small against the messages timed: with the 64 KiB-or-4-ms
# bucket used before, a 150 KB frame crossed a 200 Mbit/s link at 460 Mbit/s and a 50 KB slab at
# 1 Gbit/s (every frame follows an idle gap here). 8 KB (about five full frames) holds 186-211
# Mbit/s at 200 and 360-396 Mbit/s at 400 for messages of 50 KB to 2 MB (measured through a
# veth pair with TCP, 2026-12-05); tbf splits larger GSO packets into segments itself.
TBF_BURST_BYTES = 8000


class LinkSetupError(RuntimeError):
    """Namespaces/veth/tbf could not be set up (not root, missing `ip`/`tc`, ...)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, check=False, text=True)
    if check and p.returncode != 0:
        raise LinkSetupError(f"`{' '.join(cmd)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def available() -> tuple[bool, str]:
    """(True, "") when namespaces + veth + tbf can be used here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "not root (network namespaces and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found"
    return True, ""


@dataclass
class Links:
    """Device namespaces with `mbit`-Mbit/s links (tbf both directions) to the root, for every
    device of `range(n)` except the `local` ones (indices), which stay in the root namespace."""

    n: int
    mbit: float
    local: tuple[int, ...] = ()
    # names and addresses of this set of links: two benchmarks running at once (the chaos bench
    # uses its own) must neither share addresses nor remove each other's links as stale
    netns_prefix: str = PREFIX
    veth_prefix: str = VETH_PREFIX
    subnet: str = SUBNET
    names: list[str] = field(default_factory=list)
    _made: list[int] = field(default_factory=list)  # devices whose namespace exists (for close)
    _forward_before: str | None = None
    _closed: bool = False

    def __post_init__(self) -> None:
        bad = [i for i in self.local if not 0 <= i < self.n]
        if bad:
            raise ValueError(f"local device indices {bad} out of range for {self.n} devices")
        self.local = tuple(sorted(set(self.local)))

    @property
    def remote(self) -> tuple[int, ...]:
        """Devices behind a link, in index order."""
        return tuple(i for i in range(self.n) if i not in self.local)

    def is_local(self, i: int) -> bool:
        return i in self.local

    def host_ip(self, i: int) -> str:
        """Root-side address of remote device i's link (reachable from every namespace)."""
        return f"{self.subnet}.{i}.1"

    def root_ip(self) -> str:
        """A root-namespace address every namespace reaches (root routes for all of them): where
        the router, the coordinator and local devices listen."""
        if not self.remote:
            raise LinkSetupError("no remote device: nothing to emulate a link for")
        return self.host_ip(self.remote[0])

    def device_ip(self, i: int) -> str:
        """Where device i's processes listen: its namespace's address, or root's when local."""
        return self.root_ip() if self.is_local(i) else f"{self.subnet}.{i}.2"

    def netns(self, i: int) -> str:
        return f"{self.netns_prefix}{i}"

    def root_veth(self, i: int) -> str:
        return f"{self.veth_prefix}r{i}"

    def netns_veth(self, i: int) -> str:
        return f"{self.veth_prefix}n{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it in device i's namespace (nothing when local)."""
        return [] if self.is_local(i) else ["ip", "netns", "exec", self.netns(i)]

    def __enter__(self) -> Links:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        ok, why = available()
        if not ok:
            raise LinkSetupError(why)
        if not self.remote:
            raise LinkSetupError("no remote device: nothing to emulate a link for")
        cleanup_stale(max(16, self.n), self.netns_prefix, self.veth_prefix)
        atexit.register(self.close)
        try:
            with open("/proc/sys/net/ipv4/ip_forward") as f:
                self._forward_before = f.read().strip()
            _run("sysctl", "-qw", "net.ipv4.ip_forward=1")
            for i in self.remote:
                self._add_link(i)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _tbf(mbit: float) -> list[str]:
        return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(TBF_BURST_BYTES), "latency", "50ms"]

    def set_rate(self, i: int, mbit: float) -> None:
        """Change remote device i's link rate, both directions, while processes use it (the
        chaos bench collapses a link and restores it)."""
        if i not in self._made:
            raise LinkSetupError(f"device {i} has no emulated link")
        inside = ["ip", "netns", "exec", self.netns(i)]
        for where, ifname in (([], self.root_veth(i)), (inside, self.netns_veth(i))):
            _run(*where, "tc", "qdisc", "change", "dev", ifname, "root", *self._tbf(mbit))

    def _add_link(self, i: int) -> None:
        ns, host, dev = self.netns(i), self.root_veth(i), self.netns_veth(i)
        _run("ip", "netns", "add", ns)
        self.names.append(ns)
        self._made.append(i)  # from here on close() removes this device's namespace and veth
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", dev)
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "addr", "add", f"{self.host_ip(i)}/24", "dev", host)
        _run("ip", "link", "set", host, "up")
        inside = ["ip", "netns", "exec", ns]
        _run(*inside, "ip", "addr", "add", f"{self.device_ip(i)}/24", "dev", dev)
        _run(*inside, "ip", "link", "set", dev, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "route", "add", "default", "via", self.host_ip(i))
        for where, ifname in (([], host), (inside, dev)):
            _run(*where, "tc", "qdisc", "add", "dev", ifname, "root", *self._tbf(self.mbit))

    def describe(self) -> str:
        text = (f"{len(self.remote)} network namespaces ({', '.join(self.netns(i) for i in self.remote)}), "
                f"veth pairs with tbf {self.mbit:g} Mbit/s in both directions, routed through the root "
                f"namespace")
        if self.local:
            text += (f"; device(s) {', '.join(map(str, self.local))} local: in the root namespace with the "
                     f"coordinator, no link")
        return text

    def qdisc_stats(self) -> dict[str, str]:
        """`tc -s qdisc` of every link end (to show bytes really went through tbf)."""
        out = {}
        for i in self._made:
            host, dev = self.root_veth(i), self.netns_veth(i)
            out[host] = _run("tc", "-s", "qdisc", "show", "dev", host, check=False).stdout
            out[dev] = _run(*self.exec_prefix(i), "tc", "-s", "qdisc", "show", "dev", dev,
                                  check=False).stdout
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i in self._made:
            _run("ip", "link", "del", self.root_veth(i), check=False)  # removes the peer and both qdiscs
            _run("ip", "netns", "del", self.netns(i), check=False)
        self._made.clear()
        self.names.clear()
        if self._forward_before is not None:
            _run("sysctl", "-qw", f"net.ipv4.ip_forward={self._forward_before}", check=False)


def cleanup_stale(n: int = 16, netns_prefix: str = PREFIX, veth_prefix: str = VETH_PREFIX) -> None:
    """Remove leftovers of an earlier run that was killed before it could clean up."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for i in range(n):
        _run("ip", "link", "del", f"{veth_prefix}r{i}", check=False)
        if f"{netns_prefix}{i}" in listed:
            _run("ip", "netns", "del", f"{netns_prefix}{i}", check=False)
