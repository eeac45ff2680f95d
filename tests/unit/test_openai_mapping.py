"""The OpenAI front's pure logic: request decoding and mapping, SSE chunks, error bodies. No server."""

from __future__ import annotations

import json

import pytest

from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.mapping import (
    DONE,
    Collected,
    EventStream,
    Kind,
    chat_request,
    check_model,
    client_field_names,
    completion_request,
    sse_error,
)
from pdserve.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    decode_request,
    error_from_status,
)


def completion(**body) -> g.GenerateRequest:
    return completion_request(decode_request(json.dumps(body).encode(), CompletionRequest), "cmpl-1")


def chat(**body) -> g.GenerateRequest:
    return chat_request(decode_request(json.dumps(body).encode(), ChatCompletionRequest), "chatcmpl-1")


def error_of(fn, **body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(**body)
    return info.value


def events(data: bytes) -> list:
    """The SSE stream's events: parsed JSON, or the literal "[DONE]"."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def msg(text: str, ids: list[int], finish: str = "", usage: tuple[int, int] = (0, 0)) -> g.GenerateResponse:
    m = g.GenerateResponse(request_id="r", token_ids=ids, text=text, finish_reason=finish)
    if finish:
        m.usage.prompt_tokens, m.usage.completion_tokens = usage
    return m


# ---- requests -----------------------------------------------------------------------------------------


def test_completion_maps_prompt_forms_and_only_the_sampling_fields_sent():
    r = completion(model="m", prompt="hi there", max_tokens=5, temperature=0, stop="\n", seed=3)
    assert r.request_id == "cmpl-1" and r.WhichOneof("input") == "prompt" and r.prompt == "hi there"
    s = r.sampling
    assert (s.max_tokens, s.temperature, list(s.stop), s.seed) == (5, 0.0, ["\n"], 3)
    assert s.HasField("temperature") and not s.HasField("top_p") and not s.HasField("ignore_eos")
    assert not completion(prompt="x").sampling.HasField("max_tokens")  # OpenAI's default 16 is the engine's
    assert completion(prompt=["one"]).prompt == "one"
    assert list(completion(prompt=[5, 6, 7]).prompt_token_ids.ids) == [5, 6, 7]
    assert list(completion(prompt=[[5, 6]]).prompt_token_ids.ids) == [5, 6]
    empty = completion(prompt=[[]])
    assert empty.WhichOneof("input") == "prompt_token_ids" and not empty.prompt_token_ids.ids
    # vLLM's extensions, and top_k 0 meaning "off" as vLLM clients send it.
    s = completion(
        prompt="x", top_k=0, min_tokens=2, ignore_eos=True, stop_token_ids=[9], stop=["a", "b"]
    ).sampling
    assert (s.top_k, s.min_tokens, s.ignore_eos, list(s.stop_token_ids), list(s.stop)) == (
        -1,
        2,
        True,
        [9],
        ["a", "b"],
    )


def test_penalties_and_logit_bias_map_onto_the_proto_on_both_endpoints():
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.25}
    bias = {"5": -100, "12": 2.5}
    for s in (
        completion(prompt="x", logit_bias=bias, **fields).sampling,
        chat(messages=[{"role": "user", "content": "x"}], logit_bias=bias, **fields).sampling,
    ):
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
        assert dict(s.logit_bias) == {5: -100.0, 12: 2.5}
    s = completion(prompt="x", logit_bias={}).sampling
    assert not s.HasField("presence_penalty") and not s.HasField("repetition_penalty") and not s.logit_bias


def test_speculative_false_reaches_the_engine_params_and_unset_leaves_the_default():
    from pdserve.worker.convert import sampling_params_from_proto

    s = completion(prompt="x", speculative=False).sampling
    assert s.HasField("speculative") and s.speculative is False
    assert sampling_params_from_proto(s).speculative is False
    s = chat(messages=[{"role": "user", "content": "x"}]).sampling
    assert not s.HasField("speculative") and sampling_params_from_proto(s).speculative is True


def test_chat_maps_messages_text_parts_and_max_completion_tokens():
    r = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": None},
        ],
        max_tokens=7,
        max_completion_tokens=9,
        top_p=0.5,
    )
    assert [(m.role, m.content) for m in r.messages.messages] == [
        ("system", "be brief"),
        ("user", "hel\nlo"),  # text parts joined by a newline, as vLLM joins them
        ("assistant", ""),
    ]
    assert r.sampling.max_tokens == 9 and r.sampling.top_p == 0.5  # the newer name wins
    assert chat(messages=[{"role": "user", "content": "x"}], max_tokens=4).sampling.max_tokens == 4
    empty = chat(messages=[])
    assert empty.WhichOneof("input") == "messages"  # the router rejects it, naming "messages"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": -1}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # (0, the prompt alone, needs echo)
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "presence_penalty": 1e300}, "presence_penalty"),  # beyond a float32
        ({"prompt": "x", "logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-5": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1.5": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999999999": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"7": 1.0, "07": 2.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
    ],
)
def test_completion_refuses_what_it_does_not_implement_naming_the_param(body, param):
    err = error_of(completion, **body)
    assert err.status == 400 and err.info.param == param and err.info.type == "invalid_request_error"
    doc = json.loads(err.body())
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}


def test_chat_refusals_and_malformed_bodies():
    for body, param in (
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),  # no logprobs
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"messages": "hello"}, "messages"),
        ({}, "messages"),
    ):
        err = error_of(chat, **body)
        assert (err.status, err.info.param) == (400, param), body
    # Chat options pdserve does not implement: refused by name, never answered with plain text.
    msgs = [{"role": "user", "content": "x"}]
    for name, value in (
        ("echo", True),
        ("best_of", 3),
        ("best_of", True),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": False}),
    ):
        err = error_of(chat, messages=msgs, **{name: value})
        assert (err.status, err.info.param) == (400, name) and "not supported" in err.info.message, name
    # vLLM's options that change the output, on both endpoints (exploratory testing: accepted and ignored).
    for name, value in (
        ("include_stop_str_in_output", True),
        ("skip_special_tokens", False),
        ("spaces_between_special_tokens", False),
        ("use_beam_search", True),
        ("min_p", 0.1),
        ("prompt_logprobs", 1),
        ("allowed_token_ids", [5]),
        ("bad_words", ["Alex"]),
        ("truncate_prompt_tokens", 1),
        ("logits_processors", ["x.Y"]),
        ("vllm_xargs", {"a": 1}),
        ("return_token_ids", True),
        ("return_tokens_as_token_ids", True),
        ("prompt_embeds", "AAAA"),
    ):
        for endpoint, body in ((chat, {"messages": msgs}), (completion, {"prompt": "x"})):
            err = error_of(endpoint, **body, **{name: value})
            assert (err.status, err.info.param) == (400, name) and "not supported" in err.info.message, name
    # What guidellm sends: accepted (usage in the last chunk; refusing it failed every guidellm request).
    chat(messages=msgs, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    completion(
        prompt="x",
        return_token_ids=False,
        include_stop_str_in_output=False,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        use_beam_search=False,
        min_p=0.0,
        guided_json=None,
    )
    # Accepted as absent: what SDKs send by default.
    chat(
        messages=msgs,
        tools=[],
        response_format={"type": "text"},
        n=1,
        user="u",
        echo=False,
        best_of=1,
        tool_choice="auto",
        function_call="auto",
        modalities=["text"],
        functions=[],
        audio=None,
        add_generation_prompt=True,
        continue_final_message=False,
        min_p=0,
    )
    # Empty however it is spaced: `[ ]` is `[]`.
    raw = b'{"messages": [{"role": "user", "content": "x"}], "tools": [ ], "functions": { }}'
    chat_request(decode_request(raw, ChatCompletionRequest), "chatcmpl-1")
    for raw in (b"{not json", b"[1, 2]"):
        with pytest.raises(OpenAIError) as info:
            decode_request(raw, ChatCompletionRequest)
        assert info.value.status == 400
    # A lone high surrogate: msgspec calls the (whole) body truncated; the message says what is wrong.
    with pytest.raises(OpenAIError) as info:
        decode_request(rb'{"messages": [{"role": "user", "content": "a\ud800"}]}', ChatCompletionRequest)
    assert "lone UTF-16 surrogate" in info.value.info.message


def test_refusals_name_what_the_client_sent():
    """Each message names the value as sent and the bound the field really has."""
    err = error_of(completion, prompt="x", temperature=1e308)  # a 32-bit float field would hold inf
    assert err.info.param == "temperature" and "1e+308" in err.info.message
    err = error_of(completion, prompt="x", top_p=5e-324)  # ... or 0.0
    assert err.info.param == "top_p" and "5e-324" in err.info.message
    assert completion(prompt="x", temperature=0.7, top_p=1e-30).sampling.top_p > 0
    for bad in (-1, 0):
        err = error_of(completion, prompt="x", max_tokens=bad)
        assert err.info.param == "max_tokens" and "[1, " in err.info.message, err.info.message
        err = error_of(chat, messages=[{"role": "user", "content": "x"}], max_completion_tokens=bad)
        assert err.info.param == "max_completion_tokens" and err.info.message.startswith(
            "max_completion_tokens"
        )
    # The router's errors too name the field as the client sent it.
    sent_as = client_field_names(ChatCompletionRequest(messages=[], max_completion_tokens=9000))
    e = error_from_status("INVALID_ARGUMENT", "max_tokens is 9000, but the prompt has 3 tokens", sent_as)
    assert e.info.param == "max_completion_tokens" and e.info.message.startswith(
        "max_completion_tokens is 9000"
    )
    sent_as = client_field_names(CompletionRequest(prompt=[[]]))
    e = error_from_status("INVALID_ARGUMENT", "prompt_token_ids is empty", sent_as)
    assert (e.info.param, e.info.message) == ("prompt", "prompt is empty")
    assert client_field_names(ChatCompletionRequest(messages=[], max_tokens=5)) == {}
    err = error_of(chat, messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert err.info.param == "messages" and "needs its text" in err.info.message
    err = error_of(chat, messages=[{"content": "x"}])  # a nested field: the top-level field it is in
    assert err.info.param == "messages" and "`role`" in err.info.message
    err = error_of(chat)
    assert err.info.param == "messages"
    with pytest.raises(OpenAIError) as info:  # a string holding bytes that are not UTF-8
        decode_request(b'{"prompt": "Hi\xff", "max_tokens": 2}', CompletionRequest)
    assert info.value.status == 400 and "UTF-8" in info.value.info.message


def test_token_ids_past_the_context_are_refused_by_their_count():
    body = CompletionRequest(prompt=[1] * 5_000_000)
    with pytest.raises(OpenAIError) as info:
        completion_request(body, "cmpl-1", context_length=100)
    err = info.value.info
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    assert err.message.startswith("prompt has 5000000 tokens; the model's context is 100 tokens")
    assert (
        list(completion_request(CompletionRequest(prompt=[[3] * 99]), "c", 100).prompt_token_ids.ids)
        == [3] * 99
    )
    assert error_of(completion, prompt=[[1, 2**32]]).info.param == "prompt"  # the proto's bound, by the loop


def test_model_name_must_match_or_be_omitted():
    check_model(None, "smol")
    check_model("smol", "smol")
    err = error_of(check_model, requested="gpt-4", served="smol")
    assert (err.status, err.info.code, err.info.param) == (404, "model_not_found", "model")


def test_grpc_status_maps_to_http_status_type_and_param():
    cases = [
        ("INVALID_ARGUMENT", "sampling.top_p must be in (0, 1], got 1.5", 400, "top_p", None),
        ("INVALID_ARGUMENT", "prompt is empty", 400, "prompt", None),
        (
            "INVALID_ARGUMENT",
            "prompt_token_ids has 30 tokens; the model's context is 24 tokens",
            400,
            "prompt",
            "context_length_exceeded",
        ),
        ("INVALID_ARGUMENT", "messages: unknown role 'wizard'", 400, "messages", None),
        ("RESOURCE_EXHAUSTED", "the router queue is full", 429, None, "rate_limit_exceeded"),
        ("UNAVAILABLE", "no decode or colocated worker is available", 503, None, "service_unavailable"),
        ("DEADLINE_EXCEEDED", "deadline", 504, None, "timeout"),
        ("INTERNAL", "decode worker ended without a finish", 500, None, None),
    ]
    for code, details, status, param, err_code in cases:
        e = error_from_status(code, details)
        assert (e.status, e.info.param, e.info.code) == (status, param, err_code), code
    assert error_from_status("INVALID_ARGUMENT", "sampling.top_p must be in (0, 1]").info.message.startswith(
        "top_p"
    )


# ---- responses ----------------------------------------------------------------------------------------


def test_completion_stream_chunks_then_usage_chunk_last_then_done():
    s = EventStream(Kind.COMPLETION, "cmpl-1", 1700, "smol", include_usage=True)
    out = (
        s.feed(msg("hello", [4]))
        + s.feed(msg("", [5]))
        + s.feed(msg(" world", [6], "length", (3, 3)))
        + s.end()
    )
    ev = events(out)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(
        c["object"] == "text_completion" and c["id"] == "cmpl-1" and c["created"] == 1700 for c in chunks
    )
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["hello", " world"]  # no empty-text chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_stream_sends_the_role_first_and_no_usage_chunk_unless_asked():
    s = EventStream(Kind.CHAT, "chatcmpl-1", 1700, "smol", include_usage=False)
    out = s.feed(msg("", [1])) + s.feed(msg("hi", [4])) + s.feed(msg("", [2], "stop", (6, 2))) + s.end()
    ev = events(out)
    assert ev[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in ev[:-1])
    deltas = [c["choices"][0]["delta"] for c in ev[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "hi"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in ev[:-1]] == [None, None, "stop"]
    assert s.usage is not None and s.usage.total_tokens == 8  # known, but not sent


def test_non_streaming_bodies_and_error_events():
    c = Collected(Kind.CHAT, "chatcmpl-1", 1700, "smol")
    for m in (msg("hel", [1]), msg("lo", [2], "stop", (4, 2))):
        c.feed(m)
    doc = json.loads(c.response())
    assert doc["object"] == "chat.completion" and doc["model"] == "smol"
    assert doc["choices"] == [
        {
            "index": 0,
            "message": {"content": "hello", "role": "assistant"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert doc["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    c = Collected(Kind.COMPLETION, "cmpl-1", 1700, "smol")
    c.feed(msg("abc", [1, 2], "length", (1, 2)))
    doc = json.loads(c.response())
    assert doc["object"] == "text_completion" and doc["choices"][0]["text"] == "abc"
    ev = events(sse_error(error_from_status("UNAVAILABLE", "decode worker d1 failed")))
    assert ev[0]["error"]["message"] == "decode worker d1 failed" and ev[0]["error"]["type"]
    assert ev[1] == "[DONE]" and sse_error(error_from_status("UNAVAILABLE", "x")).endswith(DONE)


def test_a_prompt_list_mixing_ids_and_text_is_named_as_such_not_as_a_batch():
    err = error_of(completion, prompt=[1, "a"])
    assert (err.status, err.info.param) == (400, "prompt") and "not both" in err.info.message
    assert "batch of 2" in error_of(completion, prompt=["a", "b"]).info.message


def test_max_completion_tokens_on_completions_is_refused_by_name_not_ignored():
    """Chat's name for max_tokens was silently ignored on /v1/completions (16 tokens for a request of 5)."""
    err = error_of(completion, prompt="hi", max_completion_tokens=5)
    assert (err.status, err.info.param) == (400, "max_completion_tokens") and "max_tokens" in err.info.message
    assert completion(prompt="hi", max_tokens=5, max_completion_tokens=None).sampling.max_tokens == 5
    assert (
        chat(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5).sampling.max_tokens == 5
    )
