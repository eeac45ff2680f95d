"""Same-process fake transport for unit tests, keeping the UCX semantics the logic depends on: tag matching
per receiving transport, sends that wait for their receive, receives that cancel only while unmatched, a
broken connection failing every pending operation on both ends, and data copied one loop iteration after
the send (so ordering races still happen). Addresses are ``inproc://N``, in a process-wide table.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.kvbuf import as_bytes
from pdserve.kv_transfer.transport import CloseHandler, Connection, DoneCallback, MessageHandler


def _bytes(buf: Any) -> torch.Tensor:
    return torch.from_numpy(buf) if isinstance(buf, np.ndarray) else as_bytes(buf)  # shares memory


_listeners: weakref.WeakValueDictionary[str, InprocTransport] = weakref.WeakValueDictionary()
_addresses = itertools.count(1)


class _Op:
    def __init__(self, conn: InprocConnection, buf: Any, tag: int, on_done: DoneCallback) -> None:
        self.conn = conn
        self.buf = buf
        self.tag = tag
        self.table: dict[int, _Op] | None = None  # the matching table holding this op, if any
        self.on_done: DoneCallback | None = on_done

    @property
    def done(self) -> bool:
        return self.on_done is None

    def cancel(self) -> None:
        self.unpost()
        self._settle(TransferError("cancelled"))

    def unpost(self) -> None:
        if self.table is not None and self.table.get(self.tag) is self:
            del self.table[self.tag]
        self.table = None

    def _settle(self, exc: TransferError | None) -> None:
        self.conn.ops.discard(self)
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            self.conn.loop.call_soon(on_done, exc)  # never inside the caller's own call, as with UCX


class InprocConnection:
    def __init__(self, owner: InprocTransport, peer_name: str) -> None:
        self.owner = owner
        self.loop = owner.loop
        self.remote: InprocConnection | None = None
        self.ops: set[_Op] = set()
        self._peer_name = peer_name
        self._alive = True
        self._on_message: MessageHandler | None = None
        self._on_close: CloseHandler | None = None
        self._backlog: list[bytes] = []

    @property
    def peer(self) -> str:
        return self._peer_name

    @property
    def alive(self) -> bool:
        return self._alive

    def set_handlers(self, on_message: MessageHandler, on_close: CloseHandler) -> None:
        self._on_message, self._on_close = on_message, on_close
        backlog, self._backlog = self._backlog, []
        for payload in backlog:
            self.loop.call_soon(self._deliver, payload)

    def _deliver(self, payload: bytes) -> None:
        if not self._alive:
            return
        if self._on_message is None:
            self._backlog.append(payload)
        else:
            self._on_message(payload)

    def post_message(self, payload: bytes) -> None:
        if not self._alive or self.remote is None:
            raise PeerDiedError(f"connection to {self.peer} is closed")
        self.loop.call_soon(self.remote._deliver, bytes(payload))

    def send_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _Op:
        op = _Op(self, buf, tag, on_done)
        if not self._alive or self.remote is None:
            op._settle(PeerDiedError(f"connection to {self.peer} is closed"))
            return op
        self.ops.add(op)
        target = self.remote.owner
        self.loop.call_soon(target.match_send, op)
        return op

    def recv_data(self, buf: Any, tag: int, on_done: DoneCallback) -> _Op:
        op = _Op(self, buf, tag, on_done)
        if not self._alive:
            op._settle(PeerDiedError(f"connection to {self.peer} is closed"))
            return op
        self.ops.add(op)
        self.owner.post_recv(op)
        return op

    def remote_writer(self, region: Any, local: Any = None) -> None:
        return None  # no one-sided writes here: transfers move as tagged data

    def close(self) -> None:
        self._break(PeerDiedError(f"connection to {self.peer} closed locally"))
        if self.remote is not None:
            self.remote._break(PeerDiedError(f"peer {self.remote.peer} closed the connection"))

    def _break(self, exc: TransferError) -> None:
        if not self._alive:
            return
        self._alive = False
        for op in list(self.ops):
            op.unpost()
            op._settle(exc)
        if self._on_close is not None:
            self.loop.call_soon(self._on_close, exc)


class InprocTransport:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._address = ""
        self._on_connect: Callable[[Connection], None] | None = None
        self._posted: dict[int, _Op] = {}  # receives waiting for data, by tag
        self._unexpected: dict[int, _Op] = {}  # sends waiting for a receive, by tag
        self._conns: set[InprocConnection] = set()
        self._transfer_ids = itertools.count(1)

    @property
    def address(self) -> str:
        return self._address

    async def listen(self, on_connect: Callable[[Connection], None]) -> None:
        self._on_connect = on_connect
        self._address = f"inproc://{next(_addresses)}"
        _listeners[self._address] = self

    async def connect(self, address: str) -> InprocConnection:
        server = _listeners.get(address)
        if server is None or server._on_connect is None:
            raise PeerDiedError(f"nothing listens at {address}")
        here = InprocConnection(self, peer_name=address)
        there = InprocConnection(server, peer_name=f"client of {address}")
        here.remote, there.remote = there, here
        self._conns.add(here)
        server._conns.add(there)
        self.loop.call_soon(server._on_connect, there)
        return here

    def expose(self, buf: Any, shared_fd: int | None = None) -> None:
        return None

    def next_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def post_recv(self, op: _Op) -> None:
        if op.tag in self._posted:
            raise ValueError(f"a receive with tag {op.tag:#x} is already posted")
        send = self._unexpected.pop(op.tag, None)
        if send is None:
            self._posted[op.tag] = op
            op.table = self._posted
        else:
            send.table = None
            self._copy(send, op)

    def match_send(self, send: _Op) -> None:
        if send.done:  # cancelled or its connection broke meanwhile
            return
        recv = self._posted.pop(send.tag, None)
        if recv is None:
            self._unexpected[send.tag] = send
            send.table = self._unexpected
        else:
            recv.table = None
            self._copy(send, recv)

    @staticmethod
    def _copy(send: _Op, recv: _Op) -> None:
        src, dst = _bytes(send.buf), _bytes(recv.buf)
        if src.numel() != dst.numel():
            exc = TransferError(f"message of {src.numel()} bytes for a {dst.numel()}-byte receive")
            send._settle(exc)
            recv._settle(exc)
            return
        dst.copy_(src)
        send._settle(None)
        recv._settle(None)

    def kill(self) -> None:
        """Simulate this process dying: every connection breaks at once."""
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()

    async def close(self) -> None:
        self.kill()
        if _listeners.get(self._address) is self:
            del _listeners[self._address]
