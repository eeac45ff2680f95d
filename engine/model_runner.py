"""ModelRunner: weights, the paged KV cache tensor, and batched prefill/decode steps.

The runner holds no allocation state. Block tables come from the caller's
``BlockManager(runner.num_blocks, runner.block_size)``; the runner only reads
and writes the blocks it is handed. One step:

1. build the step's index tensors once (positions, cache rows, block tables,
   masks: ``engine.attention.PrefillMeta`` / ``DecodeMeta``);
2. run the decoder layers over all tokens of the batch flattened (no padding);
   each layer writes its new K/V into the cache, then attends;
3. return float32 logits.

KV cache: ONE tensor ``kv [L, N, 2, B, Hkv, D]`` in the model dtype, allocated
once and zero-filled (see ``engine.attention`` for why unused slots must be
finite), so a transport can register it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from pdserve.engine.attention import DecodeMeta, PrefillMeta, decode_attention, prefill_attention
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import CpuKernels, kernel_cache_dir, load_cpu_kernels, supports
from pdserve.engine.model import (
    KernelStepOps,
    LayerHook,
    RopeTables,
    StepOps,
    TorchStepOps,
    forward_hidden,
    logits,
)
from pdserve.engine.weights import ModelWeights, choose_linear

__all__ = [
    "Backend",
    "DecodeItem",
    "LayerHook",
    "ModelRunner",
    "PrefillItem",
    "DEFAULT_CACHE_SEQUENCES",
]

# Without num_blocks or kv_cache_bytes the cache holds this many full-context sequences.
DEFAULT_CACHE_SEQUENCES = 8


class Backend(StrEnum):
    """Who runs the non-matmul work of a step (attention, norms, RoPE + K/V store, SiLU).

    AUTO: the C kernels of ``engine.cpu_kernels`` on CPU when they build and fit the model, else torch.
    TORCH: torch ops only (any device); decode attention gathers the blocks and runs SDPA.
    CPU_KERNELS: the C kernels; ValueError when they are unavailable.
    """

    AUTO = "auto"
    TORCH = "torch"
    CPU_KERNELS = "cpu_kernels"


@dataclass(frozen=True)
class PrefillItem:
    token_ids: Sequence[int]  # the new tokens to run
    block_table: Sequence[int]  # blocks that hold (or will hold) positions [0, start_pos + len(token_ids))
    start_pos: int = 0  # tokens [0, start_pos) are already in the cache (chunked prefill / prefix reuse)


@dataclass(frozen=True)
class DecodeItem:
    token_id: int  # last sampled token, not yet in the cache
    position: int  # its position; after the step the sequence has position + 1 cached tokens
    block_table: Sequence[int]  # must already cover position


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        backend: Backend | str = Backend.AUTO,
    ) -> None:
        """Load the model and allocate the KV cache.

        Cache size: ``num_blocks`` wins; else as many blocks as fit in ``kv_cache_bytes``; else
        ``DEFAULT_CACHE_SEQUENCES`` (8) sequences of ``max_position_embeddings`` tokens.
        ``backend``: see ``Backend``.
        """
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        backend = Backend(backend)
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        c = self.config
        elt = torch.empty((), dtype=dtype).element_size()
        self.kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * elt
        if num_blocks is None:
            if kv_cache_bytes is not None:
                num_blocks = kv_cache_bytes // (self.kv_bytes_per_token * block_size)
            else:
                num_blocks = -(-c.max_position_embeddings * DEFAULT_CACHE_SEQUENCES // block_size)
        if num_blocks < 1:
            raise ValueError(f"KV cache must hold at least one block (got {num_blocks} blocks)")
        self.num_blocks = int(num_blocks)

        # The kernel library also holds the panel matmuls (``engine.weights.LinearKind.PANELS``), which
        # any model shape can use; its attention and elementwise kernels serve the shapes ``supports``.
        lib = load_cpu_kernels(kernel_cache_dir()) if self.device.type == "cpu" else None
        self.kernels: CpuKernels | None = None
        if backend is not Backend.TORCH:
            if supports(c.num_heads, c.num_kv_heads, c.head_dim, dtype):
                self.kernels = lib
            if backend is Backend.CPU_KERNELS and self.kernels is None:
                raise ValueError(
                    "backend='cpu_kernels' is unavailable here (needs a CPU device, "
                    "a C compiler and head_dim % 16 == 0)"
                )
        self.backend = Backend.TORCH if self.kernels is None else Backend.CPU_KERNELS

        self.linear_kind = choose_linear(dtype, self.device, lib)
        self.weights = ModelWeights.load(self.model_dir, c, dtype, self.device, self.linear_kind, lib)
        self.rope = RopeTables.build(c, dtype, self.device)
        self.kv = torch.zeros(
            c.num_layers,
            self.num_blocks,
            2,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=dtype,
            device=self.device,
        )  # [L, N, 2, B, Hkv, D]

    def _check_positions(self, last_position: int) -> None:
        if last_position >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {last_position} exceeds the model context of {self.config.max_position_embeddings}"
            )

    def prefill(
        self, items: Sequence[PrefillItem], layer_hook: LayerHook | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        """Run prompts (or prompt chunks) of any lengths in one forward.

        Returns float32 logits ``[n_items, V]`` of each item's last token, or ``[T_total, V]`` for every new
        token in batch order when ``all_logits``. ``layer_hook(layer, k, v)`` gets each layer's new K/V
        ``[T_total, Hkv, D]`` right after they were written to the cache.
        """
        if not items:
            raise ValueError("prefill needs at least one item")
        ids: list[int] = []
        for it in items:
            if len(it.token_ids) == 0:
                raise ValueError("prefill item has no tokens")
            if it.start_pos < 0:
                raise ValueError(f"start_pos must be >= 0, got {it.start_pos}")
            self._check_positions(it.start_pos + len(it.token_ids) - 1)
            ids.extend(it.token_ids)
        meta = PrefillMeta.build(
            [(len(it.token_ids), it.block_table, it.start_pos) for it in items],
            self.block_size,
            self.num_blocks,
            self.device,
        )

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return prefill_attention(self.kv[layer], meta, q, k, v)

        with torch.inference_mode():
            token_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [T]
            ops = self._ops(meta.positions, meta.k_rows, meta.v_rows)
            hidden = forward_hidden(self.weights, self.config, token_ids, ops, self.kv, attend, layer_hook)
            if not all_logits:
                hidden = hidden.index_select(0, meta.last_rows)  # [n, hidden]
            return logits(self.weights, self.config, hidden, ops)

    def decode(self, items: Sequence[DecodeItem]) -> torch.Tensor:
        """One token per sequence; returns float32 logits ``[n_items, V]``."""
        if not items:
            raise ValueError("decode needs at least one item")
        for it in items:
            if it.position < 0:
                raise ValueError(f"position must be >= 0, got {it.position}")
            self._check_positions(it.position)
        kernels = self.kernels
        meta = DecodeMeta.build(
            [(it.position, it.block_table) for it in items],
            self.block_size,
            self.num_blocks,
            self.device,
            with_mask=kernels is None,
        )

        last = self.config.num_layers - 1

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nxt = self.kv[layer + 1] if layer < last else None
            return decode_attention(self.kv[layer], meta, q, kernels, nxt)

        with torch.inference_mode():
            token_ids = torch.tensor([it.token_id for it in items], dtype=torch.int64, device=self.device)
            ops = self._ops(meta.positions, meta.k_rows, meta.v_rows)
            hidden = forward_hidden(self.weights, self.config, token_ids, ops, self.kv, attend)
            return logits(self.weights, self.config, hidden, ops)

    def _ops(self, positions: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> StepOps:
        if self.kernels is not None:
            return KernelStepOps(self.kernels, self.config, self.rope, positions, k_rows, v_rows)
        return TorchStepOps(self.config, self.rope, positions, k_rows, v_rows)
