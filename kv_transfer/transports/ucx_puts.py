"""UCX's one-sided puts into a peer's exposed region: the writer a UCX connection falls back to where
no writer of this host applies, and the memory description a registration needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.transport import DoneCallback
from pdserve.kv_transfer.transports import ucp_rma, ucp_tag
from pdserve.kv_transfer.wire import RemoteRegion


class Link(Protocol):
    """What the puts need of their connection (``ucx_connection.UcxConnection``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def peer(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    @property
    def worker_handle(self) -> int: ...


def memory_of(buf: Any) -> tuple[int, int, int]:
    """(address, bytes, UCX memory type) of a contiguous uint8 numpy array or torch tensor."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data, buf.nbytes, ucp_rma.MEMORY_TYPE_HOST
    kind = ucp_rma.MEMORY_TYPE_CUDA if buf.device.type == "cuda" else ucp_rma.MEMORY_TYPE_HOST
    return buf.data_ptr(), buf.numel() * buf.element_size(), kind


class PutWriter:
    """Puts on a connection's data endpoint into the peer's exposed region (event loop thread only)."""

    synchronous = False
    direct = False
    path = "puts"

    def check(self) -> TransferError | None:
        raise NotImplementedError("puts complete asynchronously: flush")

    def __init__(self, conn: Link, ep: Any, region: RemoteRegion) -> None:
        self._conn = conn
        self._handle = ep._ep.handle  # ucp_ep_h
        self._key = ucp_rma.RemoteKey(self._handle, region.key, region.base, region.length)

    def write_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        if not self._conn.alive:
            raise PeerDiedError(f"connection to {self._conn.peer} is closed")
        put = self._key.put
        try:
            for src, dst, nbytes in runs:
                put(local + src, nbytes, offset + dst)
        except TransferError as exc:
            raise PeerDiedError(f"put to {self._conn.peer}: {exc}") from exc

    def write_layers(
        self,
        local: int,
        local_stride: int,
        offset: int,
        remote_stride: int,
        count: int,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        for i in range(count):  # a put per run and layer either way
            self.write_runs(local + i * local_stride, offset + i * remote_stride, runs)

    def flush(self, on_done: DoneCallback) -> None:
        if not self._conn.alive:
            self._conn.loop.call_soon(on_done, PeerDiedError(f"connection to {self._conn.peer} is closed"))
            return
        peer = self._conn.peer

        def flushed(status: int) -> None:
            ok = status == ucp_rma.UCS_OK
            on_done(None if ok else PeerDiedError(f"flush to {peer}: {ucp_rma.status_text(status)}"))

        ucp_tag.flush(self._handle, self._conn.worker_handle, flushed)

    def close(self) -> None:
        self._key.close()
