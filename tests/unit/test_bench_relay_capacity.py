"""benchmarks.relay_capacity without routers: the fake decode worker's stream and registration (in-process
gRPC), the load's split, and the figures it derives from the measured cases."""

from __future__ import annotations

import asyncio
import os

import grpc

from benchmarks import fake_decode_worker as fdw
from benchmarks import relay_capacity as rc
from pdserve.proto import generation_pb2, worker_pb2, worker_pb2_grpc

TIMEOUT_S = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def test_fake_worker_streams_max_tokens_one_per_message_then_length() -> None:
    async def go() -> tuple[list[worker_pb2.WorkerGenerateResponse], list[worker_pb2.WorkerGenerateResponse]]:
        worker = fdw.FakeDecodeWorker("w0", [7, 8, 9])
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                sampling = generation_pb2.SamplingParams(max_tokens=5, ignore_eos=True)
                req = worker_pb2.WorkerGenerateRequest(
                    request_id="r",
                    prompt_token_ids=[1, 2],
                    sampling=sampling,
                    mode=worker_pb2.PREFILL_MODE_LOCAL,
                )
                whole = [m async for m in stub.Generate(req)]
                req.output_offset, req.sampling.max_tokens = 3, 2  # a moved stream: 3 sent, 2 left
                moved = [m async for m in stub.Generate(req)]
            assert worker.running == 0
            return whole, moved
        finally:
            await server.stop(None)

    whole, moved = run(go())
    assert [list(m.token_ids) for m in whole] == [[7], [8], [9], [7], [8]]
    assert [m.first_index for m in whole] == [0, 1, 2, 3, 4]
    assert [m.finish_reason for m in whole] == ["", "", "", "", "length"]
    assert [(m.first_index, m.finish_reason) for m in moved] == [(3, ""), (4, "length")]


class FakeRegistry(worker_pb2_grpc.RegistryServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.beats = asyncio.Event()
        self.forget_once = True

    async def Register(self, info, context):
        assert info.kv_blocks_total >= 1 and info.block_size >= 1 and info.max_running >= 1
        self.calls.append(f"register {info.worker_id}")
        return worker_pb2.RegisterResponse(heartbeat_interval_s=0.01)

    async def Heartbeat(self, load, context):
        assert load.state == worker_pb2.WORKER_STATE_READY
        self.calls.append("heartbeat")
        if self.forget_once:  # as a restarted router: the worker registers again
            self.forget_once = False
            return worker_pb2.HeartbeatResponse(known=False)
        if self.calls.count("heartbeat") >= 3:
            self.beats.set()
        return worker_pb2.HeartbeatResponse(known=True)

    async def Deregister(self, info, context):
        self.calls.append("deregister")
        return worker_pb2.Empty()


def test_fake_worker_registers_heartbeats_registers_again_and_deregisters() -> None:
    async def go() -> list[str]:
        registry = FakeRegistry()
        server = grpc.aio.server()
        worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            worker = fdw.FakeDecodeWorker("w1", [5])
            info = worker_pb2.WorkerInfo(
                worker_id="w1", role=worker_pb2.ROLE_DECODE, address="127.0.0.1:1", kv_blocks_total=1,
                block_size=16, max_running=1,
            )  # fmt: skip
            registered, stop = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(
                fdw.keep_registered(f"127.0.0.1:{port}", info, worker, registered, stop)
            )
            await registered.wait()
            await registry.beats.wait()
            stop.set()
            await task
            return registry.calls
        finally:
            await server.stop(None)

    calls = run(go())
    assert calls[:3] == ["register w1", "heartbeat", "register w1"]
    assert calls[-1] == "deregister" and calls.count("heartbeat") >= 3


def test_split_and_cpu_seconds() -> None:
    assert rc.split(1, 2) == [1]
    assert rc.split(64, 2) == [32, 32]
    assert rc.split(5, 2) == [3, 2]
    assert rc.cpu_seconds(os.getpid()) > 0


def _case(front: str, streams: int, routers: int, us: float, tok_s: float) -> dict:
    return {
        "front": front,
        "streams": streams,
        "routers": routers,
        "router_cpu_us_per_token": us,
        "tokens_per_s": tok_s,
    }


def test_ratio_and_capacity_from_the_cases() -> None:
    cases = [
        _case("grpc", 1, 1, 300.0, 1000.0),
        _case("grpc", 64, 1, 200.0, 4000.0),
        _case("grpc", 64, 2, 220.0, 6000.0),
        _case("http", 64, 1, 100.0, 5000.0),
    ]
    (r,) = rc.ratios(cases)
    assert r["front"] == "grpc" and r["streams"] == 64
    assert abs(r["two_over_one"] - 1.1) < 1e-9 and r["within_15_percent"]
    assert abs(r["tokens_per_s_two_over_one"] - 1.5) < 1e-9
    cfg = rc.parse_args(["--assume-streams-per-worker", "10", "--assume-tokens-per-s-per-stream", "50"])
    cap = rc.capacity(cases, cfg)
    # The most loaded one-router case: 200 us/token -> 5,000 tok/s a core; 0.7 of it over 500 tok/s a worker.
    assert cap["grpc"]["from_case_streams"] == 64
    assert abs(cap["grpc"]["router_core_tokens_per_s"] - 5000.0) < 1e-6
    assert abs(cap["grpc"]["decode_workers_per_router"] - 7.0) < 1e-9
    assert abs(cap["http"]["decode_workers_per_router"] - 14.0) < 1e-9
    assert abs(cap["http"]["decode_workers_per_router_at"]["1000"] - 7.0) < 1e-9
