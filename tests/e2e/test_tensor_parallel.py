"""Tensor parallelism inside one engine (``engine.tensor_parallel``): N processes on gloo, each with its
heads, MLP columns, vocabulary slice and KV heads, give the tokens of one process and of transformers.

Exactness rule: the all-reduce of the row-parallel products sums the ranks' partial sums in another order
than one process sums a whole row, so a sequence is compared up to the first step whose top-2 reference
logits are within 1e-5 (``compared_steps``), and its logits agree within 1e-4 of the largest up to there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_runner import DecodeItem, ModelRunner, PrefillItem
from pdserve.engine.registry import DEFAULT_MODEL, resolve_model
from pdserve.engine.tensor_parallel import start_group
from tests.unit.test_llm import assert_no_leak, hf_greedy, prompts_of
from tests.unit.test_prefix_cache import compared_steps, generate_with_logits

STEPS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> Path:
    """A random Llama with 8 heads over 4 KV heads (head_dim 16, so the C kernels run), tied embeddings
    and a vocabulary no TP size divides."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tp-gqa")
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=509, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, rope_theta=10000.0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    return path


def _followers(llm: LLM) -> list[subprocess.Popen]:
    tp = llm.engine.runner.tp
    assert tp is not None
    return list(tp.processes)


def assert_group_exact(llm: LLM, prompts, want, want_logits, oracle, check=None) -> None:
    """A group's engine: ``check(llm)`` (its shape), then its greedy tokens against ``want`` (and the
    oracle's), no block leaked; closed in any case, after which every follower has exited."""
    try:
        if check is not None:
            check(llm)
        got, got_logits = generate_with_logits(llm, prompts, GREEDY)
        _assert_exact(got, got_logits, want, want_logits, oracle)
        assert_no_leak(llm)
    finally:
        procs = _followers(llm)
        llm.engine.close()
    assert all(p.poll() is not None for p in procs), "every follower exits when the engine closes"


def _assert_exact(got, got_logits, want, want_logits, oracle=None) -> None:
    for g, gl, w, wl, o in zip(got, got_logits, want, want_logits, oracle or [None] * len(want), strict=True):
        n = compared_steps(gl, wl, of_largest=True)
        assert n > STEPS // 2, "too many near ties to compare: pick other prompts"
        assert g.token_ids[:n] == w.token_ids[:n]
        if o is not None:
            assert w.token_ids[:n] == o[:n]


@pytest.mark.parametrize("size", [2, 4])  # 4: each of the 4 KV heads on one rank; 8 > 4 would replicate
def test_tp_greedy_equals_one_process_and_transformers(gqa_model, size):
    prompts = prompts_of([3, 17, 40, 9], seed=5, vocab=509)
    one = LLM(gqa_model, dtype="float32", threads=1, num_blocks=96)
    want, want_logits = generate_with_logits(one, prompts, GREEDY)
    oracle = [hf_greedy(gqa_model, p, STEPS) for p in prompts]
    llm = LLM(gqa_model, dtype="float32", threads=1, num_blocks=96, tensor_parallel_size=size)

    def check(llm: LLM) -> None:
        assert llm.engine.runner.shard_config.num_heads == 8 // size
        assert llm.engine.runner.kv.shape[-2] == 4 // size  # each rank caches its KV heads only

    assert_group_exact(llm, prompts, want, want_logits, oracle, check)


def test_replicated_kv_heads_and_prompt_logprobs(tiny_llama_dir):
    # The tiny Llama has 4 heads over 2 KV heads: at TP=4 each KV head lives on two ranks. Prompt
    # logprobs read the kept rows' logits after the step, on every rank.
    prompts = prompts_of([6, 21], seed=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    want = LLM(tiny_llama_dir, dtype="float32", threads=1).generate(prompts, params)
    llm = LLM(tiny_llama_dir, dtype="float32", threads=1, tensor_parallel_size=4)
    try:
        assert llm.engine.runner.kv.shape[-2] == 1
        got = llm.generate(prompts, params)
        for g, w in zip(got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs) > 1
            for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
                assert a.token_id == b.token_id and a.top_ids == b.top_ids
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert_no_leak(llm)
    finally:
        llm.engine.close()


def test_smollm2_at_tp3_equals_one_process_and_prefills_for_one(tmp_path, smollm2_cache):
    # SmolLM2: 9 heads over 3 KV heads, one KV head per rank; its real vocabulary is split three ways.
    model = resolve_model(DEFAULT_MODEL, smollm2_cache, progress=False)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 30] * k for k in (1, 3)]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    one = LLM(model, dtype="float32", threads=1, num_blocks=64)
    want, want_logits = generate_with_logits(one, prompts, params)
    del one
    llm = LLM(model, dtype="float32", threads=1, num_blocks=64, tensor_parallel_size=3)
    try:
        got, got_logits = generate_with_logits(llm, prompts, params)
        _assert_exact(got, got_logits, want, want_logits)
        assert_no_leak(llm)
    finally:
        llm.engine.close()
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's 9 attention"):
        LLM(model, dtype="float32", threads=1, tensor_parallel_size=2)

    # Disaggregated, prefill TP=3 -> decode TP=1 through the router: each prefill rank's KV head into the
    # decode worker's one cache (three pieces a layer, packed per run), the one process's tokens.
    from tests.e2e.cluster_harness import run_all, running_cluster

    reqs = greedy_requests("s", prompts, STEPS)
    extra = ("--prefill-tp", "3", "--local-prefill-threshold", "1", "--heartbeat-timeout", "15")
    with running_cluster(tmp_path, prefill=1, decode=1, model=model, extra=extra) as c:
        served = run_all(c.address, reqs)
        for r, w, wl in zip(reqs, want, want_logits, strict=True):
            n = first_near_tie(wl)
            assert served[r.request_id][0][:n] == w.outputs[0].token_ids[:n], r.request_id
        c.assert_no_leaks()


@pytest.mark.parametrize("collectives", ["shared", "gloo"])
def test_runner_logits_agree_and_no_kv_crosses_the_group(gqa_model, monkeypatch, collectives):
    # The whole vocabulary's logits of a prefill, at TP=2 against one process, within 1e-4 of the largest;
    # the only tensors through the group are the activations' partial sums and the logits. Either way the
    # ranks exchange them: through shared memory (the default) or gloo's loopback.
    monkeypatch.setenv("PDSERVE_TP_COLLECTIVES", collectives)
    sent: list[int] = []
    one = ModelRunner(gqa_model, num_blocks=16)
    kwargs = {"model_dir": str(gqa_model), "dtype": "float32", "num_blocks": 16}
    tp = start_group(one.config, 2, kwargs, threads=1)
    try:
        assert (tp.host is not None) == (collectives == "shared")
        runner = ModelRunner(gqa_model, num_blocks=16, tensor_parallel=tp)
        real_reduce, real_gather = tp.all_reduce, tp.gather_vocab
        monkeypatch.setattr(tp, "all_reduce", lambda t: sent.append(t.shape[-1]) or real_reduce(t))
        monkeypatch.setattr(tp, "gather_vocab", lambda t: sent.append(-1) or real_gather(t))
        items = [PrefillItem(list(range(3, 40)), [0, 1, 2]), PrefillItem(list(range(50, 61)), [3])]
        got = runner.prefill(items, all_logits=True)
        want = one.prefill(items, all_logits=True)
        assert got.shape == want.shape == (48, 509)
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
        hidden = one.config.hidden_size
        assert sent == [hidden, hidden] * one.config.num_layers + [-1]  # never K/V (Hkv * D wide)
        # A layer hook stays on rank 0 and runs once every rank's K/V of the layer are in its cache: the
        # follower's too (what the KV transfer's push reads), seen through rank 0's mapping of it.
        seen: list[tuple[int, bool]] = []
        follower = runner.rank_kv[1]
        hook_items = [PrefillItem(list(range(70, 90)), [8, 9])]

        def hook(layer, k, v):
            written = follower[layer, 8:10].reshape(2, -1)[:, :4].abs().sum(dim=1)
            seen.append((layer, bool((written > 0).all())))

        runner.prefill(hook_items, hook)
        assert seen == [(layer, True) for layer in range(one.config.num_layers)]
        one.prefill(hook_items)
        # Rank 0 maps the follower's KV cache: the ranks' heads side by side are one process's cache.
        assert [t.shape[-2] for t in runner.rank_kv] == [2, 2]
        whole = torch.cat(runner.rank_kv, dim=-2)
        assert torch.equal(whole[0], one.kv[0])  # layer 0: nothing summed in another order yet
        assert (whole - one.kv).abs().max().item() <= 1e-4 * one.kv.abs().max().item()
    finally:
        tp.close()


def test_the_torch_step_a_cuda_group_runs_agrees_with_one_process(gqa_model):
    # A group on CUDA runs the torch step (its all-reduces between products the Triton step graphs):
    # the same code on CPU here, prefill then a decode step, against one process's torch step.
    one = ModelRunner(gqa_model, num_blocks=16, backend="torch")
    kwargs = {"model_dir": str(gqa_model), "dtype": "float32", "num_blocks": 16, "backend": "torch"}
    tp = start_group(one.config, 2, kwargs, threads=1)
    try:
        runner = ModelRunner(gqa_model, num_blocks=16, backend="torch", tensor_parallel=tp)
        assert runner.backend.value == "torch" and runner.kernels is None
        items = [PrefillItem(list(range(3, 30)), [0, 1]), PrefillItem(list(range(50, 55)), [2])]
        steps = [
            (runner.prefill(items), one.prefill(items)),
            (runner.decode([DecodeItem(7, 27, [0, 1]), DecodeItem(8, 5, [2])]),
             one.decode([DecodeItem(7, 27, [0, 1]), DecodeItem(8, 5, [2])])),
        ]  # fmt: skip
        for got, want in steps:
            assert got.shape == want.shape == (2, 509)
            assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    finally:
        tp.close()


def test_followers_die_with_a_killed_rank0(gqa_model, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from pdserve.engine import LLM
        llm = LLM({str(gqa_model)!r}, dtype="float32", threads=1, tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in llm.engine.runner.tp.processes), flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1, line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, "a follower outlived rank 0"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_follower_is_heard_at_once(gqa_model):
    """Rank 0 hears of a follower's death from its pipe (EOF), not from a collective's timeout."""
    llm = LLM(gqa_model, dtype="float32", threads=1, tensor_parallel_size=2)
    tp = llm.engine.runner.tp
    assert tp is not None
    lost: list[str] = []
    heard = threading.Event()
    tp.watch(lambda why: (lost.append(why), heard.set()))
    try:
        follower = tp.processes[0]
        follower.kill()
        assert heard.wait(10), "rank 0 did not hear of its follower's death"
        assert lost == [f"tensor-parallel rank 1 (pid {follower.pid}) of 2 is gone"]
    finally:
        llm.engine.close()
    # Closing a watched group: each follower sees its pipe end and exits by itself (the watch's poll does
    # not keep the pipe open), rather than being killed once close() has waited its bound.
    llm = LLM(gqa_model, dtype="float32", threads=1, tensor_parallel_size=2)
    tp = llm.engine.runner.tp
    assert tp is not None
    tp.watch(lambda why: lost.append(why))
    llm.engine.close()
    assert [p.returncode for p in tp.processes] == [0] and len(lost) == 1


def greedy_requests(prefix: str, prompts: list[list[int]], max_tokens: int) -> list:
    """A greedy ``GenerateRequest`` per prompt (``{prefix}-{i}``) of exactly ``max_tokens`` tokens."""
    from pdserve.proto import generation_pb2

    out = []
    for i, p in enumerate(prompts):
        r = generation_pb2.GenerateRequest(
            request_id=f"{prefix}-{i}", prompt_token_ids=generation_pb2.TokenIds(ids=p)
        )
        r.sampling.max_tokens, r.sampling.temperature, r.sampling.ignore_eos = max_tokens, 0.0, True
        out.append(r)
    return out


def first_near_tie(logits) -> int:
    """The exactness rule's cut: the first step whose top-2 reference logits are within 1e-5."""
    for k, row in enumerate(logits):
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() < 1e-5:
            return k
    return len(logits)
