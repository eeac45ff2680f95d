"""Turn a llama.cpp GGUF file into what a Hugging Face model directory holds: config, weights, tokenizer.

Each part maps back to what transformers builds from the same file (``from_pretrained(..., gguf_file=...)``),
so a converted model computes exactly what transformers computes on that GGUF. Weights are dequantized to
float32 with ``gguf.quants.dequantize``. Pure numpy + ``gguf`` + ``tokenizers``: converting needs no torch.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.gguf_tokenizer import build_byte_level_tokenizer

log = logging.getLogger(__name__)

# Bump when the output of a conversion changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1

SUPPORTED_ARCHS = ("llama", "qwen2")

# A shard never grows past this many float32 bytes (a tensor larger than it gets a shard of its own).
DEFAULT_SHARD_BYTES = 2 << 30

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's metadata and tensor table; tensor data is read only by :meth:`iter_state_dict`."""

    path: Path
    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]
    # gguf.GGUFReader; parsing the header is the slow part of opening, so it is kept.
    reader: Any = field(repr=False, compare=False)

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        import gguf

        path = Path(path)
        reader = gguf.GGUFReader(path)
        metadata = {key: value.contents() for key, value in reader.fields.items()}
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"{path}: GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS}"
            )
        return cls(
            path=path, metadata=metadata, tensor_names=tuple(t.name for t in reader.tensors), reader=reader
        )

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])

    def _arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict, in the shape transformers 5 saves it."""
        heads = self._arch_key("attention.head_count")
        kv_heads = self._arch_key("attention.head_count_kv", heads)
        if isinstance(heads, list) or isinstance(kv_heads, list):
            raise ValueError(f"{self.path}: per-layer head counts are not supported")
        hidden = self._arch_key("embedding_length")
        head_dim = self._arch_key("attention.key_length") or hidden // heads
        rope_dim = self._arch_key("rope.dimension_count")
        if rope_dim is not None and rope_dim != head_dim:
            raise ValueError(
                f"{self.path}: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported"
            )
        if "rope_freqs.weight" in self.tensor_names:
            # llama.cpp stores Llama-3.1 rope scaling only as per-dimension factors; ignoring them would
            # silently change every position's rotation.
            raise ValueError(f"{self.path}: rope frequency factors (rope_freqs.weight) are not supported")
        tokens = self.metadata.get("tokenizer.ggml.tokens") or ()
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM" if self.arch == "llama" else "Qwen2ForCausalLM"],
            "model_type": self.arch,
            "vocab_size": self._arch_key("vocab_size") or len(tokens),
            "hidden_size": hidden,
            "intermediate_size": self._arch_key("feed_forward_length"),
            "num_hidden_layers": self._arch_key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self._arch_key("context_length"),
            "rms_norm_eps": self._arch_key("attention.layer_norm_rms_epsilon"),
            "rope_parameters": self._rope_parameters(),
            # llama.cpp writes output.weight only when the head is not the embedding matrix.
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.metadata.get("tokenizer.ggml.padding_token_id"),
            "dtype": "float32",
        }
        if self.arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
            config["mlp_bias"] = False
        else:
            config["use_sliding_window"] = False
        return config

    def _rope_parameters(self) -> dict[str, Any]:
        rope: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": float(self._arch_key("rope.freq_base", 10000.0)),
        }
        scaling = self._arch_key("rope.scaling.type")
        if scaling in (None, "none"):
            return rope
        if scaling == "linear":
            return rope | {"rope_type": "linear", "factor": float(self._arch_key("rope.scaling.factor"))}
        raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported")

    def generation_config(self) -> dict[str, Any]:
        keys = {
            "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id",
            "pad_token_id": "padding_token_id",
        }
        return {
            name: self.metadata[f"tokenizer.ggml.{key}"]
            for name, key in keys.items()
            if f"tokenizer.ggml.{key}" in self.metadata
        }

    def float32_nbytes(self) -> dict[str, int]:
        """GGUF tensor name -> its size once dequantized to float32, without reading any data."""
        return {t.name: int(t.n_elements) * 4 for t in self.reader.tensors}

    def iter_state_dict(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(hf_name, float32 array)`` for every tensor, in file order; one tensor in memory at a time."""
        for _, hf_name, weights in self.iter_tensors():
            yield hf_name, weights

    def iter_tensors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """``(gguf_name, hf_name, float32 array)`` for every tensor, in file order."""
        import gguf

        config = self.hf_config()
        for tensor in self.reader.tensors:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            weights = np.array(weights, dtype=np.float32)  # own the memory: the reader's is a file map
            yield tensor.name, hf_tensor_name(tensor.name), self._undo_layout(tensor.name, weights, config)

    def _undo_layout(self, name: str, weights: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        # llama.cpp reorders Q and K rows of llama-arch models so its rotary kernel can pair adjacent
        # values (convert_hf_to_gguf.py `permute`); HF pairs the two halves of each head. Qwen2 files
        # keep HF's order.
        if self.arch != "llama":
            return weights
        if ".attn_q." in name:
            return unpermute_qk(weights, config["num_attention_heads"])
        if ".attn_k." in name:
            return unpermute_qk(weights, config["num_key_value_heads"])
        return weights

    def tokenizer(self) -> tuple[Any, dict[str, Any]] | None:
        """``(tokenizers.Tokenizer, tokenizer_config dict)``, or None without a usable vocabulary."""
        kind = self.metadata.get("tokenizer.ggml.model")
        if kind is None:
            return None
        if kind != "gpt2":
            log.warning(
                "%s: tokenizer type %r is not supported; converting without a tokenizer", self.path, kind
            )
            return None
        return build_byte_level_tokenizer(self.metadata), self.tokenizer_config()

    def tokenizer_config(self) -> dict[str, Any]:
        md = self.metadata
        tokens = md["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            token_id = md.get(f"tokenizer.ggml.{key}")
            return None if token_id is None else tokens[token_id]

        config: dict[str, Any] = {
            "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
            "clean_up_tokenization_spaces": False,
            "model_max_length": self._arch_key("context_length"),
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if "tokenizer.chat_template" in md:
            config["chat_template"] = md["tokenizer.chat_template"]
        return config


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_qk(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: per head, rows (i, i + D/2) were stored as (2i, 2i + 1)."""
    half = weights.shape[0] // n_heads // 2
    # [H, D/2, 2, ...] -> [H, 2, D/2, ...] -> [H * D, ...]
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_hf_dir(
    checkpoint: GGUFCheckpoint, out_dir: Path, progress: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """Write config, generation config, float32 safetensors (sharded past ``shard_bytes``) and tokenizer."""
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", checkpoint.hf_config())
    _write_json(out_dir / "generation_config.json", checkpoint.generation_config())
    tok = checkpoint.tokenizer()
    if tok is not None:
        tokenizer, tokenizer_config = tok
        tokenizer.save(str(out_dir / "tokenizer.json"))
        _write_json(out_dir / "tokenizer_config.json", tokenizer_config)

    shards = plan_shards(checkpoint.float32_nbytes(), shard_bytes)
    names = [_shard_file_name(i, len(shards)) for i in range(len(shards))]
    shard_of = {gguf_name: i for i, shard in enumerate(shards) for gguf_name in shard}
    current: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(
        total=len(shard_of),
        desc=f"pdserve: converting {checkpoint.path.name}",
        unit="tensor",
        disable=not progress,
    )
    with bar:
        for gguf_name, hf_name, weights in checkpoint.iter_tensors():
            index = shard_of[gguf_name]
            current[hf_name] = weights
            weight_map[hf_name] = names[index]
            total += weights.nbytes
            bar.update(1)
            # Shards are contiguous runs of the file order, so a shard is complete when its last
            # tensor arrives: write it and drop it from memory.
            if gguf_name == shards[index][-1]:
                save_file(current, str(out_dir / names[index]), metadata={"format": "pt"})
                current = {}
    if len(shards) > 1:
        _write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )


def plan_shards(nbytes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Split tensors (in the given order) into contiguous runs of at most ``shard_bytes`` each."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in nbytes.items():
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards if shards[0] else []


def _shard_file_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
