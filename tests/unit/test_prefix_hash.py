"""Prefix block hashes: stable across processes, salted, chained, full blocks only; the model salt."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.engine.prefix_hash import (
    DIGEST_SIZE,
    block_hashes,
    extend_block_hashes,
    model_cache_salt,
    root_hash,
)

IDS = list(range(3, 40)) + [70000, 2**32 - 1]  # 39 ids: 9 full blocks of 4 and a partial one


def test_the_same_ids_hash_the_same_in_another_process():
    code = (
        "import json, sys; from pdserve.engine.prefix_hash import block_hashes; "
        "print(json.dumps([h.hex() for h in block_hashes(json.loads(sys.argv[1]), 4, 'salt')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(IDS)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert json.loads(out) == [h.hex() for h in block_hashes(IDS, 4, "salt")]


def test_full_blocks_only_and_max_blocks():
    hs = block_hashes(IDS, 4)
    assert len(hs) == len(IDS) // 4 and all(len(h) == DIGEST_SIZE for h in hs)
    assert len(set(hs)) == len(hs)
    assert block_hashes(IDS[:3], 4) == [] and block_hashes([], 4) == []
    assert block_hashes(IDS, 4, max_blocks=2) == hs[:2]
    assert block_hashes(IDS, 4, max_blocks=0) == []
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(IDS, 0)


def test_salt_and_every_token_change_the_hash():
    hs = block_hashes(IDS, 4)
    assert block_hashes(IDS, 4, "model-b") != hs
    assert root_hash("a") != root_hash("b")
    for i in range(len(hs) * 4):
        changed = list(IDS)
        changed[i] += 1
        other = block_hashes(changed, 4)
        k = i // 4
        assert other[:k] == hs[:k]  # blocks before the change keep their hashes
        assert all(a != b for a, b in zip(other[k:], hs[k:], strict=True))  # it and all after change


def test_hashes_chain_on_the_parent():
    hs = block_hashes(IDS, 4, "s")
    # Block 1 alone, parented on block 0's hash, is block 1 of the whole; on another parent it is not.
    assert block_hashes(IDS[4:8], 4, "s", parent=hs[0]) == [hs[1]]
    assert block_hashes(IDS[4:8], 4, "s") != [hs[1]]
    assert block_hashes(IDS[:4], 4, "s", parent=root_hash("s")) == [hs[0]]


def test_extend_appends_the_newly_full_blocks():
    full = block_hashes(IDS, 4, "s")
    hs: list[bytes] = []
    for upto in range(0, len(IDS) + 1):
        extend_block_hashes(hs, IDS, 4, "s", upto)
        assert hs == full[: upto // 4]
    extend_block_hashes(hs, IDS, 4, "s", 10_000)  # beyond the ids: only what is there
    assert hs == full


def _write_model(path, tensor_bytes: bytes, config: dict) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(tensor_bytes)], "data_offsets": [0, len(tensor_bytes)]}}
    )
    raw = header.encode()
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + tensor_bytes)


def test_model_salt_names_weights_dtype_and_quantization(tmp_path):
    weights = bytes(range(256)) * 64
    _write_model(tmp_path / "a", weights, {"model_type": "llama"})
    _write_model(tmp_path / "copy", weights, {"model_type": "llama"})
    _write_model(tmp_path / "tuned", weights[:8000] + b"\1" + weights[8001:], {"model_type": "llama"})
    salt = model_cache_salt(tmp_path / "a", "float32")
    assert salt == model_cache_salt(tmp_path / "copy", "float32")  # a copy elsewhere: the same salt
    assert salt != model_cache_salt(tmp_path / "tuned", "float32")  # one byte in the sampled middle
    assert salt != model_cache_salt(tmp_path / "a", "bfloat16")
    assert salt != model_cache_salt(tmp_path / "a", "float32", "int8")
