"""Acceptance: the worker-count alert fires at a real Alertmanager when a worker dies, and resolves.

``pdserve up --alertmanager`` starts a 1 prefill + 1 decode cluster (the real
pools, serving the tiny served model), Debian's Prometheus loading ``deploy/prometheus/alerts.yml``
(every ``for`` shortened to 2 s with ``--alert-for``; scrape and evaluation
every second) and Debian's Alertmanager, all on loopback. Then:

- with every worker up, ``PdserveWorkersBelowExpected`` is silent;
- SIGKILL of the prefill worker: the router drops it after its heartbeat
  timeout, and the alert reaches Alertmanager (read back through
  ``/api/v2/alerts``) labelled ``role=prefill``;
- ``pdserve scale --prefill 1`` starts a new one: the alert resolves there.

The binaries come from ``make prometheus`` / ``make alertmanager``; the fixtures
unpack them the same way when missing and skip, saying why, when they cannot.
Every process (cluster, Prometheus, Alertmanager) is stopped by the cluster
harness even when the test fails, and the test checks they are gone; it ends
with the leak check on the surviving workers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.deploy.local import alertmanager, cluster, prometheus
from tests.e2e.cluster_harness import free_port, pdserve, running_cluster
from tests.e2e.test_observability_prometheus import api, prometheus_binary, wait_for  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ALERT = "PdserveWorkersBelowExpected"
# Bounds on waits for things that take a few seconds here: failure bounds, not latency checks.
FIRE_TIMEOUT_S = 90.0
RESOLVE_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def alertmanager_binary() -> str:
    """Alertmanager on PATH or in the venv; otherwise unpack Debian's package into the venv, or skip."""
    found = alertmanager.find_binary()
    if found and not alertmanager.missing_templates(found):
        return found
    dest = Path(sys.prefix) / alertmanager.VENV_PREFIX
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "prometheus" / "install.sh"), str(dest), "prometheus-alertmanager"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = alertmanager.find_binary()
    if found is None or alertmanager.missing_templates(found):
        pytest.skip(
            "ALERTMANAGER IS NOT INSTALLED AND COULD NOT BE: deploy/prometheus/install.sh failed "
            f"(exit {done.returncode}): {done.stderr.strip()[-600:]}"
        )
    return found


def am_alerts(base: str, name: str) -> list[dict]:
    """Alerts named ``name`` that Alertmanager holds as active (endsAt still ahead)."""
    with urllib.request.urlopen(f"{base}/api/v2/alerts?filter=alertname%3D%22{name}%22", timeout=10) as resp:
        alerts = json.loads(resp.read())
    return [a for a in alerts if a["labels"].get("alertname") == name and a["status"]["state"] == "active"]


def prom_alerts(base: str, name: str) -> list[dict]:
    return [a for a in api(base, "alerts")["alerts"] if a["labels"]["alertname"] == name]


def test_killing_a_worker_fires_the_worker_count_alert_at_alertmanager_and_it_resolves(
    tmp_path,
    prometheus_binary,  # noqa: F811 - the fixture imported above
    alertmanager_binary,
    tiny_served_model,
):
    prom_port, am_port = free_port(), free_port()
    extra = (
        "--alertmanager", "--prometheus-port", str(prom_port), "--alertmanager-port", str(am_port),
        "--scrape-interval", "1", "--alert-for", "2",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3",
    )  # fmt: skip
    t0 = time.monotonic()
    with running_cluster(tmp_path, prefill=1, decode=1, model=tiny_served_model, extra=extra) as c:
        state = cluster.load_state(c.state_dir)
        assert state is not None and state.alertmanager is not None and state.prometheus is not None
        started = [state.router, *state.workers, *cluster.monitoring(state)]
        prom, am = f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}"
        assert state.alertmanager_url == am and state.prometheus_url == prom

        # Prometheus loaded the rules, knows what the cluster should have, and sees it whole.
        groups = {g["name"]: g for g in api(prom, "rules")["groups"]}
        assert ALERT in {r["name"] for r in groups["pdserve"]["rules"]}
        wait_for(
            lambda: [a["url"] for a in api(prom, "alertmanagers")["activeAlertmanagers"] if am in a["url"]],
            30,
            "Prometheus to know its Alertmanager",
        )
        wait_for(
            lambda: len([t for t in api(prom, "targets")["activeTargets"] if t["health"] == "up"]) == 3,
            60,
            "Prometheus to scrape the router and both workers",
        )
        ready = 'sum by (role) (pdserve_workers{state="ready"}) == on (role) pdserve:workers_expected'
        wait_for(lambda: len(api(prom, "query", query=ready)["result"]) == 3, 60, "every pool at its count")
        # (Prometheus' first evaluations may precede its first scrape of the router, which reads as
        # no worker ready: with a 2 s `for` that can fire briefly. Silent means silent from then on.)
        wait_for(
            lambda: not prom_alerts(prom, ALERT) and not am_alerts(am, ALERT), 60, f"{ALERT} to be silent"
        )

        # A worker dies without a word: the router drops it, the alert fires at Alertmanager.
        killed = next(w for w in state.workers if w.role is not None and w.role.value == "prefill")
        cluster.send(killed, signal.SIGKILL)
        t_kill = time.monotonic()
        wait_for(lambda: am_alerts(am, ALERT), FIRE_TIMEOUT_S, f"{ALERT} at Alertmanager")
        t_fired = time.monotonic()
        [fired] = am_alerts(am, ALERT)
        assert fired["labels"]["role"] == "prefill" and fired["labels"]["severity"] == "page"
        assert fired["annotations"]["summary"].startswith("fewer prefill workers are ready")
        assert fired["annotations"]["runbook"]

        # It returns: the alert resolves at Alertmanager.
        out = pdserve("scale", "--prefill", "1", "--state-dir", str(c.state_dir), timeout=300)
        t_back = time.monotonic()
        assert "had exited" in out.stderr, out.stderr
        wait_for(lambda: not am_alerts(am, ALERT), RESOLVE_TIMEOUT_S, f"{ALERT} to resolve at Alertmanager")
        assert prom_alerts(prom, ALERT) == []
        t_resolved = time.monotonic()
        print(
            f"cluster up {t_kill - t0:.1f}s; fired {t_fired - t_kill:.1f}s after the kill; "
            f"worker back {t_back - t_fired:.1f}s later; "
            f"resolved at Alertmanager {t_resolved - t_back:.1f}s after"
        )
        c.assert_no_leaks()
        state = cluster.load_state(c.state_dir)
        assert state is not None
        started += list(state.workers)

        # `pdserve drain` (the Kubernetes preStop hook): the new worker leaves the router and exits.
        [back] = [w for w in state.workers if w.role is not None and w.role.value == "prefill"]
        pdserve(
            "drain", "--worker-id", back.id, "--timeout", "60", "--state-dir", str(c.state_dir), timeout=120
        )
        assert back.id not in {w["id"] for w in c.workers()}
        assert cluster.wait_exit([back], 30) == []
        # ... and leaves the state file and the workers the alert expects: no alert for a removal on purpose.
        state = cluster.load_state(c.state_dir)
        assert state is not None and back.id not in {w.id for w in state.workers}
        assert back.id not in prometheus.targets_path(c.state_dir).read_text()
        assert "expr: vector(0)\n        labels:\n          role: prefill" in (
            prometheus.expected_path(c.state_dir).read_text()
        )
    left = [p.id for p in started if cluster.alive(p)]
    assert left == [], f"still running after the cluster was stopped: {left}"


def test_alertmanager_config_is_valid_for_amtool(alertmanager_binary, tmp_path):
    amtool = Path(alertmanager_binary).with_name("amtool")
    if not amtool.is_file():
        pytest.skip(f"amtool is not next to {alertmanager_binary}")
    config = tmp_path / "alertmanager.yml"
    config.write_text(alertmanager.render_config())
    done = subprocess.run(
        [str(amtool), "check-config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
