"""Decode side: reserve KV blocks and hand out tickets, receive layers into the blocks, and free a failed
transfer's blocks only once nothing can write them any more (docs/kv_transfer.md, "Failure handling").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

import msgspec
import torch
from prometheus_client import CollectorRegistry

from pdserve.kv_transfer import auth, wire
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.drain import Drains
from pdserve.kv_transfer.errors import (
    AbortedError,
    ChecksumError,
    DeadlineError,
    FailureReason,
    PeerDiedError,
    RejectedError,
    TransferError,
    error_for,
)
from pdserve.kv_transfer.kvbuf import KVSpans, layer_digests
from pdserve.kv_transfer.metrics import Role, TransferMetrics
from pdserve.kv_transfer.plan import MAX_CONN_IDS, MAX_LAYERS, build_segments, layer_tag, tag_base
from pdserve.kv_transfer.reservation import (
    BlockPool,
    ConnIds,
    PrefillConn,
    Reservation,
    RxState,
    TransferResult,
)
from pdserve.kv_transfer.split import RankCaches, heads_from_wire, needs_split
from pdserve.kv_transfer.tp_pack import received_digests, unpack_received
from pdserve.kv_transfer.tp_plan import pieces
from pdserve.kv_transfer.transport import Connection, Transport
from pdserve.kv_transfer.transports import make_transport

log = logging.getLogger(__name__)

_TOMBSTONES = 4096  # recently ended transfers remembered, to answer late messages precisely
_DIGEST_INLINE_BYTES = 4 << 20  # larger transfers are checked on a worker thread (handle.py's twin)


class KVReceiver:
    """Owns nothing but reservations; the KV tensor and the block pool belong to the decode worker.

    All methods run on the event loop thread that called :meth:`start`.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        blocks: BlockPool,
        compat: wire.KVCompat,
        config: TransferConfig | None = None,
        registry: CollectorRegistry | None = None,
        shared_fd: int | None = None,
        ranks: RankCaches | None = None,
    ) -> None:
        """``shared_fd``: the memfd ``kv`` is mapped from (``engine.hugepages.SharedTensor``), offered to
        senders of this host, which then write it with plain copies (writers/shm.py). ``ranks``: a
        tensor-parallel group's caches (``kv`` is rank 0's), each exposed for the sender's writes."""
        self._ranks = ranks = RankCaches.of(kv, compat, ranks)
        # Bytes of one block of one layer over every rank (a one-sided transfer's books).
        self._all_block_bytes = sum(t[0, 0].numel() * t.element_size() for t in ranks.kv)
        if blocks.block_size != compat.block_size or blocks.num_blocks > kv.shape[1]:
            raise ValueError("the block pool does not match the KV tensor (block size or block count)")
        if compat.num_layers > MAX_LAYERS:
            raise ValueError(f"{compat.num_layers} layers exceed the tag layout's {MAX_LAYERS}")
        self._kv = kv
        self._spans = KVSpans(kv)
        self._blocks = blocks
        self._compat = compat
        self._hash = compat.hash()
        self._config = config or TransferConfig()
        self.metrics = TransferMetrics(Role.DECODE, registry)
        self._drains = Drains(kv, self._spans.block_bytes, self._config.settle_timeout_s, self.metrics)
        self._conn_ids = ConnIds(MAX_CONN_IDS)
        self._nonces = auth.SeenNonces()
        self._transport: Transport | None = None
        self._by_request: dict[str, Reservation] = {}
        self._by_transfer: dict[int, Reservation] = {}
        # Ended transfers, oldest first: answers late messages, and bounds the results
        # kept for a wait() that may never come (a decode worker that aborted and moved on).
        self._ended: OrderedDict[int, tuple[str, TransferError | None]] = OrderedDict()
        self._failing: dict[int, Reservation] = {}  # failed, blocks waiting for in-flight receives
        self._results: dict[str, asyncio.Future[TransferResult]] = {}
        self._region: wire.RemoteRegion | None = None  # the KV tensor as offered for puts
        self._seq = 0  # reservations made so far (TransferTicket.seq)
        self._rma_peers: set[PrefillConn] = set()  # live connections the region was offered to
        self._shared_fd = shared_fd
        self._rank_regions: tuple[wire.RemoteRegion, ...] | None = ()  # ranks 1..; None: not exposed

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        self._transport = make_transport(self._config)
        region = self._transport.expose(self._spans.flat, self._shared_fd)
        if region is not None:
            layer_bytes = self._spans.num_blocks * self._spans.block_bytes
            self._region = msgspec.structs.replace(region, layer_bytes=layer_bytes)
        regions = []
        for rank in range(1, len(self._ranks.kv)):
            spans = KVSpans(self._ranks.kv[rank])
            fds = self._ranks.shared_fds
            exposed = self._transport.expose(spans.flat, fds[rank] if rank < len(fds) else None)
            if exposed is None:
                self._rank_regions = None
                break
            regions.append(msgspec.structs.replace(exposed, layer_bytes=spans.num_blocks * spans.block_bytes))
        else:
            self._rank_regions = tuple(regions)
        await self._transport.listen(self._on_connect)

    @property
    def address(self) -> str:
        assert self._transport is not None, "start() first"
        return self._transport.address

    async def close(self) -> None:
        """Fail every live reservation, wait (bounded) for their blocks to free, stop listening."""
        for rx in list(self._by_request.values()):
            self._fail(rx, AbortedError("decode receiver shutting down"), notify=True)
        loop = asyncio.get_running_loop()
        end = loop.time() + 3 * self._config.settle_timeout_s
        while self._failing and loop.time() < end:  # blocks wait for their in-flight writes
            await asyncio.sleep(0.01)
        if self._failing:
            log.warning(
                "closing with %d transfers still settling; their blocks stay allocated", len(self._failing)
            )
        if self._transport is not None:
            await self._transport.close()

    # -- decode engine API -------------------------------------------------
    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        deadline_s: float | None = None,
        prefix_hashes: Sequence[bytes] = (),
    ) -> wire.TransferTicket:
        """Allocate blocks under ``request_id`` and describe them in a ticket.

        ``prefix_hashes``: the prompt's full-block hashes (``engine.prefix_hash``); the blocks the pool
        has cached for a leading run of them are held instead of reserved anew, and the ticket's
        ``cached_tokens`` tells the prefill worker not to send them. The pool's error when it has no room
        (``OutOfBlocksError`` from a ``BlockManager``) passes through with nothing reserved.
        """
        assert self._transport is not None, "start() first"
        if request_id in self._by_request:
            raise ValueError(f"request {request_id!r} already has a reservation")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        deadline_s = self._config.deadline_s if deadline_s is None else deadline_s
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        # At least the block of the last prompt token comes from P: a transfer always writes something,
        # and its Complete carries the first token.
        prefix_hashes = prefix_hashes[: (num_tokens - 1) // self._blocks.block_size]
        if prefix_hashes:
            reused = self._blocks.allocate_prefixed(request_id, num_tokens, prefix_hashes)
            blocks = self._blocks.block_table(request_id)
        else:
            reused, blocks = 0, self._blocks.allocate(request_id, num_tokens)
        loop = asyncio.get_running_loop()
        xid = self._transport.next_transfer_id()
        self._seq += 1
        deadline_unix = time.time() + deadline_s
        rx = Reservation(
            request_id,
            xid,
            blocks,
            num_tokens,
            loop.create_future(),
            reused=reused,
            seq=self._seq,
            deadline_unix=deadline_unix,
        )
        rx.result.add_done_callback(_retrieve)
        rx.timer = loop.call_later(deadline_s, self._expire, rx, deadline_s)
        self._by_request[request_id] = rx
        self._by_transfer[rx.transfer_id] = rx
        self._results[request_id] = rx.result
        self.metrics.opened()
        return wire.TransferTicket(
            address=self._transport.address,
            request_id=request_id,
            transfer_id=rx.transfer_id,
            block_ids=tuple(rx.targets),
            num_tokens=num_tokens,
            protocol_version=self._compat.protocol_version,
            compat_hash=self._hash,
            deadline_unix=deadline_unix,
            seq=rx.seq,
            cached_tokens=reused * self._blocks.block_size,
        )

    async def wait(self, request_id: str) -> TransferResult:
        """Resolve when every layer and the completion arrived; raise a TransferError otherwise."""
        fut = self._results.get(request_id)
        if fut is None:
            raise KeyError(f"no reservation for request {request_id!r} (or already waited for)")
        try:
            return await asyncio.shield(fut)
        finally:
            if fut.done() and self._results.get(request_id) is fut:
                del self._results[request_id]

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        """Give up a reservation at any stage before DONE; the sender is told. False if none is live."""
        rx = self._by_request.get(request_id)
        if rx is None:
            return False
        self._fail(rx, AbortedError(f"aborted by decode: {reason}"), notify=True)
        return True

    def layers_received(self, request_id: str) -> int:
        rx = self._by_request.get(request_id)
        return rx.layers_done if rx is not None else 0

    def progress(self, request_id: str) -> int:
        """How far a transfer has come, for a stall watch: layers landed (tagged data) or, for one-sided
        puts, layers the sender reported put (``wire.Progress``); it only grows."""
        rx = self._by_request.get(request_id)
        return 0 if rx is None else max(rx.layers_done, rx.layers_put)

    def state(self, request_id: str) -> RxState | None:
        rx = self._by_request.get(request_id)
        return rx.state if rx is not None else None

    @property
    def draining(self) -> int:
        """Refused Opens whose sender's data may still land in scratch memory (0 when idle)."""
        return self._drains.live

    # -- connection and messages -------------------------------------------
    def _on_connect(self, conn: Connection) -> None:
        peer = PrefillConn(conn)
        conn.set_handlers(partial(self._on_message, peer), partial(self._on_close, peer))

    def _close(self, peer: PrefillConn) -> None:
        """Close a live sender's connection from this side (``forced``). Its sender may live on and
        still put into every transfer it opened here, or may write eagerly, not only the one it is closed
        for: those blocks are freed (once failed) no sooner than ``settle_timeout_s`` from now. The one
        case this does not close by construction: a sender frozen (not dead) in the middle of a put for
        longer than that, which then resumes, could finish that put."""
        if peer.rma and not peer.forced:
            until = asyncio.get_running_loop().time() + self._config.settle_timeout_s
            eager = [r for r in self._by_transfer.values() if r.state is RxState.RESERVED]
            # Failed ones too: its Abort unanswered, or a revoke it owes (they left ``peer.transfers``).
            failing = [
                r
                for r in self._failing.values()
                if (r.peer is peer and r.rma and r.unsettled) or peer in r.revoking
            ]
            for rx in [*peer.transfers, *(r for r in eager if self._eager_writer(peer, r)), *failing]:
                rx.hold_until = max(rx.hold_until, until)
        peer.forced = True
        peer.conn.close()

    def _send(self, conn: Connection | None, msg: wire.Message) -> None:
        if conn is None or not conn.alive:
            return
        conn.post_message(wire.encode_message(msg))

    def _on_message(self, peer: PrefillConn, payload: bytes) -> None:
        try:
            msg = wire.decode_message(payload)
        except Exception as exc:
            log.warning("closing connection from %s: undecodable message: %s", peer.conn.peer, exc)
            self._close(peer)
            return
        if isinstance(msg, wire.Hello):
            self._on_hello(peer, msg)
        elif self._config.cluster_token and not peer.proven:
            # Nothing but a proven Hello is heard from a connection (an Abort could fail a reservation).
            log.warning(
                "closing KV connection from %s: %s before proving the cluster token",
                peer.conn.peer,
                type(msg).__name__,
            )
            self._close(peer)
        elif isinstance(msg, wire.Open):
            self._on_open(peer, msg)
        elif isinstance(msg, wire.Progress):
            rx = self._by_transfer.get(msg.transfer_id)
            if rx is not None and rx.conn is peer.conn and rx.state is RxState.OPEN:
                rx.layers_put = max(rx.layers_put, min(msg.layers, self._compat.num_layers))
        elif isinstance(msg, wire.Complete):
            rx = self._by_transfer.get(msg.transfer_id)
            if rx is not None and rx.conn is peer.conn and rx.state is RxState.OPEN:
                if rx.rma and msg.layers != self._compat.num_layers:
                    # Layers went missing on the sender's side: like lost tagged data, the
                    # transfer never completes here, and its deadline ends it.
                    log.warning(
                        "transfer %s: Complete after %d of %d layers; waiting for its deadline",
                        rx.request_id,
                        msg.layers,
                        self._compat.num_layers,
                    )
                    return
                rx.first_token_id = msg.first_token_id
                rx.choice_token_ids = msg.choice_token_ids
                rx.digests = msg.digests
                if rx.rma:  # sent after the sender's flush: every put has landed
                    self._rma_landed(rx)
                self._maybe_finish(rx)
        elif isinstance(msg, wire.Abort):
            # Accepted even on a rejected connection: that is how an incompatible sender says so.
            # Also for a transfer already failing here: when both sides abort at once, the sender's
            # Abort (with the layers it sent) is the answer to ours, not an AbortAck.
            if self._drains.on_sent(peer, msg.transfer_id, msg.sent_layers or ()):
                return
            rx = self._by_transfer.get(msg.transfer_id) or self._failing.get(msg.transfer_id)
            if rx is not None and peer in rx.revoking:  # sent after its flush: it stopped writing
                self._revoked_by(rx, peer)
            if rx is not None and rx.conn in (None, peer.conn):
                err = error_for(msg.code, f"prefill gave up: {msg.reason}")
                self._fail(rx, err, notify=False, sent_layers=msg.sent_layers or ())
        elif isinstance(msg, wire.AbortAck):
            if self._drains.on_sent(peer, msg.transfer_id, msg.sent_layers):
                return
            rx = self._failing.get(msg.transfer_id)
            if rx is not None and peer in rx.revoking:
                self._revoked_by(rx, peer)
            if rx is not None and rx.conn is peer.conn:
                self._drain(rx, msg.sent_layers)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, peer.conn.peer)

    def _on_hello(self, peer: PrefillConn, msg: wire.Hello) -> None:
        if peer.greeted:
            # One Hello per connection: a second would move its hello_seq past reservations it may be
            # writing eagerly, and they would then not be revoked on it.
            log.warning("closing connection from %s: Hello twice", peer.conn.peer)
            self._close(peer)
            return
        peer.greeted = True
        ours = self._compat.protocol_version
        token = self._config.cluster_token
        code = ""
        peer.proven = not token or self._proven(msg, token)
        if not peer.proven:
            # Checked first: a process without the token learns nothing of this worker's layout.
            reason = "the prefill side did not prove the cluster token"
            code = FailureReason.UNAUTHENTICATED.value
            log.warning("refused a KV connection from %s: %s", peer.conn.peer, reason)
            self.metrics.transfer_failed(FailureReason.UNAUTHENTICATED)
        elif msg.protocol_version != ours:
            reason = f"protocol version {msg.protocol_version} (prefill) != {ours} (decode)"
        elif msg.compat_hash != self._hash:
            reason = f"KV layout hash {msg.compat_hash} (prefill) != {self._hash} (decode: {self._compat})"
        else:
            reason = ""
        if not reason and peer.conn_id < 0:
            conn_id = self._conn_ids.take()
            if conn_id is None:
                reason = f"more than {MAX_CONN_IDS} prefill connections at once"
            else:
                peer.conn_id = conn_id
        peer.accepted = not reason
        conn_id = max(peer.conn_id, 0)
        proof = auth.reply_proof(token, msg.nonce, peer.accepted, conn_id) if token else ""
        if not reason:
            reason = self._route(peer, msg)
            peer.accepted = not reason
        region = self._region if peer.accepted and msg.rma else None
        peer.rma = region is not None
        if peer.rma:
            peer.hello_seq = self._seq
            self._rma_peers.add(peer)
        reply = wire.HelloReply(
            ok=peer.accepted,
            reason=reason,
            conn_id=conn_id,
            code=code,
            proof=proof,
            rma=region,
            seq=self._seq,
            kv_heads=self._ranks.wire(),
            rank_regions=(self._rank_regions or ()) if peer.plan is not None else (),
        )
        self._send(peer.conn, reply)

    def _route(self, peer: PrefillConn, msg: wire.Hello) -> str:
        """Set ``peer.plan`` where either side is a tensor-parallel group; the reason it cannot be, else
        "". A group's heads move by one-sided writes only, into every rank's exposed cache."""
        try:
            src = heads_from_wire(msg.kv_heads, self._compat.num_kv_heads, "the prefill worker's ranks")
        except ValueError as exc:
            return str(exc)
        if not needs_split(src, self._ranks.heads):
            return ""
        if not (msg.rma and self._region is not None and self._rank_regions is not None):
            return (
                f"tensor-parallel KV ({len(src)} prefill ranks, {len(self._ranks.heads)} decode ranks) moves "
                "by one-sided writes only, which this connection does not have"
            )
        peer.plan = pieces(src, self._ranks.heads)
        return ""

    def _proven(self, msg: wire.Hello, token: str) -> bool:
        """The Hello proves the token, with a nonce this receiver has not seen before."""
        expected = auth.hello_proof(token, msg.protocol_version, msg.compat_hash, msg.sender, msg.nonce)
        return bool(msg.nonce) and auth.same(expected, msg.proof) and self._nonces.first_use(msg.nonce)

    def _on_open(self, peer: PrefillConn, msg: wire.Open) -> None:
        earlier = peer.drains.get(msg.transfer_id)
        if not peer.accepted or (earlier and not earlier.drained) or not self._drains.plausible(msg.segments):
            # A well-behaved sender opens only after an accepted handshake, with a plan that fits
            # the ticket, and opens a refused transfer again only after its AbortAck. Its data
            # cannot be drained safely: drop it all.
            log.warning("closing connection from %s: protocol violation in Open", peer.conn.peer)
            self._close(peer)
            return
        if msg.rma and not peer.rma:
            log.warning("closing connection from %s: RMA Open without an offered region", peer.conn.peer)
            self._close(peer)
            return
        rx = self._by_transfer.get(msg.transfer_id)
        if rx is not None and rx.conn is peer.conn:
            log.warning("closing connection from %s: Open twice for one transfer", peer.conn.peer)
            self._close(peer)
            return
        if msg.eager and not self._eager_open_ok(peer, msg, rx):
            return
        if rx is None or rx.request_id != msg.request_id:
            ended = self._ended.get(msg.transfer_id, ("", None))[1]
            code = ended.reason if ended is not None else FailureReason.REJECTED
            why = str(ended) if ended is not None else "unknown or expired transfer"
            return self._refuse(peer, msg, code, why)
        if rx.state is not RxState.RESERVED:
            return self._refuse(peer, msg, FailureReason.REJECTED, f"transfer already {rx.state.value}")
        try:
            segments = build_segments(msg.segments, None, rx.targets)
        except ValueError as exc:
            self._fail(rx, RejectedError(f"malformed Open: {exc}"), notify=False)
            return self._refuse(peer, msg, FailureReason.REJECTED, str(exc))
        rx.conn, rx.peer = peer.conn, peer
        peer.transfers.add(rx)
        rx.runs = [(seg.dst_start, seg.num_blocks) for seg in segments]
        rx.state = RxState.OPEN
        rx.opened_at = time.perf_counter()  # (not uvloop's loop.time(): whole milliseconds)
        if msg.rma:
            rx.rma = True
            # The sender may write the blocks from now until its Complete, Abort or AbortAck (each sent
            # after a flush of its endpoint) or the connection's end: nothing is posted here to cancel.
            rx.unsettled = 1
            if not msg.eager:
                self._send(peer.conn, wire.Accept(rx.transfer_id))
            return
        num_layers = self._compat.num_layers
        rx.pending = [len(segments)] * num_layers
        base = tag_base(rx.transfer_id, peer.conn_id)
        spans, unit, recv = self._spans, self._spans.block_bytes, peer.conn.recv_data
        for layer in range(num_layers):
            ops = rx.ops[layer] = []
            for seg in segments:
                dst = spans.span(layer, seg.dst_start, seg.num_blocks)
                done = partial(self._landed, rx, layer, seg.num_blocks * unit)
                rx.unsettled += 1
                ops.append(recv(dst, base | layer_tag(layer, seg.index), done))

    def _eager_open_ok(self, peer: PrefillConn, msg: wire.Open, rx: Reservation | None) -> bool:
        """An eager Open: its puts started before it arrived. False when it was handled here (its
        transfer refused or failed, or the connection closed) and must not be taken."""
        target = rx if rx is not None else self._failing.get(msg.transfer_id)
        if target is None or target.request_id != msg.request_id or not self._eager_writer(peer, target):
            # Puts into blocks it had no right to: they may already belong to another request.
            log.error(
                "closing KV connection from %s: eager Open of transfer %d it may not write",
                peer.conn.peer,
                msg.transfer_id,
            )
            live = target if target is not None and target.state in (RxState.RESERVED, RxState.OPEN) else None
            if live is not None and peer.rma:  # (it says it has been putting into them: held as if it may)
                until = asyncio.get_running_loop().time() + self._config.settle_timeout_s
                live.hold_until = max(live.hold_until, until)
            self._close(peer)
            if live is not None:
                self._fail(live, RejectedError("written by a sender it was not open to"), notify=True)
            return False
        if target.state is RxState.RESERVED:
            return True
        # Revoked before this Open came, or opened by another sender of the same ticket: this
        # sender's puts may be landing too, so the blocks wait for its AbortAck as well.
        state = target.state.value
        target.revoking.add(peer)
        peer.revoking.add(target)
        if target.state is RxState.OPEN:
            self._fail(target, RejectedError("opened by two senders"), notify=True)
        else:  # FAILING: its timer may be none or a hold's; this revoke is bounded like any other
            target.revoke_forced = False  # (a peer that does not answer is closed, then waited for)
            if target.grace is not None:
                target.grace.cancel()
            target.grace = asyncio.get_running_loop().call_later(
                self._config.settle_timeout_s, self._force, target
            )
        self._refuse(peer, msg, FailureReason.REJECTED, f"transfer already {state}")
        return False

    def _eager_writer(self, peer: PrefillConn, rx: Reservation) -> bool:
        """``peer`` may put into ``rx``'s blocks before an Accept (its handshake came first)."""
        return peer.rma and 0 <= peer.hello_seq < rx.seq

    def _refuse(self, peer: PrefillConn, msg: wire.Open, code: FailureReason, reason: str) -> None:
        """Receive whatever the sender already pushed into scratch memory, then tell it to stop.
        An RMA sender pushes nothing before an Accept: there is nothing to drain."""
        if not msg.rma:
            self._drains.start(peer, msg.transfer_id, msg.segments)
        self._send(peer.conn, wire.Abort(msg.transfer_id, code.value, f"decode refused: {reason}"))

    def _on_close(self, peer: PrefillConn, exc: Exception | None) -> None:
        self._rma_peers.discard(peer)
        why = "the connection was closed by the decode side" if peer.forced else f"prefill peer died: {exc}"
        for rx in list(peer.transfers):
            self._fail(rx, PeerDiedError(why), notify=False)
        peer.transfers.clear()
        if not peer.forced:  # closed by this side: its pending revokes wait for _force
            for rx in list(peer.revoking):
                self._revoked_by(rx, peer)
        self._drains.close(peer)
        self._conn_ids.release(peer.conn_id)

    # -- data --------------------------------------------------------------
    def _rma_landed(self, rx: Reservation) -> None:
        """The sender's flush covered every put of ``rx``: all layers are in."""
        nbytes = len(rx.targets) * self._all_block_bytes * self._compat.num_layers
        rx.bytes += nbytes
        self.metrics.add_bytes(nbytes)
        rx.layers_done = self._compat.num_layers
        rx.unsettled = 0

    def _landed(self, rx: Reservation, layer: int, n: int, exc: TransferError | None) -> None:
        rx.unsettled -= 1
        if exc is None:
            rx.bytes += n
            self.metrics.add_bytes(n)
            if rx.state is RxState.OPEN:
                rx.pending[layer] -= 1
                if rx.pending[layer] == 0:
                    rx.layers_done += 1
                    self._maybe_finish(rx)
        elif rx.state is RxState.OPEN:
            self._fail(rx, exc, notify=True)
        self._maybe_free(rx)

    def _maybe_finish(self, rx: Reservation) -> None:
        if rx.layers_done < self._compat.num_layers or rx.first_token_id is None or rx.verifying:
            return
        plan = rx.peer.plan if rx.peer is not None else None
        if plan is not None:
            # Every write landed (flushed before Complete): runs that came packed go into the layout now,
            # here on the loop, so no failure can free the blocks while they are rearranged; once only.
            rx.verifying = True
            unpack_received(self._ranks.kv, plan, rx.targets, self._compat.num_layers)
        if rx.digests:
            # Every writer has stopped (all receives landed; puts flushed before Complete): check what
            # landed before the request may run on it.
            rx.verifying = True
            if rx.bytes <= _DIGEST_INLINE_BYTES:
                self._verified(rx, self._digests_match(rx))
            else:
                task = asyncio.ensure_future(asyncio.to_thread(self._digests_match, rx))
                task.add_done_callback(lambda t: self._verified(rx, not t.cancelled() and t.result()))
            return
        self._finish(rx)

    def _digests_match(self, rx: Reservation) -> bool:
        if rx.peer is not None and rx.peer.plan is not None:
            return received_digests(self._ranks.kv, rx.targets, self._compat.num_layers) == rx.digests
        return layer_digests(self._spans, rx.runs, self._compat.num_layers) == rx.digests

    def _verified(self, rx: Reservation, ok: bool) -> None:
        if rx.state is not RxState.OPEN:  # failed meanwhile (an abort, the deadline)
            return
        if ok:
            self._finish(rx)
            return
        self._fail(
            rx,
            ChecksumError(f"the KV of {rx.request_id!r} that landed does not match its writer's digest"),
            notify=True,
        )

    def _finish(self, rx: Reservation) -> None:
        assert rx.first_token_id is not None  # (_maybe_finish's condition)
        self._send(rx.conn, wire.CompleteAck(rx.transfer_id))  # first: P waits for it
        rx.state = RxState.DONE
        self._end(rx, None)
        seconds = time.perf_counter() - rx.opened_at
        self.metrics.transfer_done(seconds)
        self.metrics.add_not_sent(rx.reused * self._spans.block_bytes * self._compat.num_layers)
        self.metrics.closed()
        rx.result.set_result(
            TransferResult(
                rx.request_id,
                rx.first_token_id,
                tuple(rx.blocks),
                rx.num_tokens,
                rx.bytes,
                seconds,
                rx.choice_token_ids,
            )
        )

    # -- failure and cleanup -----------------------------------------------
    def _end(self, rx: Reservation, err: TransferError | None) -> None:
        if rx.timer is not None:
            rx.timer.cancel()
        if rx.peer is not None:
            rx.peer.transfers.discard(rx)
        self._by_request.pop(rx.request_id, None)
        self._by_transfer.pop(rx.transfer_id, None)
        self._ended[rx.transfer_id] = (rx.request_id, err)
        while len(self._ended) > _TOMBSTONES:
            _, (request_id, _) = self._ended.popitem(last=False)
            fut = self._results.get(request_id)
            if fut is not None and fut.done():
                del self._results[request_id]

    def _expire(self, rx: Reservation, deadline_s: float) -> None:
        self._fail(rx, DeadlineError(f"transfer of {rx.request_id!r} not complete after {deadline_s}s"), True)

    def _fail(
        self, rx: Reservation, err: TransferError, notify: bool, sent_layers: tuple[int, ...] | None = None
    ) -> None:
        """Fail a live transfer now; free its blocks once nothing can write them any more.

        ``sent_layers``: the sender's own account (its Abort) of what it sent.
        Otherwise, with the sender reachable, ask it (Abort -> AbortAck).
        """
        if rx.state in (RxState.DONE, RxState.FAILING, RxState.FREED):
            if rx.state is RxState.FAILING and sent_layers is not None:
                self._drain(rx, sent_layers)
            return
        was_open = rx.state is RxState.OPEN
        rx.state = RxState.FAILING
        self._end(rx, err)
        self.metrics.transfer_failed(err.reason)
        self.metrics.closed()
        rx.result.set_exception(err)
        log.info("transfer %s failed: %s", rx.request_id, err)
        if not was_open:
            self._revoke(rx, err)
            self._maybe_free(rx)
            return
        self._failing[rx.transfer_id] = rx
        if sent_layers is not None:
            self._drain(rx, sent_layers)
        elif notify and rx.conn is not None and rx.conn.alive:
            self._send(rx.conn, wire.Abort(rx.transfer_id, err.reason.value, str(err)))
            rx.grace = asyncio.get_running_loop().call_later(self._config.settle_timeout_s, self._force, rx)
        else:
            self._drain(rx, ())
        self._maybe_free(rx)

    def _revoke(self, rx: Reservation, err: TransferError) -> None:
        """``rx`` ended before any Open: every connection that may be putting into it eagerly is
        told, and the blocks wait until each has answered or closed (bounded by ``_force``)."""
        writers = [p for p in self._rma_peers if p.conn.alive and self._eager_writer(p, rx)]
        if not writers:
            return
        rx.revoking.update(writers)
        self._failing[rx.transfer_id] = rx
        revoke = wire.Abort(rx.transfer_id, err.reason.value, str(err), deadline_unix=rx.deadline_unix)
        for peer in writers:
            peer.revoking.add(rx)
            self._send(peer.conn, revoke)
        rx.grace = asyncio.get_running_loop().call_later(self._config.settle_timeout_s, self._force, rx)

    def _revoked_by(self, rx: Reservation, peer: PrefillConn) -> None:
        """``peer`` will not put into ``rx`` any more (it answered, or its connection is gone)."""
        rx.revoking.discard(peer)
        peer.revoking.discard(rx)
        self._maybe_free(rx)

    def _drain(self, rx: Reservation, sent_layers: tuple[int, ...]) -> None:
        """Cancel receives for layers never sent; the sent ones land (or fail) by themselves.

        RMA: the sender's word (or the connection's end) that no put is in flight any more.
        """
        if rx.drained:
            return
        rx.drained = True
        if rx.rma:
            rx.unsettled = 0
        sent = set(sent_layers)
        for layer, ops in rx.ops.items():
            if layer not in sent:
                for op in ops:
                    op.cancel()
        if rx.grace is not None:
            rx.grace.cancel()
        if rx.unsettled or rx.revoking:
            rx.grace = asyncio.get_running_loop().call_later(self._config.settle_timeout_s, self._force, rx)
        self._maybe_free(rx)

    def _force(self, rx: Reservation) -> None:
        """Settling took too long: cancel everything, and if even that stalls, drop the connection."""
        if rx.state is not RxState.FAILING:
            return
        if rx.revoking:
            if not rx.revoke_forced:
                rx.revoke_forced = True
                self.metrics.settle_timed_out()
                log.warning(
                    "transfer %s: %d connections did not answer its revoke in %ss; closing them and "
                    "holding its blocks %ss more",
                    rx.request_id,
                    len(rx.revoking),
                    self._config.settle_timeout_s,
                    self._config.settle_timeout_s,
                )
                for peer in list(rx.revoking):
                    self._close(peer)
                rx.grace = asyncio.get_running_loop().call_later(
                    self._config.settle_timeout_s, self._force, rx
                )
                return
            for peer in list(rx.revoking):
                peer.revoking.discard(rx)
            rx.revoking.clear()
            if not rx.unsettled:
                self._maybe_free(rx)
                return
        if not rx.unsettled:
            return
        if rx.rma:
            if rx.conn is not None and rx.conn.alive:
                self.metrics.settle_timed_out()
                log.warning(
                    "transfer %s: no AbortAck from the RMA sender in %ss; closing the connection and "
                    "holding its blocks %ss more",
                    rx.request_id,
                    self._config.settle_timeout_s,
                    self._config.settle_timeout_s,
                )
                if rx.peer is not None:
                    self._close(rx.peer)
                else:
                    rx.conn.close()
                rx.grace = asyncio.get_running_loop().call_later(
                    self._config.settle_timeout_s, self._force, rx
                )
            else:
                self._drain(rx, ())
                self._maybe_free(rx)
            return
        if not rx.drained:
            self._drain(rx, ())
            return
        self.metrics.settle_timed_out()
        log.warning(
            "transfer %s: %d receives still in flight; closing the connection", rx.request_id, rx.unsettled
        )
        if rx.peer is not None:
            self._close(rx.peer)
        elif rx.conn is not None:
            rx.conn.close()

    def _maybe_free(self, rx: Reservation) -> None:
        if rx.state is not RxState.FAILING or rx.unsettled or rx.revoking:
            return
        loop = asyncio.get_running_loop()
        wait = rx.hold_until - loop.time()
        if wait > 0:  # a writer that this side cut off may still be putting (``_on_close``)
            if rx.grace is not None:
                rx.grace.cancel()
            rx.grace = loop.call_later(wait, self._maybe_free, rx)
            self._failing[rx.transfer_id] = rx  # (``close`` waits for it, as for any settling transfer)
            return
        rx.state = RxState.FREED
        if rx.grace is not None:
            rx.grace.cancel()
        self._failing.pop(rx.transfer_id, None)
        rx.ops.clear()
        self._blocks.free(rx.request_id)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (callers may never await a failed transfer)."""
    if not fut.cancelled():
        fut.exception()
