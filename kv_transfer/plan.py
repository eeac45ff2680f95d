"""Which bytes go in which data message, and the tags that name them. Pure: no torch, no ucxx."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Data message tags (64 bits, matched exactly by the receiving process):
#   bit 63      1: data (control tags clear it, transports/ucx_framing.py)
#   bits 32-62  transfer id, unique per receiving process
#   bits 24-31  layer
#   bits 16-23  connection id: the receiver's id for the sending connection (HelloReply.conn_id)
#   bits  0-15  segment index
# Data follows Open without waiting for the receiver to see it, and matching is per process, not per
# connection: the connection id keeps a second sender of the same ticket from ever matching the
# receives posted for the accepted one.
MAX_TRANSFER_ID = (1 << 31) - 1
MAX_LAYERS = 1 << 8
MAX_CONN_IDS = 1 << 8
MAX_SEGMENTS = 1 << 16


# A segment is a run of blocks consecutive on BOTH sides: one contiguous span in both KV tensors, so it
# moves as one message. The sender computes the runs from both tables and sends their lengths in Open;
# the receiver checks that its side of every run is contiguous.
@dataclass(frozen=True)
class Segment:
    index: int
    src_start: int  # first block id on the sending side
    dst_start: int  # first block id on the receiving side
    num_blocks: int


def segment_lengths(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> tuple[int, ...]:
    """Lengths of the maximal runs that are consecutive in both block tables."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"block tables differ in length: {len(src_blocks)} source vs {len(dst_blocks)}")
    lengths: list[int] = []
    run = 0
    for i in range(len(src_blocks)):
        if run and src_blocks[i] == src_blocks[i - 1] + 1 and dst_blocks[i] == dst_blocks[i - 1] + 1:
            run += 1
        else:
            if run:
                lengths.append(run)
            run = 1
    if run:
        lengths.append(run)
    if len(lengths) > MAX_SEGMENTS:
        raise ValueError(f"{len(lengths)} segments exceed the tag layout's {MAX_SEGMENTS}")
    return tuple(lengths)


def is_contiguous(blocks: Sequence[int]) -> bool:
    return all(blocks[i] == blocks[i - 1] + 1 for i in range(1, len(blocks)))


def build_segments(
    lengths: Sequence[int], src_blocks: Sequence[int] | None, dst_blocks: Sequence[int]
) -> list[Segment]:
    """Segments for given run lengths. ``src_blocks`` is None on the receiving side.

    Raises ValueError when the lengths do not cover the tables or a run is not
    contiguous on a side whose table is known.
    """
    if sum(lengths) != len(dst_blocks) or any(n < 1 for n in lengths):
        raise ValueError(f"segment lengths {list(lengths)[:8]}... do not cover {len(dst_blocks)} blocks")
    if src_blocks is not None and len(src_blocks) != len(dst_blocks):
        raise ValueError("block tables differ in length")
    segments: list[Segment] = []
    pos = 0
    for index, n in enumerate(lengths):
        dst_run = dst_blocks[pos : pos + n]
        if not is_contiguous(dst_run):
            raise ValueError(f"segment {index} is not contiguous on the receiving side")
        src_start = -1
        if src_blocks is not None:
            src_run = src_blocks[pos : pos + n]
            if not is_contiguous(src_run):
                raise ValueError(f"segment {index} is not contiguous on the sending side")
            src_start = src_run[0]
        segments.append(Segment(index, src_start, dst_run[0], n))
        pos += n
    return segments


def data_tag(transfer_id: int, layer: int, segment: int, conn_id: int) -> int:
    return tag_base(transfer_id, conn_id) | layer_tag(layer, segment)


def tag_base(transfer_id: int, conn_id: int) -> int:
    """The bits one transfer's tags share; OR with :func:`layer_tag` (the hot path checks once)."""
    if not 0 <= transfer_id <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer id {transfer_id} out of range")
    if not 0 <= conn_id < MAX_CONN_IDS:
        raise ValueError(f"connection id {conn_id} out of range")
    return (1 << 63) | (transfer_id << 32) | (conn_id << 16)


def layer_tag(layer: int, segment: int) -> int:
    if not 0 <= layer < MAX_LAYERS:
        raise ValueError(f"layer {layer} out of range")
    if not 0 <= segment < MAX_SEGMENTS:
        raise ValueError(f"segment {segment} out of range")
    return (layer << 24) | segment


def split_tag(tag: int) -> tuple[int, int, int, int]:
    """Inverse of :func:`data_tag`: (transfer id, layer, segment, connection id)."""
    return (
        (tag >> 32) & MAX_TRANSFER_ID,
        (tag >> 24) & (MAX_LAYERS - 1),
        tag & (MAX_SEGMENTS - 1),
        (tag >> 16) & (MAX_CONN_IDS - 1),
    )


def layer_runs(
    local_stride: int, remote_stride: int, count: int, runs: Sequence[tuple[int, int, int]]
) -> list[tuple[int, int, int]]:
    """The runs ``(source, destination, bytes)`` of ``count`` consecutive layers as one list: layer ``i``'s
    shifted by ``i * local_stride`` and ``i * remote_stride`` (a writer that copies them in one call)."""
    return [(i * local_stride + s, i * remote_stride + d, n) for i in range(count) for s, d, n in runs]
