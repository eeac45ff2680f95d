"""Bounds on every input the router takes, over gRPC and HTTP: each refusal is INVALID_ARGUMENT / 400
naming the field and the limit, nothing reaches a worker, and the next well-formed request is served.

In-process router with fake workers; ``cluster`` ends with the router's leak check.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import grpc
import pytest

from pdserve.proto import generation_pb2 as g
from pdserve.router.validate import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.worker.role import Role
from tests.fake_workers import CONTEXT, FakeWorker, ids, make_model_dir
from tests.unit.test_openai_server import http_cluster
from tests.unit.test_router_server import collect, expect_error, request, run

VOCAB = 32  # make_model_dir's config.json


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("bounds-model"))


HOSTILE = [
    # (request, the field the error must start with, a fragment naming the limit)
    (request("the cat", max_tokens=4_000_000_000), "max_tokens", f"context is {CONTEXT} tokens"),
    (request("the cat", max_tokens=CONTEXT - 1), "max_tokens", f"at most {CONTEXT - 2}"),
    (g.GenerateRequest(request_id="r" * 1_000_000, prompt="the cat"), "request_id", "at most 128"),
    (request("the cat", stop=["x"] * 10_000), "sampling.stop", f"at most {MAX_STOP_STRINGS}"),
    (request("the cat", stop=["x" * 5000]), "sampling.stop", f"at most {MAX_STOP_STRING_CHARS}"),
    (
        request("the cat", stop_token_ids=[1] * 5000),
        "sampling.stop_token_ids",
        f"at most {MAX_STOP_TOKEN_IDS}",
    ),
    (request("the cat", top_k=VOCAB + 1), "sampling.top_k", f"vocabulary size {VOCAB}"),
    (request("the cat", presence_penalty=2.5), "sampling.presence_penalty", "[-2, 2]"),
    (request("the cat", frequency_penalty=-3), "sampling.frequency_penalty", "[-2, 2]"),
    (request("the cat", repetition_penalty=0), "sampling.repetition_penalty", "> 0"),
    (request("the cat", repetition_penalty=float("inf")), "sampling.repetition_penalty", "finite"),
    (request("the cat", logit_bias={VOCAB: 1.0}), "sampling.logit_bias", f"vocabulary [0, {VOCAB})"),
    (request("the cat", logit_bias={1: 100.5}), "sampling.logit_bias", "[-100, 100]"),
    (request("the cat", logit_bias={1: float("nan")}), "sampling.logit_bias", "[-100, 100]"),
    (request("the cat", logit_bias=dict.fromkeys(range(5000), 1.0)), "sampling.logit_bias", "at most 300"),
    (request("the cat", n=0), "sampling.n", "[1, 128]"),
    (request("the cat", n=4_000_000_000), "sampling.n", "[1, 128]"),
    (request("the cat", n=128, max_tokens=20), "n is 128", "lower n or max_tokens"),  # the KV cache
    (
        g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[1] * 1_000_000)),
        "prompt_token_ids has 1000000 tokens",
        f"context is {CONTEXT} tokens",
    ),
    # Empty messages count no characters: 480k of them were rendered for 8 s on the event loop.
    (
        g.GenerateRequest(messages=g.ChatMessages(messages=[g.ChatMessage(role="user")] * 100_000)),
        "messages has 100000 messages",
        f"context of {CONTEXT} tokens",
    ),
]


def test_hostile_grpc_requests_are_invalid_argument_naming_field_and_limit(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        async with http_cluster(model_dir, [w]) as (server, stub):
            for req, field, limit in HOSTILE:
                details = await expect_error(stub.Generate(req), grpc.StatusCode.INVALID_ARGUMENT)
                assert details.startswith(field) and limit in details, (field, details)
            # Bytes that are not a GenerateRequest at all: refused, and counted as refused requests are.
            reg = server.router.metrics.registry
            labels = {"role": "router", "code": "INVALID_ARGUMENT"}
            refused = reg.get_sample_value("pdserve_requests_rejected_total", labels)
            async with grpc.aio.insecure_channel(server.address) as channel:
                raw = channel.unary_stream("/pdserve.v1.Generation/Generate")  # no serializer: raw bytes
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in raw(b"\x0a\x05ab"):  # field 1 says 5 bytes follow; 2 do
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid /pdserve.v1.Generation/Generate message" in info.value.details()
            assert reg.get_sample_value("pdserve_requests_rejected_total", labels) == refused + 1
            assert not w.requests  # nothing hostile reached the worker
            # The limit itself is served, and an unset max_tokens is cut to what the context holds.
            tokens, _, msgs = await collect(stub.Generate(request("the cat", max_tokens=CONTEXT - 2)))
            assert msgs[-1].finish_reason and w.requests[-1].sampling.max_tokens == CONTEXT - 2
            long_prompt = " ".join(["the"] * (CONTEXT - 3))  # 3 tokens of room; the default is 16
            await collect(
                stub.Generate(g.GenerateRequest(prompt=long_prompt, sampling=g.SamplingParams(min_tokens=3)))
            )
            assert w.requests[-1].sampling.max_tokens == 3 and w.requests[-1].sampling.min_tokens == 3
            # A min_tokens there is no room for is refused, as a max_tokens is (it was cut to the room).
            details = await expect_error(
                stub.Generate(g.GenerateRequest(prompt=long_prompt, sampling=g.SamplingParams(min_tokens=5))),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert details.startswith("min_tokens is 5") and "at most 3 can be generated" in details

    run(main())


def test_hostile_http_requests_are_400_naming_the_field(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"))
        async with http_cluster(model_dir, [w]) as (server, _):
            url = f"{server.http.url}/v1/completions"
            cases = [
                ({"prompt": "the cat", "max_tokens": 4_000_000_000}, "max_tokens", "context_length_exceeded"),
                ({"prompt": "the cat", "stop": ["x"] * 1000}, "stop", None),
                ({"prompt": "the cat", "top_k": 10_000}, "top_k", None),
                ({"prompt": "the cat", "presence_penalty": 2.01}, "presence_penalty", None),
                ({"prompt": "the cat", "frequency_penalty": -9}, "frequency_penalty", None),
                ({"prompt": "the cat", "repetition_penalty": -1}, "repetition_penalty", None),
                ({"prompt": "the cat", "logit_bias": {str(VOCAB): 1}}, "logit_bias", None),
                ({"prompt": "the cat", "logit_bias": {"3": -101}}, "logit_bias", None),
                ({"prompt": "the cat", "logit_bias": {"three": 1}}, "logit_bias", None),
                ({"prompt": "the cat", "n": 129}, "n", None),
                ({"prompt": "the cat", "n": 100, "max_tokens": 20}, "n", None),
                ({"prompt": "the cat", "n": 2, "best_of": 3}, "best_of", None),
            ]
            async with aiohttp.ClientSession() as http:
                for body, param, code in cases:
                    async with http.post(url, json=body) as resp:
                        err = (await resp.json())["error"]
                        assert resp.status == 400 and err["param"] == param, (body, err)
                        assert err["code"] == code
                assert not w.requests
                # Refused by the HTTP front itself (before the router's checks): counted all the same.
                value = server.router.metrics.registry.get_sample_value
                key = ("pdserve_requests_rejected_total", {"role": "router", "code": "INVALID_ARGUMENT"})
                before = value(*key)
                for body in (
                    {"prompt": "x", "best_of": 2},
                    {"prompt": "x", "model": "nope"},
                    {"prompt": [[]]},
                ):
                    async with http.post(url, json=body) as resp:
                        assert resp.status in (400, 404)
                async with http.post(url, data=b"{not json") as resp:
                    assert resp.status == 400
                assert value(*key) == before + 4
                async with http.post(url, json={"prompt": "the cat", "max_tokens": 2}) as resp:
                    assert resp.status == 200

    run(main())


def test_http_body_over_the_limit_is_400_naming_body() -> None:
    """aiohttp answers 413 past ``client_max_size``; the front maps it to 400 naming ``body`` and the limit
    (before the router is consulted, so no cluster is needed)."""
    import asyncio

    import aiohttp
    from aiohttp.test_utils import TestServer

    from pdserve.router.openai.server import OpenAIFront

    async def go() -> None:
        front = OpenAIFront(router=None, host="127.0.0.1", port=0, model_name="m")  # type: ignore[arg-type]
        front.max_body_bytes = 1024
        server = TestServer(front.app(), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": "m", "prompt": "x" * 4096}
                async with http.post(server.make_url("/v1/completions"), json=body) as r:
                    assert r.status == 400
                    err = (await r.json())["error"]
                    assert err["param"] == "body" and "1024 bytes" in err["message"]
                    assert err["type"] == "invalid_request_error"
        finally:
            await server.close()

    asyncio.run(go())
