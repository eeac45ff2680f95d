"""Tensor parallelism on CUDA (the GPU machine: ``pytest -m gpu``): NCCL where each rank has a GPU of its
own, gloo through host memory where two ranks share the one GPU. The same exactness rule as
``test_tensor_parallel``: compared up to a step whose top-2 logits are within 1e-5, logits within 1e-4."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.tensor_parallel import GroupBackend
from tests.e2e.test_tensor_parallel import GREEDY, assert_group_exact, gqa_model  # noqa: F401
from tests.unit.test_llm import hf_greedy, prompts_of
from tests.unit.test_prefix_cache import generate_with_logits

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run_on_cuda(model, backend: GroupBackend, devices: list[int]) -> None:
    prompts = prompts_of([3, 17, 40, 9], seed=5, vocab=509)
    want, want_logits = generate_with_logits(
        LLM(model, dtype="float32", threads=1, num_blocks=96), prompts, GREEDY
    )
    oracle = [hf_greedy(model, p, len(want[0].token_ids)) for p in prompts]
    llm = LLM(model, dtype="float32", device="cuda", threads=1, num_blocks=96, tensor_parallel_size=2)

    def check(llm: LLM) -> None:
        tp = llm.engine.runner.tp
        assert tp is not None and tp.backend is backend
        assert [d.index for d in tp.placement.devices] == devices
        assert llm.engine.runner.kv.is_cuda and llm.engine.runner.kv.shape[-2] == 2

    assert_group_exact(llm, prompts, want, want_logits, oracle, check)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs: a rank on each, over NCCL")
def test_tp2_on_two_gpus_over_nccl_equals_one_process(gqa_model):  # noqa: F811 (the fixture)
    _run_on_cuda(gqa_model, GroupBackend.NCCL, [0, 1])


def test_tp2_with_both_ranks_on_one_gpu_over_gloo_equals_one_process(gqa_model, monkeypatch):  # noqa: F811
    # On a host of one GPU the group shares it: NCCL refuses two ranks on one device, so gloo carries
    # the collectives through host memory. (On a host of several, the test hides all but the first.)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _run_on_cuda(gqa_model, GroupBackend.GLOO, [0, 0])
