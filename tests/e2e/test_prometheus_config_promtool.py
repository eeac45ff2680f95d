"""The committed Prometheus config reads `pdserve up`'s targets, and promtool accepts it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdserve.deploy.local import prometheus

ROOT = Path(__file__).resolve().parents[2]


# ---- what processes export, and what panels query ------------------------------------------------------


def test_committed_prometheus_config_reads_the_default_state_dirs_targets(tmp_path):
    committed = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    assert committed == prometheus.render_config(prometheus.DEFAULT_TARGETS_FROM_DEPLOY)
    # Relative to the config's folder, that path is the targets file of `pdserve up` run from the repo root.
    target = (ROOT / "deploy" / "prometheus" / prometheus.DEFAULT_TARGETS_FROM_DEPLOY).resolve()
    assert target == (ROOT / ".pdserve" / "prometheus" / "targets.json").resolve()
    binary = prometheus.find_binary()
    if binary is None:
        pytest.skip("prometheus is not installed (make prometheus): promtool cannot check the config")
    promtool = Path(binary).with_name("promtool")
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus.render_config("targets.json", 0.5))
    (tmp_path / "targets.json").write_text("[]")
    for path in (config, ROOT / "deploy" / "prometheus" / "prometheus.yml"):
        done = subprocess.run(
            [str(promtool), "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
