"""One benchmark request over gRPC: the ``GenerateRequest`` a sample becomes, and its timed stream.

Each token-bearing message is stamped on arrival with the caller's clock; the
request's outcome (OK, gRPC status, "abort" finish, timeout) ends up in the
record's ``error`` and is never raised, so one broken request cannot end a run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import RequestRecord
from pdserve.proto import generation_pb2, generation_pb2_grpc


def to_proto(
    sample: SampleRequest, request_id: str, temperature: float | None
) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams()
    if sample.output_len is not None:
        sampling.max_tokens = sample.output_len
    if sample.ignore_eos:
        sampling.ignore_eos = True
    if temperature is not None:
        sampling.temperature = temperature
    req = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if sample.prompt_token_ids is not None:
        req.prompt_token_ids.ids.extend(sample.prompt_token_ids)
    elif sample.prompt is not None:
        req.prompt = sample.prompt
    elif sample.messages is not None:
        req.messages.messages.extend(
            generation_pb2.ChatMessage(role=r, content=c) for r, c in sample.messages
        )
    else:
        raise ValueError("a sample request has no input")
    return req


def _completion_error(finish_reason: str, token_counts: Sequence[int]) -> str | None:
    """Why a stream that ended with an OK status still did not complete, or None."""
    if not finish_reason:
        return "stream ended without a finish_reason"
    if finish_reason == "abort":
        return "aborted by the server (finish_reason abort)"
    if not token_counts:
        return f"finished ({finish_reason}) without any token"
    return None


async def stream_request(
    stub: generation_pb2_grpc.GenerationStub,
    request: generation_pb2.GenerateRequest,
    *,
    index: int,
    scheduled_time: float,
    prompt_len: int | None,
    timeout_s: float,
    clock: Callable[[], float],
) -> RequestRecord:
    """Send one request and time its stream. Every failure ends up in the record's ``error``."""
    times: list[float] = []
    counts: list[int] = []
    finish = ""
    prompt_tokens = prompt_len or 0
    error: str | None = None
    start = clock()
    # The deadline also travels to the router, so it drops the request on its side too.
    call = stub.Generate(request, timeout=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            async for msg in call:
                now = clock()
                if msg.token_ids:
                    times.append(now)
                    counts.append(len(msg.token_ids))
                if msg.finish_reason:
                    finish = msg.finish_reason
                if msg.HasField("usage"):
                    prompt_tokens = msg.usage.prompt_tokens  # the server's count is authoritative
    except TimeoutError:
        call.cancel()
        error = f"timeout: stream not finished after {timeout_s:g} s (cancelled)"
    except asyncio.CancelledError:
        call.cancel()  # the run is being torn down: do not leave the stream open on the router
        raise
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
        error = f"{code.name}: {e.details()}" if code is not None else f"RPC error: {e}"
    except Exception as e:  # one broken request must not end the run: it is recorded
        error = f"{type(e).__name__}: {e}"
    end = clock()
    if error is None:
        error = _completion_error(finish, counts)
    return RequestRecord(
        index=index,
        scheduled_time=scheduled_time,
        start_time=start,
        end_time=end,
        token_times=tuple(times),
        token_counts=tuple(counts),
        prompt_tokens=prompt_tokens,
        error=error,
        finish_reason=finish,
        request_id=request.request_id,
    )
