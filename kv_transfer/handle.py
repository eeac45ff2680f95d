"""Prefill side, one transfer: push layers as the forward produces them, then complete or abort.

Tagged sends go out on the event loop; one-sided writes go through the connection's ``RemoteWriter``, on
the forward thread itself where the writer is direct.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pdserve.kv_transfer import wire
from pdserve.kv_transfer.errors import (
    AbortedError,
    DeadlineError,
    FailureReason,
    PeerDiedError,
    TransferError,
    error_for,
)
from pdserve.kv_transfer.kvbuf import layer_digests, ready_marker
from pdserve.kv_transfer.plan import Segment, layer_tag, tag_base
from pdserve.kv_transfer.tp_pack import sent_digests
from pdserve.kv_transfer.tp_plan import dst_runs, writes_per_layer
from pdserve.kv_transfer.transport import Connection, DataOp, RemoteWriter, describe

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from pdserve.kv_transfer.config import TransferConfig
    from pdserve.kv_transfer.kvbuf import KVSpans
    from pdserve.kv_transfer.metrics import TransferMetrics
    from pdserve.kv_transfer.split import SplitRoute

log = logging.getLogger(__name__)
T = TypeVar("T")

# CUDA only: a layer whose writes have not finished is re-checked on every loop iteration for this long
# after its push, then every millisecond. A shorter timer is no finer: asyncio rounds it up to the
# millisecond of its epoll wait, and uvloop runs it on the next iteration, so the loop would spin for as
# long as the forward runs ahead of the GPU.
_READY_SPIN_S = 2e-3
_READY_POLL_S = 1e-3
_BOOKS_LAG_S = 0.005  # direct writes: how often the loop is woken to book them, at most
# Digests of a transfer larger than this are taken on a worker thread (xxhash releases the GIL), so the
# event loop serves other streams meanwhile; smaller ones cost less than the hop.
_DIGEST_INLINE_BYTES = 4 << 20
# RMA: a Progress frame at most this often while layers are put (the decode side's stall watch sees no
# puts land before Complete; a frame a half second costs nothing next to a layer's data).
PROGRESS_INTERVAL_S = 0.5


class HandleState(Enum):
    # Open sent; each pushed layer goes out at once, without waiting for an answer to Open, while the
    # forward computes the next layers.
    STREAMING = "streaming"
    # Complete sent once every layer was issued; waiting for the ack that says every byte landed (and so
    # no send reads P's blocks any more).
    COMPLETING = "completing"
    DONE = "done"  # acknowledged: the receiver has the data
    FAILED = "failed"  # aborted, deadline, peer died or refused: every wait raises the error


class NotifyPeer(Enum):
    """What a failed handle tells the receiver once its sends have settled."""

    ABORT = "abort"  # our own failure: Abort with the layers we sent
    ACK = "ack"  # the receiver aborted: AbortAck with the layers we sent
    NOTHING = "nothing"  # the connection is gone or the receiver already knows


@dataclass(frozen=True)
class SendStats:
    request_id: str
    bytes: int
    seconds: float  # open() to the receiver's acknowledgement
    layer_seconds: tuple[float, ...]  # per layer: push_layer call to every message of it completed
    messages: int = 0  # data messages or writes sent (layers x contiguous segments, or x rank pairs too)
    writes_per_layer: int = 0


class PeerLink(Protocol):
    """One decode worker as the sender keeps it: the connection and the receiver's id for it."""

    address: str
    conn: Connection | None
    conn_id: int  # part of every data tag, so only this connection matches the posted receives


class HandleOwner(Protocol):
    """What a handle needs of the ``KVSender`` that opened it (the sender implements this; the handle
    never imports the sender, so the two modules do not import each other)."""

    kv: torch.Tensor
    spans: KVSpans
    compat: wire.KVCompat
    config: TransferConfig
    metrics: TransferMetrics

    def send(self, peer: Any, msg: wire.Message) -> None: ...

    def forget(self, handle: SenderHandle) -> None: ...

    def take_corruption(self) -> bool: ...


class SenderHandle:
    def __init__(
        self,
        sender: HandleOwner,
        peer: PeerLink,
        ticket: wire.TransferTicket,
        segments: list[Segment],
        deadline: float,
        writer: RemoteWriter | None = None,
        region: wire.RemoteRegion | None = None,
        eager: bool = False,
        split: SplitRoute | None = None,
        src_blocks: Sequence[int] = (),
    ) -> None:
        """``split``: the connection's route between tensor-parallel ranks (``writer`` is its
        ``SplitWriter``), which reads ``src_blocks`` (the source blocks sent, token order)."""
        self._sender = sender
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self._kv = sender.kv
        self._spans = sender.spans
        self.request_id = ticket.request_id
        self.transfer_id = ticket.transfer_id
        self.num_layers = sender.compat.num_layers
        self.state = HandleState.STREAMING
        self._segments = segments
        self._tag_base = tag_base(ticket.transfer_id, peer.conn_id)
        self._deadline = deadline  # loop time
        # The transfer's duration (pdserve_kv_transfer_seconds) on a fine clock: uvloop's loop.time()
        # moves in whole milliseconds, and a transfer can take less than one.
        self._t_open = time.perf_counter()
        self._progress_at = self._loop.time()  # RMA: when the receiver last heard how far the puts are
        self._lock = threading.Lock()
        self._pushed: set[int] = set()
        self._incoming: list[tuple[int, float, Any]] = []  # pushed, not yet seen by the loop
        self._wake_pending = False
        self._issued = 0  # layers sent or dropped (fault injection)
        self._sent_layers: list[int] = []
        self._layer_pending: dict[int, int] = {}
        self._layer_seconds: dict[int, float] = {}
        self._ops: dict[int, DataOp] = {}  # sends in flight, by a per-handle number
        self._op_ids = 0
        self._bytes = 0
        self._error: TransferError | None = None
        self._failed: asyncio.Future[None] = self._loop.create_future()
        self._all_issued = asyncio.Event()
        self._settled = asyncio.Event()
        self._settled.set()
        self.complete_ack: asyncio.Future[None] = self._loop.create_future()
        self._waiting: set[asyncio.Future[Any]] = set()  # futures ``until`` awaits: fail() fails them
        self._cleanup: asyncio.Task[None] | None = None
        # One-sided writes: the receiver's region, and layers pushed before its Accept came.
        self._writer = writer if region is not None else None
        self._region = region
        self._accepted = self._writer is None or eager
        self._held: list[tuple[int, float]] = []
        # Fault injection (FaultConfig.corrupt_transfers): the last layer's first run gets a flipped byte.
        self._corrupt = sender.take_corruption() if self._spans.host and split is None else False
        self._corrupted: Any = None  # the bad bytes, alive while a send or put may read them
        # Each layer's runs, in bytes from the layer's start on either side: (source, destination, length).
        unit = self._spans.block_bytes
        self._runs = [(seg.src_start * unit, seg.dst_start * unit, seg.num_blocks * unit) for seg in segments]
        self._run_bytes = sum(run[2] for run in self._runs)
        self._writes_per_layer = len(segments)  # one message or put per run
        # Tensor parallelism: each layer's pieces, rank by rank; packed pieces kept while puts may read them.
        self._split = split
        if split is not None:
            self._src_blocks = list(src_blocks)
            self._segment_blocks = [(seg.src_start, seg.dst_start, seg.num_blocks) for seg in segments]
            self._dst_runs = dst_runs(ticket.block_ids)
            self._keep: list[torch.Tensor] = []
            heads = [len(h) for h in split.dst_heads]
            self._run_bytes = len(ticket.block_ids) * sum(split.sizes.block(h) for h in heads)
            self._writes_per_layer = writes_per_layer(split.plan, len(segments), len(self._dst_runs))
        # A direct writer (a memory copy: cma.py; a copy ordered after the layer on its CUDA stream:
        # cuda_ipc.py) with eager puts writes each layer on the thread that pushes it: no hop to the
        # loop, no wait for the layer to be ready, and the loop never blocks on the copy.
        # _write_lock is held across each such write; once _error is set no write starts, so
        # taking the lock once after that means no write is in progress any more.
        self._direct = (
            bool(eager and self._writer is not None and getattr(self._writer, "direct", False))
            and not sender.config.faults.active
        )
        self._write_lock = threading.Lock()
        self._next_wake = time.perf_counter() + _BOOKS_LAG_S  # after which a direct write wakes the loop
        # Direct writes for the loop's books: layer, push to written (s), bytes, error.
        self._written: list[tuple[int, float, int, TransferError | None]] = []

    @property
    def rma(self) -> bool:
        return self._writer is not None

    @property
    def path(self) -> str:
        """How this transfer's KV moves (``metrics.TRANSFER_PATHS``): its writer's way, or tagged."""
        return self._writer.path if self._writer is not None else "tagged"

    @property
    def layers_sent(self) -> int:
        """Layers whose data went out (sends or puts issued), for progress and tests."""
        return len(self._sent_layers)

    @property
    def error(self) -> TransferError | None:
        return self._error

    # -- forward thread ----------------------------------------------------
    def push_layer(self, layer: int) -> None:
        """Send ``layer``'s K/V of this request; call right after the forward wrote them.

        Thread-safe and non-blocking: it only schedules the send on the event
        loop. After a failure it is a no-op (the forward need not know).
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        if self._direct:
            return self._write_direct(layer)
        marker = ready_marker(self._kv.device)
        with self._lock:
            if not self._claim(layer):
                return
            self._incoming.append((layer, time.perf_counter(), marker))
            # One wake-up per burst: layers pushed before the loop gets the GIL go together.
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            self._loop.call_soon_threadsafe(self._drain_incoming)

    def push_layers(self, first: int, count: int) -> None:
        """``push_layer`` for layers ``first`` to ``first + count - 1``, every one already written (a
        prefill under a CUDA graph writes all layers before its hooks run; a transfer that opens
        mid-forward catches up on the layers written so far). A direct writer copies them in one call:
        one strided copy per contiguous run (cuda_ipc.py), one system call (cma.py), where a push per
        layer costs a call, and on CUDA that call's host time, each."""
        if count < 1 or first < 0 or first + count > self.num_layers:
            raise ValueError(f"layers {first} .. {first + count - 1} outside [0, {self.num_layers})")
        if self._direct:
            return self._write_direct(first, count)  # (its claim checks every layer before any)
        with self._lock:  # one pushed already: none of them is pushed here
            twice = [layer for layer in range(first, first + count) if layer in self._pushed]
        if twice:
            raise ValueError(f"layer {twice[0]} pushed twice")
        for layer in range(first, first + count):
            self.push_layer(layer)

    def _claim(self, layer: int, count: int = 1) -> bool:
        """Under ``_lock``: mark ``count`` layers from ``layer`` pushed (none when one of them already
        was: ValueError); False when the transfer already failed."""
        pushed = self._pushed
        if count == 1:  # push_layer: every layer of every forward comes here
            if layer in pushed:
                raise ValueError(f"layer {layer} pushed twice")
            pushed.add(layer)
            return self._error is None
        layers = range(layer, layer + count)
        twice = [i for i in layers if i in pushed]
        if twice:
            raise ValueError(f"layer {twice[0]} pushed twice")
        pushed.update(layers)
        return self._error is None

    def _write_direct(self, layer: int, count: int = 1) -> None:
        """Forward thread: put ``count`` layers from ``layer`` now with the direct writer; the loop does
        the books."""
        assert self._writer is not None and self._region is not None
        pushed_at = time.perf_counter()
        with self._write_lock:
            with self._lock:
                if not self._claim(layer, count):
                    return
            nbytes, err = self._write_runs(layer, count)
        now = time.perf_counter()
        with self._lock:
            if count == 1:
                self._written.append((layer, now - pushed_at, nbytes, err))
            else:
                self._written.extend((i, now - pushed_at, nbytes, err) for i in range(layer, layer + count))
            # The books may lag (complete() and a failure's settling catch up): a wake per layer
            # would have the loop contend with this thread for the GIL.
            due = err is not None or len(self._pushed) == self.num_layers or now >= self._next_wake
            if not due:
                return
            self._next_wake = now + _BOOKS_LAG_S
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            self._loop.call_soon_threadsafe(self._drain_incoming)

    # -- event loop: sending -----------------------------------------------
    def _drain_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
            written, self._written = self._written, []
            self._wake_pending = False
        for layer, pushed_at, marker in incoming:
            self._issue(layer, pushed_at, marker)
        if written:
            self._account_written(written)

    def _issue(self, layer: int, pushed_at: float, marker: Any) -> None:
        if self._error is not None:
            return
        if marker is not None and not marker():
            if time.perf_counter() - pushed_at < _READY_SPIN_S:
                self._loop.call_soon(self._issue, layer, pushed_at, marker)
            else:
                self._loop.call_later(_READY_POLL_S, self._issue, layer, pushed_at, marker)
            return
        faults = self._sender.config.faults
        if layer in faults.drop_layers:
            log.warning("fault injection: dropping layer %d of %s", layer, self.request_id)
            self._count_issued()
            return
        delay = faults.delay_for(layer)
        if delay:
            self._loop.call_later(delay, self._send_layer, layer, pushed_at)
        else:
            self._send_layer(layer, pushed_at)

    def _send_layer(self, layer: int, pushed_at: float) -> None:
        if self._error is not None:
            return
        if self._writer is not None:
            if self._accepted:
                self._put_layer(layer, pushed_at)
            else:
                self._held.append((layer, pushed_at))
            return
        conn = self._peer.conn
        assert conn is not None
        spans, unit, send = self._spans, self._spans.block_bytes, conn.send_data
        self._layer_pending[layer] = len(self._segments)
        self._sent_layers.append(layer)
        self._settled.clear()
        for seg in self._segments:
            src = spans.span(layer, seg.src_start, seg.num_blocks)
            if self._corrupt and layer == self.num_layers - 1 and seg.index == 0:
                src = self._corrupted = src.copy()
                src[0] ^= 0xFF
                log.warning("fault injection: flipping a byte of layer %d of %s", layer, self.request_id)
            self._op_ids += 1
            done = partial(self._sent, self._op_ids, layer, pushed_at, seg.num_blocks * unit)
            self._ops[self._op_ids] = send(src, self._tag_base | layer_tag(layer, seg.index), done)
        self._count_issued()

    def on_accept(self) -> None:
        """The receiver took the RMA Open: its blocks are ours to write until we say we stopped."""
        if self._accepted or self._error is not None:
            return
        self._accepted = True
        held, self._held = self._held, []
        for layer, pushed_at in held:
            self._put_layer(layer, pushed_at)

    def _put_layer(self, layer: int, pushed_at: float) -> None:
        if self._error is not None:
            return
        nbytes, err = self._write_runs(layer)
        self._account_put(layer, time.perf_counter() - pushed_at, nbytes, err)

    def _write_runs(self, layer: int, count: int = 1) -> tuple[int, TransferError | None]:
        """Write the runs of ``count`` layers from ``layer`` into the receiver's region: (bytes of each
        layer, error). A write that failed may have written part (the books count its layers as sent
        either way)."""
        assert self._writer is not None and self._region is not None
        src_stride, dst_stride = self._spans.layer_bytes, self._region.layer_bytes
        local = self._spans.address + layer * src_stride
        try:
            if self._split is not None:
                runs, keep = self._dst_runs, self._keep
                for i in range(layer, layer + count):
                    self._split.write_layer(i, self._src_blocks, self._segment_blocks, runs, keep)
            elif count == 1:
                self._writer.write_runs(local, layer * dst_stride, self._runs)
                if self._corrupt and layer == self.num_layers - 1:
                    self._write_flipped_byte(layer)
            else:
                offset = layer * dst_stride
                self._writer.write_layers(local, src_stride, offset, dst_stride, count, self._runs)
        except TransferError as exc:
            return 0, exc
        return self._run_bytes, None

    def _write_flipped_byte(self, layer: int) -> None:
        """Fault injection: put the first byte of ``layer``'s first run again, flipped."""
        import numpy as np

        assert self._writer is not None and self._region is not None
        first = self._segments[0]
        bad = self._corrupted = np.array(self._spans.span(layer, first.src_start, 1)[:1]) ^ 0xFF
        log.warning("fault injection: flipping a byte of layer %d of %s", layer, self.request_id)
        dst = layer * self._region.layer_bytes
        self._writer.write_runs(bad.ctypes.data, dst, [(0, self._runs[0][1], 1)])

    async def _digests(self) -> tuple[int, ...]:
        """Every layer's digest of what this transfer wrote (``wire.Complete.digests``); () when the
        configuration asks for none or the KV is in device memory."""
        if not self._sender.config.digest or not self._spans.host:
            return ()
        if self._split is not None:
            split, blocks = self._split, self._src_blocks
            if self._run_bytes * self.num_layers <= _DIGEST_INLINE_BYTES:
                return sent_digests(split.src.kv, split.plan, blocks, self.num_layers)
            return await asyncio.to_thread(sent_digests, split.src.kv, split.plan, blocks, self.num_layers)
        runs = [(seg.src_start, seg.num_blocks) for seg in self._segments]
        if self._run_bytes * self.num_layers <= _DIGEST_INLINE_BYTES:
            return layer_digests(self._spans, runs, self.num_layers)
        return await asyncio.to_thread(layer_digests, self._spans, runs, self.num_layers)

    def _account_put(self, layer: int, seconds: float, nbytes: int, err: TransferError | None) -> None:
        """The loop's books of one layer's puts (issued here or written by the forward thread)."""
        self._sent_layers.append(layer)  # also after a failed put: it may have written part
        self._settled.clear()  # until a flush covers this layer
        self._op_ids += self._writes_per_layer
        if err is not None:
            self.fail(err)
            return
        self._bytes += nbytes
        self._sender.metrics.add_bytes(nbytes)
        self._layer_seconds[layer] = seconds  # push to issued; the flush at the end says landed

        self._sender.metrics.layer_done(seconds)
        self._count_issued()
        now = self._loop.time()
        if now - self._progress_at >= PROGRESS_INTERVAL_S and len(self._sent_layers) < self.num_layers:
            self._progress_at = now  # (the last layer needs none: Complete follows)
            self._sender.send(self._peer, wire.Progress(self.transfer_id, len(self._sent_layers)))

    def _account_written(self, written: list[tuple[int, float, int, TransferError | None]]) -> None:
        """``_account_put`` for a batch of direct writes, at once: the books of a whole forward (a wake
        after its last layer) sit between its last push and ``complete``."""
        if any(err is not None for *_, err in written):  # rare: layer by layer, up to the failure
            for layer, seconds, nbytes, err in written:
                self._account_put(layer, seconds, nbytes, err)
            return
        n = len(written)
        self._sent_layers.extend(w[0] for w in written)
        self._settled.clear()  # until a flush covers these layers
        self._op_ids += n * self._writes_per_layer
        nbytes = sum(w[2] for w in written)
        self._bytes += nbytes
        metrics = self._sender.metrics
        metrics.add_bytes(nbytes)
        layer_seconds = self._layer_seconds
        for layer, seconds, _, _ in written:
            layer_seconds[layer] = seconds  # push to written; the check at the end says landed
            metrics.layer_done(seconds)
        self._issued += n
        if self._issued == self.num_layers:
            self._all_issued.set()
        sent = len(self._sent_layers)
        now = self._loop.time()
        if now - self._progress_at >= PROGRESS_INTERVAL_S and sent < self.num_layers:
            self._progress_at = now  # (the last layer needs none: Complete follows)
            self._sender.send(self._peer, wire.Progress(self.transfer_id, sent))

    def _flush_started(self) -> asyncio.Future[TransferError | None]:
        """A future of the writer's flush: None once every put issued so far has landed in the
        receiver's memory, else the error. Done already where the writer knew at once (copies a CUDA
        event says are done): ``complete`` then sends Complete without a loop iteration between."""
        assert self._writer is not None
        done: asyncio.Future[TransferError | None] = self._loop.create_future()

        def flushed(err: TransferError | None) -> None:
            if not done.done():
                done.set_result(err)

        self._writer.flush(flushed)
        return done

    async def _flush(self) -> None:
        """Every put issued so far has landed in the receiver's memory (or raise)."""
        self._landed(await self._flush_started())

    def _landed(self, err: TransferError | None) -> None:
        if err is not None:
            raise err
        self._settled.set()

    def _count_issued(self) -> None:
        self._issued += 1
        if self._issued == self.num_layers:
            self._all_issued.set()

    def _sent(self, op_id: int, layer: int, pushed_at: float, nbytes: int, exc: TransferError | None) -> None:
        del self._ops[op_id]
        if exc is None:
            self._bytes += nbytes
            self._sender.metrics.add_bytes(nbytes)
            self._layer_pending[layer] -= 1
            if self._layer_pending[layer] == 0:
                seconds = time.perf_counter() - pushed_at
                self._layer_seconds[layer] = seconds
                self._sender.metrics.layer_done(seconds)
        elif self._error is None:
            alive = self._peer.conn is not None and self._peer.conn.alive
            self.fail(exc, NotifyPeer.ABORT if alive else NotifyPeer.NOTHING)
        if not self._ops:
            self._settled.set()

    # -- event loop: completion --------------------------------------------
    async def until(self, aw: Awaitable[T], what: str) -> T:
        """Wait for ``aw`` unless the transfer fails or its deadline passes first."""
        if self._error is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise self._error
        if isinstance(aw, asyncio.Future):
            if aw.done():  # common on the fast path: skip the wait
                return aw.result()
            return await self._until_future(aw, what)
        target: asyncio.Future[Any] = asyncio.ensure_future(aw)
        timeout = max(self._deadline - self._loop.time(), 0.0)
        done, _ = await asyncio.wait(
            {target, self._failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if target not in done:
            target.cancel()
            if self._error is None:
                self.fail(
                    DeadlineError(f"transfer of {self.request_id!r}: deadline passed waiting for {what}")
                )
            assert self._error is not None
            raise self._error
        return target.result()

    async def _until_future(self, fut: asyncio.Future[T], what: str) -> T:
        """``until`` for a future: awaited itself (``asyncio.wait`` costs two more loop iterations,
        and the completion ack is on every transfer's critical path); a failure or the deadline
        ends the wait by failing it (``fail`` sets the error on every future waited for)."""
        timer = self._loop.call_at(self._deadline, self._deadline_passed, what)
        self._waiting.add(fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiting.discard(fut)

    def _deadline_passed(self, what: str) -> None:
        if self._error is None:
            self.fail(DeadlineError(f"transfer of {self.request_id!r}: deadline passed waiting for {what}"))

    async def complete(self, first_token_id: int, choice_token_ids: tuple[int, ...] = ()) -> SendStats:
        """Send the completion with the first sampled token (``choice_token_ids``: an n > 1 request's other
        choices' first tokens); return once the receiver acknowledged.

        Call after ``push_layer`` returned for every layer. Raises the
        transfer's TransferError after the sends have settled.
        """
        if self._error is None and self.state is not HandleState.STREAMING:
            raise RuntimeError(f"complete() in state {self.state.value}")
        missing = sorted(set(range(self.num_layers)) - self._pushed)
        if missing and self._error is None:
            raise ValueError(f"complete() before every layer was pushed; missing {missing[:8]}")
        try:
            if self._error is not None:
                raise self._error
            self.state = HandleState.COMPLETING
            if self._direct:
                self._drain_incoming()  # the forward thread's writes are done: book them now
            if not self._all_issued.is_set():
                await self.until(self._all_issued.wait(), "every layer to be issued")
            if self._writer is not None and self._writer.synchronous:  # every copy is done: check
                self._landed(self._writer.check())
            elif self._writer is not None:  # Complete tells the receiver the puts have landed
                # (a future, not a coroutine: ``until`` awaits it without a task and asyncio.wait)
                self._landed(await self.until(self._flush_started(), "the puts to land"))
            # Sent before the data has landed: D acks once both are in, saving a round trip.
            put = len(self._sent_layers) if self._writer is not None else -1
            digests = await self._digests()
            if self._error is not None:  # (failed while the digests were taken)
                raise self._error
            self._sender.send(
                self._peer,
                wire.Complete(self.transfer_id, first_token_id, put, tuple(choice_token_ids), digests),
            )
            await self.until(self.complete_ack, "the completion ack")
            # The ack says every byte landed, so no send reads P's blocks any more; the sends'
            # own completions (for the byte count and per-layer times) are normally in already.
            if not self._settled.is_set():
                await self.until(self._settled.wait(), "every send to complete")
        except TransferError as err:
            if self._error is None:
                self.fail(err)
            await self.settled()
            assert self._error is not None
            raise self._error from None
        self.state = HandleState.DONE
        seconds = time.perf_counter() - self._t_open
        self._sender.metrics.transfer_done(seconds)
        self._sender.metrics.writes_per_layer(self._writes_per_layer)
        self._sender.metrics.closed()
        self._sender.forget(self)
        layers = tuple(self._layer_seconds.get(layer, 0.0) for layer in range(self.num_layers))
        return SendStats(self.request_id, self._bytes, seconds, layers, self._op_ids, self._writes_per_layer)

    async def abort(self, reason: str = "prefill gave up") -> None:
        """Stop sending and tell the receiver; returns once no send touches P's blocks any more."""
        if self.state is HandleState.DONE:
            return
        if self._error is None:
            self.fail(AbortedError(f"aborted by prefill: {reason}"))
        await self.settled()

    # -- failure -----------------------------------------------------------
    def fail(self, err: TransferError, notify: NotifyPeer = NotifyPeer.ABORT) -> None:
        if self._error is not None or self.state is HandleState.DONE:
            return
        with self._lock:  # from here on no direct write starts (_write_direct checks under it)
            self._error = err
        self.state = HandleState.FAILED
        self._failed.set_result(None)
        for fut in self._waiting:
            if not fut.done():
                fut.set_exception(err)
        self._sender.metrics.transfer_failed(err.reason)
        self._sender.metrics.closed()
        log.info("transfer %s failed: %s", self.request_id, err)
        self._cleanup = self._loop.create_task(self._settle_and_notify(notify))

    def on_peer_abort(self, msg: wire.Abort) -> None:
        if self._error is None:
            reason = (
                msg.reason
                if msg.reason.startswith("aborted by decode")
                else f"aborted by decode: {msg.reason}"
            )
            self.fail(error_for(msg.code, reason), NotifyPeer.ACK)

    def on_peer_died(self, exc: Exception | None) -> None:
        self.fail(
            PeerDiedError(f"decode peer {describe(self._peer.address)} died: {exc}"), NotifyPeer.NOTHING
        )

    async def settled(self) -> None:
        if self._cleanup is not None:
            await asyncio.shield(self._cleanup)

    async def _settle_and_notify(self, notify: NotifyPeer) -> None:
        timeout = self._sender.config.settle_timeout_s
        if self._writer is not None:
            notify = await self._settle_puts(notify, timeout)
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except TimeoutError:
            log.warning("transfer %s: %d sends unsettled; cancelling", self.request_id, len(self._ops))
            self._sender.metrics.settle_timed_out()
            for op in list(self._ops.values()):
                op.cancel()
            try:
                await asyncio.wait_for(self._settled.wait(), timeout)
            except TimeoutError:
                log.warning("transfer %s: closing the connection to stop stuck sends", self.request_id)
                if self._peer.conn is not None:
                    self._peer.conn.close()
        sent = tuple(self._sent_layers)
        assert self._error is not None
        if notify is NotifyPeer.ABORT:
            code: FailureReason = self._error.reason
            self._sender.send(self._peer, wire.Abort(self.transfer_id, code.value, str(self._error), sent))
        elif notify is NotifyPeer.ACK:
            self._sender.send(self._peer, wire.AbortAck(self.transfer_id, sent))
        self._sender.forget(self)

    async def _settle_puts(self, notify: NotifyPeer, timeout: float) -> NotifyPeer:
        """Flush before telling the receiver we stopped: it frees the blocks on our word."""
        if self._direct:
            with self._write_lock:  # a write the forward thread began has ended (no new one starts)
                pass
            self._drain_incoming()  # and is in the books
        if not self._sent_layers or self._settled.is_set():
            self._settled.set()
            return notify
        try:
            await asyncio.wait_for(self._flush(), timeout)
            return notify
        except (TimeoutError, TransferError) as exc:
            if isinstance(exc, TimeoutError):
                self._sender.metrics.settle_timed_out()
            # Unconfirmed puts: say nothing the receiver would free on; the broken connection
            # (it frees on that, see receiver.py) is the only safe word left.
            log.warning("transfer %s: puts not confirmed (%r); closing the connection", self.request_id, exc)
            if self._peer.conn is not None:
                self._peer.conn.close()
            self._settled.set()
            return NotifyPeer.NOTHING
