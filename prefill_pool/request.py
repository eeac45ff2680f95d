"""A prefill request's record on this worker and its one state machine (``ReqState``): every change of
stage goes through ``PrefillRequest.to``, checked against the table of the transitions there are."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.params import SamplingParams
from pdserve.kv_transfer import SenderHandle, TransferTicket


class ReqState(enum.Enum):
    """Where a request is, and so who ends it (completes or aborts its transfer, then frees its blocks)."""

    QUEUED = "queued"  # in the scheduler's queue: no blocks, no transfer (a ticket may come meanwhile)
    OPENING = "opening"  # scheduled with its ticket: the batch opens its transfer
    FORWARD = "forward"  # in the batch's forward: the hook pushes each layer to its transfer (if it has one)
    LATE = "late"  # the late path holds it (tickets.py): the ticket's wait, the open, the catch-up, the end
    GIVEN_UP = "given_up"  # given up while the batch holds it: the batch ends it with an abort
    LATE_GIVEN_UP = "late_given_up"  # given up (or its catch-up failed) on the late path: that ends it so
    CLOSING = "closing"  # its end is decided (``complete_with``): the finishing task runs next
    FINISHED = "finished"  # the finishing task ran (the blocks free once it returns), or it left the queue


_NEXT: dict[ReqState, frozenset[ReqState]] = {
    ReqState.QUEUED: frozenset({ReqState.OPENING, ReqState.FORWARD, ReqState.FINISHED}),
    ReqState.OPENING: frozenset({ReqState.FORWARD, ReqState.GIVEN_UP, ReqState.CLOSING}),
    ReqState.FORWARD: frozenset({ReqState.LATE, ReqState.GIVEN_UP, ReqState.CLOSING}),
    ReqState.LATE: frozenset({ReqState.LATE_GIVEN_UP, ReqState.FINISHED}),
    ReqState.GIVEN_UP: frozenset({ReqState.CLOSING}),
    # CLOSING: the batch's opening left it out (given up while the batch opened its transfers).
    ReqState.LATE_GIVEN_UP: frozenset({ReqState.CLOSING, ReqState.FINISHED}),
    ReqState.CLOSING: frozenset({ReqState.FINISHED}),
    ReqState.FINISHED: frozenset(),
}
# What a give-up makes of a stage that someone holds (QUEUED is the loop's: the scheduler drops the job).
_GIVEN_UP: dict[ReqState, ReqState] = {
    ReqState.OPENING: ReqState.GIVEN_UP,
    ReqState.FORWARD: ReqState.GIVEN_UP,
    ReqState.LATE: ReqState.LATE_GIVEN_UP,
}
LATE_STATES = frozenset({ReqState.LATE, ReqState.LATE_GIVEN_UP})
ENDED_STATES = frozenset({ReqState.CLOSING, ReqState.FINISHED})


class InvalidTransition(RuntimeError):
    """A stage change the table does not have: a bug in the loop."""


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (nobody may wait for it)."""
    if not fut.cancelled():
        fut.exception()


def _future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class PrefillRequest:
    """Created on the event loop (its futures belong to it); only that loop's thread changes it, but
    ``layers_done`` and ``handle``, which the layer hook reads under the loop's push lock."""

    params: SamplingParams
    ticket: TransferTicket | None  # None: until ``attach``
    ticketless: bool = False  # submitted without its ticket (the late path's: tickets.py)
    state: ReqState = ReqState.QUEUED
    # The futures carry results to whoever awaits them; the stage is ``state`` alone.
    result: asyncio.Future[tuple[int, float]] = field(default_factory=_future)  # (first token, forward s)
    attached: asyncio.Future[TransferTicket | None] = field(default_factory=_future)  # None: given up
    # The first token once its forward is over (None: the forward failed, or it was left out).
    forward_done: asyncio.Future[int | None] = field(default_factory=_future)
    # How opening its late transfer went (an error: it did not open; the decode side was never told, so the
    # ticket's AttachTicket answers with it and the router moves the request).
    late_opened: asyncio.Future[None] = field(default_factory=_future)
    ticket_by: float = 0.0  # loop time after which a missing ticket frees the blocks
    complete_with: int | None = None  # CLOSING: the first token to complete its transfer with; None: abort
    layers_done: int = 0  # layers its forward has written (the hook counts them, under the push lock)
    first_token_unix: float = 0.0  # when its first token was sampled (wall clock; 0: not yet)
    # n > 1 (params.n): choices 1..'s first tokens, sampled with choice 0's from the one forward; its
    # transfer's completion carries them to the decode worker.
    choice_tokens: tuple[int, ...] = ()
    handle: SenderHandle | None = None
    # Set with ``result`` when the params ask: the first token's logprobs, the prompt's (after its first).
    first_logprobs: Any = None  # engine.logprobs.TokenLogprob
    choice_logprobs: list[Any] = field(default_factory=list)  # choices 1..'s, as first_logprobs
    prompt_logprobs: list[Any] | None = None

    def __post_init__(self) -> None:
        self.late_opened.add_done_callback(_retrieve)

    def to(self, new: ReqState) -> None:
        """The one place a stage changes."""
        if new not in _NEXT[self.state]:
            raise InvalidTransition(f"prefill request: {self.state.value} -> {new.value}")
        self.state = new

    @property
    def given_up(self) -> bool:
        return self.state in (ReqState.GIVEN_UP, ReqState.LATE_GIVEN_UP)

    def give_up(self) -> None:
        """Whoever holds it ends it with an abort; a closing one aborts instead of completing."""
        if self.state in _GIVEN_UP:
            self.to(_GIVEN_UP[self.state])
        elif self.state is ReqState.CLOSING:
            self.complete_with = None

    def fail(self, exc: Exception) -> None:
        """End its answer with ``exc`` if it has none yet (marked retrieved: its caller may be gone)."""
        if not self.result.done():
            self.result.set_exception(exc)
            self.result.exception()
