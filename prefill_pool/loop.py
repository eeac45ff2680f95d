"""The prefill worker's forward loop: batch queued prompts, open their transfers, run the forward with a
per-layer push, answer token 0, then complete each transfer. A request's stages are ``request.ReqState``;
a prompt sent before its ticket finishes on the late path (``tickets.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.grammar import ConstrainedSequences, GrammarCompiler, TokenMask
from pdserve.engine.logprobs import TokenLogprob, prompt_targets, token_logprobs
from pdserve.engine.model_runner import LayerHook, ModelRunner, PrefillItem
from pdserve.engine.params import SamplingParams, choice_params
from pdserve.engine.sampler import Sampler, SampleRow
from pdserve.kv_transfer import AbortedError, KVSender, SenderHandle, TransferError, TransferTicket
from pdserve.prefill_pool.metrics import PrefillMetrics
from pdserve.prefill_pool.push import BatchCancelled, PushHook
from pdserve.prefill_pool.request import ENDED_STATES, LATE_STATES, PrefillRequest, ReqState
from pdserve.prefill_pool.scheduler import PrefillJob, PrefillScheduler
from pdserve.prefill_pool.tickets import LateTickets
from pdserve.worker import failures
from pdserve.worker.failures import FailureStreak

log = logging.getLogger(__name__)

MAX_FAILED_FORWARDS = failures.LIMIT  # failed forwards in a row: the model is broken, not one batch


class PrefillLoopStopped(RuntimeError):
    """The prefill loop died: this worker prefills nothing more (it drains and exits)."""


class ForwardFailed(RuntimeError):
    """A prefill forward failed: its prompts end with this; another worker may prefill them."""


class PrefillLoop:
    """Create and ``start`` inside the running event loop; every method runs on that loop's thread, which
    owns the queue, the transfers and this worker's ``BlockManager``. The forward thread runs forwards and
    calls only the layer hook (``push.PushHook``)."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        sender: KVSender,
        max_batched_tokens: int,
        metrics: PrefillMetrics,
        forward_thread: Executor | None = None,
        prefix_caching: bool = True,
        cache_salt: str = "",
        grammar: GrammarCompiler | None = None,
    ) -> None:
        """``forward_thread``: a one-thread executor that runs every forward (the one that built
        ``runner``, so one thread makes this process's CPU-kernel calls); None: asyncio's default.
        ``prefix_caching``: reuse the KV of prompts' cached prefixes (``cache_salt``: the engine's).
        ``grammar``: compiles structured-output constraints (None: the model has no tokenizer, and a
        constrained request is refused)."""
        self.runner, self.sampler, self.sender, self.metrics = runner, sampler, sender, metrics
        self._forward_thread = forward_thread
        blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=prefix_caching)
        self.sched = PrefillScheduler(blocks, max_batched_tokens, cache_salt)
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
        # Taken by the layer hook (forward thread) and by a late transfer's catch-up (``tickets.py``).
        self._push_lock = threading.Lock()
        self.tickets = LateTickets(self, sender, self._push_lock)
        # Token 0 of a constrained request obeys its grammar: a matcher per such prompt, for its one sample
        # (the decode worker replays token 0 into its own). Used on the forward thread only.
        self.constrained = ConstrainedSequences(grammar or GrammarCompiler(None, 0, ()))

    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._task = self._event_loop.create_task(self._loop())
        self._task.add_done_callback(self._stopped)

    def fail(self, cause: BaseException) -> None:
        """The loop can prefill nothing more (a tensor-parallel rank is gone): stop as if it had died of
        ``cause``. Safe from any thread."""

        def die() -> None:
            if self._task is not None and not self._task.done():
                self._task.cancel()  # (_stopped ignores a cancel: the stop is this one)
                self._stop_with(cause)

        try:
            self._event_loop.call_soon_threadsafe(die)
        except RuntimeError:  # the event loop is closed: the process is ending anyway
            pass

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
        self._stop_with(task.exception())

    def _stop_with(self, failure: BaseException | None) -> None:
        self.failure = failure
        log.critical("prefill loop stopped: %r; refusing new prompts", self.failure, exc_info=self.failure)
        err = PrefillLoopStopped(f"prefill loop stopped: {self.failure!r}")
        while (job := self.sched.pop_queued()) is not None:
            job.payload.to(ReqState.FINISHED)
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

    @contextlib.contextmanager
    def _grammar_masks(self, rows: list[SampleRow]) -> Iterator[Future[TokenMask] | None]:
        """The constrained rows' token-0 masks (each choice's row its own matcher), filled on a thread
        while the caller's prefill runs."""
        constrained = self.constrained
        keys = [i for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        for i in keys:
            constrained.add(i, constrained.new(rows[i].params))
        try:
            yield constrained.start_masks(range(len(rows))) if keys else None
        finally:
            for i in keys:
                constrained.drop(i)

    def _forward(
        self, items: list[PrefillItem], hook: LayerHook, rows: list[SampleRow], index: list[int] | None
    ) -> list[int]:
        """On the forward thread: the prefill and the first tokens' sampling (torch ops large enough to
        run in parallel, which belong on the one thread that makes this process's parallel calls).
        ``index``: each sample row's prompt, where some prompt samples several choices (n > 1)."""
        with self._grammar_masks(rows) as masks:
            logits = self.runner.prefill(items, hook)
            return self.sampler(_by_row(logits, index), rows, None if masks is None else masks.result())

    def _forward_logprobs(
        self, items: list[PrefillItem], hook: LayerHook, rows: list[SampleRow], index: list[int] | None
    ) -> tuple[list[int], list[TokenLogprob | None], list[list[TokenLogprob] | None]]:
        """``_forward`` for a batch where some request asked for logprobs: the same tokens, each sample
        row's first token's logprobs, and each item's prompt's (every position kept: its prompt is
        whole)."""
        firsts_of = range(len(items)) if index is None else [index.index(i) for i in range(len(items))]
        keep = [rows[r].params.prompt_logprobs is not None for r in firsts_of]
        with self._grammar_masks(rows) as masks:
            logits, kept = self.runner.prefill_keeping(items, keep, hook)
            logits = _by_row(logits, index)
            tokens = self.sampler(logits, rows, None if masks is None else masks.result())
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        firsts: list[TokenLogprob | None] = [None] * len(rows)
        if asked:
            tops = [rows[i].params.logprobs or 0 for i in asked]
            lps = token_logprobs(logits[asked], [tokens[i] for i in asked], tops)
            for i, lp in zip(asked, lps, strict=True):
                firsts[i] = lp
        prompts: list[list[TokenLogprob] | None] = []
        start = 0
        for i, (item, r) in enumerate(zip(items, firsts_of, strict=True)):
            prompt = None
            if keep[i]:
                targets = prompt_targets(item.token_ids, item.start_pos, len(item.token_ids))

                def kept_rows(a: int, b: int, first: int = start) -> torch.Tensor:
                    return kept.logits(first + a, first + b)

                top = rows[r].params.prompt_logprobs or 0
                prompt = token_logprobs(kept_rows, targets, [top] * len(targets))
                start += len(item.token_ids)
            prompts.append(prompt)
        return tokens, firsts, prompts

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
        ``ticket`` None: it comes later by ``attach`` with the same ``attach_key`` (``tickets.py``);
        ``deadline`` (loop time) bounds that wait.

        Raises ValueError (nothing queued) when the prompt can never fit this worker's cache.
        """
        if self.failure is not None:
            raise PrefillLoopStopped(f"prefill loop stopped: {self.failure!r}")
        # A constraint this vocabulary cannot compile is refused here, not in the batch's forward (cached:
        # a constraint compiles once; the vocabulary's view is built on the first, in about half a second).
        self.constrained.check(params)
        job = PrefillJob(request_id, prompt)
        job.whole_prompt = params.prompt_logprobs is not None
        self.sched.add(job)
        req = PrefillRequest(params, ticket, ticketless=ticket is None)
        job.payload = req
        if ticket is None:
            self.tickets.expect(job, attach_key, deadline)
        self._wake.set()
        return job, req.result

    def attach(self, request_id: Hashable, ticket: TransferTicket | None, attach_key: str = "") -> bool:
        """``LateTickets.attach``: the ticket of a request submitted without one (None: given up)."""
        return self.tickets.attach(request_id, ticket, attach_key)

    async def attach_and_open(
        self, request_id: Hashable, ticket: TransferTicket | None, attach_key: str = "", wait_s: float = 30.0
    ) -> bool:
        """``LateTickets.attach_and_open``: ``attach``, then how its late transfer opened (or
        ``LateOpenFailed``)."""
        return await self.tickets.attach_and_open(request_id, ticket, attach_key, wait_s)

    def _close(self, job: PrefillJob, first: int | None) -> None:
        """Finish a job the late path does not hold (completing with ``first``; None: aborting): at once,
        no ticket reaches it from here on."""
        req: PrefillRequest = job.payload
        if req.state in ENDED_STATES:
            return
        req.complete_with = None if req.given_up else first
        req.to(ReqState.CLOSING)
        self.tickets.forget(job)
        self._no_forward(job)
        self.spawn(self.finish(job))

    def _forward_over(self, job: PrefillJob, first: int | None) -> None:
        """After the forward (or its failure): a late job's task learns the outcome; others are finished
        here."""
        req: PrefillRequest = job.payload
        if not req.forward_done.done():
            req.forward_done.set_result(first)
        if req.state in LATE_STATES:
            return
        if first is None or req.handle is None and not req.ticketless:
            self._close(job, None)
        elif req.handle is None:  # no ticket yet: the late path waits for it
            self.tickets.start(job)
        else:
            self._close(job, first)

    def give_up(self, job: PrefillJob, reason: str) -> None:
        """The router no longer wants the result. Blocks are freed by whoever holds the job now."""
        req: PrefillRequest = job.payload
        req.give_up()
        self.tickets.forget(job)
        if not req.attached.done():
            req.attached.set_result(None)  # a forward done and waiting for its ticket stops waiting
        if req.state is ReqState.QUEUED:
            self.sched.cancel(job)  # no blocks, no transfer yet
            req.to(ReqState.FINISHED)
            self._wake.set()  # it may have headed the queue, waiting for blocks the next one fits in
            return
        if req.handle is not None:
            # Tell the decode worker now; the loop frees P's blocks once the forward and sends are done.
            self.spawn(req.handle.abort(reason))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def finish(self, job: PrefillJob) -> None:
        """Complete the job's transfer with ``complete_with`` (None: abort it), then free its blocks: no
        send reads them after this. Once per job (the late path and the batch may both get here)."""
        req: PrefillRequest = job.payload
        if req.state is ReqState.FINISHED:
            return
        req.to(ReqState.FINISHED)
        first = req.complete_with
        try:
            if req.handle is not None:
                if first is None:
                    await req.handle.abort("prefill cancelled")
                else:
                    await req.handle.complete(first, req.choice_tokens)
        except TransferError as e:
            log.warning("transfer of %s ended with %s", job.request_id, e)
        except Exception:
            log.exception("transfer of %s failed", job.request_id)
            if req.handle is not None:
                await req.handle.abort("error")
        finally:
            self.tickets.forget(job)
            self.sched.finish(job)
            self._wake.set()

    async def _open(self, batch: list[PrefillJob]) -> list[PrefillJob]:
        """Open the transfer of every job that has its ticket (handshake per new peer); jobs that fail
        are answered and freed. A job still without a ticket runs its forward without a transfer (its
        ticket, should it come now, opens one on the late path)."""
        for job in batch:
            job.payload.to(ReqState.OPENING if job.payload.ticket is not None else ReqState.FORWARD)
        opening = [j for j in batch if j.payload.state is ReqState.OPENING]
        opened = await asyncio.gather(
            *(self.sender.open(j.payload.ticket, j.block_table) for j in opening), return_exceptions=True
        )
        handles: dict[PrefillJob, SenderHandle | BaseException] = dict(zip(opening, opened, strict=True))
        live = []
        for job in batch:
            req: PrefillRequest = job.payload
            h = handles.get(job)
            if isinstance(h, BaseException):
                if not req.result.done():
                    req.result.set_exception(h if isinstance(h, TransferError) else RuntimeError(repr(h)))
                self._close(job, None)  # nothing was sent
                continue
            if h is not None:  # (None: no ticket yet; the late path may have set a handle meanwhile)
                req.handle = h
            if req.given_up:
                self._close(job, None)
                continue
            if req.state is ReqState.OPENING:
                req.to(ReqState.FORWARD)
            live.append(job)
        return live

    @staticmethod
    def _no_forward(job: PrefillJob) -> None:
        """A job left out of the forward: a late transfer's task waiting for it stops waiting."""
        if not job.payload.forward_done.done():
            job.payload.forward_done.set_result(None)

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
            # A prompt's cached prefix is read from its blocks, not computed.
            items = [
                PrefillItem(j.prompt_token_ids[j.cached_tokens :], j.block_table, j.cached_tokens)
                for j in live
            ]

            hook = PushHook(live, self._push_lock)
            self.running, self.running_tokens = len(live), sum(j.new_tokens for j in live)
            t0 = time.perf_counter()
            # (each sample row's first token's logprobs, each job's prompt's): only when some job asks
            extras: tuple[list[TokenLogprob | None], list[list[TokenLogprob] | None]] | None = None
            try:
                # The first token's penalties see the prompt (a prefill worker has no earlier outputs).
                # An n > 1 prompt samples every choice's first token from its one row of logits.
                rows = [
                    SampleRow(choice_params(j.payload.params, c), 0, 0, j.prompt_token_ids)
                    for j in live
                    for c in range(j.payload.params.n)
                ]
                index = None
                if len(rows) > len(live):
                    index = [i for i, j in enumerate(live) for _ in range(j.payload.params.n)]
                run, on = asyncio.get_running_loop().run_in_executor, self._forward_thread
                if any(r.params.logprobs is not None or r.params.prompt_logprobs is not None for r in rows):
                    sampled, firsts, prompts = await run(on, self._forward_logprobs, items, hook, rows, index)
                    extras = firsts, prompts
                else:
                    sampled = await run(on, self._forward, items, hook, rows, index)
            except BatchCancelled:
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
            self._observe(dt, sum(j.new_tokens for j in live))
            for j in live:  # every prompt's KV is whole now (a cancelled one's too): later prompts reuse it
                self.sched.computed(j)
            tokens, k = [], 0
            for i, j in enumerate(live):
                n = j.payload.params.n
                tokens.append(sampled[k])
                j.payload.choice_tokens = tuple(int(t) for t in sampled[k + 1 : k + n])
                if extras is not None:
                    j.payload.first_logprobs, *j.payload.choice_logprobs = extras[0][k : k + n]
                    j.payload.prompt_logprobs = extras[1][i]
                k += n
            for j, tok in zip(live, tokens, strict=True):
                req = j.payload
                if req.given_up or req.result.done():
                    req.fail(AbortedError("prefill cancelled"))
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


def _by_row(logits: torch.Tensor, index: list[int] | None) -> torch.Tensor:
    """One row of logits per sample row: a prompt's row repeated for each of its choices (n > 1)."""
    return logits if index is None else logits[index]
