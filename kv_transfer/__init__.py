"""KV transfer: a prefill worker pushes a request's KV cache, layer by layer, into KV blocks a decode
worker reserved for it.

:class:`KVReceiver` (decode side) and :class:`KVSender` with its :class:`SenderHandle` (prefill side) run
over the Protocols of ``transport.py``; ``transports/`` holds the backends (UCX, and an in-process fake for
tests), ``writers/`` the one-host writers. The lifecycle, wire protocol, handshake, writers and failure
handling are in ``docs/kv_transfer.md``.

THE block-ownership and threading contract (the only copy; other modules point here)
------------------------------------------------------------------------------------
A request's KV blocks always have exactly one owner, and only the owner frees them.

On the decode worker (D), in order:
    1. ``KVReceiver.reserve`` allocates the blocks under ``request_id`` in D's block pool
       (``reservation.BlockPool``; the engine's ``BlockManager`` in a decode worker). From here
       until step 3 the receiver owns them. No room: the pool's error passes through, nothing held.
    2. Any failure before step 3 (abort, deadline, P's abort or death, shutdown): the receiver
       frees them, but only once no posted receive can still write into them (at most
       ``2 * settle_timeout_s`` after the failure), so a freed block is never written late.
       Nobody else frees them in this window: ``decode_pool.remote`` asks the receiver to abort.
    3. ``await receiver.wait(request_id)`` returned (every layer and ``Complete`` landed): ownership
       passes to the decode engine, which adopts the request (``add_prefilled_request``) and frees
       the blocks when the request ends (finish, cancel, deadline, drain), as it frees its own.
On the prefill worker (P): the prefill loop owns the source blocks from scheduling until
``handle.complete``/``handle.abort`` has returned or raised (both return only once no send reads
them any more), and frees them then. D never touches P's blocks, nor P D's.

Threads. Everything in ``kv_transfer`` runs on one event loop thread, except
``SenderHandle.push_layer`` and ``push_layers``, which the forward thread calls. On D the block pool
is shared by two threads: the receiver reserves and frees on the event loop while the decode engine allocates,
grows, preempts and frees on its own thread between and during steps. That is safe because, and
only while, these three rules hold:
    a. every pool operation is atomic and all-or-nothing (``BlockManager`` holds one lock per
       call; a call that cannot be served raises and changes nothing);
    b. no thread acts on a pool reading it made in an earlier call (no ``can_allocate`` then
       ``allocate`` across threads): each side just allocates and treats "out of blocks" as "no
       room yet" (the engine preempts or waits; the receiver's caller answers RESOURCE_EXHAUSTED);
    c. an id's blocks are freed only by its owner above, so the two threads never free, grow or
       read the table of the same id at once (the engine copies a table under the lock).
Prefix caching (``engine.block_manager``): a block may also be shared read-only, by several ids
(reference counted) and, once its last holder frees it, by the pool's cache (unowned, evictable by any
allocation); ``free`` drops only the caller's references. A block is written only by an id that holds it
alone and unhashed: a reservation's blocks past its reused prefix (``allocate_prefixed``; the ticket's
``cached_tokens``) are always fresh, and only those are written by the transfer. A block becomes a cache hit
(``commit``) only once its K/V is complete: on D, a received prompt's blocks at step 3, when the engine
adopts them; on P, after the forward that wrote them. ``cached_prefix_blocks`` is a reading (rule b).
P's pool is touched on its event loop thread alone. ``tests/unit/test_block_ownership.py`` checks a and c
with reservations and frees from the event loop while the engine steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.kv_transfer.config import Backend, FaultConfig, TransferConfig
from pdserve.kv_transfer.errors import (
    AbortedError,
    ChecksumError,
    DeadlineError,
    FailureReason,
    IncompatibleError,
    PeerDiedError,
    RejectedError,
    TransferError,
    UnauthenticatedError,
)
from pdserve.kv_transfer.reservation import BlockPool
from pdserve.kv_transfer.wire import PROTOCOL_VERSION, KVCompat, TransferTicket

if TYPE_CHECKING:
    from pdserve.kv_transfer.handle import SenderHandle, SendStats
    from pdserve.kv_transfer.kvbuf import compat_for
    from pdserve.kv_transfer.receiver import KVReceiver
    from pdserve.kv_transfer.reservation import TransferResult
    from pdserve.kv_transfer.sender import KVSender

# Names that need torch load on first use, so `kv_transfer.wire` & co stay importable without it.
_LAZY = {
    "KVReceiver": "pdserve.kv_transfer.receiver",
    "TransferResult": "pdserve.kv_transfer.reservation",
    "KVSender": "pdserve.kv_transfer.sender",
    "SenderHandle": "pdserve.kv_transfer.handle",
    "SendStats": "pdserve.kv_transfer.handle",
    "compat_for": "pdserve.kv_transfer.kvbuf",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "PROTOCOL_VERSION",
    "AbortedError",
    "Backend",
    "BlockPool",
    "ChecksumError",
    "DeadlineError",
    "FailureReason",
    "FaultConfig",
    "IncompatibleError",
    "KVCompat",
    "KVReceiver",
    "KVSender",
    "PeerDiedError",
    "RejectedError",
    "SendStats",
    "SenderHandle",
    "TransferConfig",
    "TransferError",
    "TransferResult",
    "TransferTicket",
    "UnauthenticatedError",
    "compat_for",
]
