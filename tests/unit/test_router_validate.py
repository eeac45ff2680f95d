"""``router.validate.prepare`` refuses prompts known to pass the context before the costly part: a text
whose characters alone need more tokens than the context (by the tokenizer's ``max_token_chars``) is not
tokenized, and a list of ids longer than the context is not copied."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdserve.proto import generation_pb2 as g
from pdserve.router.validate import InvalidRequest, ModelLimits, prepare

CONTEXT = 100


class CountingTokenizer:
    """A byte-per-character tokenizer whose tokens stand for at most ``max_token_chars`` characters; it
    counts the characters it is asked to encode."""

    eos_token_ids = (0,)

    def __init__(self, max_token_chars: int | None) -> None:
        self.max_token_chars = max_token_chars
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded += len(text)
        per = self.max_token_chars or 1
        return [1] * -(-len(text) // per)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        self.rendered = [dict(m) for m in messages]
        return "".join(m["content"] for m in messages)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        raise NotImplementedError

    def decode_stream(self, skip_special_tokens: bool = True, prompt_token_ids=()):
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        return "x"


LIMITS = ModelLimits(context_length=CONTEXT, vocab_size=32)


def test_a_text_too_long_for_the_context_by_its_characters_is_refused_untokenized():
    tok = CountingTokenizer(max_token_chars=4)
    with pytest.raises(InvalidRequest) as info:
        prepare(g.GenerateRequest(prompt="a" * 4 * CONTEXT), tok, LIMITS)
    assert tok.encoded == 0
    assert str(info.value) == (
        "prompt has 400 characters, so at least 100 tokens; the model's context is 100 tokens and at "
        "least one must be left to generate"
    )
    # One token of room by the bound: tokenized, and the tokens decide.
    prep = prepare(g.GenerateRequest(prompt="a" * (4 * CONTEXT - 4)), tok, LIMITS)
    assert tok.encoded == 4 * CONTEXT - 4 and len(prep.prompt_token_ids) == CONTEXT - 1
    # No bound from a tokenizer that cannot give one: the tokens decide.
    tok = CountingTokenizer(max_token_chars=None)
    with pytest.raises(InvalidRequest, match="prompt has 400 tokens"):
        prepare(g.GenerateRequest(prompt="a" * 4 * CONTEXT), tok, LIMITS)
    assert tok.encoded == 4 * CONTEXT


def test_token_ids_past_the_context_are_refused_by_their_count():
    tok = CountingTokenizer(max_token_chars=4)
    ids = g.TokenIds(ids=[1] * 1_000_000)
    with pytest.raises(
        InvalidRequest, match="prompt_token_ids has 1000000 tokens; the model's context is 100"
    ):
        prepare(g.GenerateRequest(prompt_token_ids=ids), tok, LIMITS)
    prep = prepare(g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[1] * (CONTEXT - 1))), tok, LIMITS)
    assert len(prep.prompt_token_ids) == CONTEXT - 1


def test_a_chat_too_long_for_the_context_by_its_rendered_characters_is_refused_untokenized():
    """As a text prompt: three chats of a 24 MB message each took 85-103 s of the router's CPU to tokenize
    before their refusal, where the same text as a prompt was refused at once."""
    tok = CountingTokenizer(max_token_chars=4)
    chat = g.GenerateRequest(
        messages=g.ChatMessages(messages=[g.ChatMessage(role="user", content="a" * 4 * CONTEXT)])
    )
    with pytest.raises(InvalidRequest) as info:
        prepare(chat, tok, LIMITS)
    assert tok.encoded == 0
    assert str(info.value).startswith("messages has 400 characters, so at least 100 tokens;")
    chat.messages.messages[0].content = "a" * (4 * CONTEXT - 4)
    assert len(prepare(chat, tok, LIMITS).prompt_token_ids) == CONTEXT - 1


def test_the_developer_role_is_system_over_grpc_as_over_http():
    """OpenAI's API replaced the system role with "developer" (newer SDK examples send it): the template
    gets system, which chat templates know, whichever API the chat came by."""
    tok = CountingTokenizer(max_token_chars=None)
    msgs = [g.ChatMessage(role="developer", content="be brief"), g.ChatMessage(role="user", content="hi")]
    prepare(g.GenerateRequest(messages=g.ChatMessages(messages=msgs)), tok, LIMITS)
    assert tok.rendered == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


class ChatTokenizer(CountingTokenizer):
    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        return "x" * (10 * len(messages))  # 10 tokens a message (a character a token)


def test_a_chat_without_max_tokens_runs_as_far_as_the_context_and_cache_allow():
    """OpenAI's chat API has no 16-token default (vLLM's chat runs to the context): a chat with no
    max_tokens gets what fits the context and the largest KV cache; a prompt without one keeps the
    completions default, 16; one the client set is kept."""
    tok = ChatTokenizer(None)
    chat = g.GenerateRequest(messages=g.ChatMessages(messages=[g.ChatMessage(role="user", content="hi")]))
    prep = prepare(chat, tok, LIMITS)
    assert prep.params.max_tokens == prep.sampling.max_tokens == CONTEXT - 10
    cache = ModelLimits(context_length=CONTEXT, vocab_size=32, kv_tokens=50)
    assert prepare(chat, tok, cache).params.max_tokens == 50 - 10
    assert prepare(g.GenerateRequest(prompt="hello"), tok, LIMITS).params.max_tokens == 16
    chat.sampling.max_tokens = 7
    assert prepare(chat, tok, LIMITS).params.max_tokens == 7
