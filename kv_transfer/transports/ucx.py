"""UCX transport on ucxx: listening (on the worker address, not a ucxx listener), connecting, and exposing
the KV tensor for one-sided writes. How its connections work: docs/kv_transfer.md ("The UCX backend").
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve.kv_transfer.config import TransferConfig, puts_over_tcp
from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.transport import Connection, describe
from pdserve.kv_transfer.transports import ucp_rma, ucp_tag
from pdserve.kv_transfer.transports.ucx_connection import CLOSE_PERIOD_NS, CLOSE_PERIOD_S, UcxConnection
from pdserve.kv_transfer.transports.ucx_framing import (
    CHANNEL,
    CHANNEL_BITS,
    CONNECT_TAG,
    LEN,
    MAX_CONNECT_BYTES,
    parse_worker_address,
    worker_address_string,
)
from pdserve.kv_transfer.transports.ucx_puts import memory_of
from pdserve.kv_transfer.transports.ucx_runtime import runtime
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers import cma, cuda_ipc

log = logging.getLogger(__name__)


class UcxTransport:
    def __init__(self, config: TransferConfig) -> None:
        self.loop = asyncio.get_running_loop()
        self._config = config
        self.ucxx = runtime.acquire(config)
        self._closed = False
        self._on_connect: Callable[[Connection], None] | None = None
        self._conns: set[UcxConnection] = set()
        self._worker_address = bytes(self.ucxx.get_worker_address())
        self._address = worker_address_string(self._worker_address)
        self._connect_buf = np.empty(LEN.size + MAX_CONNECT_BYTES, dtype=np.uint8)
        self._connect_request: Any = None  # the posted receive of the next connect frame
        self._accepting: set[asyncio.Task[None]] = set()
        self._regions: list[ucp_rma.Registration] = []

    def expose(self, buf: Any, shared_fd: int | None = None) -> RemoteRegion | None:
        if not self._config.rma:
            return None
        address, nbytes, kind = memory_of(buf)
        try:
            reg = ucp_rma.Registration(runtime.context_handle(), address, nbytes, kind)
        except (TransferError, OSError) as exc:
            log.warning("KV tensor not registered for one-sided writes (tagged transfers only): %s", exc)
            return None
        self._regions.append(reg)
        # One host: host memory by cross-memory attach, device memory by CUDA IPC (when exportable).
        ipc = cuda_ipc.export(buf) if self.same_host and kind == ucp_rma.MEMORY_TYPE_CUDA else b""
        local = self.same_host and (kind == ucp_rma.MEMORY_TYPE_HOST or bool(ipc))
        return RemoteRegion(
            key=reg.packed_rkey,
            base=reg.address,
            length=nbytes,
            layer_bytes=0,
            pid=os.getpid() if local else 0,
            host=cma.host_identity() if local else "",
            cuda_ipc=ipc,
            shm_fd=shared_fd if local and shared_fd is not None and not ipc else -1,
        )

    @property
    def rma_over_tcp(self) -> bool | None:
        """True: puts on every endpoint; None: puts where every lane is tcp, tagged messages where
        one is ``cuda_copy`` (device memory staged through the host); False: tagged
        messages where no lane is one-sided."""
        if self._config.rma_over_tcp is True:
            return True
        return None if puts_over_tcp(self._config) else False

    @property
    def same_host(self) -> bool:
        """Peers may share this host: host-memory puts go by cross-memory attach (cma.py)."""
        return self._config.same_host

    @property
    def address(self) -> str:
        """This process's UCX worker address (``ucx-worker:`` + base64): what tickets carry."""
        return self._address

    async def listen(self, on_connect: Callable[[Connection], None]) -> None:
        # No ucxx listener (it takes only a port and binds every interface): peers reach this worker's
        # address, and UCX's TCP transport listens only on UCX_NET_DEVICES (config.apply_ucx_env).
        self._on_connect = on_connect
        self._post_connect_recv()

    def _post_connect_recv(self) -> None:
        if self._closed:
            return
        ucxx = self.ucxx
        runtime.refill_futures()
        # Worker-level: there is no endpoint to the peer yet. Closing the transport drops it.
        self._connect_request = runtime.worker.tag_recv(
            ucxx._lib.arr.Array(self._connect_buf), ucxx.types.Tag(CONNECT_TAG), ucxx.types.TagMaskFull
        )
        self._connect_request.future.add_done_callback(self._connect_received)

    def _rearm(self, delay_s: float = 0.0) -> None:
        """Post the next connect receive; should posting fail, try again (up to every 5 s) rather than
        leave a worker that looks ready but accepts no prefill peer ever again."""
        try:
            self._post_connect_recv()
        except Exception:  # noqa: BLE001 - retried below
            delay_s = min(max(2 * delay_s, 0.1), 5.0)
            log.exception("could not listen for KV connections; trying again in %.1f s", delay_s)
            self.loop.call_later(delay_s, self._rearm, delay_s)

    def _connect_received(self, fut: asyncio.Future[Any]) -> None:
        self._connect_request = None
        exc = None if fut.cancelled() else fut.exception()  # retrieved either way
        if self._closed or fut.cancelled() or isinstance(exc, self.ucxx.exceptions.UCXCanceledError):
            return
        frame = None
        if exc is None:
            (n,) = LEN.unpack_from(self._connect_buf.data)
            if CHANNEL.size < n <= MAX_CONNECT_BYTES:
                frame = bytes(self._connect_buf[LEN.size : LEN.size + n])
        self._rearm()
        if frame is None:
            log.warning("dropped a malformed KV connect frame%s", f": {exc}" if exc else "")
            return
        (channel,) = CHANNEL.unpack_from(frame)
        task = self.loop.create_task(self._accept(channel, frame[CHANNEL.size :]))
        self._accepting.add(task)  # held: the loop keeps only weak refs
        task.add_done_callback(self._accepting.discard)

    async def _accept(self, channel: int, peer_address: bytes) -> None:
        peer = f"prefill peer {channel & 0xFFFFFFFF:08x}"
        try:
            remote = self.ucxx.get_ucx_address_from_buffer(peer_address)
            ep = await self.ucxx.create_endpoint_from_worker_address(remote, endpoint_error_handling=True)
        except Exception as exc:
            log.warning("dropped a KV connection from %s: %s: %s", peer, type(exc).__name__, exc)
            return
        if self._closed or self._on_connect is None:
            ep.abort(period=CLOSE_PERIOD_NS)
            return
        conn = UcxConnection(
            self, ep, peer=peer, channel=channel & ((1 << CHANNEL_BITS) - 1), prefill_side=False
        )
        self._conns.add(conn)
        conn.start()
        conn.post_message(b"")  # the accept: the channel's first frame, empty
        self._on_connect(conn)

    async def connect(self, address: str) -> UcxConnection:
        # A connect frame on the peer's connect tag carries a random channel id and this side's worker
        # address; the peer makes its endpoint back and answers with an empty frame on the channel.
        label = describe(address)
        try:
            blob = parse_worker_address(address)
        except ValueError as exc:
            raise PeerDiedError(f"cannot connect to {label}: {exc}") from exc
        timeout = self._config.connect_timeout_s
        try:
            remote = self.ucxx.get_ucx_address_from_buffer(blob)
            ep = await self.ucxx.create_endpoint_from_worker_address(remote, endpoint_error_handling=True)
        except Exception as exc:
            raise PeerDiedError(f"cannot connect to {label}: {type(exc).__name__}: {exc}") from exc
        channel = secrets.randbits(CHANNEL_BITS) or 1
        conn = UcxConnection(self, ep, peer=label, channel=channel, prefill_side=True)
        accepted = conn.accepted = self.loop.create_future()
        self._conns.add(conn)
        conn.start()
        conn.post_frame(
            CONNECT_TAG,
            LEN.pack(CHANNEL.size + len(self._worker_address)) + CHANNEL.pack(channel) + self._worker_address,
        )
        try:
            await asyncio.wait_for(asyncio.shield(accepted), timeout)
        except TimeoutError as exc:
            conn.close()
            raise PeerDiedError(f"no answer from {label} within {timeout}s") from exc
        return conn

    def forget(self, conn: UcxConnection) -> None:
        self._conns.discard(conn)

    def next_transfer_id(self) -> int:
        return runtime.next_transfer_id()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._connect_request = None  # dropping it cancels the receive
        for task in list(self._accepting):
            task.cancel()
        closing = list(self._conns)
        for conn in closing:
            conn.close()
        # Let the closed frames go out (bounded), then the close callbacks and cancelled requests run.
        end = self.loop.time() + CLOSE_PERIOD_S
        while any(not conn.aborted for conn in closing) and self.loop.time() < end:
            await asyncio.sleep(0.005)
        for conn in closing:
            conn.abort()
        await asyncio.sleep(0.01)
        # Cancelled and failed control requests are freed on this loop: let them be, before the
        # worker can go (bounded: a request UCX never completes is left to the process's end).
        end = self.loop.time() + CLOSE_PERIOD_S
        while ucp_tag.pending() and self.loop.time() < end:
            await asyncio.sleep(0.002)
        for reg in self._regions:
            reg.close()
        self._regions.clear()
        runtime.release()
