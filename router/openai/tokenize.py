"""``POST /tokenize`` and ``POST /detokenize``, with the request and response shapes of vLLM's server.

Both use the router's own tokenizer and chat template, as the request path does, so a prompt's ``count``
here equals the ``usage.prompt_tokens`` of a completion of the same prompt. Pure: no grpc, no aiohttp.
"""

from __future__ import annotations

from pdserve.router.openai.mapping import text_content
from pdserve.router.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    invalid,
    present,
)
from pdserve.router.validate import RouterTokenizer, chat_messages


def tokenize(req: TokenizeRequest, tokenizer: RouterTokenizer, max_model_len: int) -> TokenizeResponse:
    """A ``prompt`` is encoded with the tokenizer's special tokens (BOS) unless ``add_special_tokens`` is
    false; ``messages`` are rendered by the chat template, which places the special tokens itself, with
    the assistant's turn opened unless ``add_generation_prompt`` is false. Errors: OpenAIError (400)."""
    if (req.prompt is None) == (req.messages is None):
        field = "prompt" if req.messages is None else "messages"
        raise invalid("set exactly one of prompt and messages", field)
    for name, raw in (("tools", req.tools), ("chat_template_kwargs", req.chat_template_kwargs)):
        if present(raw):
            raise invalid(f"{name} is not supported", name)
    if req.chat_template is not None:
        raise invalid("chat_template is not supported: the model's own template applies", "chat_template")
    if req.continue_final_message:
        raise invalid("continue_final_message is not supported", "continue_final_message")
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        assert req.messages is not None
        if req.add_special_tokens:
            raise invalid("add_special_tokens with messages: the template places them", "add_special_tokens")
        messages = chat_messages((m.role, text_content(i, m.content)) for i, m in enumerate(req.messages))
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            text = str(e)
            raise invalid(text if text.startswith("messages") else f"messages: {text}", "messages") from e
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(
    req: DetokenizeRequest, tokenizer: RouterTokenizer, vocab_size: int | None
) -> DetokenizeResponse:
    for t in req.tokens:
        if t < 0 or (vocab_size is not None and t >= vocab_size) or tokenizer.id_to_token(t) is None:
            limit = f" [0, {vocab_size})" if vocab_size is not None else ""
            raise invalid(f"tokens: {t} is outside the vocabulary{limit}", "tokens")
    # As vLLM: the text of every id, special tokens included (this endpoint inverts /tokenize).
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))
