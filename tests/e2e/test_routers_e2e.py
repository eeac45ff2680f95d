"""Several routers over one set of workers (`pdserve up --routers 3`, 1P+2D, the tiny served model): every
router sees every worker; a SIGKILL of one (the first) costs only its own streams; a SIGTERM drains one
with nothing lost; scale and drain keep working through the routers left; workers cap what several routers
admit into them together. Every case ends with the leak check."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import time

import grpc
import pytest

from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2, generation_pb2_grpc
from pdserve.worker.dial import router_channel
from pdserve.worker.tls import NO_TLS
from tests.e2e.cluster_harness import (
    Cluster,
    ThreadedStreams,
    metric_sum,
    pdserve,
    run_all,
    running_cluster,
    wait_until,
)

pytestmark = pytest.mark.slow

# Prompts of 16 tokens prefill on the decode worker, of 96 on the prefill worker: both routes. Each router
# sends a decode worker up to 8 requests; the worker itself holds no more than 8 (no queue), whoever sent.
# A SIGTERMed router lets its streams (1,000 tokens each, below) run to their end however slow the host.
# Every engine step waits 10 ms, so a burst's requests overlap however fast the host.
FLAGS = (
    "--routers", "3", "--local-prefill-threshold", "64", "--max-running", "8", "--max-queued", "0",
    "--shutdown-grace", "300", "--fault-step-delay", "0.01",
)  # fmt: skip


def _prompts(n: int, seed: int, prefix: str, max_tokens: int = 100):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = 16 if i % 2 else 96
        r = generation_pb2.GenerateRequest(
            request_id=f"{prefix}-{i}",
            prompt_token_ids=generation_pb2.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(length)]),
        )
        r.sampling.max_tokens = max_tokens
        r.sampling.temperature = 0.0
        r.sampling.ignore_eos = True
        reqs.append(r)
    return reqs


def _renamed(reqs, prefix: str):
    out = []
    for i, r in enumerate(reqs):
        c = generation_pb2.GenerateRequest()
        c.CopyFrom(r)
        c.request_id = f"{prefix}-{i}"
        out.append(c)
    return out


def _long(reqs, max_tokens: int = 1000):
    """``reqs`` asking for ``max_tokens``: streams still running when the test stops their router, however
    slow the host (a stream's first tokens equal the shorter run's: greedy)."""
    for r in reqs:
        r.sampling.max_tokens = max_tokens
    return reqs


STREAM_S = 300  # a bound on a whole stream (1,000 tokens), not a latency check


def _start(address: str, reqs) -> tuple[grpc.Channel, ThreadedStreams]:
    ch = grpc.insecure_channel(address)
    return ch, ThreadedStreams(generation_pb2_grpc.GenerationStub(ch), reqs, after=4, timeout=STREAM_S)


@pytest.fixture(scope="module")
def three_routers(tmp_path_factory, tiny_served_model):
    with running_cluster(
        tmp_path_factory.mktemp("routers"), prefill=1, decode=2, model=tiny_served_model, extra=FLAGS
    ) as c:
        yield c


def test_two_routers_admitting_at_once_never_overcommit_a_worker(three_routers: Cluster):
    """Two routers, each free to send a decode worker 8 requests, 40 requests at once: each worker refuses
    what would exceed its --max-running plus --max-queued, the routers route those again, every request
    ends with all its tokens, and nothing is preempted. (First in the module: every router runs.)"""
    c = three_routers
    doc = c.status()
    assert len(doc["routers"]) == 3 and all(r["workers"] == 3 for r in doc["routers"]), doc["routers"]
    routers = [r["address"] for r in doc["routers"]]
    reqs = _prompts(40, seed=9, prefix="burst", max_tokens=24)
    with cf.ThreadPoolExecutor(2) as pool:
        halves = [pool.submit(run_all, routers[i], reqs[i::2]) for i in range(2)]
        got = {k: v for h in halves for k, v in h.result().items()}
    assert all(len(ids) == 24 and reason == "length" for ids, _, reason in got.values()), got
    decoders = [w for w in doc["workers"] if w["role"] == "decode"]
    refused = sum(
        metric_sum(w["metrics_url"], "pdserve_worker_requests_refused_full_total") for w in decoders
    )
    preempted = sum(metric_sum(w["metrics_url"], "pdserve_decode_preemptions_total") for w in decoders)
    assert refused > 0 and preempted == 0, (refused, preempted)
    c.assert_no_leaks(timeout_s=15)


def test_one_router_lost_costs_only_its_own_streams_and_the_rest_carries_on(three_routers: Cluster):
    """SIGKILL of the first router under 16 streams split with the second: the second's end with the
    undisturbed tokens, a new request through the round-robin channel is served; SIGTERM of the third
    drains its streams; scale and drain work through the router left."""
    c = three_routers
    state = cluster.load_state(c.state_dir)
    assert state is not None
    killed, kept, drained = state.routers()
    routers = [a for a, _ in state.routers()]

    base = _prompts(16, seed=3, prefix="ref")
    undisturbed = run_all(kept[0], base)
    want = {i: undisturbed[r.request_id][0] for i, r in enumerate(base)}

    on_killed, on_kept = _long(_renamed(base[:8], "k")), _renamed(base[8:], "s")
    ch_a, lost = _start(killed[0], on_killed)
    ch_b, survive = _start(kept[0], on_kept)
    try:
        assert lost.wait_streaming(120) and survive.wait_streaming(120)
        os.kill(killed[1].pid, signal.SIGKILL)
        # A new request through one channel over all three routers: the dead one's connection fails, the
        # pick (and a retry, were the call already on it) goes to the others.
        short = _renamed(base[:1], "after-kill")[0]
        short.sampling.max_tokens = 2
        with router_channel(",".join(routers), NO_TLS) as ch:
            began = time.monotonic()
            new = list(generation_pb2_grpc.GenerationStub(ch).Generate(short, timeout=10))
            after_kill_s = time.monotonic() - began
        survive.join(STREAM_S)
        lost.join(STREAM_S)
    finally:
        ch_a.close()
        ch_b.close()
    assert not survive.errors, survive.errors
    assert lost.errors  # (the killed router's own streams end with it: it was mid-stream)
    assert {r.request_id: survive.got[r.request_id] for r in on_kept} == {
        r.request_id: want[8 + i] for i, r in enumerate(on_kept)
    }
    assert new[-1].finish_reason == "length", new
    print(f"a new request after the kill took {after_kill_s:.3f} s")

    # SIGTERM of the third router with 8 streams in flight: it drains them, then exits.
    on_drained = _long(_renamed(base[:8], "d"))
    ch, drain = _start(drained[0], on_drained)
    try:
        assert drain.wait_streaming(120)
        os.kill(drained[1].pid, signal.SIGTERM)
        termed = time.monotonic()
        drain.join(STREAM_S)
    finally:
        ch.close()
    assert not drain.errors, drain.errors
    assert max(t[-1] for t in drain.at.values()) > termed  # (it was streaming when told to stop)
    assert all(len(drain.got[r.request_id]) == 1000 for r in on_drained)
    assert {r.request_id: drain.got[r.request_id][:100] for r in on_drained} == {
        r.request_id: want[i] for i, r in enumerate(on_drained)
    }
    wait_until(lambda: not cluster.alive(drained[1]), 30, "the drained router to exit")

    # The first router dead and the third gone: scale and drain work through the one left.
    out = pdserve("scale", "--decode", "3", "--state-dir", str(c.state_dir), timeout=120)
    assert "3 decode" in out.stdout + out.stderr, out.stderr
    state = cluster.load_state(c.state_dir)
    assert state is not None
    newest = state.workers[-1].id
    pdserve("drain", "--worker-id", newest, "--state-dir", str(c.state_dir), "--timeout", "60", timeout=90)
    assert run_all(kept[0], _renamed(base[:1], "last"))["last-0"][0] == want[0]
    c.assert_no_leaks(timeout_s=15)
    assert newest not in {w["id"] for w in c.workers()}
