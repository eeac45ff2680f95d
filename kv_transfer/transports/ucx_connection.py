"""One side of a UCX connection: its endpoint to the peer, the control frames on the channel's two tags,
tagged KV sends and receives, and the writer it offers for one-sided writes.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Protocol

import numpy as np

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.transport import (
    CloseHandler,
    DoneCallback,
    MessageHandler,
    RemoteWriter,
)
from pdserve.kv_transfer.transports import ucp_rma, ucp_tag
from pdserve.kv_transfer.transports.ucx_framing import (
    CLOSED,
    CLOSED_FRAME,
    CONTROL,
    LEN,
    MAX_CONTROL_BYTES,
    TO_PREFILL,
)
from pdserve.kv_transfer.transports.ucx_puts import PutWriter
from pdserve.kv_transfer.transports.ucx_runtime import runtime, ucx_buffer
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers import select

log = logging.getLogger(__name__)

# Endpoint close waits at most this long (ns) for UCX to flush; a dead peer must not stall the loop.
CLOSE_PERIOD_NS = 100_000_000
CLOSE_PERIOD_S = CLOSE_PERIOD_NS / 1e9


class Owner(Protocol):
    """What a connection needs of its transport (``ucx.UcxTransport``)."""

    loop: asyncio.AbstractEventLoop
    ucxx: Any

    @property
    def same_host(self) -> bool: ...

    @property
    def rma_over_tcp(self) -> bool | None: ...

    def forget(self, conn: UcxConnection) -> None: ...


class _UcxOp:
    """One tagged send or receive. Holds the ucxx request, and so the operation, alive."""

    __slots__ = ("_conn", "_request", "_keep", "_on_done")

    def __init__(self, conn: UcxConnection, request: Any, keep: Any, on_done: DoneCallback) -> None:
        self._conn = conn
        self._request = request
        self._keep = keep  # the buffer, until UCX is done with it
        self._on_done: DoneCallback | None = on_done
        # ucxx's notifier sets this future on the loop; the callback then runs one iteration later.
        request.future.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self._request = self._keep = None
        on_done, self._on_done = self._on_done, None
        if on_done is None:
            return
        if fut.cancelled():
            on_done(TransferError("cancelled"))
            return
        exc = fut.exception()
        on_done(None if exc is None else self._conn.translate(exc))

    def cancel(self) -> None:
        # ucxx cancels a request when its last Python reference goes; on_done still
        # comes: cancelled, or completed if the data was already moving.
        self._request = None


class _FailedOp:
    def __init__(self, loop: asyncio.AbstractEventLoop, exc: TransferError, on_done: DoneCallback) -> None:
        loop.call_soon(on_done, exc)

    def cancel(self) -> None:
        pass


class UcxConnection:
    """One side of a connection: its own endpoint to the peer (control and data, with peer-failure
    handling) and the channel's two control tags."""

    def __init__(
        self,
        transport: Owner,
        ep: Any,
        peer: str,
        channel: int,
        *,
        prefill_side: bool,
    ) -> None:
        self.loop = transport.loop
        self._transport = transport
        self._ucxx = transport.ucxx
        self._ep = ep
        self._peer = peer
        self._send_tag = CONTROL | channel | (0 if prefill_side else TO_PREFILL)
        self._recv_tag = CONTROL | channel | (TO_PREFILL if prefill_side else 0)
        self._alive = True
        self._aborted = False
        self._on_message: MessageHandler | None = None
        self._on_close: CloseHandler | None = None
        self._backlog: list[bytes] = []
        self._rbuf = np.empty(LEN.size + MAX_CONTROL_BYTES, dtype=np.uint8)
        self._recv_op: ucp_tag.Op | None = None  # the posted receive of the next control frame
        self._ep_handle = int(ep._ep.handle)  # ucp_ep_h, for the control frames (ucp_tag.py)
        self.worker_handle = int(runtime.worker.handle)
        # Prefill side, while connecting: the decode side's first (empty) frame resolves it.
        self.accepted: asyncio.Future[None] | None = None
        self._writers: list[RemoteWriter] = []
        ep.set_close_callback(self._close_callback)

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def aborted(self) -> bool:
        return self._aborted

    def start(self) -> None:
        self._post_recv()

    def set_handlers(self, on_message: MessageHandler, on_close: CloseHandler) -> None:
        self._on_message, self._on_close = on_message, on_close
        backlog, self._backlog = self._backlog, []
        for payload in backlog:
            on_message(payload)

    # Control frames are read with a callback, not a reader task: a task costs one more loop
    # iteration per message, and Open and CompleteAck sit on a transfer's critical path. They go
    # straight on libucp (ucp_tag.py), not through ucxx's notifier thread.
    def _post_recv(self) -> None:
        try:
            self._recv_op = ucp_tag.recv(self.worker_handle, self._rbuf, self._recv_tag, self._received)
        except Exception as exc:
            self._broken(PeerDiedError(f"connection to {self._peer} broke: {exc}"), tell_peer=False)

    def _received(self, status: int, length: int) -> None:
        self._recv_op = None
        if not self._alive:
            return
        if status != ucp_rma.UCS_OK:
            why = ucp_rma.status_text(status)
            self._broken(PeerDiedError(f"connection to {self._peer} broke: {why}"))
            return
        n = LEN.unpack_from(self._rbuf.data)[0] if length >= LEN.size else -1
        if n == CLOSED:
            self._broken(PeerDiedError(f"{self._peer} closed the connection"), tell_peer=False)
            return
        if not 0 <= n <= min(MAX_CONTROL_BYTES, length - LEN.size):
            self._broken(PeerDiedError(f"{self._peer} sent a malformed frame ({length} bytes)"))
            return
        payload = bytes(self._rbuf[LEN.size : LEN.size + n])  # copied out before the buffer is reused
        # The message first, the next receive after: an answer (CompleteAck to Complete) goes out
        # sooner, and a frame arriving meanwhile waits in UCX's unexpected queue, in order. The receive
        # is posted from the loop's next callback, not here: a coroutine the message resumed (complete()
        # on CompleteAck) runs first, where posting here (a call into UCX, which waits for the worker's
        # lock, held by the progress thread that just delivered the frame) would sit between the ack and
        # its waiter.
        try:
            self._dispatch(payload)
        finally:
            if self._alive:
                self.loop.call_soon(self._repost)

    def _repost(self) -> None:
        if self._alive and self._recv_op is None:
            self._post_recv()

    def _dispatch(self, payload: bytes) -> None:
        if self.accepted is not None:  # the prefill side's first frame: the accept, empty
            accepted, self.accepted = self.accepted, None
            if payload:
                self._broken(PeerDiedError(f"{self._peer} did not accept the connection"))
            elif not accepted.done():
                accepted.set_result(None)
            return
        if self._on_message is None:
            self._backlog.append(payload)
        else:
            self._on_message(payload)

    def _close_callback(self) -> None:
        # Runs on the UCX progress thread.
        try:
            self.loop.call_soon_threadsafe(
                partial(self._broken, PeerDiedError(f"UCX endpoint to {self._peer} failed"), tell_peer=False)
            )
        except RuntimeError:  # loop already closed at shutdown
            pass

    def translate(self, exc: BaseException) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        if isinstance(exc, self._ucxx.exceptions.UCXCanceledError) and self._alive:
            return TransferError("cancelled")
        return PeerDiedError(f"connection to {self._peer}: {type(exc).__name__}: {exc}")

    def post_message(self, payload: bytes) -> None:
        if not self._alive:
            raise PeerDiedError(f"connection to {self._peer} is closed")
        if len(payload) > MAX_CONTROL_BYTES:
            self._broken(
                TransferError(f"a control message of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
            )
            return
        self.post_frame(self._send_tag, LEN.pack(len(payload)) + payload)

    def post_frame(self, tag: int, frame: bytes) -> None:
        """Submit one frame now (not in a task: a control message is often on the critical path,
        Complete -> CompleteAck, and a task costs a loop iteration)."""
        buf = np.frombuffer(frame, dtype=np.uint8)
        try:
            ucp_tag.send(self._ep_handle, self.worker_handle, buf, tag, self._message_sent)
        except Exception as exc:
            self._broken(self.translate(exc), tell_peer=False)

    def _message_sent(self, status: int) -> None:
        if status != ucp_rma.UCS_OK:
            why = ucp_rma.status_text(status)
            self._broken(PeerDiedError(f"control message to {self._peer} failed: {why}"), tell_peer=False)

    def send_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _UcxOp | _FailedOp:
        if not self._alive:
            return _FailedOp(self.loop, PeerDiedError(f"connection to {self._peer} is closed"), on_done)
        ucxx = self._ucxx
        runtime.refill_futures()
        try:
            request = self._ep._ep.tag_send(ucx_buffer(ucxx, buf), ucxx.types.Tag(tag))
        except Exception as exc:  # the endpoint failed under us: same as a failed send
            return _FailedOp(self.loop, self.translate(exc), on_done)
        return _UcxOp(self, request, buf, on_done)

    def recv_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _UcxOp | _FailedOp:
        if not self._alive:
            return _FailedOp(self.loop, PeerDiedError(f"connection to {self._peer} is closed"), on_done)
        ucxx = self._ucxx
        runtime.refill_futures()
        # Matching is per worker: this also receives what the peer sends on its own endpoints, and
        # messages that arrived before this receive was posted. Posted on this side's endpoint, so
        # that aborting it cancels the receive.
        try:
            request = self._ep._ep.tag_recv(
                ucx_buffer(ucxx, buf), ucxx.types.Tag(tag), ucxx.types.TagMaskFull
            )
        except Exception as exc:
            return _FailedOp(self.loop, self.translate(exc), on_done)
        return _UcxOp(self, request, buf, on_done)

    def remote_writer(self, region: RemoteRegion, local: Any = None) -> RemoteWriter | None:
        if not self._alive:
            return None
        writer = select.open_same_host_writer(region, local, self._transport.same_host, self._peer)
        if writer is None:
            rma_over_tcp = self._transport.rma_over_tcp
            # The lanes are asked for only where puts are not on regardless.
            lanes = ucp_rma.endpoint_transports(self._ep_handle) if rma_over_tcp is not True else []
            if select.tagged_instead_of_puts(lanes, rma_over_tcp):
                log.info(
                    "KV to %s: tagged messages, not puts (every UCX lane is %s)", self._peer, lanes[0][0]
                )
                return None
            try:
                writer = PutWriter(self, self._ep, region)
            except (TransferError, OSError, AttributeError) as exc:
                log.warning("no one-sided writes to %s: %s", self._peer, exc)
                return None
        self._writers.append(writer)
        return writer

    def close(self) -> None:
        self._broken(PeerDiedError(f"connection to {self._peer} closed locally"))

    def _broken(self, exc: Exception, tell_peer: bool = True) -> None:
        """End the connection once. ``tell_peer``: send the closed frame first (the peer's own
        endpoint to this side stays up when this side aborts its endpoints)."""
        if not self._alive:
            return
        self._alive = False
        if self._recv_op is not None:  # its on_done still comes (and frees the request)
            self._recv_op.cancel()
            self._recv_op = None
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_exception(exc if isinstance(exc, TransferError) else PeerDiedError(str(exc)))
            self.accepted.exception()  # retrieved: connect() may have stopped waiting
        sent = False
        if tell_peer:
            try:
                ucp_tag.send(
                    self._ep_handle,
                    self.worker_handle,
                    CLOSED_FRAME,
                    self._send_tag,
                    self._closed_frame_sent,
                )
                sent = True
            except Exception as send_exc:
                log.debug("closed frame to %s: %s", self._peer, send_exc)
        if not sent:
            self.abort()
        else:
            # Aborting now would cancel the frame: abort once it is out, or after the close period.
            self.loop.call_later(CLOSE_PERIOD_S, self.abort)
        self._transport.forget(self)
        if self._on_close is not None:
            self.loop.call_soon(self._on_close, exc)

    def _closed_frame_sent(self, status: int) -> None:
        self.abort()  # whatever the status: a peer that is gone already is no news

    def abort(self) -> None:
        """Abort both endpoints (once): cancels every request still in flight on them."""
        if self._aborted:
            return
        self._aborted = True
        for writer in self._writers:  # remote keys go before their endpoint
            writer.close()
        self._writers.clear()
        try:
            self._ep.abort(period=CLOSE_PERIOD_NS)
        except Exception as close_exc:
            log.debug("endpoint abort: %s", close_exc)
