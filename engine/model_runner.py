"""ModelRunner: weights, the paged KV cache tensor, and batched prefill/decode steps.

The runner holds no allocation state: block tables come from the caller's
``BlockManager(runner.num_blocks, runner.block_size)``, and the runner reads and writes only the blocks it
is handed. A step builds its index tensors once, runs the layers over the batch flattened, returns logits.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.attention import DecodeMeta, PrefillMeta, decode_attention, prefill_attention
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import CpuKernels, kernel_cache_dir, load_cpu_kernels, supports
from pdserve.engine.hugepages import SharedTensor, zeros_huge_pages
from pdserve.engine.model import (
    KernelStepOps,
    LayerHook,
    RopeTables,
    StepOps,
    TorchStepOps,
    forward_hidden,
    logits,
)
from pdserve.engine.quant import check_quantization
from pdserve.engine.sampler import Sampler, seeded_race
from pdserve.engine.tensor_parallel import ReducingStepOps, TensorParallel, start_group
from pdserve.engine.weights import ModelWeights, choose_linear

if TYPE_CHECKING:
    from pdserve.engine.cuda_backend import DecodeGraphs, PrefillGraphs

__all__ = [
    "Backend",
    "DecodeItem",
    "KeptRows",
    "LayerHook",
    "ModelRunner",
    "PrefillItem",
    "DEFAULT_CACHE_SEQUENCES",
]

# Without num_blocks or kv_cache_bytes the cache holds this many full-context sequences.
DEFAULT_CACHE_SEQUENCES = 8


# Longest prompt chunk a prefill CUDA graph is captured for (its activations live in the graphs' pool).
PREFILL_GRAPH_MAX_TOKENS = 2048

# On CUDA, what the KV cache leaves free of the device's share for activations, graphs and logits.
CUDA_ACTIVATION_RESERVE = 512 << 20


class Backend(StrEnum):
    """Who runs the non-matmul work of a step (attention, norms, RoPE + K/V store, SiLU).

    AUTO: the C kernels of ``engine.cpu_kernels`` on CPU, the Triton kernels of ``engine.triton_kernels``
    on CUDA, when they are available and fit the model; else torch.
    TORCH: torch ops only (any device); decode attention gathers the blocks and runs SDPA. The oracle.
    CPU_KERNELS: the C kernels; ValueError when they are unavailable.
    TRITON: the Triton kernels, with decode under CUDA graphs (``engine.cuda_backend``); CUDA only.
    """

    AUTO = "auto"
    TORCH = "torch"
    CPU_KERNELS = "cpu_kernels"
    TRITON = "triton"


def _triton_fits(config: ModelConfig) -> bool:
    try:
        from pdserve.engine import triton_kernels
    except ImportError:
        return False
    return triton_kernels.supports(config.num_heads, config.num_kv_heads, config.head_dim)


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


class KeptRows:
    """The new positions of the prefill items a step kept (``ModelRunner.prefill_keeping``), every one of
    them, in batch order: ``logits(start, end)`` gives rows ``[start, end)``'s float32 logits, computed when
    asked, so a long prompt never holds its whole ``[T, V]`` logits. Valid until the runner's next step,
    on the thread that ran it (the CPU kernels' thread)."""

    def __init__(self, num_rows: int, rows_logits: Callable[[int, int], torch.Tensor]) -> None:
        self.num_rows = num_rows
        self._rows_logits = rows_logits

    def logits(self, start: int, end: int) -> torch.Tensor:
        with torch.inference_mode():
            return self._rows_logits(start, end)


def _kept_rows(
    lengths: Sequence[int], keep: Sequence[bool], offset: int, device: torch.device
) -> torch.Tensor:
    """Row indices, in a batch flattened from ``offset`` on, of every token of the items marked ``keep``."""
    rows: list[int] = []
    start = offset
    for n, k in zip(lengths, keep, strict=True):
        if k:
            rows.extend(range(start, start + n))
        start += n
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _mirrored(fn: Callable) -> Callable:
    """A runner method that touches the model or the KV cache: under tensor parallelism rank 0 hands the
    call to its followers first, so every rank runs it (and its collectives) in the same order. Calls made
    from inside such a call are not sent again."""

    @functools.wraps(fn)
    def run(self: ModelRunner, *args: object, **kwargs: object) -> object:
        tp = self.tp
        if tp is None or not tp.leads or self._mirror_depth:
            return fn(self, *args, **kwargs)
        # A layer hook stays here: the followers run the call without it (rank 0's hook reads their
        # caches once the layer's all-reduce says they are written).
        sent_args = tuple(None if callable(a) else a for a in args)
        sent_kwargs = {k: None if callable(v) else v for k, v in kwargs.items()}
        try:
            tp.send((fn.__name__, sent_args, sent_kwargs))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"{fn.__name__} with such arguments cannot run tensor-parallel: {e}") from e
        self._mirror_depth += 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._mirror_depth -= 1

    return run


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
        gpu_memory_utilization: float | None = None,
        quantization: str = "none",
        kernel_isa: str | None = None,
        kv_shared: bool = False,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """Load the model and allocate the KV cache.

        Cache size: ``num_blocks`` wins; else as many blocks as fit in ``kv_cache_bytes``; else, on CUDA,
        what ``gpu_memory_utilization`` (default 0.9) of the device's memory leaves once the weights and
        ``CUDA_ACTIVATION_RESERVE`` are counted (as vLLM's flag); else ``DEFAULT_CACHE_SEQUENCES`` (8)
        sequences of ``max_position_embeddings`` tokens. ``backend``: see ``Backend``. ``quantization``:
        ``none`` or ``int8`` (weight-only, ``engine.quant``). ``kernel_isa``: which build of the CPU kernels
        (``EngineEnv.kernel_isa``; default ``PDSERVE_KERNEL_ISA``, else native): tests run every ISA path.
        ``kv_shared`` (CPU only): the KV cache in shared memory (``hugepages.SharedTensor``; its memfd is
        ``kv_shared_fd``), which a prefill worker of this host writes with plain copies; it has huge pages
        only where shared memory gets them (``shared_memory_huge_pages``). ``tensor_parallel``: this rank's
        group (``engine.tensor_parallel``): the runner loads its shard of the model, caches its KV heads
        only, and returns the whole vocabulary's logits; on rank 0 every forward runs on all ranks.
        """
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        backend = Backend(backend)
        self.quantization = check_quantization(quantization)
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.tp = tensor_parallel
        self._mirror_depth = 0
        self._kept: KeptRows | None = None  # tensor parallelism: each rank's latest kept rows
        # What this process runs: the whole model, or its rank's heads and columns.
        self.shard_config = self.config if self.tp is None else self.tp.layout.local_config(self.config)
        if self.tp is not None and torch.device(device).type == "cuda" and backend is Backend.TRITON:
            raise ValueError(
                "backend='triton' does not run tensor-parallel: a group on CUDA runs the torch backend"
            )
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        c = self.shard_config
        elt = torch.empty((), dtype=dtype).element_size()
        self.kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * elt
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        on_cuda = self.device.type == "cuda"
        if on_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if num_blocks is None and kv_cache_bytes is not None:
            num_blocks = kv_cache_bytes // (self.kv_bytes_per_token * block_size)
        if num_blocks is None and not on_cuda:
            num_blocks = -(-c.max_position_embeddings * DEFAULT_CACHE_SEQUENCES // block_size)
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"KV cache must hold at least one block (got {num_blocks} blocks)")

        # The kernel library also holds the panel matmuls (``engine.weights.LinearKind.PANELS``), which
        # any model shape can use; its attention and elementwise kernels serve the shapes ``supports``.
        # Seconds of each start-up phase (a worker exports them: pdserve_worker_startup_seconds).
        self._phase_s: dict[str, float] = {}
        t0 = time.perf_counter()
        lib = load_cpu_kernels(kernel_cache_dir(), kernel_isa) if self.device.type == "cpu" else None
        self._phase_s["kernel_build"] = time.perf_counter() - t0
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
        # Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors: tests ask for it there.
        interpreted = self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        # (A tensor-parallel group runs the torch step: its all-reduces sit between products that the
        # Triton step runs under CUDA graphs.)
        wants_triton = backend is Backend.TRITON or (backend is Backend.AUTO and on_cuda and self.tp is None)
        if wants_triton and (on_cuda or interpreted) and _triton_fits(c):
            self.backend = Backend.TRITON
        if backend is Backend.TRITON and self.backend is not Backend.TRITON:
            raise ValueError(
                "backend='triton' is unavailable here (needs a CUDA device, Triton, and a power-of-two "
                "head_dim >= 16)"
            )

        t0 = time.perf_counter()
        self.linear_kind = choose_linear(dtype, self.device, lib, quantization=quantization)
        self.weights = ModelWeights.load(
            self.model_dir,
            self.config,
            dtype,
            self.device,
            self.linear_kind,
            lib,
            quantization,
            shard=None if self.tp is None else self.tp.layout,
        )
        self.rope = RopeTables.build(c, dtype, self.device)
        self._phase_s["model_load"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        block_bytes = self.kv_bytes_per_token * block_size
        if on_cuda:
            share = 1 if self.tp is None else self.tp.placement.share(self.tp.rank)
            num_blocks = _cuda_num_blocks(self.device, num_blocks, block_bytes, gpu_memory_utilization, share)
        assert num_blocks is not None
        if self.tp is not None:  # rank 0's block tables index every rank's cache: one block count for all
            num_blocks = self.tp.agree_min(num_blocks)
        self.num_blocks = int(num_blocks)
        self._decoder: DecodeGraphs | None = None
        self._prefill_graphs: PrefillGraphs | None = None
        # [L, N, 2, B, Hkv, D]: one tensor, allocated once so a transport registers it once, and zero-filled
        # because attention gives masked slots probability 0 and 0 * nan would poison the output.
        shape = (c.num_layers, self.num_blocks, 2, block_size, c.num_kv_heads, c.head_dim)
        self._kv_shared: SharedTensor | None = None
        if kv_shared and self.device.type == "cpu":
            self._kv_shared = SharedTensor(*shape, dtype=dtype)
            self.kv = self._kv_shared.tensor
        else:  # huge pages on CPU: attention and transports stream it
            self.kv = zeros_huge_pages(*shape, dtype=dtype, device=self.device)
        # Every rank's KV cache, by rank: rank 0 maps its followers' (shared memory) for the KV transfer
        # (on CPU: a group on CUDA has no KV transfer, so rank 0 holds its own cache only).
        self._follower_kv: list[SharedTensor] = []
        if self.tp is not None and self.tp.leads and self.device.type == "cpu":
            self._follower_kv = self.tp.follower_caches(shape, dtype)
        self.rank_kv: list[torch.Tensor] = [self.kv] + [t.tensor for t in self._follower_kv]
        self._phase_s["kv_alloc"] = time.perf_counter() - t0

    @property
    def kv_shared_fd(self) -> int | None:
        """The memfd of a KV cache in shared memory (``kv_shared``), else None."""
        return None if self._kv_shared is None else self._kv_shared.fd

    @property
    def rank_shared_fds(self) -> tuple[int | None, ...]:
        """Per rank of ``rank_kv``, the memfd its cache is mapped from here (None: not shared)."""
        return (self.kv_shared_fd, *(t.fd for t in self._follower_kv))

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Seconds each start-up phase took: kernel_build (the CPU kernel library, built or loaded),
        model_load (weights, converted to the runtime layout), kv_alloc, and graph_capture when decode
        runs under CUDA graphs."""
        out = dict(self._phase_s)
        if self.graph_capture_s is not None:
            out["graph_capture"] = self.graph_capture_s
        return out

    @property
    def graph_capture_s(self) -> float | None:
        """Seconds the CUDA-graph captures (decode, prefill) took at start-up (None: no graphs)."""
        times = [
            g.capture_s
            for g in (self._decoder, self._prefill_graphs)
            if g is not None and g.capture_s is not None
        ]
        return sum(times) if times else None

    def prepare_decode(self, max_batch: int, cuda_graphs: bool = True) -> None:
        """Triton backend: static decode inputs for up to ``max_batch`` sequences, and (``cuda_graphs``)
        a CUDA graph per bucketed batch size, captured now. A no-op on other backends."""
        if self.backend is not Backend.TRITON:
            return
        cuda_graphs = cuda_graphs and self.device.type == "cuda"  # (the interpreter in tests: eager)
        d = self._decoder
        if d is not None and d.max_batch >= max_batch and (d.capture_s is not None) == cuda_graphs:
            return
        from pdserve.engine.cuda_backend import DecodeGraphs, make_forward

        c = self.config
        with torch.inference_mode():
            self._decoder = DecodeGraphs(
                make_forward(self.weights, c, self.rope, self.kv),
                max_batch=max_batch,
                max_blocks=-(-c.max_position_embeddings // self.block_size),
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                num_kv_heads=c.num_kv_heads,
                max_len=c.max_position_embeddings,
                device=self.device,
                use_graphs=cuda_graphs,
            )

    def prepare_prefill(self, max_tokens: int = PREFILL_GRAPH_MAX_TOKENS, cuda_graphs: bool = True) -> None:
        """Triton backend on CUDA (``cuda_graphs``): capture a prefill of one prompt chunk at bucketed
        token counts up to ``max_tokens`` (capped by ``PREFILL_GRAPH_MAX_TOKENS`` and the context) as CUDA
        graphs; longer chunks and batches of several run eagerly. A no-op elsewhere."""
        if self.backend is not Backend.TRITON or self.device.type != "cuda" or not cuda_graphs:
            return
        c = self.config
        max_tokens = max(16, min(max_tokens, PREFILL_GRAPH_MAX_TOKENS, c.max_position_embeddings))
        if self._prefill_graphs is not None and self._prefill_graphs.max_tokens >= max_tokens:
            return
        from pdserve.engine.cuda_backend import PrefillGraphs, make_prefill_forward

        with torch.inference_mode():
            self._prefill_graphs = PrefillGraphs(
                make_prefill_forward(self.weights, c, self.rope, self.kv),
                max_tokens=max_tokens,
                max_blocks=-(-c.max_position_embeddings // self.block_size),
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                device=self.device,
            )

    def _check_positions(self, last_position: int) -> None:
        if last_position >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {last_position} exceeds the model context of {self.config.max_position_embeddings}"
            )

    def _prefill_ids(self, items: Sequence[PrefillItem]) -> list[int]:
        """The items' new tokens flattened in batch order, after checking each item (ValueError)."""
        ids: list[int] = []
        for it in items:
            if len(it.token_ids) == 0:
                raise ValueError("prefill item has no tokens")
            if it.start_pos < 0:
                raise ValueError(f"start_pos must be >= 0, got {it.start_pos}")
            self._check_positions(it.start_pos + len(it.token_ids) - 1)
            ids.extend(it.token_ids)
        return ids

    def _check_decode(self, items: Sequence[DecodeItem]) -> None:
        for it in items:
            if it.position < 0:
                raise ValueError(f"position must be >= 0, got {it.position}")
            self._check_positions(it.position)

    def _decode_meta(self, items: Sequence[DecodeItem]) -> DecodeMeta:
        """Index tensors of a decode step (the C kernel needs no mask)."""
        return DecodeMeta.build(
            [(it.position, it.block_table) for it in items],
            self.block_size,
            self.num_blocks,
            self.device,
            with_mask=self.kernels is None,
        )

    @_mirrored
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
        ids = self._prefill_ids(items)
        if self.backend is Backend.TRITON:
            return self._prefill_triton(items, layer_hook, all_logits)
        with torch.inference_mode():
            hidden, meta, ops = self._prefill_hidden(items, ids, layer_hook)
            if not all_logits:
                hidden = hidden.index_select(0, meta.last_rows)  # [n, hidden]
            return self._logits(hidden, ops)

    def _prefill_hidden(
        self, items: Sequence[PrefillItem], ids: list[int], layer_hook: LayerHook | None
    ) -> tuple[torch.Tensor, PrefillMeta, StepOps]:
        """The prefill forward up to the final hidden states ``[T, hidden]`` (CPU backends)."""
        meta = PrefillMeta.build(
            [(len(it.token_ids), it.block_table, it.start_pos) for it in items],
            self.block_size,
            self.num_blocks,
            self.device,
        )

        kernels = self.kernels

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return prefill_attention(self.kv[layer], meta, q, k, v, kernels)

        token_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [T]
        ops = self._ops(meta.positions, meta.k_rows, meta.v_rows)
        hidden = forward_hidden(
            self.weights, self.config, token_ids, ops, self.kv, attend, layer_hook,
            hook_after_reduce=self.tp is not None,
        )  # fmt: skip
        return hidden, meta, ops

    @_mirrored
    def prefill_keeping(
        self, items: Sequence[PrefillItem], keep: Sequence[bool], layer_hook: LayerHook | None = None
    ) -> tuple[torch.Tensor, KeptRows]:
        """``prefill``'s logits ``[n_items, V]`` of each item's last token (the same values; on CUDA the
        eager forward's, which a prefill graph's padded chunk matches within rounding), and every new token
        of the items marked ``keep`` (prompt logprobs; only theirs are kept)."""
        if not items:
            raise ValueError("prefill needs at least one item")
        ids = self._prefill_ids(items)
        lengths = [len(it.token_ids) for it in items]
        if self.backend is Backend.TRITON:
            return self._prefill_triton_keeping(items, layer_hook, _kept_rows(lengths, keep, 0, self.device))
        with torch.inference_mode():
            hidden, meta, ops = self._prefill_hidden(items, ids, layer_hook)
            out = self._logits(hidden.index_select(0, meta.last_rows), ops)
            return out, self._keep(hidden, _kept_rows(lengths, keep, 0, self.device), ops)

    def _keep(self, hidden: torch.Tensor, rows: torch.Tensor, ops: StepOps) -> KeptRows:
        kept = hidden.index_select(0, rows)  # [n_kept, hidden]: the step's activations are freed
        rows_logits = KeptRows(len(kept), lambda a, b: self._logits(kept[a:b], ops))
        if self.tp is None:
            return rows_logits
        self._kept = rows_logits  # every rank keeps its own; rank 0's reads go through kept_logits
        return KeptRows(len(kept), self.kept_logits)

    @_mirrored
    def kept_logits(self, start: int, end: int) -> torch.Tensor:
        """Tensor parallelism: rows ``[start, end)`` of the latest kept rows' logits, made on every rank."""
        if self._kept is None:
            raise RuntimeError("no kept rows to read")
        return self._kept.logits(start, end)

    def _logits(self, hidden: torch.Tensor, ops: StepOps) -> torch.Tensor:
        """float32 logits ``[T, V]`` of final hidden states: under tensor parallelism each rank's vocabulary
        slice, gathered."""
        out = logits(self.weights, self.config, hidden, ops)
        return out if self.tp is None else self.tp.gather_vocab(out)

    @_mirrored
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """For each ``(src, dst)`` pair, block ``dst`` takes block ``src``'s K/V in every layer: a forked
        choice's own copy of the partial block it shared (``BlockManager.fork_prefix``)."""
        if not pairs:
            return
        dev = self.kv.device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=dev)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dev)
        with torch.inference_mode():
            self.kv[:, dst] = self.kv[:, src]  # [L, len(pairs), 2, B, Hkv, D]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` for this runner's float32 logits ``[n, V]``: the CPU kernels' row argmax
        where they run (torch's is slow on a large vocabulary)."""
        if self.kernels is not None:
            return self.kernels.argmax(logits)
        if self.backend is Backend.TRITON and logits.is_contiguous() and logits.dtype == torch.float32:
            from pdserve.engine import triton_kernels as tk

            return tk.argmax_rows(logits)  # torch's one-block reduction leaves the GPU idle
        return logits.argmax(dim=-1)

    def seeded_race(self, probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The sampler's seeded draw (``engine.sampler.seeded_race``): the CPU kernels' one-pass form where
        they run (the tensor form makes several passes over the vocabulary)."""
        return self.kernels.seeded_race(probs, keys) if self.kernels is not None else seeded_race(probs, keys)

    def sampler(self, eos_token_ids: Sequence[int], seed: int = 0) -> Sampler:
        """A sampler for this runner's logits, using its kernels where they run."""
        return Sampler(
            eos_token_ids, seed=seed, device=self.kv.device, argmax=self.argmax, race=self.seeded_race
        )

    @_mirrored
    def decode(self, items: Sequence[DecodeItem], num_layers: int | None = None) -> torch.Tensor:
        """One token per sequence; returns float32 logits ``[n_items, V]``. ``num_layers``: only the first
        that many layers, then the final norm and LM head (a self-speculative draft; CPU backends): their
        K/V are written as a full step writes them."""
        if not items:
            raise ValueError("decode needs at least one item")
        self._check_decode(items)
        if num_layers is not None and self.backend is Backend.TRITON:
            raise ValueError("a truncated (draft) forward runs on the CPU backends only")
        if self.backend is Backend.TRITON:
            if self._decoder is None:
                self.prepare_decode(max(64, len(items)), cuda_graphs=False)
            assert self._decoder is not None
            with torch.inference_mode():
                return self._decoder.run([(it.token_id, it.position, it.block_table) for it in items])
        kernels = self.kernels
        meta = self._decode_meta(items)

        last = self.config.num_layers - 1

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nxt = self.kv[layer + 1] if layer < last else None
            return decode_attention(self.kv[layer], meta, q, kernels, nxt)

        with torch.inference_mode():
            token_ids = torch.tensor([it.token_id for it in items], dtype=torch.int64, device=self.device)
            ops = self._ops(meta.positions, meta.k_rows, meta.v_rows)
            hidden = forward_hidden(
                self.weights, self.config, token_ids, ops, self.kv, attend, num_layers=num_layers
            )
            return self._logits(hidden, ops)

    @_mirrored
    def decode_columns(
        self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """``decode`` of the sequences given as columns; ``tables`` are the ``BlockManager``'s own lists
        (each sequence's list object the same every step, only ever appended to): the CUDA backend then
        writes a table row only where it changed (``DecodeGraphs.run_columns``)."""
        if self.backend is not Backend.TRITON or self._decoder is None:
            return self.decode([DecodeItem(*c) for c in zip(token_ids, positions, tables, strict=True)])
        with torch.inference_mode():
            return self._decoder.run_columns(token_ids, positions, tables)

    @_mirrored
    def step(self, prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem]) -> torch.Tensor:
        """Decode tokens and prefill chunks in one forward: every product reads its weights once for both.

        Returns float32 logits ``[len(decode) + len(prefill), V]``: the decode items' rows, then each
        prefill item's last token. Attention runs per part, each with its own kernel, so a decode row
        attends exactly as in ``decode``. On the Triton backend (decode under CUDA graphs) the two parts
        run as two forwards.
        """
        if not prefill:
            return self.decode(decode)
        if not decode:
            return self.prefill(prefill)
        if self.backend is Backend.TRITON:
            return torch.cat([self.decode(decode), self.prefill(prefill)])
        with torch.inference_mode():
            hidden, ops, rows = self._step_hidden(prefill, decode)
            return self._logits(hidden.index_select(0, rows), ops)

    @_mirrored
    def step_keeping(
        self, prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem], keep: Sequence[bool]
    ) -> tuple[torch.Tensor, KeptRows]:
        """``step``'s logits (the same values), and every new token of the prefill items marked ``keep``
        (``prefill_keeping``)."""
        if not decode:
            return self.prefill_keeping(prefill, keep)
        if self.backend is Backend.TRITON:
            out, kept = self.prefill_keeping(prefill, keep)
            return torch.cat([self.decode(decode), out]), kept
        lengths = [len(it.token_ids) for it in prefill]
        with torch.inference_mode():
            hidden, ops, rows = self._step_hidden(prefill, decode)
            out = self._logits(hidden.index_select(0, rows), ops)
            return out, self._keep(hidden, _kept_rows(lengths, keep, len(decode), self.device), ops)

    def _step_hidden(
        self, prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem]
    ) -> tuple[torch.Tensor, StepOps, torch.Tensor]:
        """``step``'s forward (CPU backends) up to the final hidden states ``[T, hidden]``, with the rows
        ``step`` returns the logits of."""
        ids = self._prefill_ids(prefill)
        self._check_decode(decode)
        kernels = self.kernels
        n_dec = len(decode)
        dmeta = self._decode_meta(decode)
        pmeta = PrefillMeta.build(
            [(len(it.token_ids), it.block_table, it.start_pos) for it in prefill],
            self.block_size,
            self.num_blocks,
            self.device,
        )
        last = self.config.num_layers - 1

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nxt = self.kv[layer + 1] if layer < last else None
            out_d = decode_attention(self.kv[layer], dmeta, q[:n_dec], kernels, nxt)
            out_p = prefill_attention(self.kv[layer], pmeta, q[n_dec:], k[n_dec:], v[n_dec:], kernels)
            return torch.cat([out_d, out_p])

        token_ids = torch.tensor([d.token_id for d in decode] + ids, dtype=torch.int64, device=self.device)
        ops = self._ops(
            torch.cat([dmeta.positions, pmeta.positions]),
            torch.cat([dmeta.k_rows, pmeta.k_rows]),
            torch.cat([dmeta.v_rows, pmeta.v_rows]),
        )
        hidden = forward_hidden(self.weights, self.config, token_ids, ops, self.kv, attend)
        rows = torch.cat([torch.arange(n_dec, device=self.device), pmeta.last_rows + n_dec])
        return hidden, ops, rows

    def _prefill_triton(
        self, items: Sequence[PrefillItem], layer_hook: LayerHook | None, all_logits: bool
    ) -> torch.Tensor:
        from pdserve.engine.cuda_backend import make_prefill_forward, prefill_inputs

        graphs = self._prefill_graphs
        if graphs is not None and len(items) == 1 and not all_logits:
            it = items[0]
            if graphs.fits(len(it.token_ids), it.start_pos):
                with torch.inference_mode():
                    out = graphs.run(it.token_ids, it.block_table, it.start_pos)
                if layer_hook is not None:  # every layer's K/V is in the cache once the graph has run
                    written = getattr(layer_hook, "layers_written", None)
                    if written is not None:
                        written(self.config.num_layers)
                    else:
                        for layer in range(self.config.num_layers):
                            layer_hook(layer, None, None)
                return out
        inp = prefill_inputs(
            [(it.token_ids, it.block_table, it.start_pos) for it in items],
            self.block_size,
            self.num_blocks,
            self.device,
        )
        forward = make_prefill_forward(self.weights, self.config, self.rope, self.kv)  # what the graphs run
        with torch.inference_mode():
            return forward(
                inp.token_ids, inp.positions, inp.slots, inp.cu_seqlens, inp.start_pos, inp.tables,
                None if all_logits else inp.last_rows, inp.max_new, layer_hook,
            )  # fmt: skip

    def _prefill_triton_keeping(
        self, items: Sequence[PrefillItem], layer_hook: LayerHook | None, keep_rows: torch.Tensor
    ) -> tuple[torch.Tensor, KeptRows]:
        """``prefill_keeping`` on the Triton backend: eager (no graph keeps hidden states)."""
        from pdserve.engine.cuda_backend import TritonStepOps, make_prefill_forward, prefill_inputs

        inp = prefill_inputs(
            [(it.token_ids, it.block_table, it.start_pos) for it in items],
            self.block_size,
            self.num_blocks,
            self.device,
        )
        forward = make_prefill_forward(self.weights, self.config, self.rope, self.kv)
        with torch.inference_mode():
            out, kept = forward(
                inp.token_ids, inp.positions, inp.slots, inp.cu_seqlens, inp.start_pos, inp.tables,
                inp.last_rows, inp.max_new, layer_hook, keep_rows,
            )  # fmt: skip
        ops = TritonStepOps(self.config, self.rope, inp.positions, inp.slots)  # (its norm and products)
        return out, KeptRows(len(kept), lambda a, b: logits(self.weights, self.config, kept[a:b], ops))

    def _ops(self, positions: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> StepOps:
        c = self.shard_config
        ops: StepOps
        if self.kernels is not None:
            ops = KernelStepOps(self.kernels, c, self.rope, positions, k_rows, v_rows)
        else:
            ops = TorchStepOps(c, self.rope, positions, k_rows, v_rows)
        return ops if self.tp is None else ReducingStepOps(ops, self.tp)


def build_runner(
    model_dir: str | Path, tensor_parallel_size: int = 1, threads: int = 1, **kwargs: Any
) -> ModelRunner:
    """A ``ModelRunner`` of ``kwargs``; with ``tensor_parallel_size`` > 1, rank 0 of a group whose other
    ranks it starts, each with ``threads`` torch threads (stop them with ``runner.tp.close()``). ValueError
    where the model does not divide."""
    if tensor_parallel_size == 1:
        return ModelRunner(model_dir, **kwargs)
    if kwargs.get("kv_shared"):
        raise ValueError("kv_shared_memory is not supported with tensor_parallel_size > 1")
    follower_kwargs = {**kwargs, "model_dir": str(model_dir)}
    if isinstance(follower_kwargs.get("dtype"), torch.dtype):
        follower_kwargs["dtype"] = str(follower_kwargs["dtype"]).removeprefix("torch.")
    tp = start_group(ModelConfig.from_dir(Path(model_dir)), tensor_parallel_size, follower_kwargs, threads)
    try:
        return ModelRunner(model_dir, tensor_parallel=tp, **kwargs)
    except BaseException:
        tp.close()
        raise


def _cuda_num_blocks(
    device: torch.device, num_blocks: int | None, block_bytes: int, utilization: float | None, share: int = 1
) -> int:
    """The cache size on CUDA, checked against the device's free memory (weights are loaded by now).
    ``share``: how many processes split the device (tensor-parallel ranks on one GPU)."""
    free, total = torch.cuda.mem_get_info(device)
    room = free - CUDA_ACTIVATION_RESERVE
    gib = 1 << 30
    if num_blocks is not None:
        if num_blocks * block_bytes > room:
            raise ValueError(
                f"a KV cache of {num_blocks} blocks ({num_blocks * block_bytes / gib:.2f} GiB) does not fit "
                f"in the {free / gib:.2f} GiB free on {device} (less {CUDA_ACTIVATION_RESERVE >> 20} MiB for "
                "activations): lower --num-blocks / --kv-cache-bytes, or leave them unset to size the cache "
                "from --gpu-memory-utilization"
            )
        return num_blocks
    util = 0.9 if utilization is None else utilization
    # The device's share for this worker, less what the process already holds (weights, workspaces).
    budget = min(
        int(util * total) // share - torch.cuda.memory_reserved(device) - CUDA_ACTIVATION_RESERVE, room
    )
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"no room for a KV cache on {device}: {free / gib:.2f} GiB free of {total / gib:.2f} GiB, "
            f"and --gpu-memory-utilization {util} allows {util * total / gib:.2f} GiB for this worker; "
            "raise --gpu-memory-utilization or free the device"
        )
    return int(blocks)
