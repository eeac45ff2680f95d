"""One try of a request on its current route: the worker calls of the local or the prefill/decode
choreography, up to the decode worker's stream (relayed by ``stream``)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import grpc

from pdserve.proto import generation_pb2, worker_pb2
from pdserve.router.channels import WorkerChannels
from pdserve.router.errors import RelayError, outcome
from pdserve.router.jobs import Job
from pdserve.router.metrics import RouterMetrics
from pdserve.router.moves import Finished, LiveMove
from pdserve.router.ops import RouterOps
from pdserve.router.registry import Worker
from pdserve.router.stream import (
    DecodeStream,
    MoveRequested,
    Output,
    ReadAheadBudget,
    Write,
    deliver,
    relay_stream,
)
from pdserve.router.validate import Prepared, RouterTokenizer

log = logging.getLogger(__name__)

_EOF = grpc.aio.EOF


class Attempt:
    """Runs one try of a routed job (``run``); the migration loop (``relay.Relay``) runs the next."""

    def __init__(
        self,
        tokenizer: RouterTokenizer,
        channels: WorkerChannels,
        ops: RouterOps,
        budget: ReadAheadBudget,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._tok = tokenizer
        self._channels = channels
        self._ops = ops
        self._budget = budget
        self.mover = LiveMove(channels, ops, budget, metrics)

    async def run(
        self, job: Job, prep: Prepared, out: Output, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        """One try on the job's current route; a migrated try starts after the tokens already sent."""
        route = job.route
        assert route is not None, "run() needs a routed job"
        d = route.decode
        prompt, sampling = prep.prompt_token_ids, prep.sampling
        choices = out.n  # the choices D runs
        resumed: list[worker_pb2.ResumedChoice] = []
        if out.n > 1 and out.any_sent:
            resumed = await self._resumed_choices(prep, out, write)
            if not resumed:
                return
            choices = len(resumed)
            sampling = generation_pb2.SamplingParams()
            sampling.CopyFrom(prep.sampling)
            sampling.ClearField("prompt_logprobs")  # (sent with token 0)
        sent = 0 if out.n > 1 else len(out.sent)
        if sent:
            p = prep.params
            if sent >= p.max_tokens:  # everything was sent but the finish: end it here
                await deliver(out, (), sent, "length", write)
                return
            prompt = prompt + out.sent
            sampling = generation_pb2.SamplingParams()
            sampling.CopyFrom(prep.sampling)
            sampling.max_tokens = p.max_tokens - sent
            sampling.min_tokens = max(p.min_tokens - sent, 0)
            sampling.ClearField("prompt_logprobs")  # (sent with token 0; the prompt now ends in outputs)
        if route.decode_unused:
            # Token 0 is the whole answer and P samples it: no decode call, no KV reservation, no
            # transfer (which the finish at token 0 would only abort, counted as a failure).
            await self._prefill_only(job, prep, out, write, timeout, deadline_unix)
            return
        req = worker_pb2.WorkerGenerateRequest(
            request_id=self._channels.worker_request_id(prep.request_id),
            prompt_token_ids=prompt,
            sampling=sampling,
            mode=worker_pb2.PREFILL_MODE_LOCAL if route.prefill is None else worker_pb2.PREFILL_MODE_REMOTE,
            deadline_unix=deadline_unix,
            output_offset=sent,
            resumed_choices=resumed,
        )
        meta = self._channels.metadata(prep.request_id)
        dcall = self._channels.stub(d.address).Generate(req, timeout=timeout, metadata=meta)
        job.calls.append(dcall)
        pending: asyncio.Future | None = None
        if route.prefill is not None:
            finished, pending = await self._remote_start(job, prep, dcall, out, write, timeout, deadline_unix)
            if finished:
                return
        stream: DecodeStream | None = None
        while True:
            try:
                await relay_stream(
                    job, d, dcall, out, write, pending, self._budget, self._ops, choices, stream
                )
                return
            except MoveRequested as mv:  # (a live move: the stream goes on, here or on another worker)
                try:
                    moved = await self.mover.run(job, prep, out, write, d, mv.stream, timeout, deadline_unix)
                except Finished:
                    mv.stream.close(self._budget)
                    return
                except BaseException:
                    mv.stream.close(self._budget)
                    raise
                if moved is None:
                    stream = mv.stream
                else:
                    d, dcall, pending, stream = moved.worker, moved.call, None, None

    async def _resumed_choices(
        self, prep: Prepared, out: Output, write: Write
    ) -> list[worker_pb2.ResumedChoice]:
        """An ``n`` > 1 request moved after some output: its open choices, each to go on from the tokens
        it sent (one that sent all of max_tokens but its finish ends here)."""
        resumed = []
        for i, c in enumerate(out.choices):
            if c.finished:
                continue
            if c.detok.count >= prep.params.max_tokens:
                await deliver(out, (), c.detok.count, "length", write, index=i)
                continue
            resumed.append(worker_pb2.ResumedChoice(index=i, token_ids=c.sent))
        return resumed

    async def _remote_start(
        self,
        job: Job,
        prep: Prepared,
        dcall: Any,
        out: Output,
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
        d, p, ops = route.decode, route.prefill, self._ops
        stub, meta = self._channels.stub(p.address), self._channels.metadata(prep.request_id)
        key, started = self._prefill(job, prep, p, timeout, deadline_unix)
        p_task: asyncio.Future | None = started
        read: asyncio.Future | None = asyncio.ensure_future(dcall.read())
        attach: asyncio.Future | None = None  # P's AttachTicket call, once D's ticket came
        attached = answered = False
        # With logprobs asked, D's tokens wait for P's answer, which has token 0's and the prompt's.
        held: Any = None  # D's message waiting for P's answer
        try:
            while True:
                # (A finished AttachTicket call is not waited on again: it would wake every loop at once.)
                waiting = tuple(t for t in (p_task, read, None if attached else attach) if t is not None)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if read is not None and read.done():
                    m = outcome(read, job, d, "decode", ops)
                    read = None
                    if attach is None:  # D's first message: the ticket
                        if m is _EOF:
                            raise RelayError(
                                grpc.StatusCode.INTERNAL,
                                f"decode worker {d.worker_id} ended without a ticket",
                            )
                        if m.finish_reason:  # D ended the request before any prefill (e.g. aborted)
                            out.prefilled(m.cached_tokens)
                            await deliver(
                                out, m.token_ids, m.first_index, m.finish_reason, write, index=m.index
                            )
                            return True, None
                        if not m.transfer_ticket:
                            raise RelayError(
                                grpc.StatusCode.INTERNAL,
                                f"decode worker {d.worker_id} sent no transfer ticket",
                            )
                        areq = worker_pb2.AttachTicketRequest(
                            request_id=self._channels.worker_request_id(prep.request_id),
                            transfer_ticket=m.transfer_ticket,
                            attach_key=key,
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
                        # A finish waits for P's answer too: the usage it carries counts P's reused
                        # prompt tokens, and D, streaming once all KV landed, may finish first.
                        if p_task is not None and (out.logprobs is not None or m.finish_reason):
                            held = m
                        elif await self._deliver_decoded(out, m, write):
                            return True, None
                if attach is not None and not attached and attach.done():
                    outcome(attach, job, p, "prefill", ops)  # a refused ticket fails the request
                    attached = True
                if p_task is not None and p_task.done():
                    task, p_task = p_task, None
                    ops.release_prefill(job)
                    answered = True
                    try:
                        resp = outcome(task, job, p, "prefill", ops)
                    except RelayError:
                        # Once D streams, all KV has arrived: a late prefill failure changes nothing.
                        if not out.any_sent and (held is None or out.logprobs is not None):
                            raise
                        log.info("request %s: prefill failed after decode started; ignored", prep.request_id)
                    else:
                        # Output index 0: sent only when D has not already delivered it.
                        if await self._deliver_first(prep, out, resp, write):
                            return True, None
                    if held is not None:
                        m, held = held, None
                        if await self._deliver_decoded(out, m, write):
                            return True, None
                if answered and attached:
                    return False, read
                if read is None and attach is not None and held is None:
                    read = asyncio.ensure_future(dcall.read())
        except BaseException:
            for t in (p_task, read, attach):
                if t is not None:
                    t.cancel()
            raise
        finally:
            if not attached:
                self._drop_prefill(p, self._channels.worker_request_id(prep.request_id), key)

    def _prefill(
        self, job: Job, prep: Prepared, p: Worker, timeout: float | None, deadline_unix: float
    ) -> tuple[str, asyncio.Future]:
        """P's Prefill call, started: this attempt's attach key (its AttachTicket reaches this Prefill, no
        other) and the call's future."""
        key = uuid.uuid4().hex
        preq = worker_pb2.PrefillRequest(
            request_id=self._channels.worker_request_id(prep.request_id),
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
        self, job: Job, prep: Prepared, out: Output, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        """A request whose token 0 is its last (max_tokens 1) on a remote-prefill route: P's answer alone,
        and P drops the KV at once (an empty ticket). No decode call: a reservation and a transfer that
        the finish at token 0 would only abort (counted as a failed transfer on both sides)."""
        p = job.route.prefill if job.route is not None else None
        assert p is not None
        key, task = self._prefill(job, prep, p, timeout, deadline_unix)
        try:
            await asyncio.wait((task,))
            self._ops.release_prefill(job)
            resp = outcome(task, job, p, "prefill", self._ops)
            job.prefill_pending = False
        finally:
            task.cancel()  # (a no-op once it ended)
            self._drop_prefill(p, self._channels.worker_request_id(prep.request_id), key)
        await self._deliver_first(prep, out, resp, write, "length")

    async def _deliver_first(
        self, prep: Prepared, out: Output, resp: worker_pb2.PrefillResponse, write: Write, finish: str = ""
    ) -> bool:
        """P's answer to the client: every choice's token 0 (unless D delivered it already), with its
        logprobs and the prompt's when asked. ``finish``: the finish of a token 0 that does not end its
        choice by itself. True when that finished the request."""
        out.prefilled(resp.cached_tokens)
        firsts = list(resp.first_token_ids) if out.n > 1 else [resp.first_token_id]
        if len(firsts) != out.n:
            raise RelayError(
                grpc.StatusCode.INTERNAL, f"prefill worker sent {len(firsts)} first tokens for n={out.n}"
            )
        entries: list[generation_pb2.TokenLogprobs | None] = [None] * out.n
        if out.logprobs is not None:
            if resp.HasField("first_logprobs"):
                given = [resp.first_logprobs, *resp.choice_logprobs][: out.n]
                entries[: len(given)] = given
            out.logprobs.prefilled(entries, resp.prompt_logprobs)
        for i, (tok, entry) in enumerate(zip(firsts, entries, strict=True)):
            lps = [entry] if entry is not None else []
            finish_i = self._first_token_finish(prep, tok) or finish
            if await deliver(out, (tok,), 0, finish_i, write, lps, i):
                return True  # (the last choice; or a prompt-only request, whose finishes went at once)
        return False

    @staticmethod
    async def _deliver_decoded(out: Output, m: Any, write: Write) -> bool:
        """One of D's messages to the client (its first ones, before ``relay_stream`` takes over)."""
        out.prefilled(m.cached_tokens)
        lps = m.logprobs if out.logprobs is not None else ()
        return await deliver(out, m.token_ids, m.first_index, m.finish_reason, write, lps, m.index)

    def _drop_prefill(self, p: Worker, request_id: str, key: str) -> None:
        """Tell P to free the KV of a prefill that will get no ticket (fire and forget: P also drops it
        after ``prefill_pool.tickets.TICKET_WAIT_S``)."""
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
