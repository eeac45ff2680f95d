"""The time-to-first-token budget of admission: the prediction (pure) and the router refusing at once what
would miss it, with a retry hint, while what fits is served (fake workers)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.proto import generation_pb2 as g
from pdserve.router.budget import predict_ttft, retry_after_s
from pdserve.router.policy import Route
from pdserve.router.registry import Worker
from pdserve.worker.role import Role
from tests.fake_workers import FakeWorker, Transfers, ids, make_model_dir
from tests.unit.test_router_server import cluster, collect, run, until


def mk(wid: str, role: Role, rate: float, queued: int = 0, assigned: int = 0) -> Worker:
    w = Worker(wid, role, f"127.0.0.1:{wid}", 100, 16, 8)
    w.prefill_tokens_per_s, w.queued_prefill_tokens, w.assigned_prefill_tokens = rate, queued, assigned
    return w


def test_prediction_counts_the_queue_ahead_and_the_uncached_prompt_on_the_worker_that_prefills():
    d, p = mk("d", Role.DECODE, 500.0), mk("p", Role.PREFILL, 1000.0, queued=1500, assigned=800)
    pred = predict_ttft(Route(d, p, prefill_cached_tokens=200), 700)
    assert pred is not None
    # The larger of the heartbeat's queue and the router's own count (not their sum), then its 500 uncached.
    assert (pred.tokens_ahead, pred.own_tokens, pred.seconds) == (1500, 500, 2.0)
    assert retry_after_s(pred, 0.5) == 2 and retry_after_s(pred, 5.0) == 1
    # A local prefill: the decode worker's queue, rate and cache.
    local = predict_ttft(Route(d, None, decode_cached_tokens=100), 600)
    assert local is not None and local.seconds == 1.0
    # No rate measured yet: no prediction (the request is admitted).
    assert predict_ttft(Route(mk("d2", Role.DECODE, 0.0), None), 600) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("budget-model"))


def test_a_burst_past_the_budget_is_refused_at_once_and_the_rest_served(model_dir):
    async def main():
        transfers = Transfers()
        p = FakeWorker("p1", Role.PREFILL, [5, 6], transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, [5, 6], transfers=transfers)
        p.prefill_rate = 10.0  # tokens/s: 6-token prompts predict 0.6 s each
        p.prefill_gate = asyncio.Event()  # the prefill worker holds them: its queue grows
        cfg = dict(local_prefill_threshold=2, admission_ttft_s=2.0, max_prefill_queue_tokens=0)
        async with cluster(model_dir, [p, d], **cfg) as (server, stub):
            await until(lambda: any(w.prefill_tokens_per_s for w in server.router.registry), what="a rate")

            def req(i: int) -> g.GenerateRequest:
                prompt = g.TokenIds(ids=ids("the cat sat on the mat"))
                return g.GenerateRequest(prompt_token_ids=prompt, sampling=g.SamplingParams(max_tokens=2))

            admitted = []
            for i in range(3):  # 0.6, 1.2, 1.8 s predicted: within 2 s
                admitted.append(stub.Generate(req(i)))
                await p.wait_for(lambda n=i + 1: len(p.requests) == n)
            t0 = time.monotonic()
            refused = stub.Generate(req(9))  # 2.4 s: over
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(refused)
            assert time.monotonic() - t0 < 1.0  # at once, not after a wait
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "over the budget of 2s" in info.value.details()
            trailer = dict(info.value.trailing_metadata() or ())
            assert trailer.get("grpc-retry-pushback-ms") == "1000"
            # Its own deadline tightens the budget: 1.8 s predicted, over a 1 s deadline.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub.Generate(req(10), timeout=1.0))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            p.prefill_gate.set()
            for call in admitted:
                tokens, _, _ = await collect(call)
                assert tokens == [5, 6]
            m = server.router.metrics
            refusals = m.registry.get_sample_value(
                "pdserve_router_admission_refused_total", {"role": "router", "reason": "ttft_budget"}
            )
            assert refusals == 2
            ratios = m.registry.get_sample_value(
                "pdserve_router_ttft_prediction_ratio_count", {"role": "router"}
            )
            assert ratios == 3  # each admitted request's actual TTFT went against its prediction

    run(main())
