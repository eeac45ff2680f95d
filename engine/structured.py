"""What a request's structured output must match (vLLM's ``StructuredOutputsParams``), and its validation.

Pure Python: imports no torch. The grammar library (llguidance) is imported only to check that a spec
compiles, so the router refuses what the workers could not compile with the same words. Every check
raises ``ValueError`` naming the field (``structured_outputs.json``, ...). Constrained decoding itself is
``engine.grammar``.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

# A schema, regex, grammar or choice list longer than this (UTF-8 bytes) is refused: compiling one is
# work the router and every worker do before the first token.
MAX_STRUCTURED_OUTPUT_BYTES = 64 << 10
FIELD = "structured_outputs"


class StructuredKind(enum.Enum):
    JSON = "json"  # a JSON schema
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of a list of strings
    GRAMMAR = "grammar"  # a context-free grammar: GBNF (llama.cpp's EBNF) or Lark
    JSON_OBJECT = "json_object"  # any JSON object


# How JSON is laid out: compact, one fixed separator between items and keys. With any whitespace allowed a
# model may emit whitespace forever (runs of it are single tokens in byte-level vocabularies).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints, as vLLM names them. ``json`` is a JSON schema as text or as a
    mapping (stored as its canonical JSON text); ``choice`` a list of strings (stored as a tuple)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{FIELD}.json must be a JSON schema (an object), got {e}") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise ValueError(f"{FIELD}.choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in StructuredKind if getattr(self, k.value) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(k.value for k in StructuredKind)
            got = ", ".join(k.value for k in given) or "none"
            raise ValueError(f"{FIELD} must set exactly one of {names}; got {got}")
        kind = given[0]
        name = f"{FIELD}.{kind.value}"
        if kind is StructuredKind.JSON_OBJECT:
            if self.json_object is not True:
                raise ValueError(f"{name} must be true or unset, got {self.json_object!r}")
            return
        if kind is StructuredKind.CHOICE:
            assert self.choice is not None
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{name} must be a non-empty list of non-empty strings")
            size = sum(len(c.encode()) for c in self.choice)
        else:
            text = getattr(self, kind.value)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{name} must be a non-empty string")
            size = len(text.encode())
        if size > MAX_STRUCTURED_OUTPUT_BYTES:
            raise ValueError(f"{name} has {size:,} bytes; at most {MAX_STRUCTURED_OUTPUT_BYTES:,}")
        if kind is StructuredKind.JSON:
            assert self.json is not None
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{name} is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"{name} must be a JSON schema (an object), got {type(schema).__name__}")

    @property
    def kind(self) -> StructuredKind:
        return next(k for k in StructuredKind if getattr(self, k.value) not in (None, False))

    @property
    def field(self) -> str:
        """The field errors about this constraint name."""
        return f"{FIELD}.{self.kind.value}"

    def lark(self) -> str:
        """The constraint as an llguidance grammar (its JSON text): what ``LLMatcher`` compiles. Cheap: the
        work happens when a matcher is built (``engine.grammar``)."""
        return _grammar(self)


@functools.lru_cache(maxsize=256)
def _grammar(spec: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher, grammar_from

    kind = spec.kind
    try:
        if kind is StructuredKind.JSON:
            return LLMatcher.grammar_from_json_schema(spec.json or "", defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if kind is StructuredKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if kind is StructuredKind.REGEX:
            return LLMatcher.grammar_from_regex(spec.regex or "")
        if kind is StructuredKind.CHOICE:
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choice or ())
            )
        return grammar_from("grammar", spec.grammar or "")
    except ValueError as e:
        raise ValueError(f"{spec.field} does not compile: {e}") from None


@functools.lru_cache(maxsize=256)
def check_compiles(spec: StructuredOutputsParams) -> None:
    """ValueError naming the field when the grammar library cannot compile ``spec`` (checked without a
    tokenizer: what the router can check; a worker compiles it again against its vocabulary)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(spec.lark())
    if error:
        first = error.strip().splitlines()[0] if error.strip() else error
        raise ValueError(f"{spec.field} does not compile: {first}")
