"""Which rank writes which KV heads where, between a tensor-parallel sender and receiver of any sizes. Pure:
no torch, no ucxx.

A rank's KV cache holds its heads only, ``[L, N, 2, B, h, D]``, so the heads a destination rank needs from
one source rank are a strided slice of both caches (per token). The writer packs them instead: for every
destination run of consecutive blocks, a piece ``[n, 2, B, hk, D]`` (contiguous) goes into the run's span
of the destination rank's layer, the pieces of one run side by side in head order; the receiver unpacks
the run into its layout once every layer landed (a rank that gets one piece needs none). A piece that is
a whole source rank's heads and a whole destination rank's heads (the same split on both sides) needs
neither: it moves as today, run for run.
So a layer costs at most (source ranks x destination ranks x runs) writes, whatever the prompt's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Heads ``heads`` (the model's numbering) that ``src_rank`` writes into ``dst_rank``: at ``src_first``
    of the source rank's own heads, ``dst_first`` of the destination rank's (also where, in heads, the
    piece starts inside a packed run)."""

    src_rank: int
    dst_rank: int
    heads: range
    src_first: int
    dst_first: int
    direct: bool  # the whole source rank's heads and the whole destination rank's: no packing

    @property
    def num_heads(self) -> int:
        return len(self.heads)


def check_heads(ranks: Sequence[range], num_kv_heads: int, what: str) -> None:
    """ValueError unless ``ranks`` (each rank's KV heads) is a tensor-parallel split of ``num_kv_heads``:
    every rank holds a non-empty run of heads, all the same count, and every head is held."""
    if not ranks:
        raise ValueError(f"{what}: no ranks")
    counts = {len(r) for r in ranks}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"{what}: ranks hold different or no head counts: {[len(r) for r in ranks]}")
    for r in ranks:
        if r.step != 1 or r.start < 0 or r.stop > num_kv_heads:
            raise ValueError(f"{what}: heads {r} outside the model's {num_kv_heads}")
    if {h for r in ranks for h in r} != set(range(num_kv_heads)):
        raise ValueError(f"{what}: ranks {list(ranks)} do not hold every one of {num_kv_heads} KV heads")


def pieces(src: Sequence[range], dst: Sequence[range]) -> list[Piece]:
    """Every piece, by destination rank then head: each head a destination rank holds comes from the first
    source rank that holds it (a head replicated on several source ranks is written once per destination
    rank that holds it), and consecutive heads of one source rank make one piece."""
    out: list[Piece] = []
    for j, want in enumerate(dst):
        h = want.start
        while h < want.stop:
            i = next(i for i, have in enumerate(src) if h in have)
            stop = min(want.stop, src[i].stop)
            heads = range(h, stop)
            out.append(
                Piece(
                    src_rank=i,
                    dst_rank=j,
                    heads=heads,
                    src_first=h - src[i].start,
                    dst_first=h - want.start,
                    direct=heads == src[i] and heads == want,
                )
            )
            h = stop
    return out


def dst_runs(dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """The destination block table's runs of consecutive blocks: (position in the table, first block,
    count)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(dst_blocks):
        if runs and b == runs[-1][1] + runs[-1][2]:
            pos0, first, n = runs[-1]
            runs[-1] = (pos0, first, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def writes_per_layer(plan: Sequence[Piece], num_segments: int, num_dst_runs: int) -> int:
    """Writes one layer takes: a direct piece one per segment (runs consecutive on both sides), a packed
    piece one per destination run."""
    return sum(num_segments if p.direct else num_dst_runs for p in plan)


def needs_unpack(plan: Sequence[Piece], dst_rank: int) -> bool:
    """Whether ``dst_rank``'s runs arrive in another layout than its own: more than one piece side by side
    (one piece holds all its heads, packed or not, in its layout)."""
    return sum(p.dst_rank == dst_rank for p in plan) > 1


@dataclass(frozen=True)
class HeadBytes:
    """Byte sizes of a layout's unit, one head of one block of one layer (K and V): ``2 * B * D * elt``."""

    head_block: int

    def block(self, num_heads: int) -> int:
        return num_heads * self.head_block


def packed_runs(
    piece: Piece, runs: Sequence[tuple[int, int, int]], sizes: HeadBytes, dst_heads: int
) -> list[tuple[int, int, int]]:
    """A packed piece's writes for one layer, per destination run ``(position, first block, count)``:
    ``(offset in the packed piece, offset in the destination rank's layer, bytes)``; the piece sits
    ``piece.dst_first`` heads into its run."""
    per_block, dst_block = sizes.block(piece.num_heads), sizes.block(dst_heads)
    return [
        (pos * per_block, first * dst_block + piece.dst_first * n * sizes.head_block, n * per_block)
        for pos, first, n in runs
    ]


def direct_runs(
    segments: Sequence[tuple[int, int, int]], sizes: HeadBytes, heads: int
) -> list[tuple[int, int, int]]:
    """A direct piece's writes for one layer, per segment ``(source block, destination block, count)``:
    ``(source offset, destination offset, bytes)`` within the two ranks' layers (blocks of ``heads``)."""
    unit = sizes.block(heads)
    return [(src * unit, dst * unit, n * unit) for src, dst, n in segments]
