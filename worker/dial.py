"""How a client dials the routers: one gRPC channel over every router (``round_robin``), health-checked
so that a router still loading or draining gets nothing, retrying UNAVAILABLE before the first response
(admission: a router that is stopping or just died). The CLI and ``pdserve bench`` use it; docs/routers.md
shows the same settings for other gRPC clients."""

from __future__ import annotations

import json
import socket
from typing import Any

import grpc

from pdserve.worker.router_set import split_routers
from pdserve.worker.tls import TLSConfig, aio_channel, channel

GENERATION_SERVICE = "pdserve.v1.Generation"

SERVICE_CONFIG: dict[str, Any] = {
    "loadBalancingConfig": [{"round_robin": {}}],
    # A router answers its health check for Generation NOT_SERVING while it loads and once it drains.
    "healthCheckConfig": {"serviceName": GENERATION_SERVICE},
    "methodConfig": [
        {
            "name": [{"service": GENERATION_SERVICE}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}


def router_target(spec: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """The gRPC target and channel options for the routers ``spec`` names (``host:port[,host:port...]``).
    One entry: a name goes to gRPC's DNS resolver, so a name with several addresses spreads over all of
    them. Several: their addresses, looked up now (IPv4 where any entry has it)."""
    entries = split_routers(spec)
    options: tuple[tuple[str, Any], ...] = (
        ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
        ("grpc.enable_retries", 1),
    )
    if len(entries) == 1:
        host = entries[0].rpartition(":")[0]
        if host.startswith("[") or host.replace(".", "").isdigit():
            return entries[0], options
        return f"dns:///{entries[0]}", options
    v4: list[str] = []
    v6: list[str] = []
    names = []
    for entry in entries:
        host, _, port = entry.rpartition(":")
        name = host.strip("[]")
        if not (name.replace(".", "").isdigit() or ":" in name):
            names.append(name)
        for family, _, _, _, sockaddr in socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM):
            ip = str(sockaddr[0])
            if family == socket.AF_INET and f"{ip}:{port}" not in v4:
                v4.append(f"{ip}:{port}")
            elif family == socket.AF_INET6 and f"[{ip}]:{port}" not in v6:
                v6.append(f"[{ip}]:{port}")
    if names:  # (a certificate names the host, not its addresses)
        options += (("grpc.ssl_target_name_override", names[0]),)
    return ("ipv4:" + ",".join(v4)) if v4 else ("ipv6:" + ",".join(v6)), options


def router_channel(spec: str, tls: TLSConfig) -> grpc.Channel:
    target, options = router_target(spec)
    return channel(target, tls, options)


def router_aio_channel(spec: str, tls: TLSConfig) -> grpc.aio.Channel:
    target, options = router_target(spec)
    return aio_channel(target, tls, options)
