"""The TTFT budget across processes (``pdserve up --admission-ttft-s``), on a tiny model: with the prefill
worker frozen (SIGSTOP) its queue only grows, so the router's prediction is plain arithmetic on the rate
the worker last reported: a burst is admitted while it fits the budget and refused at once past it, and
every admitted request is served once the worker runs again."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from pdserve.proto import generation_pb2
from tests.e2e.cluster_harness import running_cluster, wait_until

pytestmark = pytest.mark.slow

PROMPT = 1024
FITS = 4  # the budget is sized so that about this many prompts fit it


def _prefill_seconds(model) -> float:  # type: ignore[no-untyped-def]
    """One 1,024-token prefill of the tiny model in this process (best of 3): sizes the budget."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", threads=1, kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    best = float("inf")
    for i in range(3):
        t0 = time.perf_counter()
        llm.generate([[(7 + i + k) % 40000 for k in range(PROMPT)]], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best


def test_a_burst_beyond_the_budget_is_refused_at_once_and_the_rest_served(tmp_path):
    from tests.tiny_models import make_tiny_served_model

    model = make_tiny_served_model("llama", tmp_path / "tiny")
    budget = (FITS + 0.5) * _prefill_seconds(model)
    extra = (
        *("--model", str(model), "--kv-cache-mib", "64", "--local-prefill-threshold", "1"),
        *("--admission-ttft-s", f"{budget:.6f}", "--heartbeat-timeout", "60"),
    )
    with running_cluster(tmp_path, prefill=1, decode=1, extra=extra) as c:

        def req(i: int) -> generation_pb2.GenerateRequest:
            ids = [(1000 + 37 * i + k) % 40000 for k in range(PROMPT)]  # no two share a block
            return generation_pb2.GenerateRequest(
                request_id=f"burst-{i}",
                prompt_token_ids=generation_pb2.TokenIds(ids=ids),
                sampling=generation_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
            )

        with c.channel() as ch:
            for i in range(3):  # the prefill worker measures its rate (the first one: nothing refuses it)
                try:
                    list(c.stub(ch).Generate(req(100 + i), timeout=60, metadata=c.token_metadata()))
                except grpc.RpcError as e:  # a slower worker than this process: its rate may refuse more
                    assert i > 0 and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        wait_until(lambda: _rate(c) > 0, 10, "the prefill worker's rate in a heartbeat")
        pid = c.worker_pid(_prefill(c)["id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            rate = _rate(c)  # frozen with the worker: no forward runs, no heartbeat comes
            fits = int(budget * rate // PROMPT)  # k queued prompts predict k * PROMPT / rate seconds
            burst = fits + 3
            results: dict[int, tuple[object, float]] = {}

            def run(i: int) -> None:
                t0 = time.monotonic()
                with c.channel() as ch:
                    try:
                        got: object = [
                            t
                            for m in c.stub(ch).Generate(req(i), timeout=120, metadata=c.token_metadata())
                            for t in m.token_ids
                        ]
                    except grpc.RpcError as e:
                        got = e
                results[i] = (got, time.monotonic() - t0)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(burst)]
            for t in threads:
                t.start()
            # Every request answered (refused) or admitted and waiting on the frozen worker.
            wait_until(
                lambda: len(results) + c.status()["router"]["requests_running"] == burst,
                30,
                "the burst to be admitted or refused",
            )
            refused_early = dict(results)
        finally:
            os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join(120)
        served = [i for i, (r, _) in results.items() if isinstance(r, list)]
        refused = [i for i, (r, _) in results.items() if isinstance(r, grpc.RpcError)]
        for i in refused:
            err = results[i][0]
            assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "over the budget" in err.details()
            assert i in refused_early  # refused while the worker was frozen: at once, not after waiting
        assert all(len(results[i][0]) == 2 for i in served)  # type: ignore[arg-type]
        assert len(served) + len(refused) == burst
        assert abs(len(served) - fits) <= 1, (fits, rate, budget, results)
        assert len(refused) >= 2
        c.assert_no_leaks()


def _prefill(c) -> dict:  # type: ignore[no-untyped-def]
    (p,) = [w for w in c.status()["workers"] if w["role"] == "prefill"]
    return p


def _rate(c) -> float:  # type: ignore[no-untyped-def]
    return float(_prefill(c)["prefill_tokens_per_s"])
