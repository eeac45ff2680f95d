"""The benchmark's pure logic on hand-made data: metrics math, arrival schedule, workloads, report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalConfig, arrival_times
from pdserve.bench.datasets import (
    DatasetName,
    SampleRequest,
    TokenSpace,
    WorkloadConfig,
    length_range,
    load_jsonl,
    sample_requests,
)
from pdserve.bench.metrics import RequestRecord, Slo, compute_metrics, parse_slo, summarize
from pdserve.bench.plan import plan_run
from pdserve.bench.report import format_summary, json_safe, write_json

# ---- one request --------------------------------------------------------------------------------------


def test_itl_splits_a_multi_token_message_evenly():
    r = RequestRecord(
        index=0,
        scheduled_time=1.0,
        start_time=1.0,
        end_time=1.7,
        token_times=(1.1, 1.3, 1.6),
        token_counts=(1, 2, 3),
    )
    assert r.ok and r.output_tokens == 6
    assert r.ttft == pytest.approx(0.1)
    # 0.2 s over 2 tokens, then 0.3 s over 3 tokens: five gaps of 0.1 s.
    assert r.itl == pytest.approx([0.1] * 5)
    assert r.e2el == pytest.approx(0.7)
    assert r.tpot == pytest.approx((0.7 - 0.1) / 5)
    d = r.as_dict()
    assert d["ttft_ms"] == pytest.approx(100.0) and d["itl_ms"] == pytest.approx([100.0] * 5)
    assert d["e2el_ms"] == pytest.approx(700.0) and d["tpot_ms"] == pytest.approx(120.0)
    assert d["output_tokens"] == 6 and d["error"] is None


def test_extra_tokens_of_the_first_message_have_no_itl():
    r = RequestRecord(0, 0.2, 0.2, 1.0, token_times=(0.5, 0.9), token_counts=(2, 1))
    assert r.ttft == pytest.approx(0.3)
    assert r.itl == pytest.approx([0.4])  # output_tokens - tokens of the first message = 1 value
    assert r.tpot == pytest.approx((0.8 - 0.3) / 2)


def test_one_token_and_no_token_requests():
    one = RequestRecord(0, 0.0, 0.0, 0.5, token_times=(0.25,), token_counts=(1,))
    assert one.itl == [] and one.tpot is None and one.ttft == 0.25
    none = RequestRecord(1, 0.0, 0.0, 0.5, error="UNAVAILABLE: gone")
    assert none.ttft is None and none.tpot is None and not none.ok
    with pytest.raises(ValueError):
        RequestRecord(2, 0.0, 0.0, 1.0, token_times=(0.1,), token_counts=())
    with pytest.raises(ValueError):
        RequestRecord(2, 0.0, 0.0, 1.0, token_times=(0.1,), token_counts=(0,))


# ---- aggregates ---------------------------------------------------------------------------------------

STEP = 1 / 64  # dyadic times: every figure below is exact in binary floating point


def _ten_ok_and_one_failed() -> list[RequestRecord]:
    records = [
        RequestRecord(i, 0.0, 0.0, (i + 1) * STEP, (((i + 1) * STEP),), (1,), prompt_tokens=10)
        for i in range(10)
    ]
    records.append(RequestRecord(10, 0.0, 0.0, 5.0, prompt_tokens=10, error="UNAVAILABLE: worker died"))
    return records


def test_aggregates_follow_vllm_definitions():
    m = compute_metrics(_ten_ok_and_one_failed())
    assert m["completed"] == 10 and m["failed"] == 1
    assert m["total_input_tokens"] == 100  # the failed request's prompt is not counted
    assert m["total_output_tokens"] == 10
    assert m["duration"] == 5.0  # runs to the end of the last stream, failed or not
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    ms = STEP * 1000.0  # TTFTs are 1..10 times this
    assert m["mean_ttft_ms"] == pytest.approx(5.5 * ms)
    assert m["median_ttft_ms"] == pytest.approx(5.5 * ms)
    assert m["p50_ttft_ms"] == pytest.approx(5.5 * ms)
    # Linear interpolation at rank 0.9 * 9 = 8.1 and 0.99 * 9 = 8.91 of the sorted 1..10.
    assert m["p90_ttft_ms"] == pytest.approx(9.1 * ms)
    assert m["p99_ttft_ms"] == pytest.approx(9.91 * ms)
    # Population std of 1..10 is sqrt(8.25).
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(8.25) * ms)
    # One-token requests: no TPOT and no ITL; an empty set is None, not 0.
    for key in ("mean_tpot_ms", "p99_tpot_ms", "median_itl_ms", "std_itl_ms"):
        assert m[key] is None
    assert m["request_goodput"] is None and m["slo_attainment"] is None  # no SLO given


def test_goodput_counts_requests_meeting_every_slo_inclusive():
    records = _ten_ok_and_one_failed()
    m = compute_metrics(records, Slo(ttft_ms=5 * STEP * 1000.0))
    # TTFTs 1..5 steps meet it (5 exactly on the bound); the failed one is a miss.
    assert m["request_goodput"] == pytest.approx(5 / 5.0)
    assert m["slo_attainment"] == pytest.approx(5 / 11)


def test_goodput_tpot_of_one_token_request_is_zero_and_all_slos_apply():
    one = RequestRecord(0, 0.0, 0.0, 0.5, (0.25,), (1,))
    slow_decode = RequestRecord(1, 0.0, 0.0, 1.7, (0.1, 0.3, 0.6), (1, 2, 3))  # TPOT 320 ms
    fast = RequestRecord(2, 0.0, 0.0, 0.3, (0.1, 0.2), (1, 1))  # TPOT 200 ms, e2el 300 ms
    recs = [one, slow_decode, fast]
    assert compute_metrics(recs, Slo(tpot_ms=250))["slo_attainment"] == pytest.approx(2 / 3)
    assert compute_metrics(recs, Slo(tpot_ms=250, e2el_ms=500))["slo_attainment"] == pytest.approx(2 / 3)
    assert compute_metrics(recs, Slo(tpot_ms=250, e2el_ms=299))["slo_attainment"] == pytest.approx(0.0)
    assert compute_metrics(recs, Slo(ttft_ms=100, tpot_ms=1000))["slo_attainment"] == pytest.approx(2 / 3)


def test_itl_and_tpot_statistics_pool_all_requests():
    a = RequestRecord(0, 0.0, 0.0, 0.75, (0.25, 0.5, 0.75), (1, 2, 1))  # ITLs .125 .125 .25
    b = RequestRecord(1, 0.0, 0.0, 1.0, (0.5, 1.0), (1, 1))  # ITL .5
    m = compute_metrics([a, b])
    itls_ms = [125.0, 125.0, 250.0, 500.0]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls_ms))
    assert m["median_itl_ms"] == pytest.approx(187.5)
    assert m["p90_itl_ms"] == pytest.approx(250.0 + 0.7 * 250.0)
    tpots_ms = [(750 - 250) / 3, (1000 - 500) / 1]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots_ms))
    assert m["mean_e2el_ms"] == pytest.approx(875.0)


def test_no_records_and_summarize_keys():
    m = compute_metrics([])
    assert m["completed"] == 0 and m["duration"] == 0.0 and m["request_throughput"] is None
    s = summarize([0.001, 0.003], "ttft", percentiles=(50, 99.9))
    assert set(s) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms"}
    assert s["std_ttft_ms"] == pytest.approx(1.0)


def test_parse_slo():
    assert parse_slo(["ttft:500", "tpot:50", "e2el:2000"]) == Slo(500.0, 50.0, 2000.0)
    assert not parse_slo([]).any
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


# ---- arrivals -----------------------------------------------------------------------------------------


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(4, ArrivalConfig(), np.random.default_rng(0)) == [0.0] * 4
    assert arrival_times(0, ArrivalConfig(2.0), np.random.default_rng(0)) == []


def test_arrivals_are_seeded_normalized_and_sorted():
    cfg = ArrivalConfig(request_rate=4.0)
    a = arrival_times(50, cfg, np.random.default_rng(3))
    assert a == arrival_times(50, cfg, np.random.default_rng(3))
    assert a != arrival_times(50, cfg, np.random.default_rng(4))
    assert a[0] == 0.0 and a[-1] == pytest.approx(49 / 4.0)
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))


def test_burstiness_is_the_gamma_shape():
    n = 20_000
    for shape in (1.0, 0.25, 4.0):
        gaps = np.diff(arrival_times(n, ArrivalConfig(10.0, shape), np.random.default_rng(1)))
        # A gamma(k) gap has coefficient of variation 1/sqrt(k): 1 for Poisson, 2 when bursty.
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / math.sqrt(shape), rel=0.05)
    even = arrival_times(5, ArrivalConfig(2.0, math.inf), np.random.default_rng(1))
    assert even == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        ArrivalConfig(request_rate=0.0)
    with pytest.raises(ValueError):
        ArrivalConfig(burstiness=0.0)


# ---- workloads ----------------------------------------------------------------------------------------

SPACE = TokenSpace(vocab_size=300, excluded_ids=frozenset({0, 1, 2}))


def test_length_range_matches_vllm():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(3, 0.5) == (1, 5)  # floor(1.5), ceil(4.5)
    assert length_range(1, 0.9) == (1, 2)  # never 0


def test_random_prompts_have_exact_lengths_in_range():
    cfg = WorkloadConfig(input_len=40, output_len=10, range_ratio=0.5)
    reqs = sample_requests(cfg, 200, np.random.default_rng(0), SPACE)
    assert len(reqs) == 200
    for r in reqs:
        assert r.prompt_token_ids is not None and r.prompt is None and r.messages is None
        assert r.prompt_len == len(r.prompt_token_ids) and 20 <= r.prompt_len <= 60
        assert r.output_len is not None and 5 <= r.output_len <= 15 and r.ignore_eos
        assert all(3 <= t < 300 for t in r.prompt_token_ids)
    assert {r.prompt_len for r in reqs} == set(range(20, 61))  # the whole range is drawn


def test_shared_prefix_groups():
    cfg = WorkloadConfig(
        DatasetName.SHARED_PREFIX, input_len=8, output_len=4, prefix_len=16, num_prefix_groups=3
    )
    reqs = sample_requests(cfg, 30, np.random.default_rng(5), SPACE)
    by_group: dict[int, list[SampleRequest]] = {}
    for r in reqs:
        assert r.group is not None and r.prompt_len == 24
        by_group.setdefault(r.group, []).append(r)
    assert sorted(len(v) for v in by_group.values()) == [10, 10, 10]
    prefixes = {g: {r.prompt_token_ids[:16] for r in v} for g, v in by_group.items()}  # type: ignore[index]
    assert all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 3
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled, not in blocks
    with pytest.raises(ValueError):
        WorkloadConfig(DatasetName.SHARED_PREFIX, prefix_len=0)


def test_jsonl_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "hello"},
        {"messages": [{"role": "user", "content": "hi"}], "output_len": 7},
        {"prompt": "bye", "output_len": 3},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    cfg = WorkloadConfig(DatasetName.JSONL, output_len=20, dataset_path=path)
    reqs = sample_requests(cfg, 7, np.random.default_rng(0))
    # Cycles through a shuffled order: every entry twice in the first six.
    assert sorted((r.prompt or "", r.output_len) for r in reqs[:6]) == sorted(
        [("hello", 20), ("", 7), ("bye", 3)] * 2
    )
    chat = next(r for r in reqs if r.messages is not None)
    assert chat.messages == (("user", "hi"),) and not chat.ignore_eos and chat.prompt_len is None
    for bad, where in (
        ('{"prompt": ""}', ":1:"),
        ('{"prompt": "a"}\n[1]', ":2:"),
        ('{"prompt": "a", "messages": []}', ":1:"),
    ):
        path.write_text(bad)
        with pytest.raises(ValueError, match=where):
            load_jsonl(path)
    with pytest.raises(ValueError):
        WorkloadConfig(DatasetName.JSONL)  # no path


def test_plan_is_fixed_by_the_seed():
    cfg = WorkloadConfig(input_len=12, output_len=5, range_ratio=0.3)
    rate = ArrivalConfig(request_rate=8.0, burstiness=0.5)
    a = plan_run(cfg, rate, 10, 2, seed=11, token_space=SPACE)
    assert a == plan_run(cfg, rate, 10, 2, seed=11, token_space=SPACE)
    assert len(a.requests) == 10 and len(a.warmup) == 2 and len(a.send_times) == 10
    other = plan_run(cfg, rate, 10, 2, seed=12, token_space=SPACE)
    assert other.requests != a.requests and other.send_times != a.send_times
    # Warmup and rate draw from their own streams: the measured prompts do not move.
    assert plan_run(cfg, ArrivalConfig(2.0), 10, 5, seed=11, token_space=SPACE).requests == a.requests
    with pytest.raises(ValueError):
        plan_run(cfg, rate, 10, 0, seed=1, token_space=None)  # random prompts need the vocabulary


# ---- report -------------------------------------------------------------------------------------------


def test_summary_and_strict_json(tmp_path):
    records = _ten_ok_and_one_failed()
    doc = {
        **compute_metrics(records, Slo(ttft_ms=100)),
        "goodput_slo": {"ttft": 100.0},
        "config": {"request_rate": math.inf, "max_concurrency": 4, "cpu_count": 2},
        "requests": [r.as_dict() for r in records],
    }
    text = format_summary(doc)
    for needle in (
        "Serving Benchmark Result",
        "Successful requests:",
        "Request goodput (req/s):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):                          n/a",
        "UNAVAILABLE: worker died",
    ):
        assert needle in text
    assert "Request rate configured" not in text  # infinite
    write_json(tmp_path / "r.json", doc)
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded["config"]["request_rate"] == "inf" and loaded["completed"] == 10
    assert json_safe([float("nan"), 1.0]) == ["nan", 1.0]
