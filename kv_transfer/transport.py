"""The one small interface every backend implements (Protocols only): a connection between a prefill
worker (connects) and a decode worker (listens) carries ordered control messages, tagged data and, where
the backend has them, one-sided writes into the decode worker's exposed KV bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pdserve.kv_transfer.errors import TransferError
    from pdserve.kv_transfer.wire import RemoteRegion

    # A contiguous 1-D uint8 view: numpy for host memory (slicing it is far cheaper than a torch view,
    # kvbuf.KVSpans), torch for device memory.
    Buffer = np.ndarray | torch.Tensor

MessageHandler = Callable[[bytes], None]
CloseHandler = Callable[[Exception | None], None]
# Called exactly once, on the event loop thread and never from inside the call that started the operation,
# with None or the error that ended it. A callback, not a future: a transfer runs hundreds of operations,
# and each future costs another loop iteration.
DoneCallback = Callable[["TransferError | None"], None]


def describe(address: str) -> str:
    """A peer's address for logs and errors: a UCX worker address is hundreds of characters of base64."""
    if len(address) <= 48:
        return address
    head = address[: address.find(":") + 1] if ":" in address[:24] else ""
    return f"{head}{hashlib.sha256(address.encode()).hexdigest()[:12]}"


class DataOp(Protocol):
    def cancel(self) -> None:
        """Ask to stop. ``on_done`` still comes, and only then is the buffer free of the transport (a
        receive that already matched finishes writing first): receivers rely on this to free KV blocks
        only after the last write into them."""
        ...


class RemoteWriter(Protocol):
    # True: ``write_runs`` is a copy done when it returns, callable from any thread; ``flush`` is a check.
    synchronous: bool
    # True: ``write_runs`` may be called on the forward thread right after the forward wrote (or, on
    # CUDA, enqueued the writes of) a layer: a synchronous copy, or a copy ordered after those writes
    # on the same CUDA stream (cuda_ipc.py). False: only on the event loop, once the layer is ready.
    direct: bool
    # How it writes, for the metrics (``metrics.TRANSFER_PATHS``): "puts", "cross_memory", "shared_memory"
    # or "cuda_ipc".
    path: str

    def write_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        """Start writing each run ``(source, destination, nbytes)``: ``nbytes`` at local address
        ``local + source`` to ``offset + destination`` bytes into the peer's region (a layer's runs
        in one call, so that a writer may batch them); raises TransferError when the connection
        refuses it at once."""

    def write_layers(
        self,
        local: int,
        local_stride: int,
        offset: int,
        remote_stride: int,
        count: int,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        """``write_runs`` for ``count`` consecutive layers at once (every one already written): layer
        ``i``'s runs go from ``local + i * local_stride`` to ``offset + i * remote_stride``. One call for
        what a CUDA-graph prefill wrote together: a writer may make it one system call (cma.py) or one
        strided copy per run (cuda_ipc.py) instead of a call per layer."""

    def flush(self, on_done: DoneCallback) -> None:
        """``on_done`` (on the loop) once every earlier put landed in the peer's memory, or failed."""

    def check(self) -> TransferError | None:
        """Synchronous writers only: ``flush``'s answer, now."""

    def close(self) -> None: ...


class Connection(Protocol):
    @property
    def peer(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    def set_handlers(self, on_message: MessageHandler, on_close: CloseHandler) -> None:
        """Install handlers, which run on the event loop thread; messages that arrived earlier are
        delivered after this call. A broken connection calls ``on_close`` with the error exactly once
        and fails every pending operation on it."""

    def post_message(self, payload: bytes) -> None:
        """Submit a control message now (not when a task gets to run), in order.

        Fire and forget: a failed send breaks the connection, which is how the
        caller learns. Raises PeerDiedError if the connection is already closed.
        """

    def send_data(self, buf: Buffer, tag: int, on_done: DoneCallback) -> DataOp:
        """Send a contiguous uint8 buffer; ``on_done`` once it may be reused."""

    def recv_data(self, buf: Buffer, tag: int, on_done: DoneCallback) -> DataOp:
        """Receive into a contiguous uint8 buffer of exactly the sent size; ``on_done`` once it holds the
        data. Tags match per receiving process, not per connection (as in UCX), and a message that
        arrives before its receive is posted waits for it."""

    def close(self) -> None:
        """Close abruptly: pending operations fail, the peer sees the connection break."""

    def remote_writer(self, region: RemoteRegion, local: Buffer | None = None) -> RemoteWriter | None:
        """Puts from ``local`` (this side's KV bytes, as ``KVSpans.flat``: it says which memory the
        writes read) into the peer's exposed ``region``, or None when this connection cannot."""


class Transport(Protocol):
    @property
    def address(self) -> str:
        """Where peers connect (valid after ``listen``)."""

    async def listen(self, on_connect: Callable[[Connection], None]) -> None: ...

    async def connect(self, address: str) -> Connection: ...

    def expose(self, buf: Buffer, shared_fd: int | None = None) -> RemoteRegion | None:
        """Register ``buf`` (the whole KV tensor's bytes) for peers' one-sided writes; None when
        this backend has none. Valid until ``close``. ``shared_fd``: the memfd ``buf`` is mapped from
        (offset 0), offered to senders of this host (writers/shm.py)."""

    def next_transfer_id(self) -> int:
        """A transfer id unique among the receives this process may have posted."""

    async def close(self) -> None: ...
