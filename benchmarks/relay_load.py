"""The load of ``benchmarks.relay_capacity``, as its own process: ``python -m benchmarks.relay_load``.

``--streams`` concurrent streams against one router front (``grpc``: ``pdserve.v1.Generation/Generate``;
``http``: streaming ``/v1/completions``), each asking for ``--max-tokens`` tokens with EOS ignored, again
as soon as one ends. Once imported it prints ``READY`` and reads the window from stdin, ``START END`` on
CLOCK_MONOTONIC (which every process of the machine shares); it streams from then until END and counts the
tokens received between START and END; the result is one JSON line on stdout. A token is counted as it
arrives: one per token id on gRPC, one per server-sent text event on HTTP (the benchmark streams tokens
that each decode to text, so each gets its event; ``usage`` checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp
import grpc

from pdserve.proto import generation_pb2, generation_pb2_grpc

STREAMS_PER_CHANNEL = 64  # gRPC: streams sharing one connection, as many clients behind one proxy would
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Counts:
    tokens: int = 0  # every token received, window or not
    window_start_tokens: int = 0
    window_end_tokens: int = 0
    requests_done: int = 0
    errors: int = 0
    # HTTP: finished requests whose usage came, and those whose text events did not match its
    # completion_tokens.
    usage_checked: int = 0
    usage_mismatches: int = 0
    first_error: str = ""
    late: bool = False  # started after the window began (its count would miss the window's start)

    def error(self, what: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = what[:300]


def _sampling(max_tokens: int) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def grpc_stream(stub, prompt: Sequence[int], max_tokens: int, counts: Counts, end: float) -> None:
    req = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt), sampling=_sampling(max_tokens)
    )
    while time.monotonic() < end:
        try:
            async for m in stub.Generate(req, timeout=REQUEST_TIMEOUT_S):
                counts.tokens += len(m.token_ids)
            counts.requests_done += 1
        except grpc.aio.AioRpcError as e:
            counts.error(f"{e.code().name}: {e.details()}")
            await asyncio.sleep(0.05)  # (a refused request is not retried in a tight loop)


async def http_stream(session, url: str, body: bytes, counts: Counts, end: float) -> None:
    headers = {"Content-Type": "application/json"}
    while time.monotonic() < end:
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    counts.error(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    await asyncio.sleep(0.05)
                    continue
                events = 0
                usage = None
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if b'"choices":[]' in line:  # the usage chunk (stream_options.include_usage)
                        usage = json.loads(line[6:])["usage"]["completion_tokens"]
                        continue
                    events += 1
                    counts.tokens += 1
                counts.requests_done += 1
                if usage is not None:
                    counts.usage_checked += 1
                    counts.usage_mismatches += usage != events
        except (TimeoutError, OSError, aiohttp.ClientError) as e:
            counts.error(repr(e))
            await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> Counts:
    counts = Counts()
    loop = asyncio.get_running_loop()
    now_mono, now_loop = time.monotonic(), loop.time()
    counts.late = now_mono >= args.start

    def snap(field: str) -> None:
        setattr(counts, field, counts.tokens)

    # (the loop's clock is CLOCK_MONOTONIC too; the offset only guards against another loop clock)
    loop.call_at(now_loop + args.start - now_mono, snap, "window_start_tokens")
    loop.call_at(now_loop + args.end - now_mono, snap, "window_end_tokens")
    async with contextlib.AsyncExitStack() as stack:
        if args.front == "grpc":
            stubs = []
            for _ in range(-(-args.streams // STREAMS_PER_CHANNEL)):
                ch = grpc.aio.insecure_channel(args.target, options=(("grpc.use_local_subchannel_pool", 1),))
                await stack.enter_async_context(ch)
                stubs.append(generation_pb2_grpc.GenerationStub(ch))
            coros = [
                grpc_stream(
                    stubs[i // STREAMS_PER_CHANNEL], args.prompt_ids, args.max_tokens, counts, args.end
                )
                for i in range(args.streams)
            ]
        else:
            session = await stack.enter_async_context(
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                )
            )
            body = json.dumps(
                {
                    "prompt": args.prompt_ids,
                    "max_tokens": args.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            url = f"{args.target.rstrip('/')}/v1/completions"
            coros = [http_stream(session, url, body, counts, args.end) for _ in range(args.streams)]
        tasks = [asyncio.ensure_future(c) for c in coros]
        # Streams still open at the end are cut there (their tokens so far counted): the next case does
        # not wait for a backlog to drain.
        await asyncio.wait(tasks, timeout=max(args.end - time.monotonic(), 0.0) + 0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.relay_load", description=__doc__.splitlines()[0])
    p.add_argument("--front", choices=("grpc", "http"), required=True)
    p.add_argument("--target", required=True, help="gRPC host:port, or the HTTP front's base URL")
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    args = p.parse_args(argv)
    args.prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t]
    if args.streams < 1:
        p.error("--streams >= 1")
    print("READY", flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2:
        p.error("stdin: expected START END (time.monotonic() seconds)")
    args.start, args.end = float(line[0]), float(line[1])
    import uvloop

    counts = uvloop.run(run(args))
    doc = asdict(counts)
    doc["window_tokens"] = counts.window_end_tokens - counts.window_start_tokens
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
