"""Acceptance: a real Prometheus scrapes a real 1 prefill + 1 decode cluster under load.

``pdserve up --prometheus --autoscale`` starts the router, the two workers (the real pools,
serving the tiny served model in float32) and Debian's Prometheus (``make prometheus`` unpacks it into
the virtualenv; the fixture does the same when it is missing, and skips saying
why only when it cannot). After a load of short prompts (prefilled locally by
the decode worker) and long ones (prefilled remotely, KV over the transfer):

- every query of every panel of the serving dashboard returns data through
  Prometheus' HTTP API (``$instance`` = All, ``$__rate_interval`` as Grafana
  derives it from the scrape interval);
- the router's TTFT histogram counted every request, its generation token
  counter equals the tokens the clients received, and the KV transfer moved
  exactly prompt tokens x KV bytes per token for the remote prompts;
- ``status --json`` lists a serving ``metrics_url`` for the router and each worker;
- the autoscaler (``--autoscale``, held at one worker per pool) is scraped too.

Everything the test starts (cluster and Prometheus) is stopped by the cluster
harness, even when the test fails; the test ends with its leak check.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.deploy.local import prometheus
from pdserve.proto import generation_pb2 as g
from pdserve.proto import generation_pb2_grpc
from tests.e2e.cluster_harness import free_port, running_cluster
from tests.unit.test_observability import DASHBOARD_DIR, panel_queries

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_S = 1.0
# Grafana's $__rate_interval: max(4 x scrape interval, step + scrape interval), with a 1 s step here.
RATE_INTERVAL = "4s"
LOCAL_PREFILL_THRESHOLD = 32  # prompts shorter than this many tokens prefill on the decode worker
# A tiny-model token takes milliseconds: answers long enough that the load spans several scrapes, so that
# every rate sees it rise.
MAX_TOKENS = 200
BLOCK_SIZE = 16  # tokens per KV block (the workers' default)
WAVES = 3
_POLL_S = 0.5


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """Prometheus on PATH or in the venv; otherwise unpack Debian's package into the venv, or skip loudly."""
    found = prometheus.find_binary()
    if found:
        return found
    dest = Path(sys.prefix) / prometheus.VENV_PREFIX
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "prometheus" / "install.sh"), str(dest)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = prometheus.find_binary()
    if found is None:
        pytest.skip(
            "PROMETHEUS IS NOT INSTALLED AND COULD NOT BE: deploy/prometheus/install.sh failed "
            f"(exit {done.returncode}): {done.stderr.strip()[-600:]}"
        )
    return found


def api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        doc = json.loads(resp.read())
    assert doc["status"] == "success", doc
    return doc["data"]


def instant(base: str, query: str) -> float | None:
    """The single value of an instant query, or None while it has no data."""
    result = api(base, "query", query=query)["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Poll (bounded: a failure bound, not a latency check)."""
    give_up = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(_POLL_S)


def wait_equal(prom: str, query: str, expected: float, timeout_s: float = 30.0) -> None:
    """Wait until Prometheus has scraped ``query`` up to ``expected``: each target is scraped on its own
    schedule, so a counter's last increments show up a scrape interval or so after the load ends."""
    give_up = time.monotonic() + timeout_s
    while (seen := instant(prom, query)) != expected:
        if time.monotonic() > give_up:
            raise AssertionError(f"{query}: {seen} after {timeout_s:.0f}s, expected {expected}")
        time.sleep(_POLL_S)


def requests(wave: int) -> list[g.GenerateRequest]:
    """Short text prompts (prefilled locally by the decode worker) and long token-id prompts (prefilled
    remotely). The long ones fill whole KV blocks, since the transfer moves whole blocks: then prompt
    tokens x bytes per token is exactly what moves. Each wave's long prompts are its own: whether a
    repeat finds its prompt cached, and where, would depend on when its twin ended."""
    rng = random.Random(5 + wave)
    short = [g.GenerateRequest(prompt=t) for t in ("Name a colour.", "What is two plus two?", "Say hello.")]
    long = [
        g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(n)]))
        for n in (3 * BLOCK_SIZE, 6 * BLOCK_SIZE, 10 * BLOCK_SIZE)
    ]
    for r in short + long:
        r.sampling.max_tokens = MAX_TOKENS
        r.sampling.temperature = 0.0
    return short + long


def generate(address: str, req: g.GenerateRequest) -> tuple[int, int]:
    """One request; (prompt tokens, tokens streamed to us)."""
    streamed, usage = 0, None
    with grpc.insecure_channel(address) as channel:
        for m in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=120):
            streamed += len(m.token_ids)
            if m.finish_reason:
                usage = m.usage
    assert usage is not None
    return usage.prompt_tokens, streamed


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """The model's K and V of every layer, KV heads x head dim, float32."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


# Metrics of events this load has none of, as their families are exposed: a histogram only a live move
# observes (router/moves.py), and the ratios of speculative decoding's counters (0 / 0 on a worker that
# does not speculate).
EVENT_METRICS = {
    "pdserve_router_live_move_pause_seconds": "_bucket{",
    "pdserve_spec_decode_num_accepted_tokens": "_total{",
    "pdserve_spec_decode_num_emitted_tokens": "_total{",
}


def _exposed(urls: list[str], metric: str) -> bool:
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as resp:
            if f"{metric}{EVENT_METRICS[metric]}".encode() in resp.read():
                return True
    return False


def test_every_dashboard_query_returns_data_from_a_real_cluster(
    tmp_path, prometheus_binary, tiny_served_model
):
    prom_port = free_port()
    extra = (
        "--local-prefill-threshold", str(LOCAL_PREFILL_THRESHOLD), "--block-size", str(BLOCK_SIZE),
        "--prometheus", "--prometheus-port", str(prom_port), "--scrape-interval", str(SCRAPE_S),
        # An autoscaler held at one worker per pool: its panels have data, the pools stay as they are.
        "--autoscale", "--prefill-max", "1", "--decode-max", "1", "--autoscale-interval", str(SCRAPE_S),
        # Every prompt at or above the threshold prefilled remotely (the KV-aware policy would prefill a
        # repeated one on the decode worker that caches it), so the bytes below add up per prompt.
        "--routing-policy", "load",
        # A generous heartbeat timeout: on a starved machine a prefill worker dropped for missed
        # heartbeats sends its prompts to the decode worker, and the KV bytes do not add up.
        "--heartbeat-timeout", "15",
    )  # fmt: skip
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        prom = f"http://127.0.0.1:{prom_port}"
        status = c.status()
        urls = [status["router"]["metrics_url"]] + [w["metrics_url"] for w in status["workers"]]
        assert len(urls) == 3 and all(u.startswith("http://") for u in urls), urls
        for u in urls:
            with urllib.request.urlopen(u, timeout=10) as resp:
                assert b"pdserve_info" in resp.read()
        # Every process scraped at least once before the load, so rates see the load's increases.
        wait_for(
            lambda: len([t for t in api(prom, "targets")["activeTargets"] if t["health"] == "up"]) == 4,
            60,
            "Prometheus to scrape the router, both workers and the autoscaler",
        )
        start = time.time()
        work = [r for wave in range(WAVES) for r in requests(wave)]
        with ThreadPoolExecutor(max_workers=len(work) // WAVES) as pool:
            results = list(pool.map(lambda r: generate(c.address, r), work))
        n, streamed = len(results), sum(s for _, s in results)
        remote_tokens = sum(p for p, _ in results if p >= LOCAL_PREFILL_THRESHOLD)
        assert remote_tokens > 0 and any(p < LOCAL_PREFILL_THRESHOLD for p, _ in results)

        # Acceptance 3, through Prometheus once it has scraped the end of the load.
        wait_equal(prom, "sum(pdserve_time_to_first_token_seconds_count)", n)
        wait_equal(prom, "sum(pdserve_generation_tokens_total)", streamed)
        wait_equal(prom, 'sum(pdserve_requests_total{finish_reason=~"stop|length"})', n)
        kv_bytes = remote_tokens * kv_bytes_per_token(tiny_served_model)
        # Bytes sent, and bytes landed: with the blocks the decode worker already cached (and so were not
        # sent), every remote prompt's KV.
        not_sent = "sum(pdserve_kv_transfer_bytes_not_sent_total)"
        for role in ("prefill", "decode"):
            wait_equal(prom, f'sum(pdserve_kv_transfer_bytes_total{{role="{role}"}}) + {not_sent}', kv_bytes)

        # Acceptance 1: every panel's query has data over the load.
        doc = json.loads((DASHBOARD_DIR / "pdserve.json").read_text())
        empty = []
        for title, expr in panel_queries(doc):
            q = expr.replace("$instance", ".*").replace("$__rate_interval", RATE_INTERVAL)
            end = f"{time.time():.3f}"
            data = api(prom, "query_range", query=q, start=f"{start - 5:.3f}", end=end, step="1")
            values = [float(v) for series in data["result"] for _, v in series["values"]]
            if not any(math.isfinite(v) for v in values):
                # Events this load has none of (no stream moves live on 1P+1D, no proposals) give no
                # quantiles or ratios: the family must at least be exposed, so the query names a real
                # metric.
                event = next((m for m in EVENT_METRICS if m in q), None)
                if event is None or not _exposed(urls, event):
                    empty.append(f"{title}: {q}")
        assert empty == [], "panels without data:\n" + "\n".join(empty)
        c.assert_no_leaks()
