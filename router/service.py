"""The Generation service and the ``Router`` behind it: admission, rerouting and route claims.
``generate`` is the one entry every front (gRPC, the OpenAI HTTP front) calls."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.proto import generation_pb2, generation_pb2_grpc
from pdserve.router.budget import check_prefill_queue, check_ttft_budget
from pdserve.router.channels import WorkerChannels
from pdserve.router.config import RouterConfig
from pdserve.router.errors import ClientGone, is_batch_error, worker_failure
from pdserve.router.jobs import Job, Ledger, NoRoute
from pdserve.router.kv_index import KvIndex, PromptProbe
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.moves import MoveWatch, RebalanceConfig
from pdserve.router.policy import (
    Admission,
    AdmissionClosed,
    QueueFullError,
    Route,
    RoutingConfig,
    can_ever_serve,
    choose_route,
)
from pdserve.router.registry import Registry, State, Worker
from pdserve.router.relay import Relay, RelayError, Write
from pdserve.router.validate import InvalidRequest, ModelLimits, Prepared, RouterTokenizer, prepare

log = logging.getLogger(__name__)

_ALWAYS_LOCAL = (
    1 << 62
)  # a local_prefill_threshold no prompt reaches: migrated streams prefill where they decode


class Router:
    """Registry, admission, ledger and worker channels of one router process; the ``RouterOps`` the
    relay calls back."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = Registry(config.registry_config())
        self.routing = config.routing_config()
        self.admission = Admission(config.max_waiting)
        self.ledger = Ledger(self.registry)
        self.kv_index = KvIndex()  # fed by the workers' heartbeats (control.RegistryService.Heartbeat)
        self.channels = WorkerChannels(config.cluster_token, config.tls)
        self.metrics = RouterMetrics()
        self.membership = Membership(
            self.registry,
            self.ledger,
            self.admission,
            self.channels,
            self.metrics,
            config.heartbeat_interval_s,
        )
        # Started by the server when live migration is on.
        self.move_watch = MoveWatch(self.registry, self.ledger, RebalanceConfig(enabled=config.rebalance))
        self.address = config.bind_address  # the bound address once the server has started
        self.tokenizer: RouterTokenizer | None = None  # None until loaded: Generate is UNAVAILABLE
        self.limits = ModelLimits()
        self.relay: Relay | None = None
        self.closing = False
        self.inflight_ids: set[str] = set()  # request ids admitted and not finished: unique at a time
        self.metrics_url = ""  # set once the router's /metrics endpoint serves
        self.http_url = ""  # set once the OpenAI HTTP front serves (``OpenAIFront``); empty: off
        self.metrics.watch(
            running=lambda: len(self.ledger.jobs),
            waiting=lambda: self.admission.waiting,
            workers=lambda: [(w.role.value, w.state.value) for w in self.registry],
        )

    def set_frontend(self, tokenizer: RouterTokenizer, limits: ModelLimits) -> None:
        self.tokenizer, self.limits = tokenizer, limits
        self.relay = Relay(
            tokenizer,
            self.channels,
            self,
            metrics=self.metrics,
            max_migrations=self.config.max_migrations,
            queue_timeout_s=self.config.queue_timeout_s,
        )

    def current_limits(self) -> ModelLimits:
        """The model's limits; the context length falls back to what the workers registered. ``kv_tokens``:
        the largest live decoding worker's KV cache, in tokens."""
        kv_tokens = max(
            (
                w.kv_blocks_total * w.block_size
                for w in self.registry
                if w.role.decodes and w.state in (State.READY, State.LOADING)
            ),
            default=0,
        )
        context = self.limits.context_length
        if context <= 0:
            context = min(
                (i.context_length for i in self.membership.infos.values() if i.context_length > 0), default=0
            )
        return ModelLimits(context_length=context, vocab_size=self.limits.vocab_size, kv_tokens=kv_tokens)

    async def admit(self, job: Job, timeout_s: float | None, max_tokens: int = 0, choices: int = 1) -> Route:
        """Claim a route for ``job``, waiting in the admission queue for room. A request that no live
        decoding worker could hold even alone (its prompt plus ``max_tokens``, within the context; with
        ``choices`` > 1, that many times: the bound the engine sets, as if no block were shared) is
        refused at once, INVALID_ARGUMENT as the worker itself would."""
        entered = time.monotonic()
        n = job.prompt_len
        live = [w for w in self.registry if w.state in (State.READY, State.LOADING)]
        decoders = [w for w in live if w.role.decodes]
        if not decoders:
            draining = any(w.role.decodes and w.state is State.DRAINING for w in self.registry)
            why = ": every one is draining (the cluster is stopping or scaling down)" if draining else ""
            raise RelayError(grpc.StatusCode.UNAVAILABLE, f"no decode or colocated worker is available{why}")
        context = self.current_limits().context_length
        total = n + max(max_tokens, 1)
        if context > 0:
            total = min(total, context)
        if choices > 1:
            if not can_ever_serve(decoders, choices * total - 1):
                holds = max(w.kv_blocks_total * w.block_size for w in decoders)
                raise RelayError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"n is {choices}: {choices} choices of up to {total} tokens (prompt and output) need "
                    f"{choices * total} tokens of KV cache but the largest decode worker's holds {holds}: "
                    "lower n or max_tokens",
                )
            total = n + choices * (total - n)  # what it holds: the prompt once, every choice's output
        job.total_tokens = total
        job.one_token = max_tokens == 1
        if not can_ever_serve(decoders, total - 1):
            holds = max(w.kv_blocks_total * w.block_size for w in decoders)
            if not can_ever_serve(decoders, n):  # the prompt alone (and its first token)
                why = (
                    f"prompt has {n} tokens but the largest decode worker's KV cache holds {holds}: shorten "
                    "it, or give the decode workers more KV memory"
                )
            else:  # (an unset max_tokens was cut to fit: the client set this one)
                why = (
                    f"max_tokens is {max_tokens}, but the prompt has {n} tokens and the largest decode "
                    f"worker's KV cache holds {holds}: at most {holds - n} can be generated, or give the "
                    "decode workers more KV memory"
                )
            raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, why)

        # The TTFT budget (off: 0), tightened by the request's own deadline.
        budget = self.config.admission_ttft_s
        if budget and timeout_s is not None:
            budget = min(budget, timeout_s)

        # Claimed in the step that chose it, so the next routing decision sees it.
        def try_route() -> Route | None:
            route = choose_route(
                self.registry.ready(), n, self.routing, job.total_tokens, job.one_token, job.probe
            )
            if route is not None:
                check_prefill_queue(route, n, self.config.max_prefill_queue_tokens)
                if budget:
                    job.predicted_ttft_s = check_ttft_budget(route, n, budget)
                self.ledger.claim(job, route)
                self.metrics.routed(route)
            return route

        wait = (
            self.config.queue_timeout_s if timeout_s is None else min(self.config.queue_timeout_s, timeout_s)
        )
        if budget:  # waiting for room longer than the budget would miss it anyway
            wait = min(wait, budget)
        try:
            route = await self.admission.wait_for_route(try_route, max(wait, 0.0))
        except QueueFullError as e:
            self.metrics.refused(e.reason)
            raise RelayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry_after_s=e.retry_after_s
            ) from None
        except AdmissionClosed:
            raise RelayError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down") from None
        if route is None:
            if timeout_s is not None and timeout_s <= self.config.queue_timeout_s:
                # The request's own deadline (the client's, or --request-timeout) ended the wait.
                raise RelayError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the request's deadline ({timeout_s:.3g}s) passed while it waited for a worker "
                    "with room",
                )
            raise RelayError(grpc.StatusCode.UNAVAILABLE, f"no worker had room within {wait:.3g}s")
        self.metrics.queue_time.observe(time.monotonic() - entered)
        return route

    async def reroute(
        self, job: Job, prompt_len: int, wait_s: float, avoid: str = "", remote: bool = False
    ) -> Route | NoRoute:
        """Move ``job`` off its failed route: release it, then claim a route on READY workers other than
        ``avoid`` (the one that failed), waiting up to ``wait_s`` for room. ``remote``: nothing was sent
        yet, so the route may name a prefill worker as admission would; else the decode worker prefills
        ``prompt_len`` tokens (prompt + tokens sent) itself. ``NoRoute``: why no worker took it."""
        self.ledger.release(job)
        await self.admission.notify()  # its old claim no longer counts
        job.prompt_len = prompt_len
        live = [w for w in self.registry if w.state in (State.READY, State.LOADING) and w.worker_id != avoid]
        # No decoding worker left that could hold it: fail now rather than wait.
        if not any(w.role.decodes for w in live):
            return NoRoute(
                "no other decode or colocated worker is left to take the request over", "none_left"
            )
        if not can_ever_serve(live, max(prompt_len, job.total_tokens - 1)):
            n = max(prompt_len, job.total_tokens)
            return NoRoute(
                f"no other decode or colocated worker has KV cache for its {n} tokens", "none_left"
            )
        routing = self.routing if remote else RoutingConfig(local_prefill_threshold=_ALWAYS_LOCAL)

        # No prefill queue bound here: an admitted request is not refused later.
        def try_route() -> Route | None:
            ready = [w for w in self.registry.ready() if w.worker_id != avoid]
            route = choose_route(
                ready, prompt_len, routing, job.total_tokens, job.one_token and remote, job.probe
            )
            if route is not None:
                self.ledger.claim(job, route)
                self.metrics.routed(route)
            return route

        try:
            route = await self.admission.wait_for_route(try_route, max(wait_s, 0.0))
        except QueueFullError as e:
            return NoRoute(str(e), "queue_full")
        except AdmissionClosed:
            return NoRoute("the router is shutting down", "closing")
        return (
            route
            if route is not None
            else NoRoute(f"no healthy worker had room within {wait_s:.3g}s", "no_room")
        )

    async def release(self, job: Job) -> None:
        """The job no longer uses its workers (its decode stream ended, though its client may still be
        reading): its claims go to requests waiting for room. Idempotent."""
        self.ledger.release(job)
        await self.admission.notify()

    async def finish(self, job: Job) -> None:
        self.inflight_ids.discard(job.request_id)
        await self.release(job)

    # RouterOps: what the relay tells the router.
    def release_prefill(self, job: Job) -> None:
        self.ledger.release_prefill(job)

    def grow(self, job: Job, seq_len: int) -> None:
        self.ledger.grow(job, seq_len)

    def worker_full(self, w: Worker) -> None:
        self.membership.worker_full(w)

    def move_target(self, job: Job, avoid: Worker, seq_len: int) -> Route | None:
        ready = [w for w in self.registry.ready() if w.worker_id != avoid.worker_id]
        routing = RoutingConfig(local_prefill_threshold=_ALWAYS_LOCAL, policy=self.routing.policy)
        return choose_route(ready, seq_len, routing, job.total_tokens, False, job.probe)

    def moved(self, job: Job, route: Route, seq_len: int) -> None:
        self.ledger.move(job, route, seq_len)

    def worker_failed(self, w: Worker, dead: bool, reason: str) -> None:
        self.membership.worker_failed(w, dead, reason)


# Prompts up to this many characters are tokenized inline: too short to hold the event loop up.
_INLINE_PREPARE_CHARS = 4096


def _input_chars(request) -> int:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return len(request.prompt)
    if kind == "messages":  # (each message is rendered by the template: its role and markup count too)
        return sum(len(m.content) + len(m.role) + 16 for m in request.messages.messages)
    return 0


async def generate(router: Router, request, write: Write, time_remaining: float | None) -> None:
    """Run one ``GenerateRequest`` to its end: the request path every front shares.

    gRPC ``Generate`` and the OpenAI HTTP front (``router.openai.server``) both
    call this, so validation, admission, the ledger, metrics and cancellation
    are the same whatever the client speaks. ``write`` gets every response
    message; ``time_remaining`` is the client's deadline in seconds (None: the
    router's default). Ends normally after the finishing message; raises
    RelayError for every error status; a cancel of the calling task (client
    gone) propagates after the worker calls are cancelled.
    """
    arrival = time.monotonic()  # TTFT and e2e latency count from here
    try:
        job, prep, deadline = await _admit(router, request, time_remaining, arrival)
    except RelayError as e:
        if e.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            router.metrics.finished("abort")  # its deadline passed in the queue: not a refusal
        else:
            router.metrics.rejected(e.code.name)
        raise
    except asyncio.CancelledError:
        router.metrics.finished("abort")  # the client left while its request queued
        raise
    relay = router.relay
    assert relay is not None
    try:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        deadline_unix = 0.0 if timeout is None else time.time() + timeout
        await relay.run(job, prep, write, timeout, deadline_unix)
    except asyncio.CancelledError as e:
        # The sweep failed the job by cancelling its worker calls: report why, not a cancel.
        if (failed := worker_failure(job, e)) is not None:
            raise failed from None
        raise
    finally:
        await router.finish(job)  # every exit path: the route is released and waiting requests woken


async def _admit(
    router: Router, request, time_remaining: float | None, arrival: float
) -> tuple[Job, Prepared, float | None]:
    """Validate, tokenize and admit: (the admitted job, its prepared request, its monotonic deadline).

    Raises RelayError for a request refused before it could run (counted as
    "rejected" by the caller); the job is finished here if admission fails.
    """
    tokenizer, relay = router.tokenizer, router.relay
    if router.closing or tokenizer is None or relay is None:
        state = "shutting down" if router.closing else "starting"
        raise RelayError(grpc.StatusCode.UNAVAILABLE, f"the router is {state}")
    limits = router.current_limits()
    if limits.context_length <= 0:
        raise RelayError(grpc.StatusCode.UNAVAILABLE, "the model's context length is not known yet")
    try:
        if _input_chars(request) > _INLINE_PREPARE_CHARS:
            # Long texts tokenize off the event loop, which relays every other request's tokens.
            prep = await asyncio.to_thread(prepare, request, tokenizer, limits)
        else:
            prep = prepare(request, tokenizer, limits)
    except InvalidRequest as e:
        raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    remaining = time_remaining
    if remaining is None and router.config.request_timeout_s > 0:
        remaining = router.config.request_timeout_s
    deadline = None if remaining is None else time.monotonic() + remaining
    if prep.request_id in router.inflight_ids:
        # Workers key a request's blocks and stream by its id: a second one would take over the first's.
        raise RelayError(
            grpc.StatusCode.INVALID_ARGUMENT, f"request_id {prep.request_id!r} is already in flight"
        )
    job = Job(prep.request_id, len(prep.prompt_token_ids), arrival)
    job.probe = PromptProbe(router.kv_index, prep.prompt_token_ids)
    router.inflight_ids.add(job.request_id)
    try:
        await router.admit(job, remaining, prep.params.max_tokens, prep.params.n)
    except BaseException:
        await router.finish(job)
        raise
    return job, prep, deadline


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        async def write(resp: generation_pb2.GenerateResponse) -> None:
            try:
                await context.write(resp)
            except Exception as e:
                # A client that cancels (or whose deadline passes) while a write waits on flow control:
                # grpc.aio raises its internal ExecuteBatchError, not a cancel, often before the context
                # knows the call ended. The client went away: an abort, not a server error.
                if context.cancelled() or context.done() or is_batch_error(e):
                    raise ClientGone from e
                raise

        try:
            await generate(self._router, request, write, context.time_remaining())
        except RelayError as e:
            if e.retry_after_s:  # gRPC's server pushback: when the refused request would fit
                context.set_trailing_metadata((("grpc-retry-pushback-ms", str(e.retry_after_s * 1000)),))
            try:
                await context.abort(e.code, e.details)
            except Exception as exc:
                # The call ended on its own meanwhile (its deadline, a cancel): the status cannot be sent
                # and nobody waits for it.
                if is_batch_error(exc):
                    return
                raise
