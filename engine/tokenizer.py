"""Tokenizer and chat template for a model directory, on ``tokenizers`` (the Rust library transformers wraps).

The chat template renders as transformers renders it: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, ``raise_exception``, a non-escaping ``tojson`` and the special tokens in scope.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from pdserve.engine.tools import TOOL_ROLE, ToolSpec, generic_tool_messages

# Roles a chat may use unless tokenizer_config.json lists others under this key. These are the
# roles ChatML-style templates (SmolLM2's among them) render; anything else is rejected up front
# rather than rendered into a prompt the model was never trained on.
CHAT_ROLES_KEY = "pdserve_chat_roles"
DEFAULT_CHAT_ROLES = ("system", "user", "assistant")
# Texts longer than this (in characters; id lists in ids) go through ``encode_batch`` / ``decode_batch``,
# which release the GIL (``Tokenizer.encode``).
_GIL_HELD_CHARS = 4096
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


PRIME_TOKENS = 4  # prompt tokens replayed into a sequence's text stream before its first output


class TextStream:
    """Incremental detokenization of one sequence (``tokenizers``' DecodeStream)."""

    def __init__(self, backend: _Backend, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # ``step`` for a Python int, without the method call: the text or None (the engine calls it for
        # every sequence every step).
        self.step_int: Callable[[int], str | None] = functools.partial(self._stream.step, backend)

    def step(self, token_id: int) -> str:
        """The text ``token_id`` adds; "" while it leaves a multi-byte character incomplete."""
        return self._stream.step(self._backend, int(token_id)) or ""


class Tokenizer:
    def __init__(
        self,
        backend: _Backend,
        special_tokens: Mapping[str, str],
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_roles: Sequence[str] = DEFAULT_CHAT_ROLES,
        name: str = "tokenizer",
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_template_source = chat_template
        self._template: jinja2.Template | None = None
        self._chat_roles = tuple(chat_roles)
        self._name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._token_id("bos_token")
        if self.bos_token_id is None:
            self.bos_token_id = bos_token_id
        eos = self._token_id("eos_token")
        # The tokenizer's own EOS first, then every stop id the generation config names (as vLLM does).
        ids = ([eos] if eos is not None else []) + [int(i) for i in extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from an HF model directory; FileNotFoundError when it has no ``tokenizer.json``."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json; use token-id prompts with this model")
        backend = _Backend.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        special = {
            key: _token_content(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key) is not None
        }
        eos_ids = generation.get("eos_token_id", model_config.get("eos_token_id"))
        return cls(
            backend,
            special_tokens=special,
            chat_template=_chat_template(path, config),
            extra_eos_token_ids=_as_id_list(eos_ids),
            bos_token_id=generation.get("bos_token_id", model_config.get("bos_token_id")),
            chat_roles=tuple(config.get(CHAT_ROLES_KEY, DEFAULT_CHAT_ROLES)),
            name=str(path),
        )

    @functools.cached_property
    def vocab_digest(self) -> str:
        """A short digest of the vocabulary: every id and its token string, added tokens included. Two
        tokenizers with the same digest turn the same ids into the same pieces of text, whatever files they
        were loaded from; the router refuses a worker whose model's digest is not its own."""
        h = hashlib.sha256()
        for token, i in sorted(self._backend.get_vocab(with_added_tokens=True).items(), key=lambda t: t[1]):
            h.update(b"%d\0%s\0" % (i, token.encode()))
        return h.hexdigest()[:16]

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        if len(text) > _GIL_HELD_CHARS:
            # ``tokenizers`` holds the GIL through ``encode`` but releases it in ``encode_batch``: a long
            # text tokenized in a worker thread must not stop the event loop (a multi-megabyte prompt
            # would hold it long enough for a router to miss its workers' heartbeats).
            batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, where that bounds a text's token count
        from below (``len(text) / max_token_chars``): byte-level BPE with no normalizer, whose tokens are
        runs of the text's own bytes (every added token counted too). None for any other tokenizer: a
        normalizer may shorten a text, and an unknown token may stand for a run of any length; an added
        token that strips the whitespace beside it (``lstrip``/``rstrip``) takes a run of any length too."""
        spec = json.loads(self._backend.to_str())
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
            return None
        if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
            return None
        pre = spec.get("pre_tokenizer") or {}
        kinds = [p.get("type") for p in pre.get("pretokenizers") or []] + [pre.get("type")]
        if "ByteLevel" not in kinds:
            return None
        return max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if len(ids) > _GIL_HELD_CHARS:  # as ``encode``: ``decode_batch`` releases the GIL
            return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for one id (None outside the vocabulary)."""
        return self._backend.id_to_token(int(token_id))

    def decode_stream(
        self, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()
    ) -> TextStream:
        """A stream for a sequence's output, primed with ``prompt_token_ids``' tail (as vLLM does) so
        that the first output token decodes in context: a SentencePiece word start keeps its leading space,
        and a character the prompt's last token began is completed, not a U+FFFD. The tail is the shortest
        of at least PRIME_TOKENS that decodes without a broken multi-byte character (else the last
        PRIME_TOKENS, whose incomplete character the output completes)."""
        stream = TextStream(self._backend, skip_special_tokens)
        prime = [int(t) for t in prompt_token_ids[-PRIME_TOKENS:]]
        for n in range(PRIME_TOKENS, min(len(prompt_token_ids), 4 * PRIME_TOKENS) + 1):
            suffix = [int(t) for t in prompt_token_ids[-n:]]
            if "\ufffd" not in self.decode(suffix, skip_special_tokens=skip_special_tokens):
                prime = suffix
                break
        for t in prime:
            stream.step(t)
        return stream

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """Prompt token ids for a conversation. ValueError naming the problem for a malformed one.

        The rendered text is encoded without adding special tokens: the template wrote them."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template has a tool format of its own (it reads ``tools``)."""
        return "tools" in (self._chat_template_source or "")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        tools: Sequence[ToolSpec] = (),
    ) -> str:
        """The prompt text the chat template makes of ``messages``; ``tools``: functions the model may call,
        in the template's tool format, or pdserve's generic one where it has none (``engine.tools``)."""
        listed = tools and self.renders_tools
        if tools and not self.renders_tools and _is_message_list(messages):
            # (a tool message stays one where the model's roles have it)
            messages = generic_tool_messages(messages, tools, keep_tool_role=TOOL_ROLE in self._chat_roles)
        plain = self._check_messages(messages)
        template = self._compiled_template()
        try:
            return template.render(
                messages=plain,
                tools=[t.as_openai() for t in tools] if listed else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc

    def _check_messages(self, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
            raise ValueError(
                f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}"
            )
        if not messages:
            raise ValueError("messages is empty: a chat needs at least one message")
        plain: list[dict[str, str]] = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(
                    f"message {index} must be a mapping with 'role' and 'content', got {message!r}"
                )
            # As transformers does: a None value (OpenAI clients send content=None) is an absent key.
            message = {key: value for key, value in message.items() if value is not None}
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str):
                raise ValueError(f"message {index} has no 'role' string")
            if role not in self._chat_roles:
                raise ValueError(
                    f"message {index} has role {role!r}, which pdserve does not render for this model; "
                    f"allowed roles: {', '.join(self._chat_roles)} (the model's config may name more: "
                    f"{CHAT_ROLES_KEY})"
                )
            if not isinstance(content, str):
                raise ValueError(f"message {index} ({role}) has no 'content' string")
            for key, value in message.items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise ValueError(f"message {index} field {key!r} must map a string to a string")
            plain.append({str.__str__(k): str.__str__(v) for k, v in message.items()})
        return plain

    def _compiled_template(self) -> jinja2.Template:
        if self._chat_template_source is None:
            raise ValueError(f"{self._name} has no chat template; pass a plain prompt instead")
        if self._template is None:
            self._template = _compile_template(self._chat_template_source)
        return self._template

    def _token_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)


class _GenerationTag(jinja2.ext.Extension):
    """Render ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask markers) as-is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _is_message_list(messages: object) -> bool:
    return (
        isinstance(messages, Sequence)
        and not isinstance(messages, str | bytes)
        and all(isinstance(m, Mapping) for m in messages)
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON, as transformers provides.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_template(source: str) -> jinja2.Template:
    # Chat templates are untrusted code from model files: the immutable sandbox keeps them away
    # from Python internals and from mutating the caller's data.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the model's chat template does not parse: {exc}") from exc


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    # transformers 5 saves the template as its own file, which wins over the config entry.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str:
    # tokenizer_config stores a special token as a string or as a serialized AddedToken.
    return str(value["content"]) if isinstance(value, Mapping) else str(value)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
