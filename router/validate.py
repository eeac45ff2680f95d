"""Request validation and preparation at the router. Pure: no grpc, no torch.

The rules are the engine's own (``engine.params``), so a request the router accepts is one the workers
accept; ``InvalidRequest`` names the offending field."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdserve.engine.params import (
    SamplingParams,
    check_prompt_length,
    validate_params_for_model,
    validate_prompt_token_ids,
)
from pdserve.engine.structured import MAX_STRUCTURED_OUTPUT_BYTES
from pdserve.engine.tools import ToolSpec
from pdserve.proto import generation_pb2
from pdserve.worker.convert import sampling_params_from_proto

# Used when the model's vocabulary size is unknown: only the context check then bounds the ids.
_UNKNOWN_VOCAB = 1 << 32


class InvalidRequest(ValueError):
    """The request is malformed; the message names the field."""


# A client's request id travels in logs, gRPC metadata and HTTP headers: bounded, and printable without
# quoting (the characters of UUIDs, ULIDs, trace ids and vLLM's "benchmark-serving12").
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._~:@/+=-]+")


# Bounds on what a request may carry beyond what the model itself limits (each refusal names the field).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOOLS = 128
MAX_TOOL_PARAMETERS_BYTES = MAX_STRUCTURED_OUTPUT_BYTES  # one tool's arguments schema


def _check_bounds(s: generation_pb2.SamplingParams) -> None:
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop has {len(s.stop)} strings; at most {MAX_STOP_STRINGS}")
    longest = max((len(x) for x in s.stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise InvalidRequest(
            f"sampling.stop has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS}"
        )
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"sampling.stop_token_ids has {len(s.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
        )


def check_request_id(request_id: str, field: str = "request_id") -> str:
    """The client's request id, checked (InvalidRequest naming ``field``); empty means "assign one"."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"{field} has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if request_id and not _REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest(f"{field} may hold only letters, digits and ._~:@/+=- (got {request_id[:40]!r})")
    return request_id


class TextStream(Protocol):
    def step(self, token_id: int) -> str | None: ...


class RouterTokenizer(Protocol):
    """What the router needs from ``engine.tokenizer.Tokenizer``."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: Sequence[ToolSpec] = (),
    ) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]: ...

    def decode_stream(
        self, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()
    ) -> TextStream: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    @property
    def max_token_chars(self) -> int | None: ...


@dataclass(frozen=True)
class ModelLimits:
    """Model facts the router validates against. 0 / None: unknown (ask the workers)."""

    context_length: int = 0
    vocab_size: int | None = None
    # Tokens (prompt and output) one request may hold in the largest decode worker's KV cache: an unset
    # max_tokens is cut to fit it as well as the context. 0: unknown.
    kv_tokens: int = 0

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelLimits:
        """Read ``max_position_embeddings`` and ``vocab_size`` from an HF-style ``config.json``."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            return cls()
        cfg = json.loads(cfg_path.read_text())
        # Multimodal configs nest the language model's settings.
        cfg = cfg.get("text_config", cfg)
        ctx = cfg.get("max_position_embeddings") or 0
        vocab = cfg.get("vocab_size")
        return cls(context_length=int(ctx), vocab_size=int(vocab) if vocab else None)


@dataclass(frozen=True)
class Prepared:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: generation_pb2.SamplingParams  # forwarded to the workers: the client's, minus stop strings
    # max_tokens 0: the prompt alone (its logprobs, when asked). The workers run it as max_tokens 1 and
    # the router sends none of its output.
    prompt_only: bool = False


def _prompt_ids(
    request: generation_pb2.GenerateRequest, tokenizer: RouterTokenizer, context_length: int
) -> tuple[str, list[int]]:
    """The prompt's token ids and the name of the field they came from. A prompt known to be longer than
    the context before it is tokenized (its characters, by ``max_token_chars``) or copied (its ids) is
    refused at once: tokenizing a long text holds up the event loop."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("prompt is empty: set one of prompt, prompt_token_ids or messages")
    try:
        if kind == "prompt":
            if not request.prompt:
                raise InvalidRequest("prompt is empty")
            per_token = tokenizer.max_token_chars
            if per_token:
                chars = len(request.prompt)
                at_least = f"{chars:,} characters, so at least {-(-chars // per_token):,}"
                check_prompt_length(-(-chars // per_token), context_length, "prompt", at_least)
            return "prompt", list(tokenizer.encode(request.prompt))
        if kind == "prompt_token_ids":
            check_prompt_length(len(request.prompt_token_ids.ids), context_length, "prompt_token_ids")
            return "prompt_token_ids", list(request.prompt_token_ids.ids)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    if context_length > 0 and len(request.messages.messages) > context_length:
        # Each message takes at least a token: refused before rendering, since empty messages count no
        # characters yet still take the event loop's time to render.
        raise InvalidRequest(
            f"messages has {len(request.messages.messages)} messages: more than the model's context of "
            f"{context_length} tokens could hold"
        )
    messages = chat_messages((m.role, m.content) for m in request.messages.messages)
    tools = tool_specs(request.messages.tools)
    try:
        # The tokenizer checks roles against what the model's chat template allows. Rendering is cheap;
        # a chat known to pass the context by its rendered characters (as a text prompt) is refused
        # before it is tokenized, which holds up the event loop.
        text = tokenizer.render_chat(messages, tools=tools) if tools else tokenizer.render_chat(messages)
    except ValueError as e:
        text = str(e)
        raise InvalidRequest(text if text.startswith("messages") else f"messages: {text}") from e
    per_token = tokenizer.max_token_chars
    if per_token:
        chars = len(text)
        at_least = f"{chars:,} characters, so at least {-(-chars // per_token):,}"
        try:
            check_prompt_length(-(-chars // per_token), context_length, "messages", at_least)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
    # The template places the special tokens itself (as apply_chat_template).
    return "messages", list(tokenizer.encode(text, add_special_tokens=False))


# OpenAI's "developer" role is its newer name for "system" (its API docs: developer messages replace
# system messages); chat templates know system. For every way in: HTTP, gRPC and /tokenize.
ROLE_ALIASES = {"developer": "system"}


def tool_specs(tools: Sequence[generation_pb2.Tool]) -> list[ToolSpec]:
    """The request's functions, checked: InvalidRequest naming ``messages.tools``."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"messages.tools has {len(tools)} functions; at most {MAX_TOOLS}")
    out = []
    for i, t in enumerate(tools):
        if not t.name:
            raise InvalidRequest(f"messages.tools[{i}] has no name")
        size = len(t.parameters.encode())
        if size > MAX_TOOL_PARAMETERS_BYTES:
            raise InvalidRequest(
                f"messages.tools[{i}].parameters has {size:,} bytes; at most {MAX_TOOL_PARAMETERS_BYTES:,}"
            )
        try:
            params = json.loads(t.parameters) if t.parameters else None
        except ValueError as e:
            raise InvalidRequest(f"messages.tools[{i}].parameters is not valid JSON: {e}") from None
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(f"messages.tools[{i}].parameters must be a JSON schema (an object)")
        out.append(ToolSpec(t.name, t.description, params))
    return out


def chat_messages(pairs: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    """(role, content) pairs as the chat template takes them, roles' aliases resolved."""
    return [{"role": ROLE_ALIASES.get(role, role), "content": content} for role, content in pairs]


def _one_token(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """A prompt-only request (max_tokens 0) as the workers run it: one token, which is not sent, so none
    of its logprobs are asked for."""
    if request.sampling.min_tokens:
        raise InvalidRequest(
            f"sampling.min_tokens must be 0 when max_tokens is 0 (the prompt alone), got "
            f"{request.sampling.min_tokens}"
        )
    one = generation_pb2.GenerateRequest()
    one.CopyFrom(request)
    one.sampling.max_tokens = 1
    one.sampling.ClearField("logprobs")
    return one


def prepare(
    request: generation_pb2.GenerateRequest,
    tokenizer: RouterTokenizer,
    limits: ModelLimits,
) -> Prepared:
    """Validate ``request`` and turn it into what the workers need. Raises InvalidRequest."""
    if limits.context_length <= 0:
        raise ValueError("the model's context length is unknown")
    if request.sampling.HasField("max_tokens") and request.sampling.max_tokens == 0:
        return dataclasses.replace(prepare(_one_token(request), tokenizer, limits), prompt_only=True)
    check_request_id(request.request_id)
    _check_bounds(request.sampling)
    try:
        params = sampling_params_from_proto(request.sampling)
        validate_params_for_model(params, vocab_size=limits.vocab_size or _UNKNOWN_VOCAB, can_detokenize=True)
    except ValueError as e:
        raise InvalidRequest(f"sampling.{e}") from e
    field, ids = _prompt_ids(request, tokenizer, limits.context_length)
    try:
        validate_prompt_token_ids(
            ids,
            vocab_size=limits.vocab_size or _UNKNOWN_VOCAB,
            max_model_len=limits.context_length,
            name=field,
        )
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    sampling = request.sampling
    room = limits.context_length - len(ids)  # >= 1: checked with the prompt
    max_tokens = params.max_tokens
    if sampling.HasField("max_tokens") and max_tokens > room:
        # As vLLM: a request that cannot get what it asked for is refused, not cut short.
        raise InvalidRequest(
            f"max_tokens is {max_tokens}, but the prompt has {len(ids)} tokens and the model's context is "
            f"{limits.context_length} tokens: at most {room} can be generated"
        )
    unset = not sampling.HasField("max_tokens")
    if unset and limits.kv_tokens > len(ids):
        # Unset: what fits the cache too (n choices: n times, the bound the engine sets).
        room = min(room, limits.kv_tokens // params.n - len(ids))
        if room < 1:
            raise InvalidRequest(
                f"n is {params.n}, but the prompt has {len(ids)} tokens and the largest decode worker's KV "
                f"cache has room for {limits.kv_tokens}: not for {params.n} choices"
            )
    if unset and field == "messages":
        # A chat has no 16-token default (OpenAI's chat API has none; vLLM's chat runs to the context):
        # it runs to its end, or as far as the context and the cache allow.
        max_tokens = room
    if params.min_tokens > room:
        # min_tokens is what the client asked for at least: refused as max_tokens is, never cut.
        where = "the model's context" if room == limits.context_length - len(ids) else "the largest KV cache"
        raise InvalidRequest(
            f"min_tokens is {params.min_tokens}, but the prompt has {len(ids)} tokens and {where} leaves "
            f"room for {room}: at most {room} can be generated"
        )
    if sampling.stop or max_tokens != params.max_tokens or max_tokens > room:
        sampling = generation_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        # The router owns stop strings (it detokenizes); workers stop only on token ids.
        del sampling.stop[:]
        if max_tokens != params.max_tokens or max_tokens > room:
            # Unset by the client: a chat's room, or the default cut to what fits the context and cache.
            params = dataclasses.replace(params, max_tokens=min(max_tokens, room))
            sampling.max_tokens = params.max_tokens
    return Prepared(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=ids,
        params=params,
        sampling=sampling,
    )
