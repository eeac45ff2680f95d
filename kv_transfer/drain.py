"""Decode side: receive what the sender of a refused ``Open`` pushed into scratch memory, never into KV
blocks, until the sender says which layers it sent and the rest are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial

import torch

from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.kvbuf import scratch
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.plan import MAX_SEGMENTS, layer_tag, tag_base
from pdserve.kv_transfer.reservation import Drain, PrefillConn

log = logging.getLogger(__name__)


class Drains:
    """Every drain of one receiver; all methods run on its event loop thread.

    A sender pushes right after Open, so by the time an Open is refused its messages may already wait
    in UCX, and rendezvous sends stay pending until a receive matches them: hence a scratch receive for
    every (layer, segment) of the refused plan. A drain that hears nothing cancels everything after
    ``settle_timeout_s``, and drops the connection if even that stalls.
    """

    def __init__(
        self, kv: torch.Tensor, block_bytes: int, settle_timeout_s: float, metrics: TransferMetrics
    ) -> None:
        self._kv = kv
        self._metrics = metrics
        self._block_bytes = block_bytes
        self._num_layers = kv.shape[0]
        self._max_blocks = kv.shape[1]
        self._settle_timeout_s = settle_timeout_s
        self.live = 0  # drains with receives still posted

    def plausible(self, segments: Sequence[int]) -> bool:
        """Could a well-behaved sender have sent this plan here? (Else the connection is dropped.)"""
        return (
            0 < len(segments) <= MAX_SEGMENTS
            and all(n >= 1 for n in segments)
            and sum(segments) <= self._max_blocks
        )

    def start(self, peer: PrefillConn, transfer_id: int, segments: Sequence[int]) -> None:
        """Post a scratch receive for every message of the plan; call only for a plausible plan."""
        sizes = [n * self._block_bytes for n in segments]
        buf = scratch(self._kv, max(sizes))
        drain = Drain(transfer_id, buf)
        peer.drains[transfer_id] = drain  # an earlier, drained one settles on its own
        self.live += 1
        base = tag_base(transfer_id, peer.conn_id)
        for layer in range(self._num_layers):
            ops = drain.ops[layer] = []
            for index, size in enumerate(sizes):
                drain.unsettled += 1
                done = partial(self._settled, peer, drain)
                ops.append(peer.conn.recv_data(buf[:size], base | layer_tag(layer, index), done))
        drain.grace = asyncio.get_running_loop().call_later(self._settle_timeout_s, self._force, peer, drain)

    def on_sent(self, peer: PrefillConn, transfer_id: int, sent_layers: Sequence[int]) -> bool:
        """The sender says what it sent: cancel the rest. False if no such drain."""
        drain = peer.drains.get(transfer_id)
        if drain is None:
            return False
        self._cancel_unsent(drain, set(sent_layers))
        if drain.unsettled:  # the sent layers land by themselves, within a settle timeout
            if drain.grace is not None:
                drain.grace.cancel()
            loop = asyncio.get_running_loop()
            drain.grace = loop.call_later(self._settle_timeout_s, self._force, peer, drain)
        return True

    def close(self, peer: PrefillConn) -> None:
        """The connection broke: every receive fails or is cancelled; forget the drains."""
        for drain in list(peer.drains.values()):
            self._cancel_unsent(drain, set())

    def _cancel_unsent(self, drain: Drain, sent: set[int]) -> None:
        if drain.drained:
            return
        drain.drained = True
        for layer, ops in drain.ops.items():
            if layer not in sent:
                for op in ops:
                    op.cancel()

    def _settled(self, peer: PrefillConn, drain: Drain, exc: TransferError | None) -> None:
        drain.unsettled -= 1
        if drain.unsettled:
            return
        if drain.grace is not None:
            drain.grace.cancel()
        if peer.drains.get(drain.transfer_id) is drain:
            del peer.drains[drain.transfer_id]
        drain.ops.clear()
        self.live -= 1

    def _force(self, peer: PrefillConn, drain: Drain) -> None:
        if not drain.unsettled:
            return
        if not drain.drained:
            self._metrics.settle_timed_out()  # the sender never said which layers it sent
            self._cancel_unsent(drain, set())
            drain.grace = asyncio.get_running_loop().call_later(
                self._settle_timeout_s, self._force, peer, drain
            )
            return
        log.warning(
            "refused transfer %d: %d receives still in flight; closing the connection",
            drain.transfer_id,
            drain.unsettled,
        )
        peer.conn.close()
