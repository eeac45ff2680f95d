"""The KV transfer between tensor-parallel groups of different sizes (``kv_transfer.tp_plan``, ``tp_pack``):
every pair of sizes moves every head of a scattered block table into the ranks that own it, exactly, in at
most (source ranks x destination ranks x runs) writes a layer; the two sides' digests agree, and see a
flipped byte."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.plan import build_segments, segment_lengths
from pdserve.kv_transfer.testing.spec import head_split
from pdserve.kv_transfer.tp_pack import pack, received_digests, sent_digests, unpack
from pdserve.kv_transfer.tp_plan import (
    HeadBytes,
    check_heads,
    direct_runs,
    dst_runs,
    needs_unpack,
    packed_runs,
    pieces,
    writes_per_layer,
)

L, B, D = 3, 4, 8
SRC_BLOCKS = [3, 4, 5, 9, 10, 0, 1]  # token order, scattered: 3 runs
DST_BLOCKS = [2, 3, 7, 8, 9, 15, 11]  # 4 runs


def split(num_heads: int, size: int) -> list[range]:
    return list(head_split(num_heads, size))


def transfer(num_heads: int, p: int, d: int, flip: bool = False):
    torch.manual_seed(p * 10 + d)
    src_heads, dst_heads = split(num_heads, p), split(num_heads, d)
    check_heads(src_heads, num_heads, "source")
    check_heads(dst_heads, num_heads, "destination")
    n = len(SRC_BLOCKS)
    logical = torch.randn(L, n, 2, B, num_heads, D)
    src = [torch.zeros(L, 12, 2, B, len(h), D) for h in src_heads]
    for kv, h in zip(src, src_heads, strict=True):
        kv[:, SRC_BLOCKS] = logical[..., h.start : h.stop, :]
    dst = [torch.full((L, 20, 2, B, len(h), D), float("nan")) for h in dst_heads]
    plan = pieces(src_heads, dst_heads)
    sizes = HeadBytes(2 * B * D * 4)
    segs = [(s.src_start, s.dst_start, s.num_blocks) for s in build_segments(
        segment_lengths(SRC_BLOCKS, DST_BLOCKS), SRC_BLOCKS, DST_BLOCKS)]  # fmt: skip
    runs = dst_runs(DST_BLOCKS)
    writes = 0
    for layer in range(L):
        for piece in plan:
            to = dst[piece.dst_rank][layer].reshape(-1).view(torch.uint8)
            if piece.direct:
                source = src[piece.src_rank][layer].reshape(-1).view(torch.uint8)
                todo = direct_runs(segs, sizes, piece.num_heads)
            else:
                source = pack(src[piece.src_rank], layer, SRC_BLOCKS, piece).reshape(-1).view(torch.uint8)
                todo = packed_runs(piece, runs, sizes, len(dst_heads[piece.dst_rank]))
            for s, t, nbytes in todo:  # a writer's one write
                to[t : t + nbytes] = source[s : s + nbytes]
                writes += 1
    if flip:
        dst[-1][L - 1, DST_BLOCKS[0]].view(-1).view(torch.uint8)[0] ^= 0xFF
    for j in range(d):
        if needs_unpack(plan, j):
            mine = [q for q in plan if q.dst_rank == j]
            for _, first, count in runs:
                unpack(dst[j], first, count, mine)
    return logical, src, dst, dst_heads, plan, writes, len(segs), len(runs)


@pytest.mark.parametrize(
    "num_heads,p,d",
    [(4, 1, 1), (4, 2, 1), (4, 1, 2), (4, 2, 2), (4, 4, 2), (4, 2, 4), (4, 1, 8), (4, 8, 1), (4, 8, 2),
     (3, 3, 1), (3, 1, 3), (3, 3, 3), (3, 6, 1), (3, 1, 6)],
)  # fmt: skip
def test_every_head_lands_where_its_rank_holds_it(num_heads, p, d):
    logical, src, dst, dst_heads, plan, writes, num_segs, num_runs = transfer(num_heads, p, d)
    for kv, h in zip(dst, dst_heads, strict=True):
        assert torch.equal(kv[:, DST_BLOCKS], logical[..., h.start : h.stop, :])
    assert writes == L * writes_per_layer(plan, num_segs, num_runs)
    sources = len({q.src_rank for q in plan})  # a replicated head is sent by its first holder only
    assert writes <= L * sources * d * max(num_segs, num_runs)
    if p == d:  # the same split on both sides: every piece direct, nothing to unpack
        assert all(q.direct for q in plan) and len(plan) == d
    if p == 1:  # one source rank: each destination rank gets one piece, already in its layout
        assert not any(needs_unpack(plan, j) for j in range(d))
    assert sent_digests(src, plan, SRC_BLOCKS, L) == received_digests(dst, DST_BLOCKS, L)


def test_the_same_split_digests_as_one_process():
    from pdserve.kv_transfer.kvbuf import KVSpans, layer_digests

    _, src, dst, _, plan, *_ = transfer(4, 1, 1)
    runs = [(first, count) for _, first, count in dst_runs(DST_BLOCKS)]
    assert received_digests(dst, DST_BLOCKS, L) == layer_digests(KVSpans(dst[0]), runs, L)


def test_a_flipped_byte_changes_the_receivers_digest():
    _, src, dst, _, plan, *_ = transfer(4, 2, 1, flip=True)
    sent, got = sent_digests(src, plan, SRC_BLOCKS, L), received_digests(dst, DST_BLOCKS, L)
    assert sent[:-1] == got[:-1] and sent[-1] != got[-1]


def test_splits_that_are_not_one_are_refused():
    with pytest.raises(ValueError, match="different or no head counts"):
        check_heads([range(0, 3), range(3, 4)], 4, "destination")
    with pytest.raises(ValueError, match="do not hold every one of 4"):
        check_heads([range(0, 2), range(0, 2)], 4, "source")
    with pytest.raises(ValueError, match="outside the model's 4"):
        check_heads([range(2, 6)], 4, "source")


def test_split_is_the_engines(tiny_llama_dir):
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.tensor_parallel import ShardLayout

    config = ModelConfig.from_dir(tiny_llama_dir)  # 4 heads over 2 KV heads
    for size in (1, 2, 4):
        ranks = [ShardLayout.of(config, r, size).kv_heads for r in range(size)]
        assert ranks == split(config.num_kv_heads, size)
