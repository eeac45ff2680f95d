"""A decode worker without a model, for router benchmarks: ``python -m benchmarks.fake_decode_worker``.

It serves ``Worker.Generate`` in local prefill mode (what the router calls for a short prompt on a decode
worker, or any prompt on a colocated one), streaming ``max_tokens`` tokens, one per message as the engine
sends them, as fast as the stream takes them; it registers with every ``--router`` and heartbeats READY at
the interval each one answers, until SIGTERM. Its messages are built once per output length, so the
worker's own cost per token stays small beside the router's it is there to load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

import grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc

log = logging.getLogger("fake_decode_worker")
ROLES = {"decode": worker_pb2.ROLE_DECODE, "both": worker_pb2.ROLE_BOTH}
DEFAULT_MAX_TOKENS = 16
REGISTER_TIMEOUT_S = 60.0
# Large enough that neither ever holds a request back: the router admits on the claims it counts itself.
KV_BLOCKS = 1 << 24
BLOCK_SIZE = 16


class FakeDecodeWorker(worker_pb2_grpc.WorkerServicer):
    """Streams a fixed token cycle; counts the streams it runs for its heartbeats."""

    def __init__(self, worker_id: str, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        self.worker_id = worker_id
        self.token_ids = list(token_ids)
        self.running = 0
        self._messages: dict[int, list[worker_pb2.WorkerGenerateResponse]] = {}

    def messages(self, n: int) -> list[worker_pb2.WorkerGenerateResponse]:
        """Output tokens 0..n-1, the last with finish "length" (built once per n, shared by every stream)."""
        cached = self._messages.get(n)
        if cached is None:
            ids = self.token_ids
            cached = [
                worker_pb2.WorkerGenerateResponse(
                    first_index=i, token_ids=[ids[i % len(ids)]], finish_reason="length" if i == n - 1 else ""
                )
                for i in range(n)
            ]
            self._messages[n] = cached
        return cached

    async def Generate(self, request, context):
        if request.mode == worker_pb2.PREFILL_MODE_REMOTE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "mode: this worker prefills locally only")
        n = request.output_offset + (
            request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        )
        self.running += 1
        try:
            for m in self.messages(n)[request.output_offset :]:
                await context.write(m)
        finally:
            self.running -= 1

    async def GetLoad(self, request, context):
        return self.load()

    def load(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id,
            state=worker_pb2.WORKER_STATE_READY,
            running=self.running,
            kv_blocks_total=KV_BLOCKS,
        )


async def keep_registered(
    router: str,
    info: worker_pb2.WorkerInfo,
    worker: FakeDecodeWorker,
    registered: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    """Register with one router (then set ``registered``), then heartbeat at the interval it answers
    (registering again when it forgot this worker) until ``stop``; deregister on the way out."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = worker_pb2_grpc.RegistryStub(channel)
        interval = await _register(stub, info, router)
        registered.set()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                break
            try:
                beat = await stub.Heartbeat(worker.load(), timeout=5.0)
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to %s failed: %s", router, e.code().name)
                continue
            if not beat.known:
                interval = await _register(stub, info, router)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Deregister(info, timeout=2.0)


async def _register(stub: worker_pb2_grpc.RegistryStub, info: worker_pb2.WorkerInfo, router: str) -> float:
    """The heartbeat interval the router answers; retried (bounded) while it is not up yet."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + REGISTER_TIMEOUT_S
    while True:
        try:
            resp = await stub.Register(info, timeout=5.0)
            return resp.heartbeat_interval_s or 0.5
        except grpc.aio.AioRpcError as e:
            if e.code() is not grpc.StatusCode.UNAVAILABLE or loop.time() > give_up:
                raise RuntimeError(
                    f"cannot register with router {router}: {e.code().name} {e.details()}"
                ) from e
        await asyncio.sleep(0.1)


async def serve(args: argparse.Namespace) -> None:
    worker = FakeDecodeWorker(args.worker_id, args.token_ids)
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    address = f"{args.host}:{port}"
    info = worker_pb2.WorkerInfo(
        worker_id=args.worker_id,
        role=ROLES[args.role],
        address=address,
        model="fake",
        kv_blocks_total=KV_BLOCKS,
        block_size=BLOCK_SIZE,
        max_running=args.max_running,
        pid=os.getpid(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registered = [asyncio.Event() for _ in args.routers]
    tasks = [
        asyncio.create_task(keep_registered(r, info, worker, ok, stop))
        for r, ok in zip(args.routers, registered, strict=True)
    ]
    try:
        # Up once every router took the registration; a task that failed first ends the process with its
        # error.
        all_in = asyncio.create_task(asyncio.wait([asyncio.create_task(e.wait()) for e in registered]))
        await asyncio.wait([all_in, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done():
                t.result()
        if not all_in.done():
            all_in.cancel()
        print(f"READY {address}", flush=True)
        await stop.wait()
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fake_decode_worker", description=__doc__.splitlines()[0]
    )
    p.add_argument("--routers", required=True, help="comma-separated router addresses to register with")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--token-ids", required=True, help="comma-separated ids streamed in turn")
    p.add_argument("--role", choices=tuple(ROLES), default="decode")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--max-running", type=int, default=4096, help="streams the router may run here at once")
    args = p.parse_args(argv)
    args.routers = [r for r in args.routers.split(",") if r]
    args.token_ids = [int(t) for t in args.token_ids.split(",") if t]
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    import uvloop

    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
