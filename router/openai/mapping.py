"""OpenAI requests onto ``pdserve.v1`` ``GenerateRequest``, and ``GenerateResponse`` messages back onto
OpenAI responses and server-sent-event chunks. Pure: protobuf messages, no grpc.

Only what the HTTP API alone has (model name, ``best_of``, unsupported options) is checked here; values
are left to the router's own validation, so both fronts reject exactly the same requests. With ``n`` > 1
each response message is one choice's (its ``index``): chunks carry it, and a whole body gathers them.
"""

from __future__ import annotations

import enum
import math
import re
import struct
from collections.abc import Callable, Mapping

import msgspec

from pdserve.engine.params import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, check_prompt_length
from pdserve.engine.tools import tool_call_text
from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.choices import Choices, ChoiceState, chat_choice, completion_choice
from pdserve.router.openai.logprobs import ResponseOptions, chat_logprobs, completion_logprobs
from pdserve.router.openai.protocol import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessageIn,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorBody,
    OpenAIError,
    ToolCallDelta,
    Usage,
    encode,
    invalid,
    present,
)
from pdserve.router.openai.structured import structured_outputs_of
from pdserve.router.openai.tools import ToolChoice, ToolPlan, tool_plan

DONE = b"data: [DONE]\n\n"
_UINT32 = (1 << 32) - 1
_INT32 = (1 << 31) - 1
_UINT64 = (1 << 64) - 1


class Kind(enum.Enum):
    COMPLETION = "text_completion"
    CHAT = "chat.completion"

    @property
    def id_prefix(self) -> str:
        return "cmpl-" if self is Kind.COMPLETION else "chatcmpl-"


def check_model(requested: str | None, served: str) -> None:
    """A request may omit ``model``; naming another one is OpenAI's 404."""
    if requested is not None and requested != served:
        raise OpenAIError(
            404,
            f"The model `{requested}` does not exist. This server serves `{served}`.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Options the API has and pdserve does not implement: refused, never silently ignored."""
    if present(req.tools) and not isinstance(req, ChatCompletionRequest):
        raise invalid("tools is a chat completions field", "tools")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options can only be set when stream is true", "stream_options")
    _refuse_unsupported(req, UNSUPPORTED)


def _bounded(name: str, value: int, low: int, high: int) -> int:
    """A value the proto field can hold (the router then checks what the engine accepts)."""
    if not low <= value <= high:
        raise invalid(f"{name} must be in [{low}, {high}], got {value}", name)
    return value


def _float32(name: str, value: float) -> float:
    """A value the proto's 32-bit float field keeps meaning: one it would turn into infinity or zero is
    refused here, naming what the client sent (the router would see only ``inf`` or ``0.0``)."""
    try:
        narrowed = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # (older Pythons refuse to pack what a float32 cannot hold)
        narrowed = math.inf
    if (math.isinf(narrowed) and math.isfinite(value)) or (narrowed == 0.0 and value != 0.0):
        raise invalid(f"{name} is {value!r}: out of the range a 32-bit float holds", name)
    return value


def _sampling(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    max_tokens_name: str = "max_tokens",
) -> g.SamplingParams:
    """Only what the client sent is set: unset proto3 optionals keep the engine's defaults.
    ``max_tokens_name``: the field the client sent it in."""
    s = g.SamplingParams()
    if max_tokens is not None:
        s.max_tokens = _bounded(max_tokens_name, max_tokens, 1, _UINT32)
    if req.temperature is not None:
        s.temperature = _float32("temperature", req.temperature)
    if req.top_p is not None:
        s.top_p = _float32("top_p", req.top_p)
    if req.top_k is not None:
        # vLLM clients send 0 as well as -1 for "off"; the engine spells it -1.
        s.top_k = -1 if req.top_k == 0 else _bounded("top_k", req.top_k, -_INT32 - 1, _INT32)
    if req.seed is not None:
        s.seed = _bounded("seed", req.seed, 0, _UINT64)
    if req.min_tokens is not None:
        s.min_tokens = _bounded("min_tokens", req.min_tokens, 0, _UINT32)
    if req.ignore_eos is not None:
        s.ignore_eos = req.ignore_eos
    if req.speculative is not None:
        s.speculative = req.speculative
    if req.stop is not None:
        s.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop)
    if req.stop_token_ids is not None:
        s.stop_token_ids.extend(_bounded("stop_token_ids", t, 0, _UINT32) for t in req.stop_token_ids)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            setattr(s, name, _float32(name, value))
    if req.logit_bias:
        s.logit_bias.update(_logit_bias(req.logit_bias))
    constraint = structured_outputs_of(req)
    if constraint is not None:
        s.structured_outputs.CopyFrom(constraint)
    if req.n is not None:
        s.n = _bounded("n", req.n, 0, _UINT32)  # (the router checks the range)
    return s


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # (uint32's digits at most)


def _logit_bias(bias: Mapping[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (JSON: token ids as string keys) as the proto's map; its size and values are
    the router's to check, what the proto cannot hold is refused here."""
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:  # (before reading a huge one)
        raise invalid(f"logit_bias has {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise invalid(
                f"logit_bias has the key {key!r}; keys must be token ids (integers >= 0)", "logit_bias"
            )
        t = _bounded("logit_bias", int(key), 0, _UINT32)
        if t in out:  # ("7" and "07")
            raise invalid(f"logit_bias has token id {t} twice", "logit_bias")
        out[t] = _float32("logit_bias", value)
    return out


def _token_ids(ids: list, context_length: int) -> list[int]:
    """A prompt's token ids as the proto holds them: a list longer than the context (when known) is
    refused before any id is looked at (a 64 MiB body holds millions), then C-level bounds checks."""
    try:
        check_prompt_length(len(ids), context_length or len(ids) + 1)
    except ValueError as e:
        raise invalid(str(e), "prompt", "context_length_exceeded") from None
    if ids and (min(ids) < 0 or max(ids) > _UINT32):
        for t in ids:  # names the first id out of range
            _bounded("prompt", t, 0, _UINT32)
    return ids


def completion_request(req: CompletionRequest, request_id: str, context_length: int = 0) -> g.GenerateRequest:
    """``POST /v1/completions`` as a ``GenerateRequest``; ``context_length``: the model's, when known (0:
    not). Raises OpenAIError (400)."""
    _check_common(req)
    if req.suffix:
        raise invalid("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != (1 if req.n is None else req.n):
        # best_of would rank choices server-side; only best_of == n (every choice returned) is served.
        raise invalid(f"best_of must equal n ({req.n or 1}), got {req.best_of}", "best_of")
    if present(req.max_completion_tokens):
        raise invalid(
            "max_completion_tokens is a chat completions field; /v1/completions takes max_tokens",
            "max_completion_tokens",
        )
    # The completions default (16) is also the engine's: an unset max_tokens stays unset. 0 (with echo) is
    # the prompt alone, as OpenAI's scoring requests send it.
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo:
        raise invalid(
            f"max_tokens must be in [1, {_UINT32}] (0, the prompt alone, with echo), got 0", "max_tokens"
        )
    out = g.GenerateRequest(
        request_id=request_id, sampling=_sampling(req, None if prompt_only else req.max_tokens)
    )
    if prompt_only:
        out.sampling.max_tokens = 0
    if req.logprobs is not None:
        out.sampling.logprobs = _bounded("logprobs", req.logprobs, 0, MAX_LOGPROBS)
        if req.echo:  # the prompt's too, shown before the completion's (as vLLM)
            out.sampling.prompt_logprobs = req.logprobs
    prompt = req.prompt
    if prompt is None:
        raise invalid("prompt is required", "prompt")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            out.prompt_token_ids.ids.extend(_token_ids(prompt, context_length))
            return out
        if any(isinstance(t, int) for t in prompt) and not all(isinstance(t, int) for t in prompt):
            raise invalid("prompt: a list is token ids (ints) or prompts, not both", "prompt")
        if len(prompt) > 1:
            raise invalid(
                f"prompt: one prompt per request is supported, got a batch of {len(prompt)}", "prompt"
            )
        if not prompt:
            raise invalid("prompt is empty", "prompt")
        one = prompt[0]
        if isinstance(one, list):
            out.prompt_token_ids.ids.extend(_token_ids(one, context_length))
            if not one:
                out.prompt_token_ids.SetInParent()  # an empty id list: the router says "prompt is empty"
            return out
        if not isinstance(one, str):
            raise invalid(
                "prompt must be a string, a list of token ids, or a list of one of either", "prompt"
            )
        prompt = one
    out.prompt = prompt
    return out


def text_content(i: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise invalid(
                f"messages[{i}].content: only text parts are supported, got {part.type!r}", "messages"
            )
        if part.text is None:
            raise invalid(f"messages[{i}].content: a text part needs its text", "messages")
        parts.append(part.text)
    return "\n".join(parts)  # (as vLLM joins a message's text parts)


# Options refused when sent with a value other than their default (None: any value is refused), on both
# endpoints (``_GenerationFields``) and on chat only (``ChatCompletionRequest``).
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "min_p": (0, 0.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "vllm_xargs": (),
    "return_token_ids": (False,),
    "return_tokens_as_token_ids": (False,),
    "prompt_embeds": (),
}
_CHAT_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "best_of": (1,),
    # The /tokenize endpoint takes it; a chat always opens the assistant's turn (as /tokenize by default).
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),  # the model's own template applies
    "chat_template_kwargs": (),
    "functions": (),
    "function_call": ("none", "auto"),  # without functions, auto calls none
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
}


def _refuse_unsupported(req: object, options: Mapping[str, tuple[object, ...]]) -> None:
    for name, defaults in options.items():
        raw = getattr(req, name)
        value = msgspec.json.decode(bytes(raw)) if present(raw) else None
        if value is not None and not any(type(value) is type(d) and value == d for d in defaults):
            raise invalid(f"{name} is not supported", name)


def client_field_names(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """The router's names of fields this request sent under another name, and the client's names: for
    the router's errors to name what the client sent (``protocol.error_from_status``)."""
    names = {}
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        names["prompt_token_ids"] = "prompt"
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None:
        names["logprobs"] = "top_logprobs"
    return names


def response_options(
    req: CompletionRequest | ChatCompletionRequest,
    token_text: Callable[[int], str],
    decode: Callable[[list[int]], str],
) -> ResponseOptions:
    """What the response shows beyond the generated text: a completion's ``echo`` (the prompt's text as
    sent, or its token ids decoded) and ``logprobs`` (a chat's ``top_logprobs`` when ``logprobs``)."""
    if isinstance(req, ChatCompletionRequest):
        top = (req.top_logprobs or 0) if req.logprobs else None
        return ResponseOptions(logprobs=top, token_text=token_text)
    echo = None
    if req.echo:
        prompt: object = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # (a batch of one)
        if isinstance(prompt, str):
            echo = prompt
        else:
            echo = decode([t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else [])
    return ResponseOptions(echo=echo, logprobs=req.logprobs, token_text=token_text)


def chat_request(req: ChatCompletionRequest, request_id: str) -> g.GenerateRequest:
    """``POST /v1/chat/completions`` as a ``GenerateRequest``. Raises OpenAIError (400)."""
    _check_common(req)
    plan = tool_plan(req.tools, req.tool_choice)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        _bounded("top_logprobs", req.top_logprobs, 0, MAX_LOGPROBS)
    _refuse_unsupported(req, _CHAT_UNSUPPORTED)
    if req.messages is None:
        raise invalid("messages is required", "messages")
    # max_completion_tokens replaced max_tokens in OpenAI's API; either is accepted, the new one wins.
    sent_as = client_field_names(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(req, max_tokens, sent_as.get("max_tokens", "max_tokens"))
    if req.logprobs:
        sampling.logprobs = req.top_logprobs or 0
    out = g.GenerateRequest(request_id=request_id, sampling=sampling)
    out.messages.SetInParent()  # an empty list stays "messages" (the router rejects it by name)
    out.messages.messages.extend(
        g.ChatMessage(role=m.role, content=_message_text(i, m))  # aliases: validate.chat_messages
        for i, m in enumerate(req.messages)
    )
    if plan is not None and plan.choice is not ToolChoice.NONE:
        out.messages.tools.extend(plan.to_proto())
        forced = plan.constraint()
        if forced is not None:
            if out.sampling.HasField("structured_outputs"):
                raise invalid(
                    "tool_choice forces a tool call, and the output is constrained too", "tool_choice"
                )
            out.sampling.structured_outputs.CopyFrom(forced)
    return out


def _message_text(i: int, m: ChatMessageIn) -> str:
    """A message's text; an assistant's tool calls are written after it as the generic convention does
    (``engine.tools``)."""
    text = text_content(i, m.content)
    if m.tool_calls:
        calls = [tool_call_text(c.function.name, c.function.arguments) for c in m.tool_calls]
        text = "\n".join([text, *calls] if text else calls)
    return text


# ---- responses ----------------------------------------------------------------------------------------


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def sse_error(err: OpenAIError) -> bytes:
    """An error after the stream began (the status line is already sent): an event, then [DONE]."""
    return b"data: " + encode(ErrorBody(err.info)) + b"\n\n" + DONE


def _usage(msg: g.GenerateResponse) -> Usage | None:
    """The request's usage, which its last message carries (n > 1: not every finishing one)."""
    if not msg.HasField("usage"):
        return None
    return Usage.of(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens)


class EventStream:
    """One streaming response: response messages in, SSE bytes out (each chunk one choice's)."""

    def __init__(
        self,
        kind: Kind,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
        options: ResponseOptions | None = None,
        tools: ToolPlan | None = None,
    ) -> None:
        self.kind = kind
        self.id, self.created, self.model = response_id, created, model
        self.include_usage = include_usage
        self.usage: Usage | None = None  # from the finishing message
        # Echo or logprobs (None: neither, the plain path): the prompt's text goes with a choice's first
        # chunk; logprobs wait with their tokens' text (held back while it may begin a stop string).
        self.options = options if options is not None and options.any else None
        self._tools = tools is not None
        self._choices = Choices(self.options, tools, streaming=True)

    def feed(self, msg: g.GenerateResponse) -> bytes:
        """The events for one message; empty when it adds nothing (text still held back, no finish)."""
        finish = msg.finish_reason or None
        if finish is not None:
            self.usage = _usage(msg) or self.usage
        opts = self.options
        st = self._choices.of(msg, opts is not None and opts.logprobs is not None)
        if self._tools:  # (tool calls are shown without logprobs)
            return self._feed_with_tools(st, msg.text, finish, msg.index)
        if opts is not None:
            return self._feed_shown(st, msg, finish, opts)
        if not msg.text and finish is None:
            return b""
        if self.kind is Kind.COMPLETION:
            choice = CompletionChoice(index=msg.index, text=msg.text, logprobs=None, finish_reason=finish)
            return sse(Completion(self.id, self.created, self.model, [choice], None))
        return self._role(st, msg.index) + self._chat_chunk(
            ChatDelta(content=msg.text or None), finish, msg.index
        )

    def _role(self, st: ChoiceState, index: int) -> bytes:
        if st.role_sent:
            return b""
        # The role comes in its own first chunk, as OpenAI sends it, right before the first text.
        st.role_sent = True
        return self._chat_chunk(ChatDelta(role="assistant", content=""), None, index)

    def _feed_with_tools(self, st: ChoiceState, text: str, finish: str | None, index: int) -> bytes:
        assert st.calls is not None
        text = st.calls.feed(text)
        calls = None
        if finish is not None:
            held, calls = st.calls.finish()
            text += held
        if calls and finish == "stop":
            deltas = [ToolCallDelta(i, c.id, c.function) for i, c in enumerate(calls)]
            out = self._role(st, index) + self._chat_chunk(ChatDelta(tool_calls=deltas), None, index)
            return out + self._chat_chunk(ChatDelta(), "tool_calls", index)
        if not text and finish is None:
            return b""
        return self._role(st, index) + self._chat_chunk(ChatDelta(content=text or None), finish, index)

    def _feed_shown(
        self, st: ChoiceState, msg: g.GenerateResponse, finish: str | None, opts: ResponseOptions
    ) -> bytes:
        """``feed`` of a response that shows the prompt (echo) or logprobs."""
        if not msg.text and finish is None:
            return b""
        entries = st.take_pending()
        if self.kind is Kind.COMPLETION:
            lps = None
            if opts.logprobs is not None:
                lps = completion_logprobs(entries, opts.token_text, st.text_offset)
                if lps.tokens:
                    st.text_offset = lps.text_offset[-1] + len(lps.tokens[-1])
            text = st.echo(msg.text, opts)
            choice = CompletionChoice(index=msg.index, text=text, logprobs=lps, finish_reason=finish)
            return sse(Completion(self.id, self.created, self.model, [choice], None))
        chat = chat_logprobs(entries, opts.token_text) if opts.logprobs is not None else None
        delta = ChatDelta(content=msg.text or None)
        return self._role(st, msg.index) + self._chat_chunk(delta, finish, msg.index, chat)

    def _chat_chunk(
        self, delta: ChatDelta, finish: str | None, index: int = 0, logprobs: ChatLogprobs | None = None
    ) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(ChatCompletionChunk(self.id, self.created, self.model, [choice], None))

    def end(self) -> bytes:
        """After the finishing message: the usage chunk (when asked for, choices empty), then [DONE]."""
        if not (self.include_usage and self.usage is not None):
            return DONE
        if self.kind is Kind.COMPLETION:
            last: msgspec.Struct = Completion(self.id, self.created, self.model, [], self.usage)
        else:
            last = ChatCompletionChunk(self.id, self.created, self.model, [], self.usage)
        return sse(last) + DONE


class Collected:
    """A non-streaming response: the messages gathered, then one body (a choice per index)."""

    def __init__(
        self,
        kind: Kind,
        response_id: str,
        created: int,
        model: str,
        options: ResponseOptions | None = None,
        tools: ToolPlan | None = None,
    ) -> None:
        self.kind = kind
        self.id, self.created, self.model = response_id, created, model
        self.tools = tools
        self.usage: Usage | None = None
        self.options = options or ResponseOptions()
        # Each choice's text and logprobs (the prompt's first, shown with echo, then the output's).
        self._choices = Choices(self.options, None, streaming=False)

    @property
    def finish(self) -> str | None:
        """Choice 0's finish reason (None: not finished)."""
        return self._choices.finish(0)

    def feed(self, msg: g.GenerateResponse) -> None:
        st = self._choices.of(msg, self.options.logprobs is not None)
        st.text.append(msg.text)
        if msg.finish_reason:
            self.usage = _usage(msg) or self.usage

    def response(self) -> bytes:
        opts, by_index = self.options, self._choices.by_index
        indices = self._choices.indices()
        if self.kind is Kind.COMPLETION:
            choices = [completion_choice(i, by_index.get(i), opts) for i in indices]
            return encode(Completion(self.id, self.created, self.model, choices, self.usage))
        chats = [chat_choice(i, by_index.get(i), opts, self.tools) for i in indices]
        return encode(ChatCompletion(self.id, self.created, self.model, chats, self.usage))
