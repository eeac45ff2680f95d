"""GGUF tokenizer metadata -> a ``tokenizers.Tokenizer`` equal to the one transformers builds.

The same pipeline transformers' GGUF path builds (see ``build_byte_level_tokenizer``), made directly with
``tokenizers``; a test compares the two serialized tokenizers for equality.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Pre-tokenizer splits by `tokenizer.ggml.pre`, for vocabularies whose merges were learned on
# these splits. Anything not listed keeps GPT-2's own ByteLevel regex, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table.

    Printable Latin-1 bytes stand for themselves; the others take code points 256, 257, ... in byte order.
    """
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table: dict[int, str] = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def build_byte_level_tokenizer(metadata: dict[str, Any]) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF tokenizer metadata.

    Mirrors transformers' GGUF path (GPT2Tokenizer from vocab + merges, control tokens added as
    special, user-defined ones as plain added tokens, the split regex chosen by ``tokenizer.ggml.pre``,
    and a TemplateProcessing post-processor honouring add_bos/add_eos) so the two encode identically.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    token_types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or ()
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (raw UTF-8 in the file) are respelled byte by byte.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): index
        for index, tok in enumerate(tokens)
    }
    merges: list[tuple[str, str]] = []
    for merge in metadata.get("tokenizer.ggml.merges") or ():
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed BPE merge {merge!r} in GGUF tokenizer")
        merges.append((parts[0], parts[1]))

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()

    # A "control" token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the
    # vocabulary past the model's embedding rows, so it is skipped (as transformers does).
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(tok) <= alphabet
    ]
    tokenizer.add_special_tokens(control)
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED and tok in vocab
    ]
    tokenizer.add_tokens(user_defined)

    def special(key: str) -> tuple[str, int] | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else (tokens[token_id], int(token_id))

    bos = special("bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
    eos = special("eos_token_id") if metadata.get("tokenizer.ggml.add_eos_token") else None
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t is not None]
    )
    return tokenizer
