"""The prefill worker's forward loop: schedule -> open transfers -> forward with per-layer push -> sample
-> answer -> finish.

A request's stages here (``scheduler.Stage`` names the queue states):

    submitted (``PrefillLoop.submit``: prompt, sampling, the decode worker's transfer ticket
    or none yet)
    -> queued -> scheduled into a forward under the token budget (blocks allocated)
    -> transfer opened (endpoint cached per decode worker; the handshake checks
       protocol version and compatibility hash before any data moves)
    -> during the forward, after each layer, that layer's K/V for every request
       in the batch is handed to its transfer (sent while later layers compute)
    -> first token sampled -> the request's future resolves AT ONCE (TTFT does
       not wait for decode) -> completion (carrying the first token) sent to the
       decode worker -> blocks freed when the transfer ends.
    Without a ticket at its forward (the router starts the prefill while the decode worker
    is still handing one out, so that its round trip is off TTFT's path): the forward runs
    and the first token is answered all the same. When the ticket comes (``attach``) the
    transfer opens at once: the layers the forward has written by then are pushed in one
    go, under the same lock the layer hook takes, and the later ones by the hook as they
    come (so a ticket that arrives mid-forward still streams), or, after the forward, every
    layer at once; the completion follows the forward. (The two may push out of order: each
    layer is a message or a write of its own.) No ticket within ``TICKET_WAIT_S``
    (or the request's deadline), or ``attach(None)`` (the router gave the request up): the
    blocks are freed once the forward is done with them.
    ``give_up`` (the router's RPC cancelled, deadline) or a failed transfer at any
    stage: the transfer is aborted (the decode worker frees its reservation) and
    this worker's blocks are freed.

Threads: one thread runs forwards (the worker's ``forward_thread``, which also built the
runner: the CPU kernels want one calling thread per process) and calls only the layer
hook; the event loop owns the queue, the transfers and this worker's
``BlockManager`` (P's blocks; the rules are in ``kv_transfer``'s docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import LayerHook, ModelRunner, PrefillItem
from pdserve.engine.params import SamplingParams
from pdserve.engine.sampler import Sampler, SampleRow
from pdserve.kv_transfer import AbortedError, KVSender, SenderHandle, TransferError, TransferTicket
from pdserve.prefill_pool.metrics import PrefillMetrics
from pdserve.prefill_pool.scheduler import PrefillJob, PrefillScheduler, Stage
from pdserve.worker import failures
from pdserve.worker.failures import FailureStreak

log = logging.getLogger(__name__)


MAX_FAILED_FORWARDS = failures.LIMIT  # failed forwards in a row: the model is broken, not one batch


class PrefillLoopStopped(RuntimeError):
    """The prefill loop died: this worker prefills nothing more (it drains and exits)."""


class ForwardFailed(RuntimeError):
    """A prefill forward failed: its prompts end with this; another worker may prefill them."""


class _BatchCancelled(Exception):
    """Raised from the layer hook to stop a forward whose every request was cancelled."""


# How long the KV of a prefill sent without a ticket waits for ``attach`` at most (the router sends the
# ticket as soon as the decode worker hands it out, or gives the request up).
TICKET_WAIT_S = 30.0
_EARLY_TICKETS = 1024  # tickets attached before their Prefill arrived, kept at most
_EARLY_TICKET_S = 5.0  # and for at most this long (the Prefill call was sent first)


@dataclass(eq=False)
class _Req:
    params: SamplingParams
    ticket: TransferTicket | None  # None: until ``attach``
    result: asyncio.Future[tuple[int, float]]  # (first token, forward seconds)
    ticket_by: float = 0.0  # loop time after which a missing ticket frees the blocks
    attached: asyncio.Future[TransferTicket | None] | None = None  # ticket None at submit: attach sets it
    # Ticket None at submit: the first token once its forward is over (None: it failed or was cancelled).
    forward_done: asyncio.Future[int | None] | None = None
    opening: bool = False  # a transfer is opened or being opened for it (by the batch, or late)
    late: bool = False  # ``_transfer_later`` owns the rest: the transfer, the completion, the blocks
    # Late: how opening its transfer went (an error: it did not open; the decode side was never told, so
    # the ticket's AttachTicket answers with it and the router moves the request).
    late_opened: asyncio.Future[None] | None = None
    closing: bool = False  # the loop is finishing it (a late transfer must not start, or must abort)
    finished: bool = False  # ``_finish`` ran (it runs once)
    layers_done: int = 0  # layers its forward has written (the hook counts them, under the push lock)
    first_token_unix: float = 0.0  # when its first token was sampled (wall clock; 0: not yet)
    handle: SenderHandle | None = None
    cancelled: bool = False


class _PushHook:
    """A batch's layer hook (``LayerHook``), on the forward thread: counts each job's written layers and
    pushes them to the jobs' transfers. A batch nobody waits for any more stops at the next layer, so its
    blocks come back within one layer's time instead of a whole forward's."""

    def __init__(self, live: list[PrefillJob], push_lock: threading.Lock) -> None:
        self._live = live
        self._push_lock = push_lock  # a late transfer's catch-up either pushed a layer or sees it here

    def __call__(self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        self._written(layer, 1)  # right after ``layer`` wrote its K/V into the cache

    def layers_written(self, count: int) -> None:
        """A prefill under a CUDA graph: layers 0 .. count - 1 are all written; one push for them."""
        self._written(0, count)

    def _written(self, first: int, count: int) -> None:
        if all(j.payload.cancelled for j in self._live):
            raise _BatchCancelled
        with self._push_lock:
            for j in self._live:
                j.payload.layers_done = first + count
            handles = [j.payload.handle for j in self._live if j.payload.handle is not None]
        for h in handles:
            if count == 1:
                h.push_layer(first)
            else:
                h.push_layers(first, count)


def _fail(req: _Req, exc: Exception) -> None:
    """End a request's answer with ``exc`` if it has none yet (marked retrieved: its caller may be gone)."""
    if not req.result.done():
        req.result.set_exception(exc)
        req.result.exception()


class LateOpenFailed(RuntimeError):
    """The transfer of a prefill already answered did not open (``attach_and_open``)."""


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (nobody may wait for it)."""
    if not fut.cancelled():
        fut.exception()


class PrefillLoop:
    """Create and ``start`` inside the running event loop; every method runs on that loop's thread."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        sender: KVSender,
        max_batched_tokens: int,
        metrics: PrefillMetrics,
        forward_thread: Executor | None = None,
    ) -> None:
        """``forward_thread``: a one-thread executor that runs every forward (the one that built
        ``runner``, so one thread makes this process's CPU-kernel calls); None: asyncio's default."""
        self.runner, self.sampler, self.sender, self.metrics = runner, sampler, sender, metrics
        self._forward_thread = forward_thread
        self.sched = PrefillScheduler(BlockManager(runner.num_blocks, runner.block_size), max_batched_tokens)
        self._wake = asyncio.Event()
        self.running_tokens = 0  # prompt tokens of the forward in progress
        self.running = 0  # requests in the forward in progress
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None  # why the loop stopped, if it did
        self._on_fatal: Callable[[PrefillLoopStopped], None] | None = None
        self._inflight: list[PrefillJob] = []  # the batch between scheduling and its answers
        self._failures = FailureStreak()  # failed forwards in a row (worker.failures)
        self._metrics_failed = False
        # Jobs submitted without a ticket, by (request id, attach key): the key is the router's per attempt,
        # so a late drop or ticket of an earlier attempt of the request never reaches a retry.
        self._awaiting: dict[tuple[Hashable, str], PrefillJob] = {}
        self._early: dict[tuple[Hashable, str], tuple[TransferTicket, float]] = {}  # came before submit
        # Taken by the layer hook (forward thread) and by a late transfer's catch-up around a job's
        # ``layers_done`` and ``handle`` (not around the pushes): every layer is pushed exactly once, by
        # one or the other.
        self._push_lock = threading.Lock()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        self._task.add_done_callback(self._stopped)

    def on_forward_failed(self, fn: Callable[[], object]) -> None:
        """``fn()`` runs after every failed forward (a metric)."""
        self._failures.on_failure = fn

    def on_fatal(self, fn: Callable[[PrefillLoopStopped], None]) -> None:
        """``fn(error)`` runs once if the loop dies (the worker then drains and exits)."""
        self._on_fatal = fn

    def _stopped(self, task: asyncio.Task[None]) -> None:
        """The loop must not die quietly: a worker that takes prompts and never prefills them
        hangs every request sent to it. Fail what is queued and the batch in flight (its transfers
        aborted, its blocks freed); ``submit`` refuses from now on; ``on_fatal`` runs."""
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        log.critical("prefill loop stopped: %r; refusing new prompts", self.failure, exc_info=self.failure)
        err = PrefillLoopStopped(f"prefill loop stopped: {self.failure!r}")
        while (job := self.sched.pop_queued()) is not None:
            if not job.payload.result.done():
                job.payload.result.set_exception(err)
        inflight, self._inflight = self._inflight, []
        for job in inflight:
            try:
                if not job.payload.result.done():
                    job.payload.result.set_exception(err)
                self._forward_over(job, None)
            except Exception:  # noqa: BLE001 - the others are still failed and freed
                log.exception("request %s: could not be failed cleanly", job.request_id)
        if self._on_fatal is not None:
            self._on_fatal(err)

    def _forward(self, items: list[PrefillItem], hook: LayerHook, rows: list[SampleRow]) -> list[int]:
        """On the forward thread: the prefill and the first tokens' sampling (torch ops large enough to
        run in parallel, which belong on the one thread that makes this process's parallel calls)."""
        return self.sampler(self.runner.prefill(items, hook), rows)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._background:
            await asyncio.wait(self._background, timeout=10)

    def submit(
        self,
        request_id: Hashable,
        prompt: list[int],
        params: SamplingParams,
        ticket: TransferTicket | None,
        deadline: float | None = None,
        attach_key: str = "",
    ) -> tuple[PrefillJob, asyncio.Future[tuple[int, float]]]:
        """Queue a prompt; the future gives (first token, forward seconds) or the error that ended it.
        ``ticket`` None: it comes later by ``attach`` with the same ``attach_key`` (module docstring);
        ``deadline`` (loop time) bounds that wait.

        Raises ValueError (nothing queued) when the prompt can never fit this worker's cache.
        """
        if self.failure is not None:
            raise PrefillLoopStopped(f"prefill loop stopped: {self.failure!r}")
        loop = asyncio.get_running_loop()
        job = PrefillJob(request_id, prompt)
        self.sched.add(job)
        req = _Req(params, ticket, loop.create_future())
        job.payload = req
        if ticket is None:
            req.attached = loop.create_future()
            req.forward_done = loop.create_future()
            by = loop.time() + TICKET_WAIT_S
            req.ticket_by = by if deadline is None else min(by, deadline)
            job.attach_key = (request_id, attach_key)
            early = self._early.pop(job.attach_key, None)
            if early is not None:
                self._take(job, early[0])
            else:
                self._awaiting[job.attach_key] = job
        self._wake.set()
        return job, req.result

    def attach(self, request_id: Hashable, ticket: TransferTicket | None, attach_key: str = "") -> bool:
        """The ticket of a request submitted without one (None: the router gave it up). A ticket for
        a request not submitted yet (its Prefill call still on the way) waits for it a while. False:
        no room to keep such a ticket (the caller says so: the router then fails the attempt)."""
        key = (request_id, attach_key)
        job = self._awaiting.pop(key, None)
        if job is not None:
            self._take(job, ticket)
            return True
        if ticket is None:  # nothing here to give up
            return True
        now = asyncio.get_running_loop().time()
        for k in [k for k, (_, by) in self._early.items() if by < now]:
            del self._early[k]
        if len(self._early) >= _EARLY_TICKETS:
            return False
        self._early[key] = (ticket, now + _EARLY_TICKET_S)
        return True

    async def attach_and_open(
        self, request_id: Hashable, ticket: TransferTicket | None, attach_key: str = "", wait_s: float = 30.0
    ) -> bool:
        """``attach``; then, when the ticket went to a prefill already answered (its transfer opens late,
        the decode side waiting on its reservation), how that open went, within ``wait_s``: an open
        that failed raises its error here, for the router to move the request (nothing else tells the
        decode side, whose reservation would wait for the request's deadline)."""
        job = self._awaiting.get((request_id, attach_key))
        kept = self.attach(request_id, ticket, attach_key)
        opened = job.payload.late_opened if job is not None and ticket is not None else None
        if opened is not None:
            assert job is not None
            try:
                await asyncio.wait_for(asyncio.shield(opened), wait_s)
            except TimeoutError:
                # Still opening (a connect to the decode worker that hangs): the router moves the
                # request now, and a transfer that opens after this is aborted unused.
                self.give_up(job, "its late transfer did not open in time")
                raise LateOpenFailed(
                    f"KV transfer of {request_id} did not open within {wait_s:.3g}s"
                ) from None
            except Exception as e:  # noqa: BLE001 - whatever the open raised
                raise LateOpenFailed(f"KV transfer of {request_id} did not open: {e}") from e
        return kept

    def _take(self, job: PrefillJob, ticket: TransferTicket | None) -> None:
        req: _Req = job.payload
        if ticket is not None and ticket.num_tokens != job.num_tokens:
            why = f"ticket reserves {ticket.num_tokens} tokens for a prompt of {job.num_tokens}"
            _fail(req, ValueError(why))
            self.give_up(job, "its ticket does not fit the prompt")
            raise ValueError(why)
        assert req.attached is not None
        if ticket is None:
            _fail(req, AbortedError("the router gave the request up before its ticket"))
            self.give_up(job, "given up by the router before its ticket")
            return
        req.ticket = ticket
        if not req.attached.done():
            req.attached.set_result(ticket)
        if job.stage is Stage.SCHEDULED:  # its forward is past opening transfers: open one now
            self._start_late(job)

    def _start_late(self, job: PrefillJob) -> None:
        """Hand a ticketless job's transfer, completion and blocks to ``_transfer_later`` (once)."""
        req: _Req = job.payload
        if req.late or req.closing or req.finished:
            return
        req.late = True
        req.late_opened = asyncio.get_running_loop().create_future()
        req.late_opened.add_done_callback(_retrieve)
        self._spawn(self._transfer_later(job))

    def _close(self, job: PrefillJob, first: int | None) -> None:
        """Finish a job that no late transfer owns: at once, no ticket reaches it from here on."""
        req: _Req = job.payload
        req.closing = True
        if job.attach_key is not None and self._awaiting.get(job.attach_key) is job:
            del self._awaiting[job.attach_key]
        self._no_forward(job)
        self._spawn(self._finish(job, first))

    def _forward_over(self, job: PrefillJob, first: int | None) -> None:
        """After the forward (or its failure): a late job's task learns the outcome; others are finished
        here."""
        req: _Req = job.payload
        if req.forward_done is not None and not req.forward_done.done():
            req.forward_done.set_result(first)
        if req.late:
            return
        if first is None or req.handle is None and req.attached is None:
            self._close(job, None)
        elif req.handle is None:  # no ticket yet: the late task waits for it
            self._start_late(job)
        else:
            self._close(job, first)

    def give_up(self, job: PrefillJob, reason: str) -> None:
        """The router no longer wants the result. Blocks are freed by whoever holds the job now."""
        req: _Req = job.payload
        req.cancelled = True
        if job.attach_key is not None and self._awaiting.get(job.attach_key) is job:
            del self._awaiting[job.attach_key]
        if req.attached is not None and not req.attached.done():
            req.attached.set_result(None)  # a forward done and waiting for its ticket stops waiting
        if job.stage is Stage.QUEUED:
            self.sched.cancel(job)  # no blocks, no transfer yet
            self._wake.set()  # it may have headed the queue, waiting for blocks the next one fits in
            return
        if req.handle is not None:
            # Tell the decode worker now; the loop frees P's blocks once the forward and sends are done.
            self._spawn(req.handle.abort(reason))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish(self, job: PrefillJob, first: int | None) -> None:
        """Complete (or abort) the job's transfer, then free its blocks: no send reads them after this.
        Once per job (a late transfer's task and the batch may both get here)."""
        req: _Req = job.payload
        if req.finished:
            return
        req.finished = True
        try:
            if req.handle is not None:
                if first is None or req.cancelled:
                    await req.handle.abort("prefill cancelled")
                else:
                    await req.handle.complete(first)
        except TransferError as e:
            log.warning("transfer of %s ended with %s", job.request_id, e)
        except Exception:
            log.exception("transfer of %s failed", job.request_id)
            if req.handle is not None:
                await req.handle.abort("error")
        finally:
            if job.attach_key is not None and self._awaiting.get(job.attach_key) is job:
                del self._awaiting[job.attach_key]
            self.sched.finish(job)
            self._wake.set()

    async def _open_ticketed(self, job: PrefillJob) -> SenderHandle | None:
        req: _Req = job.payload
        if req.ticket is None or req.opening:
            return None
        req.opening = True
        return await self.sender.open(req.ticket, job.block_table)

    async def _open(self, batch: list[PrefillJob]) -> list[PrefillJob]:
        """Open the transfer of every job that has its ticket (handshake per new peer); jobs that fail
        are answered and freed. A job still without a ticket runs its forward without a transfer."""
        opened = await asyncio.gather(*(self._open_ticketed(j) for j in batch), return_exceptions=True)
        live = []
        for job, h in zip(batch, opened, strict=True):
            req: _Req = job.payload
            if isinstance(h, BaseException):
                if not req.result.done():
                    req.result.set_exception(h if isinstance(h, TransferError) else RuntimeError(repr(h)))
                self._close(job, None)  # nothing was sent
                continue
            if h is not None:  # (None: no ticket yet; a late transfer may have set a handle meanwhile)
                req.handle = h
            if req.cancelled:
                self._close(job, None)
                continue
            live.append(job)
        return live

    @staticmethod
    def _no_forward(job: PrefillJob) -> None:
        """A job left out of the forward: a late transfer's task waiting for it stops waiting."""
        done = job.payload.forward_done
        if done is not None and not done.done():
            done.set_result(None)

    async def _transfer_later(self, job: PrefillJob) -> None:
        """A ticketless job's transfer (``_start_late``): wait for the ticket, open, push the layers
        written so far (the hook pushes the rest), complete once the forward gave the first token. The
        blocks are freed only after the forward is done with them."""
        req: _Req = job.payload
        assert req.attached is not None and req.forward_done is not None
        loop = asyncio.get_running_loop()
        ticket: TransferTicket | None = None
        try:
            async with asyncio.timeout_at(req.ticket_by):
                ticket = await asyncio.shield(req.attached)
        except TimeoutError:
            log.warning(
                "request %s: no ticket within %.0f s; its KV is dropped", job.request_id, TICKET_WAIT_S
            )
        if job.attach_key is not None and self._awaiting.get(job.attach_key) is job:
            del self._awaiting[job.attach_key]
        handle: SenderHandle | None = None
        opened = req.late_opened
        if ticket is not None and not req.cancelled and not req.opening:
            req.opening = True
            try:
                handle = await self.sender.open(ticket, job.block_table)
            except Exception as e:  # noqa: BLE001 - told to the router through the ticket's AttachTicket
                log.warning("request %s: transfer did not open: %r", job.request_id, e)
                if opened is not None and not opened.done():
                    opened.set_exception(e)
            finally:  # (a cancel too: AttachTicket must not wait out its bound for nothing)
                if opened is not None and not opened.done():
                    opened.set_result(None)
        if opened is not None and not opened.done():
            opened.set_result(None)
        if handle is not None and (req.closing or req.finished):
            # The loop finished the job meanwhile (its forward failed, it was cancelled): its blocks may
            # be someone else's now. This transfer never writes; the decode worker frees its blocks.
            await handle.abort("prefill cancelled")
            return
        if handle is not None and req.cancelled:  # given up while it opened: it never writes either
            await handle.abort("given up before its transfer opened")
            handle = None
        if handle is not None:

            def catch_up(h: SenderHandle = handle) -> None:
                # Off the loop (a same-host writer copies on the calling thread: cma.py, cuda_ipc.py).
                with self._push_lock:  # (held only to split the layers: pushes can take milliseconds)
                    req.handle = h  # the hook pushes every later layer from here on
                    written = req.layers_done
                if written:  # in any order with the hook's: each layer is its own
                    h.push_layers(0, written)

            try:
                await loop.run_in_executor(None, catch_up)
            except Exception:  # noqa: BLE001 - aborted below; the blocks still come back
                log.exception("request %s: pushing its written layers failed", job.request_id)
                req.cancelled = True
        first = await req.forward_done
        # Completed with the handle this task opened, or the one the batch opened (a ticket that came
        # while the batch was opening its transfers): the hook pushed every layer to that one.
        await self._finish(job, None if req.handle is None or req.cancelled else first)

    async def _loop(self) -> None:
        """Forever: take a batch under the budget, open its transfers, run the forward, hand out tokens."""
        while True:
            batch = self.sched.schedule()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._inflight = batch  # until answered (``_stopped`` fails it should this loop die)
            live = await self._open(batch)
            self._inflight = live
            if not live:
                continue
            items = [PrefillItem(j.prompt_token_ids, j.block_table) for j in live]

            hook = _PushHook(live, self._push_lock)
            self.running, self.running_tokens = len(live), sum(j.num_tokens for j in live)
            t0 = time.perf_counter()
            try:
                rows = [SampleRow(j.payload.params, 0) for j in live]
                tokens = await asyncio.get_running_loop().run_in_executor(
                    self._forward_thread, self._forward, items, hook, rows
                )
            except _BatchCancelled:
                for j in live:
                    self._forward_over(j, None)
                self._inflight = []
                continue
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving (unless it keeps failing)
                broken = self._failures.failed()
                log.exception("prefill forward failed (%d in a row)", self._failures.count)
                if broken:
                    n = self._failures.count
                    raise RuntimeError(f"{n} prefill forwards in a row failed, the last: {e!r}") from e
                for j in live:
                    if not j.payload.result.done():
                        j.payload.result.set_exception(ForwardFailed(f"prefill failed: {e!r}"))
                    self._forward_over(j, None)
                self._inflight = []
                continue
            finally:
                self.running, self.running_tokens = 0, 0
            self._failures.succeeded()
            dt = time.perf_counter() - t0
            self._observe(dt, sum(j.num_tokens for j in live))
            for j, tok in zip(live, tokens, strict=True):
                req = j.payload
                if req.cancelled or req.result.done():
                    _fail(req, AbortedError("prefill cancelled"))
                    self._forward_over(j, None)
                    continue
                # Answer the router first (TTFT), then complete the transfer in the background.
                req.first_token_unix = time.time()
                req.result.set_result((int(tok), dt))
                self._forward_over(j, int(tok))
            self._inflight = []

    def _observe(self, seconds: float, tokens: int) -> None:
        try:
            self.metrics.observe_prefill(seconds, tokens)
        except Exception:  # a metric must not stop the loop
            if not self._metrics_failed:
                log.exception("prefill metrics failed (logged once; the loop goes on)")
                self._metrics_failed = True
