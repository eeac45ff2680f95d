"""The router's OpenAI-compatible HTTP front (aiohttp, on the router's own event loop).

``/v1/completions`` and ``/v1/chat/completions`` (server-sent events or one JSON body), ``/v1/models``,
and what vLLM-compatible servers offer beside them: ``/tokenize``, ``/detokenize``, ``/metrics``,
``/version``, ``/health``. Generation runs the gRPC front's request path; fields and errors: docs/openai.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.logprobs import ResponseOptions
from pdserve.router.openai.mapping import (
    Collected,
    EventStream,
    Kind,
    chat_request,
    check_model,
    client_field_names,
    completion_request,
    response_options,
    sse_error,
)
from pdserve.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    VersionInfo,
    decode_request,
    encode,
    error_from_status,
    invalid,
)
from pdserve.router.openai.tokenize import detokenize, tokenize
from pdserve.router.openai.tools import tool_plan
from pdserve.router.relay import RelayError
from pdserve.router.service import Router, generate
from pdserve.router.validate import InvalidRequest, check_request_id
from pdserve.telemetry.exporter import pdserve_version
from pdserve.worker.address import host_port
from pdserve.worker.role import Role
from pdserve.worker.tls import NO_TLS, TLSConfig

log = logging.getLogger(__name__)

# Chat histories can be long; the default (1 MiB) is a web-form limit.
_MAX_BODY_BYTES = 64 << 20
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "X-Request-ID"
_BODY_LIMIT: web.AppKey[int] = web.AppKey("max_body_bytes", int)
_INLINE_TOKENIZE_BYTES = 4096  # as the request path's own threshold (service.py)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# HTTP status of a refusal -> the gRPC status the router counts it under (router.metrics.REJECT_CODES).
_REFUSAL_CODES = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


# A refusal for load (429: the router's queue is full; 503: no worker can take it now) says when to try
# again: OpenAI's client libraries wait that long before their retry (openai-python reads Retry-After),
# where without it they back off on their own schedule. A second: a queue moves on that scale.
RETRY_AFTER_S = 1


def _error_response(err: OpenAIError, headers: Mapping[str, str] | None = None) -> web.Response:
    if err.status in _REFUSAL_CODES:
        headers = {"Retry-After": str(err.retry_after_s or RETRY_AFTER_S), **(headers or {})}
    return web.Response(status=err.status, body=err.body(), content_type="application/json", headers=headers)


def _refusal(e: RelayError, req: CompletionRequest | ChatCompletionRequest) -> OpenAIError:
    """The HTTP error of a request the router ended, with its retry hint when it has one."""
    err = error_from_status(e.code.name, e.details, client_field_names(req))
    err.retry_after_s = e.retry_after_s
    return err


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error this server answers has OpenAI's body, unknown routes and crashes included."""
    try:
        return await handler(request)
    except OpenAIError as e:
        return _error_response(e)
    except web.HTTPRequestEntityTooLarge:
        # aiohttp's 413 while reading the body: a bounded input like the others, so 400 naming it.
        limit = request.app[_BODY_LIMIT]
        return _error_response(invalid(f"request body is over the limit of {limit} bytes", "body"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        err = OpenAIError(e.status, f"{e.reason}: {request.method} {request.path}", kind)
        # aiohttp's own headers that HTTP requires of the status (a 405's Allow), not its body's.
        keep = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        return _error_response(err, keep)
    except ConnectionResetError:
        raise  # the client went away: there is no one to answer
    except Exception:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return _error_response(OpenAIError(500, "internal server error", "server_error"))


def _request_id(request: web.Request, kind: Kind) -> str:
    """The client's ``X-Request-ID`` (checked as gRPC's ``request_id``; 400 naming the header) or a new id
    of OpenAI's form: the request's id end to end (the body's ``id``, the worker calls, the logs), echoed
    in the response's header."""
    sent = request.headers.get(REQUEST_ID_HEADER, "")
    try:
        check_request_id(sent, REQUEST_ID_HEADER)
    except InvalidRequest as e:
        raise invalid(str(e), REQUEST_ID_HEADER) from None
    return sent or kind.id_prefix + uuid.uuid4().hex


class OpenAIFront:
    """The HTTP server: ``start`` binds and serves, ``stop`` closes (after the router drained)."""

    max_body_bytes = _MAX_BODY_BYTES  # a larger body is refused with 400 naming ``body``

    def __init__(
        self, router: Router, host: str, port: int, model_name: str, tls: TLSConfig = NO_TLS
    ) -> None:
        self.router = router
        self.host, self.port = host, port
        self.tls = tls  # with a certificate: HTTPS (no client certificates)
        self.model_name = model_name
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls.serves else 'http'}://{host_port(self.host, self.port)}"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_openai_errors], client_max_size=self.max_body_bytes)
        app[_BODY_LIMIT] = self.max_body_bytes
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # a served model's name may be a path
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    async def start(self) -> str:
        """Bind (port 0 picks a free one) and serve. Returns the base URL."""
        # handler_cancellation: a closed connection cancels the handler's task and with it the request's
        # worker calls (which free its KV blocks), as a gRPC client's cancel does.
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            ssl_context = self.tls.ssl_context() if self.tls.serves else None
            site = web.TCPSite(runner, self.host, self.port, ssl_context=ssl_context)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("OpenAI HTTP API on %s/v1", self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- routes ---------------------------------------------------------------------------------------

    def _serving(self) -> None:
        """Raise 503 unless the router serves generation (as its gRPC health SERVING)."""
        router = self.router
        if router.closing or router.tokenizer is None:
            state = "shutting down" if router.closing else "starting"
            raise OpenAIError(503, f"the router is {state}", "service_unavailable_error")

    async def health(self, request: web.Request) -> web.Response:
        """200 while a request could be served now: the router serves and a worker that decodes is READY.

        503 while the router loads or stops, or while no decode or colocated worker is READY (prefill
        workers alone serve nothing). The body counts the READY workers by role.
        """
        self._serving()
        ready = {role.value: 0 for role in Role}
        for w in self.router.registry.ready():
            ready[w.role.value] += 1
        if not any(ready[r.value] for r in Role if r.decodes):
            raise OpenAIError(
                503, f"no decode or colocated worker is ready (ready: {ready})", "service_unavailable_error"
            )
        return web.json_response({"status": "ok", "ready_workers": ready})

    async def version(self, request: web.Request) -> web.Response:
        return web.Response(body=encode(VersionInfo(pdserve_version())), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's registry, as its metrics port serves it (OpenMetrics when the scraper asks)."""
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(self.router.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    def body_limit(self) -> int:
        """The largest body a request to this model can need: its text as JSON at 12 bytes a character
        (a character outside the BMP, escaped), and as many characters as the context holds tokens of the
        tokenizer's longest (``max_token_chars``); 64 bytes of JSON a message (each takes a token); 1 MiB
        for the rest. A larger body is refused before it is decoded: decoding holds the event loop, every
        stream waiting. ``max_body_bytes`` where there is no bound (a tokenizer that gives none), and never
        more."""
        if self.router is None or self.router.tokenizer is None:  # (None: a front tested alone)
            return self.max_body_bytes
        per_token, context = (
            self.router.tokenizer.max_token_chars,
            self.router.current_limits().context_length,
        )
        if not per_token or context <= 0:
            return self.max_body_bytes
        return min(self.max_body_bytes, context * (12 * per_token + 64) + (1 << 20))

    async def _read(self, request: web.Request, limit: int | None = None) -> bytes:
        """The body, refused (400 naming ``body``) over ``limit`` (default ``body_limit``) before it is
        read, when it says its length, or before it is decoded."""
        limit = self.body_limit() if limit is None else limit
        length = request.content_length
        if length is None or length <= limit:
            body = await request.read()
            length = len(body)
            if length <= limit:
                return body
        why = "" if limit == self.max_body_bytes else ": more than a request to this model can need"
        raise invalid(f"request body is {length} bytes, over the limit of {limit} bytes{why}", "body")

    async def tokenize(self, request: web.Request) -> web.Response:
        # Not bound by the context: counting a document's tokens is what /tokenize is for (vLLM's counts
        # any length too), and one long string decodes fast; its tokenizing runs off the loop (below).
        body = await self._read(request, self.max_body_bytes)
        req = decode_request(body, TokenizeRequest)
        check_model(req.model, self.model_name)
        self._serving()
        assert self.router.tokenizer is not None
        args = (req, self.router.tokenizer, self._max_model_len() or 0)
        # Long texts tokenize off the event loop, which relays every other request's tokens.
        if len(body) > _INLINE_TOKENIZE_BYTES:
            out = await asyncio.to_thread(tokenize, *args)
        else:
            out = tokenize(*args)
        return web.Response(body=encode(out), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        req = decode_request(await self._read(request), DetokenizeRequest)
        check_model(req.model, self.model_name)
        self._serving()
        assert self.router.tokenizer is not None
        args = (req, self.router.tokenizer, self.router.current_limits().vocab_size)
        if len(req.tokens) > _INLINE_TOKENIZE_BYTES:  # long lists decode off the event loop, as tokenize
            out = await asyncio.to_thread(detokenize, *args)
        else:
            out = detokenize(*args)
        return web.Response(body=encode(out), content_type="application/json")

    def _card(self) -> ModelCard:
        """``max_model_len``: the longest sequence a request can have now, as vLLM's (which never starts
        with a KV cache that cannot hold its max_model_len): the context, or the largest decode worker's
        KV cache where that holds less (clients size their prompts by it)."""
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self._max_model_len())

    def _max_model_len(self) -> int | None:
        limits = self.router.current_limits()
        known = [n for n in (limits.context_length, limits.kv_tokens) if n > 0]
        return min(known) if known else None

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=encode(ModelList([self._card()])), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the served model's card, or 404."""
        check_model(request.match_info["model"], self.model_name)
        return web.Response(body=encode(self._card()), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self._refusals_counted():
            req = decode_request(await self._read(request), CompletionRequest)
            check_model(req.model, self.model_name)
            rid = _request_id(request, Kind.COMPLETION)
            greq = completion_request(req, rid, self.router.current_limits().context_length)
        return await self._run(request, Kind.COMPLETION, rid, greq, req)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self._refusals_counted():
            req = decode_request(await self._read(request), ChatCompletionRequest)
            check_model(req.model, self.model_name)
            rid = _request_id(request, Kind.CHAT)
            greq = chat_request(req, rid)
        return await self._run(request, Kind.CHAT, rid, greq, req)

    @contextlib.contextmanager
    def _refusals_counted(self) -> Iterator[None]:
        """A generation request this front refuses before the router's own checks is counted as the
        router counts what it refuses (``pdserve_requests_rejected_total{code}``): the same bad request
        is the same figure over HTTP and gRPC."""
        try:
            yield
        except (OpenAIError, web.HTTPRequestEntityTooLarge) as e:
            if self.router is not None:  # (None: a front tested alone)
                self.router.metrics.rejected(_REFUSAL_CODES.get(e.status, "INVALID_ARGUMENT"))
            raise

    # ---- the request path -----------------------------------------------------------------------------

    async def _run(
        self,
        request: web.Request,
        kind: Kind,
        rid: str,
        greq: g.GenerateRequest,
        req: CompletionRequest | ChatCompletionRequest,
    ) -> web.StreamResponse:
        created = int(time.time())
        options = self._response_options(req)
        # (checked already, by ``chat_request``)
        tools = tool_plan(req.tools, req.tool_choice) if isinstance(req, ChatCompletionRequest) else None
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = EventStream(kind, rid, created, self.model_name, include_usage, options, tools)
            return await self._stream(request, greq, events, req)
        collected = Collected(kind, rid, created, self.model_name, options, tools)

        async def collect(msg: g.GenerateResponse) -> None:
            collected.feed(msg)

        try:
            await generate(self.router, greq, collect, None)
        except RelayError as e:
            raise _refusal(e, req) from None
        return web.Response(
            body=collected.response(), content_type="application/json", headers={REQUEST_ID_HEADER: rid}
        )

    def _response_options(self, req: CompletionRequest | ChatCompletionRequest) -> ResponseOptions | None:
        """Echo and logprobs, shown through the router's tokenizer (None: neither asked)."""
        tok = self.router.tokenizer
        if isinstance(req, CompletionRequest):
            asked = bool(req.echo) or req.logprobs is not None
        else:
            asked = bool(req.logprobs)
        if tok is None or not asked:
            return None

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=False)

        return response_options(req, lambda t: decode([t]), decode)

    async def _stream(
        self,
        request: web.Request,
        greq: g.GenerateRequest,
        events: EventStream,
        req: CompletionRequest | ChatCompletionRequest,
    ) -> web.StreamResponse:
        # The first thing that happens decides the HTTP status: the first message sends 200 and starts the
        # stream; an error before it is an error status with OpenAI's body; an error after it is an error
        # event, then the end of the stream.
        resp = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: events.id})

        async def write(msg: g.GenerateResponse) -> bool:
            data = events.feed(msg)
            if not data:
                return False  # its text is held back (a possible stop string): the client saw nothing
            if not resp.prepared:
                await resp.prepare(request)  # the status line goes out with the first token
            await resp.write(data)
            return True

        try:
            await generate(self.router, greq, write, None)
        except ConnectionResetError:
            # The client went away mid-stream (the request counts as aborted): nothing to answer, and
            # nothing for aiohttp to log as a server error.
            return resp
        except RelayError as e:
            err = _refusal(e, req)
            if not resp.prepared:
                raise err from None
            await resp.write(sse_error(err))
            await resp.write_eof()
            return resp
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(events.end())
        await resp.write_eof()
        return resp
