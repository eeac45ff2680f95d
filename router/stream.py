"""Relaying a decode worker's stream to the client: read-ahead flow control, and each message's delivery
through the request's detokenizer. The hot loop: per worker message one read, one detokenizer step and
one write, and no logging."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from pdserve.proto import generation_pb2
from pdserve.router.detok import Detokenizer
from pdserve.router.errors import RelayError, cancelling, classify, worker_failure
from pdserve.router.jobs import Job
from pdserve.router.logprobs import LogprobRelay, MissingLogprobs
from pdserve.router.ops import RouterOps
from pdserve.router.registry import Worker
from pdserve.router.validate import Prepared

_EOF = grpc.aio.EOF
# Worker messages a stream reads ahead of a slow client: beyond them the worker waits (and its claim
# stays), which bounds what a stalled client costs the router.
_READ_AHEAD = 4096
# ... and router-wide: many stalled clients together make every stream past its first
# ``_READ_AHEAD_OWN`` messages wait, so the router's memory stays bounded whatever clients do (their workers
# then hold their claims, and admission refuses what no worker can take).
_READ_AHEAD_TOTAL = 1 << 17
_READ_AHEAD_OWN = 64  # a stream may always read this far ahead: readers are not slowed by stalled ones
_Resp = generation_pb2.GenerateResponse
# Sends one message to the client. False: it delivered nothing of it (yet), as the HTTP front holding back
# text that may begin a stop string; the metrics then see no token arrive (``RequestRecord.wrap``).
Write = Callable[[generation_pb2.GenerateResponse], Awaitable[bool | None]]


class ReadAheadBudget:
    """Worker messages read ahead of their clients by every stream of the router together."""

    __slots__ = ("limit", "used", "_room")

    def __init__(self, limit: int = _READ_AHEAD_TOTAL) -> None:
        self.limit = limit
        self.used = 0
        self._room: asyncio.Event | None = None

    async def wait(self, own: asyncio.Queue[Any]) -> None:
        """Until the router-wide read-ahead is under its limit or the waiting stream's own queue ``own``
        is under ``_READ_AHEAD_OWN`` again (its client read: it may always read that far ahead, whatever
        stalled streams hold)."""
        while self.used >= self.limit and own.qsize() >= _READ_AHEAD_OWN:
            if self._room is None or self._room.is_set():
                self._room = asyncio.Event()
            await self._room.wait()

    def give(self, n: int) -> None:
        """``n`` messages left the read-ahead: every waiting stream looks again (one of them may be the
        stream whose own queue they left)."""
        self.used -= n
        if self._room is not None:
            self._room.set()


class Choice:
    """What has been sent of one choice of a request (``n`` > 1: each has its own detokenizer and stop
    strings)."""

    __slots__ = ("detok", "sent", "finished")

    def __init__(self, detok: Detokenizer) -> None:
        self.detok = detok
        self.sent: list[int] = []  # output token ids sent so far: a migrated stream's input tail
        self.finished = False


class Output:
    """What has been sent to the client for one request: each of its choices (one unless ``n`` > 1)."""

    __slots__ = ("request_id", "prompt_tokens", "choices", "open", "cached_tokens", "logprobs", "prompt_only")

    def __init__(self, prep: Prepared, detoks: Sequence[Detokenizer]) -> None:
        self.request_id = prep.request_id
        self.prompt_tokens = len(prep.prompt_token_ids)
        self.choices = [Choice(d) for d in detoks]
        self.open = len(self.choices)  # choices not finished
        # Prompt tokens the worker that prefilled reused from its prefix cache: the first report (P's
        # answer, or a local prefill's first message) stands.
        self.cached_tokens = 0
        self.logprobs = LogprobRelay.of(prep)  # None: the request asked for none
        self.prompt_only = prep.prompt_only  # max_tokens 0: the finish (and prompt logprobs) alone

    @property
    def n(self) -> int:
        return len(self.choices)

    @property
    def sent(self) -> list[int]:
        """The tokens sent of a request of one choice (``n`` = 1)."""
        return self.choices[0].sent

    @property
    def any_sent(self) -> bool:
        return any(c.detok.count for c in self.choices)

    @property
    def most_sent(self) -> int:
        """The most tokens any choice sent."""
        return max(c.detok.count for c in self.choices)

    def prefilled(self, cached_tokens: int) -> None:
        if cached_tokens and not self.cached_tokens:
            self.cached_tokens = min(cached_tokens, self.prompt_tokens)


async def deliver(
    out: Output,
    ids: Sequence[int],
    first_index: int,
    finish: str,
    write: Write,
    logprobs: Sequence[generation_pb2.TokenLogprobs] = (),
    index: int = 0,
) -> bool:
    """Send the new part of a worker message (of choice ``index``) to the client. True when the request
    is finished (every choice). ``logprobs``: the message's (those of its last tokens), when the request
    asked for them."""
    if out.prompt_only:
        return await _deliver_prompt_only(out, finish, write)
    if index >= len(out.choices):
        raise RelayError(grpc.StatusCode.INTERNAL, f"worker sent choice {index} of a request of n={out.n}")
    choice = out.choices[index]
    if choice.finished:  # (a stop string ended it here; the worker goes on until the request ends)
        return False
    detok = choice.detok
    lp = out.logprobs
    entries: list[generation_pb2.TokenLogprobs] = []
    if lp is not None:
        try:
            entries = lp.aligned(ids, first_index, logprobs, index)
        except MissingLogprobs as e:
            raise RelayError(grpc.StatusCode.INTERNAL, str(e)) from None
    skip = detok.count - first_index
    if skip:
        if skip < 0 and len(ids):
            raise RelayError(
                grpc.StatusCode.INTERNAL, f"worker skipped output tokens {detok.count}..{first_index}"
            )
        if skip > 0:
            ids = ids[skip:]
            entries = entries[skip:]
    if not ids and not finish:
        return False
    # The router owns stop strings (workers get none), so a worker's "stop" is eos or a stop token id.
    text, used = detok.feed(ids, ends_on_stop_token=finish == "stop")
    if detok.stopped:
        ids, finish = ids[:used], "stop"
        entries = entries[:used]
    choice.sent.extend(ids)
    if not finish:
        resp = _Resp(request_id=out.request_id, token_ids=ids, text=text, index=index)
        if lp is not None:
            lp.attach(resp, entries)
        await write(resp)
        return False
    choice.finished = True
    out.open -= 1
    resp = _Resp(
        request_id=out.request_id, token_ids=ids, text=text + detok.flush(), finish_reason=finish, index=index
    )
    if not out.open:  # the last choice to finish: the request's usage comes with it
        resp.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=out.prompt_tokens,  # once, whatever n
                completion_tokens=sum(c.detok.count for c in out.choices),
                cached_tokens=out.cached_tokens,
            )
        )
    if lp is not None:
        lp.attach(resp, entries)
    await write(resp)
    return not out.open


async def _deliver_prompt_only(out: Output, finish: str, write: Write) -> bool:
    """A prompt-only request (max_tokens 0): its one token is the workers' alone; the client gets each
    choice's finish and no output, the first with the prompt's logprobs (when asked), the last with the
    usage."""
    if not finish:
        return False
    for index in range(out.n):
        resp = _Resp(request_id=out.request_id, finish_reason="length", index=index)
        if index == out.n - 1:
            resp.usage.CopyFrom(
                generation_pb2.Usage(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
            )
        if out.logprobs is not None:
            out.logprobs.attach(resp, ())
        await write(resp)
    return True


class DecodeStream:
    """D's stream as the relay reads it: the reader task that reads it ahead of the client, and what it read.
    It outlives one ``relay_stream`` when a live move pauses the relay (the call must stay open: cancelling
    a read cancels the call)."""

    __slots__ = ("reader", "ahead", "started")

    def __init__(self, reader: asyncio.Future, ahead: asyncio.Queue[Any]) -> None:
        self.reader = reader
        self.ahead = ahead
        self.started = False  # a message was read off it

    def close(self, budget: ReadAheadBudget) -> None:
        """Stop reading (this cancels D's call once the reader was mid-read)."""
        self.reader.cancel()  # (it puts nothing more: a put it waits in is cancelled with it)
        budget.give(self.ahead.qsize())


class MoveRequested(Exception):
    """The relay paused for a live move of its stream (``Job.request_move``); D's stream is ``stream``."""

    def __init__(self, stream: DecodeStream) -> None:
        super().__init__("live move requested")
        self.stream = stream


_MOVE = object()  # the sentinel ``Job.wake`` puts into a stream's read-ahead: a move is asked


async def next_message(stream: DecodeStream, budget: ReadAheadBudget) -> Any:
    """The next item D's reader put (a message, EOF, an error or the move sentinel)."""
    ahead = stream.ahead
    m = ahead.get_nowait() if not ahead.empty() else await ahead.get()
    if m is not _MOVE:
        budget.give(1)
    return m


def open_stream(
    job: Job,
    dcall: Any,
    pending: asyncio.Future | None,
    prompt_tokens: int,
    choices: int,
    budget: ReadAheadBudget,
    ops: RouterOps,
) -> DecodeStream:
    ahead: asyncio.Queue[Any] = asyncio.Queue(_READ_AHEAD)
    reader = asyncio.ensure_future(
        _read_ahead(job, dcall, pending, ahead, prompt_tokens, choices, budget, ops)
    )
    return DecodeStream(reader, ahead)


async def relay_stream(
    job: Job,
    d: Worker,
    dcall: Any,
    out: Output,
    write: Write,
    pending: asyncio.Future | None,
    budget: ReadAheadBudget,
    ops: RouterOps,
    choices: int = 1,
    stream: DecodeStream | None = None,
) -> None:
    """Relay D's stream until its finish (or a stop string). The hot loop. ``choices``: how many choices
    D runs (``n``, or a migrated request's open ones); its stream ends with their last finish.
    ``stream``: D's stream as an earlier, paused relay left it (None: open one). Raises MoveRequested,
    leaving the stream open, when the job is asked to move live (``Job.request_move``).

    D is read ahead of the client's writes (``_read_ahead``): a client that reads slowly, or not at
    all, holds back only its own stream, never D's, and D's claim ends with D's stream."""
    if stream is None:
        stream = open_stream(job, dcall, pending, out.prompt_tokens, choices, budget, ops)
    ahead = stream.ahead

    def wake() -> None:
        if not ahead.full():  # (full: messages flow, and each is followed by a look at job.move)
            ahead.put_nowait(_MOVE)

    job.wake = wake
    paused = False
    try:
        while True:
            m = await next_message(stream, budget)
            if m is _MOVE:  # (asked before D's first message: the move waits for it)
                if job.move and stream.started:
                    paused = True
                    raise MoveRequested(stream)
                continue
            if not stream.started:
                stream.started = True
                job.prefill_pending = False  # D streams only once all KV landed: P no longer matters
                ops.release_prefill(job)  # a local prefill's tokens no longer queue on D
            if isinstance(m, BaseException):
                raise m
            if m is _EOF:
                raise RelayError(
                    grpc.StatusCode.INTERNAL, f"decode worker {d.worker_id} ended without a finish"
                )
            out.prefilled(m.cached_tokens)
            lp = out.logprobs
            if lp is not None:  # (a local prefill's first message carries the prompt's)
                lp.prefilled((), m.prompt_logprobs)
            lps = m.logprobs if lp is not None else ()
            if await deliver(out, m.token_ids, m.first_index, m.finish_reason, write, lps, m.index):
                return
            if job.move:
                paused = True
                raise MoveRequested(stream)
    except grpc.aio.AioRpcError as e:
        raise classify(job, d, "decode", e, ops) from None
    except asyncio.CancelledError as e:
        # A cancel of the worker call by ``Job.fail`` (not of this task) carries the job's failure.
        if (failed := worker_failure(job, e)) is not None:
            raise failed from None
        raise
    finally:
        job.wake = None
        if not paused:
            stream.close(budget)


async def _read_ahead(
    job: Job,
    dcall: Any,
    pending: asyncio.Future | None,
    ahead: asyncio.Queue[Any],
    prompt_tokens: int,
    choices: int,
    budget: ReadAheadBudget,
    ops: RouterOps,
) -> None:
    """D's messages into ``ahead`` as they come (at most one per token; up to ``_READ_AHEAD`` ahead of
    the client, then D waits as before), then its end or its error (raised in order by ``relay_stream``).
    Each message's tokens grow the job's KV count on D (``choices`` > 1: as if every choice were as long
    as the message's); once D's stream ended, its claim is released."""
    grow = ops.grow
    left = choices
    try:
        m = await (pending if pending is not None else dcall.read())
        while True:
            if budget.used >= budget.limit and ahead.qsize() >= _READ_AHEAD_OWN:
                await budget.wait(ahead)
            await ahead.put(m)
            budget.used += 1
            if m is _EOF:
                break
            if m.finish_reason:
                left -= 1
                if not left:
                    break
            # D holds the prompt and every output so far (a migrated try's prompt includes the tokens
            # sent before; ``first_index`` counts them too).
            grow(job, prompt_tokens + choices * (m.first_index + len(m.token_ids)))
            m = await dcall.read()
    except BaseException as e:  # noqa: BLE001 - handed to relay_stream, which raises it in its place
        if isinstance(e, asyncio.CancelledError) and cancelling():
            raise  # (relay_stream is done: no one reads any more)
        await ahead.put(e)
        budget.used += 1
        return
    await ops.release(job)
