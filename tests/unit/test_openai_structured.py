"""The OpenAI front's structured output and tools, pure: ``response_format`` and vLLM's options onto the
proto's constraint (400s naming the field), ``tools`` / ``tool_choice``, the generic tool prompt, and the
output read back as ``tool_calls``, streamed and not. No server."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.structured import MAX_STRUCTURED_OUTPUT_BYTES
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.tools import ToolSpec, tool_call_schema
from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.mapping import Collected, EventStream, Kind, chat_request, completion_request
from pdserve.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    decode_request,
    error_from_status,
)
from pdserve.router.openai.tools import ToolCallStream, ToolChoice, parse_tool_calls, tool_plan
from pdserve.router.validate import InvalidRequest, ModelLimits, prepare

MSGS = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def chat(**body) -> g.GenerateRequest:
    return chat_request(decode_request(json.dumps(body).encode(), ChatCompletionRequest), "chatcmpl-1")


def completion(**body) -> g.GenerateRequest:
    return completion_request(decode_request(json.dumps(body).encode(), CompletionRequest), "cmpl-1")


def error_of(fn, **body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(**body)
    return info.value


def response(text: str, ids=(1,), finish: str = "stop") -> g.GenerateResponse:
    m = g.GenerateResponse(request_id="r", token_ids=list(ids), text=text, finish_reason=finish)
    if finish:
        m.usage.prompt_tokens, m.usage.completion_tokens = 5, len(ids)
    return m


def events(data: bytes) -> list:
    return [
        json.loads(b.removeprefix("data: ")) for b in data.decode().split("\n\n") if b and "[DONE]" not in b
    ]


# ---- response_format and vLLM's options ----------------------------------------------------------------
def test_response_format_and_vllm_options_become_the_constraint():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    for fn, body in ((chat, {"messages": MSGS}), (completion, {"prompt": "x"})):
        so = fn(**body, response_format=fmt).sampling.structured_outputs
        assert so.WhichOneof("kind") == "json" and json.loads(so.json) == SCHEMA
        assert fn(**body, response_format={"type": "json_object"}).sampling.structured_outputs.json_object
        assert not fn(**body, response_format={"type": "text"}).sampling.HasField("structured_outputs")
        assert fn(**body, guided_regex="[a-z]+").sampling.structured_outputs.regex == "[a-z]+"
        assert list(fn(**body, guided_choice=["a", "b"]).sampling.structured_outputs.choice.choices) == [
            "a",
            "b",
        ]
        assert fn(**body, guided_json=SCHEMA).sampling.structured_outputs.json
        assert fn(**body, structured_outputs={"grammar": 'root ::= "x"'}).sampling.structured_outputs.grammar
        assert not fn(**body).sampling.HasField("structured_outputs")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "with a name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
            "does not compile: Invalid type: foo",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"description": "x" * MAX_STRUCTURED_OUTPUT_BYTES},
                    },
                }
            },
            "response_format",
            "at most 65,536",
        ),
        ({"guided_regex": "(("}, "guided_regex", "does not compile"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs",
            "structural_tag is not supported",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "both constrain",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_sent(body, param, words):
    for fn, base in ((chat, {"messages": MSGS}), (completion, {"prompt": "x"})):
        err = error_of(fn, **base, **body)
        assert (err.status, err.info.param) == (400, param) and words in err.info.message, err.info.message


def test_grpc_names_the_constraint_field_and_http_maps_a_router_error_onto_response_format():
    class Tok:
        eos_token_ids = (0,)
        max_token_chars = None

        def encode(self, text, add_special_tokens=True):
            return [1, 2]

    req = g.GenerateRequest(prompt="x")
    req.sampling.structured_outputs.json = '{"type": "foo"}'
    with pytest.raises(InvalidRequest, match=r"^sampling\.structured_outputs\.json does not compile"):
        prepare(req, Tok(), ModelLimits(context_length=64, vocab_size=32))  # type: ignore[arg-type]
    req.sampling.structured_outputs.regex = "a" * (MAX_STRUCTURED_OUTPUT_BYTES + 1)
    with pytest.raises(InvalidRequest, match=r"^sampling\.structured_outputs\.regex has 65,537 bytes"):
        prepare(req, Tok(), ModelLimits(context_length=64, vocab_size=32))  # type: ignore[arg-type]
    err = error_from_status("INVALID_ARGUMENT", "sampling.structured_outputs.json does not compile: x")
    assert err.info.param == "response_format"


# ---- tools ------------------------------------------------------------------------------------------------
def test_tool_choice_plans():
    def plan(tools, choice=None):
        raw = lambda v: decode_request(json.dumps({"tools": v}).encode(), ChatCompletionRequest).tools  # noqa: E731
        rc = decode_request(json.dumps({"tool_choice": choice}).encode(), ChatCompletionRequest).tool_choice
        return tool_plan(raw(tools), rc)

    assert plan(None) is None and plan([]) is None and plan(None, "auto") is None
    assert plan([WEATHER]).choice is ToolChoice.AUTO
    assert plan([WEATHER], "none").choice is ToolChoice.NONE
    req = plan([WEATHER, TIME], "required")
    assert req.choice is ToolChoice.REQUIRED and [t.name for t in req.forced] == ["get_weather", "get_time"]
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.choice is ToolChoice.NAMED and [t.name for t in named.forced] == ["get_time"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "of type function"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
                "tool_choice": "required",
            },
            "tools",
            "does not compile",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "constrained too",
        ),
        ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(body, param, words):
    err = error_of(chat, messages=MSGS, **body)
    assert (err.status, err.info.param) == (400, param) and words in err.info.message, err.info.message


def test_tools_travel_with_the_messages_and_required_or_named_calls_are_enforced():
    auto = chat(messages=MSGS, tools=[WEATHER, TIME])
    assert [t.name for t in auto.messages.tools] == ["get_weather", "get_time"]
    assert json.loads(auto.messages.tools[0].parameters) == WEATHER["function"]["parameters"]
    assert not auto.sampling.HasField("structured_outputs")
    assert not chat(messages=MSGS, tools=[WEATHER], tool_choice="none").messages.tools
    required = chat(messages=MSGS, tools=[WEATHER, TIME], tool_choice="required")
    specs = [
        ToolSpec("get_weather", "", WEATHER["function"]["parameters"]),
        ToolSpec("get_time", "", {"type": "object"}),
    ]
    assert json.loads(required.sampling.structured_outputs.json) == tool_call_schema(specs)
    named = chat(
        messages=MSGS,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(named.sampling.structured_outputs.json) == tool_call_schema(specs[:1])
    # A conversation that carries on after a call: the call and its result are in the history.
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    req = chat(messages=history, tools=[WEATHER])
    assert [(m.role, m.content) for m in req.messages.messages[1:]] == [
        ("assistant", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("tool", "sunny"),
    ]


def test_the_generic_tool_prompt_on_a_template_without_a_tool_format(tiny_served_model):
    tok = Tokenizer.from_dir(tiny_served_model)  # SmolLM2's template: no tool format
    assert not tok.renders_tools
    tools = [ToolSpec("get_weather", "The weather in a city.", {"type": "object"})]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "sunny"}]
    text = tok.render_chat(msgs, tools=tools)
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert (
        '{"name": "get_weather", "description": "The weather in a city.", "parameters": {"type": "object"}}'
        in text
    )
    assert "<|im_start|>user\nThe function returned: sunny<|im_end|>" in text
    assert "SmolLM" not in text  # the listing is the system message
    with_system = tok.render_chat([{"role": "system", "content": "Be brief."}, *msgs[:1]], tools=tools)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert tok.render_chat(msgs[:1]) == tok.render_chat(msgs[:1], tools=())  # no tools: as before


def test_output_is_read_as_calls_only_when_it_is_calls_to_listed_tools():
    names = {"get_weather", "get_time"}
    one = parse_tool_calls('{"name":"get_weather","arguments":{"city":"Paris"}}', names)
    assert one is not None and len(one) == 1
    assert one[0].function.name == "get_weather" and json.loads(one[0].function.arguments) == {
        "city": "Paris"
    }
    assert one[0].type == "function" and one[0].id.startswith("call_")
    two = parse_tool_calls(
        '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":"{}"}]', names
    )
    assert two is not None and [c.function.name for c in two] == ["get_time", "get_weather"]
    for text in (
        '{"name":"other","arguments":{}}',
        "Paris is sunny",
        '{"name":"get_time","arguments":3}',
        "[]",
        '{"a":1}',
    ):
        assert parse_tool_calls(text, names) is None, text


def _plan(choice):
    body = {"tools": [WEATHER], "tool_choice": choice}
    req = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    return tool_plan(req.tools, req.tool_choice)


CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'


def test_calls_come_back_as_tool_calls_streamed_and_not_and_the_two_agree():
    for choice in ("auto", "required"):
        plan = _plan(choice)
        c = Collected(Kind.CHAT, "chatcmpl-1", 1, "smol", tools=plan)
        for piece in ('{"name":"get_', 'weather","arguments":', '{"city":"Paris"}}'):
            c.feed(response(piece, finish=""))
        c.feed(response("", finish="stop"))
        doc = json.loads(c.response())["choices"][0]
        assert doc["finish_reason"] == "tool_calls" and doc["message"]["content"] is None
        (call,) = doc["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        s = EventStream(Kind.CHAT, "chatcmpl-1", 1, "smol", False, tools=plan)
        out = s.feed(response('{"name":"get_', finish="")) + s.feed(
            response('weather","arguments":', finish="")
        )
        assert out == b""  # held back: it may be (it is) a call
        out += s.feed(response('{"city":"Paris"}}', finish="")) + s.feed(response("", finish="stop"))
        chunks = [e["choices"][0] for e in events(out)]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        (delta,) = chunks[1]["delta"]["tool_calls"]
        assert (
            delta["index"] == 0 and delta["function"] == call["function"] and delta["id"].startswith("call_")
        )
        assert [c["finish_reason"] for c in chunks] == [None, None, "tool_calls"]


def test_with_auto_text_that_is_no_call_streams_as_content_at_once():
    plan = _plan("auto")
    s = EventStream(Kind.CHAT, "chatcmpl-1", 1, "smol", False, tools=plan)
    first = s.feed(response("  It is", finish=""))
    assert [e["choices"][0]["delta"] for e in events(first)][-1] == {"content": "  It is"}
    rest = events(s.feed(response(" sunny.", finish="stop")))
    assert rest[-1]["choices"][0] == {
        "index": 0,
        "delta": {"content": " sunny."},
        "logprobs": None,
        "finish_reason": "stop",
    }
    # Text that opened like a call but was none comes out whole at the end, as content.
    s = ToolCallStream(plan)
    assert s.feed("{not a call") == "" and s.finish() == ("{not a call", None)
    c = Collected(Kind.CHAT, "chatcmpl-1", 1, "smol", tools=plan)
    c.feed(response("{not a call", finish="stop"))
    doc = json.loads(c.response())["choices"][0]
    assert (
        doc["message"] == {"content": "{not a call", "role": "assistant"} and doc["finish_reason"] == "stop"
    )
    # A call cut by max_tokens stays text, with its finish reason.
    c = Collected(Kind.CHAT, "chatcmpl-1", 1, "smol", tools=_plan("required"))
    c.feed(response('{"name":"get_weather","argu', finish="length"))
    assert json.loads(c.response())["choices"][0]["finish_reason"] == "length"
