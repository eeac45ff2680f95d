"""The server conventions vLLM-compatible clients and load tools probe for, on the OpenAI HTTP front:
``/tokenize``, ``/detokenize``, ``/metrics``, ``/version``, ``/health`` and ``X-Request-ID`` end to end.

In-process router with fake workers (``tests.unit.test_router_server.cluster``: each test ends with the
router's leak check), driven by the official ``openai`` SDK and by plain HTTP.
"""

from __future__ import annotations

import asyncio
import json
from importlib import metadata
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest

from pdserve.proto import generation_pb2 as g
from pdserve.proto import worker_pb2
from pdserve.router.validate import MAX_REQUEST_ID_CHARS
from pdserve.worker.role import Role
from tests.fake_workers import CONTEXT, ID, FakeWorker, Transfers, ids, make_model_dir
from tests.unit.test_openai_server import http_cluster, sdk
from tests.unit.test_router_server import collect, expect_error, run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("openai-endpoints-model"))


def root_sdk(server) -> openai.AsyncOpenAI:
    """The SDK at the server's root, where vLLM puts /tokenize and /detokenize."""
    return openai.AsyncOpenAI(base_url=server.http.url, api_key="none", max_retries=0, timeout=30)


async def post(http: aiohttp.ClientSession, url: str, body, headers=None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers=headers or {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def test_x_request_id_is_the_id_end_to_end_on_both_workers(model_dir):
    async def main():
        transfers = Transfers()
        out = ids("hello world the cat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        async with http_cluster(model_dir, [p, d], local_prefill_threshold=2) as (server, stub):
            model = str(model_dir)
            raw = await sdk(server).completions.with_raw_response.create(
                model=model, prompt="the cat sat", max_tokens=4, extra_headers={"X-Request-ID": "abc-123"}
            )
            assert raw.headers["x-request-id"] == "abc-123"
            assert raw.parse().id == "abc-123" and raw.parse().choices[0].text == " hello world the cat"
            prefill = [r for r in p.requests if isinstance(r, worker_pb2.PrefillRequest)]
            # Workers know it as "<id>@<router tag>" (ids are unique per router); the metadata is the id.
            assert [r.request_id.split("@")[0] for r in prefill] == ["abc-123"]
            assert p.metadata_ids == ["abc-123"]
            assert d.requests[-1].mode == worker_pb2.PREFILL_MODE_REMOTE
            assert [r.request_id.split("@")[0] for r in d.requests] == ["abc-123"]
            assert d.metadata_ids == ["abc-123"]

            # Streaming chat: every chunk carries it, and so does the header.
            async with aiohttp.ClientSession() as http:
                body = {"model": model, "messages": [{"role": "user", "content": "the cat"}], "stream": True}
                headers = {"X-Request-ID": "chat.42"}
                async with http.post(
                    f"{server.http.url}/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200 and r.headers["X-Request-ID"] == "chat.42"
                    events = [ln for ln in (await r.text()).splitlines() if ln.startswith("data: {")]
                assert events and all(json.loads(e[6:])["id"] == "chat.42" for e in events)
            assert d.requests[-1].request_id.startswith("chat.42@") and d.metadata_ids[-1] == "chat.42"

            # Without the header: a generated id of OpenAI's form, echoed all the same.
            raw = await sdk(server).completions.with_raw_response.create(
                model=model, prompt="cat", max_tokens=2
            )
            assert raw.parse().id.startswith("cmpl-") and raw.headers["x-request-id"] == raw.parse().id
            assert d.metadata_ids[-1] == raw.parse().id

            # gRPC: request_id is the same thing (the proto says so), on the worker calls too.
            await collect(stub.Generate(g.GenerateRequest(request_id="grpc-7", prompt="the cat sat")))
            assert d.requests[-1].request_id.startswith("grpc-7@") and d.metadata_ids[-1] == "grpc-7"

    run(main())


def test_bad_and_duplicate_request_ids_are_refused_naming_the_field(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        w.hold_at = 1
        async with http_cluster(model_dir, [w]) as (server, stub):
            model, url = str(model_dir), f"{server.http.url}/v1/completions"
            body = {"model": model, "prompt": "the cat", "max_tokens": 3}
            async with aiohttp.ClientSession() as http:
                for bad in ("x" * (MAX_REQUEST_ID_CHARS + 1), "has space", "quote'd", "semi;colon"):
                    status, err, _ = await post(http, url, body, {"X-Request-ID": bad})
                    assert status == 400 and err["error"]["param"] == "X-Request-ID", (bad, err)
                    assert "X-Request-ID" in err["error"]["message"]
                assert not w.requests  # refused before any worker saw them
                # One in flight (held at its first token), the same id again: refused, the first unharmed.
                first = asyncio.ensure_future(post(http, url, body, {"X-Request-ID": "dup-1"}))
                await asyncio.wait_for(_started(w, "dup-1"), 10)
                status, err, _ = await post(http, url, body, {"X-Request-ID": "dup-1"})
                assert status == 400 and err["error"]["param"] == "X-Request-ID"
                assert "already in flight" in err["error"]["message"]
                w.release.set()
                status, done, headers = await first
                assert status == 200 and done["id"] == "dup-1" and done["choices"][0]["text"]
                # Finished: the id is free again.
                status, again, _ = await post(http, url, body, {"X-Request-ID": "dup-1"})
                assert status == 200 and again["id"] == "dup-1"
            details = await expect_error(
                stub.Generate(g.GenerateRequest(request_id="y" * 1000, prompt="the cat")),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert details.startswith("request_id") and str(MAX_REQUEST_ID_CHARS) in details

    run(main())


async def _started(w: FakeWorker, rid: str) -> None:
    while not any(s.split("@")[0] == rid for s in w.started):  # (workers see "<id>@<router tag>")
        w.changed.clear()
        await w.changed.wait()


def test_tokenize_and_detokenize_agree_with_usage(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"), finish="stop")
        async with http_cluster(model_dir, [w]) as (server, _):
            model = str(model_dir)
            client, root = sdk(server), root_sdk(server)
            # What vllm bench serve sends to align its prompts.
            tok = await root.post(
                "/tokenize",
                body={"model": model, "prompt": "the cat sat", "add_special_tokens": False},
                cast_to=object,
            )
            assert tok == {
                "count": 3,
                "max_model_len": CONTEXT,
                "tokens": ids("the cat sat"),
                "token_strs": None,
            }
            c = await client.completions.create(model=model, prompt="the cat sat", max_tokens=2)
            tok = await root.post("/tokenize", body={"prompt": "the cat sat"}, cast_to=object)
            assert tok["count"] == c.usage.prompt_tokens == 3

            messages = [{"role": "user", "content": "the cat"}]
            chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=2)
            tok = await root.post(
                "/tokenize",
                body={"model": model, "messages": messages, "return_token_strs": True},
                cast_to=object,
            )
            assert tok["count"] == chat.usage.prompt_tokens == len(ids("user : the cat assistant :"))
            assert tok["token_strs"] == "user : the cat assistant :".split()
            no_gen = await root.post(
                "/tokenize", body={"messages": messages, "add_generation_prompt": False}, cast_to=object
            )
            assert no_gen["tokens"] == ids("user : the cat")
            # OpenAI's "developer" role is system, on /tokenize as on chat (it was refused here alone).
            dev = [{"role": "developer", "content": "be brief"}, *messages]
            chat = await client.chat.completions.create(model=model, messages=dev, max_tokens=2)
            tok_dev = await root.post("/tokenize", body={"messages": dev}, cast_to=object)
            system = [{"role": "system", "content": "be brief"}, *messages]
            tok_sys = await root.post("/tokenize", body={"messages": system}, cast_to=object)
            assert tok_dev["tokens"] == tok_sys["tokens"] and tok_dev["count"] == chat.usage.prompt_tokens
            assert w.requests[-1].prompt_token_ids == tok_sys["tokens"]  # what the worker got

            back = await root.post(
                "/detokenize", body={"model": model, "tokens": tok["tokens"]}, cast_to=object
            )
            assert back == {"prompt": "user : the cat assistant :"}
            await client.close()
            await root.close()

    run(main())


def test_tokenize_and_detokenize_refuse_bad_input_with_a_400_naming_the_field(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello"))
        async with http_cluster(model_dir, [w]) as (server, _):
            base = server.http.url
            cases = [
                ("/tokenize", {}, 400, "prompt"),
                (
                    "/tokenize",
                    {"prompt": "the", "messages": [{"role": "user", "content": "the"}]},
                    400,
                    "messages",
                ),
                ("/tokenize", {"prompt": 5}, 400, "prompt"),
                (
                    "/tokenize",
                    {"messages": [{"role": "user", "content": "a"}], "tools": [{"x": 1}]},
                    400,
                    "tools",
                ),
                ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
                (
                    "/tokenize",
                    {"messages": [{"role": "user", "content": "a"}], "chat_template": "x"},
                    400,
                    "chat_template",
                ),
                ("/tokenize", {"prompt": "the", "model": "other"}, 404, "model"),
                ("/tokenize", b"{not json", 400, None),
                ("/detokenize", {"tokens": [0, len(ID) + 5]}, 400, "tokens"),
                ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
                ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
                ("/detokenize", {}, 400, "tokens"),
            ]
            async with aiohttp.ClientSession() as http:
                for path, body, status, param in cases:
                    got, err, _ = await post(http, base + path, body)
                    assert got == status, (path, body, err)
                    assert err["error"]["param"] == param, (path, body, err)
                    assert err["error"]["message"]
                # The cluster still serves the next well-formed request.
                got, tok, _ = await post(http, base + "/tokenize", {"prompt": "hello"})
                assert got == 200 and tok["tokens"] == ids("hello")
                got, _, _ = await post(http, base + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
                assert got == 200

    run(main())


def test_metrics_version_and_health_on_the_api_port(model_dir):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"))
        async with http_cluster(model_dir, [w]) as (server, _):
            client = sdk(server)
            await client.completions.create(model=str(model_dir), prompt="the cat", max_tokens=2)
            card = await client.models.retrieve(str(model_dir))  # a path: the route takes its slashes
            assert card.id == str(model_dir) and card.max_model_len == CONTEXT  # type: ignore[attr-defined]
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("other")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{server.http.url}/metrics") as resp:
                    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
                    api = await resp.text()
                async with http.get(server.metrics.url) as resp:
                    port = await resp.text()
                families = {ln.split()[2] for ln in api.splitlines() if ln.startswith("# TYPE")}
                assert families == {ln.split()[2] for ln in port.splitlines() if ln.startswith("# TYPE")}
                assert "pdserve_time_to_first_token_seconds" in families
                assert 'pdserve_requests_total{finish_reason="length",role="router"} 1.0' in api
                openmetrics = "application/openmetrics-text; version=1.0.0"
                async with http.get(f"{server.http.url}/metrics", headers={"Accept": openmetrics}) as resp:
                    assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
                    assert (await resp.text()).rstrip().endswith("# EOF")

                # A 405 says which methods the path takes (HTTP requires Allow).
                async with http.get(f"{server.http.url}/v1/chat/completions") as resp:
                    assert resp.status == 405 and resp.headers["Allow"] == "POST"
                    assert (await resp.json())["error"]["type"] == "invalid_request_error"
                async with http.get(f"{server.http.url}/version") as resp:
                    assert resp.status == 200 and await resp.json() == {
                        "version": metadata.version("pdserve")
                    }
                async with http.get(f"{server.http.url}/health") as resp:
                    body = await resp.json()
                    assert resp.status == 200 and body["ready_workers"] == {
                        "prefill": 0,
                        "decode": 0,
                        "both": 1,
                    }
            await client.close()

    run(main())


def test_what_vllm_bench_serve_sends_meets_no_404(model_dir):
    """The probes and requests of ``vllm bench serve --backend openai`` (it cannot be installed here): the
    model list, prompt alignment through /tokenize, then streamed completions with their own request ids."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        async with http_cluster(model_dir, [w]) as (server, _):
            base = server.http.url
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/v1/models") as resp:
                    model = (await resp.json())["data"][0]["id"]
                status, tok, _ = await post(
                    http,
                    f"{base}/tokenize",
                    {"model": model, "prompt": "the cat sat", "add_special_tokens": False},
                )
                assert status == 200 and tok["count"] == 3
                for i in range(3):
                    body = {
                        "model": model,
                        "prompt": "the cat sat",
                        "temperature": 0.0,
                        "max_tokens": 4,
                        "logprobs": None,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "ignore_eos": True,
                    }
                    headers = {"Authorization": "Bearer none", "x-request-id": f"benchmark-serving{i}"}
                    async with http.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
                        assert resp.status == 200, await resp.text()
                        assert resp.headers["X-Request-ID"] == f"benchmark-serving{i}"
                        lines = [ln for ln in (await resp.text()).splitlines() if ln.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]"
                    usage = json.loads(lines[-2][6:])["usage"]
                    assert usage == {
                        "prompt_tokens": 3,
                        "completion_tokens": 4,
                        "total_tokens": 7,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    }

    run(main())


def test_a_kv_cache_shorter_than_the_context_is_the_models_max_model_len(model_dir):
    """As vLLM's ``max_model_len`` (which never starts with a cache that cannot hold it): clients size their
    prompts by it. Here the one decode worker's cache holds 12 tokens of the context's 24; a prompt past it
    is refused with OpenAI's context_length_exceeded code, as a prompt past the context is."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"), kv_blocks_total=3, block_size=4)
        async with http_cluster(model_dir, [w]) as (server, _):
            client, root = sdk(server), root_sdk(server)
            model = str(model_dir)
            card = await client.models.retrieve(model)
            assert card.max_model_len == 12  # type: ignore[attr-defined]
            assert (await root.post("/tokenize", body={"prompt": "the"}, cast_to=object))[
                "max_model_len"
            ] == 12
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=model, prompt=[ID["the"]] * 13, max_tokens=1)
            assert info.value.code == "context_length_exceeded" and "KV cache holds 12" in info.value.message
            await client.close()
            await root.close()

    run(main())


def test_a_body_longer_than_any_request_to_the_model_is_refused_before_it_is_decoded(model_dir):
    """The bound: the context's worth of the tokenizer's longest token as escaped JSON, plus room for the
    rest. Decoding a 62 MB list of ids held the router's event loop 4 s (every stream stood still); past the
    bound a body is refused unread when it says its length, and undecoded when it is chunked."""

    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world"))
        async with http_cluster(model_dir, [w]) as (server, _):
            server.router.tokenizer.max_token_chars = 2  # the fake WordLevel tokenizer gives no bound
            limit = server.http.body_limit()
            assert limit == CONTEXT * (12 * 2 + 64) + (1 << 20) < server.http.max_body_bytes
            url = f"{server.http.url}/v1/completions"
            big = json.dumps({"prompt": [1] * (limit // 2)}).encode()  # a long list of ids: slow to decode

            async def chunks():
                for i in range(0, len(big), 1 << 16):
                    yield big[i : i + (1 << 16)]

            async with aiohttp.ClientSession() as http:
                for data in (big, chunks()):  # with its length, then chunked
                    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                        err = (await r.json())["error"]
                        assert r.status == 400 and err["param"] == "body", err
                        assert f"over the limit of {limit} bytes: more than a request" in err["message"]
                got, _, _ = await post(http, url, {"prompt": "hello", "max_tokens": 1})
                assert got == 200
                # /tokenize counts a document of any length (vLLM's too): not bound by the context.
                doc = " ".join(["the"] * (limit // 3))
                got, body, _ = await post(http, f"{server.http.url}/tokenize", {"prompt": doc})
                assert got == 200 and body["count"] >= limit // 3, body.get("error")

    run(main())
