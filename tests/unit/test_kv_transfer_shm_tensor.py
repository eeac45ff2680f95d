"""Shared-memory KV caches within one process: the memfd tensor, a runner on it, and the step benchmark."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.hugepages import SharedTensor, shared_memory_huge_pages
from pdserve.kv_transfer.writers import cma

pytestmark = pytest.mark.skipif(not cma.host_identity(), reason="no /proc here: no same-host writers")


def test_a_shared_tensor_is_zeroed_and_seen_through_its_memfd() -> None:
    t = SharedTensor(4, 8, 16, dtype=torch.bfloat16)
    assert t.tensor.shape == (4, 8, 16) and t.tensor.dtype == torch.bfloat16
    assert not t.tensor.any() and t.nbytes == 4 * 8 * 16 * 2
    assert os.readlink(f"/proc/self/fd/{t.fd}").startswith("/memfd:pdserve-kv")
    assert t.huge == (t.huge and shared_memory_huge_pages())  # advised only where the kernel allows it
    t.tensor[1, 2, 3] = 1.5
    with open(f"/proc/self/fd/{t.fd}", "rb") as f:  # what a peer mapping the memfd sees
        raw = f.read()
    seen = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(4, 8, 16)
    assert seen[1, 2, 3].item() == 1.5 and int(seen.count_nonzero()) == 1
    with pytest.raises(ValueError):
        SharedTensor(0, 4, dtype=torch.float32)


def test_a_runner_with_its_kv_cache_in_shared_memory_computes_the_same(tiny_llama_dir) -> None:
    from pdserve.engine.model_runner import ModelRunner, PrefillItem

    plain = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=4)
    shared = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=4, kv_shared=True)
    assert plain.kv_shared_fd is None and shared.kv_shared_fd is not None
    item = [PrefillItem(list(range(3, 20)), list(range(5)))]
    torch.testing.assert_close(shared.prefill(item), plain.prefill(item), rtol=0, atol=0)
    torch.testing.assert_close(shared.kv, plain.kv, rtol=0, atol=0)


def test_the_step_benchmark_times_both_caches(tiny_llama_dir) -> None:
    """``tools.kv_shared_steps`` (the price of --kv-shared-memory), on a tiny model."""
    from tools import kv_shared_steps

    tiny = str(tiny_llama_dir)
    report = kv_shared_steps.measure(tiny, batch=2, prompt_len=8, dtype=torch.float32, rounds=1)
    assert set(report["step_ms"]) == {"anonymous", "shared"}
    assert all(len(v) == 1 and v[0] > 0 for v in report["step_ms"].values())
    assert report["shared_over_anonymous"] > 0
