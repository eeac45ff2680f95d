"""Routing policy (which workers serve a request) and admission control (the bounded wait for room).
Pure logic: no grpc, no torch.

Both legs are scored by what each worker already holds of the prompt (``PrefixProbe``, from the router's
KV index) against its load, in the spirit of Dynamo's KV router: a decode worker costs the prompt blocks
it would have to receive or compute plus the blocks in use on it; a prefill worker the prompt tokens it
would compute plus its queue. A guard keeps a popular prefix from piling every request onto one worker.
``RoutingPolicy.LOAD`` is the load-only policy (no prefix credit).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.registry import Worker
from pdserve.worker.role import Role


class RoutingPolicy(enum.StrEnum):
    KV_AWARE = "kv-aware"  # cached prefix overlap against load, on both legs
    LOAD = "load"  # least loaded only


class RouteReason(enum.StrEnum):
    """Why a request's prompt is prefilled where it is (a metric label)."""

    COLOCATED = "colocated"  # a colocated worker prefills its own
    SHORT_PROMPT = "short_prompt"  # below --local-prefill-threshold: the decode worker prefills it
    CACHED_PREFIX = "cached_prefix"  # long, but the decode worker holds all but a short suffix
    REMOTE = "remote"  # a prefill worker prefills it and sends the KV
    NO_PREFILL_WORKER = "no_prefill_worker"  # long, but no prefill worker is ready
    PREFILL_ONLY = "prefill_only"  # max_tokens 1: the prefill worker's answer is the whole request


class PrefixProbe(Protocol):
    """How many leading prompt tokens a worker holds in its prefix cache (by the router's KV index)."""

    def cached_tokens(self, worker: Worker) -> int: ...


@dataclass(frozen=True)
class RoutingConfig:
    local_prefill_threshold: int = 256
    policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    # The guard: a worker already assigned more than this many times the least assigned worker's requests
    # plus ``balance_slack`` gets no prefix credit-based pick over the less busy ones. A slack of two lets
    # the worker that caches a prefix keep it while a couple of requests run there and none elsewhere (few
    # requests in flight); the factor bounds a hot prefix's pile-up once many are.
    balance: float = 1.25
    balance_slack: int = 2
    # What one prompt block a decode worker must receive (or compute) costs against one block in use on it:
    # moving a block, and computing it where the prefill worker lost it too, costs more than holding one,
    # so a worker that caches a prefix keeps it while it runs two or three requests more than the others
    # (the guard bounds how many more).
    prefix_weight: float = 3.0

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if self.balance < 1:
            raise ValueError(f"balance must be >= 1, got {self.balance}")
        if self.balance_slack < 0:
            raise ValueError(f"balance_slack must be >= 0, got {self.balance_slack}")
        if self.prefix_weight <= 0:
            raise ValueError(f"prefix_weight must be > 0, got {self.prefix_weight}")


@dataclass(frozen=True)
class Route:
    decode: Worker
    prefill: Worker | None  # None: the decode worker prefills locally
    # The prefill worker's answer is the whole request (max_tokens 1): ``decode`` gets no call and no
    # claim, so its load does not hold the request back and its death does not touch it.
    decode_unused: bool = False
    reason: RouteReason = RouteReason.REMOTE
    # What the KV index says each chosen worker holds of the prompt (tokens): a prediction.
    decode_cached_tokens: int = 0
    prefill_cached_tokens: int = 0


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
    probe: PrefixProbe | None = None,
) -> Route | None:
    """Pick workers for a request, or None when no READY worker has room now. ``total_tokens``: prompt +
    max_tokens; a decode worker whose whole cache cannot hold them is never picked (it would refuse).
    ``one_token``: the request's only token is the first (max_tokens 1), which a prefill worker samples:
    a prompt that would go to one goes to it alone (``Route.decode_unused``), however busy the decode
    workers are. ``probe``: what each worker caches of the prompt (None, or the LOAD policy: nothing)."""
    if config.policy is RoutingPolicy.LOAD:
        probe = None

    def cached(w: Worker) -> int:
        return min(probe.cached_tokens(w), prompt_len - 1) if probe is not None else 0

    if one_token and prompt_len >= config.local_prefill_threshold:
        prefillers = [w for w in ready if w.role.prefills_remote]
        named = min((w for w in ready if w.role.decodes), key=lambda w: w.worker_id, default=None)
        if prefillers and named is not None:
            p, p_hit = _best_prefill(prefillers, prompt_len, cached)
            return Route(named, p, True, RouteReason.PREFILL_ONLY, prefill_cached_tokens=p_hit)
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
    d, d_hit = _best_decode(decoders, prompt_len, config, cached)
    if d.role is Role.BOTH:
        return Route(d, None, reason=RouteReason.COLOCATED, decode_cached_tokens=d_hit)
    # A short prompt (or a short suffix past what the decode worker holds) is not worth a transfer.
    if prompt_len - d_hit < config.local_prefill_threshold:
        why = (
            RouteReason.SHORT_PROMPT
            if prompt_len < config.local_prefill_threshold
            else RouteReason.CACHED_PREFIX
        )
        return Route(d, None, reason=why, decode_cached_tokens=d_hit)
    prefillers = [w for w in ready if w.role.prefills_remote]
    if not prefillers:
        return Route(d, None, reason=RouteReason.NO_PREFILL_WORKER, decode_cached_tokens=d_hit)
    p, p_hit = _best_prefill(prefillers, prompt_len, cached)
    return Route(d, p, reason=RouteReason.REMOTE, decode_cached_tokens=d_hit, prefill_cached_tokens=p_hit)


def _best_decode(
    decoders: list[Worker], prompt_len: int, config: RoutingConfig, cached
) -> tuple[Worker, int]:
    """Least loaded first (fewest assigned requests, then most free blocks, then id: deterministic);
    with prefix credit, the lowest cost among the workers the balance guard leaves: blocks it would have
    to receive or compute for the prompt (weighted) plus blocks in use on it."""
    hits = {w.worker_id: cached(w) for w in decoders}
    if not any(hits.values()):
        d = min(decoders, key=lambda w: (w.assigned, -w.kv_blocks_free, w.worker_id))
        return d, 0
    least = min(w.assigned for w in decoders)
    guarded = [w for w in decoders if w.assigned <= least * config.balance + config.balance_slack]

    def cost(w: Worker) -> tuple[float, int, str]:
        new_blocks = blocks_needed(w, prompt_len) - hits[w.worker_id] // max(w.block_size, 1)
        in_use = w.kv_blocks_total - w.kv_blocks_free
        return (new_blocks * config.prefix_weight + in_use, w.assigned, w.worker_id)

    d = min(guarded, key=cost)
    return d, hits[d.worker_id]


def _best_prefill(prefillers: list[Worker], prompt_len: int, cached) -> tuple[Worker, int]:
    """Fewest prompt tokens to compute, counting its queue: the last heartbeat's figure plus what the
    router dispatched since, plus this prompt's tokens past its cached prefix."""
    hits = {w.worker_id: cached(w) for w in prefillers}

    def cost(w: Worker) -> tuple[int, str]:
        queued = w.queued_prefill_tokens + w.assigned_prefill_tokens
        return (queued + prompt_len - hits[w.worker_id], w.worker_id)

    p = min(prefillers, key=cost)
    return p, hits[p.worker_id]


def can_ever_serve(workers: list[Worker], prompt_len: int) -> bool:
    """True when some decoding worker could hold the prompt if it were idle."""
    for w in workers:
        if w.role.decodes and blocks_needed(w, prompt_len) <= w.kv_blocks_total:
            return True
    return False


class QueueFullError(Exception):
    """A queue is full: the router's own (``max_waiting``) or the chosen prefill worker's (``reason``
    names which, as ``metrics.REFUSAL_REASONS`` does)."""

    def __init__(self, message: str, reason: str = "queue_full", retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s  # when it would fit (0: unknown)


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
