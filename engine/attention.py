"""Paged attention over the KV cache ``kv [L, N, 2, B, Hkv, D]``: prefill and decode and their index tensors.

Position ``p`` of a sequence is K row ``table[p // B] * 2B + p % B`` of a layer viewed as
``[N * 2 * B, Hkv, D]``, V that row ``+ B`` (docs/engine.md). Unused slots must hold finite values: masked
positions get probability 0, and ``0 * nan`` would poison the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.cpu_kernels import CpuKernels


def _slot_rows(table: Sequence[int], positions: range, block_size: int) -> list[int]:
    """K rows (in the ``[N * 2B]`` view of one layer) of ``positions``; V rows are ``+ block_size``."""
    two_b = 2 * block_size
    return [table[p // block_size] * two_b + p % block_size for p in positions]


def _check_table(table: Sequence[int], needed_tokens: int, block_size: int, num_blocks: int) -> None:
    if len(table) * block_size < needed_tokens:
        raise ValueError(f"block table of {len(table)} blocks cannot hold {needed_tokens} tokens")
    if table and (min(table) < 0 or max(table) >= num_blocks):
        raise ValueError(f"block table {list(table)} has ids outside [0, {num_blocks})")


@dataclass(frozen=True)
class PrefillSeq:
    start: int  # first row of this prompt in the flattened batch
    end: int
    start_pos: int
    table: torch.Tensor | None  # [M] blocks covering [0, start_pos + len); only when start_pos > 0
    mask: torch.Tensor | None  # [len, start_pos + len] bool; only when start_pos > 0


@dataclass(frozen=True)
class PrefillMeta:
    positions: torch.Tensor  # [T] int64
    k_rows: torch.Tensor  # [T] int64 rows of K in the [N * 2B, Hkv, D] layer view
    v_rows: torch.Tensor  # [T]
    seqs: tuple[PrefillSeq, ...]
    last_rows: torch.Tensor  # [n] index of each prompt's last token in the flattened batch

    @classmethod
    def build(
        cls,
        items: Sequence[tuple[int, Sequence[int], int]],
        block_size: int,
        num_blocks: int,
        device: torch.device,
    ) -> PrefillMeta:
        """``items``: (num_new_tokens, block_table, start_pos) per prompt, in batch order."""
        positions: list[int] = []
        rows: list[int] = []
        seqs: list[PrefillSeq] = []
        last: list[int] = []
        start = 0
        for n, table, start_pos in items:
            total = start_pos + n
            _check_table(table, total, block_size, num_blocks)
            pos = range(start_pos, total)
            positions.extend(pos)
            rows.extend(_slot_rows(table, pos, block_size))
            tab = mask = None
            if start_pos > 0:
                n_blocks = -(-total // block_size)
                tab = torch.tensor(table[:n_blocks], dtype=torch.int64, device=device)
                key_pos = torch.arange(n_blocks * block_size, device=device)  # [S]
                query_pos = torch.arange(start_pos, total, device=device)  # [n]
                mask = key_pos[None, :] <= query_pos[:, None]  # [n, S]
            seqs.append(PrefillSeq(start, start + n, start_pos, tab, mask))
            start += n
            last.append(start - 1)
        k_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            k_rows=k_rows,
            v_rows=k_rows + block_size,
            seqs=tuple(seqs),
            last_rows=torch.tensor(last, dtype=torch.int64, device=device),
        )


@dataclass(frozen=True)
class DecodeMeta:
    positions: torch.Tensor  # [Bsz] int64
    k_rows: torch.Tensor  # [Bsz] rows of the new tokens' K in the [N * 2B, Hkv, D] layer view
    v_rows: torch.Tensor  # [Bsz]
    tables: torch.Tensor  # [Bsz * M] block ids, each table padded to M with block 0 (masked out)
    lens: torch.Tensor  # [Bsz] int64 tokens each query attends (position + 1)
    mask: torch.Tensor | None  # [Bsz, 1, 1, M * B] bool: key position <= query position (torch path only)
    max_blocks: int  # M
    max_len: int
    # [n_seqs + 1] starts of runs of consecutive positions of one sequence (a speculative step's verified
    # rows, which the C kernel attends together); None when every row is its own sequence.
    seq_rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        items: Sequence[tuple[int, Sequence[int]]],
        block_size: int,
        num_blocks: int,
        device: torch.device,
        with_mask: bool = True,
    ) -> DecodeMeta:
        """``items``: (position, block_table) per row, in batch order; rows that continue the previous row
        (the same table object, the next position) are one sequence's verified positions. The C kernel
        needs no mask."""
        m = max(-(-(pos + 1) // block_size) for pos, _ in items)
        positions: list[int] = []
        rows: list[int] = []
        flat: list[int] = []
        starts: list[int] = []
        prev: tuple[int, Sequence[int] | None] = (-2, None)
        for i, (pos, table) in enumerate(items):
            if not (table is prev[1] and pos == prev[0] + 1):
                starts.append(i)
            prev = (pos, table)
            _check_table(table, pos + 1, block_size, num_blocks)
            positions.append(pos)
            rows.append(table[pos // block_size] * 2 * block_size + pos % block_size)
            used = list(table[: -(-(pos + 1) // block_size)])
            flat.extend(used)
            flat.extend([0] * (m - len(used)))
        pos_t = torch.tensor(positions, dtype=torch.int64, device=device)
        k_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        mask = None
        if with_mask:
            key_pos = torch.arange(m * block_size, device=device)  # [S]
            mask = (key_pos[None, :] <= pos_t[:, None])[:, None, None, :]  # [Bsz, 1, 1, S]
        return cls(
            positions=pos_t,
            k_rows=k_rows,
            v_rows=k_rows + block_size,
            tables=torch.tensor(flat, dtype=torch.int64, device=device),
            lens=pos_t + 1,
            mask=mask,
            max_blocks=m,
            max_len=max(positions) + 1,
            seq_rows=(
                torch.tensor([*starts, len(items)], dtype=torch.int64, device=device)
                if len(starts) < len(items)
                else None
            ),
        )


def write_kv(
    kv_layer: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store ``k, v [T, Hkv, D]`` into one layer's cache ``kv_layer [N, 2, B, Hkv, D]``."""
    n, _, b, h_kv, d = kv_layer.shape
    rows = kv_layer.view(n * 2 * b, h_kv, d)
    rows.index_copy_(0, k_rows, k)
    rows.index_copy_(0, v_rows, v)


def _gather(kv_layer: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks in ``table [n*M]`` as ``[n*M*B, Hkv, D]`` each (contiguous copies)."""
    _, _, b, h_kv, d = kv_layer.shape
    k = kv_layer[:, 0].index_select(0, table).view(-1, h_kv, d)
    v = kv_layer[:, 1].index_select(0, table).view(-1, h_kv, d)
    return k, v


def prefill_attention(
    kv_layer: torch.Tensor,
    meta: PrefillMeta,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernels: CpuKernels | None = None,
) -> torch.Tensor:
    """Attend ``q [T, H, D]`` over the fresh ``k, v [T, Hkv, D]`` (already written to the cache) and, for
    prompts continuing a cached prefix, over the cache; returns ``[T, H * D]``. With ``kernels``, fresh
    prompts go through ``CpuKernels.prefill_attention`` (SDPA's CPU kernel is slow on small heads), prompts
    with a cached prefix through ``CpuKernels.prefill_attention_paged``, which reads the blocks in place;
    else SDPA (over a gathered copy of the cached blocks)."""
    t, n_h, d = q.shape
    if kernels is not None and len(meta.seqs) == 1:  # one prompt: its rows are the whole output
        s = meta.seqs[0]
        if s.table is None:
            return kernels.prefill_attention(q, k, v)
        return kernels.prefill_attention_paged(q, kv_layer, s.table, s.start_pos)
    out = torch.empty(t, n_h, d, dtype=q.dtype, device=q.device)  # [T, H, D]
    for s in meta.seqs:
        if kernels is not None:
            if s.table is None:
                rows = kernels.prefill_attention(q[s.start : s.end], k[s.start : s.end], v[s.start : s.end])
            else:
                rows = kernels.prefill_attention_paged(q[s.start : s.end], kv_layer, s.table, s.start_pos)
            out[s.start : s.end] = rows.view(-1, n_h, d)
            continue
        qs = q[s.start : s.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if s.table is None:
            ks = k[s.start : s.end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            vs = v[s.start : s.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            kc, vc = _gather(kv_layer, s.table)  # [S, Hkv, D]
            o = F.scaled_dot_product_attention(
                qs,
                kc.transpose(0, 1).unsqueeze(0),
                vc.transpose(0, 1).unsqueeze(0),
                attn_mask=s.mask,
                enable_gqa=True,
            )
        out[s.start : s.end] = o[0].transpose(0, 1)  # [n, H, D]
    return out.view(t, n_h * d)


def decode_attention(
    kv_layer: torch.Tensor,
    meta: DecodeMeta,
    q: torch.Tensor,
    kernels: CpuKernels | None = None,
    next_kv_layer: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, ``q [Bsz, H, D]``, against the cache (which already holds the new
    tokens' K/V); returns ``[Bsz, H * D]``. ``next_kv_layer``: the cache layer that attends next, a
    prefetch hint for the C kernel."""
    if kernels is not None:
        return kernels.decode_attention(
            kv_layer, q, meta.tables, meta.lens, meta.max_blocks, meta.max_len, next_kv_layer, meta.seq_rows
        )
    assert meta.mask is not None, "the torch decode path needs DecodeMeta built with_mask"
    bsz, n_h, d = q.shape
    h_kv = kv_layer.shape[3]
    kc, vc = _gather(kv_layer, meta.tables)  # [Bsz * S, Hkv, D]
    kc = kc.view(bsz, -1, h_kv, d).transpose(1, 2)  # [Bsz, Hkv, S, D]
    vc = vc.view(bsz, -1, h_kv, d).transpose(1, 2)
    # The G = H / Hkv query heads of a KV head become that head's G query rows.
    qg = q.view(bsz, h_kv, n_h // h_kv, d)  # [Bsz, Hkv, G, D]
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=meta.mask)  # [Bsz, Hkv, G, D]
    return o.reshape(bsz, n_h * d)
