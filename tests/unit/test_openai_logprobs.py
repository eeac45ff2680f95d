"""Logprobs and echo on the OpenAI front, pure: what a request asks the router for, and the completions
(legacy lists, echo, max_tokens 0) and chat shapes of the router's ``TokenLogprobs``, streamed and not;
and the router merging a prefill worker's token 0 with a decode worker's stream (``LogprobRelay``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.proto import generation_pb2 as g
from pdserve.router.detok import Detokenizer
from pdserve.router.logprobs import LogprobRelay
from pdserve.router.openai.logprobs import ResponseOptions
from pdserve.router.openai.mapping import Collected, EventStream, Kind, response_options
from pdserve.router.openai.protocol import ChatCompletionRequest, CompletionRequest, decode_request
from pdserve.router.stream import Output, deliver
from pdserve.router.validate import Prepared
from tests.unit.test_openai_mapping import chat, completion, events

TEXT = {1: "The", 2: " cat", 3: " sat", 4: "!", 5: " dog"}


def entry(token: int, logprob: float | None, top: dict[int, float] | None = None) -> g.TokenLogprobs:
    e = g.TokenLogprobs(token_id=token)
    if logprob is not None:
        e.logprob = logprob
    for t, v in (top or {}).items():
        e.top_token_ids.append(t)
        e.top_logprobs.append(v)
    return e


def opts(**kw) -> ResponseOptions:
    return ResponseOptions(token_text=lambda t: TEXT[t], **kw)


PROMPT = [entry(1, None), entry(2, -1.5, {5: -0.5})]
OUT = [entry(3, -0.25, {3: -0.25}), entry(4, -2.0, {3: -0.125})]


def message(text, ids, lps, prompt=(), finish="") -> g.GenerateResponse:
    m = g.GenerateResponse(request_id="r", token_ids=ids, text=text, finish_reason=finish)
    m.logprobs.extend(lps)
    m.prompt_logprobs.extend(prompt)
    if finish:
        m.usage.prompt_tokens, m.usage.completion_tokens = 2, len(ids)
    return m


def test_requests_ask_the_router_for_what_the_client_asked():
    s = completion(prompt="x", logprobs=3).sampling
    assert s.logprobs == 3 and not s.HasField("prompt_logprobs")
    s = completion(prompt=[[1, 2]], echo=True, logprobs=1, max_tokens=0).sampling
    assert (s.logprobs, s.prompt_logprobs, s.max_tokens) == (1, 1, 0)
    assert not completion(prompt="x", echo=True).sampling.HasField("prompt_logprobs")
    s = chat(messages=[{"role": "user", "content": "x"}], logprobs=True).sampling
    assert s.logprobs == 0
    s = chat(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=20).sampling
    assert s.logprobs == 20
    assert not chat(messages=[{"role": "user", "content": "x"}], logprobs=False).sampling.HasField("logprobs")
    # Echo shows the prompt as sent, or its token ids decoded.
    req = decode_request(b'{"prompt": ["hi"], "echo": true}', CompletionRequest)
    assert response_options(req, str, lambda ids: "?").echo == "hi"
    req = decode_request(b'{"prompt": [[1, 2]], "echo": true, "logprobs": 0}', CompletionRequest)
    o = response_options(req, str, lambda ids: "".join(TEXT[t] for t in ids))
    assert (o.echo, o.logprobs) == ("The cat", 0)
    req = decode_request(b'{"messages": [], "logprobs": true, "top_logprobs": 2}', ChatCompletionRequest)
    assert response_options(req, str, str).logprobs == 2


def test_completion_with_echo_shows_the_prompt_and_its_logprobs_first():
    c = Collected(Kind.COMPLETION, "cmpl-1", 1, "m", opts(echo="The cat", logprobs=1))
    c.feed(message(" sat", [3], OUT[:1], PROMPT))
    c.feed(message("!", [4], OUT[1:], finish="length"))
    choice = json.loads(c.response())["choices"][0]
    assert choice["text"] == "The cat sat!"
    assert choice["logprobs"] == {
        "tokens": ["The", " cat", " sat", "!"],
        "token_logprobs": [None, -1.5, -0.25, -2.0],
        "top_logprobs": [None, {" dog": -0.5, " cat": -1.5}, {" sat": -0.25}, {" sat": -0.125, "!": -2.0}],
        "text_offset": [0, 3, 7, 11],
    }
    # max_tokens 0: the prompt alone (the router sends the finish with the prompt's logprobs).
    c = Collected(Kind.COMPLETION, "cmpl-2", 1, "m", opts(echo="The cat", logprobs=1))
    c.feed(message("", [], [], PROMPT, finish="length"))
    choice = json.loads(c.response())["choices"][0]
    assert choice["text"] == "The cat" and choice["logprobs"]["token_logprobs"] == [None, -1.5]


def test_streamed_chunks_carry_their_tokens_logprobs_held_back_text_included():
    s = EventStream(Kind.COMPLETION, "cmpl-1", 1, "m", False, opts(logprobs=0))
    # The first message's text is held back (it may begin a stop string): its logprobs wait with it.
    out = s.feed(message("", [3], OUT[:1])) + s.feed(message(" sat!", [4], OUT[1:], finish="length"))
    (chunk,) = [e for e in events(out + s.end()) if e != "[DONE]"]
    lp = chunk["choices"][0]["logprobs"]
    assert lp["tokens"] == [" sat", "!"] and lp["text_offset"] == [0, 4]
    s = EventStream(Kind.CHAT, "chatcmpl-1", 1, "m", False, opts(logprobs=1))
    out = s.feed(message(" sat", [3], OUT[:1])) + s.feed(message("!", [4], OUT[1:], finish="stop"))
    chunks = [e for e in events(out) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role's chunk
    contents = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:]]
    assert contents == [
        [{"token": " sat", "logprob": -0.25, "bytes": [32, 115, 97, 116], "top_logprobs": [
            {"token": " sat", "logprob": -0.25, "bytes": [32, 115, 97, 116]}]}],
        [{"token": "!", "logprob": -2.0, "bytes": [33], "top_logprobs": [
            {"token": " sat", "logprob": -0.125, "bytes": [32, 115, 97, 116]}]}],
    ]  # fmt: skip
    c = Collected(Kind.CHAT, "chatcmpl-2", 1, "m", opts(logprobs=1))
    c.feed(message(" sat", [3], OUT[:1]))
    c.feed(message("!", [4], OUT[1:], finish="stop"))
    assert json.loads(c.response())["choices"][0]["logprobs"]["content"] == contents[0] + contents[1]


class _Stream:
    def step(self, token_id: int) -> str:
        return TEXT[token_id]


def _prepared(**kw) -> Prepared:
    params = SamplingParams(max_tokens=8, **kw)
    return Prepared("r", [1, 2], params, g.SamplingParams())


def test_the_router_merges_token_0_from_the_prefill_worker_with_the_decode_stream():
    prep = _prepared(logprobs=1, prompt_logprobs=1)
    out = Output(prep, [Detokenizer(_Stream(), prep.params)])
    sent: list[g.GenerateResponse] = []

    async def write(resp):
        sent.append(resp)

    async def main():
        out.logprobs.prefilled([OUT[0]], PROMPT[1:])  # P's answer: token 0's and the prompt's
        await deliver(out, [3], 0, "", write, [OUT[0]])
        # D's first message repeats token 0 without its logprobs (P sampled it): skipped.
        await deliver(out, [3, 4], 0, "length", write, OUT[1:])

    asyncio.run(main())
    assert [list(m.token_ids) for m in sent] == [[3], [4]]
    assert [e.token_id for e in sent[0].prompt_logprobs] == [1, 2] and not sent[1].prompt_logprobs
    assert [list(m.logprobs) for m in sent] == [OUT[:1], OUT[1:]]
    # Tokens without logprobs where none may be missing: an error, never a silent gap.
    bare = Output(prep, [Detokenizer(_Stream(), prep.params)])
    with pytest.raises(Exception, match="sent 0 logprobs for 1 tokens"):
        asyncio.run(deliver(bare, [3], 1, "", write, []))
    assert LogprobRelay.of(_prepared()) is None
