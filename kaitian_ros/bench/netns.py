"""Link emulation for benchmarks: one Linux network namespace per device, joined to the root
namespace by a veth pair whose both ends are rate limited with ``tc qdisc ... tbf`` (DESIGN.md
section 9; netem does not exist on these kernels, tbf does). Needs root.

Topology (device i = 0, 1, ...)::

    root namespace (router, coordinator, bench driver)
      ktr<i>  10.231.<i>.1/24  --tbf-->  |  <--tbf--  ktn<i>  10.231.<i>.2/24   namespace kaitian_dev<i>

Root forwards between the veths, so device-to-device traffic (halos) crosses both devices'
links and root-to-device traffic (input slabs, outputs) crosses one. Everything is removed on
``close()`` (also registered with ``atexit``); ``Links`` is a context manager.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "kaitian_dev"
SUBNET = "10.231"


class LinkSetupError(RuntimeError):
    """Namespaces/veth/tbf could not be set up (not root, missing `ip`/`tc`, ...)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
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
    """`n` device namespaces with `mbit`-Mbit/s links (tbf both directions) to the root."""

    n: int
    mbit: float
    names: list[str] = field(default_factory=list)
    _forward_before: str | None = None
    _closed: bool = False

    def host_ip(self, i: int) -> str:
        """Root-side address of device i's link (reachable from every namespace)."""
        return f"{SUBNET}.{i}.1"

    def device_ip(self, i: int) -> str:
        return f"{SUBNET}.{i}.2"

    def netns(self, i: int) -> str:
        return f"{PREFIX}{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it inside device i's namespace."""
        return ["ip", "netns", "exec", self.netns(i)]

    def __enter__(self) -> Links:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        ok, why = available()
        if not ok:
            raise LinkSetupError(why)
        cleanup_stale(self.n)
        atexit.register(self.close)
        try:
            with open("/proc/sys/net/ipv4/ip_forward") as f:
                self._forward_before = f.read().strip()
            _run("sysctl", "-qw", "net.ipv4.ip_forward=1")
            rate = f"{self.mbit:g}mbit"
            # burst >= one 64 KiB GSO super-packet (tbf would otherwise segment/drop them)
            burst = str(max(65536, int(self.mbit * 1e6 / 8 / 250)))
            for i in range(self.n):
                ns, host, dev = self.netns(i), f"ktr{i}", f"ktn{i}"
                _run("ip", "netns", "add", ns)
                self.names.append(ns)
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
                    _run(*where, "tc", "qdisc", "add", "dev", ifname, "root", "tbf", "rate", rate,
                         "burst", burst, "latency", "50ms")
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return (f"{self.n} network namespaces ({', '.join(self.names)}), veth pairs with tbf "
                f"{self.mbit:g} Mbit/s in both directions, routed through the root namespace")

    def qdisc_stats(self) -> dict[str, str]:
        """`tc -s qdisc` of every link end (to show bytes really went through tbf)."""
        out = {}
        for i in range(len(self.names)):
            out[f"ktr{i}"] = _run("tc", "-s", "qdisc", "show", "dev", f"ktr{i}", check=False).stdout
            out[f"ktn{i}"] = _run(*self.exec_prefix(i), "tc", "-s", "qdisc", "show", "dev", f"ktn{i}",
                                  check=False).stdout
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i, ns in enumerate(self.names):
            _run("ip", "link", "del", f"ktr{i}", check=False)  # removes the peer and both qdiscs
            _run("ip", "netns", "del", ns, check=False)
        self.names.clear()
        if self._forward_before is not None:
            _run("sysctl", "-qw", f"net.ipv4.ip_forward={self._forward_before}", check=False)


def cleanup_stale(n: int = 16) -> None:
    """Remove leftovers of an earlier run that was killed before it could clean up."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for i in range(n):
        _run("ip", "link", "del", f"ktr{i}", check=False)
        if f"{PREFIX}{i}" in listed:
            _run("ip", "netns", "del", f"{PREFIX}{i}", check=False)
