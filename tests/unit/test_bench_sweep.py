"""``pdserve bench sweep`` / ``compare``: shapes, goodput, core pinning, outputs.

Two layers: the sweep logic against in-process fake routers (fast, every
branch: ABBA order, skipping past --stop-below, documents and plots), then one
live ``pdserve bench compare`` of 1P+1D against 2 colocated workers with real
processes, which also serves as the live 1P+1D check of ``pdserve bench``'s
result JSON (figures recomputed from the requests' own timestamps).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.datasets import TokenSpace, WorkloadConfig
from pdserve.bench.metrics import RequestRecord, Slo
from pdserve.bench.report import json_safe, read_json
from pdserve.bench.serve import BenchConfig
from pdserve.bench.sweep import (
    ClusterSpec,
    Shape,
    SweepConfig,
    attainment_split,
    find_goodput,
    format_summary,
    machine_info,
    redraw,
    run_sweep,
)
from pdserve.deploy.local.cluster import choose_cpus, format_cpu_list, parse_cpu_list
from tests.bench_fakes import FakeGeneration, fake_router

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Token ids the fakes never fail or abort on (they do for a first id % 5 in {0, 1}).
ALL_OK = TokenSpace(vocab_size=500, excluded_ids=frozenset(i for i in range(500) if i % 5 in (0, 1)))


# ---- pure pieces ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shape", "label"),
    [
        ("1P+1D", Shape(1, 1, 0), "1P+1D"),
        ("2C", Shape(0, 0, 2), "2C"),
        ("2x colocated", Shape(0, 0, 2), "2C"),
        ("1prefill + 2decode", Shape(1, 2, 0), "1P+2D"),
        ("1p+1d+1both", Shape(1, 1, 1), "1P+1D+1C"),
        ("1D+1D", Shape(0, 2, 0), "2D"),
    ],
)
def test_shape_parse(text, shape, label):
    assert Shape.parse(text) == shape
    assert shape.label == label
    assert Shape.parse(label) == shape


@pytest.mark.parametrize("text", ["", "1X", "P+D", "1P", "1P+-1D", "1.5C"])
def test_bad_shapes_are_refused_with_the_reason(text):
    with pytest.raises(ValueError, match="shape"):
        Shape.parse(text)


def test_goodput_is_the_last_rate_before_the_first_miss():
    pts = [(0.5, 1.0), (1.0, 0.95), (1.5, 0.7), (2.0, 0.95)]  # a late recovery does not count
    g = find_goodput(pts, 0.9)
    assert g["goodput_rps"] == 1.0 and g["saturated"] and g["first_miss_rps"] == 1.5
    assert g["goodput_interpolated_rps"] == pytest.approx(1.0 + (0.95 - 0.9) / (0.95 - 0.7) * 0.5)
    # Order of the points does not matter; exactly the goal passes.
    assert find_goodput(list(reversed(pts)), 0.9) == g
    assert find_goodput([(1.0, 0.9), (2.0, 0.5)], 0.9)["goodput_rps"] == 1.0


def test_goodput_edge_cases():
    never = find_goodput([(1.0, 1.0), (2.0, 0.92)])
    assert never == {
        "goodput_rps": 2.0,
        "goodput_interpolated_rps": 2.0,
        "saturated": False,
        "first_miss_rps": None,
    }
    first = find_goodput([(1.0, 0.5), (2.0, None)])
    assert first["goodput_rps"] == 0.0 and first["first_miss_rps"] == 1.0
    assert first["goodput_interpolated_rps"] == 0.0  # no evidence below the lowest rate
    skipped = find_goodput([(1.0, 1.0), (2.0, None), (3.0, None)])
    assert skipped["goodput_rps"] == 1.0
    assert skipped["goodput_interpolated_rps"] == pytest.approx(1.0 + 0.1 * 1.0)
    with pytest.raises(ValueError):
        find_goodput([])


def _rec(ttft: float, tpot: float, error: str | None = None) -> RequestRecord:
    times = (ttft, ttft + tpot, ttft + 2 * tpot)
    return RequestRecord(0, 0.0, 0.0, times[-1], times, (1, 1, 1), error=error)


def test_attainment_split_counts_each_slo_and_both():
    slo = Slo(ttft_ms=100, tpot_ms=10)
    recs = [_rec(0.05, 0.005), _rec(0.2, 0.005), _rec(0.05, 0.02), _rec(0.05, 0.005, error="UNAVAILABLE")]
    assert attainment_split(recs, slo) == {
        "slo_attainment": 0.25,
        "ttft_attainment": 0.5,
        "tpot_attainment": 0.5,
    }
    assert attainment_split([], slo)["slo_attainment"] is None


def test_cpu_lists_and_placement():
    assert parse_cpu_list("0") == (0,)
    assert parse_cpu_list("3,0-1") == (0, 1, 3)
    assert format_cpu_list((3, 0, 1)) == "0,1,3"
    for bad in ("", "a", "2-1", "1-", "-1"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)
    cores = (0, 1)
    # 2 workers x 1 thread on 2 cores: one core each, in spawn order, whatever the roles.
    first = choose_cpus([], 1, cores)
    assert (first, choose_cpus([first], 1, cores)) == ((0,), (1,))
    # A third worker shares the least used core; a freed core is reused first.
    assert choose_cpus([(0,), (1,)], 1, cores) == (0,)
    assert choose_cpus([(1,)], 1, cores) == (0,)
    assert choose_cpus([(0, 1)], 2, cores) == (0, 1)
    assert choose_cpus([(0,), (1,), (2,)], 2, (0, 1, 2, 3)) == (0, 3)


def _bench(address: str = "unset", **kw) -> BenchConfig:
    base = dict(
        router=address,
        workload=WorkloadConfig(input_len=16, output_len=6, range_ratio=0.5),
        arrivals=ArrivalConfig(request_rate=1.0),
        num_prompts=10,
        warmup=2,
        seed=5,
        connect_timeout_s=10.0,
        request_timeout_s=30.0,
        slo=Slo(ttft_ms=10_000, tpot_ms=10_000),
    )
    base.update(kw)
    return BenchConfig(**base)


def test_sweep_config_validation(tmp_path):
    ok = dict(shapes=(Shape(1, 1),), rates=(1.0,), bench=_bench(), cluster=ClusterSpec(), out_dir=tmp_path)
    SweepConfig(**ok)
    for bad, match in (
        ({"rates": ()}, "rates"),
        ({"rates": (1.0, math.inf)}, "rates"),
        ({"rates": (0.0,)}, "rates"),
        ({"rates": (1.0, 1.0)}, "differ"),
        ({"shapes": ()}, "shapes"),
        ({"shapes": (Shape(1, 1), Shape(1, 1))}, "differ"),
        ({"bench": _bench(slo=Slo(ttft_ms=100))}, "both SLOs"),
        ({"bench": _bench(slo=Slo(ttft_ms=100, tpot_ms=50, e2el_ms=170))}, "no e2el"),
        ({"cdf_rate": 2.0}, "cdf_rate must be one of the rates"),
        ({"goal": 1.5}, "goal"),
        ({"stop_below": 0.95}, "stop_below"),
    ):
        with pytest.raises(ValueError, match=match):
            SweepConfig(**(ok | bad))
    # --up-arg cannot override what the sweep sets itself (it connects to its own port, records its dtype).
    for up in (("--port=55300",), ("--dtype", "float32"), ("--state-dir=x",)):
        with pytest.raises(ValueError, match="the sweep sets"):
            ClusterSpec(extra_up_args=up)
    assert ClusterSpec(extra_up_args=("--kv-cache-mib", "512", "--http-port=0")).extra_up_args


def test_machine_records_the_workers_device():
    # The workers' device comes from --up-arg (gpu_cluster.sh passes --up-arg=--device=cuda).
    assert machine_info(1)["device"] == {"type": "cpu"} and machine_info(1)["kernel_isa"]
    cuda = machine_info(1, ("--http-port=0", "--device", "cuda:1"))
    assert cuda["device"]["type"] == "cuda" and "name" in cuda["device"] and cuda["kernel_isa"] is None
    assert machine_info(1, ("--device=cuda",))["device"]["type"] == "cuda"


# ---- the sweep against fake routers --------------------------------------------------------------------


class SlowFake(FakeGeneration):
    """A fake whose every token takes ``step_s``: a shape that cannot meet a tight TPOT SLO."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    async def Generate(self, request, context):  # noqa: N802
        import asyncio

        async for msg in super().Generate(request, context):
            await asyncio.sleep(self.step_s)
            yield msg


@pytest.mark.slow  # seconds of work: make test runs it, test-fast does not
def test_sweep_logic_with_fake_clusters(tmp_path, monkeypatch):
    """ABBA order, the same request stream for every shape, skipping after --stop-below, outputs."""
    # The slow fake's tokens take 167-500 ms each, the fast one's a few ms: a TPOT SLO of 100 ms tells them
    # apart with room for a loaded host, where the fake routers share this process with the bench.
    fast, slow = FakeGeneration(), SlowFake(step_s=0.5)
    started, stopped = [], []
    monkeypatch.setattr("pdserve.bench.sweep.model_token_space", lambda model: ALL_OK)

    with contextlib.ExitStack() as stack:
        addresses = {
            "1P+1D": stack.enter_context(fake_router(fast)),
            "2C": stack.enter_context(fake_router(slow)),
        }

        @contextlib.contextmanager
        def fake_cluster(shape: Shape, spec: ClusterSpec, state_dir: Path) -> Iterator[dict]:
            started.append(shape.label)
            try:
                yield {"shape": shape.label, "router": addresses[shape.label], "workers": []}
            finally:
                stopped.append(shape.label)

        cfg = SweepConfig(
            shapes=(Shape(1, 1), Shape(colocated=2)),
            rates=(200.0, 100.0, 300.0),  # swept in increasing order
            bench=_bench(slo=Slo(ttft_ms=10_000, tpot_ms=100)),
            cluster=ClusterSpec(threads=1),
            out_dir=tmp_path / "out",
            stop_below=0.5,
        )
        doc = run_sweep(cfg, "pdserve bench compare ...", start_cluster=fake_cluster)

    assert started == ["1P+1D", "2C"] and stopped == ["2C", "1P+1D"]
    assert doc["kind"] == "compare" and doc["rates"] == [100.0, 200.0, 300.0]
    m = doc["machine"]
    assert m["cores"] == os.cpu_count() and m["threads_per_worker"] == 1
    assert m["isa"] and "flags" in m and m["kernel_isa"] and m["torch"] and m["device"] == {"type": "cpu"}
    fast_doc, slow_doc = doc["shapes"]["1P+1D"], doc["shapes"]["2C"]
    assert [p["rate"] for p in fast_doc["points"]] == [100.0, 200.0, 300.0]
    assert [p["slo_attainment"] for p in fast_doc["points"]] == [1.0, 1.0, 1.0]
    assert slow_doc["points"][0]["slo_attainment"] == 0.0  # every token takes >= 167 ms > 100 ms
    assert slow_doc["points"][0]["tpot_attainment"] == 0.0
    assert slow_doc["points"][0]["ttft_attainment"] == 1.0
    assert all(p.get("skipped") for p in slow_doc["points"][1:])  # below --stop-below at the first rate
    assert slow_doc["goodput_rps"] == 0.0

    # ABBA: at the second rate the second shape would go first; it was skipped, so only 1P+1D ran.
    # Every run that did run saved its full result, with the same request stream.
    streams = {}
    for label, shape_doc in doc["shapes"].items():
        for p in shape_doc["points"]:
            if p.get("skipped"):
                continue
            run = read_json(cfg.out_dir / p["result_file"])
            assert len(run["requests"]) == 10 and run["warmup_requests"] == 2
            assert run["config"]["request_rate"] == p["rate"]
            assert run["slo_attainment"] == p["slo_attainment"]
            streams[(label, p["rate"])] = [(r["prompt_tokens"], r["scheduled_time"]) for r in run["requests"]]
    assert streams[("1P+1D", 100.0)] == streams[("2C", 100.0)]

    assert fast_doc["goodput_rps"] == 300.0 and fast_doc["saturated"] is False
    assert doc["ratio"] == {
        "shapes": ["1P+1D", "2C"],
        "goodput": math.inf,
        "goodput_interpolated": math.inf,
        "lower_bound": True,
        "upper_bound": False,
        "undetermined": False,
    }

    saved = json.loads((cfg.out_dir / "compare.json").read_text())
    assert saved["shapes"]["2C"]["points"][1]["skipped"] is True
    for name in ("slo_attainment", "ttft_cdf", "itl_cdf"):
        assert Path(doc["plots"][name]).read_bytes()[:8] == PNG_MAGIC
    assert doc["plots"]["cdf_rate"] == 100.0  # the highest rate both shapes ran
    # The same requests rescored under other SLO pairs: TPOT 0.75x..2x, TTFT 0.5x..2x of the sweep's.
    scan = {(r["ttft_ms"], r["tpot_ms"]): r for r in doc["slo_scan"]}
    assert len(scan) == 12 and scan[(10_000, 100)]["goodput_rps"] == {"1P+1D": 300.0, "2C": 0.0}
    assert scan[(20_000, 200)]["ratio"] == math.inf
    assert scan[(5_000, 75)]["goodput_rps"]["1P+1D"] == 300.0
    # Redrawn from the saved runs alone: the same scan, the plots written again.
    for name in ("slo_attainment", "ttft_cdf", "itl_cdf"):
        Path(doc["plots"][name]).unlink()
    again = redraw(cfg.out_dir)
    assert json_safe(again["slo_scan"]) == saved["slo_scan"]
    assert all(Path(again["plots"][n]).read_bytes()[:8] == PNG_MAGIC for n in ("slo_attainment", "itl_cdf"))
    summary = format_summary(saved)
    assert "goodput ratio 1P+1D / 2C: inf" in summary and "(lower bound)" in summary
    assert "skipped" in summary and f"{os.cpu_count()} cores" in summary
    # Files written before bench.machine: cpu_count, no ISA.
    old = {**saved, "machine": {"cpu_count": 3, "cpu": "x", "threads_per_worker": 1}}
    assert "machine: 3 cores (x)" in format_summary(old)


# ---- live: 1P+1D against 2 colocated workers ------------------------------------------------------------
