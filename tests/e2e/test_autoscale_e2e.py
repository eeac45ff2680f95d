"""Autoscaling end to end: a 1P+1D cluster under `pdserve up --autoscale` (min 1, max 2 per pool,
one warm worker per pool) and a load ramp on each pool in turn.

Long prompts grow the prefill pool (and only it); once their load stops, it shrinks back by draining.
Short prompts with long answers then grow the decode pool, which shrinks back the same way. Every request
completes (0 failed), the decisions are in the autoscaler's /metrics with their reasons, the scale-ups
came from the warm pool in under a second each (decision to routed), and the test ends with the leak
check. Short intervals and cooldowns are given as flags.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.local import autoscaler as autoscaler_mod
from pdserve.proto import generation_pb2, generation_pb2_grpc
from tests.e2e.cluster_harness import generate, running_cluster

pytestmark = pytest.mark.slow

FLAGS = (
    "--autoscale",
    "--prefill-min", "1", "--prefill-max", "2", "--decode-min", "1", "--decode-max", "2",
    "--warm", "1",
    "--autoscale-interval", "0.3",
    "--scale-up-after", "2",
    "--scale-down-after", "4",
    "--scale-up-cooldown", "1",
    "--scale-down-cooldown", "2",
    "--prefill-tokens-high", "1000",
    "--prefill-tokens-low", "100",
    "--running-high", "0.75",
    "--running-low", "0.3",
    # Latency SLOs out of the way on a shared 2-core machine: the load signals decide here.
    "--ttft-slo", "120", "--itl-slo", "30",
    "--max-running", "8",
    "--heartbeat-interval", "0.2", "--heartbeat-timeout", "5",
)  # fmt: skip


def _request(
    rid: str, prompt_len: int, max_tokens: int, rng: random.Random
) -> generation_pb2.GenerateRequest:
    r = generation_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=generation_pb2.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(prompt_len)]),
    )
    r.sampling.max_tokens = max_tokens
    r.sampling.temperature = 0.0
    r.sampling.ignore_eos = True
    return r


def _ramp(address, name, clients, prompt_len, max_tokens, until, timeout_s) -> list[tuple[str, int]]:
    """``clients`` threads send requests back to back until ``until()`` holds; returns (finish, tokens)."""
    stop = threading.Event()
    results: list[tuple[str, int]] = []

    def client(k: int) -> None:
        rng = random.Random(k)
        with grpc.insecure_channel(address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            i = 0
            while not stop.is_set():
                ids, _, reason, _ = generate(
                    stub, _request(f"{name}-{k}-{i}", prompt_len, max_tokens, rng), 120
                )
                results.append((reason, len(ids)))
                i += 1

    with cf.ThreadPoolExecutor(clients) as pool:
        futs = [pool.submit(client, k) for k in range(clients)]
        give_up = time.monotonic() + timeout_s
        try:
            while not until():
                assert time.monotonic() < give_up, f"{name}: the pool did not grow within {timeout_s}s"
                assert not any(f.done() for f in futs), [f.exception() for f in futs if f.done()]
                time.sleep(0.2)
        finally:
            stop.set()
        for f in futs:
            f.result()  # a failed request raises here
    return results


def _pools(state_dir):
    doc = autoscaler_mod.load_status(state_dir)
    return {} if doc is None else doc.pools


def _wait(cond, timeout_s: float, what: str) -> None:
    give_up = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < give_up, what
        time.sleep(0.2)


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_each_pool_grows_under_its_load_and_shrinks_back_by_draining(tmp_path):
    with running_cluster(tmp_path, prefill=1, decode=1, extra=FLAGS) as c:
        sd = c.state_dir
        _wait(lambda: _pools(sd).get("decode") is not None, 30, "the autoscaler reported nothing")

        def serving(pool: str, n: int, standby: int | None = None):
            def check() -> bool:
                p = _pools(sd).get(pool)
                return (
                    p is not None
                    and p.serving == n
                    and not p.draining
                    and not p.starting
                    and (standby is None or p.standby == standby)
                )

            return check

        _wait(serving("prefill", 1, standby=1), 60, "prefill's warm worker")
        _wait(serving("decode", 1, standby=1), 60, "decode's warm worker")
        t_a = time.time()
        # Phase A: long prompts, 2 tokens each -> prefill work queues.
        a = _ramp(c.address, "long-prompt", 3, 700, 2, serving("prefill", 2), 60)
        _wait(serving("prefill", 1), 60, "prefill did not shrink back")
        t_b = time.time()
        # Phase B: short prompts (prefilled on the decode worker), long answers -> the decode batch fills.
        b = _ramp(c.address, "long-answer", 10, 16, 48, serving("decode", 2), 60)
        _wait(serving("decode", 1), 60, "decode did not shrink back")
        # The warm pool is refilled for both pools before the leak check asks every worker.
        _wait(serving("prefill", 1, standby=1), 90, "prefill's replacement standby")
        _wait(serving("decode", 1, standby=1), 90, "decode's replacement standby")

        # 0 failed: every request ran to its length.
        assert a and b
        assert all(r == ("length", 2) for r in a), a
        assert all(r == ("length", 48) for r in b), b

        doc = autoscaler_mod.load_status(sd)
        assert doc is not None
        ups = [(d.time_unix, d.pool, d.reason) for d in doc.decisions if d.direction == "up"]
        downs = [(d.pool, d.reason) for d in doc.decisions if d.direction == "down"]
        # The stressed pool grew first, and only it: prefill in phase A, decode in phase B.
        assert [(p, r) for t, p, r in ups if t_a <= t < t_b] == [("prefill", "queued_prefill_tokens")], ups
        # Phase B's load reads as a full batch or as requests waiting at the router for one: which a tick
        # sees first depends on when the decode worker's heartbeat lands (seen both ways on 2 cores).
        after_b = [(p, r) for t, p, r in ups if t >= t_b]
        assert len(after_b) == 1 and after_b[0][0] == "decode", ups
        reason_b = after_b[0][1]
        assert reason_b in ("running_batch", "router_queue"), ups
        assert sorted(downs) == [("decode", "idle"), ("prefill", "idle")], downs

        m = _samples(doc.metrics_url)
        for pool, direction, reason in (
            ("prefill", "up", "queued_prefill_tokens"),
            ("prefill", "down", "idle"),
            ("decode", "up", reason_b),
            ("decode", "down", "idle"),
        ):
            key = (
                "pdserve_autoscaler_decisions_total",
                (("direction", direction), ("pool", pool), ("reason", reason)),
            )
            assert m.get(key) == 1.0, (key, {k: v for k, v in m.items() if "decisions" in k[0]})
        for pool in ("prefill", "decode"):
            assert m[("pdserve_autoscaler_current_workers", (("pool", pool),))] == 1.0
            assert m[("pdserve_autoscaler_target_workers", (("pool", pool),))] == 1.0
            # Acceptance 2: from the warm pool, decision to routed in under a second.
            labels = (("pool", pool), ("source", "warm"))
            assert m[("pdserve_autoscaler_scale_up_seconds_count", labels)] == 1.0
            assert m[("pdserve_autoscaler_scale_up_seconds_bucket", (("le", "1.0"), *labels))] == 1.0
        # Scale-down drained: no worker had to be stopped by signal.
        log = (sd / "logs" / "autoscaler.log").read_text()
        assert "drain timed out" not in log
        # `pdserve status` shows the autoscaler.
        status = c.status()
        assert status["autoscaler"]["pools"]["decode"]["serving"] == 1
        assert any(w["state"] == "standby" for w in status["workers"])
        # (Bounded wait: a refilled standby may still be registering on a loaded machine.)
        c.assert_no_leaks(timeout_s=30)


def test_an_autoscaler_run_by_hand_owns_the_pools_like_a_background_one(tmp_path):
    """`pdserve autoscale` in the foreground (fake workers, bounds = the current sizes, so it changes
    nothing) puts itself in the state file: `scale` refuses while it runs, `status --json` shows it, and
    `down` stops it first. One stopped by its own SIGTERM takes itself out again, and `scale` works."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from pdserve.deploy.local import cluster
    from tests.e2e.cluster_harness import ROOT, Cluster, free_port, stop_cluster
    from tests.fake_workers import make_model_dir

    state_dir = tmp_path / "state"
    cli = [sys.executable, "-m", "pdserve.cli"]
    sd = ["--state-dir", str(state_dir)]

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*cli, *argv, *sd],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )

    def by_hand() -> subprocess.Popen:
        bounds = ["--prefill-min", "1", "--prefill-max", "1", "--decode-min", "1", "--decode-max", "1"]
        proc = subprocess.Popen(
            [*cli, "autoscale", *bounds, "--autoscale-interval", "0.3", *sd],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        _wait(
            lambda: (
                (s := cluster.load_state(state_dir)) is not None
                and s.autoscaler is not None
                and s.autoscaler.pid == proc.pid
            ),
            30,
            "the autoscaler run by hand never appeared in the state file",
        )
        return proc

    model = make_model_dir(tmp_path / "model")
    procs: list[subprocess.Popen] = []
    try:
        up = run(
            "up", "--prefill", "1", "--decode", "1", "--colocated", "0", "--model", str(model),
            "--port", str(free_port()), "--http-port", "0", "--worker-module", "tests.fake_workers",
            "--timeout", "60",
        )  # fmt: skip
        assert up.returncode == 0, up.stderr[-2000:]
        state = cluster.load_state(state_dir)
        assert state is not None
        pre_scale = [w.id for w in state.workers]
        assert len(pre_scale) == 2, pre_scale
        procs.append(by_hand())
        refused = run("scale", "--decode", "2")
        assert refused.returncode != 0 and "sizes this cluster's pools" in refused.stderr, refused.stderr
        status = run("status", "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["autoscaler"]["pid"] == procs[0].pid

        os.kill(procs[0].pid, signal.SIGTERM)
        assert procs[0].wait(timeout=30) == 0
        state = cluster.load_state(state_dir)
        assert state is not None and state.autoscaler is None
        scaled = run("scale", "--decode", "2")
        assert scaled.returncode == 0, scaled.stderr[-2000:]

        procs.append(by_hand())
        state = cluster.load_state(state_dir)
        assert state is not None
        # The workers `up` started (the by-hand autoscaler, bounded at 1 per pool, may drain the
        # decode worker `scale` added).
        Cluster(state_dir, state.router_address).assert_no_leaks(workers=pre_scale)
        down = run("down")
        assert down.returncode == 0, down.stderr[-2000:]
        assert procs[1].wait(timeout=30) == 0  # stopped by `down`, before the workers
        assert cluster.load_state(state_dir) is None
        assert not any(cluster.alive(p) for p in (state.router, *state.workers))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop_cluster(state_dir)
