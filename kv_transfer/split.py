"""The KV transfer of a tensor-parallel group: rank 0 holds every rank's cache (``RankCaches``) and moves
each rank's heads into the destination ranks that hold them, by one-sided writes (``tp_plan`` says which;
docs/tensor_parallel.md why rank 0 issues them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.kvbuf import check_kv
from pdserve.kv_transfer.tp_pack import pack
from pdserve.kv_transfer.tp_plan import HeadBytes, Piece, check_heads, direct_runs, packed_runs, pieces
from pdserve.kv_transfer.transport import DoneCallback, RemoteWriter
from pdserve.kv_transfer.wire import KVCompat, RemoteRegion

Heads = tuple[tuple[int, int], ...]  # each rank's (start, stop) of the model's KV heads, as the wire says


@dataclass(frozen=True)
class RankCaches:
    """A tensor-parallel group's KV caches as its rank 0 holds them (``ModelRunner.rank_kv``): rank ``r``'s
    ``[L, N, 2, B, h, D]`` and which of the model's KV heads it holds. ``shared_fds``: the memfd each is
    mapped from (None: not in shared memory), which a receiver offers to senders of its host."""

    kv: tuple[torch.Tensor, ...]
    heads: tuple[range, ...]
    shared_fds: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, kv: torch.Tensor, compat: KVCompat, ranks: RankCaches | None) -> RankCaches:
        """A sender's or receiver's caches, checked against ``compat``: ``ranks`` (whose rank 0 must be
        ``kv``), or ``kv`` alone holding every head."""
        if ranks is None:
            check_kv(kv, compat)
            ranks = cls((kv,), (range(compat.num_kv_heads),))
        elif ranks.kv[0] is not kv:
            raise ValueError("kv must be rank 0's cache of ranks")
        ranks.check(compat)
        return ranks

    def check(self, compat: KVCompat) -> None:
        if len(self.kv) != len(self.heads) or not self.kv:
            raise ValueError(f"{len(self.kv)} rank caches for {len(self.heads)} ranks' heads")
        check_heads(self.heads, compat.num_kv_heads, "tensor-parallel ranks")
        for t, h in zip(self.kv, self.heads, strict=True):
            check_kv(t, compat, len(h))
            if t.shape[1] != self.kv[0].shape[1]:
                raise ValueError("tensor-parallel ranks' caches hold different block counts")

    @property
    def split(self) -> bool:
        return len(self.kv) > 1

    def wire(self) -> Heads:
        """The heads as the handshake carries them: () for one rank holding every head."""
        return tuple((h.start, h.stop) for h in self.heads) if self.split else ()


def heads_from_wire(heads: Heads, num_kv_heads: int, what: str) -> tuple[range, ...]:
    """A peer's ranks' heads from the handshake; ValueError where they are not a split of the model's."""
    ranks = tuple(range(a, b) for a, b in heads) or (range(num_kv_heads),)
    check_heads(ranks, num_kv_heads, what)
    return ranks


def needs_split(src: Sequence[range], dst: Sequence[range]) -> bool:
    """Whether a transfer between these ranks is anything but one whole cache into another."""
    return len(src) > 1 or len(dst) > 1


class SplitWriter:
    """One writer per destination rank, flushed and checked as one (``RemoteWriter``). ``write_runs`` and
    ``write_layers`` write into rank 0 (fault injection's flipped byte)."""

    def __init__(self, writers: Sequence[RemoteWriter]) -> None:
        self.writers = list(writers)
        self.synchronous = all(w.synchronous for w in self.writers)
        self.direct = all(w.direct for w in self.writers)
        self.path = self.writers[0].path

    def write_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        self.writers[0].write_runs(local, offset, runs)

    def write_layers(
        self,
        local: int,
        local_stride: int,
        offset: int,
        remote_stride: int,
        count: int,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        self.writers[0].write_layers(local, local_stride, offset, remote_stride, count, runs)

    def flush(self, on_done: DoneCallback) -> None:
        left = [len(self.writers)]
        first: list[TransferError | None] = [None]

        def one(err: TransferError | None) -> None:
            if err is not None and first[0] is None:
                first[0] = err
            left[0] -= 1
            if left[0] == 0:
                on_done(first[0])

        for w in self.writers:
            w.flush(one)

    def check(self) -> TransferError | None:
        return next((e for e in (w.check() for w in self.writers) if e is not None), None)

    def close(self) -> None:
        for w in self.writers:
            w.close()


class SplitRoute:
    """How one connection's transfers move: from these source ranks into the receiver's ranks, through one
    writer per destination rank into its region."""

    def __init__(
        self,
        src: RankCaches,
        dst_heads: Sequence[range],
        writer: SplitWriter,
        regions: Sequence[RemoteRegion],
    ) -> None:
        if len(regions) != len(dst_heads) or len(writer.writers) != len(dst_heads):
            raise ValueError(
                f"{len(regions)} regions and {len(writer.writers)} writers for {len(dst_heads)} ranks"
            )
        self.src = src
        self.dst_heads = tuple(dst_heads)
        self.writer = writer
        self.regions = tuple(regions)
        self.plan: list[Piece] = pieces(src.heads, dst_heads)
        kv = src.kv[0]
        self.sizes = HeadBytes(2 * kv.shape[3] * kv.shape[5] * kv.element_size())
        self._src_layer_bytes = [t[0].numel() * t.element_size() for t in src.kv]

    def write_layer(
        self,
        layer: int,
        src_blocks: Sequence[int],
        segments: Sequence[tuple[int, int, int]],
        dst_runs: Sequence[tuple[int, int, int]],
        keep: list[torch.Tensor],
    ) -> int:
        """Write ``layer`` of a transfer: every piece, direct ones per ``segments`` (source block,
        destination block, count), packed ones per destination run; a packed piece a writer reads later
        (puts) goes into ``keep``, alive until the transfer has settled. Returns the bytes written; raises
        TransferError as a writer does."""
        nbytes = 0
        for p in self.plan:
            w, region = self.writer.writers[p.dst_rank], self.regions[p.dst_rank]
            offset = layer * region.layer_bytes
            if p.direct:
                kv = self.src.kv[p.src_rank]
                runs = direct_runs(segments, self.sizes, p.num_heads)
                w.write_runs(kv.data_ptr() + layer * self._src_layer_bytes[p.src_rank], offset, runs)
            else:
                packed = pack(self.src.kv[p.src_rank], layer, src_blocks, p)
                if not w.synchronous:
                    keep.append(packed)
                runs = packed_runs(p, dst_runs, self.sizes, len(self.dst_heads[p.dst_rank]))
                w.write_runs(packed.data_ptr(), offset, runs)
            nbytes += sum(n for _, _, n in runs)
        return nbytes
