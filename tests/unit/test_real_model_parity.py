"""SmolLM2-135M-Instruct (the packaged Q4_1 GGUF) in float32 gives exactly
transformers' greedy output for 4 chat prompts, 32 tokens each.

transformers loads the same GGUF (``from_pretrained(pkgdir, gguf_file=...)``, dequantized to float32);
pdserve converts it into a temporary cache and runs it. Each side loads once per module (the conversion
and transformers' tokenizer once per run: ``tests/conftest.py``, shared with the tokenizer tests). The pieces
(weights, config, prompt ids, our runner's greedy loop) are checked on their own too, so a failure of
the end-to-end test points at its cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine.registry import DEFAULT_MODEL, KNOWN_MODELS, packaged_gguf_path, resolve_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
]


@pytest.fixture(scope="module")
def cache_dir(smollm2_cache) -> Path:
    return smollm2_cache


@pytest.fixture(scope="module")
def model_dir(cache_dir) -> Path:
    return resolve_model(DEFAULT_MODEL, cache_dir, progress=False)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return packaged_gguf_path(DEFAULT_MODEL, KNOWN_MODELS[DEFAULT_MODEL])


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def hf_model(gguf_path, gguf_parsed_once):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy new ids) per chat, from transformers' ``generate``, one prompt at a time."""
    import torch

    out = []
    for chat in CHATS:
        text = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
        out.append((prompt, generated[0, len(prompt) :].tolist()))
    return out


def _strip_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    # transformers keeps the EOS it stopped on; whether an engine reports it is a presentation choice.
    return ids[:-1] if ids and ids[-1] in eos else ids


def test_converted_weights_equal_transformers_exactly(model_dir, hf_model):
    import torch
    from safetensors.torch import load_file

    ours = load_file(str(model_dir / "model.safetensors"))
    theirs = hf_model.state_dict()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and hf_model.config.tie_word_embeddings is True
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in theirs.items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert ours[source].dtype == torch.float32
        assert torch.equal(ours[source], tensor), name


def test_converted_config_matches_transformers(model_dir, hf_model):
    config = json.loads((model_dir / "config.json").read_text())
    ref = hf_model.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(ref, key), key
    assert config["rope_parameters"] == dict(ref.rope_parameters)
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        30,
        9,
        3,
    )


def test_chat_prompt_ids_equal_transformers(model_dir, reference):
    from pdserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    for chat, (prompt, _) in zip(CHATS, reference, strict=True):
        assert tokenizer.apply_chat_template(chat) == prompt


def test_model_runner_greedy_equals_transformers(model_dir, reference, hf_model):
    import torch

    from pdserve.engine.model_runner import DecodeItem, ModelRunner, PrefillItem

    eos = (hf_model.generation_config.eos_token_id,)
    runner = ModelRunner(model_dir, dtype=torch.float32, num_blocks=16)
    table = list(range(runner.num_blocks))
    # Two prompts suffice to localise a failure of the end-to-end test below; all four cost ~30 s more.
    for prompt, expected in reference[:2]:
        logits = runner.prefill([PrefillItem(prompt, table)])  # [1, V]
        tokens = [int(logits[0].argmax())]
        while len(tokens) < MAX_TOKENS and tokens[-1] not in eos:
            logits = runner.decode([DecodeItem(tokens[-1], len(prompt) + len(tokens) - 1, table)])
            tokens.append(int(logits[0].argmax()))
        assert tokens == expected


@pytest.mark.parametrize(
    "speculative",
    [
        None,
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft", "num_speculative_tokens": 2},
    ],
    ids=["plain", "ngram", "draft"],
)
def test_llm_chat_greedy_equals_transformers(cache_dir, reference, hf_model, speculative):
    """Plain, and with n-gram speculative decoding (its verify rows sum as the decode rows do here: the
    tokens are compared whole)."""
    from pdserve.engine import LLM, SamplingParams

    eos = (hf_model.generation_config.eos_token_id,)
    llm = LLM(
        model=DEFAULT_MODEL,
        dtype="float32",
        cache_dir=cache_dir,
        num_blocks=64,
        threads=2,
        speculative_config=speculative,
    )
    outputs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert len(outputs) == len(CHATS)
    for output, (prompt, expected) in zip(outputs, reference, strict=True):
        assert output.prompt_token_ids == prompt
        assert _strip_eos(output.token_ids, eos) == _strip_eos(expected, eos)
        stopped_early = len(_strip_eos(expected, eos)) < MAX_TOKENS
        assert output.finish_reason == ("stop" if stopped_early else "length")
        assert output.text == llm.tokenizer.decode(output.token_ids)
    if speculative is not None:  # proposals were verified, and some stood
        stats = llm.engine.speculator.stats
        assert stats.verify_steps > 0 and stats.accepted_tokens > 0
