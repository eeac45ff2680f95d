"""The alert rules under promtool, and the failure gauge a worker that cannot load its model exports."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.grafana import alerts
from tests.e2e.cluster_harness import free_port
from tests.e2e.test_observability_prometheus import prometheus_binary  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
_LABEL_REF = re.compile(r"\{\{ \$labels\.(\w+) \}\}")


def by_name() -> dict[str, alerts.Alert]:
    return {a.name: a for a in alerts.alerts()}


# ---- promtool test rules ----------------------------------------------------------------------------------
# Each case: the alert, input series (1 minute apart), when to evaluate, and the alerts expected then
# (their labels beyond alertname and severity; an empty list: silent).


def _hist(name: str, counts: dict[str, str]) -> list[dict[str, str]]:
    return [
        {"series": f'{name}_bucket{{role="router",instance="r:1",le="{le}"}}', "values": v}
        for le, v in counts.items()
    ]


TTFT, ITL = "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds"
PREFILL_READY = 'pdserve_workers{role="prefill",state="ready"}'
DECODE_READY = 'pdserve_workers{role="decode",state="ready"}'
EXPECT_PREFILL = 'pdserve:workers_expected{role="prefill"}'
EXPECT_DECODE = 'pdserve:workers_expected{role="decode"}'
KV_FAIL = 'pdserve_kv_transfer_failures_total{{role="prefill",instance="p:1",reason="{}"}}'
REJECTED = 'pdserve_requests_rejected_total{{role="router",code="{}"}}'
FINISHED = 'pdserve_requests_total{{role="router",finish_reason="{}"}}'

CASES: list[tuple[str, list[dict[str, str]], str, list[dict[str, str]]]] = [
    # p99 TTFT: every request between 2 s (the SLO) and 3 s, for 15 minutes
    ("PdserveTimeToFirstTokenHigh", _hist(TTFT, {"1": "0x20", "2": "0x20", "3": "0+10x20",
                                                 "+Inf": "0+10x20"}), "15m", [{}]),
    ("PdserveTimeToFirstTokenHigh", _hist(TTFT, {"1": "0+10x20", "2": "0+10x20", "3": "0+10x20",
                                                 "+Inf": "0+10x20"}), "15m", []),
    ("PdserveInterTokenLatencyHigh", _hist(ITL, {"0.05": "0x20", "0.1": "0x20", "0.2": "0+50x20",
                                                 "+Inf": "0+50x20"}), "15m", [{}]),
    ("PdserveInterTokenLatencyHigh", _hist(ITL, {"0.05": "0+50x20", "0.1": "0+50x20", "0.2": "0+50x20",
                                                 "+Inf": "0+50x20"}), "15m", []),
    # KV cache: one worker full for 15 minutes, another half full
    ("PdserveKVCacheUsageHigh", [
        {"series": 'pdserve_kv_cache_usage_ratio{role="decode",instance="d:1"}', "values": "0.95x20"},
        {"series": 'pdserve_kv_cache_usage_ratio{role="decode",instance="d:2"}', "values": "0.5x20"},
    ], "15m", [{"instance": "d:1"}]),
    # ... full for 3 minutes only: not "for minutes"
    ("PdserveKVCacheUsageHigh", [
        {"series": 'pdserve_kv_cache_usage_ratio{role="decode",instance="d:1"}', "values": "0.95x3 0.5x17"},
    ], "15m", []),
    ("PdserveDecodePreemptions", [
        {"series": 'pdserve_decode_preemptions_total{role="decode",instance="d:1"}', "values": "0+3x20"},
    ], "15m", [{"instance": "d:1"}]),
    # preemptions long ago, none since
    ("PdserveDecodePreemptions", [
        {"series": 'pdserve_decode_preemptions_total{role="decode",instance="d:1"}', "values": "0 5 7x18"},
    ], "15m", []),
    ("PdserveWorkerStepsFailing", [
        {"series": 'pdserve_failed_steps_total{role="decode",instance="d:1"}', "values": "0x4 1x16"},
        {"series": 'pdserve_failed_steps_total{role="prefill",instance="p:1"}', "values": "0x20"},
    ], "6m", [{"instance": "d:1", "role": "decode"}]),
    # one failure long ago: over once it is out of the window
    ("PdserveWorkerStepsFailing", [
        {"series": 'pdserve_failed_steps_total{role="decode",instance="d:1"}', "values": "0x4 1x16"},
    ], "15m", []),
    ("PdserveKVTransferFailures", [
        {"series": KV_FAIL.format("peer_died"), "values": "0x4 1x16"},
        {"series": KV_FAIL.format("aborted"), "values": "0+5x20"},
    ], "7m", [{"instance": "p:1", "role": "prefill", "reason": "peer_died"}]),
    # client cancels abort transfers on purpose: not a page
    ("PdserveKVTransferFailures", [
        {"series": KV_FAIL.format("peer_died"), "values": "0x20"},
        {"series": KV_FAIL.format("aborted"), "values": "0+5x20"},
    ], "15m", []),
    # the prefill worker died at minute 5: 0 ready of 1 expected; decode is whole
    ("PdserveWorkersBelowExpected", [
        {"series": PREFILL_READY, "values": "1x5 0x15"},
        {"series": DECODE_READY, "values": "1x20"},
        {"series": EXPECT_PREFILL, "values": "1x20"},
        {"series": EXPECT_DECODE, "values": "1x20"},
    ], "15m", [{"role": "prefill"}]),
    # the router itself is gone: no worker is ready anywhere
    ("PdserveWorkersBelowExpected", [
        {"series": EXPECT_PREFILL, "values": "1x20"},
        {"series": EXPECT_DECODE, "values": "2x20"},
    ], "15m", [{"role": "decode"}, {"role": "prefill"}]),
    # a restart of 3 minutes (shorter than `for`), and a deliberate scale-down (expected follows)
    ("PdserveWorkersBelowExpected", [
        {"series": PREFILL_READY, "values": "1x5 0x3 1x12"},
        {"series": DECODE_READY, "values": "2x5 1x15"},
        {"series": EXPECT_PREFILL, "values": "1x20"},
        {"series": EXPECT_DECODE, "values": "2x5 1x15"},
    ], "15m", []),
    # the worker set the gauge, lingered two minutes and exited (its series goes stale)
    ("PdserveModelLoadFailed", [
        {"series": 'pdserve_model_load_failed{role="decode",instance="d:3"}', "values": "0 1 1 _x17"},
    ], "5m", [{"instance": "d:3", "role": "decode"}]),
    # ... and ten minutes later the alert has cleared
    ("PdserveModelLoadFailed", [
        {"series": 'pdserve_model_load_failed{role="decode",instance="d:3"}', "values": "0 1 1 _x17"},
    ], "15m", []),
    ("PdserveModelLoadFailed", [
        {"series": 'pdserve_model_load_failed{role="decode",instance="d:1"}', "values": "0x20"},
    ], "15m", []),
    # one request in six refused for a full queue
    ("PdserveRouterRefusingRequests", [
        {"series": REJECTED.format("RESOURCE_EXHAUSTED"), "values": "0+10x20"},
        {"series": FINISHED.format("stop"), "values": "0+50x20"},
        {"series": FINISHED.format("rejected"), "values": "0+10x20"},
    ], "15m", [{}]),
    # the same number refused for bad input (the clients' fault): no page
    ("PdserveRouterRefusingRequests", [
        {"series": REJECTED.format("INVALID_ARGUMENT"), "values": "0+10x20"},
        {"series": REJECTED.format("RESOURCE_EXHAUSTED"), "values": "0x20"},
        {"series": REJECTED.format("UNAVAILABLE"), "values": "0x20"},
        {"series": FINISHED.format("stop"), "values": "0+50x20"},
        {"series": FINISHED.format("rejected"), "values": "0+10x20"},
    ], "15m", []),
]  # fmt: skip


def _annotations(alert: alerts.Alert, labels: dict[str, str]) -> dict[str, str]:
    def fill(text: str) -> str:
        return _LABEL_REF.sub(lambda m: labels[m.group(1)], text)

    return {"summary": fill(alert.summary), "runbook": fill(alert.runbook)}


def promtool_tests(rule_file: Path, cases=CASES, rules=None) -> dict:
    rules = rules or by_name()
    tests = []
    for name, series, at, expected in cases:
        alert = rules[name]
        exp = []
        for extra in expected:
            labels = {"severity": alert.severity, **extra}
            exp.append({"exp_labels": labels, "exp_annotations": _annotations(alert, labels)})
        tests.append(
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": exp}],
            }
        )
    return {"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": tests}


@pytest.fixture(scope="module")
def promtool(prometheus_binary) -> str:  # noqa: F811 - the fixture imported above
    path = Path(prometheus_binary).with_name("promtool")
    if not path.is_file():
        pytest.skip(f"promtool is not next to {prometheus_binary}")
    return str(path)


def run_promtool(promtool: str, tmp_path: Path, doc: dict) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)


def test_every_rule_fires_and_stays_silent_under_promtool(promtool, tmp_path):
    fires = {name for name, _, _, exp in CASES if exp}
    silent = {name for name, _, _, exp in CASES if not exp}
    assert fires == silent == set(by_name()), "every rule needs a firing and a silent case"
    check = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    done = run_promtool(promtool, tmp_path, promtool_tests(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_fails_a_wrong_expectation(promtool, tmp_path):
    """The cases are really checked: a silent case that expects an alert, and a firing one that does
    not, each make promtool fail."""
    firing = next(c for c in CASES if c[3])
    silent = next(c for c in CASES if not c[3] and c[0] == firing[0])
    for name, series, at, exp in (firing, silent):
        wrong = [(name, series, at, [] if exp else [{}])]
        done = run_promtool(promtool, tmp_path, promtool_tests(RULES, wrong))
        assert done.returncode != 0, done.stdout


def test_workers_expected_rules_are_valid_for_promtool(promtool, tmp_path):
    for counts in ({"prefill": 2, "decode": 1, "both": 0}, {}):
        path = tmp_path / "workers_expected.yml"
        path.write_text(alerts.workers_expected_rules(counts))
        done = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


# ---- a worker whose model does not load ------------------------------------------------------------------


def _scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except (urllib.error.URLError, OSError):
        return ""


@pytest.mark.slow
def test_a_worker_that_cannot_load_its_model_exports_the_failure_while_it_lingers(tmp_path):
    port = free_port()
    argv = [
        sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode", "--router", "127.0.0.1:9",
        "--model", str(tmp_path / "no-such-model"), "--metrics-port", str(port),
        "--load-failure-linger", "120",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, line = f"http://127.0.0.1:{port}/metrics", 'pdserve_model_load_failed{role="decode"} 1.0'
        give_up = time.monotonic() + 120
        while line not in _scrape(url):
            assert proc.poll() is None, f"the worker exited before its failure was scraped: {proc.stdout}"
            assert time.monotonic() < give_up, "pdserve_model_load_failed never became 1"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # ends the linger at once
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode != 0, out
        assert "could not load model" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
