"""The decode side's KVReceiver when it closes an RMA sender's connection itself (code review).

The sender is alive then (it did not answer, or broke the protocol), and may still be putting into every
transfer it opened on that connection, or into reservations it may write eagerly: not only the one the
connection was closed for. Their blocks are held ``settle_timeout_s`` before they are freed (rule c of
``kv_transfer/__init__.py``: a freed block is never written by a late message). A scripted RMA transport
plays the prefill side message by message (the in-process transport has no one-sided writes).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.kv_transfer import KVReceiver, TransferConfig, compat_for, wire
from pdserve.kv_transfer import receiver as receiver_mod

SETTLE = 0.3
L, N, B, H, D = 4, 32, 4, 2, 8


class _Conn:
    peer = "scripted-prefill"

    def __init__(self) -> None:
        self.alive = True
        self.closed_at: float | None = None  # the loop's time when the receiver closed it
        self.sent: list[wire.Message] = []  # what the receiver sent to the "prefill worker"
        self.on_message = self.on_close = None

    def set_handlers(self, on_message, on_close) -> None:  # type: ignore[no-untyped-def]
        self.on_message, self.on_close = on_message, on_close

    def post_message(self, payload: bytes) -> None:
        self.sent.append(wire.decode_message(payload))

    def recv_data(self, *_args):  # type: ignore[no-untyped-def]
        raise AssertionError("one-sided puts only")

    send_data = recv_data

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.closed_at = asyncio.get_running_loop().time()
            asyncio.get_running_loop().call_soon(self.on_close, RuntimeError("closed here"))

    def deliver(self, msg: wire.Message) -> None:
        self.on_message(wire.encode_message(msg))  # type: ignore[misc]


class _Transport:
    address = "scripted://decode"

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.on_connect = None

    def expose(self, buf, shared_fd=None):  # type: ignore[no-untyped-def]
        return wire.RemoteRegion(key=b"k", base=0, length=int(buf.nbytes), layer_bytes=0)

    async def listen(self, on_connect) -> None:  # type: ignore[no-untyped-def]
        self.on_connect = on_connect

    def next_transfer_id(self) -> int:
        return next(self._ids)

    async def close(self) -> None:
        pass

    def connect(self) -> _Conn:
        conn = _Conn()
        self.on_connect(conn)  # type: ignore[misc]
        return conn


@pytest.fixture
def scripted(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(receiver_mod, "make_transport", lambda _cfg: _Transport())


async def _receiver() -> tuple[KVReceiver, BlockManager, _Conn, object]:
    kv = torch.zeros(L, N, 2, B, H, D)
    bm = BlockManager(N, B)
    compat = compat_for(kv, "tiny")
    rx = KVReceiver(
        kv, bm, compat, TransferConfig(backend="inproc", settle_timeout_s=SETTLE, deadline_s=30.0)
    )
    await rx.start()
    conn = rx._transport.connect()  # type: ignore[attr-defined]
    conn.deliver(wire.Hello(compat.protocol_version, compat.hash(), "p", rma=True))
    return rx, bm, conn, compat


def _open(conn: _Conn, ticket) -> None:  # type: ignore[no-untyped-def]
    conn.deliver(
        wire.Open(ticket.transfer_id, ticket.request_id, (len(ticket.block_ids),), rma=True, eager=True)
    )


async def _until_closed(conn: _Conn) -> None:
    async with asyncio.timeout(10):
        while conn.alive:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)  # (its close handler runs)


def test_a_forced_close_holds_every_transfer_of_the_connection(scripted) -> None:  # type: ignore[no-untyped-def]
    """r1 is aborted and its sender never answers: the connection is closed after settle_timeout_s. r2,
    open on the same connection and never aborted, was freed at once (its blocks went to the next
    allocation while the sender might still be putting into them); it is held as r1 is."""

    async def main() -> None:
        rx, bm, conn, _ = await _receiver()
        t1, t2 = rx.reserve("r1", 8), rx.reserve("r2", 8)
        _open(conn, t1)
        _open(conn, t2)
        rx.abort("r1", "client cancel")
        await _until_closed(conn)
        assert "r1" in bm and "r2" in bm  # both held
        taken = bm.allocate("other", bm.num_free * bm.block_size)
        assert not set(taken) & set(t2.block_ids)
        bm.free("other")
        async with asyncio.timeout(10):
            while "r1" in bm or "r2" in bm:  # then freed: nothing stranded
                await asyncio.sleep(0.02)
        await rx.close()

    asyncio.run(main())


@pytest.mark.parametrize("violation", ["open_twice", "hello_twice"])
def test_a_connection_closed_for_a_protocol_violation_holds_what_it_may_write(scripted, violation) -> None:  # type: ignore[no-untyped-def]
    """A second Open of one transfer, or a second Hello (which would move the connection's handshake past
    reservations it may write eagerly), closes the connection: its open transfer and the reservation it
    may write eagerly are held, not freed in the same loop iteration."""

    async def main() -> None:
        rx, bm, conn, compat = await _receiver()
        t1 = rx.reserve("r1", 8)
        rx.reserve("r2", 8)
        _open(conn, t1)
        if violation == "open_twice":
            _open(conn, t1)
        else:
            conn.deliver(wire.Hello(compat.protocol_version, compat.hash(), "p", rma=True))
        await _until_closed(conn)
        rx.abort("r2", "client cancel")  # r2 was never opened: the closed connection may write it eagerly
        await asyncio.sleep(0.05)
        assert "r1" in bm and "r2" in bm
        async with asyncio.timeout(10):
            while "r1" in bm or "r2" in bm:
                await asyncio.sleep(0.02)
        await rx.close()

    asyncio.run(main())


def test_a_forced_close_holds_the_transfers_of_the_connection_already_failing(scripted) -> None:  # type: ignore[no-untyped-def]
    """Review: r1 and r2 open on one connection, both aborted (r2 a little later) and the sender frozen.
    r1's settle runs out and closes the connection; r2, already failing (out of the connection's open
    transfers), was freed at its own settle soon after, though the sender might still be putting into it:
    it is held ``settle_timeout_s`` from the close as well."""

    async def main() -> None:
        rx, bm, conn, _ = await _receiver()
        loop = asyncio.get_running_loop()
        t1, t2 = rx.reserve("r1", 8), rx.reserve("r2", 8)
        _open(conn, t1)
        _open(conn, t2)
        rx.abort("r1", "client cancel")
        await asyncio.sleep(SETTLE * 0.6)
        rx.abort("r2", "client cancel")
        await _until_closed(conn)
        # From the close itself (not from when the poll above saw it, up to 30 ms later and more on a
        # loaded machine, which left a margin of a few ms under SETTLE * 0.9).
        closed = conn.closed_at
        assert closed is not None
        async with asyncio.timeout(10):
            while "r2" in bm:
                await asyncio.sleep(0.005)
        assert loop.time() - closed >= SETTLE * 0.9, loop.time() - closed
        async with asyncio.timeout(10):
            while "r1" in bm:
                await asyncio.sleep(0.02)
        await rx.close()

    asyncio.run(main())


def test_an_eager_open_of_a_transfer_it_may_not_write_holds_that_transfer(scripted) -> None:  # type: ignore[no-untyped-def]
    """Review: a sender whose handshake came after a reservation sends an eager Open of it (it says it has
    been putting into those blocks). The connection is closed and the reservation failed, and its blocks
    are held as the closed connection's others are (they were freed in the same loop iteration), and the
    receiver's close waits for them."""

    async def main() -> None:
        rx, bm, first, compat = await _receiver()
        t1 = rx.reserve("r1", 8)
        first.close()  # (no sender left that may write r1 eagerly: nothing else holds it)
        await _until_closed(first)
        late = rx._transport.connect()  # type: ignore[attr-defined]
        late.deliver(wire.Hello(compat.protocol_version, compat.hash(), "p2", rma=True))
        _open(late, t1)
        await _until_closed(late)
        assert "r1" in bm  # failed, held
        assert rx.state("r1") is None  # failed: no longer a live reservation
        await rx.close()  # waits for the held blocks
        assert "r1" not in bm

    asyncio.run(main())


def test_a_revoke_that_lands_while_a_failed_transfer_is_held_is_bounded(scripted) -> None:  # type: ignore[no-untyped-def]
    """Review: r1, opened by A, fails when A's connection is closed for a protocol violation and is held.
    In that hold B, which may write r1 eagerly too, sends its eager Open: B owes an AbortAck, but only the
    hold's timer was running, so a B that never answers held r1's blocks for good. Its revoke is bounded
    (``settle_timeout_s``, then B's connection is closed and waited for) like any other."""

    async def main() -> None:
        rx, bm, a, compat = await _receiver()
        b = rx._transport.connect()  # type: ignore[attr-defined]
        b.deliver(wire.Hello(compat.protocol_version, compat.hash(), "p2", rma=True))
        t1 = rx.reserve("r1", 8)
        _open(a, t1)
        a.deliver(wire.Hello(compat.protocol_version, compat.hash(), "p", rma=True))  # a violation
        await _until_closed(a)
        _open(b, t1)  # B says it has been putting into r1: refused, and owes an AbortAck it never sends
        assert any(isinstance(m, wire.Abort) for m in b.sent)
        async with asyncio.timeout(10):
            while "r1" in bm:
                await asyncio.sleep(0.02)
        assert not b.alive  # closed for not answering, then waited for
        await rx.close()

    asyncio.run(main())
