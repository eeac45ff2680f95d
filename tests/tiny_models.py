"""Tiny random-weight Llama-family models built with transformers: the correctness oracle.

Weights are drawn with a large init std so logits are peaked and greedy argmax
is not decided by float32 rounding noise.
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("llama", "qwen2", "llama3")


def hf_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3":
        # Llama-3 style rope scaling, tied embeddings (as SmolLM2).
        return LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    if kind == "qwen2":
        return Qwen2Config(
            **common, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    """Save a random-init float32 HF model directory at ``path`` and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_reference(path: Path):
    """The transformers model for a directory made by ``make_tiny_model`` (float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def load_int8_reference(path: Path):
    """The oracle of ``--quantization int8``: the transformers model of ``path`` with every matrix the engine
    quantises replaced by its dequantised weights (``engine.quant.dequantize_state_dict``), LM head untied
    from the (unquantised) embedding."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.quant import dequantize_state_dict

    model = load_reference(path)
    config = copy.deepcopy(model.config)
    sd = dequantize_state_dict(model.state_dict(), bool(config.tie_word_embeddings))
    config.tie_word_embeddings = False
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ref.load_state_dict(sd, strict=True)
    ref.eval()
    return ref


def make_tiny_served_model(kind: str, path: Path, seed: int = 0) -> Path:
    """A tiny random-weight model a cluster can serve: ``kind``'s config with the default model's vocabulary
    and its tokenizer files beside the weights, so the router tokenizes and checks workers as for a real
    model, while every forward costs what a tiny one does."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.registry import resolve_model

    if (path / "config.json").exists():
        return path
    real = resolve_model("smollm2-135m-instruct", progress=False)
    real_config = json.loads((real / "config.json").read_text())
    config = hf_config(kind)
    config.vocab_size = real_config["vocab_size"]
    config.bos_token_id = real_config.get("bos_token_id", config.bos_token_id)
    config.eos_token_id = real_config.get("eos_token_id", config.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(real / name, path / name)
    return path
