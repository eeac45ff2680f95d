"""Weight loading from a Hugging Face model directory into the engine's layout (``ModelWeights``, ``Linear``).

Tensors are converted to the requested dtype and device as they are read, so peak memory stays near one
copy of the model. q/k/v and gate/up are fused into one product each (fewer products a layer on the decode
path, where per-op overhead matters as much as FLOPs); on CPU each matrix is repacked once for its path.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import CpuKernels
from pdserve.engine.env import EngineEnv
from pdserve.engine.hugepages import HugePageArena
from pdserve.engine.quant import INT8_GROUP, check_quantization, dequantize_int8, quantize_int8
from pdserve.engine.tensor_parallel import ShardLayout, shard_state_dict

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
    """All tensors of an HF directory by their HF names, converted to ``dtype`` on ``device``: from
    a sharded ``model.safetensors.index.json``, else ``model.safetensors``, else every ``*.safetensors``
    file there."""
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


class LinearKind(StrEnum):
    """How a ``Linear`` multiplies (``choose_linear`` picks one per model at load).

    PLAIN: ``F.linear`` (any device; MKL on CPU).
    ONEDNN: oneDNN's pre-packed blocked layout (``torch.ops.mkldnn``), its own run-time ISA dispatch.
    PANELS: ``engine.cpu_kernels``' ``linear_packed`` over contiguous column panels, float32 accumulation.
    """

    PLAIN = "plain"
    ONEDNN = "onednn"
    PANELS = "panels"


def onednn_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's pre-packed linear runs ``dtype`` here natively (float32 always; half precision
    only where the CPU has the instructions: AVX512-BF16/AMX, AVX512-FP16)."""
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


def choose_linear(
    dtype: torch.dtype,
    device: torch.device,
    kernels: CpuKernels | None,
    env: EngineEnv | None = None,
    quantization: str = "none",
) -> LinearKind:
    """The matmul path for a model: ``PDSERVE_LINEAR`` when set (ValueError if it cannot run here), else
    the path that ran fastest where we measured (``benchmarks/``):

    - ``quantization="int8"``: PANELS where the C kernels are built (they read int8 panels), else PLAIN
      (``Linear`` dequantises per call: correct, slow). oneDNN's pre-packed path has no int8 weights.

    - CPU, float32, C kernels built: PANELS, faster than oneDNN (itself faster than MKL) at every batch
      size, as the weights stream through once a step.
    - CPU, bfloat16, C kernels with AVX512-BF16 dot products (``CpuKernels.bf16_pairs``): PANELS in pair
      layout, at least as fast as oneDNN's bfloat16, prefill included.
    - CPU, half precision otherwise: ONEDNN where the CPU has the instructions (AVX512-BF16, AMX: bitwise
      equal to ``F.linear``); else PANELS, which reads half-precision weights (half the bytes of float32)
      and multiplies in float32, where oneDNN and MKL would emulate.
    - anything else: PLAIN.
    """
    env = EngineEnv.from_environ() if env is None else env
    if env.linear is not None and env.linear != "auto":
        kind = LinearKind(env.linear)
        if kind is LinearKind.ONEDNN and quantization != "none":
            raise ValueError(f"PDSERVE_LINEAR=onednn cannot run --quantization {quantization}")
        if kind is LinearKind.ONEDNN and not onednn_runs(dtype, device):
            raise ValueError(f"PDSERVE_LINEAR=onednn: oneDNN does not run {dtype} on {device} here")
        if kind is LinearKind.PANELS and (kernels is None or device.type != "cpu"):
            raise ValueError("PDSERVE_LINEAR=panels needs the CPU kernels (a CPU device and a C compiler)")
        return kind
    if device.type != "cpu":
        return LinearKind.PLAIN
    if quantization != "none":
        return LinearKind.PANELS if kernels is not None else LinearKind.PLAIN
    # bf16_pairs of any even K: whether this build has the AVX512-BF16 pair kernel at all
    if dtype == torch.bfloat16 and kernels is not None and kernels.bf16_pairs(2):
        return LinearKind.PANELS
    if dtype != torch.float32 and onednn_runs(dtype, device):
        return LinearKind.ONEDNN
    if kernels is not None:
        return LinearKind.PANELS
    return LinearKind.ONEDNN if onednn_runs(dtype, device) else LinearKind.PLAIN


@dataclass(frozen=True)
class Linear:
    """``y = x @ weight.T + bias``. ``weight`` is in the layout of ``kind`` (``[out, in]`` only for PLAIN):
    use it only through ``__call__``. Quantised (``scales`` set): ``weight`` holds int8 and the weights it
    stands for are ``q * scale`` per output row and group of ``group`` inputs (``engine.quant``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None  # [out]
    kind: LinearKind = LinearKind.PLAIN
    n_out: int = 0  # out features (PANELS pads its layout)
    kernels: CpuKernels | None = None  # PANELS
    # int8 weights: float32 scales, [out, groups] (PLAIN) or CpuKernels.pack_int8_scales' layout (PANELS)
    scales: torch.Tensor | None = None
    group: int = 0  # int8 weights: inputs per scale
    # A fused gate_up whose call returns silu(gate) * up [T, I] (PANELS in CpuKernels.gate_up_panel_order: the
    # product's epilogue applies the activation); False: the call returns [T, 2I] and the caller applies it.
    silu_mul: bool = False

    @classmethod
    def build(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kind: LinearKind = LinearKind.PLAIN,
        kernels: CpuKernels | None = None,
        quantization: str = "none",
        arena: HugePageArena | None = None,
        gate_up: bool = False,
    ) -> Linear:
        """From a plain ``weight [out, in]``: quantised when asked (``engine.quant``), repacked for ``kind``
        (a copy unless PLAIN and unquantised). ``arena``: where PANELS weights are packed (default: their own
        allocations). ``gate_up``: the weight is ``[gate; up]``; PANELS then fuse ``silu(gate) * up`` into
        the product where the intermediate size allows (``silu_mul``)."""
        alloc = None if arena is None else arena.empty
        n = int(weight.shape[0])
        order = None
        if gate_up and kind is LinearKind.PANELS and kernels is not None:
            order = kernels.gate_up_panel_order(n // 2)
        if order is not None:  # the same row permutation of the weight, its bias and (below) its int8 scales
            weight = weight[order]
            bias = None if bias is None else bias[order]
        if check_quantization(quantization) == "int8":
            q, scales = quantize_int8(weight, INT8_GROUP)
            if kind is LinearKind.PLAIN:
                return cls(q, bias, kind, n, scales=scales, group=INT8_GROUP)
            if kind is not LinearKind.PANELS or kernels is None:
                raise ValueError(f"int8 weights need PANELS (with the CPU kernels) or PLAIN, not {kind}")
            b = None if bias is None else bias.contiguous()
            packed, packed_scales = kernels.pack_linear_weight(q, alloc), kernels.pack_int8_scales(scales)
            return cls(packed, b, kind, n, kernels, packed_scales, INT8_GROUP, silu_mul=order is not None)
        if kind is LinearKind.ONEDNN:
            return cls(torch.ops.mkldnn._reorder_linear_weight(weight), bias, kind, n)
        if kind is LinearKind.PANELS:
            if kernels is None:
                raise ValueError("LinearKind.PANELS needs the CPU kernels")
            b = None if bias is None else bias.contiguous()
            return cls(
                kernels.pack_linear_weight(weight, alloc), b, kind, n, kernels, silu_mul=order is not None
            )
        return cls(weight, bias, kind, n)

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """oneDNN's pre-packed layout."""
        return cls.build(weight, bias, LinearKind.ONEDNN)

    @property
    def packed(self) -> bool:
        return self.kind is not LinearKind.PLAIN

    @property
    def out_features(self) -> int:
        return self.n_out or int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is LinearKind.PANELS:
            assert self.kernels is not None
            return self.kernels.linear(
                x, self.weight, self.n_out, self.bias, self.scales, self.group, silu_mul=self.silu_mul
            )
        if self.kind is LinearKind.ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.scales is not None:  # the portable int8 path: dequantise, then multiply as the reference does
            return F.linear(x, dequantize_int8(self.weight, self.scales, self.group).to(x.dtype), self.bias)
        return F.linear(x, self.weight, self.bias)

    def num_bytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
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
        cls,
        sd: dict[str, torch.Tensor],
        config: ModelConfig,
        kind: LinearKind = LinearKind.PLAIN,
        kernels: CpuKernels | None = None,
        quantization: str = "none",
        lm_head_rows: int | None = None,
    ) -> ModelWeights:
        """Consume ``sd`` (entries are popped so unfused copies are freed as we go).

        ``lm_head_rows``: the LM head's rows where they are not the vocabulary (a tensor-parallel rank's
        slice of it, ``engine.tensor_parallel``).

        ``kind``: the matmul layout (``choose_linear``); PANELS needs ``kernels``. ``quantization``:
        ``none`` or ``int8`` (``engine.quant``: every matmul weight, the LM head included; not the
        embedding table). PANELS weights are packed back to back on huge pages (``engine.hugepages``): every
        decode step streams all of them."""
        arena = HugePageArena() if kind is LinearKind.PANELS else None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, gate_up: bool = False) -> Linear:
            return Linear.build(weight, bias, kind, kernels, quantization, arena, gate_up)

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
                        check(p + "gate_up", torch.cat([gate, up]), (2 * c.intermediate_size, c.hidden_size)),
                        gate_up=True,
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
            rows = c.vocab_size if lm_head_rows is None else lm_head_rows
            lm_head = linear(check("lm_head", take("lm_head.weight"), (rows, c.hidden_size)))
        return cls(embed=embed, layers=tuple(layers), final_norm=take("model.norm.weight"), lm_head=lm_head)

    @classmethod
    def load(
        cls,
        path: str | Path,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device,
        kind: LinearKind = LinearKind.PLAIN,
        kernels: CpuKernels | None = None,
        quantization: str = "none",
        shard: ShardLayout | None = None,
    ) -> ModelWeights:
        """``shard``: load only a tensor-parallel rank's part (``engine.tensor_parallel``)."""
        sd = load_state_dict(path, dtype, device)
        if shard is None:
            return cls.from_state_dict(sd, config, kind, kernels, quantization)
        sd = shard_state_dict(sd, config, shard)
        local = dataclasses.replace(shard.local_config(config), tie_word_embeddings=False)  # its own slice
        return cls.from_state_dict(sd, local, kind, kernels, quantization, lm_head_rows=len(shard.vocab))

    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads: every layer, the final norm and the LM head (not the embedding
        table, of which a step reads one row per token)."""
        n = self.lm_head.num_bytes() + self.final_norm.numel() * self.final_norm.element_size()
        for lw in self.layers:
            n += sum(lin.num_bytes() for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
            n += sum(t.numel() * t.element_size() for t in (lw.input_norm, lw.post_norm))
        return n
