"""What both sides of the two-process harness agree on: the peer's shape, seeded KV contents (checked
bit-exact on both sides without shipping tensors; device KV through an untimed host copy), scattered
allocations, and the error a peer's failure comes back as."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.kv_transfer.config import TransferConfig

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class PeerSpec:
    num_layers: int = 30  # SmolLM2-135M
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 256
    dtype: str = "bfloat16"
    model_id: str = "smollm2-135m"
    config: TransferConfig = field(default_factory=TransferConfig)
    env: tuple[tuple[str, str], ...] = ()  # e.g. (("UCX_TLS", "tcp"),), applied before ucxx loads
    threads: int = 1
    use_uvloop: bool = True
    huge_pages: bool = True  # back the KV tensor with transparent huge pages (engine.hugepages; host only)
    # Where the KV tensor and the raw baseline's buffers live: "cpu" or "cuda". With "cuda", UCX_TLS in
    # ``env`` must name cuda_copy (ucxx refuses device buffers otherwise) and the peer creates its CUDA
    # context (allocating the tensor) before ucxx starts in its process.
    device: str = "cpu"
    # Host memory: the KV tensor in shared memory (engine.hugepages.SharedTensor), offered to same-host
    # senders, which write it with plain copies (writers/shm.py): a ``--kv-shared-memory`` decode worker.
    kv_shared: bool = False
    # A tensor-parallel group's rank 0: that many rank caches (each its heads, ``head_split``), ranks 1..
    # in shared memory as a group's followers' are, moved by ``kv_transfer.split``.
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.kv_shared and self.device != "cpu":
            raise ValueError("kv_shared is for host memory (device cpu)")
        if self.tp_size > 1 and self.device != "cpu":
            raise ValueError("tp_size > 1 is for host memory (device cpu)")


class PeerCallError(RuntimeError):
    """The peer raised; ``kind`` is the exception's class name (e.g. "PeerDiedError")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def expected_bytes(seed: int, num_layers: int, num_blocks: int, block_bytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_layers, num_blocks, block_bytes), dtype=torch.uint8, generator=gen)


def head_split(num_kv_heads: int, size: int) -> tuple[range, ...]:
    """Each rank's KV heads, as ``engine.tensor_parallel.ShardLayout`` splits them (each head on several
    ranks where ``size`` exceeds their count)."""
    if size <= num_kv_heads:
        per = num_kv_heads // size
        return tuple(range(r * per, (r + 1) * per) for r in range(size))
    return tuple(range(r // (size // num_kv_heads), r // (size // num_kv_heads) + 1) for r in range(size))


def scatter_allocate(bm: BlockManager, seq_id: str, num_tokens: int, keep_every: int) -> list[int]:
    """Allocate with non-contiguous block ids: take every free block, give back a pattern, allocate.

    Of the free blocks (in free-list order) every ``keep_every``-th stays taken
    while the request allocates, so its runs have length ``keep_every - 1``
    (2: every other block). Needs about ``keep_every / (keep_every - 1)`` times
    the request's blocks free.
    """
    fillers = [f"__filler_{seq_id}_{i}" for i in range(bm.num_free)]
    for f in fillers:
        bm.allocate(f, 1)
    for i, f in enumerate(fillers):
        if i % keep_every != 0:
            bm.free(f)
    try:
        return bm.allocate(seq_id, num_tokens)
    finally:
        for f in fillers:
            bm.free(f)


def fingerprint(t: torch.Tensor) -> str:
    """A digest of ``t``'s bytes (device memory: of a host copy; host memory: no copy)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
