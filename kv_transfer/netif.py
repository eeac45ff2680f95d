"""Which network interface carries an address: for ``UCX_NET_DEVICES``. Pure: no torch, no ucxx.

UCX picks its network devices by interface name (``UCX_NET_DEVICES=lo``), while an operator says where a
worker lives by address (``--host``). :func:`interfaces_for_host` maps one onto the other with the C
library's ``getifaddrs`` (Linux, as UCX itself).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from functools import cache

# Hosts that mean "every interface": UCX's default device set, not a restriction.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*"})


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _SockAddrIn6(ctypes.Structure):
    _fields_ = [
        ("family", ctypes.c_ushort),
        ("port", ctypes.c_uint16),
        ("flowinfo", ctypes.c_uint32),
        ("addr", ctypes.c_ubyte * 16),
        ("scope_id", ctypes.c_uint32),
    ]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("ifu", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Every (interface name, address) pair of this host, IPv4 and IPv6."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.addr and ifa.name:
                family = ifa.addr.contents.family
                name = ifa.name.decode()
                if family == socket.AF_INET:  # sockaddr_in: port (2 bytes), then the address
                    out.append((name, ipaddress.IPv4Address(bytes(ifa.addr.contents.data[2:6]))))
                elif family == socket.AF_INET6:
                    sin6 = ctypes.cast(ifa.addr, ctypes.POINTER(_SockAddrIn6)).contents
                    out.append((name, ipaddress.IPv6Address(bytes(sin6.addr))))
            node = ifa.next
    finally:
        libc.freeifaddrs(head)
    return out


@cache
def interfaces_for_host(host: str) -> str | None:
    """``UCX_NET_DEVICES`` for a worker that lives at ``host``: the interface(s) carrying its address.

    None for a wildcard host (every interface, UCX's default). A loopback host maps to the loopback
    interface (``lo``). Raises ValueError when no interface of this host carries the address.
    """
    if host in WILDCARD_HOSTS:
        return None
    try:
        ips = {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            raise ValueError(f"cannot resolve host {host!r}: {exc}") from exc
        ips = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    pairs = interface_addresses()
    names: list[str] = []
    for ip in sorted(ips, key=str):
        if ip.is_unspecified:
            return None
        for name, addr in pairs:
            # Any loopback address lives on the loopback interface (127.0.0.2 too).
            if (addr == ip or (ip.is_loopback and addr.is_loopback)) and name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"no network interface of this host carries {host!r}: name one with --kv-interface")
    return ",".join(names)
