"""Weight loading from a Hugging Face model directory.

``load_state_dict`` reads ``model.safetensors``, a sharded
``model.safetensors.index.json``, or (failing both) every ``*.safetensors``
file in the directory, converting each tensor to the requested dtype and
device as it is read so peak memory stays near one copy of the model.

``ModelWeights.from_state_dict`` maps HF parameter names onto the engine's
layout. Two fusions cut the per-layer matmul count on the decode path, where
per-op overhead matters as much as FLOPs:

- ``qkv``: ``cat(q_proj, k_proj, v_proj)`` rows, so one matmul yields
  ``[T, (H + 2 * Hkv) * D]``; the optional Qwen2 biases are fused likewise.
- ``gate_up``: ``cat(gate_proj, up_proj)`` rows, one matmul yields ``[T, 2 * I]``.

Weights on CPU are pre-packed once into oneDNN's blocked layout
(``Linear.pack``, ``can_pack``). Half precision: the same kernel ``F.linear``
ends up in, with bitwise-equal results, minus the per-call weight reorder,
which roughly halves decode-size matmul time for bfloat16. float32:
``F.linear`` goes to MKL, which on an AVX2 EPYC ran batch-8 decode products
at half of oneDNN's pre-packed rate; the results differ from MKL's by
summation order only (the parity tests bound them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.env import EngineEnv

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path}")
    return files


def load_state_dict(
    path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory by their HF names, converted to ``dtype`` on ``device``."""
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


def can_pack(dtype: torch.dtype, device: torch.device, env: EngineEnv | None = None) -> bool:
    """Whether the matmul weights are pre-packed (``Linear.pack``): on a CPU whose oneDNN runs ``dtype``,
    unless ``PDSERVE_PACK_LINEAR=0`` says otherwise.

    float32 packs too: oneDNN's pre-packed float32 kernels ran decode-sized products 1.5-2x faster than
    ``F.linear`` (MKL) on an AVX2 EPYC (bench/results/cpu_engine_avx2), and an ISA-specific path is
    oneDNN's own run-time dispatch, so nothing here assumes an instruction set."""
    env = EngineEnv.from_environ() if env is None else env
    if env.pack_linear is False:
        return False
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    # Private ops (what torch.compile's CPU freezing uses); absent in a torch that renamed them.
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


@dataclass(frozen=True)
class Linear:
    """``y = x @ weight.T + bias``. A packed weight is in oneDNN's blocked layout: use it only through
    ``__call__``."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]
    packed: bool = False

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight), bias, packed=True)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def num_bytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(H + 2 * Hkv) * D, hidden], bias [(H + 2 * Hkv) * D] for Qwen2
    o_proj: Linear  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * I, hidden]
    down: Linear  # [hidden, I]


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [V, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # [V, hidden]; the embedding's values when tied

    @classmethod
    def from_state_dict(
        cls, sd: dict[str, torch.Tensor], config: ModelConfig, pack: bool = False
    ) -> ModelWeights:
        """Consume ``sd`` (entries are popped so unfused copies are freed as we go).

        ``pack``: pre-pack the matmul weights (``Linear.pack``)."""

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear.pack(weight, bias) if pack else Linear(weight, bias)

        def take(name: str) -> torch.Tensor:
            try:
                return sd.pop(name)
            except KeyError:
                raise ValueError(f"weight {name!r} missing from the checkpoint") from None

        def check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            if tuple(t.shape) != shape:
                raise ValueError(f"weight {name}: shape {tuple(t.shape)} != expected {shape} from config")
            return t

        c = config
        qkv_rows = c.q_size + 2 * c.kv_size
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            layers.append(
                LayerWeights(
                    input_norm=check(
                        p + "input_layernorm", take(p + "input_layernorm.weight"), (c.hidden_size,)
                    ),
                    qkv=linear(check(p + "qkv", torch.cat([q, k, v]), (qkv_rows, c.hidden_size)), bias),
                    o_proj=linear(
                        check(p + "o_proj", take(p + "self_attn.o_proj.weight"), (c.hidden_size, c.q_size))
                    ),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(
                        check(p + "gate_up", torch.cat([gate, up]), (2 * c.intermediate_size, c.hidden_size))
                    ),
                    down=linear(
                        check(
                            p + "down", take(p + "mlp.down_proj.weight"), (c.hidden_size, c.intermediate_size)
                        )
                    ),
                )
            )
            del q, k, v, gate, up
        embed = check("embed_tokens", take("model.embed_tokens.weight"), (c.vocab_size, c.hidden_size))
        if c.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
            lm_head = linear(embed)  # packing copies; unpacked it is the same tensor
        else:
            lm_head = linear(check("lm_head", take("lm_head.weight"), (c.vocab_size, c.hidden_size)))
        return cls(embed=embed, layers=tuple(layers), final_norm=take("model.norm.weight"), lm_head=lm_head)

    @classmethod
    def load(
        cls,
        path: str | Path,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device,
        pack: bool = False,
    ) -> ModelWeights:
        return cls.from_state_dict(load_state_dict(path, dtype, device), config, pack=pack)

    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads: every layer, the final norm and the LM head (not the embedding
        table, of which a step reads one row per token)."""
        n = self.lm_head.num_bytes() + self.final_norm.numel() * self.final_norm.element_size()
        for lw in self.layers:
            n += sum(lin.num_bytes() for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
            n += sum(t.numel() * t.element_size() for t in (lw.input_norm, lw.post_norm))
        return n
