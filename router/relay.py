"""Running one admitted request on its workers and relaying tokens to the client.

Stages of a request here (after validation and admission, see ``service``):

A worker failing under a request (its call breaks, its KV transfer is aborted, it misses heartbeats)
does not end the request: ``run`` moves it to a healthy worker (``reroute``) with the prompt plus every
token already sent as input, what is left of max_tokens / min_tokens, and ``output_offset`` = tokens
sent, up to ``max_migrations`` times. Before token 0 the move is an ordinary route (another prefill
worker when one is READY, else local prefill); after it, the new decode worker prefills the prompt and
the tokens sent itself. Greedy and seeded sampling continue
with exactly the tokens an undisturbed run gives (token i depends on (seed, i) only), and the client's
stream goes on with no gap and no duplicate.

local route (the decode or colocated worker prefills):
    D.Generate(mode=LOCAL) -> relay D's messages
remote route:
    D.Generate(mode=REMOTE) and P.Prefill (no ticket) at once -> D's first message
    (the KV transfer ticket) to P by P.AttachTicket -> P's first token goes to the
    client at once (TTFT waits neither for decode nor for D's ticket) -> relay D's
    messages, skipping tokens already sent (D's messages carry ``first_index``).

Every token goes through the request's ``Detokenizer``; a stop string ends the
client stream with "stop" and cancels the worker calls. Whatever ends the
request (finish, stop string, client cancel, deadline, a worker failure, the
sweep failing the job), ``run`` leaves no worker call open.

The relay loop is the router's added inter-token latency: per worker message
it does one read, one detokenizer step and one write, and never logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from pdserve.proto import generation_pb2, worker_pb2, worker_pb2_grpc
from pdserve.router.detok import Detokenizer
from pdserve.router.jobs import Failure, Job, NoRoute
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import Route
from pdserve.router.registry import Worker
from pdserve.router.validate import Prepared, RouterTokenizer
from pdserve.worker.auth import token_metadata
from pdserve.worker.convert import request_id_metadata
from pdserve.worker.role import Role
from pdserve.worker.shell import REJECT_METADATA_KEY, RETRY_ELSEWHERE_KEY
from pdserve.worker.tls import NO_TLS, TLSConfig, aio_channel

log = logging.getLogger(__name__)

_EOF = grpc.aio.EOF
_REROUTE_WAIT_S = 10.0  # how long a migrating stream may wait for a worker with room
# Worker messages (~0.5 kB each) a stream reads ahead of a slow client: beyond them the worker waits (and
# its claim stays), which bounds what a stalled client costs the router.
_READ_AHEAD = 4096
# ... and router-wide (~64 MB): many stalled clients together make every stream past its first
# ``_READ_AHEAD_OWN`` messages wait, so the router's memory stays bounded whatever clients do (their workers
# then hold their claims, and admission refuses what no worker can take).
_READ_AHEAD_TOTAL = 1 << 17
_READ_AHEAD_OWN = 64  # a stream may always read this far ahead: readers are not slowed by stalled ones
_Resp = generation_pb2.GenerateResponse
# Sends one message to the client. False: it delivered nothing of it (yet), as the HTTP front holding back
# text that may begin a stop string; the metrics then see no token arrive (``RequestRecord.wrap``).
Write = Callable[[generation_pb2.GenerateResponse], Awaitable[bool | None]]
# worker, dead (True: drop it from the registry; False: it is draining), reason
OnWorkerFailed = Callable[[Worker, bool, str], None]
# (job, prompt length, seconds to wait for room, worker id to avoid, whether a prefill worker may prefill
# it) -> a new route claimed for the job, or None
# A new route for a failed request, or why there is none (``Router.reroute``).
Reroute = Callable[[Job, int, float, str, bool], Awaitable[Route | NoRoute]]


class RelayError(Exception):
    """The request ends with this gRPC status. ``migrate``: what failed under it when a healthy worker
    could take the request over (``metrics.MIGRATION_REASONS``); "" when it must end."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        migrate: str = "",
        worker_id: str = "",
        rejected: bool = False,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.migrate = migrate
        self.worker_id = worker_id  # the worker that failed, not to be routed to again (when migrating)
        # Refused for want of room, as the admission queue refuses: counted as a rejection, not an error.
        self.rejected = rejected

    @classmethod
    def of(cls, failure: Failure) -> RelayError:
        # The sweep fails a job with UNAVAILABLE when one of its workers missed heartbeats; a worker seen
        # dead by another request's call fails its jobs with the reason it was seen with.
        migrate = failure.reason or ("heartbeat_lost" if failure.code == "UNAVAILABLE" else "")
        return cls(grpc.StatusCode[failure.code], failure.details, migrate, failure.worker_id)


class ReadAheadBudget:
    """Worker messages read ahead of their clients by every stream of the router together."""

    __slots__ = ("limit", "used", "_room")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._room: asyncio.Event | None = None

    async def wait(self) -> None:
        """Until the router-wide read-ahead is under its limit."""
        while self.used >= self.limit:
            if self._room is None or self._room.is_set():
                self._room = asyncio.Event()
            await self._room.wait()

    def give(self, n: int) -> None:
        self.used -= n
        if self._room is not None and self.used < self.limit:
            self._room.set()


class WorkerChannels:
    """One channel per worker address, reused by every request to that worker; and the metadata of
    every call: the request's id and, when configured, the cluster token the workers require."""

    def __init__(self, cluster_token: str = "", tls: TLSConfig = NO_TLS) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._token_meta = token_metadata(cluster_token)
        self._tls = tls  # over TLS, presenting the router's certificate (mutual TLS with a CA)

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return request_id_metadata(request_id) + self._token_meta

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = aio_channel(address, self._tls)
            entry = self._stubs[address] = (channel, worker_pb2_grpc.WorkerStub(channel))
        return entry[1]

    async def close_except(self, keep: set[str]) -> None:
        """Close channels to addresses no worker or request uses any more."""
        for address in [a for a in self._stubs if a not in keep]:
            channel, _ = self._stubs.pop(address)
            await channel.close()

    async def close(self) -> None:
        await self.close_except(set())


class _Out:
    """What has been sent to the client for one request."""

    __slots__ = ("request_id", "prompt_tokens", "detok", "sent")

    def __init__(self, prep: Prepared, detok: Detokenizer) -> None:
        self.request_id = prep.request_id
        self.prompt_tokens = len(prep.prompt_token_ids)
        self.detok = detok
        self.sent: list[int] = []  # output token ids sent so far: a migrated stream's input tail


class ClientGone(asyncio.CancelledError):
    """A write to the client failed because the client went away (its cancel or deadline): the request
    ends as a cancel, even where a worker failure was recorded at the same moment (no move for nobody)."""


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def worker_failure(job: Job, e: asyncio.CancelledError) -> RelayError | None:
    """The job's recorded failure, when ``e`` is the cancel ``Job.fail`` gave its worker call: not a cancel
    of this task, nor the client gone during a write."""
    if job.failure is None or _cancelling() or isinstance(e, ClientGone):
        return None
    return RelayError.of(job.failure)


def is_batch_error(e: BaseException) -> bool:
    """grpc.aio's internal ExecuteBatchError: an operation on a call that already ended (client gone)."""
    return type(e).__name__ == "ExecuteBatchError"


class Relay:
    def __init__(
        self,
        tokenizer: RouterTokenizer,
        channels: WorkerChannels,
        release_prefill: Callable[[Job], None],
        on_worker_failed: OnWorkerFailed,
        metrics: RouterMetrics | None = None,
        reroute: Reroute | None = None,
        max_migrations: int = 0,
        on_worker_full: Callable[[Worker], None] | None = None,
        queue_timeout_s: float = 30.0,
        worker_done: Callable[[Job], Awaitable[None]] | None = None,
        grown: Callable[[Job, int], None] | None = None,
    ) -> None:
        """``on_worker_full``: a decode worker refused a reservation for room (it is counted full a while);
        the request then waits for room as in the admission queue, up to ``queue_timeout_s`` from its
        arrival, and the refusal is no migration (nothing was sent, no worker failed)."""
        self._tok = tokenizer
        self._queue_timeout_s = queue_timeout_s
        # The decode worker's stream ended (its finish came): release the job's claim on the worker now,
        # though the client may still be reading what was received (a slow client slows only itself).
        self._worker_done = worker_done
        # The job's sequence on its decode worker grew to n tokens (``Ledger.grow``): its KV blocks count.
        self._grown = grown
        self.read_ahead = ReadAheadBudget(_READ_AHEAD_TOTAL)
        self._on_worker_full = on_worker_full
        self._channels = channels
        self._release_prefill = release_prefill
        self._on_worker_failed = on_worker_failed
        self._metrics = metrics
        self._reroute = reroute
        self._max_migrations = max_migrations if reroute is not None else 0

    async def run(
        self, job: Job, prep: Prepared, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        """Run ``job`` (already routed) to its end. Raises RelayError when it ends with an error status.

        With metrics, every message to the client is timed on its way (TTFT from ``job.arrival``,
        ITL, e2e) and the request's outcome is counted once, whichever way it ends.
        """
        if self._metrics is None:
            return await self._run(job, prep, write, timeout, deadline_unix)
        with self._metrics.request(job.arrival, len(prep.prompt_token_ids)) as rec:
            await self._run(job, prep, rec.wrap(write), timeout, deadline_unix)

    async def _run(
        self, job: Job, prep: Prepared, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        # Primed with the prompt's tail, as the engine's own stream (offline ``LLM``) is: the same text.
        stream = self._tok.decode_stream(skip_special_tokens=True, prompt_token_ids=prep.prompt_token_ids)
        out = _Out(prep, Detokenizer(stream, prep.params))
        migrations = 0
        step_moves = 0  # moves after a failed step: one only (the request itself may be what breaks it)
        try:
            while True:
                try:
                    return await self._attempt(job, prep, out, write, timeout, deadline_unix)
                except RelayError as e:
                    full = e.migrate == "decode_full" and self._reroute is not None
                    if e.migrate == "step_failed" and step_moves:
                        raise RelayError(
                            e.code, f"{e.details} (a step failed under it on two workers: not moved again)"
                        ) from None
                    step_moves += e.migrate == "step_failed"
                    if not full and (not e.migrate or migrations >= self._max_migrations):
                        if migrations:
                            raise RelayError(
                                e.code, f"{e.details} (after {migrations} migration(s))"
                            ) from None
                        raise
                    failed = e
                for c in job.calls:
                    c.cancel()  # the failed worker's calls: a decode reservation is freed by this
                job.calls.clear()
                job.failure = None
                self._release_prefill(job)
                if timeout is not None:
                    timeout = max(deadline_unix - time.time(), 0.0)
                assert self._reroute is not None
                if full:
                    # No worker failed (at most P's token 0 was sent): it waits for room as in admission.
                    queue_left = max(self._queue_timeout_s - (time.monotonic() - job.arrival), 0.0)
                    wait = queue_left if timeout is None else min(queue_left, timeout)
                else:
                    wait = min(timeout or _REROUTE_WAIT_S, _REROUTE_WAIT_S)
                route = await self._reroute(
                    job,
                    len(prep.prompt_token_ids) + len(out.sent),
                    wait,
                    failed.worker_id,
                    not out.sent,  # nothing sent yet: any prefill worker may prefill it again
                )
                if isinstance(route, NoRoute):
                    if not full:
                        raise RelayError(failed.code, f"{failed.details}; {route.why}")
                    # A rejection as admission's, unless P's token 0 reached the client before D refused.
                    rejected = not out.sent
                    if route.kind == "queue_full":  # (as admission refuses it)
                        raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, route.why, rejected=rejected)
                    if route.kind != "no_room":  # no wait helps: nobody can take it
                        raise RelayError(
                            grpc.StatusCode.UNAVAILABLE, f"{route.why} (the last refusal: {failed.details})"
                        )
                    if timeout is not None and timeout <= queue_left:
                        raise RelayError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the request's deadline passed while it waited for a worker with room",
                        )
                    raise RelayError(  # (the admission queue's words)
                        grpc.StatusCode.UNAVAILABLE,
                        f"no worker had room within {self._queue_timeout_s:.3g}s (the last refusal: "
                        f"{failed.details})",
                        rejected=rejected,
                    )
                migrations += not full
                if self._metrics is not None:
                    self._metrics.migrated(failed.migrate)
                if route.decode_unused:  # (a one-token request: the prefill worker alone answers it)
                    to = f"prefill worker {route.prefill.worker_id if route.prefill else '?'} alone"
                else:
                    local = route.prefill.worker_id if route.prefill is not None else "local"
                    to = f"{route.decode.worker_id} (prefill: {local})"
                (log.info if full else log.warning)(
                    "request %s: %s; moved to %s after %d tokens (migration %d)",
                    prep.request_id,
                    failed.details,
                    to,
                    len(out.sent),
                    migrations,
                )
        finally:
            for c in job.calls:
                c.cancel()  # a no-op on a call that has already ended
            self._release_prefill(job)

    async def _attempt(
        self, job: Job, prep: Prepared, out: _Out, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        """One try on the job's current route; a migrated try starts after the tokens already sent."""
        route = job.route
        assert route is not None, "run() needs a routed job"
        d = route.decode
        sent = len(out.sent)
        prompt, sampling = prep.prompt_token_ids, prep.sampling
        if sent:
            p = prep.params
            if sent >= p.max_tokens:  # everything was sent but the finish: end it here
                await self._deliver(out, (), sent, "length", write)
                return
            prompt = prompt + out.sent
            sampling = generation_pb2.SamplingParams()
            sampling.CopyFrom(prep.sampling)
            sampling.max_tokens = p.max_tokens - sent
            sampling.min_tokens = max(p.min_tokens - sent, 0)
        if route.decode_unused:
            # Token 0 is the whole answer and P samples it: no decode call, no KV reservation, no
            # transfer (which the finish at token 0 would only abort, counted as a failure).
            await self._prefill_only(job, prep, out, write, timeout, deadline_unix)
            return
        req = worker_pb2.WorkerGenerateRequest(
            request_id=prep.request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            mode=worker_pb2.PREFILL_MODE_LOCAL if route.prefill is None else worker_pb2.PREFILL_MODE_REMOTE,
            deadline_unix=deadline_unix,
            output_offset=sent,
        )
        meta = self._channels.metadata(prep.request_id)
        dcall = self._channels.stub(d.address).Generate(req, timeout=timeout, metadata=meta)
        job.calls.append(dcall)
        pending: asyncio.Future | None = None
        if route.prefill is not None:
            finished, pending = await self._remote_start(job, prep, dcall, out, write, timeout, deadline_unix)
            if finished:
                return
        await self._relay(job, d, dcall, out, write, pending)

    async def _relay(self, job: Job, d: Worker, dcall, out: _Out, write: Write, pending) -> None:
        """Relay D's stream until its finish (or a stop string). The hot loop.

        D is read ahead of the client's writes (``_read_ahead``): a client that reads slowly, or not at
        all, holds back only its own stream, never D's, and D's claim ends with D's stream."""
        deliver = self._deliver
        budget = self.read_ahead
        ahead: asyncio.Queue[Any] = asyncio.Queue(_READ_AHEAD)
        reader = asyncio.ensure_future(self._read_ahead(job, dcall, pending, ahead, out.prompt_tokens))
        try:
            m = await ahead.get()
            budget.give(1)
            job.prefill_pending = False  # D streams only once all KV landed: P no longer matters
            while True:
                if isinstance(m, BaseException):
                    raise m
                if m is _EOF:
                    raise RelayError(
                        grpc.StatusCode.INTERNAL, f"decode worker {d.worker_id} ended without a finish"
                    )
                if await deliver(out, m.token_ids, m.first_index, m.finish_reason, write):
                    return
                m = ahead.get_nowait() if not ahead.empty() else await ahead.get()
                budget.give(1)
        except grpc.aio.AioRpcError as e:
            raise self._worker_error(job, d, "decode", e) from None
        except asyncio.CancelledError as e:
            # A cancel of the worker call by ``Job.fail`` (not of this task) carries the job's failure.
            if (failed := worker_failure(job, e)) is not None:
                raise failed from None
            raise
        finally:
            reader.cancel()  # (it puts nothing more: a put it waits in is cancelled with it)
            budget.give(ahead.qsize())

    async def _read_ahead(
        self, job: Job, dcall, pending, ahead: asyncio.Queue[Any], prompt_tokens: int
    ) -> None:
        """D's messages into ``ahead`` as they come (at most one per token; up to ``_READ_AHEAD`` ahead of
        the client, then D waits as before), then its end or its error (raised in order by ``_relay``).
        Each message's tokens grow the job's KV count on D; once D's stream ended, its claim is released."""
        grown = self._grown
        budget = self.read_ahead
        try:
            m = await (pending if pending is not None else dcall.read())
            while True:
                if budget.used >= budget.limit and ahead.qsize() >= _READ_AHEAD_OWN:
                    await budget.wait()
                await ahead.put(m)
                budget.used += 1
                if m is _EOF or m.finish_reason:
                    break
                if grown is not None:
                    # D holds the prompt and every output so far (a migrated try's prompt includes the
                    # tokens sent before; ``first_index`` counts them too).
                    grown(job, prompt_tokens + m.first_index + len(m.token_ids))
                m = await dcall.read()
        except BaseException as e:  # noqa: BLE001 - handed to _relay, which raises it in its place
            if isinstance(e, asyncio.CancelledError) and _cancelling():
                raise  # (_relay is done: no one reads any more)
            await ahead.put(e)
            budget.used += 1
            return
        if self._worker_done is not None:
            await self._worker_done(job)

    async def _remote_start(
        self,
        job: Job,
        prep: Prepared,
        dcall,
        out: _Out,
        write: Write,
        timeout: float | None,
        deadline_unix: float,
    ) -> tuple[bool, asyncio.Future | None]:
        """Prefill on P and the ticket from D at once, P's first token to the client.

        P's prefill starts without waiting for D's ticket (a round trip off TTFT's path): D's first
        message, the ticket, goes to P by ``AttachTicket`` as soon as it comes, and P holds the KV
        until it has it. Returns (finished, D's pending read to continue with) once P answered and
        took the ticket. D is read all along: D dying fails the request at once, and tokens D sends
        before P's answer arrives are relayed. Should the request end before P took a ticket, P is
        told to drop the KV (an empty ticket).
        """
        route = job.route
        assert route is not None and route.prefill is not None
        d, p = route.decode, route.prefill
        stub, meta = self._channels.stub(p.address), self._channels.metadata(prep.request_id)
        key, started = self._prefill(job, prep, p, timeout, deadline_unix)
        p_task: asyncio.Future | None = started
        read: asyncio.Future | None = asyncio.ensure_future(dcall.read())
        attach: asyncio.Future | None = None  # P's AttachTicket call, once D's ticket came
        attached = answered = False
        try:
            while True:
                waiting = tuple(t for t in (p_task, read, attach) if t is not None)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if read is not None and read.done():
                    m = self._outcome(read, job, d, "decode")
                    read = None
                    if attach is None:  # D's first message: the ticket
                        if m is _EOF:
                            raise RelayError(
                                grpc.StatusCode.INTERNAL,
                                f"decode worker {d.worker_id} ended without a ticket",
                            )
                        if m.finish_reason:  # D ended the request before any prefill (e.g. aborted)
                            await self._deliver(out, m.token_ids, m.first_index, m.finish_reason, write)
                            return True, None
                        if not m.transfer_ticket:
                            raise RelayError(
                                grpc.StatusCode.INTERNAL,
                                f"decode worker {d.worker_id} sent no transfer ticket",
                            )
                        areq = worker_pb2.AttachTicketRequest(
                            request_id=prep.request_id, transfer_ticket=m.transfer_ticket, attach_key=key
                        )
                        acall = stub.AttachTicket(areq, timeout=timeout, metadata=meta)
                        job.calls.append(acall)
                        attach = asyncio.ensure_future(acall)
                    else:
                        job.prefill_pending = False
                        if m is _EOF:
                            raise RelayError(
                                grpc.StatusCode.INTERNAL,
                                f"decode worker {d.worker_id} ended without a finish",
                            )
                        if await self._deliver(out, m.token_ids, m.first_index, m.finish_reason, write):
                            return True, None
                if attach is not None and not attached and attach.done():
                    self._outcome(attach, job, p, "prefill")  # a refused ticket fails the request
                    attached = True
                if p_task is not None and p_task.done():
                    task, p_task = p_task, None
                    self._release_prefill(job)
                    answered = True
                    try:
                        resp = self._outcome(task, job, p, "prefill")
                    except RelayError:
                        # Once D streams, all KV has arrived: a late prefill failure changes nothing.
                        if out.detok.count == 0:
                            raise
                        log.info("request %s: prefill failed after decode started; ignored", prep.request_id)
                    else:
                        # Output index 0: sent only when D has not already delivered it.
                        tok = resp.first_token_id
                        if await self._deliver(out, (tok,), 0, self._first_token_finish(prep, tok), write):
                            return True, None
                if answered and attached:
                    return False, read
                if read is None and attach is not None:
                    read = asyncio.ensure_future(dcall.read())
        except BaseException:
            for t in (p_task, read, attach):
                if t is not None:
                    t.cancel()
            raise
        finally:
            if not attached:
                self._drop_prefill(p, prep.request_id, key)

    def _prefill(
        self, job: Job, prep: Prepared, p: Worker, timeout: float | None, deadline_unix: float
    ) -> tuple[str, asyncio.Future]:
        """P's Prefill call, started: this attempt's attach key (its AttachTicket reaches this Prefill, no
        other) and the call's future."""
        key = uuid.uuid4().hex
        preq = worker_pb2.PrefillRequest(
            request_id=prep.request_id,
            prompt_token_ids=prep.prompt_token_ids,
            sampling=prep.sampling,
            deadline_unix=deadline_unix,
            attach_key=key,
        )
        meta = self._channels.metadata(prep.request_id)
        pcall = self._channels.stub(p.address).Prefill(preq, timeout=timeout, metadata=meta)
        job.calls.append(pcall)
        return key, asyncio.ensure_future(pcall)

    async def _prefill_only(
        self, job: Job, prep: Prepared, out: _Out, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        """A request whose token 0 is its last (max_tokens 1) on a remote-prefill route: P's answer alone,
        and P drops the KV at once (an empty ticket). No decode call: a reservation and a transfer that
        the finish at token 0 would only abort (counted as a failed transfer on both sides)."""
        p = job.route.prefill if job.route is not None else None
        assert p is not None
        key, task = self._prefill(job, prep, p, timeout, deadline_unix)
        try:
            await asyncio.wait((task,))
            self._release_prefill(job)
            resp = self._outcome(task, job, p, "prefill")
            job.prefill_pending = False
        finally:
            task.cancel()  # (a no-op once it ended)
            self._drop_prefill(p, prep.request_id, key)
        tok = resp.first_token_id
        await self._deliver(out, (tok,), 0, self._first_token_finish(prep, tok) or "length", write)

    def _drop_prefill(self, p: Worker, request_id: str, key: str) -> None:
        """Tell P to free the KV of a prefill that will get no ticket (fire and forget: P also drops it
        after ``TICKET_WAIT_S``)."""
        call = self._channels.stub(p.address).AttachTicket(
            worker_pb2.AttachTicketRequest(request_id=request_id, attach_key=key),
            timeout=5.0,
            metadata=self._channels.metadata(request_id),
        )

        def done(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: P gone or loading is fine here

        asyncio.ensure_future(call).add_done_callback(done)

    def _first_token_finish(self, prep: Prepared, token_id: int) -> str:
        """The engine's token-level stop check for output 0, so the router can end the request at once."""
        p = prep.params
        if p.min_tokens <= 1 and (
            token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self._tok.eos_token_ids)
        ):
            return "stop"
        return "length" if p.max_tokens == 1 else ""

    def _outcome(self, task: asyncio.Future, job: Job, w: Worker, role: str):
        try:
            return task.result()
        except grpc.aio.AioRpcError as e:
            raise self._worker_error(job, w, role, e) from None
        except asyncio.CancelledError:
            if job.failure is not None:
                raise RelayError.of(job.failure) from None
            raise

    async def _deliver(
        self, out: _Out, ids: Sequence[int], first_index: int, finish: str, write: Write
    ) -> bool:
        """Send the new part of a worker message to the client. True when the request is finished."""
        detok = out.detok
        skip = detok.count - first_index
        if skip:
            if skip < 0 and len(ids):
                raise RelayError(
                    grpc.StatusCode.INTERNAL, f"worker skipped output tokens {detok.count}..{first_index}"
                )
            if skip > 0:
                ids = ids[skip:]
        if not ids and not finish:
            return False
        # The router owns stop strings (workers get none), so a worker's "stop" is eos or a stop token id.
        text, used = detok.feed(ids, ends_on_stop_token=finish == "stop")
        if detok.stopped:
            ids, finish = ids[:used], "stop"
        out.sent.extend(ids)
        if not finish:
            await write(_Resp(request_id=out.request_id, token_ids=ids, text=text))
            return False
        await write(
            _Resp(
                request_id=out.request_id,
                token_ids=ids,
                text=text + detok.flush(),
                finish_reason=finish,
                usage=generation_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=detok.count),
            )
        )
        return True

    def _worker_error(self, job: Job, w: Worker, role: str, e: grpc.aio.AioRpcError) -> RelayError:
        if job.failure is not None:
            return RelayError.of(job.failure)
        code = e.code()
        trailing = e.trailing_metadata() or ()
        # In messages a worker is named by its role ("colocated" for role both); ``role`` is the call's.
        where = f"{'colocated' if w.role is Role.BOTH else role} worker {w.worker_id}"
        if any(k == RETRY_ELSEWHERE_KEY for k, _ in trailing):
            # A failed engine step or prefill forward: the worker lives on; another one serves the request.
            return RelayError(code, f"{where} failed: {e.details()}", "step_failed", w.worker_id)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            # The request's time ran out (the client's deadline or --request-timeout): no worker failed.
            return RelayError(code, f"the request passed its deadline (it was on {where})")
        details = f"{where} failed: {code.name}: {e.details()}"
        lost = f"{role}_failed"
        if code is grpc.StatusCode.UNAVAILABLE:
            draining = any(k == REJECT_METADATA_KEY for k, _ in trailing)
            self._on_worker_failed(w, not draining, details)
            return RelayError(code, details, lost, w.worker_id)
        if code is grpc.StatusCode.CANCELLED:
            # Not our cancel (that raises CancelledError): the worker went away mid-call.
            return RelayError(grpc.StatusCode.UNAVAILABLE, details, lost, w.worker_id)
        if code is grpc.StatusCode.ABORTED:
            # A KV transfer that did not complete (its prefill side died or hung): another try can serve it,
            # not on that prefill worker.
            route = job.route
            culprit = route.prefill.worker_id if route is not None and route.prefill is not None else ""
            # The decode worker lives on: it reports the transfer failed (not "decode worker ... failed").
            sender = f" from prefill worker {culprit}" if culprit else ""
            said = f"the KV transfer{sender} to {where} failed: {code.name}: {e.details()}"
            return RelayError(code, said, "transfer_aborted", culprit)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and role == "decode":
            # Its reservation found fewer free blocks than its last heartbeat said (running requests grew
            # since): nothing was sent, so route it again, on this worker too once a heartbeat shows room.
            if self._on_worker_full is not None:
                self._on_worker_full(w)
            return RelayError(code, f"{where} refused it: {e.details()}", "decode_full")
        return RelayError(code, details)
