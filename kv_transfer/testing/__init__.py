"""Two-process harness for the KV transfer tests and ``benchmarks/kv_transfer.py`` (not used by the serving
path; in the product because the benchmark drives the same peers): ``spec`` (what both sides agree on),
``process`` (the parent's handle on a peer), ``child`` (what a peer does), ``baseline`` (raw ucxx sends).
The only part of ``kv_transfer`` that uses the engine's ``BlockManager`` directly.
"""

from pdserve.kv_transfer.testing.process import PeerProcess, running_peers
from pdserve.kv_transfer.testing.spec import (
    PeerCallError,
    PeerSpec,
    expected_bytes,
    fingerprint,
    scatter_allocate,
)

__all__ = [
    "PeerCallError",
    "PeerProcess",
    "PeerSpec",
    "expected_bytes",
    "fingerprint",
    "running_peers",
    "scatter_allocate",
]
