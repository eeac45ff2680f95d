"""pdserve's Prometheus alert rules, generated like the dashboards from the names the code exports.

    .venv/bin/python -m pdserve.deploy.grafana.alerts          # rewrite deploy/prometheus/alerts.yml
    .venv/bin/python -m pdserve.deploy.grafana.alerts --check  # exit 1 when the committed file is stale
The SLO thresholds come from ``telemetry.slo``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

# Every metric name comes from the module that defines it, so a rename there is a rename here.
from pdserve.decode_pool import metrics as dm
from pdserve.deploy.grafana import panels
from pdserve.router import metrics as rm
from pdserve.telemetry import exporter
from pdserve.telemetry import prefill as prefill_metrics
from pdserve.telemetry.slo import DEFAULT_SLO, SloThresholds

OUT_FILE = Path(__file__).resolve().parent.parent / "prometheus" / "alerts.yml"
GROUP = "pdserve"
# What the deployment says each pool should have, compared with the ready workers the router counts:
# ``pdserve up``/``scale`` write it as a recording-rule file (``workers_expected_rules``), and on Kubernetes
# a recording rule derives it from kube-state-metrics (deploy/kubernetes/README.md). Without it the
# worker-count alert stays silent.
WORKERS_EXPECTED = "pdserve:workers_expected"
KV_CACHE_HIGH = 0.9  # fraction of a decode worker's KV blocks in use
REFUSED_FRACTION = 0.05  # of the router's requests refused with RESOURCE_EXHAUSTED / UNAVAILABLE
WINDOW = "5m"  # rate window of every rate-based rule


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_s: float
    severity: str  # page (someone acts now) | ticket (look today)
    # Only ``$labels``, never ``$value``, so promtool's tests state it exactly; the dashboards show values.
    summary: str
    runbook: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name.startswith("Pdserve") or self.severity not in ("page", "ticket"):
            raise ValueError(f"bad alert {self.name!r} (severity {self.severity!r})")
        if self.for_s < 0:
            raise ValueError(f"{self.name}: for must be >= 0")


def _p99(histogram: str) -> str:
    return f'histogram_quantile(0.99, sum by (le) (rate({histogram}_bucket{{role="router"}}[{WINDOW}])))'


def alerts(slo: SloThresholds = DEFAULT_SLO) -> tuple[Alert, ...]:
    # Every router counts every worker (each keeps its own registry): the workers ready are the most any
    # router sees, not the sum over routers.
    ready = f'max by (role) (sum by (role, instance) ({rm.WORKERS}{{state="ready"}}))'
    expected = f"sum by (role) ({WORKERS_EXPECTED})"
    refused = f'{rm.REJECTED}{{code=~"RESOURCE_EXHAUSTED|UNAVAILABLE"}}'
    return (
        Alert(
            "PdserveTimeToFirstTokenHigh",
            f"{_p99(rm.TTFT)} > {slo.ttft_s:g}",
            300,
            "page",
            f"p99 time to first token has been over its {slo.ttft_s:g}s SLO for 5 minutes",
            "Check the serving dashboard: a long router queue (Requests waiting) means too few decode "
            "workers or KV blocks: scale the decode pool; a high prefill queue means scale the prefill "
            "pool; slow KV transfers point at the network between the pools.",
        ),
        Alert(
            "PdserveInterTokenLatencyHigh",
            f"{_p99(rm.ITL)} > {slo.itl_s:g}",
            300,
            "page",
            f"p99 inter-token latency has been over its {slo.itl_s:g}s SLO for 5 minutes",
            "Decode is slow: look at decode batch size and step time; scale the decode pool or lower "
            "--max-running; colocated workers stall decodes behind prefills (use separate pools).",
        ),
        Alert(
            "PdserveKVCacheUsageHigh",
            f"max by (instance) ({dm.KV_CACHE_USAGE}) > {KV_CACHE_HIGH:g}",
            300,
            "ticket",
            f"decode worker {{{{ $labels.instance }}}} has used over {KV_CACHE_HIGH:.0%} of its KV cache "
            "for 5 minutes",
            "New requests queue and running ones get preempted soon: add decode workers or give each a "
            "larger KV cache (--kv-cache-mib / --kv-blocks).",
        ),
        Alert(
            "PdserveDecodePreemptions",
            f"sum by (instance) (rate({dm.DECODE_PREEMPTIONS}[{WINDOW}])) > 0",
            600,
            "ticket",
            "decode worker {{ $labels.instance }} has been preempting sequences for 10 minutes",
            "Preempted sequences give up their KV blocks and are recomputed, wasting work: the decode "
            "pool is short of KV cache; scale it out or raise --kv-cache-mib.",
        ),
        Alert(
            "PdserveWorkerStepsFailing",
            f"sum by (instance, role) (increase({prefill_metrics.FAILED_STEPS}[{WINDOW}])) > 0",
            0,
            "ticket",
            "engine steps or prefill forwards fail on {{ $labels.role }} worker {{ $labels.instance }}",
            "Their requests moved to another worker, but something breaks forwards: read the worker's log "
            "for the exception (a prompt that breaks the model, out of memory, a device error). Three in a "
            "row within a minute and the worker drains and exits (PdserveWorkersBelowExpected follows).",
        ),
        Alert(
            "PdserveKVTransferFailures",
            # "aborted" is a side giving up on purpose (a client cancel): not a fault.
            f"sum by (instance, role, reason) (increase({panels.KV_TRANSFER_FAILURES}"
            f'{{reason!="aborted"}}[{WINDOW}])) > 0',
            60,
            "page",
            "KV transfers fail on {{ $labels.instance }} ({{ $labels.role }} side, reason "
            "{{ $labels.reason }})",
            "Requests whose KV did not arrive fail or are retried: check the worker logs for the reason, "
            "that prefill and decode workers reach each other (UCX ports, pod network) and that every "
            "worker runs the same model, dtype and block size (compatibility hash).",
        ),
        Alert(
            "PdserveWorkersBelowExpected",
            f"({ready} or on (role) 0 * {expected}) < on (role) {expected}",
            300,
            "page",
            "fewer {{ $labels.role }} workers are ready than the cluster should have",
            "`pdserve status` (or `kubectl get pods -l app.kubernetes.io/component=...`) shows which "
            "are missing: read the logs of workers that exited or stay loading; `pdserve scale` (or "
            "the Deployment) brings the count back.",
        ),
        Alert(
            "PdserveModelLoadFailed",
            f"max by (instance, role) (max_over_time({exporter.MODEL_LOAD_FAILED}[10m])) > 0",
            0,
            "page",
            "a {{ $labels.role }} worker ({{ $labels.instance }}) failed to load its model",
            "Read that worker's log: a wrong --model name or path, a missing or corrupt file, or too "
            "little memory (GPU memory on the gpu overlay). It will not serve until fixed.",
        ),
        Alert(
            "PdserveRouterRefusingRequests",
            f"sum(rate({refused}[{WINDOW}])) / sum(rate({rm.REQUESTS}[{WINDOW}])) > {REFUSED_FRACTION:g}",
            300,
            "page",
            f"the router has refused over {REFUSED_FRACTION:.0%} of requests (RESOURCE_EXHAUSTED or "
            "UNAVAILABLE) for 5 minutes",
            "RESOURCE_EXHAUSTED: pdserve_router_admission_refused_total{reason} says which bound refused "
            "them: the router's queue (--max-waiting), a prefill worker's queue (--max-prefill-queue-tokens) "
            "or the time-to-first-token budget (--admission-ttft-s): the pool that prefills is short, add "
            "prefill workers; UNAVAILABLE: no worker can take requests: see PdserveWorkersBelowExpected and "
            "`pdserve status`.",
        ),
    )


def _duration(seconds: float) -> str:
    ms = round(seconds * 1000)
    if ms % 60000 == 0:
        return f"{ms // 60000}m"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _q(text: str) -> str:
    """A YAML double-quoted scalar (a JSON string is one)."""
    return json.dumps(text)


def render(rules: Sequence[Alert], for_override_s: float | None = None) -> str:
    """The rule file. ``for_override_s`` replaces every ``for`` (a test or a demo that must fire fast)."""
    out = [
        "# pdserve alert rules. Generated by deploy/grafana/alerts.py: do not edit by hand;",
        "# `python -m pdserve.deploy.grafana.alerts` rewrites it and tests/unit/test_alerts.py checks it.",
        "groups:",
        f"  - name: {GROUP}",
        "    rules:",
    ]
    for a in rules:
        if for_override_s is not None:
            a = replace(a, for_s=for_override_s)
        out += [
            f"      - alert: {a.name}",
            f"        expr: {_q(a.expr)}",
            f"        for: {_duration(a.for_s)}",
            "        labels:",
            f"          severity: {a.severity}",
            *(f"          {k}: {_q(v)}" for k, v in sorted(a.labels.items())),
            "        annotations:",
            f"          summary: {_q(a.summary)}",
            f"          runbook: {_q(a.runbook)}",
        ]
    return "\n".join(out) + "\n"


def workers_expected_rules(counts: Mapping[str, int]) -> str:
    """Recording rules that say how many workers of each role the cluster should have (``pdserve up``
    and ``scale`` write them for their Prometheus; an empty mapping: no expectation, a stopped cluster)."""
    out = ["# How many workers of each role this cluster should have. Written by `pdserve up`/`scale`."]
    if not counts:
        return "\n".join([*out, "groups: []"]) + "\n"
    out += ["groups:", "  - name: pdserve-workers-expected", "    rules:"]
    for role, n in sorted(counts.items()):
        out += [
            f"      - record: {WORKERS_EXPECTED}",
            f"        expr: vector({int(n)})",
            "        labels:",
            f"          role: {role}",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_FILE)
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = ap.parse_args(argv)
    text = render(alerts())
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"stale (run `python -m pdserve.deploy.grafana.alerts`): {args.out}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
