"""Whether a host name or address stays on this machine: the one rule for "beyond loopback"."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost``, any of 127.0.0.0/8, ``::1`` (bracketed or not) and IPv4-mapped loopback
    (``::ffff:127.0.0.1``); not a name that merely starts with "127." (``127.example.com``)."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback
