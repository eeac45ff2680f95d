"""Free loopback ports for tests that must name a port before a server binds it.

A port the kernel hands out for ``bind(0)`` lies in the ephemeral range, where any outgoing connection
of the busy host may take it before the server gets to bind it. These come from below that range, from
a slice of its own per test process (pytest-xdist worker), handed out in turn and checked free."""

from __future__ import annotations

import itertools
import os
import random
import socket

_LOW, _HIGH = 10_000, 32_000  # below Linux's default ephemeral range (32768-60999)
_SLICES = 16


def _slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (_HIGH - _LOW) // _SLICES
    start = _LOW + (index % _SLICES) * width
    return range(start, start + width)


def _candidates() -> itertools.cycle[int]:
    ports = _slice()
    # A random starting point: two runs on one host (or a rerun) do not walk the same ports in step.
    first = random.randrange(len(ports))
    return itertools.cycle([*ports[first:], *ports[:first]])


_next_ports = _candidates()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port no one holds now, never the same twice in one process (until its slice wraps)."""
    for _ in range(_HIGH - _LOW):
        port = next(_next_ports)
        if _bindable(port):
            return port
    raise RuntimeError("no free loopback port in this test process's slice")
