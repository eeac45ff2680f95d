"""The fault matrix: a worker killed, hung or flooded, the router restarted; no admitted request lost.

Each case runs on a real local cluster (float32, UCX on loopback) and ends with a leak check
(0 KV blocks on every surviving worker) and a follow-up request that succeeds. Greedy outputs of the
requests that were moved or retried equal, token for token, an undisturbed run on the same cluster.
The SIGKILL of a decode worker mid-stream is ``test_serving_e2e``'s migration test.

Clusters serve the tiny served model (``tiny_served_model``) where the fault's timing does not hang on
the model's speed (a transfer held back by a fault delay, cancels, a router restart); SmolLM2 where a
worker must be caught mid-prefill or a prefill queue must build (a tiny forward takes milliseconds).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import re
import signal
import time

import grpc
import pytest

from pdserve.deploy.local import cluster
from pdserve.proto import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster_harness import (
    Cluster,
    ThreadedStreams,
    generate,
    migrations,
    run_all,
    running_cluster,
    streaming,
)

pytestmark = pytest.mark.slow

REMOTE = ("--local-prefill-threshold", "1", "--max-running", "16")


def _prompts(n: int, length: int, seed: int, max_tokens: int = 8, prefix: str = "f"):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        r = generation_pb2.GenerateRequest(
            request_id=f"{prefix}-{i}",
            prompt_token_ids=generation_pb2.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(length)]),
        )
        r.sampling.max_tokens = max_tokens
        r.sampling.temperature = 0.0
        r.sampling.ignore_eos = True
        reqs.append(r)
    return reqs


def _load(c: Cluster, worker: dict) -> worker_pb2.WorkerLoad:
    with grpc.insecure_channel(worker["address"]) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetLoad(
            worker_pb2.Empty(), timeout=5, metadata=c.token_metadata()
        )


def _wait_prefilling(c: Cluster, worker: dict, timeout_s: float = 60) -> None:
    """Until ``worker`` (a prefill worker) runs a forward: its requests are past the queue, before token 0."""
    end = time.monotonic() + timeout_s
    while _load(c, worker).running == 0:
        assert time.monotonic() < end, f"{worker['id']} never started a prefill"
        time.sleep(0.01)


def _router_log(c: Cluster) -> str:
    state = cluster.load_state(c.state_dir)
    assert state is not None
    with open(state.router.log, encoding="utf-8", errors="replace") as f:
        return f.read()


def _moved(c: Cluster) -> dict[str, str]:
    """Request id -> the prefill worker it moved to ("local": the decode worker prefilled it)."""
    return dict(re.findall(r"request (\S+): .*; moved to \S+ \(prefill: (\S+)\)", _router_log(c)))


def _moved_at(c: Cluster, rid: str) -> float:
    """When the router logged moving ``rid`` (Unix time)."""
    import datetime

    stamp = re.search(rf"^(\S+ \S+) WARNING \S+ request {re.escape(rid)}: .*; moved to", _router_log(c), re.M)
    assert stamp is not None, rid
    return datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _follow_up(c: Cluster, n: int = 300) -> None:
    [r] = _prompts(1, n, seed=99, max_tokens=4, prefix=f"after-{time.monotonic_ns()}")
    with c.channel() as ch:
        ids, _, reason, _ = generate(c.stub(ch), r, timeout=120)
    assert len(ids) == 4 and reason == "length"


def _check_exact(streams: ThreadedStreams, want: dict) -> None:
    assert not streams.errors, streams.errors
    for rid, (tokens, _, _) in want.items():
        assert streams.got[rid] == tokens, rid


def test_prefill_killed_mid_transfer_moves_at_once(tmp_path, tiny_served_model):
    """2P+1D with every KV layer sent 3 s late: token 0 reached the clients, the transfers are in flight,
    a prefill worker is SIGKILLed. The decode worker sees its peer die and the router moves the streams
    at once (the decode worker prefills prompt + token 0): the same tokens, and they continue within
    seconds of the kill, not at a transfer deadline."""
    reqs = _prompts(4, 200, seed=2)
    extra = (*REMOTE, "--kv-fault-delay", "3")
    with running_cluster(tmp_path, prefill=2, decode=1, model=tiny_served_model, extra=extra) as c:
        want = run_all(c.address, reqs)
        prefills = [w for w in c.workers() if w["role"] == "prefill"]
        with streaming(c, reqs, after=1) as streams:
            assert streams.wait_streaming(120)  # every stream has token 0; no transfer can be done yet
            # A prefill worker holds a request's blocks until its transfer completes.
            victim = max(prefills, key=lambda w: _load(c, w).kv_blocks_used)
            assert _load(c, victim).kv_blocks_used > 0
            killed, killed_unix = time.monotonic(), time.time()
            os.kill(c.worker_pid(victim["id"]), signal.SIGKILL)
        _check_exact(streams, want)
        moved = _moved(c)
        assert moved, "some stream's transfer came from the killed worker"
        assert set(moved.values()) == {"local"}, moved  # token 0 was sent: the decode worker prefills
        seen = max(_moved_at(c, rid) for rid in moved) - killed_unix
        resumed = max(next(t for t in streams.at[rid] if t > killed) - killed for rid in moved)
        print(f"\nmoved {len(moved)} stream(s), the last {seen:.2f}s after the kill; on {resumed:.2f}s after")
        assert seen < 2.0, seen  # the peer's death is seen, not a transfer deadline or heartbeat timeout
        c.assert_no_leaks()
        _follow_up(c)


def test_a_burst_of_200_cancels_frees_every_block(tmp_path, tiny_served_model):
    extra = ("--local-prefill-threshold", "64")
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        with c.channel() as ch:
            stub = c.stub(ch)
            calls = []
            for i in range(200):
                n = 20 if i % 2 else 150  # half local prefill, half remote
                r = generation_pb2.GenerateRequest(
                    request_id=f"c{i}",
                    prompt_token_ids=generation_pb2.TokenIds(ids=list(range(300, 300 + n))),
                )
                r.sampling.max_tokens = 1800  # (the tiny model's context is 2,048 tokens)
                r.sampling.ignore_eos = True
                calls.append(stub.Generate(r, timeout=120))
                if i == 1:
                    # Two streams under way before the burst: sent all at once, the router may admit
                    # others ahead of these two, and each holds its room for 1,800 tokens.
                    next(calls[0])
                    next(calls[1])
            for call in calls:
                call.cancel()
        print(f"\nidle {c.assert_workers_idle_direct(timeout_s=5.0):.2f}s after 200 cancels")
        c.assert_no_leaks()
        _follow_up(c)


def test_overload_burst_past_the_prefill_queue_bound_is_refused_at_once(tmp_path):
    """1P+1D, a prefill queue bound of 1,000 tokens, 16 prompts of 250 tokens at once: the excess is
    RESOURCE_EXHAUSTED at once, every admitted request completes (the same tokens as a lone run)."""
    # Prefix caching off: after the lone run the prompt is cached, and its repeats would queue no prompt
    # tokens on the prefill worker.
    # A heartbeat that 16 prompts at once on a loaded host's 2 cores starved must not expire the prefill
    # worker under the follow-up (this tests the queue bound, not heartbeats).
    extra = (
        *(*REMOTE, "--max-prefill-queue-tokens", "1000", "--no-enable-prefix-caching"),
        *("--heartbeat-timeout", "15"),
    )
    reqs = _prompts(16, 250, seed=4)
    for r in reqs[1:]:
        r.prompt_token_ids.CopyFrom(reqs[0].prompt_token_ids)  # one prompt: every output is the same
    with running_cluster(tmp_path, prefill=1, decode=1, extra=extra) as c:
        with c.channel() as ch:
            stub = c.stub(ch)
            # The lone run under its own id: a client that stops reading at the last token may reuse
            # an id before the router has seen the call end (then: "already in flight").
            lone = generation_pb2.GenerateRequest()
            lone.CopyFrom(reqs[0])
            lone.request_id = "f-lone"
            [want] = run_all(c.address, [lone]).values()

            def one(r) -> tuple[str, float, list[int]]:
                t0 = time.monotonic()
                try:
                    ids, _, _, _ = generate(stub, r, timeout=300)
                    return "ok", time.monotonic() - t0, ids
                except grpc.RpcError as e:
                    details.append(f"{r.request_id}: {e.code().name} {e.details()}")
                    return e.code().name, time.monotonic() - t0, []

            details: list[str] = []
            with cf.ThreadPoolExecutor(len(reqs)) as pool:
                results = list(pool.map(one, reqs))
        refused = [s for code, s, _ in results if code == "RESOURCE_EXHAUSTED"]
        served = [ids for code, _, ids in results if code == "ok"]
        assert len(refused) + len(served) == len(reqs), details
        assert refused and len(served) >= 4, (len(refused), len(served))
        assert all(ids == want[0] for ids in served)
        assert max(refused) < 5.0, refused  # refused on arrival, not after a wait
        c.assert_no_leaks()
        _follow_up(c)


def test_router_restart_workers_register_again(tmp_path, tiny_served_model):
    """SIGKILL of the router with a stream in flight: the workers free its blocks; a new router on the
    same port gets their registrations and serves."""
    [r] = _prompts(1, 300, seed=5, max_tokens=1700)  # (the tiny model's context is 2,048 tokens)
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=REMOTE) as c:
        state = cluster.load_state(c.state_dir)
        assert state is not None
        with open(f"/proc/{state.router.pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        with streaming(c, [r], after=2) as streams:
            assert streams.wait_streaming(120)
            os.kill(state.router.pid, signal.SIGKILL)
        assert streams.errors  # its router is gone: the client sees the broken stream
        entry = cluster.spawn("router", argv, c.state_dir / "logs" / "router2.log", cluster.child_env(1))
        import msgspec

        cluster.save_state(c.state_dir, msgspec.structs.replace(state, router=entry))
        end = time.monotonic() + 60
        while True:
            try:
                if sorted(w["state"] for w in c.workers()) == ["ready", "ready"]:
                    break
            except Exception:  # noqa: BLE001 - the new router is still starting
                pass
            assert time.monotonic() < end, "the workers did not register with the new router"
            time.sleep(0.25)
        c.assert_no_leaks()
        _follow_up(c)


# Last in the module: its 2P+1D cluster stays up from its first test to the module's end.
# The 8 long prompts: long enough that a worker is caught mid-prefill (each worker gets ~4, a
# second or more of forward on a 2-core CPU), short enough that the three runs of them stay affordable.
HANG_OR_KILL_PROMPTS = {"n": 8, "length": 320, "seed": 1}


@pytest.fixture(scope="module")
def two_prefill(tmp_path_factory):
    """One 2P+1D cluster for the hang and the kill of a prefill worker mid-prefill (in that order: the
    hung worker comes back), and the undisturbed greedy tokens of their prompts, by position."""
    # 3 s: long enough that a healthy worker's heartbeats are not missed in its first forward on a loaded
    # 2-core machine (seen once at 1.5 s: the other prefill worker dropped, which would fail the hang
    # test's "moved to the other one").
    # Prefix caching off: the tests send the undisturbed run's prompts again, and a cached prompt's prefill
    # is a forward of one block, too short a window to catch a worker in.
    extra = (*REMOTE, "--heartbeat-timeout", "3", "--no-enable-prefix-caching")
    with running_cluster(tmp_path_factory.mktemp("two-prefill"), prefill=2, decode=1, extra=extra) as c:
        reqs = _prompts(**HANG_OR_KILL_PROMPTS, prefix="undisturbed")
        want = run_all(c.address, reqs)
        yield c, [want[r.request_id] for r in reqs]


def _same_prompts(prefix: str, want_by_index: list) -> tuple[list, dict]:
    """The fixture's prompts under new ids (``prefix``), and their undisturbed tokens by those ids."""
    reqs = _prompts(**HANG_OR_KILL_PROMPTS, prefix=prefix)
    return reqs, {r.request_id: w for r, w in zip(reqs, want_by_index, strict=True)}


def _moved_of(c: Cluster, prefix: str) -> dict[str, str]:
    return {rid: to for rid, to in _moved(c).items() if rid.startswith(prefix + "-")}


def test_prefill_worker_hung_past_its_deadline(two_prefill):
    """2P+1D, SIGSTOP of a prefill worker mid-prefill (a hang, not a death): past the heartbeat timeout
    its requests go to the other prefill worker with the undisturbed tokens; once SIGCONT it comes
    back, re-registers, and holds nothing."""
    c, want_by_index = two_prefill
    reqs, want = _same_prompts("hang", want_by_index)
    victim, other = sorted((w for w in c.workers() if w["role"] == "prefill"), key=lambda w: w["id"])
    pid = c.worker_pid(victim["id"])
    try:
        with streaming(c, reqs) as streams:
            _wait_prefilling(c, victim)
            os.kill(pid, signal.SIGSTOP)
    finally:
        os.kill(pid, signal.SIGCONT)
    _check_exact(streams, want)
    assert set(_moved_of(c, "hang").values()) == {other["id"]}, _moved_of(c, "hang")
    end = time.monotonic() + 30
    while victim["id"] not in {w["id"] for w in c.workers() if w["state"] == "ready"}:
        assert time.monotonic() < end, "the resumed worker did not register again"
        time.sleep(0.25)
    c.assert_no_leaks(timeout_s=15)
    _follow_up(c)


def test_prefill_killed_mid_prefill_retries_on_the_other_prefill_worker(two_prefill):
    """2P+1D, SIGKILL of a prefill worker while it computes: its requests are prefilled by the other one
    (not locally), with the undisturbed tokens."""
    c, want_by_index = two_prefill
    reqs, want = _same_prompts("kill", want_by_index)
    victim, other = sorted((w for w in c.workers() if w["role"] == "prefill"), key=lambda w: w["id"])
    before = migrations(c).get("prefill_failed", 0)
    with streaming(c, reqs) as streams:
        _wait_prefilling(c, victim)
        os.kill(c.worker_pid(victim["id"]), signal.SIGKILL)
    _check_exact(streams, want)
    moved = _moved_of(c, "kill")
    assert moved and set(moved.values()) == {other["id"]}, moved
    assert migrations(c).get("prefill_failed", 0) > before
    c.assert_no_leaks()
    _follow_up(c)
