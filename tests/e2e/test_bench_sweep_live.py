"""`pdserve bench` sweep and compare run as commands, one against a live 1P+1D and a 2C cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.bench.report import read_json
from tests.bench_fakes import RECORD_KEYS, VLLM_KEYS, recompute_figures
from tests.e2e.cluster_harness import stop_cluster

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_compare_refuses_unequal_worker_counts(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--shapes", "1P+1D", "1C", "--rates", "1"]
        + ["--goodput", "ttft:100", "tpot:10", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 1
    assert "different worker counts" in out.stderr and "1P+1D: 2" in out.stderr
    assert not (tmp_path / "compare.json").exists()


# ---- the sweep against fake routers --------------------------------------------------------------------


# ---- live: 1P+1D against 2 colocated workers ------------------------------------------------------------


def _router_gone(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=1.0)
        except grpc.FutureTimeoutError:
            return True
    return False


@pytest.mark.slow
def test_live_compare_1p1d_vs_2c(tmp_path, tiny_served_model):
    """``pdserve bench compare`` with real clusters: pinned cores, results, plots, everything stopped.

    Every prompt prefills remotely in 1P+1D (--local-prefill-threshold 1), so
    its runs are ``pdserve bench`` against a live 1P+1D cluster: each saved
    result holds every vLLM key and a record per request, and its figures equal
    those recomputed from the requests' own timestamps. The clusters serve the tiny
    served model: the bench's mechanics are checked, not the model's speed.
    """
    out_dir = tmp_path / "cmp"
    try:
        argv = [
            "bench", "compare",
            "--shapes", "1P+1D", "2C",
            "--rates", "2,4",
            "--num-prompts", "5",
            "--warmup", "1",
            "--input-len", "48",
            "--range-ratio", "0.5",
            "--output-len", "5",
            "--seed", "3",
            "--dtype", "float32",
            "--threads", "1",
            "--model", str(tiny_served_model),
            "--goodput", "ttft:60000", "tpot:60000",
            "--up-arg=--local-prefill-threshold=1",
            "--up-arg=--kv-cache-mib=64",
            "--no-progress",
            "--out-dir", str(out_dir),
        ]  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        assert "goodput ratio 1P+1D / 2C" in out.stdout

        doc = json.loads((out_dir / "compare.json").read_text())
        assert doc["machine"]["cores"] == os.cpu_count() and doc["cluster"]["pin_cpus"] is True
        assert doc["cluster"]["dtype"] == "float32" and doc["cluster"]["threads"] == 1
        assert doc["command"].startswith("pdserve bench compare --shapes 1P+1D 2C")
        ncpu = len(os.sched_getaffinity(0))
        placements = {}
        for label, shape_doc in doc["shapes"].items():
            workers = shape_doc["cluster"]["workers"]
            assert len(workers) == 2 and all(len(w["cpus"]) == 1 for w in workers)
            placements[label] = sorted(w["cpus"][0] for w in workers)
            # Generous SLOs: everything meets them, so the goodput is the highest rate, a lower bound.
            assert [p["slo_attainment"] for p in shape_doc["points"]] == [1.0, 1.0]
            assert shape_doc["goodput_rps"] == 4.0 and shape_doc["saturated"] is False
        assert {w["role"] for w in doc["shapes"]["1P+1D"]["cluster"]["workers"]} == {"prefill", "decode"}
        # Same worker count, same cores (on a machine with at least 2 cores each worker has its own).
        assert placements["1P+1D"] == placements["2C"]
        if ncpu >= 2:
            assert len(set(placements["1P+1D"])) == 2
        # Neither shape missed: the ratio of two lower bounds says nothing, and the summary says so.
        assert doc["ratio"]["goodput"] == 1.0 and doc["ratio"]["undetermined"] is True
        assert not doc["ratio"]["lower_bound"] and "(undetermined" in out.stdout

        streams = {}
        for label in ("1P+1D", "2C"):
            for p in doc["shapes"][label]["points"]:
                run = read_json(out_dir / p["result_file"])
                for key in VLLM_KEYS:
                    assert key in run, key
                records = run["requests"]
                assert len(records) == 5 and all(RECORD_KEYS <= set(r) for r in records)
                assert all(r["error"] is None and r["finish_reason"] == "length" for r in records)
                expected = recompute_figures(records, run["goodput_slo"])
                for key, value in expected.items():
                    assert run[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
                streams[(label, p["rate"])] = [
                    (r["prompt_tokens"], r["output_tokens"], r["scheduled_time"]) for r in records
                ]
        for rate in (2.0, 4.0):
            assert streams[("1P+1D", rate)] == streams[("2C", rate)]

        for name in ("slo_attainment", "ttft_cdf", "itl_cdf"):
            assert Path(doc["plots"][name]).read_bytes()[:8] == PNG_MAGIC
        # Every cluster was stopped: state files gone, routers no longer answer.
        for label, shape_doc in doc["shapes"].items():
            assert not (out_dir / "clusters" / label.replace("+", "_") / "cluster.json").exists()
            assert _router_gone(shape_doc["cluster"]["router"])
    finally:  # what the compare left running (it failed or timed out) is stopped all the same
        for label in ("1P_1D", "2C"):
            stop_cluster(out_dir / "clusters" / label)
