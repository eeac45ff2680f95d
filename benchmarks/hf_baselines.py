"""The transformers side of ``benchmarks.engine_cuda``: random-weight models of a known shape, and the
``generate`` baselines (dynamic cache; static cache under ``torch.compile``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Random-weight models (weights do not change speed): smollm2 is SmolLM2-135M's shape (its config.json);
# tiny is for smoke tests. (hidden, intermediate, layers, heads, KV heads, vocab, context, rope theta)
RANDOM_MODELS: dict[str, tuple[int, int, int, int, int, int, int, float]] = {
    "smollm2": (576, 1536, 30, 9, 3, 49152, 8192, 100000.0),
    "tiny": (64, 128, 2, 4, 2, 512, 2048, 10000.0),
}


def random_config(name: str) -> Any:
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv_heads, vocab, context, theta = RANDOM_MODELS[name]
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=context,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def write_random_model(name: str, path: Path, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """Save a random-weight Llama of ``RANDOM_MODELS[name]``'s shape at ``path`` (HF safetensors)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initializing on the GPU takes a fraction of the CPU's time
        model = LlamaForCausalLM(random_config(name)).to(dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    del model
    from pdserve.engine.config import ModelConfig

    write_placeholder_tokenizer(path)
    theta = RANDOM_MODELS[name][-1]
    if ModelConfig.from_dir(path).rope_theta != theta:  # a transformers that spells RoPE another way
        raise RuntimeError(f"random {name} model: config.json lost rope_theta {theta}; see {path}")
    return path


def write_placeholder_tokenizer(path: Path) -> Path:
    """Give a random-weight model directory a tokenizer, so a router can serve it: id ``i`` is the word
    ``<i>`` (whitespace-separated), every id of ``config.json``'s vocabulary, its bos and eos ids special.
    Benchmarks send token ids; this only lets the router check ids and stream some text back."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads((path / "config.json").read_text())
    vocab = {f"<{i}>": i for i in range(int(config["vocab_size"]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {k: config.get(f"{k}_token_id") for k in ("bos", "eos")}
    backend.add_special_tokens([f"<{i}>" for i in special.values() if isinstance(i, int)])
    backend.save(str(path / "tokenizer.json"))
    tok_config = {f"{k}_token": f"<{i}>" for k, i in special.items() if isinstance(i, int)}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def load_transformers(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # always generate the full length
    return model


STATIC_RECIPES = {
    "generate": "static cache; generate compiles its decode step: CompileConfig(reduce-overhead, fullgraph)",
    "forward": 'static cache; model.forward = torch.compile(mode="reduce-overhead", fullgraph=True)',
}


def make_static(model: Any, recipe: str) -> str:
    """Turn ``model`` into the compiled static-cache baseline by ``recipe`` (a key of ``STATIC_RECIPES``, or
    auto: generate where transformers has ``CompileConfig``, else forward); returns the recipe applied."""
    dyn = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):  # one graph per batch size and phase
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), 64))
    gcfg = model.generation_config
    gcfg.cache_implementation = "static"
    if recipe == "auto":
        import transformers

        recipe = "generate" if hasattr(transformers, "CompileConfig") else "forward"
    if recipe == "generate":
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if model.device.type != "cuda":
            # generate compiles on CUDA only unless told so (the smoke tests on CPU)
            cc._compile_all_devices = True  # type: ignore[assignment]
        gcfg.compile_config = cc
        return recipe
    if hasattr(gcfg, "disable_compile"):
        gcfg.disable_compile = True  # newer transformers would compile __call__ around it again
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return recipe


def hf_gen(model: Any, prompts: list[list[int]]) -> Callable[[int], Any]:
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> Any:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)

    return gen
