"""Block hashes for automatic prefix caching: a chained, salted digest of each full KV block's token ids.

``h_i = blake2b(h_{i-1} || ids of block i as little-endian uint32, digest_size=16)`` with ``h_{-1} =
root_hash(salt)``, so a block's hash names its whole prefix and is the same in every process and on every
machine (never Python's ``hash()``). The salt is whatever changes the K/V of the same tokens: the weights,
the dtype, the quantization (``model_cache_salt``). Also the events a block manager records when a hash
enters or leaves its cache. Pure Python: the scheduler, the workers and the router share it.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Sequence
from hashlib import blake2b
from pathlib import Path
from typing import NamedTuple

BlockHash = bytes
DIGEST_SIZE = 16
# Bumped whenever the hashing changes, so hashes of two versions never meet.
SCHEME = "pdserve-kv1"


class StoredBlock(NamedTuple):
    """A block's K/V became reusable under ``block_hash``."""

    block_hash: BlockHash
    parent_hash: BlockHash | None  # the previous block's hash; None for a sequence's first block


class RemovedBlock(NamedTuple):
    """The cache no longer holds ``block_hash`` (its block was evicted)."""

    block_hash: BlockHash


KVEvent = StoredBlock | RemovedBlock


@functools.lru_cache(maxsize=64)
def root_hash(salt: str) -> BlockHash:
    """The parent of a sequence's first block."""
    return blake2b(salt.encode(), digest_size=DIGEST_SIZE).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    *,
    parent: BlockHash | None = None,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """The hash of each full block of ``token_ids`` (a partial last block has none), at most
    ``max_blocks``. ``parent``: the hash of the block before ``token_ids[0]`` (default: the root)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return []
    h = root_hash(salt) if parent is None else parent
    data = memoryview(struct.pack(f"<{n * block_size}I", *token_ids[: n * block_size]))
    width = 4 * block_size
    out: list[BlockHash] = []
    for off in range(0, n * width, width):
        d = blake2b(h, digest_size=DIGEST_SIZE)
        d.update(data[off : off + width])
        h = d.digest()
        out.append(h)
    return out


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str, upto_tokens: int
) -> None:
    """Append to ``hashes`` (those of the first ``len(hashes)`` blocks of ``token_ids``) the hashes of the
    full blocks that end at or before ``upto_tokens``."""
    start = len(hashes) * block_size
    end = min(upto_tokens, len(token_ids))
    if end - start < block_size:
        return
    hashes += block_hashes(token_ids[start:end], block_size, salt, parent=hashes[-1] if hashes else None)


# A sample of each tensor's bytes: enough to tell fine-tunes of one base apart, cheap for any model size.
_SAMPLE = 4096


def model_cache_salt(model_dir: str | Path, dtype: str, quantization: str = "none") -> str:
    """The salt of a model's KV hashes: the scheme, a fingerprint of the weights (config.json, every
    safetensors header and a sample of every tensor), the dtype and the quantization. The same files give
    the same salt on every machine; reading them costs a few KiB per tensor."""
    path = Path(model_dir)
    digest = blake2b(digest_size=DIGEST_SIZE)
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        digest.update(f"\0{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(header_len)
            digest.update(header)
            spans = [v["data_offsets"] for k, v in json.loads(header).items() if k != "__metadata__"]
            for begin, end in sorted(spans):
                f.seek(8 + header_len + begin + max(0, (end - begin - _SAMPLE) // 2))
                digest.update(f.read(min(_SAMPLE, end - begin)))
    return f"{SCHEME}:{digest.hexdigest()}:{dtype}:{quantization}"
