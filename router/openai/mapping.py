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
from collections.abc import Mapping

import msgspec

from pdserve.engine.params import MAX_LOGIT_BIAS_TOKENS, check_prompt_length
from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorBody,
    OpenAIError,
    Usage,
    encode,
    invalid,
    present,
)

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
    if present(req.tools):
        raise invalid("tools are not supported", "tools")
    if present(req.response_format):
        fmt = msgspec.json.decode(bytes(req.response_format))
        if not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
            raise invalid("response_format: only {'type': 'text'} is supported", "response_format")
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
    if req.echo:
        raise invalid("echo is not supported", "echo")
    if req.suffix:
        raise invalid("suffix is not supported", "suffix")
    if req.logprobs is not None:
        raise invalid("logprobs is not supported", "logprobs")
    if req.best_of is not None and req.best_of != (1 if req.n is None else req.n):
        # best_of would rank choices server-side; only best_of == n (every choice returned) is served.
        raise invalid(f"best_of must equal n ({req.n or 1}), got {req.best_of}", "best_of")
    if present(req.max_completion_tokens):
        raise invalid(
            "max_completion_tokens is a chat completions field; /v1/completions takes max_tokens",
            "max_completion_tokens",
        )
    # The completions default (16) is also the engine's: an unset max_tokens stays unset.
    out = g.GenerateRequest(request_id=request_id, sampling=_sampling(req, req.max_tokens))
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
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "truncate_prompt_tokens": (),
    "structured_outputs": (),
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
    "tool_choice": ("none", "auto"),  # without tools, auto calls none
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
    return names


def chat_request(req: ChatCompletionRequest, request_id: str) -> g.GenerateRequest:
    """``POST /v1/chat/completions`` as a ``GenerateRequest``. Raises OpenAIError (400)."""
    _check_common(req)
    if req.logprobs:
        raise invalid("logprobs is not supported", "logprobs")
    if req.top_logprobs:
        raise invalid("top_logprobs is not supported", "top_logprobs")
    _refuse_unsupported(req, _CHAT_UNSUPPORTED)
    if req.messages is None:
        raise invalid("messages is required", "messages")
    # max_completion_tokens replaced max_tokens in OpenAI's API; either is accepted, the new one wins.
    sent_as = client_field_names(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(req, max_tokens, sent_as.get("max_tokens", "max_tokens"))
    out = g.GenerateRequest(request_id=request_id, sampling=sampling)
    out.messages.SetInParent()  # an empty list stays "messages" (the router rejects it by name)
    out.messages.messages.extend(
        g.ChatMessage(role=m.role, content=text_content(i, m.content))  # aliases: validate.chat_messages
        for i, m in enumerate(req.messages)
    )
    return out


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
    """One streaming response: response messages in, SSE bytes out."""

    def __init__(self, kind: Kind, response_id: str, created: int, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id, self.created, self.model = response_id, created, model
        self.include_usage = include_usage
        self.usage: Usage | None = None  # from the finishing message
        self._role_sent: set[int] = set()  # the choices whose role chunk went out

    def feed(self, msg: g.GenerateResponse) -> bytes:
        """The events for one message; empty when it adds nothing (text still held back, no finish)."""
        finish = msg.finish_reason or None
        if finish is not None:
            self.usage = _usage(msg) or self.usage
        if not msg.text and finish is None:
            return b""
        index = msg.index
        if self.kind is Kind.COMPLETION:
            choice = CompletionChoice(index=index, text=msg.text, logprobs=None, finish_reason=finish)
            return sse(Completion(self.id, self.created, self.model, [choice], None))
        out = b""
        if index not in self._role_sent:
            # The role comes in its own first chunk, as OpenAI sends it, right before the first text.
            self._role_sent.add(index)
            out = self._chat_chunk(ChatDelta(role="assistant", content=""), None, index)
        return out + self._chat_chunk(ChatDelta(content=msg.text or None), finish, index)

    def _chat_chunk(self, delta: ChatDelta, finish: str | None, index: int = 0) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=finish)
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
    """A non-streaming response: the messages gathered, then one body."""

    def __init__(self, kind: Kind, response_id: str, created: int, model: str) -> None:
        self.kind = kind
        self.id, self.created, self.model = response_id, created, model
        self._text: dict[int, list[str]] = {}  # by choice index
        self._finish: dict[int, str] = {}
        self.usage: Usage | None = None

    @property
    def finish(self) -> str | None:
        """Choice 0's finish reason (None: not finished)."""
        return self._finish.get(0)

    def feed(self, msg: g.GenerateResponse) -> None:
        self._text.setdefault(msg.index, []).append(msg.text)
        if msg.finish_reason:
            self._finish[msg.index] = msg.finish_reason
            self.usage = _usage(msg) or self.usage

    def response(self) -> bytes:
        indices = sorted(self._text.keys() | self._finish.keys()) or [0]
        texts = {i: "".join(self._text.get(i, ())) for i in indices}
        if self.kind is Kind.COMPLETION:
            choices = [
                CompletionChoice(index=i, text=texts[i], logprobs=None, finish_reason=self._finish.get(i))
                for i in indices
            ]
            return encode(Completion(self.id, self.created, self.model, choices, self.usage))
        chats = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content=texts[i]),
                logprobs=None,
                finish_reason=self._finish.get(i),
            )
            for i in indices
        ]
        return encode(ChatCompletion(self.id, self.created, self.model, chats, self.usage))
