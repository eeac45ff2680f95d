"""Weight-only int8 quantisation (``--quantization int8``): one float32 scale per output row and input group.

The engine is exact against its dequantised reference (``dequantize_state_dict``: ``q * scale`` in
float32); how far that is from the unquantised model is the model's property, measured by
``benchmarks.engine --quantizations int8``, not assumed. Activations, the KV cache and sums stay unquantised.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# check_quantization and these names import nothing heavy (the CLI validates flags without torch).
QUANTIZATIONS = ("none", "int8")
INT8_MAX = 127
# k per scale: 64 (GGUF's Q8_0 uses 32, GPTQ and AWQ 128): much closer to float32 than one scale per row,
# for 1/16 more bytes than int8 alone. Scales belong to output rows, so quantising the fused qkv and
# gate_up equals quantising each HF matrix.
INT8_GROUP = 64


def check_quantization(name: str) -> str:
    """``name`` if it is one of ``QUANTIZATIONS``, else ValueError naming them."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {name!r}")
    return name


def quantize_int8(weight: torch.Tensor, group: int = INT8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(q [N, K] int8, scales [N, ceil(K / group)] float32)``, one
    scale per row and group of ``group`` consecutive k (the last group may be shorter), symmetric:
    ``scale = max|w_group| / 127``, ``q = round(w / scale)`` (half to even). An all-zero group gets scale 1
    (and zeros)."""
    import torch

    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8: need a 2-D float weight, not {weight.dtype} {tuple(weight.shape)}")
    if group < 1:
        raise ValueError(f"quantize_int8: group must be >= 1, got {group}")
    n, k = weight.shape
    groups = -(-k // group)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group - k)).view(n, groups, group)
    amax = w.abs().amax(dim=2)  # [N, groups]
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(n, groups * group)[:, :k].contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, group: int = INT8_GROUP) -> torch.Tensor:
    """The float32 weights ``q * scale`` stand for: what the engine multiplies by, exactly."""
    return q.float() * scales.float().repeat_interleave(group, dim=1)[:, : q.shape[1]]


# The Hugging Face names of the matrices the engine quantises (per layer), and the LM head.
_LAYER_MATRICES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_LAYER_WEIGHT = re.compile(r"model\.layers\.\d+\.(.+)\.weight")


def dequantize_state_dict(
    sd: Mapping[str, torch.Tensor], tie_word_embeddings: bool
) -> dict[str, torch.Tensor]:
    """The reference for ``--quantization int8``: a copy of the HF state dict ``sd`` in which every matrix
    the engine quantises is replaced by its dequantised float32 weights. With tied embeddings the LM head
    is quantised and the embedding is not, so the result has an untied ``lm_head.weight`` (load it into a
    model configured with ``tie_word_embeddings=False``)."""
    out = dict(sd)
    for name, t in sd.items():
        m = _LAYER_WEIGHT.fullmatch(name)
        if m is not None and m.group(1) in _LAYER_MATRICES:
            out[name] = dequantize_int8(*quantize_int8(t))
    head = sd["model.embed_tokens.weight"] if tie_word_embeddings else sd["lm_head.weight"]
    out["lm_head.weight"] = dequantize_int8(*quantize_int8(head))
    return out


def kv_model_id(model: str, quantization: str) -> str:
    """The model id a worker's KV compatibility record carries (``kv_transfer.KVCompat``): KV computed by
    an int8 model is not what the unquantised model computes, so prefill and decode refuse to pair unless
    both run the same quantization."""
    return model if quantization == "none" else f"{model}+{quantization}"
