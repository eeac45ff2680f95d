"""Live migration on a real local cluster (the tiny served model, float32, UCX on loopback): a drained
worker's decoding streams move with their KV to the other workers, and every client gets exactly the
tokens of an undisturbed run, with no gap or duplicate; nothing moves by re-prefill, the destinations
prefill none of the moved tokens, and every survivor ends holding no KV block."""

from __future__ import annotations

import random
import time

import pytest

from pdserve.proto import generation_pb2
from tests.e2e.cluster_harness import (
    Cluster,
    metric_sum,
    migrations,
    run_all,
    running_cluster,
    streaming,
    wait_until,
    worker_load,
)

pytestmark = pytest.mark.slow

_MAX_TOKENS = 600  # long enough to be mid-stream when the drain comes, within the tiny model's 2,048


def _requests(prefix: str, max_tokens: int = _MAX_TOKENS) -> list[generation_pb2.GenerateRequest]:
    """8 greedy and 8 seeded streams of short prompts (prefilled on the decode workers themselves)."""
    rng = random.Random(7)
    reqs = []
    for i in range(16):
        r = generation_pb2.GenerateRequest(
            request_id=f"{prefix}-{i}",
            prompt_token_ids=generation_pb2.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(24 + i)]),
        )
        r.sampling.max_tokens = max_tokens
        r.sampling.ignore_eos = True
        if i % 2:
            r.sampling.temperature = 0.9
            r.sampling.seed = 1000 + i
        else:
            r.sampling.temperature = 0.0
        reqs.append(r)
    return reqs


def _drain(c: Cluster, worker_id: str) -> None:
    """Drain a worker through the router (what `pdserve drain` asks, without its process start) and wait
    until it has left."""
    import grpc

    from pdserve.proto import worker_pb2, worker_pb2_grpc

    meta = c.token_metadata()
    with grpc.insecure_channel(c.address) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        stub.DrainWorker(worker_pb2.DrainWorkerRequest(worker_id=worker_id), timeout=30, metadata=meta)

        def left() -> bool:
            status = stub.GetClusterStatus(worker_pb2.Empty(), timeout=10, metadata=meta)
            return worker_id not in {e.info.worker_id for e in status.workers}

        wait_until(left, 60, f"{worker_id} to leave")


def _prefilled(c: Cluster, worker: dict) -> float:
    return metric_sum(worker["metrics_url"], "pdserve_prefill_tokens_total")


def test_drain_moves_every_stream_live_with_exact_tokens(tmp_path, tiny_served_model):
    """A decode-only and a colocated worker drained at once, 8 greedy and 8 seeded streams over the three
    workers: every stream of the two moves live to the third. The workers speculate with the draft (it
    proposes at every step), so streams move between verify steps and go on speculating where they land."""
    import threading

    # 10 ms a step: no stream ends on its own before its worker's drain moves it, however fast the host.
    extra = (
        *("--max-running", "32", "--heartbeat-timeout", "15", "--speculative", "draft"),
        *("--fault-step-delay", "0.01"),
    )
    with running_cluster(tmp_path, decode=1, colocated=2, model=tiny_served_model, extra=extra) as c:
        ref = run_all(c.address, _requests("ref"))
        reqs = _requests("moved")
        doc = c.status()
        live, router_metrics = doc["workers"], doc["router"]["metrics_url"]
        meta = c.token_metadata()
        with streaming(c, reqs, after=8) as streams:
            assert streams.wait_streaming(120)
            loads = {w["id"]: worker_load(w["address"], meta).running for w in live}
            both = sorted((w for w in live if w["role"] == "both"), key=lambda w: loads[w["id"]])
            sources = [next(w for w in live if w["role"] == "decode"), both[-1]]
            (stays,) = [w for w in live if w not in sources]
            assert all(loads[w["id"]] > 0 for w in sources), loads
            prefilled = _prefilled(c, stays)
            started = time.monotonic()
            drains = [threading.Thread(target=_drain, args=(c, w["id"])) for w in sources]
            for t in drains:
                t.start()
            for t in drains:
                t.join(90)
            drained_s = time.monotonic() - started
            streams.join(180)
        assert not streams.errors, streams.errors
        for r in reqs:
            tokens = streams.got[r.request_id]
            assert len(tokens) == _MAX_TOKENS, (r.request_id, len(tokens))
            assert tokens == ref["ref-" + r.request_id.split("-", 1)[1]][0], r.request_id
        assert drained_s < 30, drained_s  # the streams moved: the drains did not wait for their tokens
        assert _prefilled(c, stays) == prefilled, "the destination prefilled moved tokens"
        moved = metric_sum(router_metrics, "pdserve_router_live_moves_total", outcome="moved")
        assert moved >= sum(loads[w["id"]] for w in sources), (moved, loads)
        re_prefilled = metric_sum(router_metrics, "pdserve_router_migrations_total")
        assert re_prefilled == 0, migrations(c)  # no re-prefill fallback
        print(f"\ntwo workers drained in {drained_s:.2f}s, {moved:.0f} streams moved live")
        c.assert_no_leaks()


def _reserving(c: Cluster, candidates: list[dict]) -> dict | None:
    """A worker of ``candidates`` holding a reservation a moving stream's KV is being written into."""
    meta = c.token_metadata()
    for w in candidates:
        try:
            if worker_load(w["address"], meta).queued > 0:
                return w
        except Exception:  # noqa: BLE001 - a worker that just left holds nothing
            continue
    return None


def _wait_reserving(c: Cluster, candidates: list[dict], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = _reserving(c, candidates)
        if w is not None:
            return w
        time.sleep(0.05)
    # What the router did instead (moves declined or failed, streams re-prefilled, workers lost).
    router_metrics = c.status()["router"]["metrics_url"]
    moves = {
        outcome: metric_sum(router_metrics, "pdserve_router_live_moves_total", outcome=outcome)
        for outcome in ("moved", "declined", "failed")
    }
    raise AssertionError(
        f"no move started writing within {timeout_s}s: live moves {moves}, re-prefilled "
        f"{metric_sum(router_metrics, 'pdserve_router_migrations_total')}, workers {c.workers()}"
    )


def test_moves_survive_a_killed_destination_a_killed_source_and_a_flipped_byte(tmp_path, tiny_served_model):
    """Four colocated workers and 4 streams, every KV layer written 2 s late and each worker's first
    transfer with a byte flipped in flight (its check fails, the stream stays and moves on the next try).
    A drain whose destination is SIGKILLed mid-write: the streams stay on the source and move later. A
    drain whose source is SIGKILLed mid-write: the streams move by re-prefill. Every client gets the
    undisturbed tokens and every survivor ends holding no KV block. The workers speculate with the draft,
    so the kills land between or inside verify steps."""
    import os
    import signal
    import threading

    # (The killed workers are seen dead by their calls at once; a heartbeat timeout ends the last wait. It
    # is long enough that a worker starved of CPU on a loaded host is not taken for dead meanwhile.)
    # Every engine step waits 10 ms: the streams are mid-way when the drain comes however fast the host (a
    # tiny-model token takes a millisecond; streams that start a second apart could end before it).
    extra = (
        *("--max-running", "32", "--heartbeat-timeout", "15", "--fault-step-delay", "0.01"),
        *("--kv-fault-delay", "2", "--kv-fault-corrupt-transfers", "1"),
        *("--speculative", "draft", "--num-speculative-tokens", "2"),
    )
    with running_cluster(tmp_path, colocated=4, model=tiny_served_model, extra=extra) as c:
        want = run_all(c.address, _requests("ref", 600)[:4])
        for victim in ("destination", "source"):
            t0 = time.monotonic()
            reqs = _requests(victim, 600)[:4]
            live = c.workers()
            meta = c.token_metadata()
            with streaming(c, reqs, after=8) as streams:
                assert streams.wait_streaming(120)
                loads = {w["id"]: worker_load(w["address"], meta).running for w in live}
                source = max(live, key=lambda w: loads[w["id"]])
                others = [w for w in live if w["id"] != source["id"]]
                drain = threading.Thread(target=_drain, args=(c, source["id"]))
                drain.start()
                try:
                    dest = _wait_reserving(c, others, 120)
                    killed = dest if victim == "destination" else source
                    assert killed is not None
                    os.kill(c.worker_pid(killed["id"]), signal.SIGKILL)
                finally:
                    drain.join(150)
                streams.join(180)
            assert not streams.errors, streams.errors
            for r in reqs:
                key = "ref-" + r.request_id.split("-", 1)[1]
                assert streams.got[r.request_id] == want[key][0], r.request_id
            print(f"\n{victim} killed mid-write: every stream exact ({time.monotonic() - t0:.1f}s)")
        doc = c.status()
        router_metrics = doc["router"]["metrics_url"]
        failed = metric_sum(router_metrics, "pdserve_router_live_moves_total", outcome="failed")
        assert failed >= 2, failed  # the checksum and the killed destination failed moves
        checks = sum(
            metric_sum(w["metrics_url"], "pdserve_kv_transfer_failures_total", reason="checksum")
            for w in doc["workers"]
        )
        print(f"live moves failed: {failed:.0f}; checksum failures on the survivors: {checks:.0f}")
        c.assert_no_leaks()
