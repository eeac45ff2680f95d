"""Llama-family decoder math as plain functions (Llama, Llama 3, SmolLM2, Mistral, Qwen2).

Tokens of every sequence in a step are flattened into one ``[T, hidden]`` matrix, so each product runs
once per layer for the whole batch; only attention, passed in as a callable, knows where sequences begin
and end. The non-matmul work of a layer is a ``StepOps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.engine.attention import write_kv
from pdserve.engine.config import ModelConfig, RopeScaling
from pdserve.engine.cpu_kernels import CpuKernels
from pdserve.engine.weights import Linear, ModelWeights

# attend(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H * D]; k/v are already in the cache.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# hook(layer, k [T, Hkv, D], v [T, Hkv, D]) once the layer's K/V are in the cache (on CUDA: queued on the
# current stream); k, v may be views of a buffer reused after the call returns (copy to keep them), and are
# None after a prefill under a CUDA graph, which calls every layer's hook once the graph is queued; there a
# hook that has a ``layers_written(count)`` method gets that one call instead (layers 0 .. count - 1 are all
# written: a KV transfer copies them in one go, kv_transfer.SenderHandle.push_layers).
LayerHook = Callable[[int, "torch.Tensor | None", "torch.Tensor | None"], None]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[D / 2]`` in float32, Llama-3 scaled when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeTables:
    """cos/sin for every position, so a step only gathers rows (no per-step trig)."""

    cos: torch.Tensor  # [P, D] model dtype
    sin_signed: torch.Tensor  # [P, D] model dtype: sin with the first half negated (folds rotate_half's sign)

    @classmethod
    def build(cls, config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> RopeTables:
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [D/2]
        pos = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()  # [P]
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2], float32 as in transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        half = config.head_dim // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        return cls(
            cos=emb.cos().to(device=device, dtype=dtype), sin_signed=sin.to(device=device, dtype=dtype)
        )

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions [T]`` shaped ``[T, 1, D]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused kernel normalises in float32 and is bitwise equal to the unfused float32 formula.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [T, heads, D]``; returns a new contiguous tensor."""
    t, h, d = x.shape
    # flip of the two halves gives [x2, x1]; the sign of rotate_half's -x2 lives in sin_signed.
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # [T, heads, D]
    return x * cos + swapped * sin_signed


class StepOps(Protocol):
    """The non-matmul work of a layer for one step (positions and cache rows bound at construction), and
    how its products are called (``Products``: the ``Linear`` itself)."""

    def linear(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        """``lin(x)``."""
        ...

    def norm_linear(
        self, lin: Linear, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += res`` in place (when given); returns ``lin(rmsnorm(x) * weight)``."""
        ...

    def residual(self, lin: Linear, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """``lin(a)``, a residual for ``x``: returned for the next norm to add, or added into ``x`` at
        once (then None)."""
        ...

    def down(self, lin: Linear, gate_up: torch.Tensor, applied: bool, x: torch.Tensor) -> torch.Tensor | None:
        """The MLP's down product of ``silu(gate) * up`` (``applied``: ``gate_up`` already is that), a
        residual for ``x`` as ``residual`` returns it."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += res`` in place (when given); returns ``rmsnorm(x) * weight``."""
        ...

    def rope_store(
        self, kv_layer: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE on q and k of ``qkv [T, (H + 2Hkv) * D]``; K/V into ``kv_layer``; returns q, k, v
        ``[T, H, D], [T, Hkv, D], [T, Hkv, D]``."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``[T, 2I]`` -> ``[T, I]``."""
        ...


class Products:
    """``StepOps``' products as the ``Linear`` runs them, each norm and residual add on its own (the CUDA
    backend's small batches differ)."""

    def linear(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        return lin(x)

    def norm_linear(
        self, lin: Linear, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.linear(lin, self.add_rms_norm(x, res, weight, eps))

    def residual(self, lin: Linear, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        return self.linear(lin, a)

    def down(self, lin: Linear, gate_up: torch.Tensor, applied: bool, x: torch.Tensor) -> torch.Tensor | None:
        return lin(gate_up if applied else self.silu_mul(gate_up))

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        raise NotImplementedError

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchStepOps(Products):
    """Plain torch ops on any device, following transformers' Llama modules op for op (RMSNorm in float32,
    RoPE as ``x * cos + rotate_half(x) * sin`` in the model dtype): the oracle."""

    def __init__(
        self,
        config: ModelConfig,
        rope: RopeTables,
        positions: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> None:
        self.n_h, self.n_kv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        self.cos, self.sin = rope.gather(positions)  # [T, 1, D], shared by every layer
        self.k_rows, self.v_rows = k_rows, v_rows

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if res is not None:
            x.add_(res)
        return rms_norm(x, weight, eps)

    def rope_store(
        self, kv_layer: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, n_h, n_kv, d = qkv.shape[0], self.n_h, self.n_kv, self.d
        # q and k rotate together: one set of elementwise ops instead of two.
        qk = apply_rope(
            qkv[:, : (n_h + n_kv) * d].view(t, n_h + n_kv, d), self.cos, self.sin
        )  # [T, H + Hkv, D]
        k = qk[:, n_h:]  # [T, Hkv, D]
        v = qkv[:, (n_h + n_kv) * d :].view(t, n_kv, d)  # [T, Hkv, D]
        write_kv(kv_layer, self.k_rows, self.v_rows, k, v)
        return qk[:, :n_h], k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


class KernelStepOps(Products):
    """The fused C kernels of ``engine.cpu_kernels`` (CPU): each part one call, in float32, rounding once."""

    def __init__(
        self,
        kernels: CpuKernels,
        config: ModelConfig,
        rope: RopeTables,
        positions: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> None:
        self.kernels, self.rope = kernels, rope
        self.n_h, self.n_kv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        self.positions, self.k_rows, self.v_rows = positions, k_rows, v_rows

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.kernels.add_rms_norm(x, res, weight, eps)

    def rope_store(
        self, kv_layer: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, n_h, n_kv, d = qkv.shape[0], self.n_h, self.n_kv, self.d
        self.kernels.rope_store(
            qkv,
            n_h,
            n_kv,
            d,
            self.rope.cos,
            self.rope.sin_signed,
            self.positions,
            kv_layer,
            self.k_rows,
            self.v_rows,
        )
        q = qkv[:, : n_h * d].view(t, n_h, d)  # [T, H, D], rotated in place
        k = qkv[:, n_h * d : (n_h + n_kv) * d].view(t, n_kv, d)  # [T, Hkv, D]
        v = qkv[:, (n_h + n_kv) * d :].view(t, n_kv, d)  # [T, Hkv, D]
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


def forward_hidden(
    weights: ModelWeights,
    config: ModelConfig,
    token_ids: torch.Tensor,
    ops: StepOps,
    kv: torch.Tensor,
    attend: AttendFn,
    layer_hook: LayerHook | None = None,
    num_layers: int | None = None,
    hook_after_reduce: bool = False,
) -> torch.Tensor:
    """Run every decoder layer (or the first ``num_layers``: a self-speculative draft) over flattened
    tokens ``[T]``; returns the final hidden states ``[T, hidden]`` before the last norm. Each layer's K/V go
    into ``kv[layer]`` before it attends. ``hook_after_reduce`` (tensor parallelism): the hook runs after the
    layer's o_proj product, whose all-reduce every rank joins only once its own K/V of the layer are in its
    cache, so the hook may read every rank's."""
    eps = config.rms_norm_eps
    x = F.embedding(token_ids, weights.embed)  # [T, hidden]; a fresh tensor, so the residual adds go in place
    # The last sub-block's output, added into x by the next norm (None: nothing, or already added into x
    # by the product itself).
    res: torch.Tensor | None = None
    for i, lw in enumerate(weights.layers[:num_layers]):
        qkv = ops.norm_linear(lw.qkv, x, res, lw.input_norm, eps)  # [T, (H + 2Hkv) * D]
        q, k, v = ops.rope_store(kv[i], qkv)
        o = attend(i, q, k, v)  # [T, H * D]
        if layer_hook is not None and not hook_after_reduce:
            layer_hook(i, k, v)
        res = ops.residual(lw.o_proj, o, x)
        if layer_hook is not None and hook_after_reduce:
            layer_hook(i, k, v)
        # [T, I] when the product applied silu(gate) * up itself, else [T, 2I]
        gu = ops.norm_linear(lw.gate_up, x, res, lw.post_norm, eps)
        res = ops.down(lw.down, gu, lw.gate_up.silu_mul, x)  # [T, hidden]
    if res is not None:
        x.add_(res)
    return x


def logits(weights: ModelWeights, config: ModelConfig, hidden: torch.Tensor, ops: StepOps) -> torch.Tensor:
    """float32 logits ``[T, V]`` from final hidden states ``[T, hidden]``."""
    return ops.linear(
        weights.lm_head, ops.add_rms_norm(hidden, None, weights.final_norm, config.rms_norm_eps)
    ).float()
