"""Generated requests, valid and hostile, thrown at a live router over gRPC and HTTP (hypothesis).

Only documented outcomes may come back: gRPC OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED or UNAVAILABLE;
HTTP 200, 400, 404, 413, 429 or 503 with OpenAI's error body. The router keeps serving: after each batch
a well-formed request is served, and ``cluster`` ends with the leak check (no request left in the
ledger, no router-assigned load on any worker).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.proto import generation_pb2 as g
from pdserve.worker.role import Role
from tests.fake_workers import WORDS, FakeWorker, ids, make_model_dir
from tests.unit.test_openai_server import http_cluster
from tests.unit.test_router_server import collect, request, run

GRPC_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
HTTP_OK = {200, 400, 404, 413, 429, 503}

words = st.sampled_from(WORDS)
text = st.one_of(
    st.lists(words, max_size=30).map(" ".join),
    st.text(max_size=200),  # any unicode: the tokenizer maps what it does not know to <unk>
)
uint32 = st.integers(0, 2**32 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32, allow_subnormal=False)


@st.composite
def sampling(draw) -> g.SamplingParams:
    s = g.SamplingParams()
    for name, strategy in (
        ("max_tokens", st.one_of(st.integers(0, 40), uint32)),
        ("temperature", floats),
        ("top_p", floats),
        ("top_k", st.integers(-(2**31), 2**31 - 1)),
        ("seed", st.integers(0, 2**64 - 1)),
        ("min_tokens", st.one_of(st.integers(0, 10), uint32)),
        ("ignore_eos", st.booleans()),
        ("presence_penalty", st.one_of(st.floats(-2.5, 2.5, width=32), floats)),
        ("frequency_penalty", st.one_of(st.floats(-2.5, 2.5, width=32), floats)),
        ("repetition_penalty", st.one_of(st.floats(-0.5, 3, width=32), floats)),
        ("logprobs", st.one_of(st.integers(0, 25), uint32)),
        ("prompt_logprobs", st.one_of(st.integers(0, 25), uint32)),
        ("n", st.one_of(st.integers(0, 4), st.integers(120, 140), uint32)),
    ):
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    bias_ids = st.one_of(st.integers(0, 40), uint32)
    bias_values = st.one_of(st.floats(-110, 110, width=32), floats)
    s.logit_bias.update(draw(st.dictionaries(bias_ids, bias_values, max_size=8)))
    if draw(st.integers(0, 9)) == 0:  # over the bound on the number of tokens
        s.logit_bias.update(dict.fromkeys(range(draw(st.integers(290, 400))), 1.0))
    s.stop.extend(draw(st.lists(st.text(max_size=20), max_size=80)))
    s.stop_token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 40), uint32), max_size=20)))
    if draw(st.booleans()):  # a constraint: well-formed or not, compiling or not, up to over the bound
        so = s.structured_outputs
        kind = draw(st.sampled_from(["json", "regex", "grammar", "json_object", "choice", "empty"]))
        constraint = st.one_of(
            text, st.sampled_from(['{"type": "object"}', "[a-z]+", "(("]), st.just("a" * 70000)
        )
        if kind in ("json", "regex", "grammar"):
            setattr(so, kind, draw(constraint))
        elif kind == "json_object":
            so.json_object = draw(st.booleans())
        elif kind == "choice":
            so.choice.choices.extend(draw(st.lists(text, max_size=4)))
        else:
            so.SetInParent()
    return s


@st.composite
def generate_request(draw) -> g.GenerateRequest:
    req = g.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=300))))
    kind = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(text)
    elif kind == "ids":
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 40), uint32), max_size=30)))
    elif kind == "messages":
        req.messages.SetInParent()
        roles = st.sampled_from(["user", "assistant", "system", "wizard", ""])
        for role, content in draw(st.lists(st.tuples(roles, text), max_size=4)):
            req.messages.messages.add(role=role, content=content)
        for name, params in draw(
            st.lists(st.tuples(text, st.one_of(text, st.just('{"type": "object"}'))), max_size=3)
        ):
            req.messages.tools.add(name=name, parameters=params)
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    return req


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_subnormal=False), text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
http_body = st.one_of(
    # Plausible requests with hostile values in the fields the endpoints read.
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.one_of(st.none(), text),
            "prompt": st.one_of(text, st.lists(st.integers(-5, 2**33), max_size=6), json_value),
            "messages": st.one_of(
                st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": text})),
                json_value,
            ),
            "max_tokens": st.one_of(st.integers(-5, 2**40), json_value),
            "temperature": st.one_of(st.floats(allow_subnormal=False), json_value),
            "top_k": st.integers(-(2**40), 2**40),
            "stop": st.one_of(text, st.lists(text, max_size=80)),
            "stream": st.booleans(),
            "tokens": st.lists(st.integers(-(2**40), 2**40), max_size=6),
            "n": st.one_of(st.integers(-2, 3), st.integers(120, 140), st.integers(2**31, 2**40)),
            "best_of": st.integers(-1, 4),
            "presence_penalty": st.one_of(st.floats(-3, 3), json_value),
            "frequency_penalty": st.one_of(st.floats(allow_subnormal=False), json_value),
            "repetition_penalty": st.one_of(st.floats(-1, 3), json_value),
            "logit_bias": st.one_of(
                st.dictionaries(
                    st.one_of(st.integers(-5, 2**40).map(str), text),
                    st.one_of(st.floats(-200, 200), json_value),
                    max_size=6,
                ),
                json_value,
            ),
            "logprobs": st.one_of(st.integers(-2, 25), st.booleans(), json_value),
            "top_logprobs": st.one_of(st.integers(-2, 25), json_value),
            "echo": st.one_of(st.booleans(), json_value),
            "response_format": st.one_of(
                json_value,
                st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])}),
                st.fixed_dictionaries(
                    {
                        "type": st.just("json_schema"),
                        "json_schema": st.fixed_dictionaries({"name": text, "schema": json_value}),
                    }
                ),
            ),
            "guided_regex": st.one_of(text, json_value),
            "tools": st.one_of(
                json_value,
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.just("function"),
                            "function": st.fixed_dictionaries({"name": text, "parameters": json_value}),
                        }
                    ),
                    max_size=3,
                ),
            ),
            "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_value),
        },
    ).map(lambda d: json.dumps(d).encode()),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),  # not JSON at all
)
paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
printable = st.characters(min_codepoint=32, max_codepoint=126)  # what an HTTP client can send in a header
headers = st.one_of(st.just({}), st.text(printable, max_size=300).map(lambda s: {"X-Request-ID": s}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("fuzz-model"))


async def _grpc_outcome(stub, req: g.GenerateRequest) -> grpc.StatusCode:
    try:
        await asyncio.wait_for(collect(stub.Generate(req, timeout=20)), 30)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    grpc_reqs=st.lists(generate_request(), min_size=1, max_size=8),
    http_reqs=st.lists(st.tuples(paths, http_body, headers), min_size=1, max_size=8),
)
def test_generated_requests_get_documented_answers_and_the_router_keeps_serving(
    model_dir, grpc_reqs, http_reqs
):
    async def main():
        w = FakeWorker("b1", Role.BOTH, ids("hello world the cat"))
        async with http_cluster(model_dir, [w]) as (server, stub):
            outcomes = await asyncio.gather(*(_grpc_outcome(stub, r) for r in grpc_reqs))
            bad = [(r, o) for r, o in zip(grpc_reqs, outcomes, strict=True) if o not in GRPC_OK]
            assert not bad, bad
            async with aiohttp.ClientSession() as http:
                for path, body, hdrs in http_reqs:
                    async with http.post(server.http.url + path, data=body, headers=hdrs) as resp:
                        payload = await resp.read()
                        assert resp.status in HTTP_OK, (path, body, resp.status, payload[:300])
                        if resp.status != 200:
                            assert "error" in json.loads(payload), payload[:300]
                async with http.post(f"{server.http.url}/v1/completions", json={"prompt": "the cat"}) as resp:
                    assert resp.status == 200
            tokens, _, _ = await collect(stub.Generate(request("the cat", max_tokens=3)))
            assert tokens

    run(main(), timeout=120)
