"""UCX backend on ucxx: the only module of pdserve that imports ucxx (the benchmark's
raw baseline in ucx_baseline.py borrows the module object from this runtime).

Connections: no listener. ucxx's listener takes only a port and binds every
interface, so instead the decode side's address is its UCX *worker address*
(``ucx-worker:`` + base64, carried in the transfer ticket), and the prefill
side creates an endpoint to it. UCX's TCP transport then listens only on the
devices in ``UCX_NET_DEVICES``, which ``config.apply_ucx_env`` sets from the
worker's ``--host`` (``lo`` on loopback) or ``--kv-interface``.

A connection is a pair of endpoints, one each way, both with UCX peer-failure
error handling: UCX fails their operations and calls their close callbacks
when the peer dies (kill -9 included), which is how both sides detect peer
death without waiting for a deadline. The prefill side P opens with a
``connect`` frame on the decode worker's connect tag, carrying a random
channel id and P's own worker address; the decode side D makes its endpoint
back from that address and answers with an empty frame on the channel.

Control messages are tagged messages on the channel's two tags (``_tag``),
framed with their length and received into one buffer per connection. They go
straight on libucp (ucp_tag.py: completions reach the loop in one hop, where
ucxx's notifier thread takes two hops and three loop iterations); a UCX receive
is the worker's, not an endpoint's, so breaking a connection cancels its
posted receive. KV data
uses tagged messages posted straight into the KV tensor (rendezvous above
``UCX_RNDV_THRESH``, so no staging copy). Tag matching is per UCX worker, not
per endpoint: a receive matches what the peer sent on any endpoint.
Closing one side's endpoint does not tell the peer (they are two endpoints),
so a local close first sends a ``closed`` frame.

One-sided writes (RMA, protocol 3): the decode side maps its KV tensor with
UCX once (``expose``, ucp_rma.py) and the prefill side unpacks the remote key
on its endpoint (``remote_writer``) and puts into it. The receiver's own
memory (torch's allocation) works for every transport, so the KV tensor needs
no UCX allocation.

One host (``TransferConfig.same_host``): UCX 1.21 never uses its
shared-memory transports (cma, posix, sysv) on an endpoint with peer-failure
handling (puts there are emulated over tcp), and on an endpoint without it a
put or rendezvous read that meets a dead peer aborts the whole process. So
pdserve keeps every endpoint error-handled, and a sender on the receiver's
host writes host memory itself by cross-memory attach (cma.py), falling back
to UCX's puts where the kernel does not permit it.

ucxx runtime: one application context per process, created on first use
inside the running event loop (its Python futures belong to that loop), with a
progress thread and Python-future notification, so waiting costs no polling.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import logging
import os
import random
import secrets
import struct
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from pdserve.kv_transfer.config import TransferConfig, apply_ucx_env, puts_over_tcp
from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.kvbuf import as_bytes
from pdserve.kv_transfer.plan import MAX_TRANSFER_ID
from pdserve.kv_transfer.transport import (
    CloseHandler,
    Connection,
    DoneCallback,
    MessageHandler,
    RemoteWriter,
    describe,
)
from pdserve.kv_transfer.transports import cma, cuda_ipc, shm, ucp_rma, ucp_tag
from pdserve.kv_transfer.wire import RemoteRegion

log = logging.getLogger(__name__)

# Endpoint close waits at most this long (ns) for UCX to flush; a dead peer must not stall the loop.
_CLOSE_PERIOD_NS = 100_000_000
_CLOSE_PERIOD_S = _CLOSE_PERIOD_NS / 1e9

ADDRESS_PREFIX = "ucx-worker:"

# Control tags (bit 63 clear; KV data tags set it, plan.py):
#   bit 62      1: control
#   bit 61      direction: 1 towards the prefill side
#   bits 0-60   channel id, random per connection; 0: the decode side's queue of connect frames
_CONTROL = 1 << 62
_TO_PREFILL = 1 << 61
_CHANNEL_BITS = 61
_CONNECT_TAG = _CONTROL

# Frames: a little-endian u32 payload length, then the payload. _CLOSED in place of a length: the peer
# closed the connection. An Open with the tag layout's 65,536 segment lengths is ~200 KB of msgpack.
_LEN = struct.Struct("<I")
_CLOSED = 0xFFFFFFFF
MAX_CONTROL_BYTES = 1 << 20
# Transports whose puts UCX carries as messages (no one-sided hardware path between processes):
# an endpoint made only of these moves KV as tagged messages unless puts over tcp are on
# (TransferConfig.rma_over_tcp; by default on when every lane is tcp with 64 KB segments).
_NO_RMA_HARDWARE = frozenset({"tcp", "cuda_copy", "rocm_copy"})
_CLOSED_FRAME = np.frombuffer(_LEN.pack(_CLOSED), dtype=np.uint8)
# A connect frame's payload: the channel id, then the prefill side's UCX worker address.
_CHANNEL = struct.Struct("<Q")
_MAX_CONNECT_BYTES = 1 << 16


def worker_address_string(blob: bytes) -> str:
    return ADDRESS_PREFIX + base64.urlsafe_b64encode(blob).decode()


def parse_worker_address(address: str) -> bytes:
    """The UCX worker address blob in a ``ucx-worker:`` address; ValueError if it is not one."""
    if not address.startswith(ADDRESS_PREFIX):
        raise ValueError(f"not a UCX worker address: {address[:40]!r}")
    try:
        blob = base64.urlsafe_b64decode(address.removeprefix(ADDRESS_PREFIX).encode())
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"bad UCX worker address: {exc}") from exc
    if not blob or len(blob) > _MAX_CONNECT_BYTES - _CHANNEL.size:
        raise ValueError(f"bad UCX worker address: {len(blob)} bytes")
    return blob


class _Runtime:
    """Reference-counted ucxx context (ucxx itself keeps one per process)."""

    def __init__(self) -> None:
        self.users = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ucxx: Any = None
        self.worker: Any = None
        # A random start keeps a restarted process from reusing recent transfer ids.
        self._ids = itertools.count(random.randrange(1, MAX_TRANSFER_ID // 2))

    def acquire(self, config: TransferConfig) -> Any:
        """The ucxx module, started on first use; UCX's devices follow the first user's ``config``."""
        loop = asyncio.get_running_loop()
        if self.users == 0:
            apply_ucx_env(config)
            import ucxx

            try:
                ucxx.init(progress_mode="thread", enable_python_future=True)
            except RuntimeError:
                log.info("ucxx was already initialised by someone else in this process")
            if not ucxx.core._get_ctx().worker.enable_python_future:  # ucxx offers no public accessor
                raise RuntimeError("kv_transfer needs ucxx with Python-future notification enabled")
            self.ucxx, self.loop = ucxx, loop
            self.worker = ucxx.core._get_ctx().worker
            ucxx.continuous_ucx_progress()  # the progress thread; a worker-level receive needs it running
        elif loop is not self.loop:
            raise RuntimeError("ucxx is bound to the event loop it started in; use one loop per process")
        self.users += 1
        return self.ucxx

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        ucxx, worker = self.ucxx, self.worker
        self.ucxx, self.loop, self.worker = None, None, None
        # The notifier thread must stop while its loop still exists, else exit hangs. It reads ucxx's
        # shutdown message only between waits of a second: waking its wait first makes a close (every
        # worker's stop, each scale-down) a second shorter.
        worker.stop_request_notifier_thread()
        ucxx.stop_notifier_thread()
        try:
            ucxx.reset()
        except Exception as exc:  # objects still referenced: UCX is torn down at exit instead
            log.warning("ucxx.reset() failed: %s", exc)

    def next_transfer_id(self) -> int:
        return next(self._ids) % MAX_TRANSFER_ID + 1

    def context_handle(self) -> int:
        """The process's ucp_context_h, for memory registration (ucp_rma.py)."""
        return int(self.ucxx.core._get_ctx().context.handle)

    def refill_futures(self) -> None:
        # Every request takes a Python future from a pool of 100 that the notifier
        # thread refills only now and then; a transfer posts hundreds at once, so top
        # it up here (a no-op above 50 left) instead of letting ucxx warn per request.
        self.worker.populate_python_futures_pool()


_runtime = _Runtime()


def _ucx_buffer(ucxx: Any, buf: Any) -> Any:
    if isinstance(buf, np.ndarray):  # host memory, from kvbuf.KVSpans: the hot path
        return ucxx._lib.arr.Array(buf)
    raw = as_bytes(buf)  # [nbytes]
    # Host memory goes through numpy's buffer protocol; device memory through __cuda_array_interface__.
    return ucxx._lib.arr.Array(raw.numpy() if raw.device.type == "cpu" else raw)


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


def _address_of(buf: Any) -> tuple[int, int, int]:
    """(address, bytes, UCX memory type) of a contiguous uint8 numpy array or torch tensor."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data, buf.nbytes, ucp_rma.MEMORY_TYPE_HOST
    kind = ucp_rma.MEMORY_TYPE_CUDA if buf.device.type == "cuda" else ucp_rma.MEMORY_TYPE_HOST
    return buf.data_ptr(), buf.numel() * buf.element_size(), kind


class _RemoteWriter:
    """Puts on a connection's data endpoint into the peer's exposed region (event loop thread only)."""

    synchronous = False
    direct = False
    path = "puts"

    def check(self) -> TransferError | None:
        raise NotImplementedError("puts complete asynchronously: flush")

    def __init__(self, conn: UcxConnection, ep: Any, region: RemoteRegion) -> None:
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


class UcxConnection:
    """One side of a connection: its own endpoint to the peer (control and data, with peer-failure
    handling) and the channel's two control tags."""

    def __init__(
        self,
        transport: UcxTransport,
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
        self._send_tag = _CONTROL | channel | (0 if prefill_side else _TO_PREFILL)
        self._recv_tag = _CONTROL | channel | (_TO_PREFILL if prefill_side else 0)
        self._alive = True
        self._aborted = False
        self._on_message: MessageHandler | None = None
        self._on_close: CloseHandler | None = None
        self._backlog: list[bytes] = []
        self._rbuf = np.empty(_LEN.size + MAX_CONTROL_BYTES, dtype=np.uint8)
        self._recv_op: ucp_tag.Op | None = None  # the posted receive of the next control frame
        self._ep_handle = int(ep._ep.handle)  # ucp_ep_h, for the control frames (ucp_tag.py)
        self.worker_handle = int(_runtime.worker.handle)
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
        n = _LEN.unpack_from(self._rbuf.data)[0] if length >= _LEN.size else -1
        if n == _CLOSED:
            self._broken(PeerDiedError(f"{self._peer} closed the connection"), tell_peer=False)
            return
        if not 0 <= n <= min(MAX_CONTROL_BYTES, length - _LEN.size):
            self._broken(PeerDiedError(f"{self._peer} sent a malformed frame ({length} bytes)"))
            return
        payload = bytes(self._rbuf[_LEN.size : _LEN.size + n])  # copied out before the buffer is reused
        # The message first, the next receive after: an answer (CompleteAck to Complete) goes out
        # sooner, and a frame arriving meanwhile waits in UCX's unexpected queue, in order. The receive
        # is posted from the loop's next callback, not here: a coroutine the message resumed (complete()
        # on CompleteAck) runs first, where posting (a call into UCX, which waits for the worker's lock,
        # held by the progress thread that just delivered the frame) sat between the ack and its waiter.
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
        self.post_frame(self._send_tag, _LEN.pack(len(payload)) + payload)

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
        _runtime.refill_futures()
        try:
            request = self._ep._ep.tag_send(_ucx_buffer(ucxx, buf), ucxx.types.Tag(tag))
        except Exception as exc:  # the endpoint failed under us: same as a failed send
            return _FailedOp(self.loop, self.translate(exc), on_done)
        return _UcxOp(self, request, buf, on_done)

    def recv_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _UcxOp | _FailedOp:
        if not self._alive:
            return _FailedOp(self.loop, PeerDiedError(f"connection to {self._peer} is closed"), on_done)
        ucxx = self._ucxx
        _runtime.refill_futures()
        # Matching is per worker: this also receives what the peer sends on its own endpoints, and
        # messages that arrived before this receive was posted. Posted on this side's endpoint, so
        # that aborting it cancels the receive.
        try:
            request = self._ep._ep.tag_recv(
                _ucx_buffer(ucxx, buf), ucxx.types.Tag(tag), ucxx.types.TagMaskFull
            )
        except Exception as exc:
            return _FailedOp(self.loop, self.translate(exc), on_done)
        return _UcxOp(self, request, buf, on_done)

    def remote_writer(self, region: RemoteRegion, local: Any = None) -> RemoteWriter | None:
        if not self._alive:
            return None
        writer: RemoteWriter | None = None
        path = cma.same_host_path(region, local, self._transport.same_host)
        if path == "cross_memory" and region.shm_fd >= 0:
            try:
                writer = shm.ShmWriter.open(region)
                log.info("KV to %s: plain copies into its shared KV cache (pid %d)", self._peer, region.pid)
            except TransferError as exc:  # not permitted, or gone: cross-memory writes instead
                log.info("no shared KV cache of %s to map (%s); cross-memory writes instead", self._peer, exc)
        if path == "cross_memory" and writer is None:
            try:
                writer = cma.CmaWriter.open(region)
                log.info("KV to %s: one-sided writes by cross-memory attach (pid %d)", self._peer, region.pid)
            except TransferError as exc:  # another host, or not permitted: UCX's puts instead
                log.info("no cross-memory writes to %s (%s); UCX puts instead", self._peer, exc)
        elif path == "cuda_ipc":
            try:
                writer = cuda_ipc.CudaIpcWriter.open(region, local)
                log.info("KV to %s: one-sided writes by CUDA IPC (pid %d)", self._peer, region.pid)
            except TransferError as exc:  # another host, another GPU set: UCX's puts instead
                log.info("no CUDA IPC writes to %s (%s); UCX puts instead", self._peer, exc)
        if writer is None and self._transport.rma_over_tcp is not True:
            lanes = ucp_rma.endpoint_transports(self._ep_handle)
            tcp_puts = self._transport.rma_over_tcp is None and all(tl == "tcp" for tl, _ in lanes)
            if lanes and all(tl in _NO_RMA_HARDWARE for tl, _ in lanes) and not tcp_puts:
                log.info(
                    "KV to %s: tagged messages, not puts (every UCX lane is %s)", self._peer, lanes[0][0]
                )
                return None
        if writer is None:
            try:
                writer = _RemoteWriter(self, self._ep, region)
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
                    _CLOSED_FRAME,
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
            self.loop.call_later(_CLOSE_PERIOD_S, self.abort)
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
            self._ep.abort(period=_CLOSE_PERIOD_NS)
        except Exception as close_exc:
            log.debug("endpoint abort: %s", close_exc)


class UcxTransport:
    def __init__(self, config: TransferConfig) -> None:
        self.loop = asyncio.get_running_loop()
        self._config = config
        self.ucxx = _runtime.acquire(config)
        self._closed = False
        self._on_connect: Callable[[Connection], None] | None = None
        self._conns: set[UcxConnection] = set()
        self._worker_address = bytes(self.ucxx.get_worker_address())
        self._address = worker_address_string(self._worker_address)
        self._connect_buf = np.empty(_LEN.size + _MAX_CONNECT_BYTES, dtype=np.uint8)
        self._connect_request: Any = None  # the posted receive of the next connect frame
        self._accepting: set[asyncio.Task[None]] = set()
        self._regions: list[ucp_rma.Registration] = []

    def expose(self, buf: Any, shared_fd: int | None = None) -> RemoteRegion | None:
        if not self._config.rma:
            return None
        address, nbytes, kind = _address_of(buf)
        try:
            reg = ucp_rma.Registration(_runtime.context_handle(), address, nbytes, kind)
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
        one is ``cuda_copy`` (device memory staged through the host: unmeasured); False: tagged
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
        self._on_connect = on_connect
        self._post_connect_recv()

    def _post_connect_recv(self) -> None:
        if self._closed:
            return
        ucxx = self.ucxx
        _runtime.refill_futures()
        # Worker-level: there is no endpoint to the peer yet. Closing the transport drops it.
        self._connect_request = _runtime.worker.tag_recv(
            ucxx._lib.arr.Array(self._connect_buf), ucxx.types.Tag(_CONNECT_TAG), ucxx.types.TagMaskFull
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
            (n,) = _LEN.unpack_from(self._connect_buf.data)
            if _CHANNEL.size < n <= _MAX_CONNECT_BYTES:
                frame = bytes(self._connect_buf[_LEN.size : _LEN.size + n])
        self._rearm()
        if frame is None:
            log.warning("dropped a malformed KV connect frame%s", f": {exc}" if exc else "")
            return
        (channel,) = _CHANNEL.unpack_from(frame)
        task = self.loop.create_task(self._accept(channel, frame[_CHANNEL.size :]))
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
            ep.abort(period=_CLOSE_PERIOD_NS)
            return
        conn = UcxConnection(
            self, ep, peer=peer, channel=channel & ((1 << _CHANNEL_BITS) - 1), prefill_side=False
        )
        self._conns.add(conn)
        conn.start()
        conn.post_message(b"")  # the accept: the channel's first frame, empty
        self._on_connect(conn)

    async def connect(self, address: str) -> UcxConnection:
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
        channel = secrets.randbits(_CHANNEL_BITS) or 1
        conn = UcxConnection(self, ep, peer=label, channel=channel, prefill_side=True)
        accepted = conn.accepted = self.loop.create_future()
        self._conns.add(conn)
        conn.start()
        conn.post_frame(
            _CONNECT_TAG,
            _LEN.pack(_CHANNEL.size + len(self._worker_address))
            + _CHANNEL.pack(channel)
            + self._worker_address,
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
        return _runtime.next_transfer_id()

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
        end = self.loop.time() + _CLOSE_PERIOD_S
        while any(not conn.aborted for conn in closing) and self.loop.time() < end:
            await asyncio.sleep(0.005)
        for conn in closing:
            conn.abort()
        await asyncio.sleep(0.01)
        # Cancelled and failed control requests are freed on this loop: let them be, before the
        # worker can go (bounded: a request UCX never completes is left to the process's end).
        end = self.loop.time() + _CLOSE_PERIOD_S
        while ucp_tag.pending() and self.loop.time() < end:
            await asyncio.sleep(0.002)
        for reg in self._regions:
            reg.close()
        self._regions.clear()
        _runtime.release()


def parse_address(address: str) -> tuple[str, int]:
    """``ucx://host:port``: a listener's address (the raw baseline's, testing/baseline.py)."""
    if not address.startswith("ucx://"):
        raise ValueError(f"not a UCX address: {address!r}")
    host, _, port = address.removeprefix("ucx://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad UCX address: {address!r}")
    return host.strip("[]"), int(port)
