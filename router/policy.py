"""Routing policy (which workers serve a request) and admission control (the bounded wait for room).
Pure logic: no grpc, no torch."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.router.registry import Worker
from pdserve.worker.role import Role


@dataclass(frozen=True)
class RoutingConfig:
    local_prefill_threshold: int = 256

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")


@dataclass(frozen=True)
class Route:
    decode: Worker
    prefill: Worker | None  # None: the decode worker prefills locally
    # The prefill worker's answer is the whole request (max_tokens 1): ``decode`` gets no call and no
    # claim, so its load does not hold the request back and its death does not touch it.
    decode_unused: bool = False


def blocks_needed(w: Worker, prompt_len: int) -> int:
    """KV blocks a decode worker reserves for a prompt: the prompt plus the first generated token."""
    return -(-(prompt_len + 1) // max(w.block_size, 1))


def _has_room(w: Worker, blocks_needed: int) -> bool:
    return w.assigned < w.max_running and w.kv_blocks_free >= blocks_needed


def choose_route(
    ready: list[Worker],
    prompt_len: int,
    config: RoutingConfig,
    total_tokens: int = 0,
    one_token: bool = False,
) -> Route | None:
    """Pick workers for a request, or None when no READY worker has room now. ``total_tokens``: prompt +
    max_tokens; a decode worker whose whole cache cannot hold them is never picked (it would refuse).
    ``one_token``: the request's only token is the first (max_tokens 1), which a prefill worker samples:
    a prompt that would go to one goes to it alone (``Route.decode_unused``), however busy the decode
    workers are."""
    if one_token and prompt_len >= config.local_prefill_threshold:
        prefillers = [w for w in ready if w.role.prefills_remote]
        named = min((w for w in ready if w.role.decodes), key=lambda w: w.worker_id, default=None)
        if prefillers and named is not None:
            return Route(decode=named, prefill=_least_queued(prefillers), decode_unused=True)
    decoders = []
    for w in ready:
        if not w.role.decodes:
            continue
        if total_tokens and blocks_needed(w, total_tokens - 1) > w.kv_blocks_total:
            continue
        if _has_room(w, blocks_needed(w, prompt_len)):
            decoders.append(w)
    if not decoders:
        return None
    # Least loaded first: fewest assigned requests, then most free blocks, then id (deterministic).
    decoders.sort(key=lambda w: (w.assigned, -w.kv_blocks_free, w.worker_id))
    d = decoders[0]
    # A colocated worker prefills its own; a short prompt is not worth a transfer.
    if d.role is Role.BOTH or prompt_len < config.local_prefill_threshold:
        return Route(decode=d, prefill=None)
    prefillers = [w for w in ready if w.role.prefills_remote]
    if not prefillers:
        return Route(decode=d, prefill=None)
    return Route(decode=d, prefill=_least_queued(prefillers))


def _least_queued(prefillers: list[Worker]) -> Worker:
    """Fewest queued prefill tokens: the last heartbeat's figure plus what the router dispatched since."""
    return min(prefillers, key=lambda w: (w.queued_prefill_tokens + w.assigned_prefill_tokens, w.worker_id))


def can_ever_serve(workers: list[Worker], prompt_len: int) -> bool:
    """True when some decoding worker could hold the prompt if it were idle."""
    for w in workers:
        if w.role.decodes and blocks_needed(w, prompt_len) <= w.kv_blocks_total:
            return True
    return False


class QueueFullError(Exception):
    """A queue is full: the router's own (``max_waiting``) or the chosen prefill worker's."""


class AdmissionClosed(Exception):
    """The router is stopping: a request still waiting for a worker is refused, not left to wait out the
    shutdown (its client can go to another router at once)."""


class Admission:
    """Bounded FIFO of requests waiting for a worker with room.

    ``wait_for_route`` retries the routing function each time capacity may have
    changed (a request finished, a heartbeat arrived, a worker joined).
    """

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self.waiting = 0
        self.closed = False
        self._changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        """Refuse every request waiting (``AdmissionClosed``) and every later one that finds no room."""
        self.closed = True
        await self.notify()

    async def wait_for_route(self, try_route, timeout_s: float | None) -> Route | None:
        """Route now, or wait in the bounded queue. None when ``timeout_s`` passes first;
        AdmissionClosed once ``close`` was called."""
        route = try_route()
        if route is not None:
            return route
        if self.closed:
            raise AdmissionClosed
        if self.waiting >= self.max_waiting:
            raise QueueFullError(f"the router queue is full ({self.max_waiting} requests waiting)")
        self.waiting += 1
        try:
            # The timeout in this task, not ``asyncio.wait_for``'s inner one: a cancel racing the timeout
            # could leave that inner task holding the condition's lock, and every later notify would block
            # on it. ``Condition.wait`` re-takes the lock in the cancelled task itself, and ``async with``
            # gives it back.
            async with asyncio.timeout(timeout_s), self._changed:
                route = await self._changed.wait_for(lambda: self.closed or try_route())
                if route is True:  # (closed: no route was tried, so none was claimed)
                    raise AdmissionClosed
                return route
        except TimeoutError:
            return None
        finally:
            self.waiting -= 1
