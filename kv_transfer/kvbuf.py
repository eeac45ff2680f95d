"""Byte views of the project's KV tensor for the transports; uses torch, never model code. In the layout
``kv [L, N, 2, B, Hkv, D]``, ``kv[layer, b0:b0 + n]`` is one contiguous span (K then V of each block): the
unit one data message moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash

from pdserve.kv_transfer.wire import PROTOCOL_VERSION, KVCompat


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compat_for(
    kv: torch.Tensor,
    model_id: str,
    protocol_version: int = PROTOCOL_VERSION,
    num_kv_heads: int | None = None,
) -> KVCompat:
    """The compatibility record of a KV tensor in the project layout. ``num_kv_heads``: the model's, where
    ``kv`` is one tensor-parallel rank's cache holding some of them (the record names the model's KV
    shape; how a group splits it travels in the handshake)."""
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(f"KV tensor must be [L, N, 2, B, Hkv, D], got shape {tuple(kv.shape)}")
    num_layers, _, _, block_size, heads_here, head_dim = kv.shape
    return KVCompat(
        model_id=model_id,
        dtype=dtype_name(kv.dtype),
        num_layers=num_layers,
        num_kv_heads=heads_here if num_kv_heads is None else num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        protocol_version=protocol_version,
    )


def check_kv(kv: torch.Tensor, compat: KVCompat, num_heads: int | None = None) -> None:
    """The tensor must be one contiguous allocation matching ``compat`` (holding ``num_heads`` of its KV
    heads: a tensor-parallel rank's cache; default all)."""
    expected = compat_for(kv, compat.model_id, compat.protocol_version, compat.num_kv_heads)
    if num_heads is None:
        num_heads = compat.num_kv_heads
    if expected != compat or kv.shape[4] != num_heads:
        raise ValueError(
            f"KV tensor of shape {tuple(kv.shape)} ({num_heads} KV heads expected) does not match "
            f"compatibility record {compat}"
        )
    if not kv.is_contiguous():
        raise ValueError("KV tensor must be contiguous (one registration for the transport)")


def span(kv: torch.Tensor, layer: int, first_block: int, num_blocks: int) -> torch.Tensor:
    """``kv[layer, first_block : first_block + num_blocks]``, contiguous."""
    return kv[layer, first_block : first_block + num_blocks]  # [n, 2, B, Hkv, D]


class KVSpans:
    """Byte spans of one KV tensor, for the transport's hot path.

    A span is a slice of one flat uint8 view made once: a numpy view for host
    memory (slicing it is far cheaper than a torch view plus ``.numpy()``, which
    adds up over hundreds of messages per transfer), a torch view for device memory.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        if not kv.is_contiguous():
            raise ValueError("KV tensor must be contiguous")
        self.num_blocks = kv.shape[1]
        self.block_bytes = block_bytes(kv)
        self.layer_bytes = self.num_blocks * self.block_bytes
        flat = as_bytes(kv)  # [L * N * block_bytes]
        self.host = kv.device.type == "cpu"
        self.flat: Any = flat.numpy() if self.host else flat
        self.address: int = flat.data_ptr()  # of block 0 of layer 0, for one-sided writes by address

    def span(self, layer: int, first_block: int, num_blocks: int) -> Any:
        """The bytes of ``kv[layer, first_block : first_block + num_blocks]``."""
        start = (layer * self.num_blocks + first_block) * self.block_bytes
        return self.flat[start : start + num_blocks * self.block_bytes]


def layer_digests(spans: KVSpans, runs: Sequence[tuple[int, int]], num_layers: int) -> tuple[int, ...]:
    """Per layer, the xxh3-64 of its bytes in ``runs`` (first block, block count), in order: what a
    transfer wrote, hashed by the writer from its blocks and by the receiver from its own (the runs of
    both sides cover the same tokens in the same order). Host memory only: () for device memory."""
    if not spans.host:
        return ()
    out = []
    for layer in range(num_layers):
        h = xxhash.xxh3_64()
        for first, count in runs:
            h.update(spans.span(layer, first, count))
        out.append(h.intdigest())
    return tuple(out)


def scratch(kv: torch.Tensor, nbytes: int) -> Any:
    """A uint8 buffer of ``nbytes`` on the KV tensor's device, in the form :class:`KVSpans` gives."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=kv.device)
    return buf.numpy() if kv.device.type == "cpu" else buf


def block_bytes(kv: torch.Tensor) -> int:
    """Bytes of one block of one layer (K and V)."""
    return kv[0, 0].numel() * kv.element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (shares memory)."""
    return t.reshape(-1).view(torch.uint8)  # [nbytes]


def ready_marker(device: torch.device) -> Callable[[], bool] | None:
    """Something to poll until the KV just written on ``device`` is visible to the transport.

    CPU writes are done when the forward's call returns, so there is nothing to
    wait for. On CUDA the forward only enqueued the writes: record an event on
    the current stream (cheap, never blocks the forward thread).
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event.query
