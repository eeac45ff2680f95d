"""The serving path end to end: real router, real prefill/decode/colocated workers, UCX on loopback.

Exact output through 1P+1D, through a colocated worker and offline; the first token from the prefill
result before decode admits; bad input; kill -9 of a decode worker (cancels: ``test_faults``' burst of
200). Every test ends with a leak check (every worker reports zero KV blocks used).

The clusters serve the tiny random model with the default model's tokenizer (``tiny_served_model``): what
is checked is the serving path against the same engine offline, not the real model's output, which
``tests/unit/test_real_model_parity.py`` and ``test_llm.py`` check.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.proto import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster_harness import (
    generate,
    migrations,
    run_all,
    running_cluster,
    streaming,
    wait_until,
    worker_load,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def _requests() -> list[generation_pb2.GenerateRequest]:
    """8 requests: token-id prompts of mixed lengths (one over 1,000 tokens), a text prompt and a chat."""
    rng = random.Random(7)
    # Ordinary vocabulary ids (SmolLM2's special tokens are the first ~17).
    lengths = [5, 40, 130, 100, 1100, 200]  # (the prefills are most of these tests' time on 2 cores)
    reqs = [
        generation_pb2.GenerateRequest(
            request_id=f"ids-{n}",
            prompt_token_ids=generation_pb2.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(n)]),
        )
        for n in lengths
    ]
    reqs.append(generation_pb2.GenerateRequest(request_id="text", prompt="The three primary colours are"))
    reqs.append(
        generation_pb2.GenerateRequest(
            request_id="chat",
            messages=generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content="Name a large ocean.")]
            ),
        )
    )
    for r in reqs:
        r.sampling.max_tokens = MAX_TOKENS
        r.sampling.temperature = 0.0
    return reqs


def _offline(reqs, model, quantization: str = "none") -> dict[str, tuple[list[int], str]]:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_bytes=256 << 20, threads=2, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = {}
    for r in reqs:
        kind = r.WhichOneof("input")
        if kind == "messages":
            res = llm.chat(
                [[{"role": m.role, "content": m.content} for m in r.messages.messages]],
                params,
                use_tqdm=False,
            )[0]
        elif kind == "prompt":
            res = llm.generate([r.prompt], params, use_tqdm=False)[0]
        else:
            res = llm.generate([list(r.prompt_token_ids.ids)], params, use_tqdm=False)[0]
        out[r.request_id] = (list(res.token_ids), res.text)
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks
    return out


@pytest.fixture(scope="module")
def offline(tiny_served_model) -> dict[str, tuple[list[int], str]]:
    """Offline float32 ``LLM``'s tokens and text for ``_requests()``."""
    return _offline(_requests(), tiny_served_model)


def test_colocated_equals_offline(tmp_path, offline, tiny_served_model):
    reqs = _requests()
    with running_cluster(tmp_path, colocated=1, model=tiny_served_model) as c:
        got = run_all(c.address, reqs)
        c.assert_no_leaks()
    want = offline
    for rid, (ids, text) in want.items():
        assert got[rid][0] == ids, rid
        assert got[rid][1] == text, rid
        assert got[rid][2] in ("stop", "length"), rid


def _transfers_by_path(c) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The prefill worker's transfers opened, by how their KV moved."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    (prefill,) = [w for w in c.workers() if w["role"] == "prefill"]
    with urllib.request.urlopen(prefill["metrics_url"], timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["path"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pdserve_kv_transfer_opened_total" and s.labels.get("role") == "prefill" and s.value
    }


# Every prompt prefilled remotely. A generous heartbeat timeout: on a starved machine a prefill worker
# dropped for missed heartbeats sends its prompts to the decode worker, and the transfer counts fall short.
REMOTE_PREFILL = ("--local-prefill-threshold", "1", "--heartbeat-timeout", "15")


@pytest.fixture(scope="class")
def remote_prefill_cluster(tmp_path_factory, tiny_served_model):
    """1P+1D with every prompt prefilled remotely, its KV written across processes (cross-memory)."""
    dest = tmp_path_factory.mktemp("remote-prefill")
    with running_cluster(dest, prefill=1, decode=1, model=tiny_served_model, extra=REMOTE_PREFILL) as c:
        yield c


class TestRemotePrefill:
    """1P+1D, threshold 1: all 8 prompts cross the KV transfer. The cross-memory run and the death of the
    decode worker share one cluster (the death last: it ends the cluster's decode pool)."""

    # shared_memory first: its own cluster is down before the class's starts.
    @pytest.mark.parametrize("kv", ["shared_memory", "cross_memory"])
    def test_disaggregated_equals_offline_and_first_token_comes_from_prefill(
        self, tmp_path, kv, offline, tiny_served_model, request
    ):
        if kv == "cross_memory":
            self._check_disaggregated(request.getfixturevalue("remote_prefill_cluster"), kv, offline)
            return
        extra = (*REMOTE_PREFILL, "--kv-shared-memory")
        with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
            self._check_disaggregated(c, kv, offline)

    @staticmethod
    def _check_disaggregated(c, kv: str, offline) -> None:  # type: ignore[no-untyped-def]
        reqs = _requests()
        got = run_all(c.address, reqs)
        for rid, (ids, text) in offline.items():
            assert got[rid][0] == ids, rid
            assert got[rid][1] == text, rid
        _first_token_before_admission(c)
        # One host: every transfer (the 8 and the trace's) written by the prefill worker itself.
        assert _transfers_by_path(c) == {kv: len(reqs) + 1}
        c.assert_no_leaks()

    def test_kill_decode_worker_mid_stream(self, remote_prefill_cluster):
        from pdserve.proto import generation_pb2_grpc

        c = remote_prefill_cluster

        decode = next(w for w in c.workers() if w["role"] == "decode")
        prefill = next(w for w in c.workers() if w["role"] == "prefill")
        with grpc.insecure_channel(c.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            r = generation_pb2.GenerateRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=list(range(300, 700)))
            )
            r.sampling.max_tokens = 1500  # (the tiny model's context is 2,048 tokens)
            r.sampling.ignore_eos = True
            call = stub.Generate(r, timeout=120)
            next(call)
            next(call)
            os.kill(c.worker_pid(decode["id"]), signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                for _ in call:
                    pass
            # No other decoding worker to move to: the stream fails at once, saying so.
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no other decode or colocated worker is left" in e.value.details()
            assert time.monotonic() - t0 < 3.0
        # The router stopped routing to it, and the prefill side holds nothing.
        ws = c.workers()
        assert decode["id"] not in {w["id"] for w in ws}
        c.assert_no_leaks(workers=[prefill["id"]])


def test_int8_disaggregated_equals_offline_int8_and_a_float_worker_cannot_join(tmp_path, tiny_served_model):
    """`up --quantization int8`, 1P+1D: every request crosses the KV transfer and gives offline int8's
    tokens and text. A decode worker started by hand without --quantization is refused by the router at
    registration (its KV record differs) and exits, saying which flag to match; so is one whose KV record
    matches but whose model has another vocabulary; the cluster is untouched."""
    from pdserve.deploy.local import cluster as local

    reqs = _requests()
    want = _offline(reqs, tiny_served_model, quantization="int8")
    extra = ("--local-prefill-threshold", "1", "--quantization", "int8")
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        got = run_all(c.address, reqs)
        for rid, (ids, text) in want.items():
            assert got[rid][0] == ids, rid
            assert got[rid][1] == text, rid
        layouts = {w["id"]: w["kv_layout"] for w in c.workers()}
        assert len(set(layouts.values())) == 1 and "+int8, float32" in next(iter(layouts.values())), layouts

        state = local.load_state(c.state_dir)
        assert state is not None
        # The same model directory name, shape and flags (so the same KV record), another vocabulary: the
        # KV check cannot tell; the router's vocabulary check refuses it. (The two strays start together.)
        other = _other_vocabulary_copy(tiny_served_model, tmp_path / "other-vocab")
        with cf.ThreadPoolExecutor(2) as pool:
            float_worker = pool.submit(_decode_worker_by_hand, state, "--worker-id", "float-decode")
            other_vocab = pool.submit(
                _decode_worker_by_hand,
                *(state, "--worker-id", "other-vocab", "--quantization", "int8", "--model", str(other)),
            )
            stray, stranger = float_worker.result(), other_vocab.result()
        assert stray.returncode != 0, stray.stderr[-2000:]
        assert "FAILED_PRECONDITION" in stray.stderr and "--quantization" in stray.stderr, stray.stderr[
            -2000:
        ]
        assert stranger.returncode != 0, stranger.stderr[-2000:]
        assert "FAILED_PRECONDITION" in stranger.stderr and "vocabulary" in stranger.stderr, stranger.stderr[
            -2000:
        ]
        assert set(layouts) == {w["id"] for w in c.workers()}
        c.assert_no_leaks()


def _decode_worker_by_hand(state, *flags: str) -> subprocess.CompletedProcess:
    """`pdserve worker --role decode` joining the cluster of ``state`` as an operator would start one (its
    model, one thread, a small cache, float32; ``flags`` may name another model), run to its exit
    (bounded)."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode", "--router", state.router_address]
        + ["--model", state.model, "--cluster-token-file", state.token_file, "--dtype", "float32"]
        + ["--kv-cache-mib", "32"]
        + ["--threads", "1", *flags],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


def _other_vocabulary_copy(src, parent):
    """The model directory ``src`` under the same name, weights linked, with one token added to its
    vocabulary."""
    from tokenizers import Tokenizer as Backend

    dst = parent / src.name
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            (dst / f.name).symlink_to(f)
    backend = Backend.from_file(str(src / "tokenizer.json"))
    backend.add_tokens(["<one-more>"])
    backend.save(str(dst / "tokenizer.json"))
    return dst


def _first_token_before_admission(c) -> None:
    """Drive the internal API as the router does and compare the two workers' own timestamps."""
    ws = {w["role"]: w for w in c.workers()}
    prompt = list(range(200, 500))
    with (
        grpc.insecure_channel(ws["decode"]["address"]) as dch,
        grpc.insecure_channel(ws["prefill"]["address"]) as pch,
    ):
        d = worker_pb2_grpc.WorkerStub(dch)
        p = worker_pb2_grpc.WorkerStub(pch)
        sampling = generation_pb2.SamplingParams(max_tokens=4, temperature=0.0)
        stream = d.Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id="trace",
                prompt_token_ids=prompt,
                sampling=sampling,
                mode=worker_pb2.PREFILL_MODE_REMOTE,
            ),
            timeout=120,
            metadata=c.token_metadata(),
        )
        first = next(stream)
        assert first.transfer_ticket, "remote mode answers with a transfer ticket first"
        resp = p.Prefill(
            worker_pb2.PrefillRequest(
                request_id="trace",
                prompt_token_ids=prompt,
                sampling=sampling,
                transfer_ticket=first.transfer_ticket,
            ),
            timeout=120,
            metadata=c.token_metadata(),
        )
        rest = list(stream)
    admitted = rest[0].admitted_unix
    assert rest[0].first_index == 0 and rest[0].token_ids[0] == resp.first_token_id
    # The prefill worker answered with token 0 before the decode worker admitted the request.
    assert 0 < resp.first_token_unix < admitted, (resp.first_token_unix, admitted)
    assert rest[-1].finish_reason == "length"


def _migration_requests(n: int, max_tokens: int) -> list[generation_pb2.GenerateRequest]:
    rng = random.Random(11)
    reqs = []
    for i in range(n):
        r = generation_pb2.GenerateRequest(
            request_id=f"mig-{i}",
            prompt_token_ids=generation_pb2.TokenIds(
                ids=[rng.randrange(100, 40000) for _ in range(20 + 9 * i)]
            ),
        )
        r.sampling.max_tokens = max_tokens
        r.sampling.ignore_eos = True
        if i % 2:  # half greedy, half seeded sampling: both continue exactly after a move
            r.sampling.temperature = 0.8
            r.sampling.seed = 100 + i
        else:
            r.sampling.temperature = 0.0
        reqs.append(r)
    return reqs


def test_killed_decode_worker_streams_move_to_the_other_and_lose_nothing(tmp_path, tiny_served_model):
    """1 prefill + 2 decode, 8 streams (greedy and seeded), SIGKILL of a decode worker mid-stream: every
    stream completes with exactly the tokens of an undisturbed run, each migration is counted, and the
    survivors hold no KV blocks."""
    # 300 tokens: the tiny model decodes a token in milliseconds; the streams must outlast the kill.
    reqs = _migration_requests(8, max_tokens=300)
    extra = ("--local-prefill-threshold", "1", "--max-running", "8")
    with running_cluster(tmp_path, prefill=1, decode=2, model=tiny_served_model, extra=extra) as c:
        want = run_all(c.address, reqs)  # undisturbed, on the same cluster
        decoders = [w for w in c.workers() if w["role"] == "decode"]
        assert len(decoders) == 2
        with streaming(c, reqs, after=3) as streams:
            assert streams.wait_streaming(120)
            # The victim is the decode worker running most streams, asked of the workers themselves
            # (milliseconds): a fixed one may have ended all of its streams already (one was seen to
            # end before the last had its 3 tokens), and then nothing migrates. The last stream to get
            # its 3 tokens has most of its 300 to go: some worker still runs it.
            busy = {w["id"]: worker_load(w["address"], c.token_metadata()).running for w in decoders}
            victim = max(decoders, key=lambda w: busy[w["id"]])
            assert busy[victim["id"]] > 0, busy
            os.kill(c.worker_pid(victim["id"]), signal.SIGKILL)
        assert not streams.errors, streams.errors
        for r in reqs:
            assert streams.got[r.request_id] == want[r.request_id][0], r.request_id
        # (the router drops it once a call or a heartbeat finds it dead: not always by the streams' end)
        wait_until(lambda: victim["id"] not in {w["id"] for w in c.workers()}, 30, "the router to drop it")
        c.assert_no_leaks()
        assert migrations(c).get("decode_failed", 0) >= 1, "the killed worker's streams were migrated"


# A prefill worker killed while prompts queue or prefill on it: tests/e2e/test_faults.py (the fault matrix).


def test_scale_decode_up_and_down_under_traffic(tmp_path, tiny_served_model):
    """`pdserve scale --decode 2` then `--decode 1` with requests flowing: none fails; the removed worker
    drains."""
    import threading

    from pdserve.proto import generation_pb2_grpc
    from tests.e2e.cluster_harness import pdserve

    extra = ("--local-prefill-threshold", "32")
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        errors: list[str] = []
        done: list[str] = []
        stop = threading.Event()

        def traffic(worker: int) -> None:
            with grpc.insecure_channel(c.address) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                i = 0
                # Bounded by time, not by count: a fast host would run out of requests before the
                # scale-down ends and the test would wait on traffic that had stopped.
                give_up = time.monotonic() + 600
                while not stop.is_set() and time.monotonic() < give_up:
                    n = 16 if i % 2 else 80
                    r = generation_pb2.GenerateRequest(
                        request_id=f"s{worker}-{i}",
                        prompt_token_ids=generation_pb2.TokenIds(ids=list(range(500, 500 + n))),
                    )
                    r.sampling.max_tokens = 24
                    r.sampling.ignore_eos = True
                    try:
                        ids, _, reason, _ = generate(stub, r, timeout=120)
                        assert len(ids) == 24 and reason == "length", (len(ids), reason)
                        done.append(r.request_id)
                    except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                        errors.append(f"{r.request_id}: {e!r}")
                    i += 1

        threads = [threading.Thread(target=traffic, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(done) >= 3 or bool(errors), 120, "traffic before the scale-up")
            pdserve("scale", "--decode", "2", "--state-dir", str(c.state_dir), timeout=300)
            decoders = [w for w in c.workers() if w["role"] == "decode"]
            assert len(decoders) == 2 and all(w["state"] == "ready" for w in decoders)
            before = len(done)
            wait_until(lambda: len(done) > before or bool(errors), 120, "traffic with two decode workers")
            assert len(done) > before, "traffic kept flowing with two decode workers"
            pdserve("scale", "--decode", "1", "--state-dir", str(c.state_dir), timeout=300)
            decoders = [w for w in c.workers() if w["role"] == "decode"]
            assert len(decoders) == 1
            after = len(done)
            assert all(t.is_alive() for t in threads), "the traffic threads stopped before the scale-down"
            wait_until(lambda: len(done) > after or bool(errors), 120, "traffic after the scale-down")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=180)
        assert not errors, errors[:5]
        assert len(done) >= 10
        # The removed worker drained: its log says so and it exited on its own after its requests finished.
        logs = sorted((c.state_dir / "logs").glob("decode-*.log"))
        assert any("draining" in p.read_text() for p in logs), [p.name for p in logs]
        c.assert_no_leaks()
