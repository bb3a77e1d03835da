"""Our addresses for direct-tcp-v1 hints: every interface that is up, not just the default route.

:func:`local_addresses` lists the addresses of every interface that is up
(IPv4, and IPv6 except link-local), the default route's first, loopback only
when there is nothing else. Cluster machines often have no default route;
offering only the default route's address (or 127.0.0.1) sent two machines
that can reach each other through the relay.

Interfaces come from ``getifaddrs(3)`` through :mod:`ctypes` (Linux, macOS,
the BSDs); where that is missing (Windows) only the default route's addresses
are found, with a UDP ``connect()`` that sends nothing. The answer is cached
for :data:`CACHE_SECONDS`: every Dilation generation asks for it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import sys
import time
from collections.abc import Iterable
from typing import Any

CACHE_SECONDS = 5.0
LOOPBACK = "127.0.0.1"
IFF_UP = 0x1  # the same on Linux, macOS and the BSDs

# Documentation addresses (RFC 5737, RFC 3849): connect() only picks a route.
_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))
# BSD-style sockaddr: sa_len (1 byte), then sa_family (1 byte); Linux: a 2-byte family.
_BSD_SOCKADDR = sys.platform == "darwin" or "bsd" in sys.platform


def usable_addresses(preferred: Iterable[str], others: Iterable[str]) -> list[str]:
    """What to offer a peer: ``preferred`` first, then ``others``' IPv4, then their IPv6.

    Deduplicated and normalised (an IPv4-mapped IPv6 address counts as IPv4);
    loopback, link-local (169.254/16, fe80::/10), unspecified and multicast
    addresses and anything that is not an IP address are dropped; ``[LOOPBACK]``
    when nothing is left.
    """
    rest = sorted(_parse_all(others), key=lambda ip: ip.version)  # stable: IPv4 first
    found: dict[str, None] = {}
    for ip in [*_parse_all(preferred), *rest]:
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast):
            found.setdefault(str(ip), None)
    return list(found) or [LOOPBACK]


def _parse_all(texts: Iterable[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for text in texts:
        try:
            ip = ipaddress.ip_address(text.partition("%")[0])  # no scope id
        except ValueError:
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        out.append(ip)
    return out


def default_route_addresses() -> list[str]:
    """Our source address towards the IPv4 and IPv6 default routes, where there is one."""
    found = []
    for family, probe in _PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                found.append(s.getsockname()[0])
        except OSError:
            continue  # no such route, or no such family
    return found


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [  # struct ifaddrs: the same layout on Linux, macOS and the BSDs
    ("ifa_next", ctypes.POINTER(_IfAddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_dstaddr", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]

_libc_cache: list[Any] = []


def _libc() -> Any:
    """The C library's getifaddrs/freeifaddrs, or None where there is none."""
    if not _libc_cache:
        lib = None
        try:
            lib = ctypes.CDLL(None)
            lib.getifaddrs.argtypes = [ctypes.POINTER(ctypes.POINTER(_IfAddrs))]
            lib.getifaddrs.restype = ctypes.c_int
            lib.freeifaddrs.argtypes = [ctypes.POINTER(_IfAddrs)]
            lib.freeifaddrs.restype = None
        except (OSError, TypeError, AttributeError):  # Windows: no CDLL(None), no getifaddrs
            lib = None
        _libc_cache.append(lib)
    return _libc_cache[0]


def _sockaddr_ip(addr: int | None) -> str | None:
    """The IP address in a ``struct sockaddr *``, or None for other families."""
    if not addr:
        return None
    head = ctypes.string_at(addr, 2)
    family = head[1] if _BSD_SOCKADDR else int.from_bytes(head, sys.byteorder)
    if family == socket.AF_INET:  # sockaddr_in: family, port, then the address
        return socket.inet_ntop(socket.AF_INET, ctypes.string_at(addr + 4, 4))
    if family == socket.AF_INET6:  # sockaddr_in6: family, port, flowinfo, then the address
        return socket.inet_ntop(socket.AF_INET6, ctypes.string_at(addr + 8, 16))
    return None


def interface_addresses() -> list[str] | None:
    """IP addresses of the interfaces that are up, as ``getifaddrs(3)`` lists them.

    None when the system cannot tell (no ``getifaddrs``, or it failed).
    """
    lib = _libc()
    if lib is None:
        return None
    head = ctypes.POINTER(_IfAddrs)()
    if lib.getifaddrs(ctypes.byref(head)) != 0:
        return None
    try:
        found = []
        node = head
        while node:
            entry = node.contents
            if entry.ifa_flags & IFF_UP:
                ip = _sockaddr_ip(entry.ifa_addr)
                if ip is not None:
                    found.append(ip)
            node = entry.ifa_next
        return found
    finally:
        lib.freeifaddrs(head)


_cached: tuple[float, tuple[str, ...]] | None = None


def local_addresses() -> list[str]:
    """Addresses a peer may reach us on (see the module docstring); cached for a few seconds."""
    global _cached
    now = time.monotonic()
    cached = _cached
    if cached is None or not 0 <= now - cached[0] < CACHE_SECONDS:
        found = usable_addresses(default_route_addresses(), interface_addresses() or ())
        cached = _cached = (now, tuple(found))
    return list(cached[1])


def family_of(address: str) -> int | None:
    """``AF_INET``/``AF_INET6`` for an IP address, None for a host name."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return None
    return socket.AF_INET if ip.version == 4 else socket.AF_INET6


def unmapped(host: str) -> str:
    """``::ffff:10.0.0.1`` (an IPv4 peer on a dual-stack socket) as ``10.0.0.1``."""
    if host.lower().startswith("::ffff:") and family_of(host[7:]) == socket.AF_INET:
        return host[7:]
    return host
