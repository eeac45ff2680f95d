"""The late path of a prefill sent before its ticket: the ticket kept until its prompt is here, then (once
the batch is past opening transfers) the transfer opened late, caught up with the layers written, and
completed after the forward."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Hashable
from typing import Any, Protocol

from pdserve.kv_transfer import AbortedError, KVSender, SenderHandle, TransferTicket
from pdserve.prefill_pool.request import ENDED_STATES, LATE_STATES, PrefillRequest, ReqState
from pdserve.prefill_pool.scheduler import PrefillJob

log = logging.getLogger(__name__)

# How long the KV of a prefill sent without a ticket waits for ``attach`` at most (the router sends the
# ticket as soon as the decode worker hands it out, or gives the request up).
TICKET_WAIT_S = 30.0
_EARLY_TICKETS = 1024  # tickets attached before their Prefill arrived, kept at most
_EARLY_TICKET_S = 5.0  # and for at most this long (the Prefill call was sent first)


class LateOpenFailed(RuntimeError):
    """The transfer of a prefill already answered did not open (``attach_and_open``)."""


class PrefillLoopSide(Protocol):
    """What the late path needs of the prefill loop."""

    def give_up(self, job: PrefillJob, reason: str) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    async def finish(self, job: PrefillJob) -> None: ...


class LateTickets:
    """Runs on the event loop's thread, as the loop does."""

    def __init__(self, loop: PrefillLoopSide, sender: KVSender, push_lock: threading.Lock) -> None:
        self._loop, self._sender = loop, sender
        # Taken by the layer hook (forward thread) and by the catch-up around a job's ``layers_done`` and
        # ``handle`` (not around the pushes): every layer is pushed exactly once, by one or the other.
        self._push_lock = push_lock
        # Jobs submitted without a ticket, by (request id, attach key): the key is the router's per attempt,
        # so a late drop or ticket of an earlier attempt of the request never reaches a retry.
        self._awaiting: dict[tuple[Hashable, str], PrefillJob] = {}
        self._early: dict[tuple[Hashable, str], tuple[TransferTicket, float]] = {}  # came before submit

    def expect(self, job: PrefillJob, attach_key: str, deadline: float | None) -> None:
        """A job submitted without its ticket: ``attach`` brings it, by ``deadline`` (loop time) at most."""
        req: PrefillRequest = job.payload
        by = asyncio.get_running_loop().time() + TICKET_WAIT_S
        req.ticket_by = by if deadline is None else min(by, deadline)
        job.attach_key = (job.request_id, attach_key)
        early = self._early.pop(job.attach_key, None)
        if early is not None:
            self._take(job, early[0])
        else:
            self._awaiting[job.attach_key] = job

    def forget(self, job: PrefillJob) -> None:
        """No ticket reaches ``job`` from here on."""
        if job.attach_key is not None and self._awaiting.get(job.attach_key) is job:
            del self._awaiting[job.attach_key]

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
        """``attach``; then, when the ticket went to a prefill already past opening its batch's transfers
        (its transfer opens late, the decode side waiting on its reservation), how that open went, within
        ``wait_s``: an open that failed raises its error here, for the router to move the request (nothing
        else tells the decode side, whose reservation would wait for the request's deadline)."""
        job = self._awaiting.get((request_id, attach_key))
        kept = self.attach(request_id, ticket, attach_key)
        if job is None or ticket is None or job.payload.state is not ReqState.LATE:
            return kept
        try:
            await asyncio.wait_for(asyncio.shield(job.payload.late_opened), wait_s)
        except TimeoutError:
            # Still opening (a connect to the decode worker that hangs): the router moves the request
            # now, and a transfer that opens after this is aborted unused.
            self._loop.give_up(job, "its late transfer did not open in time")
            raise LateOpenFailed(f"KV transfer of {request_id} did not open within {wait_s:.3g}s") from None
        except Exception as e:  # noqa: BLE001 - whatever the open raised
            raise LateOpenFailed(f"KV transfer of {request_id} did not open: {e}") from e
        return kept

    def _take(self, job: PrefillJob, ticket: TransferTicket | None) -> None:
        req: PrefillRequest = job.payload
        if ticket is not None and ticket.num_tokens != job.num_tokens:
            why = f"ticket reserves {ticket.num_tokens} tokens for a prompt of {job.num_tokens}"
            req.fail(ValueError(why))
            self._loop.give_up(job, "its ticket does not fit the prompt")
            raise ValueError(why)
        if ticket is None:
            req.fail(AbortedError("the router gave the request up before its ticket"))
            self._loop.give_up(job, "given up by the router before its ticket")
            return
        req.ticket = ticket
        if not req.attached.done():
            req.attached.set_result(ticket)
        # QUEUED: the batch opens it when scheduled. FORWARD: past opening transfers, open one now.
        self.start(job)

    def start(self, job: PrefillJob) -> None:
        """Hand a ticketless job in the forward (or past it) to the late path: its transfer, completion and
        blocks (once)."""
        req: PrefillRequest = job.payload
        if req.state is not ReqState.FORWARD:
            return
        req.to(ReqState.LATE)
        self._loop.spawn(self._transfer(job))

    async def _transfer(self, job: PrefillJob) -> None:
        """Wait for the ticket, open, push the layers written so far (the hook pushes the rest), complete
        once the forward gave the first token. The blocks are freed only after the forward is done with
        them."""
        req: PrefillRequest = job.payload
        loop = asyncio.get_running_loop()
        ticket: TransferTicket | None = None
        try:
            async with asyncio.timeout_at(req.ticket_by):
                ticket = await asyncio.shield(req.attached)
        except TimeoutError:
            log.warning(
                "request %s: no ticket within %.0f s; its KV is dropped", job.request_id, TICKET_WAIT_S
            )
        self.forget(job)
        handle: SenderHandle | None = None
        opened = req.late_opened
        if ticket is not None and req.state is ReqState.LATE:
            try:
                handle = await self._sender.open(ticket, job.block_table)
            except Exception as e:  # noqa: BLE001 - told to the router through the ticket's AttachTicket
                log.warning("request %s: transfer did not open: %r", job.request_id, e)
                if not opened.done():
                    opened.set_exception(e)
            finally:  # (a cancel too: AttachTicket must not wait out its bound for nothing)
                if not opened.done():
                    opened.set_result(None)
        if not opened.done():
            opened.set_result(None)
        if handle is not None and req.state in ENDED_STATES:
            # The loop finished the job meanwhile (given up while its batch opened transfers): its blocks
            # may be someone else's now. This transfer never writes; the decode worker frees its blocks.
            await handle.abort("prefill cancelled")
            return
        if handle is not None and req.given_up:  # given up while it opened: it never writes either
            await handle.abort("given up before its transfer opened")
            handle = None
        if handle is not None:

            def catch_up(h: SenderHandle = handle) -> None:
                # Off the loop (a same-host writer copies on the calling thread: cma.py, cuda_ipc.py).
                with self._push_lock:  # (held only to split the layers: the pushes run outside it)
                    req.handle = h  # the hook pushes every later layer from here on
                    written = req.layers_done
                if written:  # in any order with the hook's: each layer is its own
                    h.push_layers(0, written)

            try:
                await loop.run_in_executor(None, catch_up)
            except Exception:  # noqa: BLE001 - aborted below; the blocks still come back
                log.exception("request %s: pushing its written layers failed", job.request_id)
                req.give_up()
        first = await req.forward_done
        if req.state in LATE_STATES:  # (else the loop closed it, with an abort)
            req.complete_with = None if req.handle is None or req.given_up else first
        await self._loop.finish(job)
