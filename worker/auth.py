"""The cluster token: a shared secret the router requires of every caller of its control plane, and every
worker of every caller of its Worker service (token files, call metadata, the interceptor). No token
configured: everything is open."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Callable, Collection
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# Plain gRPC metadata: beyond loopback, pair the token with TLS so it cannot be read off the wire.
TOKEN_METADATA_KEY = "pdserve-cluster-token"
MIN_TOKEN_CHARS = 16


class TokenError(ValueError):
    """A token file that cannot be used; the message says why."""


def read_token_file(path: str | Path) -> str:
    path = Path(path)
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise TokenError(f"cannot read the cluster token file {path}: {e.strerror}") from e
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
        raise TokenError(
            f"the cluster token in {path} must be at least {MIN_TOKEN_CHARS} printable ASCII characters"
        )
    if path.stat().st_mode & 0o077:
        log.warning("cluster token file %s is readable by other users (chmod 600 it)", path)
    return token


def write_new_token(path: str | Path) -> Path:
    """A new random token in a file only its owner can read; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata proving ``token`` (none when no token is configured)."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses calls to ``services`` that do not carry the token: UNAUTHENTICATED, logged, counted."""

    def __init__(self, token: str, services: Collection[str], on_refused: Callable[[str], None]) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenError(f"a cluster token must have at least {MIN_TOKEN_CHARS} characters")
        self._token = token.encode()
        self._services = frozenset(services)
        self._on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.split("/")[1] not in self._services:
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        sent_bytes = sent if isinstance(sent, bytes) else sent.encode()
        if hmac.compare_digest(sent_bytes, self._token):
            return handler
        reason = "no cluster token" if not sent else "a wrong cluster token"
        log.warning("refused %s: %s", method, reason)
        self._on_refused(method)
        text = f"{method}: {reason}"

        # The refusal takes the method's shape, and the request's bytes are never parsed.
        if handler.unary_stream is not None:

            async def refuse_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, text)
                yield  # an async generator, as a streaming handler is

            return grpc.unary_stream_rpc_method_handler(refuse_stream)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, text)

        return grpc.unary_unary_rpc_method_handler(refuse)


AUTH_REFUSED = "pdserve_auth_refused_total"


def refusal_counter(registry, role: str) -> Callable[[str], None]:
    """``pdserve_auth_refused_total{role,method}`` in ``registry``; returns what counts one refusal."""
    from prometheus_client import Counter

    counter = Counter(
        AUTH_REFUSED,
        "Calls refused for a missing or wrong cluster token, by method.",
        ["role", "method"],
        registry=registry,
    )
    return lambda method: counter.labels(role, method).inc()
