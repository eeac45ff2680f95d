"""``pdserve.v1`` ``TokenLogprobs`` as the OpenAI API shows them: the completions API's legacy lists
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``; with ``echo``, the prompt's first) and
the chat API's ``content`` entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``). A token's text is
the tokenizer's decoding of it alone, special tokens included, as vLLM shows it. Pure: no grpc.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.proto import generation_pb2 as g
from pdserve.router.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)

# JSON has no -inf: the floor OpenAI's API (and vLLM) report in its place.
LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


@dataclass(frozen=True)
class ResponseOptions:
    """What a response shows beyond the generated text. ``echo``: the prompt's text, first (completions'
    ``echo``; None: not shown). ``logprobs``: the alternatives shown per token (None: no logprobs), with the
    prompt's too when ``echo``. ``token_text``: a token id's text."""

    echo: str | None = None
    logprobs: int | None = None
    token_text: Callable[[int], str] = str

    @property
    def any(self) -> bool:
        return self.echo is not None or self.logprobs is not None


def completion_logprobs(
    entries: Sequence[g.TokenLogprobs], token_text: Callable[[int], str], text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy shape; each ``top_logprobs`` dict holds the most likely tokens and the token itself (as
    vLLM's); ``text_offset`` counts from ``text_offset`` by the tokens' texts (as vLLM's)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        text = token_text(e.token_id)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(text)
        if not e.HasField("logprob"):  # a prompt's first token
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(e.logprob))
        top = {token_text(t): _value(v) for t, v in zip(e.top_token_ids, e.top_logprobs, strict=True)}
        top.setdefault(text, _value(e.logprob))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(entries: Sequence[g.TokenLogprobs], token_text: Callable[[int], str]) -> ChatLogprobs:
    """The chat shape: each token's text, logprob and UTF-8 bytes, and its ``top_logprobs`` alternatives."""

    def top(t: int, v: float) -> ChatTopLogprob:
        text = token_text(t)
        return ChatTopLogprob(token=text, logprob=_value(v), bytes=list(text.encode()))

    content = []
    for e in entries:
        text = token_text(e.token_id)
        alternatives = [top(t, v) for t, v in zip(e.top_token_ids, e.top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(text, _value(e.logprob), list(text.encode()), alternatives))
    return ChatLogprobs(content=content)
