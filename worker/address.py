"""``host:port`` strings for gRPC, with IPv6 literals in brackets (``[fd00::1]:50051``).

A pod IP may be IPv6 (dual-stack or IPv6-only clusters): ``f"{host}:{port}"`` would read as a longer
IPv6 address with no port, both to gRPC's bind and to every peer that dials it.
"""

from __future__ import annotations

import socket

WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def host_port(host: str, port: int) -> str:
    """``host:port``; an IPv6 literal (it has a colon) goes in brackets unless it already is."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def dial_host(host: str) -> str:
    """The host others dial for a server bound to ``host``: a wildcard bind is no address, so the host
    name stands in for it."""
    return socket.gethostname() if host in WILDCARDS else host
