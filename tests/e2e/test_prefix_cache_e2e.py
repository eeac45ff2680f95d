"""Prefix caching across processes, on a tiny random model with the default model's vocabulary (the router
tokenizes and checks it as a real one): a 1P+2D cluster routes by KV state, moves only the blocks the decode
worker lacks, reports cached tokens on both fronts and stays exact; faults with shared prefixes leak and
double-free nothing (each worker checks its block pool's invariants at every heartbeat here). The shared
cluster's decode workers speculate (``--speculative ngram``), so every test here also checks that
speculative decoding in PD changes no token.

Exactness: a suffix computed over cached K/V sums floats in another order than one pass, so a sequence may
differ from the oracle after a step whose top-2 logits are within 1e-5; the tiny model's peaked logits
make that rare, and the oracle here checks for it (``_greedy`` stops comparing at such a step).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.proto import generation_pb2
from tests.e2e.cluster_harness import running_cluster, wait_until

pytestmark = pytest.mark.slow

BS = 16  # the default --block-size
MAX_TOKENS = 8
THRESHOLD = 32  # --local-prefill-threshold: shorter uncached parts prefill on the decode worker


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    from tests.tiny_models import make_tiny_served_model

    return make_tiny_served_model("llama", tmp_path_factory.mktemp("tiny-served"))


@pytest.fixture(scope="module")
def oracle(tiny_served):
    """Greedy continuations from transformers, with the positions where the top two logits nearly tie."""
    import torch

    from tests.tiny_models import load_reference

    model = load_reference(tiny_served)

    def greedy(ids: list[int], n: int = MAX_TOKENS) -> tuple[list[int], int]:
        """(tokens, how many of them to compare): comparison stops after a near tie."""
        x = torch.tensor([ids])
        out: list[int] = []
        compare = n
        with torch.no_grad():
            for step in range(n):
                logits = model(x).logits[0, -1]
                top = torch.topk(logits, 2).values
                if float(top[0] - top[1]) < 1e-5 and compare == n:
                    compare = step + 1
                tok = int(logits.argmax())
                out.append(tok)
                x = torch.cat([x, torch.tensor([[tok]])], dim=1)
        return out, compare

    return greedy


@pytest.fixture(scope="module")
def pd_cluster(tiny_served, tmp_path_factory):
    os.environ["PDSERVE_CHECK_BLOCKS"] = "1"
    extra = (
        *("--model", str(tiny_served), "--kv-cache-mib", "64", "--http-port", "0"),
        *("--local-prefill-threshold", str(THRESHOLD)),
        *("--speculative", "ngram", "--num-speculative-tokens", "3"),
        # Byte counts assume each route: a starved heartbeat must not drop the prefill worker meanwhile.
        *("--heartbeat-timeout", "15"),
    )
    try:
        with running_cluster(tmp_path_factory.mktemp("pc"), prefill=1, decode=2, extra=extra) as c:
            yield c
    finally:
        os.environ.pop("PDSERVE_CHECK_BLOCKS", None)


def _request(rid: str, ids: list[int], **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=generation_pb2.TokenIds(ids=ids),
        sampling=generation_pb2.SamplingParams(
            **{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **sampling}
        ),
    )


def _run(c, rid: str, ids: list[int], **sampling) -> tuple[list[int], generation_pb2.Usage]:
    with c.channel() as ch:
        out: list[int] = []
        usage = None
        request = _request(rid, ids, **sampling)
        for m in c.stub(ch).Generate(request, timeout=120, metadata=c.token_metadata()):
            out += m.token_ids
            if m.finish_reason:
                usage = m.usage
    assert usage is not None
    return out, usage


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _sum(c, name: str, role: str) -> float:
    return sum(
        v
        for w in c.workers()
        if w["role"] == role
        for (n, _), v in _metrics(w["metrics_url"]).items()
        if n == name
    )


def _index_blocks(c, worker_id: str) -> float:
    m = _metrics(c.status()["router"]["metrics_url"])
    return m.get(("pdserve_router_kv_index_blocks", (("role", "router"), ("worker", worker_id))), 0.0)


def _check_exact(got: list[int], want: tuple[list[int], int], what: str) -> None:
    tokens, compare = want
    assert got[:compare] == tokens[:compare], what


def _no_broken_invariants(c) -> None:
    assert _sum(c, "pdserve_kv_block_invariant_failures_total", "decode") == 0
    assert _sum(c, "pdserve_kv_block_invariant_failures_total", "prefill") == 0


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_shared_prefixes_of_every_alignment_stay_exact_in_1p2d(pd_cluster, oracle):
    """Prompts sharing a prefix shorter than a block, exactly k blocks, k blocks + 1, and a prompt that is
    exactly k cached blocks, each sent twice (the second time from both workers' caches)."""
    base = _tokens(5000, 3 * BS + 7)
    prompts = {
        "short": base[:10] + _tokens(6000, 40),
        "k-blocks": base[: 2 * BS] + _tokens(6100, 40),
        "k-blocks-plus-1": base[: 2 * BS + 1] + _tokens(6200, 40),
        "exactly-k": base[: 3 * BS],
        "longer": base + _tokens(6300, 50),
    }
    want = {k: oracle(v) for k, v in prompts.items()}
    for round_ in (1, 2):
        for name, ids in prompts.items():
            got, usage = _run(pd_cluster, f"align-{name}-{round_}", ids)
            _check_exact(got, want[name], f"{name}, round {round_}")
            assert usage.prompt_tokens == len(ids) and usage.cached_tokens <= len(ids) - 1
    pd_cluster.assert_no_leaks()
    _no_broken_invariants(pd_cluster)


def test_only_the_blocks_the_decode_worker_lacks_cross_and_cached_tokens_count_once(pd_cluster, oracle):
    c = pd_cluster
    prefix = _tokens(20000, 4 * BS + 5)  # 4 full blocks shared below
    first = prefix + _tokens(21000, 40)
    before = _sum(c, "pdserve_kv_transfer_bytes_total", "decode")
    got, usage = _run(c, "bytes-1", first)
    _check_exact(got, oracle(first), "first")
    assert usage.cached_tokens == 0
    block_bytes = (_sum(c, "pdserve_kv_transfer_bytes_total", "decode") - before) / -(-len(first) // BS)
    assert block_bytes > 0 and block_bytes == int(block_bytes)
    # The decode worker that got it publishes its blocks: the router's index learns them from its events.
    holder = ""

    def learned() -> bool:
        nonlocal holder
        for w in c.workers():
            if w["role"] == "decode" and _index_blocks(c, w["id"]) >= 4:
                holder = w["id"]
                return True
        return False

    wait_until(learned, 30, "the router's KV index to learn the decode worker's blocks")
    # A short suffix past what the decode worker holds: prefilled there, from its cache, no transfer.
    sent, kept = (
        _sum(c, "pdserve_kv_transfer_bytes_total", "decode"),
        _sum(c, "pdserve_kv_transfer_bytes_not_sent_total", "decode"),
    )
    local = prefix + _tokens(22000, 10)
    got, usage = _run(c, "bytes-local", local)
    _check_exact(got, oracle(local), "local")
    assert usage.cached_tokens == 4 * BS  # the decode worker's own reuse: it prefilled
    assert _sum(c, "pdserve_kv_transfer_bytes_total", "decode") == sent
    # A long suffix: remote, P sends only the blocks past the decode worker's 4.
    remote = prefix + _tokens(23000, 60)
    got, usage = _run(c, "bytes-remote", remote)
    _check_exact(got, oracle(remote), "remote")
    blocks = -(-len(remote) // BS)
    assert _sum(c, "pdserve_kv_transfer_bytes_total", "decode") - sent == (blocks - 4) * block_bytes
    assert _sum(c, "pdserve_kv_transfer_bytes_not_sent_total", "decode") - kept == 4 * block_bytes
    # cached_tokens is the prefill worker's reuse (it prefilled "bytes-1" too), not the decode worker's
    # held blocks again: counted once.
    assert usage.cached_tokens == 4 * BS
    # The OpenAI front reports the same, as prompt_tokens_details.cached_tokens.
    http = c.status()["router"]["http_url"]
    with urllib.request.urlopen(f"{http}/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "prompt": prefix + _tokens(24000, 9), "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(
        f"{http}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        doc = json.loads(resp.read())
    assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 4 * BS}
    assert holder
    c.assert_no_leaks()
    _no_broken_invariants(c)


def test_a_cancelled_request_whose_prefix_others_share_frees_only_its_own(pd_cluster, oracle):
    c = pd_cluster
    shared = _tokens(30000, 3 * BS)
    prompts = {f"share-{i}": shared + _tokens(31000 + 100 * i, 40) for i in range(4)}
    want = {k: oracle(v) for k, v in prompts.items()}
    results: dict[str, list[int]] = {}
    with c.channel() as ch:
        stub = c.stub(ch)
        slow = generation_pb2.GenerateRequest(
            request_id="share-cancelled",
            prompt_token_ids=generation_pb2.TokenIds(ids=shared + _tokens(32000, 40)),
            sampling=generation_pb2.SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True),
        )
        call = stub.Generate(slow, timeout=120, metadata=c.token_metadata())
        next(call)  # streaming: its blocks, the shared prefix among them, are held

        def run(rid: str, ids: list[int]) -> None:
            results[rid] = _run(c, rid, ids)[0]

        threads = [threading.Thread(target=run, args=kv) for kv in prompts.items()]
        for t in threads:
            t.start()
        call.cancel()
        for t in threads:
            t.join(120)
        with pytest.raises(grpc.RpcError):
            for _ in call:
                pass
    for rid, toks in want.items():
        _check_exact(results[rid], toks, rid)
    c.assert_no_leaks()
    _no_broken_invariants(c)


def test_speculating_decode_workers_stay_exact_in_pd(pd_cluster, oracle):
    """Prompts of one repeated token make the tiny model loop, so the n-gram proposer proposes and the
    decode workers verify (and accept) proposals on remotely prefilled streams: the tokens equal the
    oracle's and those of the same requests with speculation turned off per request."""
    n = 24
    before = _sum(pd_cluster, "pdserve_spec_decode_num_accepted_tokens_total", "decode")
    for i in range(4):
        ids = [1000 + i] * (THRESHOLD + 8)  # prefilled remotely
        got, _ = _run(pd_cluster, f"spec-{i}", ids, max_tokens=n)
        off, _ = _run(pd_cluster, f"spec-off-{i}", ids, max_tokens=n, speculative=False)
        want = oracle(ids, n)
        _check_exact(got, want, f"spec-{i}")
        _check_exact(off, want, f"spec-off-{i}")

    def accepted() -> bool:
        return _sum(pd_cluster, "pdserve_spec_decode_num_accepted_tokens_total", "decode") > before

    wait_until(accepted, 10, "a decode worker's heartbeat to count accepted proposals")
    pd_cluster.assert_no_leaks()
    _no_broken_invariants(pd_cluster)


def test_eviction_under_pressure_while_transfers_write(tiny_served, oracle, tmp_path):
    """Decode caches of 24 blocks: concurrent prompts of 5-6 blocks with four prefixes keep evicting cached
    blocks while other requests' transfers write theirs."""
    os.environ["PDSERVE_CHECK_BLOCKS"] = "1"
    extra = ("--model", str(tiny_served), "--local-prefill-threshold", "1", "--kv-blocks", "24")
    prompts = {
        f"evict-{i}": _tokens(40000 + 1000 * (i % 4), 3 * BS) + _tokens(45000 + 100 * i, 30)
        for i in range(12)
    }
    want = {k: oracle(v) for k, v in prompts.items()}
    results: dict[str, list[int]] = {}
    try:
        with running_cluster(tmp_path, prefill=1, decode=1, extra=extra) as c:

            def run(rid: str, ids: list[int]) -> None:
                results[rid] = _run(c, rid, ids)[0]

            threads = [threading.Thread(target=run, args=kv) for kv in prompts.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            evicted = lambda: _sum(c, "pdserve_prefix_cache_evictions_total", "decode") > 0  # noqa: E731
            wait_until(evicted, 10, "a decode worker's heartbeat to count its evictions")
            c.assert_no_leaks()
            _no_broken_invariants(c)
    finally:
        os.environ.pop("PDSERVE_CHECK_BLOCKS", None)
    for rid, toks in want.items():
        _check_exact(results[rid], toks, rid)
