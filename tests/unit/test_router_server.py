"""The router in-process against fake workers (tests/fake_workers.py): no engine, real gRPC.

Every test ends with the router's leak check: no request left in the ledger and
no worker with router-assigned load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine.params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import generation_pb2 as g
from pdserve.proto import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.detok import Detokenizer
from pdserve.router.jobs import Failure
from pdserve.router.server import RouterServer
from pdserve.router.validate import ModelLimits
from pdserve.worker.agent import RegistrationError
from pdserve.worker.role import Role
from tests.fake_workers import CONTEXT, EOS, ID, FakeWorker, Transfers, ids, make_model_dir
from tests.ports import free_port


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


def register_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The worker ids of every registration attempt from here on (failed or not), in order."""
    from pdserve.worker.agent import RouterAgent

    attempts: list[str] = []
    real = RouterAgent._register_once

    async def counted(self: RouterAgent) -> None:
        attempts.append(self.info.worker_id)
        await real(self)

    monkeypatch.setattr(RouterAgent, "_register_once", counted)
    return attempts


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


# ---- pure pieces --------------------------------------------------------------------------------------


def test_detokenizer_holds_back_stop_strings_and_skips_stop_token_text(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    d = Detokenizer(tok.decode_stream(), SamplingParams(stop=("sat on",)))
    assert d.feed(ids("the cat")) == ("the cat", 2)
    assert d.feed(ids("sat")) == (" ", 1)  # "sat" could start "sat on": held back
    assert d.feed(ids("on the")) == ("", 1) and d.stopped and d.count == 4
    d = Detokenizer(tok.decode_stream(), SamplingParams(stop=("sat on",)))
    assert d.feed(ids("the sat")) == ("the ", 2)
    assert d.feed(ids("mat"), ends_on_stop_token=True) == ("", 1)
    assert d.flush() == "sat" and d.count == 3  # the stop token's text (" mat") is never emitted
    # The engine's rule: a stop string counts once more than min_tokens outputs exist.
    d = Detokenizer(tok.decode_stream(), SamplingParams(stop=("cat",), min_tokens=1, max_tokens=9))
    assert d.feed(ids("cat cat")) == ("cat ", 2) and d.stopped  # the first "cat" is before min_tokens


# ---- health, reflection, startup and shutdown ---------------------------------------------------------


def test_health_reflection_and_graceful_shutdown(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        w.hold_at = 1
        async with cluster(model_dir, [w], frontend=False) as (server, stub):
            channel = grpc.aio.insecure_channel(server.address)
            health = health_pb2_grpc.HealthStub(channel)
            NOT, OK = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING

            async def status(service: str) -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

            # Starting: workers can register, Generation is not served yet.
            assert await status("") == NOT and await status("pdserve.v1.Generation") == NOT
            assert await status("pdserve.internal.v1.Registry") == OK
            assert "starting" in await expect_error(stub.Generate(request()), grpc.StatusCode.UNAVAILABLE)
            await server.set_frontend(Tokenizer.from_dir(model_dir), ModelLimits.from_model_dir(model_dir))
            assert await status("") == OK and await status("pdserve.v1.Generation") == OK

            # Reflection as grpcurl uses it: list services, then describe one.
            refl = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await refl.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = {s.name for s in (await refl.read()).list_services_response.service}
            assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= listed
            await refl.write(
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Generation")
            )
            files = (await refl.read()).file_descriptor_response.file_descriptor_proto
            protos = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in files]
            methods = {
                m.name: m for f in protos for s in f.service if s.name == "Generation" for m in s.method
            }
            assert methods["Generate"].server_streaming
            await refl.done_writing()

            # Shutdown: NOT_SERVING and new requests refused while the in-flight one finishes.
            call = stub.Generate(request(max_tokens=4))
            await w.wait_for(lambda: w.started)
            stopping = asyncio.ensure_future(server.stop(grace_s=30))
            await until(lambda: server.router.closing, what="shutdown to begin")
            assert await status("") == NOT and await status("pdserve.v1.Generation") == NOT
            assert "shutting down" in await expect_error(
                stub.Generate(request()), grpc.StatusCode.UNAVAILABLE
            )
            w.release.set()
            tokens, text, msgs = await collect(call)
            assert text == " hello world the cat" and msgs[-1].finish_reason == "length"
            await stopping
            await channel.close()

    run(main())


# ---- validation -------------------------------------------------------------------------------------


def test_bad_input_is_invalid_argument_naming_the_field_and_router_keeps_serving(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"))
        async with cluster(model_dir, [w]) as (_, stub):
            too_long = " ".join(["a"] * CONTEXT)
            cases = [
                (request(""), "prompt"),
                (g.GenerateRequest(), "prompt"),
                (request(max_tokens=0, min_tokens=1), "min_tokens"),  # (max_tokens 0: the prompt alone)
                (request(logprobs=21), "logprobs"),
                (request(prompt_logprobs=21), "prompt_logprobs"),
                (request(too_long), "prompt"),
                (g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[ID["a"]] * CONTEXT)), "prompt_token_ids"),
                (g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[999])), "prompt_token_ids"),
                (request(top_p=1.5), "top_p"),
                (request(temperature=-0.5), "temperature"),
                (request(top_k=0), "top_k"),
                (
                    g.GenerateRequest(
                        messages=g.ChatMessages(messages=[g.ChatMessage(role="wizard", content="hi")])
                    ),
                    "role",
                ),
                (g.GenerateRequest(messages=g.ChatMessages()), "messages"),
            ]
            for req, field in cases:
                details = await expect_error(stub.Generate(req), grpc.StatusCode.INVALID_ARGUMENT)
                assert field in details, (field, details)
            assert not w.requests  # nothing reached a worker
            tokens, text, _ = await collect(stub.Generate(request()))
            assert tokens == ids("hello world") and text == " hello world"

    run(main())


def test_no_decode_worker_is_unavailable(model_dir):
    async def main():
        p = FakeWorker("p1", Role.PREFILL, ids("hello"))
        async with cluster(model_dir, [p]) as (_, stub):
            details = await expect_error(stub.Generate(request()), grpc.StatusCode.UNAVAILABLE)
            assert "decode" in details

    run(main())


def test_a_request_no_decode_worker_could_ever_hold_is_invalid_argument_at_once(model_dir):
    """The router refuses what no decode worker's whole cache holds, as the worker itself would: the
    prompt alone, or the prompt with its max_tokens (bounded by the context)."""

    async def main():
        d = FakeWorker("d1", Role.DECODE, ids("hello"), kv_blocks_total=3, block_size=4)  # 12 tokens
        async with cluster(model_dir, [d]) as (_, stub):
            long = "hello world the cat sat " * 3  # 15 tokens
            for sampling in ({"max_tokens": 1}, {}):  # the prompt alone: named, not an unset max_tokens
                details = await expect_error(
                    stub.Generate(request(long, **sampling)), grpc.StatusCode.INVALID_ARGUMENT
                )
                assert details.startswith("prompt has 15 tokens") and "holds 12" in details, details
            details = await expect_error(
                stub.Generate(request("hello world", max_tokens=20)), grpc.StatusCode.INVALID_ARGUMENT
            )
            assert details.startswith("max_tokens is 20") and "at most 10 can be generated" in details
            assert not d.requests  # refused before any worker saw it
            tokens, _, _ = await collect(stub.Generate(request("hello world", max_tokens=10)))
            assert tokens == ids("hello")
            # An unset max_tokens is cut to what fits the cache (12 tokens), not only the context (24).
            tokens, _, _ = await collect(stub.Generate(request("hello world")))
            assert tokens == ids("hello") and d.requests[-1].sampling.max_tokens == 10

    run(main())


def test_a_request_goes_only_to_a_decode_worker_whose_cache_can_hold_it(model_dir):
    """Decode workers with caches of different sizes (a scale with another --gpu-memory-utilization): a
    request that only the big one can hold is never routed to the small one, which would refuse it."""

    async def main():
        small = FakeWorker("d1", Role.DECODE, ids("hello"), kv_blocks_total=3, block_size=4)  # 12 tokens
        big = FakeWorker("d2", Role.DECODE, ids("world the"), kv_blocks_total=64, block_size=4)
        async with cluster(model_dir, [small, big]) as (_, stub):
            busy = request("hello", max_tokens=2)
            busy.request_id = "hold-1"  # held on d2 after its first token: the small one is less loaded
            held = stub.Generate(busy)
            await big.wait_for(lambda: big.started)
            tokens, _, _ = await collect(stub.Generate(request("hello world", max_tokens=20)))
            assert tokens == ids("world the") and not small.requests
            big.release.set()
            await collect(held)

    run(main())


# ---- the request path -------------------------------------------------------------------------------


def test_local_route_streams_text_usage_chat_and_deadline(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat </s>"), finish="stop")
        async with cluster(model_dir, [w]) as (_, stub):
            before = time.time()
            tokens, text, msgs = await collect(stub.Generate(request("the cat", max_tokens=9), timeout=20))
            assert tokens == ids("hello world the cat </s>")
            assert text == " hello world the cat"  # the eos token adds no text
            last = msgs[-1]
            assert last.finish_reason == "stop" and all(not m.finish_reason for m in msgs[:-1])
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 5)
            assert msgs[0].request_id and all(m.request_id == msgs[0].request_id for m in msgs)
            req = w.requests[0]
            assert req.mode == worker_pb2.PREFILL_MODE_LOCAL and list(req.prompt_token_ids) == ids("the cat")
            assert req.sampling.max_tokens == 9
            # The client's deadline (20 s, not the router's 600 s default) reaches the worker as
            # deadline_unix and as the call's own timeout (gRPC rounds the timeout header up a little).
            assert before < req.deadline_unix < before + 60
            assert w.timeouts[0] is not None and w.timeouts[0] < 60

            chat = g.GenerateRequest(
                request_id="chat-1",
                messages=g.ChatMessages(messages=[g.ChatMessage(role="user", content="hello cat")]),
            )
            _, _, msgs = await collect(stub.Generate(chat))
            assert msgs[-1].request_id == "chat-1"
            assert list(w.requests[1].prompt_token_ids) == ids("user : hello cat assistant :")

    run(main())


def test_stop_string_never_leaks_and_cancels_the_worker(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("the cat sat on the mat a b c"))
        w.hold_at = 6
        async with cluster(model_dir, [w]) as (_, stub):
            tokens, text, msgs = await collect(stub.Generate(request(stop=["sat on"], max_tokens=9)))
            assert text == " the cat " and msgs[-1].finish_reason == "stop"
            assert tokens == ids("the cat sat on") and msgs[-1].usage.completion_tokens == 4
            assert not w.requests[0].sampling.stop  # the router owns stop strings
            await w.wait_for(lambda: w.cancelled)

    run(main())


def test_streamed_tokens_grow_the_routers_kv_count_of_the_decode_worker(model_dir):
    """Between heartbeats the router counts a stream's KV blocks as it grows (prompt + tokens relayed),
    not the prompt's alone: room running streams took is not offered to the next request."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("the cat sat on the mat a b c"), block_size=2)
        w.hold_at = 6
        async with cluster(model_dir, [w]) as (server, stub):
            call = stub.Generate(request(max_tokens=9))
            await w.wait_for(lambda: w.started)
            prompt = len(w.requests[0].prompt_token_ids)
            b1 = server.router.registry.get("b1")
            # 6 tokens out, the 7th's slot: prompt + 7 tokens in blocks of 2
            await until(lambda: b1.assigned_kv_blocks == -(-(prompt + 7) // 2), what="the grown count")
            w.release.set()
            tokens, _, _ = await collect(call)
            assert len(tokens) == 9

    run(main())


def test_remote_route_sends_prefill_first_token_before_decode_streams(model_dir):
    async def main():
        transfers = Transfers()
        out = ids("hello world the cat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        d.decode_gate = asyncio.Event()  # D streams only once the test has seen the first token
        async with cluster(model_dir, [p, d], local_prefill_threshold=2) as (_, stub):
            call = stub.Generate(request("the cat sat", max_tokens=4))
            first = await call.read()
            assert list(first.token_ids) == out[:1] and first.text == " hello"
            assert not d.started  # decode had not begun: the token came from the prefill result
            prefill = next(r for r in p.requests if isinstance(r, worker_pb2.PrefillRequest))
            # The prefill started without waiting for D's ticket, which followed by AttachTicket.
            assert not prefill.transfer_ticket
            await p.wait_for(lambda: p.attached)
            # Workers know a request as "<client id>@<router tag>": ids are unique per router only.
            ((on_worker, ticket),) = p.attached
            assert on_worker.startswith(f"{first.request_id}@") and ticket == f"ticket:{on_worker}".encode()
            assert d.requests[0].mode == worker_pb2.PREFILL_MODE_REMOTE
            d.decode_gate.set()
            tokens, text, msgs = await collect(call)
            # D re-sends output 0; the router skipped it.
            assert out[:1] + tokens == out and "hello" + text == "hello world the cat"
            assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 4

            # Short prompts stay local on the decode worker.
            await collect(stub.Generate(request("cat", max_tokens=4)))
            assert d.requests[-1].mode == worker_pb2.PREFILL_MODE_LOCAL

    run(main())


def test_a_relay_waiting_on_a_prefill_sleeps_until_something_happens(model_dir, monkeypatch):
    """While the prefill worker computes (D's ticket already attached), the relay's loop waits: it does not
    wake again and again on the finished AttachTicket call (which spun a core for the whole prefill)."""
    import types

    from pdserve.router import attempt as attempt_mod

    wakes = 0

    async def counting_wait(*args, **kwargs):
        nonlocal wakes
        wakes += 1
        return await asyncio.wait(*args, **kwargs)

    monkeypatch.setattr(
        attempt_mod, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "wait": counting_wait})
    )

    async def main():
        transfers = Transfers()
        out = ids("hello world the cat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        p.prefill_gate = asyncio.Event()
        async with cluster(model_dir, [p, d], local_prefill_threshold=2) as (_, stub):
            call = stub.Generate(request("the cat sat", max_tokens=4))
            await p.wait_for(lambda: p.attached)
            before = wakes
            # A window in which nothing happens: the prefill "computes". (Its answer may still be on the
            # way when it opens: one wake.)
            await asyncio.sleep(0.3)
            assert wakes - before <= 1, wakes - before
            p.prefill_gate.set()
            _, _, msgs = await collect(call)
            assert msgs[-1].finish_reason == "length"

    run(main())


def test_the_usage_counts_the_prefill_workers_reuse_though_decode_finishes_first(model_dir):
    """D streams once all KV landed, which can be before P's answer reaches the router: a finish waits for
    that answer, so the usage counts the prompt tokens P reused (cached_tokens)."""

    async def main():
        transfers = Transfers()
        out = ids("hello world")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        p.cached_tokens, p.answer_gate = 2, asyncio.Event()
        async with cluster(model_dir, [p, d], local_prefill_threshold=2) as (_, stub):
            call = stub.Generate(request("the cat sat", max_tokens=2))
            await d.wait_for(lambda: d.started and not d.active)  # D sent all it has, its finish too
            p.answer_gate.set()
            tokens, _, msgs = await collect(call)
            assert tokens == out and msgs[-1].finish_reason == "length"
            assert msgs[-1].usage.cached_tokens == 2

    run(main())


def test_remote_route_ends_on_eos_from_prefill(model_dir):
    async def main():
        transfers = Transfers()
        p = FakeWorker("p1", Role.PREFILL, [EOS], transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, ids("hello world"), transfers=transfers)
        d.decode_gate = asyncio.Event()
        # P answers once D's ticket reached it, so that D holds a reservation to free (P answering first
        # cancelled D's call before D had started it, 1 run in 25: nothing to free, and no cancel seen).
        p.prefill_gate = asyncio.Event()
        async with cluster(model_dir, [p, d], local_prefill_threshold=2) as (_, stub):
            call = stub.Generate(request("the cat sat"))
            await p.wait_for(lambda: p.attached)
            p.prefill_gate.set()
            tokens, text, msgs = await collect(call)
            assert tokens == [EOS] and text == "" and msgs[-1].finish_reason == "stop"
            await d.wait_for(lambda: d.cancelled)  # the decode side freed its reservation

    run(main())


def test_max_tokens_1_on_a_remote_route_is_the_prefill_workers_answer_alone(model_dir):
    """Token 0 is the whole answer and P samples it: the decode worker gets no call (no reservation, no
    KV moved only to be aborted and counted as a failed transfer on both sides), and P is told at once to
    drop the KV it holds (an empty ticket). Also seeded sampling's token 0, and EOS as token 0."""

    async def main():
        transfers = Transfers()
        out = ids("hello world the cat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        async with cluster(model_dir, [p, d], local_prefill_threshold=2) as (_, stub):
            r = request("the cat sat", max_tokens=1)
            tokens, text, msgs = await collect(stub.Generate(r))
            assert tokens == out[:1] and text == " hello" and msgs[-1].finish_reason == "length"
            assert msgs[-1].usage.completion_tokens == 1
            assert not d.requests  # no decode call at all
            assert any(isinstance(q, worker_pb2.PrefillRequest) for q in p.requests)
            await p.wait_for(lambda: p.attached)
            ((on_worker, ticket),) = p.attached  # P drops the KV now, not at its timeout
            assert on_worker.startswith(f"{msgs[-1].request_id}@") and ticket == b""
            p.tokens = [EOS]
            tokens, _, msgs = await collect(stub.Generate(request("the cat sat", max_tokens=1)))
            assert tokens == [EOS] and msgs[-1].finish_reason == "stop" and not d.requests
            # Two tokens: the decode worker streams the second, as before.
            p.tokens = out
            tokens, _, _ = await collect(stub.Generate(request("the cat sat", max_tokens=2)))
            assert tokens[0] == out[0] and d.requests[-1].mode == worker_pb2.PREFILL_MODE_REMOTE
            # Seeded sampling: P samples token 0 with the request's seed, as it does before any decode.
            seeded = request("the cat sat", max_tokens=1)
            seeded.sampling.temperature, seeded.sampling.seed = 0.5, 7
            await collect(stub.Generate(seeded))
            assert p.requests[-1].sampling.seed == 7 and p.requests[-1].sampling.temperature == 0.5

    run(main())


def test_a_one_token_request_needs_no_room_on_the_decode_workers_and_survives_their_death(model_dir):
    """The decode worker a max_tokens=1 route names gets no call: a full one (its one slot held by a long
    stream) does not hold the request back, and its death (heard while P prefills) neither fails nor moves
    it. Nothing of it is counted against that worker."""

    async def main():
        transfers = Transfers()
        out = ids("hello world the cat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers, max_running=1)
        d.hold_at = 1
        cfg = {"local_prefill_threshold": 2, "queue_timeout_s": 0.5, "max_migrations": 0}
        async with cluster(model_dir, [p, d], **cfg) as (server, stub):
            long = stub.Generate(request("the cat sat", max_tokens=4))
            await d.wait_for(lambda: d.started)  # d1's one slot is taken
            tokens, _, msgs = await collect(stub.Generate(request("the cat sat", max_tokens=1)))
            assert tokens == out[:1] and msgs[-1].finish_reason == "length"
            assert len(d.requests) == 1 and server.router.registry.get("d1").assigned == 1
            d.release.set()
            await collect(long)

            p.prefill_gate = asyncio.Event()
            call = stub.Generate(request("the cat sat", max_tokens=1))
            await until(
                lambda: server.router.registry.get("p1").assigned_prefill_tokens > 0, what="P's claim"
            )
            server.router.worker_failed(server.router.registry.get("d1"), True, "UNAVAILABLE: socket closed")
            p.prefill_gate.set()
            tokens, _, msgs = await collect(call)  # P's answer: d1 was never needed
            assert tokens == out[:1] and msgs[-1].finish_reason == "length" and len(d.requests) == 1

    run(main())


def test_queue_bound_rejects_excess_while_admitted_requests_complete(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"), max_running=1)
        w.hold_at = 1
        async with cluster(model_dir, [w], max_waiting=1) as (server, stub):
            a = stub.Generate(request(max_tokens=3))
            await w.wait_for(lambda: len(w.started) == 1)
            b = stub.Generate(request(max_tokens=3))
            await until(lambda: server.router.admission.waiting == 1, what="b to wait")
            details = await expect_error(stub.Generate(request()), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "queue" in details
            w.release.set()
            for call in (a, b):
                tokens, _, msgs = await collect(call)
                assert tokens == ids("hello world the") and msgs[-1].finish_reason == "length"

    run(main())


def test_a_request_waiting_for_room_is_refused_at_once_when_the_router_stops(model_dir):
    """Stopping (``pdserve down``, SIGTERM): the running request finishes; one waiting in the queue for a
    worker with room is refused at once, UNAVAILABLE "shutting down", rather than left to wait out the
    shutdown and be cut (no worker is coming for it: its client can go to another router now)."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"), max_running=1)
        w.hold_at = 1
        async with cluster(model_dir, [w], queue_timeout_s=30.0) as (server, stub):
            a = stub.Generate(request(max_tokens=3))
            await w.wait_for(lambda: len(w.started) == 1)
            b = stub.Generate(request(max_tokens=3))
            await until(lambda: server.router.admission.waiting == 1, what="b to wait")
            stopping = asyncio.ensure_future(server.stop(grace_s=30))
            details = await asyncio.wait_for(expect_error(b, grpc.StatusCode.UNAVAILABLE), 5)
            assert "shutting down" in details
            assert server.router.admission.waiting == 0 and not stopping.done()  # a still runs
            w.release.set()
            tokens, _, msgs = await collect(a)
            assert tokens == ids("hello world the") and msgs[-1].finish_reason == "length"
            await stopping

    run(main())


def test_a_deadline_that_passes_in_the_queue_is_deadline_exceeded_and_counted_as_aborted(model_dir):
    """Not UNAVAILABLE counted as a refusal: the cluster did not turn the request away, its time ran out."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"), max_running=1)
        w.hold_at = 1
        async with cluster(model_dir, [w], request_timeout_s=0.5, queue_timeout_s=30.0) as (server, stub):
            reg = server.router.metrics.registry
            a = stub.Generate(request(max_tokens=3), timeout=30)
            await w.wait_for(lambda: len(w.started) == 1)
            details = await expect_error(
                stub.Generate(request(max_tokens=3)), grpc.StatusCode.DEADLINE_EXCEEDED
            )
            assert "deadline" in details and "waited for a worker with room" in details
            assert (
                reg.get_sample_value("pdserve_requests_total", {"role": "router", "finish_reason": "abort"})
                == 1
            )
            for code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
                labels = {"role": "router", "code": code}
                assert reg.get_sample_value("pdserve_requests_rejected_total", labels) == 0
            w.release.set()
            await collect(a)

    run(main())


def test_client_cancel_reaches_decode_stream_and_inflight_prefill(model_dir):
    async def main():
        transfers = Transfers()
        p = FakeWorker("p1", Role.PREFILL, ids("hello world"), transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, ids("hello world the cat"), transfers=transfers)
        p.prefill_gate = asyncio.Event()
        d.hold_at = 2
        async with cluster(model_dir, [p, d], local_prefill_threshold=3) as (server, stub):
            local = stub.Generate(request("cat", max_tokens=4))
            await local.read()
            await local.read()
            local.cancel()
            await d.wait_for(lambda: len(d.cancelled) == 1)

            remote = stub.Generate(request("the cat sat", max_tokens=4))
            # Both calls in flight (the router starts them together: the prefill need not wait for D).
            await p.wait_for(lambda: p.active)
            await d.wait_for(lambda: len(d.active) == 1)
            remote.cancel()
            await p.wait_for(lambda: p.cancelled)
            await d.wait_for(lambda: len(d.cancelled) == 2)
            await until(lambda: not server.router.ledger.jobs, what="ledger to empty")
            assert server.router.ledger.prefill_tokens("p1") == 0

    run(main())


# ---- worker failures, heartbeats, drain ---------------------------------------------------------------


def test_a_failed_engine_step_moves_its_request_and_leaves_the_worker_serving(model_dir):
    """A failed step is the worker's fault, not the request's: the router moves the request (the worker
    said so in the call's trailing metadata) and keeps routing to the worker, which lives on."""

    async def main():
        bad = FakeWorker("b1", Role.BOTH, ids("hello world the"))
        good = FakeWorker("b2", Role.BOTH, ids("hello world the"))
        bad.fail_steps = 1
        async with cluster(model_dir, [bad, good]) as (server, stub):
            tokens, _, msgs = await collect(stub.Generate(request(max_tokens=3)))
            assert tokens == ids("hello world the") and msgs[-1].finish_reason == "length"
            assert [len(bad.requests), len(good.requests)] == [1, 1]  # b1 first (least loaded, by id)
            labels = {"role": "router", "reason": "step_failed"}
            assert (
                server.router.metrics.registry.get_sample_value("pdserve_router_migrations_total", labels)
                == 1
            )
            assert server.router.registry.get("b1") is not None  # not taken for dead
            await collect(stub.Generate(request(max_tokens=3)))
            assert len(bad.requests) == 2  # routed to again
            # A request under which a step fails on two workers may be what breaks them: not moved again.
            bad.fail_steps = good.fail_steps = 1
            details = await expect_error(stub.Generate(request(max_tokens=3)), grpc.StatusCode.INTERNAL)
            assert "not moved again" in details and len(bad.requests) + len(good.requests) == 5

    run(main())


@pytest.mark.parametrize("route", ["colocated", "remote"])
def test_a_request_whose_decode_worker_dies_mid_stream_continues_elsewhere_after_the_tokens_sent(
    model_dir, route
):
    """The first decode worker's stream breaks after 2 tokens (a dying worker): the router moves the
    request to another one with the prompt plus the 2 tokens sent as input, output_offset 2 and max_tokens
    / min_tokens lowered by 2 (locally prefilled, even on the remote route). The new worker continues at
    output index 2, as the engine does, and the client gets every token exactly once, in order."""

    async def main():
        out = ids("hello world the cat sat")
        transfers = Transfers()
        role = Role.BOTH if route == "colocated" else Role.DECODE
        bad = FakeWorker("d1", role, out, transfers=transfers, fail_at=2)  # ties go to the lower id
        good = FakeWorker("d2", role, out, transfers=transfers)
        workers = [bad, good]
        if route == "remote":
            workers.append(FakeWorker("p1", Role.PREFILL, out, transfers=transfers))
        async with cluster(model_dir, workers, local_prefill_threshold=2) as (server, stub):
            call = stub.Generate(request("the cat sat", max_tokens=5, min_tokens=4))
            tokens, text, msgs = await collect(call)
            assert tokens == out and text == " hello world the cat sat"
            assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 5
            (first,) = bad.requests
            (moved,) = good.requests
            want_mode = worker_pb2.PREFILL_MODE_LOCAL
            if route == "remote":
                want_mode = worker_pb2.PREFILL_MODE_REMOTE
            assert first.mode == want_mode and first.output_offset == 0
            assert (first.sampling.max_tokens, first.sampling.min_tokens) == (5, 4)
            assert list(first.prompt_token_ids) == ids("the cat sat")
            # The move: prompt + the tokens sent, their count as the offset, what is left of the limits.
            assert moved.mode == worker_pb2.PREFILL_MODE_LOCAL and moved.output_offset == 2
            assert list(moved.prompt_token_ids) == ids("the cat sat") + out[:2]
            assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (3, 2)
            assert moved.request_id == first.request_id
            reg = server.router.metrics.registry
            labels = {"role": "router", "reason": "decode_failed"}
            assert reg.get_sample_value("pdserve_router_migrations_total", labels) == 1

    run(main())


def test_a_failed_kv_transfer_moves_the_request_and_its_log_names_the_transfer_not_a_dead_decoder(
    model_dir, caplog
):
    """The decode worker says its KV transfer failed (ABORTED: the prefill peer died mid-push): the request
    moves (local prefill, not on that prefill worker), and the log says the transfer from that prefill
    worker failed; it said "decode worker d1 failed", of a decode worker that was fine."""

    async def main():
        out = ids("hello world the")
        transfers = Transfers()
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        d.abort_transfers = 1
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        async with cluster(model_dir, [d, p], local_prefill_threshold=2, max_migrations=1) as (server, stub):
            tokens, _, msgs = await collect(stub.Generate(request("the cat sat", max_tokens=3)))
            assert tokens == out and msgs[-1].finish_reason == "length"
            assert [r.mode for r in d.requests] == [
                worker_pb2.PREFILL_MODE_REMOTE,
                worker_pb2.PREFILL_MODE_LOCAL,
            ]
            reg = server.router.metrics.registry
            labels = {"role": "router", "reason": "transfer_aborted"}
            assert reg.get_sample_value("pdserve_router_migrations_total", labels) == 1

    with caplog.at_level("WARNING", logger="pdserve.router"):
        run(main())
    moved = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(moved) == 1 and "the KV transfer from prefill worker p1 to decode worker d1 failed" in moved[0]
    assert ": decode worker d1 failed" not in moved[0]  # (the old words)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_hosts_bind_register_and_serve_in_brackets(model_dir):
    """A pod IP may be IPv6: the router and the workers bind to it and register ``[addr]:port``."""

    async def main():
        transfers = Transfers()
        out = ids("hello world")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers, host="::1")
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers, host="::1")
        async with cluster(model_dir, [p, d], host="::1", local_prefill_threshold=2) as (server, stub):
            assert server.address.startswith("[::1]:")
            assert {w.address.rpartition(":")[0] for w in server.router.registry} == {"[::1]"}
            tokens, _, _ = await collect(stub.Generate(request("the cat sat", max_tokens=2)))
            assert tokens == out and p.requests and d.requests

    run(main())


def test_a_decode_worker_without_the_room_its_heartbeat_promised_gets_the_request_again(model_dir):
    """Its running requests grew since its last heartbeat: the reservation is refused. Nothing was sent, so
    the router routes the request again (here the same worker, once a heartbeat shows room), and the
    client sees one whole stream."""

    async def main():
        transfers = Transfers()
        out = ids("hello world the cat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        d.refuse_room = 1
        cfg = {"local_prefill_threshold": 2, "queue_timeout_s": 3.0, "max_migrations": 1}
        async with cluster(model_dir, [p, d], **cfg) as (server, stub):
            tokens, text, msgs = await collect(stub.Generate(request("the cat sat", max_tokens=4)))
            assert tokens == out and text == " hello world the cat" and msgs[-1].finish_reason == "length"
            # The second try prefills on P again, or on D itself after P's first token reached the client.
            assert len(d.requests) == 2 and d.refuse_room == 0
            assert d.requests[0].mode == worker_pb2.PREFILL_MODE_REMOTE
            reg = server.router.metrics.registry
            labels = {"role": "router", "reason": "decode_full"}
            assert reg.get_sample_value("pdserve_router_migrations_total", labels) == 1
            assert server.router.registry.get("d1").full_until > 0  # counted full a while

            # A refusal is no migration (exploratory testing: refused more often than --max-migrations
            # allowed, or for 10 s, admitted requests failed RESOURCE_EXHAUSTED, HTTP 429): it waits for
            # room as in the admission queue ...
            d.refuse_room = 4
            tokens, _, _ = await collect(stub.Generate(request("the cat sat", max_tokens=4)))
            assert tokens == out and d.refuse_room == 0
            # ... up to --queue-timeout from its arrival, then UNAVAILABLE, as from the queue. (A prompt
            # D prefills itself: a remote one's token 0 may reach the client first, and a request whose
            # stream began is no rejection.)
            d.refuse_room = 10**6
            started = time.monotonic()
            details = await expect_error(
                stub.Generate(request("cat", max_tokens=4)), grpc.StatusCode.UNAVAILABLE
            )
            assert d.requests[-1].mode == worker_pb2.PREFILL_MODE_LOCAL
            assert "no worker had room within 3s" in details and "no room" in details, details
            assert "failed" not in details and "RESOURCE_EXHAUSTED" not in details, details
            assert time.monotonic() - started < 20  # (a bound, not a timing)
            # Counted as the admission queue counts its timeouts: a rejection, not an error.
            get = server.router.metrics.registry.get_sample_value
            assert get("pdserve_requests_rejected_total", {"role": "router", "code": "UNAVAILABLE"}) == 1
            assert not get("pdserve_requests_total", {"role": "router", "finish_reason": "error"})
            d.refuse_room = 0

    run(main())


def _stalling_client():
    """A client write that takes the first message, then waits for ``resume`` (as a write stuck on HTTP/2
    flow control): (messages got, stalled event, resume event, write)."""
    got: list = []
    stalled, resume = asyncio.Event(), asyncio.Event()

    async def write(resp) -> None:
        got.append(resp)
        stalled.set()
        await resume.wait()

    return got, stalled, resume, write


def test_a_client_that_stops_reading_holds_no_worker_slot_once_the_worker_is_done(model_dir):
    """Exploratory testing: clients that read one message and then stop held their decode worker's slots
    (``max_running``) until their deadline, though the worker had finished their requests: every other
    client waited out --queue-timeout. The worker's stream is read ahead of the client's writes and its
    claim ends with it; the slow client still gets every message, in order."""
    from pdserve.router.service import generate

    async def main():
        out = ids("hello world the cat")
        w = FakeWorker("b1", Role.BOTH, out, max_running=1)
        async with cluster(model_dir, [w], queue_timeout_s=5.0) as (server, stub):
            got, stalled, resume, slow_client = _stalling_client()

            slow = asyncio.ensure_future(
                generate(server.router, request("the cat", max_tokens=4), slow_client, 60)
            )
            await asyncio.wait_for(stalled.wait(), 10)
            await until(lambda: server.router.ledger.assigned("b1") == 0, what="the worker's slot back")
            tokens, _, _ = await collect(stub.Generate(request("the cat", max_tokens=4), timeout=20))
            assert tokens == out  # served on the one slot while the first client still stalls
            resume.set()
            await asyncio.wait_for(slow, 10)
            assert [t for r in got for t in r.token_ids] == out and got[-1].finish_reason == "length"

    run(main())


def test_read_ahead_of_stalled_clients_is_bounded_router_wide(model_dir, monkeypatch):
    """Read-ahead is bounded per stream and router-wide: past the router-wide limit a stream reads at
    most ``_READ_AHEAD_OWN`` messages ahead, and its worker keeps its claim (waits) as before read-ahead."""
    from pdserve.router import stream
    from pdserve.router.service import generate

    monkeypatch.setattr(stream, "_READ_AHEAD_OWN", 2)

    async def main():
        out = ids("hello world the cat sat on the mat a b c")
        w = FakeWorker("b1", Role.BOTH, out)
        async with cluster(model_dir, [w]) as (server, stub):
            budget = server.router.relay.read_ahead
            budget.limit = 3
            got, stalled, resume, slow_client = _stalling_client()

            slow = asyncio.ensure_future(
                generate(server.router, request("the cat", max_tokens=len(out)), slow_client, 60)
            )
            await asyncio.wait_for(stalled.wait(), 10)
            await until(lambda: budget.used == 3, what="the read-ahead to fill")
            await asyncio.sleep(0.3)
            assert budget.used == 3 and server.router.ledger.assigned("b1") == 1  # the worker waits
            # Another client is served meanwhile: its stream may read ahead its own two messages.
            tokens, _, _ = await collect(stub.Generate(request("the cat", max_tokens=len(out)), timeout=20))
            assert tokens == out
            resume.set()
            await asyncio.wait_for(slow, 10)
            assert [t for r in got for t in r.token_ids] == out and got[-1].finish_reason == "length"

    run(main())


def test_a_stream_that_fell_behind_its_own_read_ahead_resumes_while_others_stall(model_dir, monkeypatch):
    """A stream whose client paused until its own read-ahead (``_READ_AHEAD_OWN``) was full, while stalled
    streams hold the router-wide budget, reads on once its client catches up: its wait ends with its own
    queue draining, not only with the stalled streams' (which here never drain first)."""
    from pdserve.router import stream
    from pdserve.router.service import generate

    monkeypatch.setattr(stream, "_READ_AHEAD_OWN", 2)

    async def main():
        out = ids("hello world the cat sat on the mat a b c")
        w = FakeWorker("b1", Role.BOTH, out)
        async with cluster(model_dir, [w]) as (server, stub):
            budget = server.router.relay.read_ahead
            budget.limit = 3
            _, stalled, resume, slow_client = _stalling_client()
            slow = asyncio.ensure_future(
                generate(server.router, request("the cat", max_tokens=len(out)), slow_client, 60)
            )
            await asyncio.wait_for(stalled.wait(), 10)
            await until(lambda: budget.used == 3, what="the read-ahead to fill")
            # The second client takes one message, then pauses until its own two are read ahead.
            got2, paused, go_on, paused_client = _stalling_client()
            second = asyncio.ensure_future(
                generate(server.router, request("the cat", max_tokens=len(out)), paused_client, 60)
            )
            await asyncio.wait_for(paused.wait(), 10)
            await until(lambda: budget.used == 3 + 2, what="the second stream's own read-ahead to fill")
            go_on.set()
            await asyncio.wait_for(second, 20)
            assert [t for r in got2 for t in r.token_ids] == out
            resume.set()
            await asyncio.wait_for(slow, 10)
            assert budget.used == 0

    run(main())


def test_a_client_cancel_during_a_blocked_write_is_an_abort_not_a_server_error(model_dir):
    """Exploratory testing: a client that cancels while the router's write waits on flow control made
    grpc.aio raise its internal ExecuteBatchError from ``context.write``: logged as an ERROR traceback and
    counted finish_reason="error". It is the client going away: an abort."""
    from grpc._cython import cygrpc

    from pdserve.router.service import GenerationService

    class Context:
        def __init__(self) -> None:
            self.writes = 0

        def time_remaining(self) -> float:
            return 30.0

        def cancelled(self) -> bool:  # (live, grpc.aio learns of the cancel only after the failed write)
            return False

        def done(self) -> bool:
            return False

        async def write(self, _resp) -> None:
            self.writes += 1
            if self.writes > 1:
                if mode["fail_worker_too"]:  # a worker failure recorded at the same moment: no move
                    for job in server.router.ledger.jobs:
                        job.failure = Failure("UNAVAILABLE", "worker b1 died", "b1", "decode_failed")
                raise cygrpc.ExecuteBatchError(
                    'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation>)'
                )

        async def abort(self, code, details):  # type: ignore[no-untyped-def]
            raise AssertionError(f"aborted {code}: {details}")

    server = None
    mode = {"fail_worker_too": False}

    async def main():
        nonlocal server
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        async with cluster(model_dir, [w]) as (server, _):
            reg = server.router.metrics.registry
            labels = {"role": "router", "finish_reason": "abort"}
            for fail in (False, True):
                mode["fail_worker_too"] = fail
                before = reg.get_sample_value("pdserve_requests_total", labels) or 0
                with pytest.raises(asyncio.CancelledError):
                    await GenerationService(server.router).Generate(
                        request("the cat", max_tokens=4), Context()
                    )
                assert reg.get_sample_value("pdserve_requests_total", labels) == before + 1
                assert not reg.get_sample_value(
                    "pdserve_requests_total", {"role": "router", "finish_reason": "error"}
                )
            assert not reg.get_sample_value(
                "pdserve_router_migrations_total", {"role": "router", "reason": "decode_failed"}
            )
            assert len(w.requests) == 2  # moved nowhere

    run(main())


def test_an_error_status_for_a_call_that_already_ended_is_no_server_error(model_dir):
    """Exploratory testing (soak): a request that failed (here: no decode worker) as its call ended on its
    own deadline: ``context.abort`` raised grpc.aio's ExecuteBatchError, logged as an ERROR traceback."""
    from grpc._cython import cygrpc

    from pdserve.router.service import GenerationService

    class Context:
        def time_remaining(self) -> float:
            return 30.0

        async def abort(self, code, details):  # type: ignore[no-untyped-def]
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": (<SendStatusFromServerOperation>,)')

    async def main():
        async with cluster(model_dir, []) as (server, _):
            assert await GenerationService(server.router).Generate(request("the cat"), Context()) is None

    run(main())


@pytest.mark.parametrize("sweep_fails_once", [False, True])
def test_missed_heartbeats_expire_the_worker_and_fail_its_requests(model_dir, sweep_fails_once):
    """(A sweep that failed once, by a bug, runs again at its next tick: it is what expires workers.)"""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"))
        w.hold_at = 1
        async with cluster(model_dir, [w], heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3) as (
            server,
            stub,
        ):
            if sweep_fails_once:
                real, failed = server.router.membership.sweep, []

                async def sweep(now):  # type: ignore[no-untyped-def]
                    if not failed:
                        failed.append(now)
                        raise KeyError("a bug in one sweep")
                    return await real(now)

                server.router.membership.sweep = sweep  # type: ignore[method-assign]
                await until(lambda: failed, what="the failing sweep")
            call = stub.Generate(request(max_tokens=3))
            await w.wait_for(lambda: w.started)
            await w.agent.close(deregister=False)  # the worker hangs: alive, but silent
            details = await expect_error(call, grpc.StatusCode.UNAVAILABLE)
            assert "heartbeat" in details
            assert server.router.registry.get("b1") is None
            await w.wait_for(lambda: w.cancelled)

    run(main())


def test_a_router_that_stood_still_does_not_blame_its_workers(model_dir):
    """The router's event loop blocked past the heartbeat timeout (a call holding the GIL, SIGSTOP):
    the workers' heartbeats could not be read meanwhile, so none is dropped and a running stream goes on;
    the stall is counted. A worker that stays silent after the stall still expires."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"))
        w.hold_at = 1
        async with cluster(model_dir, [w], heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3) as (
            server,
            stub,
        ):
            call = stub.Generate(request(max_tokens=3))
            await w.wait_for(lambda: w.started)
            entry = server.router.registry.get("b1")
            time.sleep(1.0)  # blocks the one event loop: the router's and the worker's
            await asyncio.sleep(0.2)
            assert server.router.registry.get("b1") is entry  # kept, not dropped and registered again
            assert server.router.metrics.loop_stalls._value.get() >= 1
            w.hold_at = None
            w.release.set()
            tokens, _, msgs = await collect(call)
            assert msgs[-1].finish_reason
            await w.agent.close(deregister=False)  # now really silent
            for _ in range(100):
                if server.router.registry.get("b1") is None:
                    break
                await asyncio.sleep(0.05)
            assert server.router.registry.get("b1") is None

    run(main())


def test_drain_worker_finishes_in_flight_then_the_worker_leaves(model_dir):
    async def main():
        w1 = FakeWorker("b1", Role.BOTH, ids("hello world"))
        w2 = FakeWorker("b2", Role.BOTH, ids("the cat"))
        w1.hold_at = 1
        async with cluster(model_dir, [w1, w2]) as (server, stub):
            a = stub.Generate(request(max_tokens=2))
            await w1.wait_for(lambda: w1.started)  # ties go to the lower id
            async with grpc.aio.insecure_channel(server.address) as channel:
                registry = worker_pb2_grpc.RegistryStub(channel)
                assert (await registry.DrainWorker(worker_pb2.DrainWorkerRequest(worker_id="b1"))).found
                assert not (await registry.DrainWorker(worker_pb2.DrainWorkerRequest(worker_id="nope"))).found
                status = await registry.GetClusterStatus(worker_pb2.Empty())
            states = {e.info.worker_id: e.load.state for e in status.workers}
            assert states == {"b1": worker_pb2.WORKER_STATE_DRAINING, "b2": worker_pb2.WORKER_STATE_READY}
            tokens, _, _ = await collect(stub.Generate(request(max_tokens=2)))
            assert tokens == ids("the cat")  # new work goes elsewhere
            async with grpc.aio.insecure_channel(server.address) as channel:
                registry = worker_pb2_grpc.RegistryStub(channel)
                await registry.DrainWorker(worker_pb2.DrainWorkerRequest(worker_id="b2"))
            # None left to take it: says why (as `down` drains every worker), not just "none available".
            why = await expect_error(stub.Generate(request(max_tokens=2)), grpc.StatusCode.UNAVAILABLE)
            assert "every one is draining" in why
            await until(lambda: w1.shell.state.value == "draining", what="b1 to hear the drain")
            w1.release.set()
            tokens, _, msgs = await collect(a)
            assert tokens == ids("hello world") and msgs[-1].finish_reason == "length"
            await asyncio.wait_for(w1.shell.wait_stopped(), 10)
            await w1.agent.close()
            assert server.router.registry.get("b1") is None

    run(main())


def test_agent_retries_until_router_is_up_and_reregisters_when_forgotten(model_dir, monkeypatch):
    attempts = register_attempts(monkeypatch)

    async def main():
        port = free_port()
        w = FakeWorker("b1", Role.BOTH, ids("hello"))
        joining = asyncio.ensure_future(w.start(f"127.0.0.1:{port}", retry_interval_s=0.05))
        await until(lambda: len(attempts) >= 3, what="three failed registration attempts")
        assert not joining.done()
        server = RouterServer(RouterConfig(port=port, heartbeat_interval_s=0.05))
        await server.start()
        try:
            await asyncio.wait_for(joining, 10)
            reg = server.router.registry
            assert reg.get("b1") is not None and w.agent.registrations == 1
            reg.remove("b1")  # as after a router restart
            # The router holds the entry before the agent's Register call returns.
            await until(lambda: w.agent.registrations == 2, what="re-registration")
            assert reg.get("b1") is not None
        finally:
            await w.stop()
            await server.stop(grace_s=0)

    run(main())


def test_a_workers_readiness_service_is_serving_only_while_registered(model_dir, monkeypatch):
    """Kubernetes' readiness probe asks ``pdserve.worker.registered``: NOT_SERVING while the worker has
    loaded but the router does not know it (here: not up yet), SERVING once registered, NOT_SERVING again
    when it drains, at once, while a held stream keeps the server up. (The overall status was SERVING from
    the model load on: a pod was Ready, and a rollout went on, while its worker could not join.) A probe
    that gets no answer is no NOT_SERVING here: a server gone must not pass for one draining."""
    from pdserve.worker.agent import AgentConfig, RouterAgent, run_worker
    from pdserve.worker.shell import REGISTERED_SERVICE, ShellConfig, WorkerShell

    attempts = register_attempts(monkeypatch)

    async def main():
        port = free_port()
        w = FakeWorker("b1", Role.BOTH, ids("hello world"))  # a "hold-" request holds after "hello"
        shell = WorkerShell(ShellConfig(host="127.0.0.1", drain_timeout_s=10.0, stop_grace_s=0.1))
        address = await shell.start(lambda srv: worker_pb2_grpc.add_WorkerServicer_to_server(w, srv))
        await shell.set_serving()
        info = worker_pb2.WorkerInfo(
            worker_id="b1", role=worker_pb2.ROLE_BOTH, address=address, kv_blocks_total=64, block_size=16,
            max_running=8, pid=os.getpid(), context_length=CONTEXT,
        )  # fmt: skip
        agent = RouterAgent(
            AgentConfig(f"127.0.0.1:{port}", retry_interval_s=0.05), info, w.load, shell.begin_drain
        )
        joined = asyncio.ensure_future(run_worker(shell, agent))
        channel = grpc.aio.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:  # (an RPC error raises: the server must answer)
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        async def eventually(service: str, want: int) -> None:
            for _ in range(200):
                if await status(service) == want:
                    return
                await asyncio.sleep(0.01)
            assert await status(service) == want

        server = None
        try:
            await until(lambda: len(attempts) >= 3, what="three failed registration attempts (no router)")
            assert await status("") == health_pb2.HealthCheckResponse.SERVING
            assert await status(REGISTERED_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            server = RouterServer(RouterConfig(port=port, heartbeat_interval_s=0.05))
            await server.start()
            await until(lambda: server.router.registry.get("b1") is not None, what="registration")
            await eventually(REGISTERED_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            # The router gone (its heartbeats fail): not registered any more; back once it knows it again.
            await server.stop(grace_s=0)
            await eventually(REGISTERED_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            server = RouterServer(RouterConfig(port=port, heartbeat_interval_s=0.05))
            await server.start()
            await eventually(REGISTERED_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            assert server.router.registry.get("b1") is not None
            # A stream held in flight keeps the draining server up: what it answers is the drain's.
            held = worker_pb2_grpc.WorkerStub(channel).Generate(
                worker_pb2.WorkerGenerateRequest(request_id="hold-1", mode=worker_pb2.PREFILL_MODE_LOCAL)
            )
            assert list((await held.read()).token_ids) == ids("hello")
            shell.begin_drain()
            assert await status(REGISTERED_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert shell.state.value == "draining" and shell.inflight == 1
            w.release.set()
            last = await held.read()  # the held stream finishes
            assert list(last.token_ids) == ids("world") and last.finish_reason == "length"
            assert await held.read() is grpc.aio.EOF
            await asyncio.wait_for(joined, 20)
            with pytest.raises(grpc.aio.AioRpcError):  # the drained server has stopped: no answer
                await status(REGISTERED_SERVICE)
        finally:
            joined.cancel()
            await channel.close()
            await shell.stop()
            if server is not None:
                await server.stop(grace_s=0)

    run(main())


def test_a_worker_told_to_stop_while_it_waits_for_its_router_stops_at_once(model_dir, monkeypatch):
    """Exploratory testing: SIGTERM to a worker whose router does not answer (a pod deleted before it
    could join) was ignored until the registration gave up (60 s). It stops at once, unregistered."""
    from pdserve.worker.agent import AgentConfig, RouterAgent, run_worker
    from pdserve.worker.shell import ShellConfig, WorkerShell

    attempts = register_attempts(monkeypatch)

    async def main():
        port = free_port()  # nothing listens here
        w = FakeWorker("b1", Role.BOTH, ids("hello"))
        shell = WorkerShell(ShellConfig(host="127.0.0.1", drain_timeout_s=10.0, stop_grace_s=0.1))
        address = await shell.start(lambda srv: worker_pb2_grpc.add_WorkerServicer_to_server(w, srv))
        await shell.set_serving()
        info = worker_pb2.WorkerInfo(
            worker_id="b1", role=worker_pb2.ROLE_BOTH, address=address, kv_blocks_total=8
        )
        agent = RouterAgent(
            AgentConfig(f"127.0.0.1:{port}", retry_interval_s=0.05, register_timeout_s=60.0),
            info,
            w.load,
            shell.begin_drain,
        )
        joined = asyncio.ensure_future(run_worker(shell, agent))
        await until(lambda: len(attempts) >= 3, what="three failed registration attempts")
        assert not joined.done()
        shell._on_signal()  # SIGTERM
        await asyncio.wait_for(joined, 10)
        assert agent.registrations == 0

    run(main())


def test_a_heartbeat_whose_load_report_fails_does_not_end_the_heartbeats(model_dir):
    """The agent keeps beating after an error of its own (its load report raised): a silent worker that
    still runs would be dropped by the router and never come back."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello"))
        async with cluster(model_dir, [w], heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5) as (server, _):
            real, failures = w.load, []

            def load():  # type: ignore[no-untyped-def]
                if len(failures) < 3:
                    failures.append(1)
                    raise ValueError("a load report bug")
                return real()

            w.agent._load = load  # type: ignore[union-attr]
            await until(lambda: len(failures) == 3, what="three failed beats")
            await asyncio.sleep(0.8)  # past the heartbeat timeout: the beats after them kept it registered
            assert server.router.registry.get("b1") is not None
            assert not w.agent._task.done()  # type: ignore[union-attr]

    run(main())


def test_a_second_live_process_under_a_registered_worker_id_is_refused(model_dir):
    """Two processes under one id (two `scale` calls at once) would share heartbeats the router cannot
    tell apart: the second is refused while the first heartbeats, and takes the id once it is gone."""

    async def main():
        first = FakeWorker("d1", Role.BOTH, ids("hello"))
        async with cluster(model_dir, [first], heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5) as (
            server,
            stub,
        ):
            second = FakeWorker("d1", Role.BOTH, ids("world"))
            try:
                with pytest.raises(RegistrationError, match="ALREADY_EXISTS|still heartbeats") as info:
                    await second.start(server.address, register_timeout_s=0.5, retry_interval_s=0.05)
                assert "give each worker its own --worker-id" in str(info.value)
                assert server.router.registry.get("d1").address == first.shell.address  # type: ignore[union-attr]
                await first.stop()  # deregisters: the id is free
                await second.agent.register()  # type: ignore[union-attr]
                second.agent.start()  # type: ignore[union-attr]
                assert server.router.registry.get("d1").address == second.shell.address  # type: ignore[union-attr]
                tokens, _, _ = await collect(stub.Generate(request(max_tokens=1)))
                assert tokens == ids("world")
            finally:
                await second.stop()

    run(main())


def test_an_agent_that_gives_up_says_what_the_last_try_got(model_dir):
    """ "did not answer within 60s" alone hid a router refusing the TLS handshake: the last error goes
    with it."""

    async def main():
        port = free_port()
        w = FakeWorker("b1", Role.BOTH, ids("hello"))
        with pytest.raises(RegistrationError, match=r"did not answer within 0.3s \(last: UNAVAILABLE: "):
            await w.start(f"127.0.0.1:{port}", retry_interval_s=0.05, register_timeout_s=0.3)
        await w.stop()

    run(main())


def test_a_worker_with_another_kv_layout_is_refused_and_the_cluster_keeps_serving(model_dir):
    """The router compares every registration's KV record with the registered workers': a mismatch is
    FAILED_PRECONDITION naming both records and the flags, and the worker never joins."""
    same = "m, float32, 2 layers x 1 KV heads x 8, block 4, protocol 5"
    other = "m+int8, float32, 2 layers x 1 KV heads x 8, block 4, protocol 5"

    async def main():
        transfers = Transfers()  # the fakes' stand-in for KV transfer, shared by every worker
        prefill = FakeWorker("p1", Role.PREFILL, ids("hello world"), kv_layout=same, transfers=transfers)
        decode = FakeWorker("d1", Role.DECODE, ids("hello world"), kv_layout=same, transfers=transfers)
        async with cluster(model_dir, [prefill, decode], local_prefill_threshold=1) as (server, stub):
            late = [
                FakeWorker("d2", Role.DECODE, ids("cat"), kv_layout=other, transfers=transfers),
                FakeWorker("b3", Role.BOTH, ids("cat"), kv_layout=other, transfers=transfers),
                FakeWorker("d4", Role.DECODE, ids("hello world"), kv_layout=same, transfers=transfers),
                FakeWorker(
                    "d5", Role.DECODE, ids("hello world"), transfers=transfers
                ),  # no record: not checked
            ]
            try:
                for w in late[:2]:
                    with pytest.raises(RegistrationError, match="FAILED_PRECONDITION") as info:
                        await w.start(server.address, register_timeout_s=5)
                    msg = str(info.value)
                    assert f"{w.worker_id}'s KV cache is [{other}]" in msg and f"[{same}]" in msg, msg
                    assert "--dtype" in msg and "--quantization" in msg, msg
                for w in late[2:]:
                    await w.start(server.address)
                assert {w.worker_id for w in server.router.registry} == {"p1", "d1", "d4", "d5"}
                for _ in range(4):
                    tokens, _, _ = await collect(stub.Generate(request("the cat", max_tokens=2)))
                    assert tokens == ids("hello world")
                assert not late[0].started and not late[1].started
            finally:
                for w in late:
                    await w.stop()

    run(main())


def test_a_worker_of_another_vocabulary_is_refused_and_one_registering_early_waits_for_the_tokenizer(
    model_dir, tmp_path, monkeypatch
):
    """The router checks every worker's vocabulary digest against its own tokenizer's: another model's is
    FAILED_PRECONDITION naming both digests and --model; a worker that registers before the router has
    loaded its tokenizer is told UNAVAILABLE, retries, and joins once it has."""
    from tokenizers import Tokenizer as Backend

    mine = Tokenizer.from_dir(model_dir).vocab_digest
    other_dir = make_model_dir(tmp_path / "other")
    backend = Backend.from_file(str(other_dir / "tokenizer.json"))
    backend.add_tokens(["<one-more>"])
    backend.save(str(other_dir / "tokenizer.json"))
    theirs = Tokenizer.from_dir(other_dir).vocab_digest
    assert theirs != mine

    attempts = register_attempts(monkeypatch)

    async def main():
        early = FakeWorker("b1", Role.BOTH, ids("hello world"), tokenizer_digest=mine)
        stranger = FakeWorker("b2", Role.BOTH, ids("cat"), tokenizer_digest=theirs)
        async with cluster(model_dir, [], frontend=False) as (server, stub):
            joining = asyncio.ensure_future(early.start(server.address, retry_interval_s=0.05))
            try:
                await until(lambda: len(attempts) >= 3, what="three attempts, each told to retry")
                assert not joining.done() and server.router.registry.get("b1") is None
                await server.set_frontend(
                    Tokenizer.from_dir(model_dir), ModelLimits.from_model_dir(model_dir)
                )
                await asyncio.wait_for(joining, 10)
                with pytest.raises(RegistrationError, match="FAILED_PRECONDITION") as info:
                    await stranger.start(server.address, register_timeout_s=5)
                msg = str(info.value)
                assert f"digest {theirs}" in msg and f"digest {mine}" in msg and "--model" in msg, msg
                assert not stranger.started
                assert {w.worker_id for w in server.router.registry} == {"b1"}
                tokens, _, _ = await collect(stub.Generate(request("the cat", max_tokens=2)))
                assert tokens == ids("hello world")
            finally:
                await early.stop()
                await stranger.stop()

    run(main())


class WriterWorker(FakeWorker):
    """Generate in the context.write style (a coroutine, not an async generator)."""

    async def Generate(self, request, context):
        async for m in super().Generate(request, context):
            await context.write(m)


def test_one_sigterm_after_a_drain_the_router_asked_for_still_waits(model_dir):
    """A drain begun by the router (pdserve drain, a preStop hook, a scale-down): the kubelet's SIGTERM
    that follows is the first signal, and drains; only a second one cuts."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"))
        w.hold_at = 1
        async with cluster(model_dir, [w]) as (server, stub):
            call = stub.Generate(request(max_tokens=3))
            await w.wait_for(lambda: w.started)
            server.router.registry.drain("b1")
            shell = w.shell
            assert shell is not None
            await until(lambda: shell.state.name == "DRAINING", what="the drain the router asked for")
            shell._on_signal()
            await asyncio.sleep(0.3)
            assert not shell._stopped.is_set()  # still waiting for the held request
            w.release.set()
            tokens, _, _ = await collect(call)
            assert tokens == ids("hello world the")

    run(main())


def test_a_second_stop_signal_while_draining_cuts_what_is_in_flight(model_dir):
    """SIGTERM drains; another one (``down``/``scale`` once their --timeout passed) stops at once, the
    requests in flight cut, rather than after the whole drain timeout."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"))
        w.hold_at = 1
        async with cluster(model_dir, [w]) as (_, stub):
            call = stub.Generate(request(max_tokens=3))
            await w.wait_for(lambda: w.started)
            shell = w.shell
            assert shell is not None and shell.config.drain_timeout_s >= 10
            shell._on_signal()  # SIGTERM: drain (the held request would keep it waiting)
            await asyncio.sleep(0.2)
            assert not shell._stopped.is_set()
            shell._on_signal()  # again: stop now
            await asyncio.wait_for(shell.wait_stopped(), 5)  # well before the drain timeout
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(call)

    run(main())


def test_shell_waits_for_writer_style_streams_and_rejects_new_calls_while_draining(model_dir):
    async def main():
        w = WriterWorker("b1", Role.BOTH, ids("hello world"))
        w.hold_at = 1
        async with cluster(model_dir, [w]) as (server, stub):
            a = stub.Generate(request(max_tokens=2))
            await w.wait_for(lambda: w.started)
            await w.agent.close(deregister=False)  # the router keeps taking b1 for READY
            w.shell.begin_drain()  # as on SIGTERM
            assert w.shell.inflight == 1
            async with grpc.aio.insecure_channel(w.shell.address) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Generate(
                    worker_pb2.WorkerGenerateRequest(request_id="x", mode=worker_pb2.PREFILL_MODE_LOCAL)
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert ("pdserve-rejected", "draining") in tuple(await call.trailing_metadata())
            # Through the router: refused, but a draining worker is not a dead one.
            await expect_error(stub.Generate(request()), grpc.StatusCode.UNAVAILABLE)
            worker = server.router.registry.get("b1")
            assert worker is not None and worker.state.value == "draining"
            assert w.shell.state.value == "draining"  # still waiting for the in-flight stream
            w.release.set()
            tokens, _, msgs = await collect(a)
            assert tokens == ids("hello world") and msgs[-1].finish_reason == "length"
            await asyncio.wait_for(w.shell.wait_stopped(), 10)
            assert w.shell.inflight == 0

    run(main())
