"""The OpenAI HTTP API's wire shapes, as typed ``msgspec`` Structs. Pure: no grpc.

The shapes follow OpenAI's API reference and the extensions vLLM accepts (``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``), so tools written for vLLM work unchanged.
Errors are ``OpenAIError``: an HTTP status and OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal, TypeVar

import msgspec

# ---- requests -----------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False
    # vLLM's usage on every chunk. Accepted (guidellm sends it): the usage comes once, in the last chunk, as
    # with include_usage. It changes no output, only where the counts are reported.
    continuous_usage_stats: bool = False


class _GenerationFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields both endpoints take. None: not sent (the server's default applies)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    ignore_eos: bool | None = None  # vLLM extension
    speculative: bool | None = None  # pdserve extension: false never speculates on this request
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None
    # Accepted only when absent or empty: kept raw, since they are never read.
    response_format: msgspec.Raw = msgspec.Raw()
    tools: msgspec.Raw = msgspec.Raw()
    # vLLM's options that change the output and pdserve does not implement: kept raw to be refused by name
    # when sent with a value other than their default (``mapping.UNSUPPORTED``), never silently ignored.
    min_p: msgspec.Raw = msgspec.Raw()
    include_stop_str_in_output: msgspec.Raw = msgspec.Raw()
    skip_special_tokens: msgspec.Raw = msgspec.Raw()
    spaces_between_special_tokens: msgspec.Raw = msgspec.Raw()
    use_beam_search: msgspec.Raw = msgspec.Raw()
    prompt_logprobs: msgspec.Raw = msgspec.Raw()
    guided_json: msgspec.Raw = msgspec.Raw()
    guided_regex: msgspec.Raw = msgspec.Raw()
    guided_choice: msgspec.Raw = msgspec.Raw()
    guided_grammar: msgspec.Raw = msgspec.Raw()
    allowed_token_ids: msgspec.Raw = msgspec.Raw()
    bad_words: msgspec.Raw = msgspec.Raw()
    truncate_prompt_tokens: msgspec.Raw = msgspec.Raw()
    structured_outputs: msgspec.Raw = msgspec.Raw()  # (vLLM's successor of guided_*)
    logits_processors: msgspec.Raw = msgspec.Raw()
    vllm_xargs: msgspec.Raw = msgspec.Raw()
    return_token_ids: msgspec.Raw = msgspec.Raw()
    return_tokens_as_token_ids: msgspec.Raw = msgspec.Raw()
    prompt_embeds: msgspec.Raw = msgspec.Raw()


# One prompt: text, token ids, or a batch of one of either (what the SDK sends for ``prompt=[...]``).
PromptField = str | list[str | int | list[int]]


class CompletionRequest(_GenerationFields, frozen=True, kw_only=True):
    prompt: PromptField | None = None
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
    # Chat's name for max_tokens: kept raw to be refused by name (ignored, it left the default of 16).
    max_completion_tokens: msgspec.Raw = msgspec.Raw()


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(msgspec.Struct, frozen=True):
    """A call in an assistant message of the history."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessageIn(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's call


class ChatCompletionRequest(_GenerationFields, frozen=True, kw_only=True):
    messages: list[ChatMessageIn] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Options of OpenAI's chat API (or vLLM's) that pdserve does not implement, kept raw to be refused
    # by name when sent with a value (``mapping.chat_request``): a client asking for a function call,
    # audio or a predicted output must not get plain text as if it had been honoured.
    echo: msgspec.Raw = msgspec.Raw()
    best_of: msgspec.Raw = msgspec.Raw()
    add_generation_prompt: msgspec.Raw = msgspec.Raw()
    continue_final_message: msgspec.Raw = msgspec.Raw()
    chat_template: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    functions: msgspec.Raw = msgspec.Raw()
    function_call: msgspec.Raw = msgspec.Raw()
    tool_choice: msgspec.Raw = msgspec.Raw()
    modalities: msgspec.Raw = msgspec.Raw()
    audio: msgspec.Raw = msgspec.Raw()
    prediction: msgspec.Raw = msgspec.Raw()


# ---- responses ----------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int  # prompt tokens reused from the prefilling worker's prefix cache


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens,
            completion_tokens,
            prompt_tokens + completion_tokens,
            PromptTokensDetails(cached_tokens),
        )


class CompletionLogprobs(msgspec.Struct, frozen=True):
    """The completions API's (legacy) logprobs: per token its text, logprob, the most likely tokens' (with
    its own), and where its text starts. A prompt's first token (``echo``) has None for both."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, frozen=True):
    """A non-streaming completion and, with ``object`` the same, each stream chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: Literal["text_completion"] = "text_completion"


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A streamed call: pdserve sends each whole, in one chunk."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessageOut(msgspec.Struct, frozen=True, omit_defaults=True):
    content: str | None  # null when the answer is tool calls
    role: Literal["assistant"]  # (no default: always sent)
    tool_calls: list[ToolCall] | None = None  # sent only when there are calls


class ChatTopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]  # the most likely tokens, as many as top_logprobs asked


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[ChatTokenLogprob] | None


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a chunk adds: the role once (first chunk), then content; the last one may be empty."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    created: int
    max_model_len: int | None = None
    owned_by: str = "pdserve"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


# ---- vLLM's utility endpoints: /tokenize, /detokenize, /version ------------------------------------------


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize``: vLLM's two request shapes in one (exactly one of ``prompt`` and ``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    # None: vLLM's default for the shape (True for a prompt, False for messages, whose template adds them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # Accepted only when absent or empty, as on the generation endpoints.
    tools: msgspec.Raw = msgspec.Raw()
    chat_template: str | None = None
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()


class TokenizeResponse(msgspec.Struct, frozen=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, frozen=True):
    prompt: str


class VersionInfo(msgspec.Struct, frozen=True):
    version: str


class ErrorInfo(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorInfo


def present(raw: msgspec.Raw) -> bool:
    """Whether a raw field was sent with a value (absent, null and empty count as not sent, however
    spaced: ``[ ]`` is ``[]``)."""
    data = bytes(raw)
    if not data:
        return False
    value = msgspec.json.decode(data)
    return value is not None and value != [] and value != {}


_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


# ---- errors -------------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """A request that ends with an HTTP error status and OpenAI's error body."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.retry_after_s = 0  # a refusal's Retry-After, when the router knows it (0: the default)

    def body(self) -> bytes:
        return encode(ErrorBody(self.info))


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


# gRPC status (by name: this module imports no grpc) -> HTTP status, OpenAI error type, error code.
_STATUS: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": (503, "service_unavailable_error", "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout_error", "timeout"),
}
_SERVER_ERROR = (500, "server_error", None)

# The fields the router's messages start with (``validate.prepare``), as the OpenAI request names them.
_PARAM_NAMES = {
    "prompt": "prompt",
    "prompt_token_ids": "prompt",
    "messages": "messages",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "structured_outputs": "response_format",
    "n": "n",
    "speculative": "speculative",
    "request_id": "X-Request-ID",  # the HTTP front takes the id from that header
    "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs",
}
_LEADING_FIELD = re.compile(r"^(?:sampling\.)?([a-z_]+)")


def error_from_status(code_name: str, details: str, sent_as: Mapping[str, str] | None = None) -> OpenAIError:
    """The HTTP error for a request the router ended with gRPC status ``code_name``.

    The router names the offending field first ("sampling.top_p must be ..."):
    that becomes ``param``, and the proto's ``sampling.`` prefix is dropped,
    since an HTTP client sent ``top_p`` at the top level. ``sent_as``: the
    router's names of fields the client sent under another name
    (``mapping.client_field_names``), named as the client sent them.
    """
    status, kind, code = _STATUS.get(code_name, _SERVER_ERROR)
    param = None
    message = details
    if status == 400:
        m = _LEADING_FIELD.match(details)
        if m is not None and m.group(1) in _PARAM_NAMES:
            param = _PARAM_NAMES[m.group(1)]
            message = details.removeprefix("sampling.")
        if "the model's context" in details or "KV cache holds" in details:  # the context, or the cache
            code = "context_length_exceeded"
        for ours, theirs in (sent_as or {}).items():
            message = re.sub(rf"\b{ours}\b", theirs, message)
            if param == _PARAM_NAMES.get(ours, ours):
                param = theirs
    return OpenAIError(status, message, kind, param, code)


# The top-level field an error is in: its path when msgspec gives one ("... - at `$.messages[0]`", for
# a nested field too), else the missing top-level field it names.
_JSON_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING_FIELD = re.compile(r"missing required field `([A-Za-z_]+)`")


T = TypeVar("T", bound=msgspec.Struct)


_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode a request body; a malformed body or a wrongly typed field is a 400 naming the field. Unknown
    fields are ignored: clients send many that change nothing here (``user``, say)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _JSON_PATH.search(str(e)) or _MISSING_FIELD.search(str(e))
        raise invalid(f"invalid request: {e}", m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        if "truncated" in str(e) and _LONE_SURROGATE.search(body):
            # msgspec reads on past a high surrogate's escape for its low half and calls it truncated.
            raise invalid(
                "the request body is not valid JSON: a \\u escape is a lone UTF-16 surrogate"
            ) from None
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:  # a string holding bytes that are not UTF-8 (msgspec's own error)
        raise invalid(f"the request body is not valid UTF-8: {e}") from None
