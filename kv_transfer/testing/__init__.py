"""Two-process harness for the KV transfer tests and benchmark (not used by the serving path).

Lives in the product, not in ``tests/``, because ``benchmarks.kv_transfer`` drives the same peers. It is the
only part of ``kv_transfer`` that uses the engine's ``BlockManager`` directly.

- ``spec``: ``PeerSpec`` and the seeded contents both sides check against.
- ``process``: ``PeerProcess``, the parent's handle on a peer (forked from a server that imported torch).
- ``child``: ``PeerState``, what the peer does with each command.
- ``baseline``: raw ucxx sends of the same bytes, the yardstick of ``benchmarks.kv_transfer``.
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
