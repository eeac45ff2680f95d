"""The torch side of ``tp_plan``: packing a source rank's heads for a destination run, unpacking a run on the
receiver, and the per-layer digest both sides take of what every destination rank holds."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xxhash

from pdserve.kv_transfer.tp_plan import Piece, dst_runs, needs_unpack


def pack(kv: torch.Tensor, layer: int, blocks: Sequence[int], piece: Piece) -> torch.Tensor:
    """``piece``'s heads of ``blocks`` (token order) of a source rank's cache ``kv`` ``[L, N, 2, B, h, D]``:
    a new contiguous ``[n, 2, B, hk, D]``, block ``i`` at ``[i]``."""
    idx = torch.as_tensor(list(blocks), dtype=torch.long, device=kv.device)
    heads = slice(piece.src_first, piece.src_first + piece.num_heads)
    return kv[layer, :, :, :, heads].index_select(0, idx).contiguous()  # (one copy: already contiguous)


def piece_offset(kv: torch.Tensor, num_blocks: int, piece: Piece) -> int:
    """Bytes from the start of a packed run of ``num_blocks`` blocks of a destination rank's cache ``kv`` to
    ``piece``: the pieces of a run lie side by side in head order."""
    _, _, _, block_size, _, head_dim = kv.shape
    return piece.dst_first * num_blocks * 2 * block_size * head_dim * kv.element_size()


def unpack(kv: torch.Tensor, first: int, num_blocks: int, mine: Sequence[Piece]) -> None:
    """Rearrange a packed run (``mine``: the destination rank's pieces) of every layer of ``kv`` in place
    into the cache's layout: one copy out and one back per piece, all layers at once."""
    region = kv[:, first : first + num_blocks]  # [L, n, 2, B, h, D]: each layer's span contiguous
    layers, n, two, block_size, _, head_dim = region.shape
    packed = region.reshape(layers, -1).clone()
    per_head = n * two * block_size * head_dim
    for p in mine:
        part = packed[:, p.dst_first * per_head : (p.dst_first + p.num_heads) * per_head]
        heads = slice(p.dst_first, p.dst_first + p.num_heads)
        region[:, :, :, :, heads] = part.view(layers, n, two, block_size, p.num_heads, head_dim)


def unpack_received(
    dst_kv: Sequence[torch.Tensor], plan: Sequence[Piece], blocks: Sequence[int], num_layers: int
) -> None:
    """The receiver's side once every write landed: each destination rank whose runs came packed gets
    them into its layout, layer by layer, run by run."""
    runs = dst_runs(blocks)
    for j, kv in enumerate(dst_kv):
        if not needs_unpack(plan, j):
            continue
        mine = [p for p in plan if p.dst_rank == j]
        for _, first, count in runs:
            unpack(kv[:num_layers], first, count, mine)


def received_digests(
    dst_kv: Sequence[torch.Tensor], blocks: Sequence[int], num_layers: int
) -> tuple[int, ...]:
    """Per layer, the xxh3-64 of every destination rank's ``[n, 2, B, h, D]`` of ``blocks`` (token order),
    rank after rank: what the receiver checks once its runs are unpacked. One rank holding every head
    hashes the same bytes as ``kvbuf.layer_digests``."""
    idx = torch.as_tensor(list(blocks), dtype=torch.long)
    return tuple(_digest(kv[layer].index_select(0, idx) for kv in dst_kv) for layer in range(num_layers))


def sent_digests(
    src_kv: Sequence[torch.Tensor], plan: Sequence[Piece], blocks: Sequence[int], num_layers: int
) -> tuple[int, ...]:
    """The writer's side of ``received_digests``: each destination rank's heads, built from the source
    ranks' ``blocks``."""
    dst_ranks = sorted({p.dst_rank for p in plan})
    return tuple(
        _digest(assembled(src_kv, plan, j, layer, blocks) for j in dst_ranks) for layer in range(num_layers)
    )


def assembled(
    src_kv: Sequence[torch.Tensor], plan: Sequence[Piece], dst_rank: int, layer: int, blocks: Sequence[int]
) -> torch.Tensor:
    """What destination rank ``dst_rank`` holds of ``blocks`` for ``layer`` once the transfer landed, built
    from the source ranks' caches: ``[n, 2, B, h, D]``."""
    mine = [p for p in plan if p.dst_rank == dst_rank]
    return torch.cat([pack(src_kv[p.src_rank], layer, blocks, p) for p in mine], dim=3)


def _digest(parts: Iterable[torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for t in parts:
        h.update(t.contiguous().view(torch.uint8).numpy().data)
    return h.intdigest()
