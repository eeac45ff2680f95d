"""Metrics, dashboards and the Prometheus config, without a Prometheus server.

- the SLO thresholds are bucket boundaries of the router's histograms;
- the committed dashboards and Prometheus config are what the generators produce;
- every metric a dashboard panel queries is exported by some pdserve process;
- GPU metrics appear with a GPU and degrade quietly to nothing without one;
- after N requests through the router (fake workers, real gRPC and a real
  /metrics endpoint), the router's counts match what the clients received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from pdserve.decode_pool.metrics import DecodeMetrics
from pdserve.deploy.local import prometheus
from pdserve.deploy.local.autoscaler import Metrics as AutoscalerMetrics
from pdserve.prefill_pool.metrics import PrefillMetrics
from pdserve.proto import generation_pb2 as g
from pdserve.router import metrics as rm
from pdserve.telemetry import gpu as gpu_metrics
from pdserve.telemetry.exporter import process_registry, serve_metrics
from pdserve.telemetry.slo import DEFAULT_SLO
from pdserve.worker.role import Role
from tests.fake_workers import FakeWorker, Transfers, ids, make_model_dir
from tests.unit.test_router_server import cluster, collect, run

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("obs-model"))


# ---- what processes export, and what panels query ------------------------------------------------------


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` can expose, labelled children or not."""
    names = set()
    for fam in registry.collect():
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names.update(fam.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(fam.name)
    return names


class FakeNvml:
    """pynvml's calls that ``telemetry.gpu`` makes, for one 8 GiB GPU at 37% utilisation."""

    def __init__(self, devices: int = 1, fail_init: bool = False) -> None:
        self.devices, self.fail_init, self.shutdowns = devices, fail_init, 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(used=1 << 30, total=8 << 30, free=7 << 30)


def kv_transfer_registries() -> list[CollectorRegistry]:
    """The KV transfer's metrics on both sides, made the way the pools make them."""
    from pdserve.kv_transfer.metrics import Role, TransferMetrics

    return [TransferMetrics(role, CollectorRegistry()).registry for role in Role]


def exported_names() -> set[str]:
    """The union of what the router, a prefill, a decode and a colocated worker export (and GPU hosts, and
    the autoscaler of `up --autoscale`)."""
    router = rm.RouterMetrics(process_registry("router", gpu=False))
    router.watch(lambda: 0, lambda: 0, lambda: [])
    prefill = process_registry("prefill", gpu=False)
    PrefillMetrics(prefill)
    decode = process_registry("decode", gpu=False)
    DecodeMetrics(decode, "decode")
    gpu = CollectorRegistry()
    assert gpu_metrics.add_gpu_metrics(gpu, "decode", nvml=FakeNvml())
    autoscaler = process_registry("autoscaler", gpu=False)
    AutoscalerMetrics(autoscaler)
    names: set[str] = set()
    for reg in (router.registry, prefill, decode, gpu, autoscaler, *kv_transfer_registries()):
        names |= sample_names(reg)
    return names


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def queried_metrics(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (identifiers outside strings, matchers, ranges and
    grouping clauses that are not function calls)."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    s = _GROUPING.sub("", s)
    return {m.group() for m in _IDENT.finditer(s) if not s[m.end() :].lstrip().startswith("(")}


def panel_queries(doc: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel of a dashboard (rows included)."""
    out = []
    for panel in doc["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p.get("title", ""), t["expr"]) for t in p.get("targets", [])]
    return out


def unexported(doc: dict, exported: set[str]) -> list[str]:
    return [
        f"{title}: {name}"
        for title, expr in panel_queries(doc)
        for name in sorted(queried_metrics(expr))
        if name not in exported
    ]


# ---- tests -----------------------------------------------------------------------------------------------


def test_slo_thresholds_are_bucket_boundaries_of_the_router_histograms():
    families = {f.name: f for f in rm.RouterMetrics(CollectorRegistry()).registry.collect()}
    checks = {rm.TTFT: DEFAULT_SLO.ttft_s, rm.ITL: DEFAULT_SLO.itl_s, rm.E2E: DEFAULT_SLO.e2e_s}
    for name, threshold in checks.items():
        bounds = {s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")}
        assert floatToGoString(threshold) in bounds, (name, threshold, sorted(bounds))
    assert DEFAULT_SLO.goodput_args() == ["ttft:2000", "tpot:100", "e2el:30000"]


def test_committed_dashboards_are_the_generators_output():
    from pdserve.deploy.grafana import dashboards

    generated = dashboards.dashboards()
    assert sorted(generated) == sorted(p.name for p in DASHBOARD_DIR.glob("*.json"))
    for name, doc in generated.items():
        committed = (DASHBOARD_DIR / name).read_text()
        assert committed == dashboards.render(doc), (
            f"{name} is stale: run `python -m pdserve.deploy.grafana.dashboards`"
        )
    # The check itself notices a difference.
    doc = json.loads((DASHBOARD_DIR / "pdserve.json").read_text())
    doc["panels"][1]["targets"][0]["expr"] += " * 2"
    assert dashboards.render(doc) != dashboards.render(generated["pdserve.json"])


def test_dashboards_have_the_variables_and_the_panels_the_issue_lists():
    doc = json.loads((DASHBOARD_DIR / "pdserve.json").read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    titles = {p["title"] for p in doc["panels"]}
    for wanted in (
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Requests by finish reason",
        "Queue depth",
        "Workers by role and state",
        "KV cache usage per decode worker",
        "KV transfer throughput",
        "KV transfer latency",
        "Prefill time",
        "Decode batch size",
        "Tokens per second",
    ):
        assert wanted in titles
    for title, expr in panel_queries(doc):
        assert 'instance=~"$instance"' in expr, (title, expr)  # every query follows the instance variable
    legends = {
        t["legendFormat"] for p in doc["panels"] if p["title"] == "Time to first token" for t in p["targets"]
    }
    assert legends == {"p50", "p90", "p99"}


def test_every_panel_queries_a_metric_some_process_exports():
    exported = exported_names()
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        doc = json.loads(path.read_text())
        assert panel_queries(doc), path
        assert unexported(doc, exported) == [], path.name
    # The check catches a panel querying a metric nobody exports.
    bad = {
        "panels": [
            {"title": "typo", "targets": [{"expr": 'sum(rate(pdserve_nonexistent_total{a="b"}[1m]))'}]}
        ]
    }
    assert unexported(bad, exported) == ["typo: pdserve_nonexistent_total"]
    assert queried_metrics(
        'histogram_quantile(0.5, sum by (le, role) (rate(x_bucket{le="1"}[5m]))) / sum(y)'
    ) == {"x_bucket", "y"}


def test_gpu_metrics_only_with_a_gpu_and_quietly_without(caplog):
    caplog.set_level(logging.DEBUG, logger="pdserve.telemetry.gpu")
    # This machine: nvidia-ml-py is installed, but there is no driver or device.
    reg = CollectorRegistry()
    assert gpu_metrics.add_gpu_metrics(reg, "decode") is False
    assert not any(n.startswith("pdserve_gpu") for n in sample_names(reg))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for nvml in (FakeNvml(fail_init=True), FakeNvml(devices=0)):
        reg = CollectorRegistry()
        assert gpu_metrics.add_gpu_metrics(reg, "decode", nvml=nvml) is False and not sample_names(reg)
    # With a GPU: utilisation and memory per device, read at scrape time.
    reg = CollectorRegistry()
    assert gpu_metrics.add_gpu_metrics(reg, "decode", nvml=FakeNvml(devices=2))
    values = {(s.name, s.labels["gpu"]): s.value for f in reg.collect() for s in f.samples}
    assert values[(gpu_metrics.GPU_UTILIZATION, "1")] == pytest.approx(0.37)
    assert values[(gpu_metrics.GPU_MEMORY_TOTAL, "0")] == 8 << 30
    assert values[(gpu_metrics.GPU_MEMORY_USED, "0")] == 1 << 30


def test_metrics_endpoint_serves_the_registry_and_releases_its_port():
    reg = process_registry("decode", gpu=False)
    DecodeMetrics(reg, "decode").observe_step(0.02, 3)
    with serve_metrics(reg) as ep:
        assert ep.url == f"http://127.0.0.1:{ep.port}/metrics"
        with urllib.request.urlopen(ep.url, timeout=10) as resp:
            text = resp.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["pdserve_info"].samples[0].labels["role"] == "decode"
    assert [s.value for s in fams["pdserve_decode_batch_size"].samples if s.name.endswith("_sum")] == [3.0]
    with pytest.raises(OSError):
        urllib.request.urlopen(ep.url, timeout=2)


def test_a_decoding_workers_local_prefills_are_prefill_time_not_decode_steps():
    from pdserve.engine.scheduler import Batch, BatchKind, ScheduledSeq

    def items(*tokens: int) -> tuple[ScheduledSeq, ...]:
        return tuple(ScheduledSeq(None, 0, t, True) for t in tokens)  # type: ignore[arg-type]

    reg = CollectorRegistry()
    m = DecodeMetrics(reg, "both")
    m.observe_batch(0.5, Batch(BatchKind.PREFILL, items(100, 20)))
    m.observe_batch(0.01, Batch(BatchKind.DECODE, items(1, 1, 1), 3))
    m.observe_batch(0.2, Batch(BatchKind.MIXED, items(1, 1, 30), 2))
    get = reg.get_sample_value
    both = {"role": "both"}
    assert get("pdserve_prefill_time_seconds_count", both) == 1
    assert get("pdserve_prefill_time_seconds_sum", both) == pytest.approx(0.5)
    assert get("pdserve_prefill_tokens_total", both) == 150  # 120 alone + 30 in the mixed step
    assert get("pdserve_decode_step_seconds_count", both) == 2
    assert get("pdserve_decode_step_seconds_sum", both) == pytest.approx(0.21)
    assert get("pdserve_decode_batch_size_sum", both) == 5


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"role": "router", **labels}.items()))]


def test_router_counts_match_what_clients_received(model_dir):
    """N requests, local and remote routes: TTFT count == N, generation tokens == tokens streamed."""

    async def main():
        transfers = Transfers()
        out = ids("hello world the cat sat")
        p = FakeWorker("p1", Role.PREFILL, out, transfers=transfers)
        d = FakeWorker("d1", Role.DECODE, out, transfers=transfers)
        async with cluster(model_dir, [p, d], local_prefill_threshold=3) as (server, stub):
            prompts = ["hello", "hello world the", "the cat sat on the mat", "a b", "a b c"]
            results = await asyncio.gather(
                *(collect(stub.Generate(g.GenerateRequest(prompt=t), timeout=30)) for t in prompts)
            )
            streamed = sum(len(toks) for toks, _, _ in results)
            # One request cancelled by its client after its first token: counted as an abort.
            d.hold_at = 1
            call = stub.Generate(g.GenerateRequest(prompt="hello world"), timeout=30)
            assert (await call.read()).token_ids
            call.cancel()
            await d.wait_for(lambda: d.cancelled)
            d.hold_at = None
            d.release.set()
            # Refused before admission: counted as "rejected", no TTFT, no prompt tokens.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(g.GenerateRequest(prompt=""), timeout=30).read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            router = server.router
            while router.ledger.jobs:
                await asyncio.sleep(0.01)
            samples = await asyncio.to_thread(scrape, router.metrics_url)
            return prompts, streamed + 1, samples

    prompts, streamed, s = run(main())
    n = len(prompts)
    assert value(s, rm.TTFT + "_count") == n + 1
    assert value(s, rm.GENERATION_TOKENS) == streamed
    assert value(s, rm.REQUESTS, finish_reason="length") == n
    assert value(s, rm.REQUESTS, finish_reason="abort") == 1
    assert value(s, rm.REQUESTS, finish_reason="error") == 0
    assert value(s, rm.REQUESTS, finish_reason="rejected") == 1
    assert value(s, rm.QUEUE_TIME + "_count") == n + 1
    # ITL is observed per token message after the first: 4 per finished request (5 tokens, one per message).
    assert value(s, rm.ITL + "_count") == 4 * n
    assert value(s, rm.E2E + "_count") == n
    assert value(s, rm.PROMPT_TOKENS) == sum(len(t.split()) for t in prompts) + 2
    assert value(s, rm.RUNNING) == 0 and value(s, rm.WAITING) == 0
    assert s[(rm.WORKERS, frozenset({"role": "decode", "state": "ready"}.items()))] == 1
    assert s[(rm.WORKERS, frozenset({"role": "prefill", "state": "ready"}.items()))] == 1
    assert s[(rm.WORKERS, frozenset({"role": "both", "state": "ready"}.items()))] == 0


def test_request_outcomes_of_errors():
    assert rm.outcome_of(asyncio.CancelledError()) == "abort"
    assert rm.outcome_of(SimpleNamespace(code=grpc.StatusCode.DEADLINE_EXCEEDED)) == "abort"  # type: ignore[arg-type]
    assert rm.outcome_of(SimpleNamespace(code=grpc.StatusCode.UNAVAILABLE)) == "error"  # type: ignore[arg-type]
    assert rm.outcome_of(RuntimeError("boom")) == "error"
    # aiohttp's ClientConnectionResetError: an HTTP client gone mid-stream.
    assert rm.outcome_of(ConnectionResetError("Cannot write to closing transport")) == "abort"


def test_a_message_is_recorded_once_written_and_only_as_far_as_it_was_delivered():
    reg = CollectorRegistry()
    m = rm.RouterMetrics(reg)
    msg = SimpleNamespace(token_ids=[7], finish_reason="")

    async def failing(_msg) -> None:
        raise ConnectionResetError("gone")

    async def held(_msg) -> bool:
        return False  # its text is held back: the client saw nothing of it

    async def sent(_msg) -> None:
        return None

    async def main():
        rec = rm.RequestRecord(m, time.monotonic())
        with pytest.raises(ConnectionResetError):
            await rec.wrap(failing)(msg)
        await rec.wrap(held)(msg)
        assert rec.last_token is None  # neither a first token nor a gap yet
        await rec.wrap(sent)(msg)
        await rec.wrap(sent)(SimpleNamespace(token_ids=[8], finish_reason="length"))

    asyncio.run(main())
    get = reg.get_sample_value
    assert get("pdserve_time_to_first_token_seconds_count", {"role": "router"}) == 1
    assert get("pdserve_inter_token_latency_seconds_count", {"role": "router"}) == 1
    assert get("pdserve_generation_tokens_total", {"role": "router"}) == 3  # the held one, delivered later


def test_a_client_cancelling_as_the_final_message_goes_is_a_finished_request():
    """Exploratory testing: a client breaking out of its loop on finish_reason cancels the call while the
    final message's write is still pending (it has the message): counted as abort, 1 in 4. The finish is
    the request's now; a cancel during any earlier message is still an abort."""
    reg = CollectorRegistry()
    m = rm.RouterMetrics(reg)

    async def cancelled(_msg) -> None:
        raise asyncio.CancelledError

    async def sent(_msg) -> None:
        return None

    async def one(last_cancelled: bool) -> None:
        with m.request(time.monotonic(), 3) as rec:
            await rec.wrap(sent)(SimpleNamespace(token_ids=[7], finish_reason=""))
            write = cancelled if last_cancelled else sent
            await rec.wrap(write)(SimpleNamespace(token_ids=[8], finish_reason="length"))

    async def early() -> None:
        with m.request(time.monotonic(), 3) as rec:
            await rec.wrap(cancelled)(SimpleNamespace(token_ids=[7], finish_reason=""))

    for coro in (one(True), one(False), early()):
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(coro)
    get = reg.get_sample_value
    assert get("pdserve_requests_total", {"role": "router", "finish_reason": "length"}) == 2
    assert get("pdserve_requests_total", {"role": "router", "finish_reason": "abort"}) == 1
    assert get("pdserve_generation_tokens_total", {"role": "router"}) == 4


def test_targets_file_lists_every_process_with_a_metrics_url(tmp_path):
    from pdserve.proto import worker_pb2

    def entry(wid: str, url: str) -> worker_pb2.WorkerEntry:
        return worker_pb2.WorkerEntry(info=worker_pb2.WorkerInfo(worker_id=wid, metrics_url=url))

    status = worker_pb2.ClusterStatus(
        metrics_url="http://127.0.0.1:9400/metrics",
        workers=[
            entry("prefill-1", "http://h1:9501/metrics"),
            entry("decode-2", ""),
            entry("both-3", "http://[::1]:7/metrics"),
        ],
    )
    groups = prometheus.targets(status)
    assert groups == [
        {"targets": ["127.0.0.1:9400"], "labels": {"worker": "router"}},
        {"targets": ["[::1]:7"], "labels": {"worker": "both-3"}},
        {"targets": ["h1:9501"], "labels": {"worker": "prefill-1"}},
    ]
    path = prometheus.write_targets(tmp_path, groups)
    assert path == tmp_path / "prometheus" / "targets.json" and json.loads(path.read_text()) == groups
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]  # no temporary file left behind
