"""The CUDA backend of ``ModelRunner``: Triton step ops, and decode and prefill under CUDA graphs.

A small step's time is set by the host's kernel launches, not the GPU, hence the graphs. The logits a
graph returns are a view of its static output: read them before the next step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.engine import triton_kernels as tk
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import LayerHook, Products, RopeTables, forward_hidden, logits
from pdserve.engine.weights import Linear, LinearKind

__all__ = [
    "DecodeGraphs",
    "PrefillGraphs",
    "PrefillInputs",
    "TritonStepOps",
    "decode_buckets",
    "prefill_buckets",
    "prefill_inputs",
]


def _gemv_runs(lin: Linear, rows: int) -> bool:
    """Whether ``lin`` over ``rows`` rows runs as ``triton_kernels.gemv`` (plain weights, where it
    beats cuBLAS: ``triton_kernels.gemv_wins``)."""
    if rows > tk.GEMV_MAX_ROWS or lin.kind is not LinearKind.PLAIN or lin.scales is not None:
        return False
    w = lin.weight
    if not w.is_cuda:  # Triton's interpreter, in tests
        return True
    return tk.gemv_wins(rows, w.shape[0], _sm_count(w.device))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonStepOps(Products):
    """Per-step non-matmul ops on CUDA; ``positions`` and ``slots`` (cache slot per token, -1: none).
    Products of up to ``triton_kernels.GEMV_MAX_ROWS`` rows (decode at batch 1) run as ``gemv`` where it
    wins, the down product taking ``silu(gate) * up`` in its own loads (one kernel less a layer), and,
    with ``triton_kernels.FUSE_NORMS``, the o and down products adding into the residual stream and the
    qkv and gate_up products normalising their input (two kernels less a layer)."""

    def __init__(self, config: ModelConfig, rope: RopeTables, positions: torch.Tensor, slots: torch.Tensor):
        self.n_h, self.n_kv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        self.rope, self.positions, self.slots = rope, positions, slots

    def linear(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        if _gemv_runs(lin, x.shape[0]):
            return tk.gemv(x, lin.weight, lin.bias)
        return lin(x)

    def norm_linear(
        self, lin: Linear, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if res is None and tk.FUSE_NORMS and _gemv_runs(lin, x.shape[0]):
            return tk.gemv(x, lin.weight, lin.bias, norm=(weight, eps))
        return self.linear(lin, self.add_rms_norm(x, res, weight, eps))

    def residual(self, lin: Linear, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        if tk.FUSE_NORMS and _gemv_runs(lin, a.shape[0]):
            tk.gemv(a, lin.weight, lin.bias, add_to=x)
            return None
        return self.linear(lin, a)

    def down(self, lin: Linear, gate_up: torch.Tensor, applied: bool, x: torch.Tensor) -> torch.Tensor | None:
        if not applied and _gemv_runs(lin, gate_up.shape[0]):
            add_to = x if tk.FUSE_NORMS else None
            out = tk.gemv(gate_up, lin.weight, lin.bias, silu_mul=True, add_to=add_to)
            return None if add_to is not None else out
        return lin(gate_up if applied else self.silu_mul(gate_up))

    def add_rms_norm(
        self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return tk.add_rms_norm(x, res, weight, eps)

    def rope_store(
        self, kv_layer: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, n_h, n_kv, d = qkv.shape[0], self.n_h, self.n_kv, self.d
        tk.rope_store(
            qkv, n_h, n_kv, d, self.rope.cos, self.rope.sin_signed, self.positions, kv_layer, self.slots
        )
        q = qkv[:, : n_h * d].view(t, n_h, d)  # rotated in place
        k = qkv[:, n_h * d : (n_h + n_kv) * d].view(t, n_kv, d)
        v = qkv[:, (n_h + n_kv) * d :].view(t, n_kv, d)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return tk.silu_mul(gate_up)


def _check_table(table: Sequence[int], tokens: int, block_size: int, num_blocks: int) -> None:
    if len(table) * block_size < tokens:
        raise ValueError(f"block table of {len(table)} blocks cannot hold {tokens} tokens")


def _check_ids(tables: np.ndarray, num_blocks: int) -> None:
    if tables.size and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(f"a block table has ids outside [0, {num_blocks})")


def _pinned(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, pin_memory=torch.cuda.is_available())


@dataclass(frozen=True)
class PrefillInputs:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each token (block * B + offset)
    cu_seqlens: torch.Tensor  # [n + 1]
    start_pos: torch.Tensor  # [n]
    last_rows: torch.Tensor  # [n] each chunk's last row in the batch
    tables: torch.Tensor  # [n, M] block ids, rows padded with 0
    max_new: int


def prefill_inputs(
    items: Sequence[tuple[Sequence[int], Sequence[int], int]],
    block_size: int,
    num_blocks: int,
    device: torch.device,
) -> PrefillInputs:
    """``items``: (new token ids, block table, start_pos) per chunk. One host-to-device copy."""
    n = len(items)
    lens = np.fromiter((len(ids) for ids, _, _ in items), dtype=np.int64, count=n)
    starts = np.fromiter((s for _, _, s in items), dtype=np.int64, count=n)
    t = int(lens.sum())
    m = max(-(-(s + len(ids)) // block_size) for ids, _, s in items)
    host = _pinned(3 * t + 3 * n + 1 + n * m)
    h = host.numpy()
    ids_h, pos_h, slot_h = h[:t], h[t : 2 * t], h[2 * t : 3 * t]
    cu_h = h[3 * t : 3 * t + n + 1]
    start_h = h[3 * t + n + 1 : 3 * t + 2 * n + 1]
    last_h = h[3 * t + 2 * n + 1 : 3 * t + 3 * n + 1]
    tab_h = h[3 * t + 3 * n + 1 :].reshape(n, m)
    tab_h[:] = 0
    cu_h[0] = 0
    np.cumsum(lens, out=cu_h[1:])
    start_h[:] = starts
    last_h[:] = cu_h[1:] - 1
    for i, (ids, table, s) in enumerate(items):
        total = s + len(ids)
        _check_table(table, total, block_size, num_blocks)
        used = -(-total // block_size)
        tab_h[i, :used] = table[:used]
        a, b = cu_h[i], cu_h[i + 1]
        ids_h[a:b] = ids
        pos = np.arange(s, total, dtype=np.int64)
        pos_h[a:b] = pos
        slot_h[a:b] = tab_h[i, pos // block_size] * block_size + pos % block_size
    _check_ids(tab_h, num_blocks)
    dev = host.to(device, non_blocking=True)
    return PrefillInputs(
        token_ids=dev[:t],
        positions=dev[t : 2 * t],
        slots=dev[2 * t : 3 * t],
        cu_seqlens=dev[3 * t : 3 * t + n + 1],
        start_pos=dev[3 * t + n + 1 : 3 * t + 2 * n + 1],
        last_rows=dev[3 * t + 2 * n + 1 : 3 * t + 3 * n + 1],
        tables=dev[3 * t + 3 * n + 1 :].view(n, m),
        max_new=int(lens.max()),
    )


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256,
    every 32 beyond, and ``max_batch`` itself."""
    out = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        out.append(b)
        b += 8 if b < 64 else 16 if b < 256 else 32
    out.append(max_batch)
    return out


# forward(ids [n], positions [n], slots [n], tables [n, M], lens [n], splits) -> float32 logits [n, V]
DecodeForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor
]


class DecodeGraphs:
    """Decode at bucketed batch sizes up to ``max_batch`` under CUDA graphs.

    Inputs live in one static device buffer (token ids, positions, cache slots, context lengths, block
    tables) staged in a pinned host twin: each step copies the four per-row vectors, and a block-table row
    only when it changed (``run_columns``). Rows past the batch are padding (slot -1: no store; length 0:
    attends nothing) and are sliced off the logits. One graph per bucket and split count of the decode
    attention (``triton_kernels.decode_splits``), captured once at start-up; batches over the largest
    bucket, or ``use_graphs=False``, run the same code eagerly."""

    def __init__(
        self,
        forward: DecodeForward,
        *,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        num_blocks: int,
        num_kv_heads: int,
        max_len: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        self.forward = forward
        self.max_batch, self.max_blocks, self.block_size, self.num_blocks = (
            max_batch,
            max_blocks,
            block_size,
            num_blocks,
        )
        self.device = device
        self.buckets = decode_buckets(max_batch)
        on_cuda = device.type == "cuda"
        # (Off CUDA only Triton's interpreter runs this, in tests: no graphs, any SM count.)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if on_cuda else 8
        # A graph fixes its split count: one graph per bucket and split count a context of up to
        # ``max_len`` tokens can ask for, so a short context launches no idle split programs.
        self.splits = {b: tk.decode_split_options(b, num_kv_heads, max_len, sms) for b in self.buckets}
        self._sms, self._n_kv = sms, num_kv_heads
        bm = max_batch
        self._host = _pinned(4 * bm + bm * max_blocks)
        self._h = self._host.numpy()
        self._h[:] = 0
        self._tab = self._h[4 * bm :].reshape(bm, max_blocks)
        self._host_tab = self._host[4 * bm :].view(bm, max_blocks)
        self._rows = np.arange(bm)
        self._bucket_of = [0] + [next(b for b in self.buckets if b >= n) for n in range(1, bm + 1)]
        # Per row: the table list written there last (``run_columns``' live tables) and its length then.
        self._held: list[Sequence[int] | None] = [None] * bm
        self._wrote = [0] * bm
        self._clean_from = bm  # rows from here on hold padding inputs (none yet)
        self._synced = (0, 0)  # (rows, columns) of the block tables the device holds as the host does
        self._tab_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.max_len = max_len
        self._dev = torch.zeros(4 * bm + bm * max_blocks, dtype=torch.int64, device=device)
        self._vec_host, self._vec_dev = self._host[: 4 * bm], self._dev[: 4 * bm]
        self.ids, self.positions, self.slots, self.lens = (self._dev[i * bm : (i + 1) * bm] for i in range(4))
        self.tables = self._dev[4 * bm :].view(bm, max_blocks)
        self._copied = torch.cuda.Event() if on_cuda else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s: float | None = None
        if use_graphs:
            if not on_cuda:
                raise ValueError("CUDA graphs need a CUDA device")
            self._capture()

    def _run(self, n: int, splits: int) -> torch.Tensor:
        return self.forward(
            self.ids[:n], self.positions[:n], self.slots[:n], self.tables[:n], self.lens[:n], splits
        )

    def _capture(self) -> None:
        t0 = time.perf_counter()
        self._h[:] = 0
        self._h[2 * self.max_batch : 3 * self.max_batch] = -1  # padding: no slot, no keys
        self._dev.copy_(self._host)
        self._clean_from, self._synced = 0, (self.max_batch, self.max_blocks)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            for splits in reversed(self.splits[b]):
                self._run(b, splits)  # warm-up: compiles the kernels for this shape
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._run(b, splits)
                self.graphs[(b, splits)] = (g, out)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0

    def run(self, items: Sequence[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
        """``items``: (token id, position, block table) per sequence. Returns float32 logits ``[n, V]``."""
        return self.run_columns(
            [it[0] for it in items], [it[1] for it in items], [it[2] for it in items], live_tables=False
        )

    def run_columns(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        live_tables: bool = True,
    ) -> torch.Tensor:
        """``run`` with one list per input: token ids, positions and block tables, a row per sequence.

        ``live_tables``: the caller passes the same list object for a sequence's table every step and
        only ever appends to it (``BlockManager``'s own tables): a row whose list object is the one it
        held last step gets only the entries appended since, so a step writes a table row when its
        sequence changes rows or crosses into a new block, not every step, and copies the block tables
        to the device only when one changed or the step reads past what was copied. With False every
        row is written in full.

        This runs on the host before every decode step, with the GPU idle until it is done: a few
        numpy operations over the batch and no per-row work but a comparison for unchanged rows."""
        n = len(token_ids)
        bm, bs = self.max_batch, self.block_size
        if not n:
            raise ValueError("decode needs at least one sequence")
        if n > bm:  # more than the static buffers hold: an eager step on its own tensors
            self._check_positions(min(positions), max(positions))
            return self._eager(list(zip(token_ids, positions, tables, strict=True)))
        bucket = self._bucket_of[n]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        h = self._h
        pos = h[bm : bm + n]
        try:
            blk, max_pos, written = self._stage_rows(token_ids, positions, tables, live_tables)
        except BaseException:
            # Rows half written: none is trusted to match the device, and every padding row is redone.
            self._synced, self._clean_from = (0, 0), bm
            self._held[:] = [None] * bm
            raise
        h[2 * bm : 2 * bm + n] = self._tab[self._rows[:n], blk] * bs + pos % bs
        h[3 * bm : 3 * bm + n] = pos + 1
        c = self._clean_from
        if c > n:  # rows from n on are padding: id 0, position 0, no slot, no keys
            h[n:c] = h[bm + n : bm + c] = h[3 * bm + n : 3 * bm + c] = 0
            h[2 * bm + n : 2 * bm + c] = -1
        self._clean_from = n  # (rows past n were padding already, and this step wrote none)
        self._vec_dev.copy_(self._vec_host, non_blocking=True)
        used_cols = max_pos // bs + 1
        if written or bucket > self._synced[0] or used_cols > self._synced[1]:
            # Only the block-table columns this step reads: the graph reads no further than each row's
            # length. (Rows past n are padding and read nothing.)
            key = (bucket, used_cols)
            views = self._tab_views.get(key)
            if views is None:
                views = self._tab_views[key] = (
                    self.tables[:bucket, :used_cols],
                    self._host_tab[:bucket, :used_cols],
                )
            views[0].copy_(views[1], non_blocking=True)
            self._synced = key
        if self._copied is not None:
            self._copied.record()
        splits = tk.decode_splits(bucket, self._n_kv, max_pos + 1, self._sms)
        graph = self.graphs.get((bucket, splits))
        if graph is None:
            return self._run(bucket, splits)[:n]
        graph[0].replay()
        return graph[1] if n == bucket else graph[1][:n]

    def _stage_rows(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        live_tables: bool,
    ) -> tuple[np.ndarray, int, bool]:
        """``run_columns``' checks and its writes of token ids, positions and block tables to the host
        buffer. Returns each row's block index of its position, the largest position, and whether a
        table row was written."""
        n, bm, bs = len(token_ids), self.max_batch, self.block_size
        h = self._h
        pos = h[bm : bm + n]
        pos[:] = positions
        max_pos = int(pos.max())
        self._check_positions(int(pos.min()), max_pos)
        h[:n] = token_ids
        blk = pos // bs
        tab, held, wrote, mb = self._tab, self._held, self._wrote, self.max_blocks
        if not live_tables:  # every row written, as far as its position reads, and checked at once
            held[:n] = [None] * n
            for i, (table, p) in enumerate(zip(tables, positions, strict=True)):
                k = wrote[i] = len(table)
                u = min(k, p // bs + 1)
                tab[i, :u] = table[:u]
            _check_ids(tab[:n, : max_pos // bs + 1], self.num_blocks)
            written = True
        else:  # a row is written only where its list changed (new entries checked as they are written)
            written = False
            for i, table in enumerate(tables):
                k = len(table)
                if table is held[i]:
                    w = wrote[i]
                    if k == w:
                        continue
                    new = table[w:mb]
                else:
                    w, new = 0, table[:mb]
                    held[i] = table
                wrote[i] = k
                written = True
                if len(new):
                    if min(new) < 0 or max(new) >= self.num_blocks:
                        raise ValueError(f"a block table has ids outside [0, {self.num_blocks})")
                    tab[i, w : w + len(new)] = new
        short = np.asarray(wrote[:n]) <= blk
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"block table of {wrote[i]} blocks cannot hold {int(pos[i]) + 1} tokens")
        return blk, max_pos, written

    def _check_positions(self, lo: int, hi: int) -> None:
        if lo < 0:
            raise ValueError(f"position must be >= 0, got {lo}")
        if hi >= self.max_len:
            raise ValueError(f"position {hi} exceeds the model context of {self.max_len}")

    def _eager(self, items: Sequence[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
        n, bs = len(items), self.block_size
        m = max(pos // bs + 1 for _, pos, _ in items)
        host = _pinned(4 * n + n * m)
        h = host.numpy()
        tab = h[4 * n :].reshape(n, m)
        tab[:] = 0
        for i, (tok, pos, table) in enumerate(items):
            _check_table(table, pos + 1, bs, self.num_blocks)
            used = pos // bs + 1
            tab[i, :used] = table[:used]
            h[i], h[n + i], h[2 * n + i], h[3 * n + i] = tok, pos, table[pos // bs] * bs + pos % bs, pos + 1
        _check_ids(tab, self.num_blocks)
        dev = host.to(self.device, non_blocking=True)
        max_len = int(h[3 * n : 4 * n].max())
        splits = tk.decode_splits(n, self._n_kv, max_len, self._sms)
        return self.forward(
            dev[:n], dev[n : 2 * n], dev[2 * n : 3 * n], dev[4 * n :].view(n, m), dev[3 * n : 4 * n], splits
        )


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts a prefill graph is captured for: 16, 32, 64, 128, then steps of a half and a third
    (192, 256, 384, 512, 768, 1024, 1536, ...), and ``max_tokens`` itself (padding wastes < 50%)."""
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b = b * 2 if b < 128 else b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    out.append(max_tokens)
    return out


# forward(ids [T], positions [T], slots [T], cu_seqlens [n + 1], start_pos [n], tables [n, M],
#         last_rows [n] (None: every row), max_new, layer_hook=None) -> float32 logits [n or T, V];
#         with keep_rows [K] as well: (those logits, the kept rows' final hidden states [K, hidden])
PrefillForward = Callable[..., Any]


class PrefillGraphs:
    """A prefill of one prompt chunk at bucketed token counts up to ``max_tokens`` under CUDA graphs.

    One static input buffer, as ``DecodeGraphs``; padding tokens past the chunk's end have slot -1 (no
    store), and the causal mask and the last-row gather ignore them. Batches of several chunks run
    eagerly."""

    def __init__(
        self,
        forward: PrefillForward,
        *,
        max_tokens: int,
        max_blocks: int,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.forward, self.max_tokens = forward, max_tokens
        self.max_blocks, self.block_size, self.num_blocks, self.device = (
            max_blocks,
            block_size,
            num_blocks,
            device,
        )
        self.buckets = prefill_buckets(max_tokens)
        t = max_tokens
        # ids, positions, slots [t] | cu_seqlens [2] | start_pos [1] | last_rows [1] | table [max_blocks]
        size = 3 * t + 4 + max_blocks
        self._host = _pinned(size)
        self._h = self._host.numpy()
        self._dev = torch.zeros(size, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s: float | None = None
        t0 = time.perf_counter()
        h = self._h
        h[:] = 0
        h[2 * t : 3 * t] = -1  # capture: every row padding, nothing stored
        h[3 * t + 1] = 1  # cu_seqlens [0, 1]
        self._dev.copy_(self._host)
        if not use_graphs:  # (tests, in Triton's interpreter: the same buffers and padding, eagerly)
            return
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._run(b)  # warm-up
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._run(b)
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - t0

    def _run(self, bucket: int) -> torch.Tensor:
        t, d = self.max_tokens, self._dev
        return self.forward(
            d[:bucket],
            d[t : t + bucket],
            d[2 * t : 2 * t + bucket],
            d[3 * t : 3 * t + 2],
            d[3 * t + 2 : 3 * t + 3],
            d[3 * t + 4 :].view(1, self.max_blocks),
            d[3 * t + 3 : 3 * t + 4],
            bucket,
        )

    def _fill(self, ids: Sequence[int], table: Sequence[int], start_pos: int) -> int:
        """The host buffer for one chunk; returns its bucket (its rows past the chunk: padding)."""
        n, t, bs, h = len(ids), self.max_tokens, self.block_size, self._h
        bucket = next(b for b in self.buckets if b >= n)
        total = start_pos + n
        _check_table(table, total, bs, self.num_blocks)
        used = -(-total // bs)
        if used > self.max_blocks:
            raise ValueError(f"position {total - 1} is past the {self.max_blocks * bs} tokens a graph holds")
        tab = h[3 * t + 4 : 3 * t + 4 + used]
        tab[:] = table[:used]
        _check_ids(tab, self.num_blocks)
        pos = np.arange(start_pos, total, dtype=np.int64)
        h[:n] = ids
        h[n:bucket] = 0
        h[t : t + n] = pos
        h[t + n : t + bucket] = 0
        h[2 * t : 2 * t + n] = tab[pos // bs] * bs + pos % bs
        h[2 * t + n : 2 * t + bucket] = -1  # padding: stores nothing
        h[3 * t], h[3 * t + 1], h[3 * t + 2], h[3 * t + 3] = 0, n, start_pos, n - 1
        return bucket

    def fits(self, n_tokens: int, start_pos: int) -> bool:
        return (
            n_tokens <= self.max_tokens and -(-(start_pos + n_tokens) // self.block_size) <= self.max_blocks
        )

    def run(self, ids: Sequence[int], table: Sequence[int], start_pos: int) -> torch.Tensor:
        """Logits ``[1, V]`` (float32, a view of the graph's output) of the chunk's last token."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous run's copy has left the host buffer
        bucket = self._fill(ids, table, start_pos)
        end = 3 * self.max_tokens + 4 + -(-(start_pos + len(ids)) // self.block_size)
        self._dev[:end].copy_(self._host[:end], non_blocking=True)  # one copy (<= 50 KB at 2,048 tokens)
        if self._copied is not None:
            self._copied.record()
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._run(bucket)
        graph[0].replay()
        return graph[1]


def make_prefill_forward(weights, config: ModelConfig, rope: RopeTables, kv: torch.Tensor) -> PrefillForward:  # type: ignore[no-untyped-def]
    """The prefill forward over ``kv`` (eager, and what ``PrefillGraphs`` captures): Triton ops and
    attention over a ragged batch of chunks, logits of the ``last_rows`` (None: of every row). With
    ``keep_rows`` (eager only: prompt logprobs), also the final hidden states of those rows."""

    def forward(
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_pos: torch.Tensor,
        tables: torch.Tensor,
        last_rows: torch.Tensor | None,
        max_new: int,
        layer_hook: LayerHook | None = None,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = TritonStepOps(config, rope, positions, slots)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return tk.prefill_attention(kv[layer], q, tables, cu_seqlens, start_pos, max_new)

        hidden = forward_hidden(weights, config, ids, ops, kv, attend, layer_hook)
        kept = None if keep_rows is None else hidden.index_select(0, keep_rows)  # [n_kept, hidden]
        if last_rows is not None:
            hidden = hidden.index_select(0, last_rows)  # [n, hidden]
        out = logits(weights, config, hidden, ops)
        return out if kept is None else (out, kept)

    return forward


def make_forward(weights, config: ModelConfig, rope: RopeTables, kv: torch.Tensor) -> DecodeForward:  # type: ignore[no-untyped-def]
    """The decode forward over ``kv``: Triton ops, paged decode attention, float32 logits."""

    def forward(
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        splits: int,
    ) -> torch.Tensor:
        ops = TritonStepOps(config, rope, positions, slots)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return tk.decode_attention(kv[layer], q, tables, lens, splits=splits)

        hidden = forward_hidden(weights, config, ids, ops, kv, attend)
        return logits(weights, config, hidden, ops)

    return forward
