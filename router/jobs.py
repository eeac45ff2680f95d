"""Router-side bookkeeping of admitted requests: each ``Job`` and the ``Ledger`` of the load they put on
workers. Pure: no grpc, no torch."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.policy import PrefixProbe, Route, blocks_needed
from pdserve.router.registry import Registry, Worker


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


@dataclass(frozen=True)
class Failure:
    """Why the router ended a request on its own; the service maps ``code`` to a gRPC status."""

    code: str  # a grpc.StatusCode name, e.g. "UNAVAILABLE"
    details: str
    worker_id: str = ""  # the worker whose loss caused it, when one did
    # Why the request may move to another worker (``metrics.MIGRATION_REASONS``); "": by the code alone.
    reason: str = ""


@dataclass(frozen=True)
class NoRoute:
    """Why a reroute found no worker for a job: ``why`` in words, and which case it was."""

    why: str
    # "none_left": no other worker could ever take it (no wait helps); "queue_full": the router's queue
    # or the prefill queue is full (as admission refuses); "no_room": none had room within the wait;
    # "closing": the router is stopping (``Admission.close``).
    kind: str


class Job:
    """One admitted request: its route and its open worker calls, so that something other than its own task
    (the heartbeat sweep, a worker's death seen by another request) can fail it."""

    __slots__ = (
        "request_id",
        "prompt_len",
        "arrival",
        "route",
        "prefill_claimed",
        "prefill_pending",
        "kv_blocks",
        "total_tokens",
        "one_token",
        "calls",
        "failure",
        "probe",
        "prefill_tokens",
        "predicted_ttft_s",
        "move",
        "move_after",
        "moved_at",
        "wake",
    )

    def __init__(self, request_id: str, prompt_len: int, arrival: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        # time.monotonic() when the request reached the router (TTFT counts from it); default: now.
        self.arrival = time.monotonic() if arrival is None else arrival
        self.route: Route | None = None
        self.prefill_claimed = False
        # The route's prefill worker still matters: its KV has not all landed on the decode worker (cleared
        # by the relay at the decode worker's first token). Losing it after that loses nothing.
        self.prefill_pending = False
        self.kv_blocks = 0  # counted against the route's decode worker (Ledger.claim)
        # Prompt + max_tokens (within the context): a decode worker whose whole cache is smaller never
        # gets the request (0: unknown, not checked).
        self.total_tokens = 0
        self.one_token = False  # its only token is the first (max_tokens 1): a prefill worker's answer
        self.calls: list[Cancellable] = []
        self.failure: Failure | None = None
        self.probe: PrefixProbe | None = None  # what each worker caches of its prompt (the KV index)
        self.prefill_tokens = 0  # counted against the worker that prefills it, while prefill_claimed
        # Live migration: why its stream should move off its decode worker now ("": it should not), not
        # asked again before ``move_after`` (time.monotonic()); ``wake`` tells its relay at once.
        self.move = ""
        self.move_after = 0.0
        self.moved_at = 0.0  # time.monotonic() of its last live move (0: never)
        self.wake: Callable[[], None] | None = None
        self.predicted_ttft_s = 0.0  # admission's prediction (0: none was made)

    def request_move(self, cause: str) -> None:
        """Ask the job's relay to move its stream live (``cause``: why; a label of the move metrics)."""
        if self.move or time.monotonic() < self.move_after:
            return
        self.move = cause
        if self.wake is not None:
            self.wake()

    def uses(self, worker_id: str) -> bool:
        r = self.route
        return r is not None and (
            (r.decode.worker_id == worker_id and not r.decode_unused)
            or (self.prefill_pending and r.prefill is not None and r.prefill.worker_id == worker_id)
        )

    def fail(self, failure: Failure) -> None:
        """Record why and cancel the open worker calls; the request's task turns that into ``failure``."""
        if self.failure is None:
            self.failure = failure
        for c in self.calls:
            c.cancel()


class Ledger:
    """The router-side load figures routing reads (``Worker.assigned``, ``assigned_prefill_tokens``,
    ``assigned_kv_blocks``). Kept per worker id, since a re-registered worker is a new object while its old
    requests still run, and written onto whichever object the registry holds. With no request in flight,
    every count is zero."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._assigned: dict[str, int] = {}
        self._prefill_tokens: dict[str, int] = {}
        self._kv_blocks: dict[str, int] = {}
        self.jobs: set[Job] = set()

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self.jobs))

    def claim(self, job: Job, route: Route) -> None:
        """Count ``route`` against its workers at once, so that the next routing decision sees it."""
        job.route = route
        self.jobs.add(job)
        if not route.decode_unused:
            self._bump(self._assigned, route.decode, 1, "assigned")
            job.kv_blocks = blocks_needed(route.decode, job.prompt_len)
            self._bump(self._kv_blocks, route.decode, job.kv_blocks, "assigned_kv_blocks")
        job.prefill_pending = route.prefill is not None
        # The tokens its prefill computes queue on the worker that prefills (a prefill worker, or the decode
        # worker itself) until the first token: what the next route and the TTFT budget see ahead of them.
        prefiller, cached = (
            (route.prefill, route.prefill_cached_tokens)
            if route.prefill is not None
            else (route.decode, route.decode_cached_tokens)
        )
        if route.prefill is not None or not route.decode_unused:
            job.prefill_claimed = True
            job.prefill_tokens = max(job.prompt_len - cached, 1)
            self._bump(self._prefill_tokens, prefiller, job.prefill_tokens, "assigned_prefill_tokens")

    def grow(self, job: Job, seq_len: int) -> None:
        """The job's sequence on its decode worker is ``seq_len`` tokens now (prompt + outputs): count the
        blocks it has grown into against that worker, so that routing between heartbeats sees the room
        running streams took since (it only ever grows; ``release`` returns it all)."""
        route = job.route
        if route is None or job not in self.jobs or route.decode_unused:
            return
        n = blocks_needed(route.decode, seq_len)
        if n > job.kv_blocks:
            self._bump(self._kv_blocks, route.decode, n - job.kv_blocks, "assigned_kv_blocks")
            job.kv_blocks = n

    def move(self, job: Job, route: Route, seq_len: int) -> None:
        """The job's stream moved live to ``route``'s decode worker, holding ``seq_len`` tokens there: its
        counts go with it (nothing is prefilled)."""
        self.release(job)
        job.prompt_len = seq_len
        self.claim(job, route)
        self.release_prefill(job)

    def release_prefill(self, job: Job) -> None:
        """The prefill call ended (either way): its tokens no longer queue on that worker. Idempotent."""
        route = job.route
        if job.prefill_claimed and route is not None:
            job.prefill_claimed = False
            prefiller = route.prefill if route.prefill is not None else route.decode
            self._bump(self._prefill_tokens, prefiller, -job.prefill_tokens, "assigned_prefill_tokens")

    def release(self, job: Job) -> None:
        """The request ended (any way). Idempotent."""
        if job not in self.jobs or job.route is None:
            return
        self.release_prefill(job)
        if not job.route.decode_unused:
            self._bump(self._assigned, job.route.decode, -1, "assigned")
            self._bump(self._kv_blocks, job.route.decode, -job.kv_blocks, "assigned_kv_blocks")
        job.kv_blocks = 0
        self.jobs.discard(job)

    def sync(self, worker: Worker) -> None:
        """A (re-)registered worker object takes over the counts of its id."""
        worker.assigned = self._assigned.get(worker.worker_id, 0)
        worker.assigned_prefill_tokens = self._prefill_tokens.get(worker.worker_id, 0)
        worker.assigned_kv_blocks = self._kv_blocks.get(worker.worker_id, 0)

    def assigned(self, worker_id: str) -> int:
        return self._assigned.get(worker_id, 0)

    def prefill_tokens(self, worker_id: str) -> int:
        return self._prefill_tokens.get(worker_id, 0)

    def _bump(self, counts: dict[str, int], w: Worker, delta: int, attr: str) -> None:
        wid = w.worker_id
        n = counts.get(wid, 0) + delta
        if n:
            counts[wid] = n
        else:
            counts.pop(wid, None)
        current = self._registry.get(wid)
        for obj in (w, current):
            if obj is not None:
                setattr(obj, attr, n)
