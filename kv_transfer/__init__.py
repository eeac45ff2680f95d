"""KV transfer: a prefill worker pushes a request's KV cache, layer by layer, into
KV blocks a decode worker reserved for it.

Interface: :class:`KVReceiver` (decode side), :class:`KVSender` and its
:class:`SenderHandle` (prefill side), over one small transport interface
(``transport.py``) with two backends: ``ucx`` (ucxx; the only module importing
it) and ``inproc`` (same-process fake for unit tests). Both sides run on an
asyncio event loop (uvloop works); the forward runs in a worker thread and
only calls ``SenderHandle.push_layer``.

Lifecycle on the decode side (D):
    1. ``ticket = receiver.reserve(request_id, num_tokens)``: blocks allocated in
       D's BlockManager under ``request_id`` (OutOfBlocksError: nothing
       reserved); deadline armed. ``ticket.encode()`` travels to P as bytes.
    2. P's ``Open`` arrives: D posts one receive per layer and contiguous run
       straight into the reserved blocks. P does not wait for this: data that
       arrives first waits in UCX until its receive is posted. A refused Open
       (expired, aborted, unknown) gets ``Abort``, and whatever P pushed lands
       in scratch memory, never in KV blocks; tags name the sending connection,
       so only the accepted sender of a ticket can match the posted receives.
    3. Every layer landed and ``Complete`` (first sampled token) arrived:
       ``await receiver.wait(request_id)`` returns a TransferResult and D
       acknowledges. The blocks stay allocated under ``request_id``.
    4. Or it fails: ``receiver.abort()`` (client cancel), the deadline, P's
       abort, P's death (UCX endpoint error), incompatibility. ``wait`` raises
       a TransferError subclass at once.

Lifecycle on the prefill side (P):
    1. ``handle = await sender.open(ticket, src_block_ids)``: connect once per
       peer (handshake checks protocol version and compatibility hash: a
       mismatch raises IncompatibleError before any data moves), send ``Open``
       and return at once.
    2. The forward calls ``handle.push_layer(layer)`` after writing each layer;
       the send starts at once and overlaps the next layers' compute.
    3. ``await handle.complete(first_token_id)`` waits until D acknowledged the
       completion, which it does once every byte of every layer landed.
    4. Or ``await handle.abort(reason)``; D's abort, D's death or the deadline
       make ``complete`` raise.

Who frees which blocks, when:
    - D's blocks, success: the decode engine, with ``BlockManager.free(request_id)``
      when the request ends (ownership passes at step 3).
    - D's blocks, any failure: the receiver, as soon as no posted receive can
      still write into them (at most ``2 * settle_timeout_s`` after the failure).
    - P's blocks: always the prefill worker, after ``complete``/``abort``
      returned or raised; both return only once no send reads them any more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kv_transfer.config import Backend, FaultConfig, TransferConfig
from kv_transfer.errors import (
    AbortedError,
    DeadlineError,
    FailureReason,
    IncompatibleError,
    PeerDiedError,
    RejectedError,
    TransferError,
)
from kv_transfer.wire import PROTOCOL_VERSION, KVCompat, TransferTicket

if TYPE_CHECKING:
    from kv_transfer.handle import SenderHandle, SendStats
    from kv_transfer.kvbuf import compat_for
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.reservation import TransferResult
    from kv_transfer.sender import KVSender

# Names that need torch load on first use, so `kv_transfer.wire` & co stay importable without it.
_LAZY = {
    "KVReceiver": "kv_transfer.receiver",
    "TransferResult": "kv_transfer.reservation",
    "KVSender": "kv_transfer.sender",
    "SenderHandle": "kv_transfer.handle",
    "SendStats": "kv_transfer.handle",
    "compat_for": "kv_transfer.kvbuf",
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
    "compat_for",
]
