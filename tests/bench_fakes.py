"""Shared by the ``pdserve bench`` tests: an in-process fake ``Generation`` server and an independent
recomputation of a run's figures from its saved per-request timestamps.

The fake streams ``max_tokens`` tokens (4 when unset) after a message with no
tokens: one token in the first token-bearing message, then chunks of 1, 2, 3, ...
with a short sleep before each message. Its fate is fixed by the request, so a
test predicts it from the seeded plan: a token prompt starting with an id
``% 5 == 0`` fails with UNAVAILABLE after its first token, ``% 5 == 1`` finishes
with "abort"; the text prompt "fail" fails the same way and "hang" never answers.
The server runs on its own event loop in a thread, so ``main()`` (which runs its
own loop) can be tested too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc
import numpy as np

from pdserve.bench.datasets import TokenSpace
from pdserve.proto import generation_pb2 as g
from pdserve.proto import generation_pb2_grpc

CHUNKS = (1, 2, 3)
SPACE = TokenSpace(vocab_size=500, excluded_ids=frozenset({0, 1, 2}))
STEP_S = 0.002
VLLM_KEYS = [
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "slo_attainment",
] + [
    f"{s}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "median", "std", "p50", "p90", "p99")
]
RECORD_KEYS = {
    "ttft_ms",
    "itl_ms",
    "e2el_ms",
    "prompt_tokens",
    "output_tokens",
    "error",
    "start_time",
    "token_times",
}


def fate(req: g.GenerateRequest) -> str:
    kind = req.WhichOneof("input")
    if kind == "prompt_token_ids":
        return {0: "fail", 1: "abort"}.get(req.prompt_token_ids.ids[0] % 5, "ok")
    if kind == "prompt" and req.prompt in ("fail", "hang"):
        return req.prompt
    return "ok"


def chunk_sizes(n: int) -> list[int]:
    sizes, i = [1], 0
    while sum(sizes) < n:
        sizes.append(min(CHUNKS[i % len(CHUNKS)], n - sum(sizes)))
        i += 1
    return sizes[:n]


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.received: list[g.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()

    async def Generate(self, request, context):  # noqa: N802 - the gRPC method name
        self.received.append(request)
        mode = fate(request)
        s = request.sampling
        n = s.max_tokens if s.HasField("max_tokens") else 4
        kind = request.WhichOneof("input")
        if kind == "prompt_token_ids":
            prompt_tokens = len(request.prompt_token_ids.ids)
        elif kind == "prompt":
            prompt_tokens = len(request.prompt.split())
        else:
            prompt_tokens = sum(len(m.content.split()) for m in request.messages.messages)
        try:
            if mode == "hang":
                await asyncio.sleep(60)  # the client's timeout cancels it long before
            await asyncio.sleep(STEP_S)
            yield g.GenerateResponse(request_id=request.request_id)  # no tokens: must not count as the first
            sent = 0
            for j, k in enumerate(chunk_sizes(n)):
                if mode == "fail" and j == 1:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake: decode worker died")
                await asyncio.sleep(STEP_S)
                sent += k
                last = sent == n
                yield g.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=list(range(sent - k, sent)),
                    text="x" * k,
                    finish_reason=("abort" if mode == "abort" else "length") if last else "",
                    usage=g.Usage(prompt_tokens=prompt_tokens, completion_tokens=n) if last else None,
                )
            if mode == "fail":  # one-token requests fail after their only token
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake: decode worker died")
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            self.cancel_seen.set()
            raise


@contextlib.contextmanager
def fake_router(servicer: FakeGeneration) -> Iterator[str]:
    """Serve ``servicer`` on 127.0.0.1 from a thread with its own event loop; yields the address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-router", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server = None
    try:
        server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        yield f"127.0.0.1:{port}"
    finally:
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def recompute_figures(records: list[dict], slo: dict[str, float]) -> dict:
    """The aggregate figures from the per-request timestamps alone, independently of bench.metrics."""
    ttft, tpot, itl, e2el, good = [], [], [], [], 0
    for r in records:
        if r["error"] is not None:
            continue
        times, counts = r["token_times"], r["token_counts"]
        t_first = times[0] - r["start_time"]
        total = r["end_time"] - r["start_time"]
        gaps = [(b - a) / k for a, b, k in zip(times, times[1:], counts[1:], strict=False) for _ in range(k)]
        n_out = sum(counts)
        per_token = (total - t_first) / (n_out - 1) if n_out > 1 else None
        ttft.append(t_first * 1e3)
        e2el.append(total * 1e3)
        itl.extend(x * 1e3 for x in gaps)
        if per_token is not None:
            tpot.append(per_token * 1e3)
        measured = {"ttft": t_first * 1e3, "tpot": (per_token or 0.0) * 1e3, "e2el": total * 1e3}
        good += all(measured[k] <= v for k, v in slo.items())
    ok = [r for r in records if r["error"] is None]
    duration = max(r["end_time"] for r in records)
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": sum(r["prompt_tokens"] for r in ok),
        "total_output_tokens": sum(sum(r["token_counts"]) for r in ok),
        "duration": duration,
        "request_goodput": good / duration,
        "slo_attainment": good / len(records),
    }
    out["request_throughput"] = out["completed"] / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out[f"mean_{name}_ms"] = float(np.mean(xs))
        out[f"median_{name}_ms"] = float(np.median(xs))
        out[f"std_{name}_ms"] = float(np.std(xs))
        for p in (50, 90, 99):
            out[f"p{p}_{name}_ms"] = float(np.percentile(xs, p))
    return out
