"""`pdserve bench soak`: the short run of the suite, and the soak's pure parts.

The short run attaches the soak to a 1P+2D cluster the harness started (so the harness stops every
process, whatever happens to the soak), gives it 15 s of mixed traffic with one SIGKILL of a
decode worker with requests in flight and its replacement by `pdserve scale`, and checks: the killed
worker's requests migrated, nothing lost, nothing leaked, no wrong tokens, the JSON, the plot and the
per-request records written; then the harness's own leak check. The cluster serves the tiny served
model: the soak's mechanics are checked, not the model.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from tests.e2e.cluster_harness import ROOT, running_cluster

# The router's migration reasons that mean a worker or its call failed (router/metrics.py); not
# "decode_full", a request routed again for lack of room.
FAILURE_MIGRATIONS = {"decode_failed", "prefill_failed", "transfer_aborted", "heartbeat_lost", "step_failed"}


@pytest.mark.slow
def test_short_soak_loses_and_leaks_nothing(tmp_path, tiny_served_model):
    out = tmp_path / "soak"
    extra = ("--http-port", "0")
    with running_cluster(tmp_path, prefill=1, decode=2, model=tiny_served_model, extra=extra) as c:
        argv = [
            sys.executable, "-m", "pdserve.cli", "bench", "soak", "--state-dir", str(c.state_dir),
            "--minutes", "0.25", "--first-kill", "5", "--kill-interval", "600", "--warmup", "5",
            "--sample-interval", "1", "--concurrency", "3", "--out-dir", str(out), "--no-progress",
        ]  # fmt: skip
        run = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL
        )
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
        doc = json.loads((out / "soak.json").read_text())
        r = doc["requests"]
        assert r["lost"] == 0, doc["lost"]
        assert r["mismatched"] == 0, doc["mismatched"]
        assert r["completed"] >= 5, r
        assert doc["machine"]["cpu"] and doc["machine"]["isa"] and doc["machine"]["kernel_isa"]
        assert doc["kv_blocks_leaked"] == 0 and doc["leak_check"]["clean"], doc["leak_check"]
        assert [k["role"] for k in doc["kills"]] == ["decode"], doc["kills"]
        assert "error" not in doc["kills"][0] and len(doc["kills"][0]["replacement"]) == 1, doc["kills"]
        # The kill hit a worker with work on it (it waits for one), and that work moved: a kill of an
        # idle worker tests no migration.
        assert doc["kills"][0]["in_flight_at_kill"] >= 1, doc["kills"]
        failed = {k: v for k, v in doc["migrations"].items() if k in FAILURE_MIGRATIONS}
        assert sum(failed.values()) >= 1, doc["migrations"]
        names = {p["name"] for p in doc["rss"]["processes"]}
        assert {"router", "soak-client", doc["kills"][0]["worker"], *doc["kills"][0]["replacement"]} <= names
        assert (out / "soak_rss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "verdict: OK" in (out / "summary.md").read_text()
        with gzip.open(out / "requests.json.gz", "rt") as f:
            assert len(json.load(f)["requests"]) == r["sent"]
        c.assert_no_leaks()
