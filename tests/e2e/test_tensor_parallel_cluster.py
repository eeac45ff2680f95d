"""Tensor-parallel workers in a cluster: groups of each role serving through the router, pools of different
sizes with the KV moved head slice by head slice, a dead rank, drain and scale acting on a group.

Exactness rule as in test_tensor_parallel.py: greedy tokens are compared with one process's up to the
first step whose top-2 reference logits are within 1e-5 (``first_near_tie`` there).
"""

from __future__ import annotations

import psutil
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.e2e.test_tensor_parallel import first_near_tie, greedy_requests
from tests.unit.test_llm import prompts_of
from tests.unit.test_prefix_cache import generate_with_logits


def gone(p: psutil.Process) -> bool:
    """The process exited (or is a zombie its parent has not reaped yet)."""
    return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


def _followers_of(pid: int) -> list[psutil.Process]:
    children = psutil.Process(pid).children()
    return [p for p in children if "pdserve.engine.tp_follower" in " ".join(p.cmdline())]


def test_colocated_groups_serve_scale_and_drain_as_groups(tmp_path, tiny_served_model):
    """`up --colocated 1 --colocated-tp 2`: one worker of two processes, shown as such by `status`, serving
    one process's greedy tokens through the router. `scale --colocated 2` adds a second group; `drain` of
    the first ends both its processes while the second serves on, and the survivor holds no KV block. (A
    dead rank of a serving group: test_a_dead_rank_of_a_decode_or_prefill_group_loses_no_request.)"""
    from tests.e2e.cluster_harness import pdserve, run_all, running_cluster, wait_until

    prompts = prompts_of([12, 45, 80, 30], seed=13, vocab=4000)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(tiny_served_model, dtype="float32", threads=1, num_blocks=64)
    want, want_logits = generate_with_logits(one, prompts, params)
    del one

    def served_as_one_process(prefix: str) -> None:
        reqs = greedy_requests(prefix, prompts, 16)
        got = run_all(c.address, reqs)
        for r, w, wl in zip(reqs, want, want_logits, strict=True):
            n = first_near_tie(wl)
            assert n > len(wl) // 2, "too many near ties to compare: pick other prompts"
            assert got[r.request_id][0][:n] == w.outputs[0].token_ids[:n], r.request_id

    extra = ("--colocated-tp", "2", "--heartbeat-timeout", "15")
    with running_cluster(tmp_path, colocated=1, model=tiny_served_model, extra=extra) as c:
        (first,) = c.workers()
        assert (first["role"], first["tensor_parallel_size"]) == ("both", 2)
        rank0 = psutil.Process(c.worker_pid(first["id"]))
        (follower,) = _followers_of(rank0.pid)
        assert first["rank_pids"] == [rank0.pid, follower.pid]
        served_as_one_process("a")

        # Scale and drain act on a group: the new worker is a group of two, and a drain ends both processes.
        pdserve("scale", "--colocated", "2", "--state-dir", str(c.state_dir), timeout=120)
        (second,) = [w for w in c.workers() if w["id"] != first["id"]]
        assert second["tensor_parallel_size"] == 2, second
        state_dir = str(c.state_dir)
        pdserve("drain", "--worker-id", first["id"], "--state-dir", state_dir, "--timeout", "60", timeout=90)
        wait_until(lambda: gone(rank0) and gone(follower), 30, "the drained group to exit")
        served_as_one_process("b")
        c.assert_no_leaks(workers=[second["id"]])


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_pools_of_different_sizes_give_one_process_tokens(tmp_path, tiny_served_model, prefill_tp, decode_tp):
    """`up --prefill-tp P --decode-tp D` (the tiny model: 2 KV heads): every prompt prefilled by the prefill
    group reaches the decode group head slice by head slice, and the greedy tokens through the router are
    one process's (compared up to the first near tie of its logits). The decode side's blocks are as the
    pool allocates them; the prefill side reports its writes per layer, at most ranks x ranks x runs."""
    from tests.e2e.cluster_harness import metric_sum, run_all, running_cluster

    prompts = prompts_of([20, 70, 130, 33, 250, 90], seed=11, vocab=4000)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = LLM(tiny_served_model, dtype="float32", threads=1, num_blocks=128)
    want, want_logits = generate_with_logits(one, prompts, params)
    del one
    reqs = greedy_requests("tp", prompts, 24)
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
            n = first_near_tie(wl)
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
        prompts = [torch.randint(100, 4000, (prompt + 7 * i,), generator=rng).tolist() for i in range(n)]
        return greedy_requests(prefix, prompts, tokens)

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

        wait_until(lambda: gone(rank0) and gone(follower), 60, "the group to exit")
        c.assert_no_leaks(workers=[w["id"] for w in c.workers() if w["id"] != group["id"]])
