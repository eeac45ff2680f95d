"""Prefill side: one connection and handshake per decode worker, and the opening of transfers, which
checks the ticket before any data moves and returns a :class:`SenderHandle` without waiting for an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
from prometheus_client import CollectorRegistry

from pdserve.kv_transfer import auth, wire
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.errors import (
    DeadlineError,
    FailureReason,
    IncompatibleError,
    PeerDiedError,
    TransferError,
    error_for,
)
from pdserve.kv_transfer.handle import HandleState, SenderHandle
from pdserve.kv_transfer.kvbuf import KVSpans
from pdserve.kv_transfer.metrics import Role, TransferMetrics
from pdserve.kv_transfer.plan import MAX_LAYERS, build_segments, segment_lengths
from pdserve.kv_transfer.split import RankCaches, SplitRoute, SplitWriter, heads_from_wire, needs_split
from pdserve.kv_transfer.transport import Connection, RemoteWriter, Transport, describe
from pdserve.kv_transfer.transports import make_transport

log = logging.getLogger(__name__)

_MAX_REVOKED = 65536  # unexpired revokes remembered per connection before it stops writing eagerly


@dataclass(eq=False)
class _Peer:
    address: str
    ready: asyncio.Future[None]
    conn: Connection | None = None
    accepted: bool = False
    reason: str = ""
    conn_id: int = 0  # the receiver's id for this connection, part of every data tag
    hello_reply: asyncio.Future[wire.HelloReply] | None = None
    refusal: str = ""  # a FailureReason value: why the receiver (or we) refused this connection
    handshake: asyncio.Task[None] | None = None
    handles: dict[int, SenderHandle] = field(default_factory=dict)
    writer: RemoteWriter | None = None  # puts into the receiver's KV tensor, when it offered them
    region: wire.RemoteRegion | None = None
    hello_seq: int = -1  # the receiver's reservation count at the handshake; -1: never eager
    revoked: dict[int, wire.Abort] = field(default_factory=dict)  # transfer id -> the revoke
    split: SplitRoute | None = None  # tensor parallelism on either side: every rank's heads, rank by rank

    def eager(self, ticket: wire.TransferTicket) -> bool:
        """Puts for ``ticket`` may start before the receiver's Accept (it revokes, not refuses)."""
        return self.writer is not None and 0 <= self.hello_seq < ticket.seq

    def remember_revoke(self, msg: wire.Abort) -> None:
        """Keep a revoke until its ticket's deadline, so that an ``open`` of the ticket is refused here
        before anything is written. Past ``_MAX_REVOKED`` unexpired ones the connection stops writing
        eagerly (every later one-sided Open waits for Accept) rather than forget one."""
        if self.hello_seq < 0:
            return
        if len(self.revoked) >= _MAX_REVOKED:
            now = time.time()
            self.revoked = {xid: m for xid, m in self.revoked.items() if m.deadline_unix > now}
            if len(self.revoked) >= _MAX_REVOKED:
                log.warning(
                    "%d unexpired revokes from %s: no more eager puts on it", len(self.revoked), self.address
                )
                self.hello_seq = -1
                self.revoked.clear()
                return
        self.revoked[msg.transfer_id] = msg


class KVSender:
    """All methods except ``SenderHandle.push_layer`` run on one event loop thread."""

    def __init__(
        self,
        kv: torch.Tensor,
        compat: wire.KVCompat,
        config: TransferConfig | None = None,
        registry: CollectorRegistry | None = None,
        name: str = "prefill",
        ranks: RankCaches | None = None,
    ) -> None:
        """``ranks``: a tensor-parallel group's caches (``kv`` is rank 0's), whose heads go to whichever
        ranks of the receiver hold them."""
        self.ranks = RankCaches.of(kv, compat, ranks)
        if compat.num_layers > MAX_LAYERS:
            raise ValueError(f"{compat.num_layers} layers exceed the tag layout's {MAX_LAYERS}")
        self.kv = kv
        self.spans = KVSpans(kv)
        self.compat = compat
        self.config = config or TransferConfig()
        self.metrics = TransferMetrics(Role.PREFILL, registry)
        self._hash = compat.hash()
        self._name = name
        self._transport: Transport | None = None
        self._peers: dict[str, _Peer] = {}
        self._corruptions_left = self.config.faults.corrupt_transfers

    def take_corruption(self) -> bool:
        """Fault injection: whether the next transfer gets a byte flipped in flight."""
        if self._corruptions_left <= 0:
            return False
        self._corruptions_left -= 1
        return True

    async def open(self, ticket: wire.TransferTicket | bytes, src_block_ids: Sequence[int]) -> SenderHandle:
        """Start a transfer of P's blocks ``src_block_ids`` (the prompt's whole table, token order) into the
        ticket's blocks; the leading blocks the decode worker already holds (``ticket.cached_tokens``) are
        not sent.

        Returns once ``Open`` is sent; a refusal by the receiver (expired or
        aborted reservation) surfaces as the handle's error, raised by ``complete``.
        Incompatibility, a past deadline or an unreachable peer raise here, and
        so does a ticket that already has a live transfer from this sender.
        """
        if not isinstance(ticket, wire.TransferTicket):
            ticket = wire.TransferTicket.decode(bytes(ticket))
        loop = asyncio.get_running_loop()
        remaining = ticket.deadline_unix - time.time()
        if not ticket.block_ids:
            raise ValueError("ticket reserves no blocks")
        if ticket.cached_tokens % self.compat.block_size:
            raise ValueError(f"cached_tokens {ticket.cached_tokens} is not a whole number of blocks")
        src_block_ids = src_block_ids[ticket.cached_tokens // self.compat.block_size :]
        if len(src_block_ids) != len(ticket.block_ids):
            raise ValueError(
                f"{len(src_block_ids)} source blocks for {len(ticket.block_ids)} reserved blocks"
            )
        if min(src_block_ids) < 0 or max(src_block_ids) >= self.spans.num_blocks:
            raise ValueError("source block id outside the KV tensor")
        segments = build_segments(
            segment_lengths(src_block_ids, ticket.block_ids), src_block_ids, ticket.block_ids
        )
        if remaining <= 0:
            self.metrics.transfer_failed(DeadlineError.reason)
            raise DeadlineError(f"ticket of {ticket.request_id!r} expired {-remaining:.3f}s ago")
        incompatible = ""
        if ticket.protocol_version != self.compat.protocol_version:
            incompatible = (
                f"protocol version {ticket.protocol_version} (decode) != {self.compat.protocol_version}"
            )
        elif ticket.compat_hash != self._hash:
            incompatible = f"KV layout hash {ticket.compat_hash} (decode) != {self._hash} ({self.compat})"
        peer = self._ready_peer(ticket.address)
        try:
            if peer is None:
                peer = await asyncio.wait_for(self._connect(ticket.address), remaining)
        except TimeoutError:
            self.metrics.transfer_failed(DeadlineError.reason)
            raise DeadlineError(f"deadline passed connecting to {describe(ticket.address)}") from None
        except TransferError as err:
            self.metrics.transfer_failed(err.reason)
            if incompatible:
                raise IncompatibleError(incompatible) from err
            raise
        refused: TransferError | None = IncompatibleError(incompatible) if incompatible else None
        if refused is None and not peer.accepted:
            refused = error_for(peer.refusal, peer.reason)
        if ticket.transfer_id in peer.handles:  # its tags would collide with the live transfer's
            raise ValueError(f"ticket of {ticket.request_id!r} is already being transferred")
        revoke = peer.revoked.get(ticket.transfer_id)
        if refused is None and revoke is not None and peer.eager(ticket):
            # The receiver ended it before we opened, and freed the blocks on our AbortAck.
            revoked = error_for(revoke.code, f"aborted by decode: {revoke.reason}")
            self.metrics.transfer_failed(revoked.reason)
            raise revoked
        if refused is not None:
            # Nothing was sent; the receiver can free now instead of at its deadline.
            self.send(peer, wire.Abort(ticket.transfer_id, refused.reason.value, str(refused), ()))
            self.metrics.transfer_failed(refused.reason)
            raise refused
        eager = peer.eager(ticket)
        handle = SenderHandle(
            self,
            peer,
            ticket,
            segments,
            deadline=loop.time() + remaining,
            writer=peer.writer,
            region=peer.region,
            eager=eager,
            split=peer.split,
            src_blocks=src_block_ids,
        )
        peer.handles[ticket.transfer_id] = handle
        rma = peer.writer is not None
        self.metrics.opened(peer.writer.path if peer.writer is not None else "tagged")
        lengths = tuple(seg.num_blocks for seg in segments)
        # A failed send shows as the connection breaking, which fails the handle.
        opening = wire.Open(ticket.transfer_id, ticket.request_id, lengths, rma=rma, eager=eager)
        delay = self.config.faults.open_delay_s
        if delay:  # unless the handle failed meanwhile: its AbortAck must not precede its Open
            loop.call_later(delay, self._send_open, handle, peer, opening)
        else:
            self.send(peer, opening)
        return handle

    async def connect(self, address: str) -> None:
        """Connect and handshake ahead of the first transfer (UCX wire-up takes a while).

        Raises IncompatibleError when the receiver refuses the handshake.
        """
        peer = await self._connect(address)
        if not peer.accepted:
            raise IncompatibleError(peer.reason)

    async def close(self) -> None:
        """Abort every open transfer (bounded by the settle timeout) and drop connections."""
        handles = [h for peer in self._peers.values() for h in peer.handles.values()]
        await asyncio.gather(*(h.abort("prefill sender closing") for h in handles), return_exceptions=True)
        if self._transport is not None:
            await self._transport.close()
        self._peers.clear()

    # -- connections -------------------------------------------------------
    def _ready_peer(self, address: str) -> _Peer | None:
        """The handshaken, live connection to ``address``, without a trip through the loop."""
        peer = self._peers.get(address)
        if peer is None or not peer.ready.done() or peer.ready.exception() is not None:
            return None
        return peer if peer.conn is not None and peer.conn.alive else None

    async def _connect(self, address: str) -> _Peer:
        # Cached until the connection breaks; a refused handshake too (it would be refused again).
        peer = self._peers.get(address)
        if peer is None or (peer.ready.done() and (peer.conn is None or not peer.conn.alive)):
            loop = asyncio.get_running_loop()
            peer = _Peer(address, loop.create_future())
            self._peers[address] = peer
            peer.handshake = loop.create_task(self._handshake(peer))  # held: the loop keeps only weak refs
        await asyncio.shield(peer.ready)
        return peer

    async def _handshake(self, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.config.connect_timeout_s
        try:
            if self._transport is None:
                # (Which same-host writer, if any, follows the KV's memory: writers.select.same_host_path.)
                self._transport = make_transport(self.config)
            conn = await self._transport.connect(peer.address)
            peer.conn = conn
            peer.hello_reply = loop.create_future()
            conn.set_handlers(partial(self._on_message, peer), partial(self._on_close, peer))
            token, nonce = self.config.cluster_token, auth.new_nonce()
            pv = self.compat.protocol_version
            proof = auth.hello_proof(token, pv, self._hash, self._name, nonce) if token else ""
            hello = wire.Hello(
                pv,
                self._hash,
                self._name,
                nonce=nonce if token else "",
                proof=proof,
                rma=self.config.rma,
                kv_heads=self.ranks.wire(),
            )
            conn.post_message(wire.encode_message(hello))
            reply = await asyncio.wait_for(asyncio.shield(peer.hello_reply), timeout)
            if token and not auth.same(auth.reply_proof(token, nonce, reply.ok, reply.conn_id), reply.proof):
                # Not a decode worker of this cluster: it must not get a prompt's KV.
                log.warning("refused KV peer %s: it did not prove the cluster token", describe(peer.address))
                reply = wire.HelloReply(
                    ok=False,
                    reason=f"decode worker {describe(peer.address)} did not prove the cluster token",
                    code=FailureReason.UNAUTHENTICATED.value,
                )
        except Exception as exc:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            if peer.conn is not None:
                peer.conn.close()
            err = (
                exc
                if isinstance(exc, TransferError)
                else PeerDiedError(f"handshake with {describe(peer.address)}: {exc!r}")
            )
            peer.ready.set_exception(err)
            peer.ready.exception()  # retrieved here; waiters get it through shield
            return
        peer.accepted, peer.reason, peer.conn_id = reply.ok, reply.reason, reply.conn_id
        if reply.ok and reply.rma is not None and self.config.rma and peer.conn is not None:
            # Offered: put into the receiver's tensor. Should unpacking its key fail here, every
            # Open on this connection says tagged (Open.rma), so the two never mix.
            if reply.rma.layer_bytes * self.compat.num_layers > reply.rma.length:
                log.warning("ignoring a malformed KV region from %s", describe(peer.address))
            else:
                try:
                    peer.writer, peer.region = peer.conn.remote_writer(reply.rma, self.spans.flat), reply.rma
                except Exception:  # noqa: BLE001 - tagged pushes then; never a peer left half open
                    # (``ready`` must resolve: every later Open to this peer waits for it.)
                    log.exception(
                        "one-sided writes to %s failed to set up: tagged pushes", describe(peer.address)
                    )
                    peer.writer, peer.region = None, None
                if peer.writer is not None:
                    peer.hello_seq = reply.seq
        if reply.ok:
            refused = self._route(peer, reply)
            if refused:  # a tensor-parallel pair this connection cannot serve: every Open refused here
                log.warning("KV to %s: %s", describe(peer.address), refused)
                peer.accepted, peer.reason, peer.writer, peer.hello_seq = False, refused, None, -1
        peer.refusal = reply.code or FailureReason.INCOMPATIBLE.value
        peer.ready.set_result(None)

    def _route(self, peer: _Peer, reply: wire.HelloReply) -> str:
        """Set ``peer.split`` where either side is a tensor-parallel group; the reason it cannot be, else
        "". A group's heads move by one-sided writes only, one writer per receiving rank."""
        try:
            dst = heads_from_wire(reply.kv_heads, self.compat.num_kv_heads, "the decode worker's ranks")
        except ValueError as exc:
            return str(exc)
        if not needs_split(self.ranks.heads, dst):
            return ""
        what = f"tensor-parallel KV ({len(self.ranks.heads)} prefill ranks, {len(dst)} decode ranks)"
        regions = (reply.rma, *reply.rank_regions) if reply.rma is not None else ()
        if peer.writer is None or peer.region is None or len(regions) != len(dst) or peer.conn is None:
            return f"{what} moves by one-sided writes only, which this connection does not have"
        writers = [peer.writer]
        for region in regions[1:]:
            if region.layer_bytes * self.compat.num_layers > region.length:
                return f"{what}: a malformed region of a decode rank"
            try:
                w = peer.conn.remote_writer(region, self.spans.flat)
            except Exception as exc:  # noqa: BLE001 - refused below, never a peer left half open
                w, why = None, repr(exc)
            else:
                why = "no writer"
            if w is None:
                for opened in writers:
                    opened.close()
                return f"{what}: no one-sided writes into a decode rank ({why})"
            writers.append(w)
        split_writer = SplitWriter(writers)
        peer.writer, peer.split = split_writer, SplitRoute(self.ranks, dst, split_writer, regions)
        return ""

    def _send_open(self, handle: SenderHandle, peer: _Peer, opening: wire.Open) -> None:
        if handle.error is None:
            self.send(peer, opening)

    def send(self, peer: _Peer, msg: wire.Message) -> None:
        """Fire-and-forget control message (failures surface as the connection breaking)."""
        if peer.conn is None or not peer.conn.alive:
            return
        peer.conn.post_message(wire.encode_message(msg))

    def forget(self, handle: SenderHandle) -> None:
        if handle.error is not None or handle.state is HandleState.DONE:
            peer = cast(_Peer, handle._peer)  # every handle this sender opened holds one of its _Peers
            if peer.handles.get(handle.transfer_id) is handle:
                del peer.handles[handle.transfer_id]

    def _on_message(self, peer: _Peer, payload: bytes) -> None:
        try:
            msg = wire.decode_message(payload)
        except Exception as exc:
            log.warning("closing connection to %s: undecodable message: %s", describe(peer.address), exc)
            if peer.conn is not None:
                peer.conn.close()
            return
        if isinstance(msg, wire.HelloReply):
            if peer.hello_reply is not None and not peer.hello_reply.done():
                peer.hello_reply.set_result(msg)
            return
        handle = peer.handles.get(getattr(msg, "transfer_id", -1))
        if isinstance(msg, wire.Accept):
            if handle is not None:
                handle.on_accept()
        elif isinstance(msg, wire.CompleteAck):
            if handle is not None and not handle.complete_ack.done():
                handle.complete_ack.set_result(None)
        elif isinstance(msg, wire.Abort):
            if msg.deadline_unix:  # a revoke: never open this ticket now
                if self.config.faults.ignore_revokes:
                    log.warning("fault injection: ignoring the revoke of transfer %d", msg.transfer_id)
                    return
                peer.remember_revoke(msg)
            if handle is not None:
                handle.on_peer_abort(msg)
            else:  # nothing of this transfer is in flight from here
                self.send(peer, wire.AbortAck(msg.transfer_id, ()))
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, describe(peer.address))

    def _on_close(self, peer: _Peer, exc: Exception | None) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        for handle in list(peer.handles.values()):
            handle.on_peer_died(exc)
