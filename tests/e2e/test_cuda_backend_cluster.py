"""A GPU cluster on one GPU gives the offline engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the CUDA backend's kernels)")

from pdserve.engine import LLM, SamplingParams  # noqa: E402

CUDA = torch.cuda.is_available()
PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [100], list(range(3, 23))]


# -- on the GPU machine -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_cluster_on_one_gpu_gives_the_offline_greedy_tokens(tiny_llama_dir, tmp_path):
    import shutil

    import grpc

    from benchmarks.hf_baselines import write_placeholder_tokenizer
    from pdserve.proto import generation_pb2, generation_pb2_grpc
    from tests.e2e.cluster_harness import generate, running_cluster

    model = write_placeholder_tokenizer(shutil.copytree(tiny_llama_dir, tmp_path / "model"))  # for the router
    want = [o.token_ids for o in LLM(model, dtype="float32", device="cuda", num_blocks=256).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )]  # fmt: skip
    extra = ("--model", str(model), "--device", "cuda", "--gpu-memory-utilization", "0.2",
             "--local-prefill-threshold", "1")  # fmt: skip
    with running_cluster(tmp_path, prefill=1, decode=1, extra=extra) as c:
        with grpc.insecure_channel(c.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for i, p in enumerate(PROMPTS):
                req = generation_pb2.GenerateRequest(
                    request_id=f"g{i}",
                    prompt_token_ids=generation_pb2.TokenIds(ids=p),
                    sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                )
                assert generate(stub, req)[0] == want[i]
        c.assert_no_leaks()
