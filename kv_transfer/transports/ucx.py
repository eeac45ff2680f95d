"""UCX backend on ucxx: the only module of pdserve that imports ucxx (the benchmark's
raw baseline in ucx_baseline.py borrows the module object from this runtime).

Connections: the prefill side connects to the decode side's listener, which
gives a control endpoint with UCX peer-failure error handling: UCX fails its
operations and calls its close callback when the peer dies (kill -9 included),
which is how both sides detect peer death without waiting for a deadline.
Control messages use active messages (``am_send``/``am_recv``); KV data uses
tagged messages posted straight into the KV tensor (rendezvous above
``UCX_RNDV_THRESH``, so no staging copy).

Shared memory: UCX 1.21 leaves posix/cma out of endpoints with peer-failure
handling, so with ``TransferConfig.ucx_shared_memory`` data moves on a second
endpoint, made from the listener's UCX worker address (sent as the first
message of every connection) without error handling. Its peer's death still
shows on the control endpoint, which then aborts the data endpoint.

ucxx runtime: one application context per process, created on first use
inside the running event loop (its Python futures belong to that loop), with a
progress thread and Python-future notification, so waiting costs no polling.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from pdserve.kv_transfer.config import TransferConfig, apply_ucx_env_defaults
from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.kvbuf import as_bytes
from pdserve.kv_transfer.plan import MAX_TRANSFER_ID
from pdserve.kv_transfer.transport import CloseHandler, Connection, DoneCallback, MessageHandler

log = logging.getLogger(__name__)

# Endpoint close waits at most this long (ns) for UCX to flush; a dead peer must not stall the loop.
_CLOSE_PERIOD_NS = 100_000_000


class _Runtime:
    """Reference-counted ucxx context (ucxx itself keeps one per process)."""

    def __init__(self) -> None:
        self.users = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ucxx: Any = None
        self.worker: Any = None
        # A random start keeps a restarted process from reusing recent transfer ids.
        self._ids = itertools.count(random.randrange(1, MAX_TRANSFER_ID // 2))

    def acquire(self) -> Any:
        loop = asyncio.get_running_loop()
        if self.users == 0:
            apply_ucx_env_defaults()
            import ucxx

            try:
                ucxx.init(progress_mode="thread", enable_python_future=True)
            except RuntimeError:
                log.info("ucxx was already initialised by someone else in this process")
            if not ucxx.core._get_ctx().worker.enable_python_future:  # ucxx offers no public accessor
                raise RuntimeError("kv_transfer needs ucxx with Python-future notification enabled")
            self.ucxx, self.loop = ucxx, loop
            self.worker = ucxx.core._get_ctx().worker
        elif loop is not self.loop:
            raise RuntimeError("ucxx is bound to the event loop it started in; use one loop per process")
        self.users += 1
        return self.ucxx

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        ucxx, self.ucxx, self.loop, self.worker = self.ucxx, None, None, None
        # The notifier thread must stop while its loop still exists, else exit hangs.
        ucxx.stop_notifier_thread()
        try:
            ucxx.reset()
        except Exception as exc:  # objects still referenced: UCX is torn down at exit instead
            log.warning("ucxx.reset() failed: %s", exc)

    def next_transfer_id(self) -> int:
        return next(self._ids) % MAX_TRANSFER_ID + 1

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


class UcxConnection:
    def __init__(self, transport: UcxTransport, ep: Any, peer: str, data_ep: Any = None) -> None:
        self.loop = transport.loop
        self._transport = transport
        self._ucxx = transport.ucxx
        self._ep = ep
        self._data_ep = data_ep if data_ep is not None else ep
        self._peer = peer
        self._alive = True
        self._on_message: MessageHandler | None = None
        self._on_close: CloseHandler | None = None
        self._backlog: list[bytes] = []
        self._am_request: Any = None  # the posted receive of the next control message
        self._outbox: dict[int, tuple[Any, np.ndarray]] = {}
        ep.set_close_callback(self._close_callback)

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self) -> None:
        self._post_am_recv()

    def set_handlers(self, on_message: MessageHandler, on_close: CloseHandler) -> None:
        self._on_message, self._on_close = on_message, on_close
        backlog, self._backlog = self._backlog, []
        for payload in backlog:
            on_message(payload)

    # Control messages are read with a callback, not a reader task: a task costs one more
    # loop iteration per message, and Open and CompleteAck sit on a transfer's critical path.
    def _post_am_recv(self) -> None:
        try:
            self._am_request = self._ep._ep.am_recv()
        except Exception as exc:
            self._broken(PeerDiedError(f"connection to {self._peer} broke: {exc}"))
            return
        self._am_request.future.add_done_callback(self._am_received)

    def _am_received(self, fut: asyncio.Future[Any]) -> None:
        request, self._am_request = self._am_request, None
        if not self._alive:
            return
        exc = TransferError("cancelled") if fut.cancelled() else fut.exception()
        if exc is not None:
            self._broken(PeerDiedError(f"connection to {self._peer} broke: {exc}"))
            return
        payload = bytes(request.recv_buffer)
        self._post_am_recv()
        if self._on_message is None:
            self._backlog.append(payload)
        else:
            self._on_message(payload)

    def _close_callback(self) -> None:
        # Runs on the UCX progress thread.
        try:
            self.loop.call_soon_threadsafe(
                self._broken, PeerDiedError(f"UCX endpoint to {self._peer} failed")
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
        buf = np.frombuffer(payload, dtype=np.uint8)
        _runtime.refill_futures()
        try:
            # Submitted here, not in a task: a control message is often on the
            # critical path (Complete -> CompleteAck), and a task costs a loop iteration.
            request = self._ep._ep.am_send(self._ucxx._lib.arr.Array(buf))
        except Exception as exc:
            self._broken(self.translate(exc))
            return
        key = id(request)
        self._outbox[key] = (request, buf)  # alive until sent
        request.future.add_done_callback(partial(self._message_sent, key))

    def _message_sent(self, key: int, fut: asyncio.Future[Any]) -> None:
        self._outbox.pop(key, None)
        exc = TransferError("cancelled") if fut.cancelled() else fut.exception()
        if exc is not None:
            self._broken(PeerDiedError(f"control message to {self._peer} failed: {exc}"))

    def send_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _UcxOp | _FailedOp:
        if not self._alive:
            return _FailedOp(self.loop, PeerDiedError(f"connection to {self._peer} is closed"), on_done)
        ucxx = self._ucxx
        _runtime.refill_futures()
        try:
            request = self._data_ep._ep.tag_send(_ucx_buffer(ucxx, buf), ucxx.types.Tag(tag))
        except Exception as exc:  # the endpoint failed under us: same as a failed send
            return _FailedOp(self.loop, self.translate(exc), on_done)
        return _UcxOp(self, request, buf, on_done)

    def recv_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _UcxOp | _FailedOp:
        if not self._alive:
            return _FailedOp(self.loop, PeerDiedError(f"connection to {self._peer} is closed"), on_done)
        ucxx = self._ucxx
        _runtime.refill_futures()
        # Matching is per worker: this also receives what the peer sends on its data endpoint,
        # and messages that arrived before this receive was posted.
        try:
            request = self._ep._ep.tag_recv(
                _ucx_buffer(ucxx, buf), ucxx.types.Tag(tag), ucxx.types.TagMaskFull
            )
        except Exception as exc:
            return _FailedOp(self.loop, self.translate(exc), on_done)
        return _UcxOp(self, request, buf, on_done)

    def close(self) -> None:
        self._broken(PeerDiedError(f"connection to {self._peer} closed locally"))

    def _broken(self, exc: Exception) -> None:
        if not self._alive:
            return
        self._alive = False
        self._am_request = None  # dropping it cancels the receive
        # Aborting cancels every request still in flight on the endpoints.
        for ep in {id(self._data_ep): self._data_ep, id(self._ep): self._ep}.values():
            try:
                ep.abort(period=_CLOSE_PERIOD_NS)
            except Exception as close_exc:
                log.debug("endpoint abort: %s", close_exc)
        self._transport.forget(self)
        if self._on_close is not None:
            self.loop.call_soon(self._on_close, exc)


class UcxTransport:
    def __init__(self, config: TransferConfig) -> None:
        self.loop = asyncio.get_running_loop()
        self._config = config
        self.ucxx = _runtime.acquire()
        self._closed = False
        self._listener: Any = None
        self._address = ""
        self._on_connect: Callable[[Connection], None] | None = None
        self._conns: set[UcxConnection] = set()
        self._worker_address = bytes(self.ucxx.get_worker_address())

    @property
    def address(self) -> str:
        return self._address

    async def listen(self, on_connect: Callable[[Connection], None]) -> None:
        self._on_connect = on_connect
        self._listener = self.ucxx.create_listener(self._accept, port=self._config.port)
        self._address = f"ucx://{self._config.host}:{self._listener.port}"

    async def _accept(self, ep: Any) -> None:
        if self._closed or self._on_connect is None:
            ep.abort(period=_CLOSE_PERIOD_NS)
            return
        try:
            # Preamble: this worker's address, for an optional shared-memory data endpoint.
            await ep.am_send(np.frombuffer(self._worker_address, dtype=np.uint8))
        except Exception as exc:
            log.warning("dropping a connection that failed during its preamble: %s", exc)
            return
        conn = UcxConnection(self, ep, peer="prefill peer")
        self._conns.add(conn)
        conn.start()
        self._on_connect(conn)

    async def connect(self, address: str) -> UcxConnection:
        host, port = parse_address(address)
        timeout = self._config.connect_timeout_s
        try:
            ep = await asyncio.wait_for(
                self.ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=timeout),
                timeout,
            )
            preamble = bytes(await asyncio.wait_for(ep.am_recv(), timeout))
            data_ep = None
            if self._config.ucx_shared_memory:
                worker = self.ucxx.get_ucx_address_from_buffer(preamble)
                data_ep = await self.ucxx.create_endpoint_from_worker_address(
                    worker, endpoint_error_handling=False
                )
        except TimeoutError as exc:
            raise PeerDiedError(f"no answer from {address} within {timeout}s") from exc
        except Exception as exc:
            raise PeerDiedError(f"cannot connect to {address}: {type(exc).__name__}: {exc}") from exc
        conn = UcxConnection(self, ep, peer=address, data_ep=data_ep)
        self._conns.add(conn)
        conn.start()
        return conn

    def forget(self, conn: UcxConnection) -> None:
        self._conns.discard(conn)

    def next_transfer_id(self) -> int:
        return _runtime.next_transfer_id()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns):
            conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        # Let the close callbacks and cancelled requests run before UCX goes away.
        await asyncio.sleep(0.01)
        _runtime.release()


def parse_address(address: str) -> tuple[str, int]:
    if not address.startswith("ucx://"):
        raise ValueError(f"not a UCX address: {address!r}")
    host, _, port = address.removeprefix("ucx://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad UCX address: {address!r}")
    return host.strip("[]"), int(port)
