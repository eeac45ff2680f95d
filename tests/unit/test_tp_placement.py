"""Where a tensor-parallel group's ranks run (CPU, one GPU, GPUs of their own) and its collectives through
each backend's path, in one process (two threads in a gloo group)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pdserve.engine.config import ModelConfig
from pdserve.engine.tensor_parallel import (
    GroupBackend,
    RankPlacement,
    ShardLayout,
    TensorParallel,
    gloo_group,
    place_ranks,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_a_cpu_group_runs_every_rank_on_cpu_over_gloo() -> None:
    p = place_ranks(CPU, 3, gpu_count=0, nccl_available=False)
    assert p.devices == (CPU, CPU, CPU) and p.backend is GroupBackend.GLOO
    assert not p.staged and p.share(0) == 3


def test_ranks_with_a_gpu_each_run_on_nccl_from_rank_0s_gpu_round() -> None:
    p = place_ranks(torch.device("cuda", 2), 4, gpu_count=4, nccl_available=True)
    assert [d.index for d in p.devices] == [2, 3, 0, 1]
    assert p.backend is GroupBackend.NCCL and not p.staged and p.share(1) == 1


def test_ranks_sharing_a_gpu_run_on_gloo_through_host_memory() -> None:
    one = place_ranks(CUDA, 2, gpu_count=1, nccl_available=True)
    assert one.devices == (CUDA, CUDA) and one.backend is GroupBackend.GLOO and one.staged
    assert one.share(0) == 2  # each rank sizes its cache from half the GPU
    three = place_ranks(CUDA, 3, gpu_count=2, nccl_available=True)
    assert [d.index for d in three.devices] == [0, 1, 0] and three.backend is GroupBackend.GLOO
    assert (three.share(0), three.share(1)) == (2, 1)
    no_nccl = place_ranks(CUDA, 2, gpu_count=2, nccl_available=False)
    assert no_nccl.backend is GroupBackend.GLOO


def test_a_cuda_group_on_a_host_without_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        place_ranks(CUDA, 2, gpu_count=0, nccl_available=False)


def _config() -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "model_type": "llama", "vocab_size": 11, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32, "rms_norm_eps": 1e-6,
        }
    )  # fmt: skip


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "through-host"])
def test_the_collectives_sum_gather_and_agree_on_either_path(staged: bool) -> None:
    # Staged: the placement says the ranks share a GPU, so every collective copies through host
    # tensors (on CPU tensors here: the same code, the copies trivial).
    devices = (CUDA, CUDA) if staged else (CPU, CPU)
    placement = RankPlacement(devices, GroupBackend.GLOO)
    assert placement.staged is staged
    store = dist.HashStore()
    results: dict[int, Any] = {}

    def rank(r: int) -> None:
        tp = TensorParallel(ShardLayout.of(_config(), r, 2), gloo_group(store, r, 2), placement=placement)
        summed = tp.all_reduce(torch.full((2, 3), float(r + 1)))
        local = torch.arange(len(tp.layout.vocab), dtype=torch.float32) + 100 * r
        vocab = tp.gather_vocab(local.repeat(2, 1))
        results[r] = (summed, vocab, tp.agree_min(7 - r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for r in range(2):
        summed, vocab, least = results[r]
        assert torch.equal(summed, torch.full((2, 3), 3.0))
        # 11 rows over 2 ranks: 6 and 5, each rank's padded slice cut back to the vocabulary.
        want = torch.tensor([0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104], dtype=torch.float32)
        assert torch.equal(vocab, want.repeat(2, 1))
        assert least == 6
