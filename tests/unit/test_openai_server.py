"""The OpenAI HTTP front in-process against fake workers, driven by the official ``openai`` SDK.

Every test runs in ``tests.unit.test_router_server.cluster``, which ends with the
router's leak check (no request left in the ledger, no router-assigned load).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from pdserve.cli import main as cli
from pdserve.cli import serve_cmds
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import generation_pb2 as g
from pdserve.router.config import RouterConfig
from pdserve.router.validate import ModelLimits
from pdserve.worker.role import Role
from tests.fake_workers import CONTEXT, FakeWorker, ids, make_model_dir
from tests.unit.test_router_server import cluster, collect, run, until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("openai-model"))


def sdk(server) -> openai.AsyncOpenAI:
    # No retries: 429 and 503 must reach the test, not be retried away.
    return openai.AsyncOpenAI(base_url=f"{server.http.url}/v1", api_key="none", max_retries=0, timeout=30)


def http_cluster(model_dir: Path, workers, **cfg):
    return cluster(model_dir, workers, http_port=0, model=str(model_dir), **cfg)


async def stream_chunks(stream) -> list:
    return [c async for c in stream]


def test_completions_and_chat_streaming_and_not_match_grpc_generate(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat </s>"), finish="stop")
        async with http_cluster(model_dir, [w]) as (server, stub):
            client = sdk(server)
            model = str(model_dir)
            grpc_tokens, grpc_text, grpc_msgs = await collect(
                stub.Generate(g.GenerateRequest(prompt="the cat", sampling=g.SamplingParams(max_tokens=9)))
            )

            c = await client.completions.create(model=model, prompt="the cat", max_tokens=9, temperature=0)
            assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == model
            assert c.choices[0].text == grpc_text == " hello world the cat"
            assert c.choices[0].finish_reason == "stop" and grpc_msgs[-1].finish_reason == "stop"
            assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (2, 5, 7)
            sent = w.requests[-1]
            assert list(sent.prompt_token_ids) == ids("the cat") == list(w.requests[0].prompt_token_ids)
            assert sent.sampling.max_tokens == 9 and sent.sampling.HasField("temperature")

            chunks = await stream_chunks(
                await client.completions.create(
                    model=model,
                    prompt="the cat",
                    max_tokens=9,
                    stream=True,
                    stream_options={"include_usage": True},
                    stop=["cat"],
                )
            )
            *text_chunks, usage_chunk = chunks
            assert (
                "".join(ch.choices[0].text for ch in text_chunks) == " hello world the "
            )  # stop string held back
            assert [ch.choices[0].finish_reason for ch in text_chunks][-1] == "stop"
            assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 4  # "cat" was the 4th
            assert usage_chunk.usage.prompt_tokens == 2 and len({ch.id for ch in chunks}) == 1
            assert not w.requests[-1].sampling.stop  # the router owns stop strings, as for gRPC

            messages = [{"role": "user", "content": "hello cat"}]
            r = await client.chat.completions.create(model=model, messages=messages, max_completion_tokens=9)
            assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
            assert r.choices[0].message.content == grpc_text and r.choices[0].finish_reason == "stop"
            assert (
                r.usage.prompt_tokens == len(ids("user : hello cat assistant :"))
                and r.usage.completion_tokens == 5
            )
            assert list(w.requests[-1].prompt_token_ids) == ids("user : hello cat assistant :")

            chunks = await stream_chunks(
                await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=9, stream=True
                )
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == grpc_text
            assert chunks[-1].choices[0].finish_reason == "stop" and all(ch.usage is None for ch in chunks)
            assert all(ch.object == "chat.completion.chunk" for ch in chunks)
            await client.close()

    run(main())


def test_errors_are_openai_bodies_with_400_404_429_503(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the"), max_running=1)
        w.hold_at = 1
        async with http_cluster(model_dir, [w], max_waiting=1) as (server, _):
            client = sdk(server)
            too_long = " ".join(["a"] * CONTEXT)
            for kwargs, param in (
                ({"prompt": "", "max_tokens": 3}, "prompt"),
                ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
                ({"prompt": "hello", "top_p": 1.5}, "top_p"),
                ({"prompt": "hello", "temperature": -0.5}, "temperature"),
                ({"prompt": too_long}, "prompt"),
                ({"prompt": "hello", "n": 0}, "n"),
            ):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.completions.create(model=str(model_dir), **kwargs)
                assert info.value.param == param and info.value.type == "invalid_request_error", kwargs
                assert "retry-after" not in info.value.response.headers  # the same request fails again
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model=str(model_dir), messages=[{"role": "wizard", "content": "hi"}]
                )
            assert info.value.param == "messages" and "role" in info.value.message
            with pytest.raises(openai.NotFoundError) as info:
                await client.completions.create(model="gpt-4", prompt="hello")
            assert info.value.code == "model_not_found"
            assert not w.requests  # nothing reached a worker

            # The queue bound: one running (held), one waiting, the third is 429.
            a = asyncio.ensure_future(
                client.completions.create(model=str(model_dir), prompt="hello", max_tokens=3)
            )
            await w.wait_for(lambda: len(w.started) == 1)
            b = asyncio.ensure_future(
                client.completions.create(model=str(model_dir), prompt="hello", max_tokens=3)
            )
            await until(lambda: server.router.admission.waiting == 1, what="b to wait")
            with pytest.raises(openai.RateLimitError) as info:
                await client.completions.create(
                    model=str(model_dir), prompt="hello", max_tokens=3, stream=True
                )
            assert info.value.status_code == 429 and "queue" in info.value.message
            # When to try again (openai-python waits that long): on refusals for load only.
            assert info.value.response.headers.get("retry-after") == "1"
            w.release.set()
            for done in await asyncio.gather(a, b):
                choice = done.choices[0]
                assert choice.text == " hello world the" and choice.finish_reason == "length"

            async with aiohttp.ClientSession() as http:
                async with http.post(f"{server.http.url}/v1/completions", data=b"{oops") as resp:
                    assert resp.status == 400 and "error" in await resp.json()
                async with http.get(f"{server.http.url}/v1/nope") as resp:
                    body = await resp.json()
                    assert resp.status == 404 and body["error"]["type"] == "invalid_request_error"
            await client.close()

    run(main())


def test_unavailable_is_503_and_health_and_models_follow_the_router(model_dir):
    async def main():
        p = FakeWorker("p1", Role.PREFILL, ids("hello"))
        async with http_cluster(model_dir, [p], frontend=False) as (server, _):
            client = sdk(server)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{server.http.url}/health") as resp:
                    assert resp.status == 503  # loading
                with pytest.raises(openai.InternalServerError) as info:
                    await client.completions.create(model=str(model_dir), prompt="hello")
                assert info.value.status_code == 503 and "starting" in info.value.message
                await server.set_frontend(
                    Tokenizer.from_dir(model_dir), ModelLimits.from_model_dir(model_dir)
                )
                async with http.get(f"{server.http.url}/health") as resp:
                    # Serving, but a prefill worker alone can serve no request.
                    assert resp.status == 503 and "no decode" in (await resp.json())["error"]["message"]
            with pytest.raises(openai.InternalServerError) as info:  # no decode worker
                await client.chat.completions.create(
                    model=str(model_dir), messages=[{"role": "user", "content": "hello"}]
                )
            assert info.value.status_code == 503 and "decode" in info.value.message
            assert info.value.response.headers.get("retry-after") == "1"
            models = await client.models.list()
            assert [m.id for m in models.data] == [str(model_dir)] and models.data[0].max_model_len == CONTEXT
            await client.close()

    run(main())


def test_client_disconnect_cancels_the_request_on_the_worker(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"), max_running=1)
        w.hold_at = 2
        async with http_cluster(model_dir, [w], max_waiting=4) as (server, _):
            client = sdk(server)
            # Streaming: the client reads a chunk, then goes away mid-generation.
            stream = await client.chat.completions.create(
                model=str(model_dir), messages=[{"role": "user", "content": "cat"}], stream=True, max_tokens=4
            )
            first = await stream.__anext__()
            assert first.choices[0].delta.role == "assistant"
            await w.wait_for(lambda: w.started)
            await stream.close()
            await w.wait_for(lambda: len(w.cancelled) == 1)
            await until(lambda: not server.router.ledger.jobs, what="the ledger to empty")

            # Non-streaming, and one still waiting for admission behind it: both dropped on disconnect.
            held = asyncio.ensure_future(
                client.completions.create(model=str(model_dir), prompt="cat", max_tokens=4)
            )
            await w.wait_for(lambda: len(w.started) == 2)
            queued = asyncio.ensure_future(client.completions.create(model=str(model_dir), prompt="cat"))
            await until(lambda: server.router.admission.waiting == 1, what="the second to queue")
            for task in (held, queued):
                task.cancel()
            await asyncio.gather(held, queued, return_exceptions=True)
            await w.wait_for(lambda: len(w.cancelled) == 2)
            await until(lambda: server.router.admission.waiting == 0, what="the queue to empty")
            assert len(w.started) == 2  # the queued one never reached the worker
            await client.close()

    run(main())


def test_error_after_the_stream_began_is_an_error_event(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        w.hold_at = 1
        async with http_cluster(model_dir, [w]) as (server, _):
            async with aiohttp.ClientSession() as http:
                body = {"prompt": "cat", "max_tokens": 4, "stream": True}
                async with http.post(f"{server.http.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200 and resp.content_type == "text/event-stream"
                    first = await resp.content.readuntil(b"\n\n")
                    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == " hello"
                    server.router.membership.fail_jobs_on("b1", "worker b1 missed heartbeats")
                    rest = (await resp.content.read()).decode()
            error, done = [e.removeprefix("data: ") for e in rest.split("\n\n") if e]
            # No other worker to move the stream to: the error says both.
            message = json.loads(error)["error"]["message"]
            assert (
                message.startswith("worker b1 missed heartbeats; no other decode or colocated worker is left")
                and done == "[DONE]"
            )

    run(main())


def test_http_port_flag_reaches_the_router_config():
    p = cli.build_parser()
    assert serve_cmds.router_config(p.parse_args(["router"])).http_port is None  # off unless asked for
    assert serve_cmds.router_config(p.parse_args(["router", "--http-port", "0"])).http_port == 0
    assert p.parse_args(["up", "--http-port", "8000"]).http_port == 8000
    with pytest.raises(SystemExit):
        p.parse_args(["router", "--http-port", "-1"])
    with pytest.raises(ValueError, match="http_port"):
        RouterConfig(http_port=70000)
