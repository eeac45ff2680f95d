"""The migration loop: runs an admitted request to its end, moving it to a healthy worker when one
fails under it. One try on a route is ``attempt``; relaying the decode stream is ``stream``."""

from __future__ import annotations

import logging
import time

import grpc

from pdserve.router.attempt import Attempt
from pdserve.router.channels import WorkerChannels
from pdserve.router.detok import Detokenizer
from pdserve.router.errors import RelayError
from pdserve.router.jobs import Job, NoRoute
from pdserve.router.metrics import RouterMetrics
from pdserve.router.ops import RouterOps
from pdserve.router.stream import Output, ReadAheadBudget, Write
from pdserve.router.validate import Prepared, RouterTokenizer

# The names the rest of the router and its fronts use (``RelayError``: every error status of a request).
__all__ = ["Relay", "RelayError", "RouterOps", "Write"]

log = logging.getLogger(__name__)

_REROUTE_WAIT_S = 10.0  # how long a migrating stream may wait for a worker with room


class Relay:
    """Runs admitted requests to their end, moving each off failed workers (``run``).

    A moved request resends the prompt plus every token already sent, with what is left of max_tokens and
    min_tokens, so the client's stream goes on with no gap and no duplicate (``Attempt.run``)."""

    def __init__(
        self,
        tokenizer: RouterTokenizer,
        channels: WorkerChannels,
        ops: RouterOps,
        metrics: RouterMetrics | None = None,
        max_migrations: int = 0,
        queue_timeout_s: float = 30.0,
    ) -> None:
        """``ops``: what the relay tells the router (``RouterOps``). A decode worker that refuses a
        reservation for room is counted full a while (``RouterOps.worker_full``); the request then waits
        for room as in the admission queue, up to ``queue_timeout_s`` from its arrival, and the refusal
        is no migration (nothing was sent, no worker failed)."""
        self._tok = tokenizer
        self._queue_timeout_s = queue_timeout_s
        self.read_ahead = ReadAheadBudget()
        self._ops = ops
        self._metrics = metrics
        self._max_migrations = max_migrations
        self._attempt = Attempt(tokenizer, channels, ops, self.read_ahead, metrics)

    @property
    def streams_moving(self) -> int:
        """Live moves under way (``moves.LiveMove``)."""
        return self._attempt.mover.moving

    async def run(
        self, job: Job, prep: Prepared, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        """Run ``job`` (already routed) to its end. Raises RelayError when it ends with an error status.

        With metrics, every message to the client is timed on its way (TTFT from ``job.arrival``,
        ITL, e2e) and the request's outcome is counted once, whichever way it ends.
        """
        if self._metrics is None:
            return await self._run(job, prep, write, timeout, deadline_unix)
        with self._metrics.request(job.arrival, len(prep.prompt_token_ids), job.predicted_ttft_s) as rec:
            await self._run(job, prep, rec.wrap(write), timeout, deadline_unix)

    async def _run(
        self, job: Job, prep: Prepared, write: Write, timeout: float | None, deadline_unix: float
    ) -> None:
        # Primed with the prompt's tail, as the engine's own stream (offline ``LLM``) is: the same text.
        # A detokenizer and stop strings per choice (n > 1).
        out = Output(
            prep,
            [
                Detokenizer(
                    self._tok.decode_stream(skip_special_tokens=True, prompt_token_ids=prep.prompt_token_ids),
                    prep.params,
                )
                for _ in range(prep.params.n)
            ],
        )
        migrations = 0
        step_moves = 0  # moves after a failed step: one only (the request itself may be what breaks it)
        try:
            while True:
                try:
                    return await self._attempt.run(job, prep, out, write, timeout, deadline_unix)
                except RelayError as e:
                    full = e.migrate == "decode_full"
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
                self._ops.release_prefill(job)
                if timeout is not None:
                    timeout = max(deadline_unix - time.time(), 0.0)
                if full:
                    # No worker failed (at most P's token 0 was sent): it waits for room as in admission.
                    queue_left = max(self._queue_timeout_s - (time.monotonic() - job.arrival), 0.0)
                    wait = queue_left if timeout is None else min(queue_left, timeout)
                else:
                    wait = min(timeout or _REROUTE_WAIT_S, _REROUTE_WAIT_S)
                route = await self._ops.reroute(
                    job,
                    len(prep.prompt_token_ids) + out.most_sent,
                    wait,
                    failed.worker_id,
                    not out.any_sent,  # nothing sent yet: any prefill worker may prefill it again
                )
                if isinstance(route, NoRoute):
                    if not full:
                        raise RelayError(failed.code, f"{failed.details}; {route.why}")
                    # A rejection as admission's, unless P's token 0 reached the client before D refused.
                    rejected = not out.any_sent
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
                    out.most_sent,
                    migrations,
                )
        finally:
            # Whatever ended the request (finish, stop string, cancel, deadline, failure), no call stays open.
            for c in job.calls:
                c.cancel()  # a no-op on a call that has already ended
            self._ops.release_prefill(job)
