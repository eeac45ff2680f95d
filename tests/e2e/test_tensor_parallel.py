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
from pdserve.engine.model_runner import ModelRunner, PrefillItem
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
    try:
        assert llm.engine.runner.shard_config.num_heads == 8 // size
        assert llm.engine.runner.kv.shape[-2] == 4 // size  # each rank caches its KV heads only
        got, got_logits = generate_with_logits(llm, prompts, GREEDY)
        _assert_exact(got, got_logits, want, want_logits, oracle)
        assert_no_leak(llm)
    finally:
        procs = _followers(llm)
        llm.engine.close()
    assert all(p.poll() is not None for p in procs), "every follower exits when the engine closes"


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
    from pdserve.proto import generation_pb2
    from tests.e2e.cluster_harness import run_all, running_cluster

    reqs = []
    for i, p in enumerate(prompts):
        r = generation_pb2.GenerateRequest(
            request_id=f"s-{i}", prompt_token_ids=generation_pb2.TokenIds(ids=p)
        )
        r.sampling.max_tokens, r.sampling.temperature, r.sampling.ignore_eos = STEPS, 0.0, True
        reqs.append(r)
    extra = ("--prefill-tp", "3", "--local-prefill-threshold", "1", "--heartbeat-timeout", "15")
    with running_cluster(tmp_path, prefill=1, decode=1, model=model, extra=extra) as c:
        served = run_all(c.address, reqs)
        for r, w, wl in zip(reqs, want, want_logits, strict=True):
            n = _first_near_tie(wl)
            assert served[r.request_id][0][:n] == w.outputs[0].token_ids[:n], r.request_id
        c.assert_no_leaks()


def test_runner_logits_agree_and_no_kv_crosses_the_group(gqa_model, monkeypatch):
    # The whole vocabulary's logits of a prefill, at TP=2 against one process, within 1e-4 of the largest;
    # the only tensors through the group are the activations' partial sums and the logits.
    sent: list[int] = []
    one = ModelRunner(gqa_model, num_blocks=16)
    kwargs = {"model_dir": str(gqa_model), "dtype": "float32", "num_blocks": 16}
    tp = start_group(one.config, 2, kwargs, threads=1)
    try:
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


def _followers_of(pid: int) -> list[psutil.Process]:
    children = psutil.Process(pid).children()
    return [p for p in children if "pdserve.engine.tp_follower" in " ".join(p.cmdline())]


def test_colocated_groups_serve_and_a_dead_rank_takes_its_worker_out(tmp_path, tiny_served_model):
    """`up --colocated 2 --colocated-tp 2`: two workers of two processes each, shown as such by `status`.
    SIGKILL of one worker's follower under 8 streams: that worker stops (its rank 0 hears at once), its
    streams re-prefill on the other and every client gets the undisturbed tokens; no process of the dead
    worker is left, and the survivor ends holding no KV block. `scale` then starts a group in its place,
    and `drain` ends that group's two processes."""
    from tests.e2e.cluster_harness import (
        migrations,
        pdserve,
        run_all,
        running_cluster,
        streaming,
        wait_until,
        worker_load,
    )
    from tests.e2e.test_live_migration_e2e import _requests

    extra = ("--colocated-tp", "2", "--heartbeat-timeout", "15")
    with running_cluster(tmp_path, colocated=2, model=tiny_served_model, extra=extra) as c:
        workers = c.workers()
        assert [(w["role"], w["tensor_parallel_size"]) for w in workers] == [("both", 2), ("both", 2)]
        assert all(len(_followers_of(c.worker_pid(w["id"]))) == 1 for w in workers)
        want = run_all(c.address, _requests("ref", 300)[:8])
        reqs = _requests("tp", 300)[:8]
        meta = c.token_metadata()
        with streaming(c, reqs, after=4) as streams:
            assert streams.wait_streaming(120)
            victim = max(workers, key=lambda w: worker_load(w["address"], meta).running)
            survivor = next(w for w in workers if w["id"] != victim["id"])
            rank0 = psutil.Process(c.worker_pid(victim["id"]))
            (follower,) = _followers_of(rank0.pid)
            follower.kill()
            streams.join(180)
        assert not streams.errors, streams.errors
        for r in reqs:
            assert streams.got[r.request_id] == want["ref-" + r.request_id.split("-", 1)[1]][0], r.request_id
        assert sum(migrations(c).values()) > 0, "no stream moved off the broken worker"

        def gone(p: psutil.Process) -> bool:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE

        wait_until(lambda: gone(rank0) and gone(follower), 60, "the broken worker's processes to exit")
        c.assert_no_leaks(workers=[survivor["id"]])

        # Scale and drain act on a group: the replacement is a group of two, and its drain ends both.
        pdserve("scale", "--colocated", "2", "--state-dir", str(c.state_dir), timeout=120)  # (one is dead)
        (new,) = [w for w in c.workers() if w["id"] not in (victim["id"], survivor["id"])]
        assert new["tensor_parallel_size"] == 2, new
        new_rank0 = psutil.Process(c.worker_pid(new["id"]))
        (new_follower,) = _followers_of(new_rank0.pid)
        state_dir = str(c.state_dir)
        pdserve("drain", "--worker-id", new["id"], "--state-dir", state_dir, "--timeout", "60", timeout=90)
        wait_until(lambda: gone(new_rank0) and gone(new_follower), 30, "the drained group to exit")
        c.assert_no_leaks(workers=[survivor["id"]])


def _first_near_tie(logits) -> int:
    """The exactness rule's cut: the first step whose top-2 reference logits are within 1e-5."""
    for k, row in enumerate(logits):
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() < 1e-5:
            return k
    return len(logits)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_pools_of_different_sizes_give_one_process_tokens(tmp_path, tiny_served_model, prefill_tp, decode_tp):
    """`up --prefill-tp P --decode-tp D` (the tiny model: 2 KV heads): every prompt prefilled by the prefill
    group reaches the decode group head slice by head slice, and the greedy tokens through the router are
    one process's (compared up to the first near tie of its logits). The decode side's blocks are as the
    pool allocates them; the prefill side reports its writes per layer, at most ranks x ranks x runs."""
    from pdserve.proto import generation_pb2
    from tests.e2e.cluster_harness import metric_sum, run_all, running_cluster

    prompts = prompts_of([20, 70, 130, 33, 250, 90], seed=11, vocab=4000)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = LLM(tiny_served_model, dtype="float32", threads=1, num_blocks=128)
    want, want_logits = generate_with_logits(one, prompts, params)
    del one
    reqs = []
    for i, p in enumerate(prompts):
        r = generation_pb2.GenerateRequest(
            request_id=f"tp-{i}", prompt_token_ids=generation_pb2.TokenIds(ids=p)
        )
        r.sampling.max_tokens, r.sampling.temperature, r.sampling.ignore_eos = 24, 0.0, True
        reqs.append(r)
    extra = (
        *("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)),
        *("--local-prefill-threshold", "1", "--heartbeat-timeout", "15"),
    )
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        sizes = {w["role"]: w["tensor_parallel_size"] for w in c.workers()}
        assert sizes == {"prefill": prefill_tp, "decode": decode_tp}
        for w in c.workers():  # `status` names every rank's process, rank 0 first
            pids = w["rank_pids"]
            assert len(pids) == w["tensor_parallel_size"] and pids[0] == c.worker_pid(w["id"]), w
            assert [f.pid for f in _followers_of(pids[0])] == pids[1:], w
        got = run_all(c.address, reqs)
        for r, w, wl in zip(reqs, want, want_logits, strict=True):
            n = _first_near_tie(wl)
            assert n > len(wl) // 2, "too many near ties to compare: pick other prompts"
            assert got[r.request_id][0][:n] == w.outputs[0].token_ids[:n], r.request_id
        prefill = next(w for w in c.workers() if w["role"] == "prefill")
        url = prefill["metrics_url"]
        opened = metric_sum(url, "pdserve_kv_transfer_opened_total", role="prefill", path="cross_memory")
        assert opened == len(reqs), opened
        counted = metric_sum(url, "pdserve_kv_transfer_writes_per_layer_count", role="prefill")
        writes = metric_sum(url, "pdserve_kv_transfer_writes_per_layer_sum", role="prefill")
        # (the bound in runs: tests/e2e/test_kv_transfer_tp.py, on a deliberately scattered pool)
        assert counted == len(reqs) and writes >= counted, (counted, writes)
        # The group's rank 0 exports each rank's process figures, labelled by rank.
        group = next(w for w in c.workers() if w["tensor_parallel_size"] == 2)
        for rank in ("0", "1"):
            cpu = metric_sum(group["metrics_url"], "pdserve_tp_rank_cpu_seconds_total", rank=rank)
            memory = metric_sum(group["metrics_url"], "pdserve_tp_rank_resident_memory_bytes", rank=rank)
            assert cpu > 0 and memory > 0, (rank, cpu, memory)
        c.assert_no_leaks()


def test_a_dead_rank_of_a_decode_or_prefill_group_loses_no_request(tmp_path, tiny_served_model):
    """2P+2D, every worker a group of two (P=2 -> D=2: each rank's heads into the same rank's cache), every
    KV layer sent 1 s late. SIGKILL of a decode group's follower under 8 streams: that worker stops, its
    streams re-prefill and go on elsewhere with the undisturbed tokens. Then SIGKILL of a prefill group's
    follower while its transfers are in flight: no request is lost. Neither broken worker leaves a process
    behind; the survivors end holding no KV block."""
    from tests.e2e.cluster_harness import run_all, running_cluster, streaming, wait_until, worker_load

    rng = torch.Generator().manual_seed(4)

    def requests(prefix: str, n: int, prompt: int, tokens: int):
        from pdserve.proto import generation_pb2

        out = []
        for i in range(n):
            ids = torch.randint(100, 4000, (prompt + 7 * i,), generator=rng).tolist()
            r = generation_pb2.GenerateRequest(request_id=f"{prefix}-{i}", prompt_token_ids={"ids": ids})
            r.sampling.max_tokens, r.sampling.temperature, r.sampling.ignore_eos = tokens, 0.0, True
            out.append(r)
        return out

    def gone(p: psutil.Process) -> bool:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE

    def kill_follower(worker: dict) -> tuple[psutil.Process, psutil.Process]:
        rank0 = psutil.Process(c.worker_pid(worker["id"]))
        (follower,) = _followers_of(rank0.pid)
        follower.kill()
        return rank0, follower

    extra = (
        *("--prefill-tp", "2", "--decode-tp", "2", "--local-prefill-threshold", "1"),
        *("--heartbeat-timeout", "15", "--fault-step-delay", "0.01", "--kv-fault-delay", "1"),
    )
    with running_cluster(tmp_path, prefill=2, decode=2, model=tiny_served_model, extra=extra) as c:
        meta = c.token_metadata()
        workers = c.workers()
        decoders = [w for w in workers if w["role"] == "decode"]
        prefills = [w for w in workers if w["role"] == "prefill"]
        reqs = requests("d", 8, 40, 300)
        want = run_all(c.address, reqs)
        with streaming(c, reqs, after=4) as streams:
            assert streams.wait_streaming(120)
            victim_d = max(decoders, key=lambda w: worker_load(w["address"], meta).running)
            dead_d = kill_follower(victim_d)
            streams.join(180)
        assert not streams.errors, streams.errors
        assert {r: streams.got[r] for r in want} == {r: t for r, (t, _, _) in want.items()}
        wait_until(lambda: all(map(gone, dead_d)), 60, "the broken decode group to exit")

        long_reqs = requests("p", 6, 600, 16)
        with streaming(c, long_reqs, after=1) as streams:
            assert streams.wait_streaming(120)  # token 0 out: the transfers wait their second
            victim_p = max(prefills, key=lambda w: worker_load(w["address"], meta).kv_blocks_used)
            assert worker_load(victim_p["address"], meta).kv_blocks_used > 0
            dead_p = kill_follower(victim_p)
            streams.join(180)
        assert not streams.errors, streams.errors
        assert all(len(streams.got[r.request_id]) == 16 for r in long_reqs)
        wait_until(lambda: all(map(gone, dead_p)), 60, "the broken prefill group to exit")
        survivors = [w["id"] for w in workers if w["id"] not in (victim_d["id"], victim_p["id"])]
        c.assert_no_leaks(workers=survivors)


def test_a_drained_group_moves_its_streams_live_into_one_process(tmp_path, tiny_served_model):
    """A decode group of two and a colocated single-process worker, 8 streams over both: draining the group
    moves each of its streams live (its two ranks' heads into the one cache), none re-prefilled, every
    stream with its undisturbed tokens; the group's processes exit and the survivor holds no block."""
    from tests.e2e.cluster_harness import metric_sum, run_all, running_cluster, streaming, wait_until
    from tests.e2e.test_live_migration_e2e import _drain, _requests

    extra = (
        *("--decode-tp", "2", "--heartbeat-timeout", "15", "--fault-step-delay", "0.01"),
        *("--local-prefill-threshold", "100000", "--no-rebalance"),
    )
    with running_cluster(tmp_path, decode=1, colocated=1, model=tiny_served_model, extra=extra) as c:
        group = next(w for w in c.workers() if w["role"] == "decode")
        assert group["tensor_parallel_size"] == 2
        want = run_all(c.address, _requests("ref", 300)[:8])
        reqs = _requests("mv", 300)[:8]
        router_metrics = c.status()["router"]["metrics_url"]
        rank0 = psutil.Process(c.worker_pid(group["id"]))
        (follower,) = _followers_of(rank0.pid)
        with streaming(c, reqs, after=8) as streams:
            assert streams.wait_streaming(120)
            _drain(c, group["id"])
            streams.join(180)
        assert not streams.errors, streams.errors
        for r in reqs:
            assert streams.got[r.request_id] == want["ref-" + r.request_id.split("-", 1)[1]][0], r.request_id
        moved = metric_sum(router_metrics, "pdserve_router_live_moves_total", outcome="moved")
        assert moved > 0 and metric_sum(router_metrics, "pdserve_router_migrations_total") == 0, moved

        def gone(p: psutil.Process) -> bool:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE

        wait_until(lambda: gone(rank0) and gone(follower), 60, "the group to exit")
        c.assert_no_leaks(workers=[w["id"] for w in c.workers() if w["id"] != group["id"]])
