"""Which network interface of this host reaches a given address (for gloo across hosts).

gloo binds each rank's sockets to one interface: ``GLOO_SOCKET_IFNAME``, or else the address
the host name resolves to, which on many machines (and in network namespaces) is a loopback
address the other hosts cannot reach. The interface the kernel would route the rendezvous
traffic through is the one the other hosts reach this rank on as well.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


def source_address(remote: str) -> str:
    """This host's IPv4 address that traffic to ``remote`` (address or host name) leaves from.
    OSError when there is no route (or the name does not resolve)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(remote), 9))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


def interface_with_address(address: str) -> str | None:
    """Name of the interface whose primary IPv4 address is ``address``, None if none is."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def interface_toward(remote: str) -> str | None:
    """The interface traffic to ``remote`` leaves through; None when it cannot be told
    (no route, unresolvable name, address not an interface's primary one)."""
    try:
        return interface_with_address(source_address(remote))
    except OSError:
        return None
