"""The OpenAI HTTP front on a real cluster (``pdserve up --http-port``, float32), driven by the official
``openai`` SDK and by guidellm, a third-party load tool. The clusters serve the tiny served model (the
default model's tokenizer; every forward far cheaper): what is checked is the front, not the model.

Acceptance of the HTTP-front issue: greedy output through the SDK (chat and
completions, streaming and not) equals gRPC ``Generate`` with the right usage;
disconnecting HTTP clients free their KV blocks on every worker (``pdserve
status --json``); guidellm runs against pdserve on the workload ``pdserve
bench`` runs. Every test ends with the cluster harness's leak check.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import openai
import pytest

from benchmarks.tool_compare import Target, Workload, compare, find_guidellm, format_report
from pdserve.deploy.local import cluster
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import generation_pb2 as g
from tests.e2e.cluster_harness import free_port, generate, running_cluster, worker_load

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "Three primary colours are", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name a large ocean."}]


@pytest.fixture(scope="module")
def http_cluster(tmp_path_factory, tiny_served_model):
    """One colocated worker for the module, its HTTP front on a free port."""
    # (a heartbeat timeout a loaded 2-core host does not starve: one worker, nothing to fail over to)
    extra = ("--http-port", str(free_port()), "--heartbeat-timeout", "15")
    dest = tmp_path_factory.mktemp("openai-e2e")
    with running_cluster(dest, colocated=1, model=tiny_served_model, extra=extra) as c:
        c.http_url = c.status()["router"]["http_url"]
        assert c.http_url.startswith("http://127.0.0.1:")
        yield c


@pytest.fixture(scope="module")
def pd_http_cluster(tmp_path_factory, tiny_served_model):
    """1P+1D, every prompt prefilled on the prefill worker (its KV pushed to the decode worker)."""
    extra = ("--http-port", str(free_port()), "--local-prefill-threshold", "1", "--heartbeat-timeout", "15")
    dest = tmp_path_factory.mktemp("openai-e2e-pd")
    with running_cluster(dest, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        c.http_url = c.status()["router"]["http_url"]
        yield c


@pytest.fixture(scope="module")
def served(tiny_served_model) -> str:
    """The name the clusters serve their model under (the ``--model`` given: its directory)."""
    return str(tiny_served_model)


@pytest.fixture(scope="module")
def tokenizer(tiny_served_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_served_model)


def grpc_generate(c, req: g.GenerateRequest) -> tuple[str, int, int, str]:
    """(text, prompt tokens, completion tokens, finish) through gRPC ``Generate``."""
    req.sampling.max_tokens, req.sampling.temperature = MAX_TOKENS, 0.0
    with c.channel() as channel:
        tokens, text, finish, msgs = generate(c.stub(channel), req)
    usage = msgs[-1][1].usage
    assert usage.completion_tokens == len(tokens)
    return text, usage.prompt_tokens, usage.completion_tokens, finish


def test_sdk_greedy_output_equals_grpc_generate_with_right_usage(http_cluster, tokenizer, served):
    c = http_cluster
    want = {p: grpc_generate(c, g.GenerateRequest(prompt=p)) for p in PROMPTS}
    chat_req = g.GenerateRequest(
        messages=g.ChatMessages(messages=[g.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    )
    want_chat = grpc_generate(c, chat_req)
    for p, (_, prompt_tokens, _, _) in want.items():
        assert prompt_tokens == len(tokenizer.encode(p))
    assert want_chat[1] == len(tokenizer.apply_chat_template(CHAT))

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        kw = {"model": served, "max_tokens": MAX_TOKENS, "temperature": 0}

        async def completion(p: str):
            return await client.completions.create(prompt=p, **kw)

        async def completion_stream(p: str):
            s = await client.completions.create(
                prompt=p, stream=True, stream_options={"include_usage": True}, **kw
            )
            chunks = [ch async for ch in s]
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            return text, chunks[-1].usage, [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]

        # All three prompts at once, both ways: batched on the worker, still the same greedy output.
        plain = await asyncio.gather(*(completion(p) for p in PROMPTS))
        streamed = await asyncio.gather(*(completion_stream(p) for p in PROMPTS))
        for p, r, (text, usage, finish) in zip(PROMPTS, plain, streamed, strict=True):
            w_text, w_prompt, w_completion, w_finish = want[p]
            assert r.choices[0].text == text == w_text, p
            assert r.choices[0].finish_reason == finish == w_finish, p
            for u in (r.usage, usage):
                assert (u.prompt_tokens, u.completion_tokens) == (w_prompt, w_completion), p
                assert u.total_tokens == w_prompt + w_completion

        r = await client.chat.completions.create(messages=CHAT, **kw)
        assert r.choices[0].message.content == want_chat[0] and r.choices[0].finish_reason == want_chat[3]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == want_chat[1:3]
        s = await client.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **kw
        )
        chunks = [ch async for ch in s]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_chat[0]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want_chat[2]
        await client.close()

    asyncio.run(asyncio.wait_for(main(), 300))
    c.assert_no_leaks()


@pytest.mark.parametrize("topology", ["colocated", "1P+1D"])
def test_disconnected_http_clients_free_their_kv_blocks_on_every_worker(topology, served, request):
    """Streaming and non-streaming clients that go mid-generation free every KV block, on a colocated
    worker and on both workers of a disaggregated pair (the prefill worker's blocks after their push)."""
    c = request.getfixturevalue("http_cluster" if topology == "colocated" else "pd_http_cluster")
    streams = 4
    # Long enough that none ends before its client goes, however fast the CPU (with 400 tokens of SmolLM2,
    # a CPU ~8x this host's decode speed finished them during the status calls below: "never saw 5
    # requests running"; a tiny model's token takes milliseconds). Every one is cut mid-generation, so the
    # length costs nothing; 5 x 1,900 tokens fit the KV cache, each within the 2,048-token context.
    kw = {"model": served, "max_tokens": 1900, "extra_body": {"ignore_eos": True}}
    state = cluster.load_state(c.state_dir)
    assert state is not None
    token = cluster.state_token(state)

    async def until_running(n: int) -> None:
        for _ in range(200):  # bounded: a failure bound, not a latency check
            # Asked of the router itself (milliseconds), not through the CLI (a process start each).
            status = await asyncio.to_thread(cluster.cluster_status, c.address, token=token)
            if status.requests_running == n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"never saw {n} requests running")

    def blocks_used() -> int:
        """KV blocks in use, asked of each worker itself (GetLoad: no heartbeat lag, no CLI)."""
        total = 0
        for w in cluster.cluster_status(c.address, token=token).workers:
            total += worker_load(w.info.address, c.token_metadata()).kv_blocks_used
        return total

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        opened = []
        for i in range(streams):
            if i % 2:
                opened.append(await client.chat.completions.create(messages=CHAT, stream=True, **kw))
            else:
                opened.append(await client.completions.create(prompt=PROMPTS[0], stream=True, **kw))
        for s in opened:
            for _ in range(3):
                await s.__anext__()
        # A non-streaming request writes nothing until it ends: only the closed connection can stop it.
        plain = asyncio.ensure_future(client.completions.create(prompt=PROMPTS[1], **kw))
        await until_running(streams + 1)
        # Mid-generation the blocks are in use (so the check below can see a leak); then the clients go.
        used = await asyncio.to_thread(blocks_used)
        for s in opened:
            await s.close()
        plain.cancel()
        await asyncio.gather(plain, return_exceptions=True)
        await client.close()
        return used

    assert asyncio.run(asyncio.wait_for(main(), 300)) > 0
    c.assert_no_leaks(timeout_s=10.0)
    assert c.status()["router"]["requests_running"] == 0


def test_guidellm_runs_against_pdserve_on_the_pdserve_bench_workload(http_cluster, served, tiny_served_model):
    """The third-party tool completes every request with exact lengths; its figures sit beside bench's.

    Agreement of the numbers is measured by ``make bench-openai`` (more requests, several rounds);
    here only that both tools ran the same workload cleanly (no timing threshold in a test).
    """
    c = http_cluster
    w = Workload(input_len=64, output_len=8, num_prompts=3, concurrency=2, rounds=1)
    target = Target(c.address, c.http_url, served, tiny_served_model)
    started = time.monotonic()
    doc = compare(target, w, find_guidellm(), timeout_s=300)
    print(format_report(doc), f"({time.monotonic() - started:.0f}s)")
    for tool in ("pdserve_bench", "guidellm"):
        (s,) = doc[tool]  # one round
        assert s["failed"] == 0, tool
        assert list(s["prompt_tokens"]) == [64] * 3 and list(s["output_tokens"]) == [8] * 3, tool
        assert s["unreported"] <= w.concurrency, tool  # guidellm may leave out the tail's last (tool_compare)
    assert [a["metric"] for a in doc["agreement"]] == ["ttft_ms", "itl_ms"]
    assert all(a["a_mean"] > 0 and a["b_mean"] > 0 for a in doc["agreement"])
    c.assert_no_leaks()


def test_penalties_and_logit_bias_travel_to_every_worker_through_both_fronts(
    http_cluster, pd_http_cluster, served
):
    """A strong negative logit_bias on the greedy token 0 moves it (in 1P+1D the prefill worker samples it),
    a repetition penalty applies on the decode worker after it, and the SDK's request (``logit_bias``'s
    string keys, ``repetition_penalty`` as vLLM's extra field) gets what gRPC gets, in both topologies."""
    prompt, n = PROMPTS[0], 8
    biased_tokens = []
    for c in (http_cluster, pd_http_cluster):
        req = g.GenerateRequest(prompt=prompt, sampling=g.SamplingParams(max_tokens=n, temperature=0.0))
        with c.channel() as channel:
            plain, _, _, _ = generate(c.stub(channel), req)
            req.sampling.logit_bias[plain[0]] = -100.0
            req.sampling.repetition_penalty = 1.5
            biased, text, _, _ = generate(c.stub(channel), req)
        assert biased[0] != plain[0]
        biased_tokens.append(biased)
        client = openai.OpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=60)
        kw = {"model": served, "prompt": prompt, "max_tokens": n, "temperature": 0}
        r = client.completions.create(
            logit_bias={str(plain[0]): -100}, extra_body={"repetition_penalty": 1.5}, **kw
        )
        assert r.choices[0].text == text
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(logit_bias={"4000000": 1}, **kw)  # outside the vocabulary
        assert info.value.param == "logit_bias"
        client.close()
        c.assert_no_leaks()
    assert biased_tokens[0] == biased_tokens[1]  # colocated and disaggregated alike


def test_http_and_grpc_errors_match_on_a_served_model(http_cluster, served):
    c = http_cluster
    client = openai.OpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=60)
    too_long = "hello " * 9000  # over the served model's context (2,048 tokens; SmolLM2's is 8,192)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=served, prompt=too_long, max_tokens=4)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with c.channel() as channel, pytest.raises(grpc.RpcError) as rpc:
        generate(c.stub(channel), g.GenerateRequest(prompt=too_long))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details() == info.value.body["message"]  # one validation, two fronts
    client.close()
    c.assert_no_leaks()


# ---- logprobs, echo and lm-evaluation-harness ----------------------------------------------------------

LOGPROB_TOL = 1e-4


def _logprob_stream(c, req: g.GenerateRequest) -> tuple[list[int], list, list, g.Usage]:
    """(tokens, their logprobs, the prompt's logprobs, usage) of one gRPC ``Generate``."""
    with c.channel() as channel:
        tokens, _, _, msgs = generate(c.stub(channel), req)
    lps = [e for _, m in msgs for e in m.logprobs]
    prompt = [e for _, m in msgs for e in m.prompt_logprobs]
    assert all(not m.prompt_logprobs for _, m in msgs[1:])  # the prompt's come on the first message
    return tokens, lps, prompt, msgs[-1][1].usage


def _assert_same_entries(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.token_id == b.token_id and a.HasField("logprob") == b.HasField("logprob")
        assert abs(a.logprob - b.logprob) < LOGPROB_TOL
        assert len(a.top_token_ids) == len(b.top_token_ids)
        for i, (ta, va) in enumerate(zip(a.top_token_ids, a.top_logprobs, strict=True)):
            assert abs(va - b.top_logprobs[i]) < LOGPROB_TOL
            # The same token at each rank, unless another one is within the tolerance of it (a near-tie).
            near = [abs(v - va) < LOGPROB_TOL for j, v in enumerate(b.top_logprobs) if j != i]
            assert ta == b.top_token_ids[i] or any(near)


def test_logprobs_in_1p1d_equal_the_colocated_workers(http_cluster, pd_http_cluster, tokenizer):
    """In 1P+1D token 0's and the prompt's logprobs come from the prefill worker, the rest from the decode
    worker; they equal a colocated worker's, and a prompt whose prefix the prefill worker caches is
    computed whole for its prompt logprobs. max_tokens 0 gives the prompt's alone."""
    prompt = tokenizer.encode("The capital of France is Paris, and the capital of Spain is")
    plain = g.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    asks = g.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    ids = g.TokenIds(ids=prompt)
    _logprob_stream(pd_http_cluster, g.GenerateRequest(prompt_token_ids=ids, sampling=plain))  # cached
    pd = _logprob_stream(pd_http_cluster, g.GenerateRequest(prompt_token_ids=ids, sampling=asks))
    co = _logprob_stream(http_cluster, g.GenerateRequest(prompt_token_ids=ids, sampling=asks))
    assert pd[0] == co[0] and len(pd[1]) == len(pd[0]) == 6
    assert [e.token_id for e in pd[1]] == pd[0]
    _assert_same_entries(pd[1], co[1])
    assert [e.token_id for e in pd[2]] == prompt and not pd[2][0].HasField("logprob")
    _assert_same_entries(pd[2], co[2])
    assert pd[3].cached_tokens == 0  # (the plain request's prefix was cached: not reused here)
    only = g.SamplingParams(max_tokens=0, prompt_logprobs=1)
    tokens, lps, prompt_lps, usage = _logprob_stream(
        pd_http_cluster, g.GenerateRequest(prompt_token_ids=ids, sampling=only)
    )
    assert tokens == [] and lps == [] and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 0)
    assert [e.logprob for e in prompt_lps[1:]] == pytest.approx(
        [e.logprob for e in co[2][1:]], abs=LOGPROB_TOL
    )
    pd_http_cluster.assert_no_leaks()
    http_cluster.assert_no_leaks()


def test_sdk_logprobs_and_echo_shapes_streamed_and_not(pd_http_cluster, served, tokenizer):
    c = pd_http_cluster
    client = openai.OpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    kw = {"model": served, "temperature": 0, "max_tokens": 5}
    r = client.completions.create(prompt=PROMPTS[0], logprobs=2, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text and all(len(t) >= 2 for t in lp.top_logprobs)
    chunks = list(client.completions.create(prompt=PROMPTS[0], logprobs=2, stream=True, **kw))
    streamed = [
        v
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for v in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=LOGPROB_TOL)
    # echo with max_tokens 0: the prompt alone and its logprobs, its first token's None.
    e = client.completions.create(prompt=PROMPTS[0], echo=True, logprobs=1, **{**kw, "max_tokens": 0})
    n = len(tokenizer.encode(PROMPTS[0]))
    assert e.choices[0].text == PROMPTS[0] and e.usage.completion_tokens == 0
    assert len(e.choices[0].logprobs.token_logprobs) == n and e.choices[0].logprobs.token_logprobs[0] is None
    # Chat: the content entries, streamed and not.
    r = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    chunks = list(
        client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, stream=True, **kw)
    )
    streamed = [
        t.logprob
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx([t.logprob for t in content], abs=LOGPROB_TOL)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=21, **kw)
    assert info.value.param == "top_logprobs"


# ---- structured output and tools ------------------------------------------------------------------------
CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def assert_valid_arguments(name: str, args: dict) -> None:
    """``args`` is an instance of the tool's parameters schema (both are flat: strings and an enum)."""
    schema = (CITY_TOOL if name == "get_weather" else CLOCK_TOOL)["function"]["parameters"]
    assert set(args) == set(schema["required"]), args
    for key, value in args.items():
        prop = schema["properties"][key]
        if "enum" in prop:
            assert value in prop["enum"], args
        else:
            assert isinstance(value, str) and len(value) <= prop["maxLength"], args


def test_sdk_parse_returns_valid_objects_for_every_committed_prompt(http_cluster, served):
    """``client.chat.completions.parse`` with the committed pydantic model, temperature 1.0 and 256
    tokens: every answer parses (the SDK raises on a ``length`` finish and on a failed validation)."""
    from tests.structured_models import CONTACT_PROMPTS, Contact

    c = http_cluster

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i: int, prompt: str):
            r = await client.chat.completions.parse(
                model=served,
                messages=[{"role": "user", "content": prompt}],
                response_format=Contact,
                temperature=1.0,
                max_tokens=256,
                seed=i,
            )
            return r.choices[0]

        choices = await asyncio.gather(*(one(i, p) for i, p in enumerate(CONTACT_PROMPTS)))
        await client.close()
        return choices

    choices = asyncio.run(asyncio.wait_for(main(), 300))
    assert len(choices) == 20
    for ch in choices:
        assert ch.finish_reason == "stop" and isinstance(ch.message.parsed, Contact)
    c.assert_no_leaks()


def test_required_and_named_tool_calls_parse_and_streaming_agrees(http_cluster, served):
    c = http_cluster
    client = openai.OpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
        kw = {
            "model": served,
            "messages": msgs,
            "tools": [CITY_TOOL, CLOCK_TOOL],
            "tool_choice": choice,
            "temperature": 1.0,
            "seed": 11,
            "max_tokens": 128,
        }
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name in names and call.id
        assert_valid_arguments(call.function.name, json.loads(call.function.arguments))
        # The same seed streamed: the same call, in tool_calls deltas.
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            (call.function.name, call.function.arguments)
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # A JSON schema response: the same seed gives the same text streamed and not.
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "call", "schema": CITY_TOOL["function"]["parameters"]},
    }
    kw = {"model": served, "messages": msgs, "response_format": fmt, "temperature": 1.0, "seed": 5}
    whole = client.chat.completions.create(max_tokens=128, **kw).choices[0].message.content
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(stream=True, max_tokens=128, **kw)
    )
    assert streamed == whole
    assert_valid_arguments("get_weather", json.loads(whole))
    client.close()
    c.assert_no_leaks()


def test_lm_eval_through_pdserve_equals_lm_eval_on_transformers(
    pd_http_cluster, served, tiny_served_model, monkeypatch
):
    """Acceptance: lm-evaluation-harness' local-completions model on pdserve's completions endpoint (1P+1D:
    the prefill worker scores every prompt) gives the per-item loglikelihoods of its hf model on the same
    weights (float32) within 1e-3, and the same accuracy, on the first 8 items of the local task."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the [test] extras")
    from benchmarks.lm_eval_compare import OFFLINE, compare, format_report

    for name in OFFLINE:
        monkeypatch.setenv(name, "1")
    result = compare(f"{pd_http_cluster.http_url}/v1/completions", served, tiny_served_model, limit=8)
    print(format_report(result))
    assert result.items == 8 and result.max_abs_diff < 1e-3
    assert result.acc_pdserve == result.acc_hf and result.same_choices
    pd_http_cluster.assert_no_leaks()


def test_a_constrained_request_on_1p1d_obeys_the_grammar_from_the_prefill_workers_first_token(
    pd_http_cluster, served
):
    """The prefill worker samples token 0 under the grammar; the decode worker's matcher takes it and
    goes on (were token 0 outside the grammar, the decode worker would end the output there)."""
    from tests.structured_models import Contact

    c = pd_http_cluster
    client = openai.OpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    kw = {"model": served, "messages": [{"role": "user", "content": "A number, please."}], "max_tokens": 16}
    free = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    digits = client.chat.completions.create(temperature=0, extra_body={"guided_regex": "[0-9]{4}"}, **kw)
    assert not free[:1].isdigit()  # (greedy's first token is no digit ...)
    text = digits.choices[0].message.content  # (... the grammar's is)
    assert text.isdigit() and len(text) == 4 and digits.choices[0].finish_reason == "stop"
    r = client.chat.completions.parse(
        model=served,
        messages=[{"role": "user", "content": "A contact card, please."}],
        response_format=Contact,
        temperature=1.0,
        seed=3,
        max_tokens=256,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Contact)


def _prefill_counters(c) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The prefill worker's transfers opened, KV bytes sent and prompt tokens prefilled, from its metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    (prefill,) = [w for w in c.workers() if w["role"] == "prefill"]
    with urllib.request.urlopen(prefill["metrics_url"], timeout=10) as resp:
        text = resp.read().decode()
    names = {
        "pdserve_kv_transfer_opened_total": "opened",
        "pdserve_kv_transfer_bytes_total": "bytes",
        "pdserve_prefill_tokens_total": "prefilled",
    }
    out = dict.fromkeys(names.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names and s.labels.get("role") == "prefill":
                out[names[s.name]] += s.value
    return out


def test_n_choices_cross_once_in_1p1d_and_equal_requests_with_the_derived_seeds(
    pd_http_cluster, http_cluster, served
):
    """n=4 on 1P+1D: the prompt is prefilled once and its KV crosses once (one transfer, the bytes of an
    n=1 request of a prompt as long); usage counts the prompt once. With a seed the four choices are the
    four requests seeded seed..seed+3 (a prompt shorter than a KV block: no prefix-cache hit changes how
    any of them is computed), and a colocated worker's; the SDK's n=3, streamed and not, gives the same
    choices by index."""
    c = pd_http_cluster
    sampling = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}

    def run(req: g.GenerateRequest, on=c) -> tuple[dict[int, tuple[list[int], str, str]], g.Usage]:
        choices: dict[int, tuple[list[int], str, str]] = {}
        with on.channel() as channel:
            _, _, _, msgs = generate(on.stub(channel), req)
        for _, m in msgs:
            ids_, text, finish = choices.get(m.index, ([], "", ""))
            choices[m.index] = (ids_ + list(m.token_ids), text + m.text, m.finish_reason or finish)
        assert [m.HasField("usage") for _, m in msgs].count(True) == 1
        return choices, msgs[-1][1].usage

    # Two fresh prompts of 40 tokens (two full KV blocks and a partial one): n=1, then n=4.
    moved = []
    for first, n in ((300, 1), (700, 4)):
        before = _prefill_counters(c)
        req = g.GenerateRequest(
            prompt_token_ids=g.TokenIds(ids=list(range(first, first + 40))),
            sampling=g.SamplingParams(n=n, **sampling),
        )
        choices, usage = run(req)
        after = _prefill_counters(c)
        assert sorted(choices) == list(range(n)) and all(len(t) == 8 for t, _, _ in choices.values())
        assert (usage.prompt_tokens, usage.completion_tokens) == (40, 8 * n)
        assert after["opened"] - before["opened"] == 1 and after["prefilled"] - before["prefilled"] == 40
        moved.append(after["bytes"] - before["bytes"])
    assert moved[0] > 0 and moved[1] == moved[0]  # one prompt's KV, whatever n

    seeded = g.SamplingParams(n=4, seed=2**64 - 2, **sampling)  # choices 2 and 3 wrap to seeds 0 and 1
    choices, _ = run(g.GenerateRequest(prompt=PROMPTS[0], sampling=seeded))
    for i in range(4):
        alone = g.SamplingParams(seed=(seeded.seed + i) % 2**64, **sampling)
        one, _ = run(g.GenerateRequest(prompt=PROMPTS[0], sampling=alone))
        assert choices[i] == one[0], i
    assert len({tuple(t) for t, _, _ in choices.values()}) > 1
    assert run(g.GenerateRequest(prompt=PROMPTS[0], sampling=seeded), http_cluster)[0] == choices  # colocated

    client = openai.OpenAI(base_url=f"{c.http_url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = {
        "model": served,
        "prompt": PROMPTS[0],
        "n": 3,
        "seed": 7,
        "max_tokens": 8,
        "extra_body": {"ignore_eos": True},
    }
    r = client.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24  # the prompt once: usage is the request's
    streamed = {0: "", 1: "", 2: ""}
    finishes = {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == [ch.text for ch in r.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert (
        chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 24
    )
    chat = client.chat.completions.create(model=served, messages=CHAT, n=3, seed=7, max_tokens=4)
    assert [ch.index for ch in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens <= 12
    client.close()
    c.assert_no_leaks()
    http_cluster.assert_no_leaks()


def test_n_choices_with_logprobs_and_a_grammar_on_1p1d_equal_the_colocated_workers(
    pd_http_cluster, http_cluster, served
):
    """Seeded n=3 with logprobs and a regex on 1P+1D: the prefill worker samples and scores every choice's
    token 0 under the grammar, the decode worker forks the choices with a matcher each; every choice
    matches the grammar, its logprobs are of its own tokens, and all equal a colocated worker's. With echo
    (completions) every choice's text starts with the prompt."""
    sampling = g.SamplingParams(
        n=3, seed=11, temperature=1.0, max_tokens=12, logprobs=1, prompt_logprobs=0, presence_penalty=0.5
    )
    sampling.structured_outputs.regex = "(cat|dog|owl) [0-9]{2,4}"
    req = g.GenerateRequest(prompt=PROMPTS[0], sampling=sampling)

    def run(on) -> dict[int, tuple[list[int], str, list[float]]]:
        with on.channel() as channel:
            _, _, _, msgs = generate(on.stub(channel), req)
        assert [bool(m.prompt_logprobs) for _, m in msgs].count(True) == 1  # the prompt's once
        out: dict[int, tuple[list[int], str, list[float]]] = {}
        for _, m in msgs:
            assert [e.token_id for e in m.logprobs] == list(m.token_ids)  # each choice's own
            ids_, text, lps = out.get(m.index, ([], "", []))
            out[m.index] = (ids_ + list(m.token_ids), text + m.text, lps + [e.logprob for e in m.logprobs])
        return out

    pd, co = run(pd_http_cluster), run(http_cluster)
    assert sorted(pd) == [0, 1, 2]
    for i in range(3):
        assert re.fullmatch("(cat|dog|owl) [0-9]{2,4}", pd[i][1]), pd[i][1]
        assert pd[i][0] == co[i][0] and pd[i][2] == pytest.approx(co[i][2], abs=LOGPROB_TOL)
    client = openai.OpenAI(
        base_url=f"{pd_http_cluster.http_url}/v1", api_key="none", max_retries=0, timeout=60
    )
    r = client.completions.create(
        model=served, prompt=PROMPTS[0], n=2, seed=3, max_tokens=4, echo=True, logprobs=1
    )
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.text.startswith(PROMPTS[0]) and ch.logprobs.token_logprobs[0] is None for ch in r.choices)
    client.close()
    pd_http_cluster.assert_no_leaks()
    http_cluster.assert_no_leaks()
