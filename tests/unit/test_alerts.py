"""The alert rules, without a cluster or a tool: the committed file and the metric names they read.

- ``deploy/prometheus/alerts.yml`` is what ``deploy/grafana/alerts.py`` generates;
- every metric a rule reads is one the router or a worker really exports;
- ``up`` and ``scale`` write the expected worker counts; ``up --alertmanager`` without the binary refuses.

``promtool test rules`` and a lingering worker's gauge: ``tests/e2e/test_alerts_processes.py``; a real
Prometheus and Alertmanager: ``tests/e2e/test_alerts_e2e.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pdserve.deploy.grafana import alerts
from pdserve.deploy.local import alertmanager, cluster
from pdserve.telemetry import exporter
from tests.unit.test_observability import exported_names, queried_metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMQL_WORDS = {"or", "and", "unless", "bool"}
_MATCHING = re.compile(r"\b(?:on|ignoring|group_left|group_right)\s*\([^)]*\)")


def by_name() -> dict[str, alerts.Alert]:
    return {a.name: a for a in alerts.alerts()}


def test_committed_rules_are_the_generators_output():
    assert RULES.read_text() == alerts.render(alerts.alerts()), (
        "deploy/prometheus/alerts.yml is stale: run `python -m pdserve.deploy.grafana.alerts`"
    )
    assert alerts.main(["--check"]) == 0


def test_rules_read_only_metrics_the_processes_export():
    reg = CollectorRegistry()
    exporter.model_load_gauge(reg, "decode")
    exported = exported_names() | {exporter.MODEL_LOAD_FAILED, alerts.WORKERS_EXPECTED}
    read = {a.name: queried_metrics(_MATCHING.sub("", a.expr)) - PROMQL_WORDS for a in alerts.alerts()}
    missing = {name: sorted(names - exported) for name, names in read.items() if names - exported}
    assert missing == {}
    assert exporter.MODEL_LOAD_FAILED in {f.name for f in reg.collect()}
    # What the issue asks for, each with a summary and a runbook line.
    assert set(by_name()) == {
        "PdserveTimeToFirstTokenHigh",
        "PdserveInterTokenLatencyHigh",
        "PdserveKVCacheUsageHigh",
        "PdserveDecodePreemptions",
        "PdserveWorkerStepsFailing",
        "PdserveKVTransferFailures",
        "PdserveWorkersBelowExpected",
        "PdserveModelLoadFailed",
        "PdserveRouterRefusingRequests",
    }
    assert all(a.summary and a.runbook for a in alerts.alerts())


def test_short_for_override_renders_every_rule_with_it():
    text = alerts.render(alerts.alerts(), for_override_s=2)
    doc = yaml.safe_load(text)
    assert {r["for"] for r in doc["groups"][0]["rules"]} == {"2s"}
    assert (
        alerts._duration(300) == "5m" and alerts._duration(0.5) == "500ms" and alerts._duration(90) == "90s"
    )


def test_up_and_scale_write_the_expected_counts_and_report_a_change(tmp_path):
    from pdserve.deploy.local import prometheus

    assert prometheus.write_expected(tmp_path, {"prefill": 1, "decode": 1}) is True
    assert prometheus.write_expected(tmp_path, {"prefill": 1, "decode": 1}) is False  # no reload needed
    doc = yaml.safe_load(prometheus.expected_path(tmp_path).read_text())
    rules = doc["groups"][0]["rules"]
    assert {(r["labels"]["role"], r["expr"]) for r in rules} == {
        ("prefill", "vector(1)"),
        ("decode", "vector(1)"),
    }
    assert prometheus.write_expected(tmp_path, {}) is True
    assert yaml.safe_load(prometheus.expected_path(tmp_path).read_text()) == {"groups": []}


def test_up_refuses_alertmanager_it_cannot_find_before_starting_anything(tmp_path, monkeypatch):
    """Without the binary, `up --alertmanager` says how to get it; nothing is left running."""
    monkeypatch.setattr(alertmanager, "find_binary", lambda: None)
    from pdserve.cli import monitoring

    with pytest.raises(cluster.ClusterError, match="make alertmanager"):
        monitoring.start_alertmanager(tmp_path, None, "127.0.0.1:1")  # type: ignore[arg-type]
