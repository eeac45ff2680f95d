"""Model configuration read from a Hugging Face model directory.

``ModelConfig`` is the one place that interprets ``config.json`` (and ``generation_config.json``): the
rest of the engine reads this frozen dataclass, so an unsupported feature (an unknown RoPE scaling, a
sliding window, a non-SiLU MLP) fails here, at load time, with a message naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_type values whose decoder is the Llama block (RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") frequency scaling; the only scaling type implemented."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; supported: 'llama3'")
        if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"invalid llama3 rope scaling {self}")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> RopeScaling | None:
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type in (None, "default"):
            return None
        if rope_type != "llama3":
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: 'default', 'llama3'")
        return cls(
            rope_type=rope_type,
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        )


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from a ``config.json`` dict (plus ``generation_config.json`` when given)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; the Llama-family MLP needs 'silu'")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        max_pos = int(d["max_position_embeddings"])
        window = d.get("sliding_window")
        if d.get("use_sliding_window", model_type == "mistral") and window is not None and window < max_pos:
            raise ValueError(
                f"sliding-window attention (window {window} < context {max_pos}) is not supported"
            )

        # Both spellings transformers has written: the newer ``rope_parameters`` dict, and the older
        # ``rope_theta`` + ``rope_scaling`` keys.
        rope = d.get("rope_parameters")
        if isinstance(rope, Mapping) and "rope_theta" in rope:
            rope_theta = float(rope["rope_theta"])
            rope_scaling = RopeScaling.from_hf(rope)
        else:
            rope_theta = float(d.get("rope_theta", 10000.0))
            scaling = d.get("rope_scaling")
            rope_scaling = RopeScaling.from_hf(scaling) if scaling else None

        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        gen = generation or {}
        eos = _id_tuple(d.get("eos_token_id")) + _id_tuple(gen.get("eos_token_id"))
        bos = d.get("bos_token_id", gen.get("bos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and writes no attention_bias key.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} is not a model directory: no config.json")
        d = json.loads(cfg_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_hf(d, gen)
