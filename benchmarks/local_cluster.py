"""What the cluster benchmarks share: the `pdserve` CLI run to its end, and a free loopback port."""

from __future__ import annotations

import socket
import subprocess
import sys


def pdserve(*args: str, timeout: float = 900) -> str:
    """``python -m pdserve.cli *args``; its stdout, or RuntimeError with both of its outputs."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if out.returncode != 0:
        raise RuntimeError(f"pdserve {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
