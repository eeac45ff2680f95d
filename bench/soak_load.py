"""The soak's workload: a seeded, mixed stream of requests over gRPC and the OpenAI front, with cancels.

``make_spec`` draws a request, ``run_grpc`` / ``run_openai`` stream it into one ``SoakRecord`` (nothing
raises), and ``Consistency`` checks every completion's length and that a pooled prompt always gives the same
tokens, so a stream migrated with a gap, a duplicate or other tokens shows.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import grpc

from pdserve.proto import generation_pb2, generation_pb2_grpc

# Ordinary vocabulary ids of SmolLM2 (its special tokens are the first ~17), as the e2e tests use.
TOKEN_RANGE = (100, 40000)


class Outcome(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"  # by this client, on purpose
    REFUSED = "refused"  # RESOURCE_EXHAUSTED / HTTP 429 before any token: the router may say no at once
    # Anything else (error, "abort" finish, timeout): with one worker killed at a time, a healthy worker of
    # every role was there to serve it.
    LOST = "lost"


class Front(StrEnum):
    GRPC = "grpc"
    OPENAI = "openai"


@dataclass(frozen=True)
class WorkloadMix:
    """Shares and length ranges of the soak's requests (lengths inclusive)."""

    short_prompt: tuple[int, int] = (16, 200)  # below the router's --local-prefill-threshold (256)
    long_prompt: tuple[int, int] = (300, 800)
    long_share: float = 0.4
    output_len: tuple[int, int] = (8, 64)
    cancel_share: float = 0.1
    openai_share: float = 0.2
    seeded_share: float = 0.5  # temperature 0.8 with a seed; the rest greedy
    pool_size: int = 12  # fixed prompts resent over the run
    pool_share: float = 0.3  # of gRPC requests without a cancel

    def __post_init__(self) -> None:
        for name in ("long_share", "cancel_share", "openai_share", "seeded_share", "pool_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("short_prompt", "long_prompt", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None  # None: greedy
    front: Front
    cancel_after: int | None = None  # cancel once this many tokens arrived; None: never
    cancel_delay_s: float | None = None  # cancel this long after sending, before any token
    pool_key: int | None = None  # requests of one key must give the same tokens


def _prompt(rng: random.Random, bounds: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(*bounds)))


def _prompt_len(rng: random.Random, mix: WorkloadMix) -> tuple[int, int]:
    return mix.long_prompt if rng.random() < mix.long_share else mix.short_prompt


def make_pool(seed: int, mix: WorkloadMix) -> list[tuple[tuple[int, ...], int, int | None]]:
    """The fixed prompts: (prompt, max_tokens, seed or None for greedy)."""
    rng = random.Random(f"pool-{seed}")
    return [
        (
            _prompt(rng, _prompt_len(rng, mix)),
            rng.randint(*mix.output_len),
            rng.randrange(1 << 30) if rng.random() < mix.seeded_share else None,
        )
        for _ in range(mix.pool_size)
    ]


def make_spec(
    rng: random.Random, index: int, mix: WorkloadMix, pool: list[tuple[tuple[int, ...], int, int | None]]
) -> RequestSpec:
    front = Front.OPENAI if rng.random() < mix.openai_share else Front.GRPC
    if rng.random() < mix.cancel_share:
        max_tokens = rng.randint(*mix.output_len)
        seed = rng.randrange(1 << 30) if rng.random() < mix.seeded_share else None
        prompt = _prompt(rng, _prompt_len(rng, mix))
        if rng.random() < 0.5:  # during prefill or the KV transfer
            return RequestSpec(index, prompt, max_tokens, seed, front, cancel_delay_s=rng.uniform(0.02, 0.6))
        return RequestSpec(index, prompt, max_tokens, seed, front, cancel_after=rng.randint(1, max_tokens))
    if front is Front.GRPC and rng.random() < mix.pool_share:
        key = rng.randrange(len(pool))
        prompt, max_tokens, seed = pool[key]
        return RequestSpec(index, prompt, max_tokens, seed, front, pool_key=key)
    seed = rng.randrange(1 << 30) if rng.random() < mix.seeded_share else None
    return RequestSpec(index, _prompt(rng, _prompt_len(rng, mix)), rng.randint(*mix.output_len), seed, front)


@dataclass
class SoakRecord:
    index: int
    request_id: str
    front: str
    prompt_len: int
    max_tokens: int
    seeded: bool
    start: float  # seconds since the soak started
    end: float = 0.0
    outcome: str = Outcome.LOST.value
    tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    pool_key: int | None = None
    planned_cancel: bool = False
    token_ids: list[int] = field(default_factory=list)  # pooled gRPC requests only

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["token_ids"]:
            del d["token_ids"]
        return d


def _sampling(spec: RequestSpec) -> dict[str, Any]:
    if spec.seed is None:
        return {"temperature": 0.0}
    return {"temperature": 0.8, "seed": spec.seed}


def _record(spec: RequestSpec, request_id: str, start: float) -> SoakRecord:
    return SoakRecord(
        index=spec.index,
        request_id=request_id,
        front=spec.front.value,
        prompt_len=len(spec.prompt),
        max_tokens=spec.max_tokens,
        seeded=spec.seed is not None,
        start=start,
        pool_key=spec.pool_key,
        planned_cancel=spec.cancel_after is not None or spec.cancel_delay_s is not None,
    )


def _finish(rec: SoakRecord, cancelled: bool, clock: Callable[[], float]) -> SoakRecord:
    rec.end = clock()
    if cancelled:
        rec.outcome = Outcome.CANCELLED.value
    elif not rec.error and rec.finish_reason in ("length", "stop"):
        rec.outcome = Outcome.COMPLETED.value
    elif not rec.error:
        rec.error = f"stream ended with finish_reason {rec.finish_reason!r}"
    return rec


async def run_grpc(
    stub: generation_pb2_grpc.GenerationStub,
    spec: RequestSpec,
    request_id: str,
    timeout_s: float,
    clock: Callable[[], float],
) -> SoakRecord:
    rec = _record(spec, request_id, clock())
    req = generation_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=generation_pb2.TokenIds(ids=spec.prompt)
    )
    req.sampling.max_tokens = spec.max_tokens
    req.sampling.ignore_eos = True
    for k, v in _sampling(spec).items():
        setattr(req.sampling, k, v)
    call = stub.Generate(req, timeout=timeout_s)
    cancelled = False

    def cancel() -> None:
        nonlocal cancelled
        if not call.done():
            cancelled = True
            call.cancel()

    timer = None
    if spec.cancel_delay_s is not None:
        timer = asyncio.get_running_loop().call_later(spec.cancel_delay_s, cancel)
    try:
        async with asyncio.timeout(timeout_s + 5):
            async for msg in call:
                rec.tokens += len(msg.token_ids)
                if spec.pool_key is not None:
                    rec.token_ids.extend(msg.token_ids)
                if msg.finish_reason:
                    rec.finish_reason = msg.finish_reason
                if (
                    spec.cancel_after is not None
                    and rec.tokens >= spec.cancel_after
                    and not msg.finish_reason
                ):
                    cancel()
                    break
    except asyncio.CancelledError:
        if not cancelled:  # the run itself is being torn down
            call.cancel()
            raise
    except TimeoutError:
        call.cancel()
        rec.error = f"timeout: not finished after {timeout_s:g} s"
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and rec.tokens == 0:
            rec.outcome = Outcome.REFUSED.value
        if not (cancelled and code == grpc.StatusCode.CANCELLED):
            rec.error = f"{code.name if code else 'RPC error'}: {e.details() if code else e}"
    finally:
        if timer is not None:
            timer.cancel()
    if rec.outcome == Outcome.REFUSED.value:
        rec.end = clock()
        return rec
    return _finish(rec, cancelled and not rec.error, clock)


async def run_openai(
    session: Any,  # aiohttp.ClientSession
    base_url: str,
    model: str,
    spec: RequestSpec,
    request_id: str,
    timeout_s: float,
    clock: Callable[[], float],
) -> SoakRecord:
    """One streamed ``/v1/completions``; a cancel closes the response (the router cancels the request)."""
    rec = _record(spec, request_id, clock())
    body = {
        "model": model,
        "prompt": list(spec.prompt),
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **_sampling(spec),
    }
    cancelled = False
    chunks = 0
    try:
        async with asyncio.timeout(spec.cancel_delay_s if spec.cancel_delay_s is not None else timeout_s):
            async with session.post(
                f"{base_url}/v1/completions", json=body, headers={"X-Request-ID": request_id}
            ) as resp:
                if resp.status == 429:
                    rec.outcome = Outcome.REFUSED.value
                    rec.error = f"HTTP 429: {(await resp.text())[:200]}"
                    rec.end = clock()
                    return rec
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return _finish(rec, False, clock)
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                        break
                    if chunk.get("usage"):
                        rec.tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    for choice in chunk.get("choices") or ():
                        chunks += 1
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                    if (
                        spec.cancel_after is not None
                        and chunks >= spec.cancel_after
                        and not rec.finish_reason
                    ):
                        cancelled = True
                        break  # leaving the block closes the connection
    except TimeoutError:
        if spec.cancel_delay_s is not None:
            cancelled = True
        else:
            rec.error = f"timeout: not finished after {timeout_s:g} s"
    except Exception as e:  # a broken connection is recorded, never raised
        rec.error = f"{type(e).__name__}: {e}"
    return _finish(rec, cancelled and not rec.error, clock)


@dataclass
class Consistency:
    """Completed requests have exactly ``max_tokens`` tokens; a pooled prompt always the same tokens."""

    first: dict[int, list[int]] = field(default_factory=dict)
    mismatched: list[dict[str, Any]] = field(default_factory=list)

    def check(self, rec: SoakRecord) -> None:
        if rec.outcome != Outcome.COMPLETED.value:
            return
        if rec.tokens != rec.max_tokens:
            self.mismatched.append(
                {"request_id": rec.request_id, "why": f"{rec.tokens} tokens, asked {rec.max_tokens}"}
            )
            return
        if rec.pool_key is None:
            return
        want = self.first.setdefault(rec.pool_key, rec.token_ids)
        if rec.token_ids != want:
            at = next((i for i, (a, b) in enumerate(zip(rec.token_ids, want, strict=True)) if a != b), -1)
            self.mismatched.append(
                {"request_id": rec.request_id, "why": f"pool prompt {rec.pool_key}: tokens differ at {at}"}
            )


def wall_clock() -> Callable[[], float]:
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0
