"""A worker process killed mid-stream fails its request and leaves the router's registry."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import generation_pb2 as g
from pdserve.proto import generation_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer
from pdserve.router.validate import ModelLimits
from tests.fake_workers import FakeWorker, make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("router-model"))


def run(coro, timeout: float = 60.0):
    """Each test is one event loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll a router-side condition (bounded; a failure bound, not a latency check)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def request(prompt: str = "hello world", **sampling) -> g.GenerateRequest:
    return g.GenerateRequest(prompt=prompt, sampling=g.SamplingParams(**sampling))


@contextlib.asynccontextmanager
async def cluster(model_dir: Path, workers: list[FakeWorker], *, frontend: bool = True, **cfg):
    cfg.setdefault("heartbeat_interval_s", 0.05)
    cfg.setdefault("heartbeat_timeout_s", 5.0)
    server = RouterServer(RouterConfig(port=0, **cfg))
    await server.start()
    if frontend:
        await server.set_frontend(Tokenizer.from_dir(model_dir), ModelLimits.from_model_dir(model_dir))
    channel = grpc.aio.insecure_channel(server.address)
    started: list[FakeWorker] = []
    try:
        for w in workers:
            await w.start(server.address)
            started.append(w)
        yield server, generation_pb2_grpc.GenerationStub(channel)
        router = server.router
        # The leak check: every exit path released its route.
        await until(lambda: not router.ledger.jobs, what="requests to leave the ledger")
        assert all(
            w.assigned == 0 and w.assigned_prefill_tokens == 0 and w.assigned_kv_blocks == 0
            for w in router.registry
        )
        assert router.admission.waiting == 0
        assert router.relay.read_ahead.used == 0  # every message read ahead was delivered or given back
    finally:
        await channel.close()
        for w in started:
            await w.stop()
        await server.stop(grace_s=0)


async def collect(call) -> tuple[list[int], str, list[g.GenerateResponse]]:
    msgs = []
    while (m := await call.read()) is not grpc.aio.EOF:
        msgs.append(m)
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


async def expect_error(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(call)
    assert info.value.code() == code, info.value
    return info.value.details()


def test_worker_killed_mid_stream_fails_the_request_and_leaves_the_registry(model_dir):
    async def main():
        async with cluster(model_dir, []) as (server, stub):
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdserve.cli",
                    "worker",
                    "--role",
                    "both",
                    "--router",
                    server.address,
                    "--worker-id",
                    "k1",
                    "--threads",
                    "1",
                    "--worker-module",
                    "tests.fake_workers",
                ],
                cwd=Path(__file__).resolve().parents[2],
                start_new_session=True,
            )
            try:
                reg = server.router.registry
                await until(lambda: reg.get("k1") is not None and reg.ready(), 30, "the worker to register")
                hold = request(max_tokens=4)
                hold.request_id = "hold-1"  # the fake stops after output 0 until it drains
                call = stub.Generate(hold)
                assert (await call.read()).text == " hello"
                os.kill(proc.pid, signal.SIGKILL)
                details = await expect_error(call, grpc.StatusCode.UNAVAILABLE)
                assert "k1" in details
                assert reg.get("k1") is None  # marked dead at once, not at heartbeat expiry
                await expect_error(stub.Generate(request()), grpc.StatusCode.UNAVAILABLE)
            finally:
                proc.kill()
                proc.wait(timeout=10)

    run(main())
