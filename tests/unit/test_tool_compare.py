"""benchmarks.tool_compare's pure parts: the agreement statistic, guidellm's command and report parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.tool_compare import Workload, agreement, bench_samples, guidellm_argv, guidellm_samples
from pdserve.bench.metrics import RequestRecord


def test_agreement_is_a_difference_of_means_within_the_noise():
    a = [100.0, 102.0, 98.0, 101.0, 99.0]
    same = agreement("ttft_ms", [a], [[101.0, 99.0, 100.0, 102.0, 98.0]])
    assert same.agree and same.diff == pytest.approx(0.0) and same.ratio == pytest.approx(1.0)
    shifted = agreement("ttft_ms", [a], [[x + 10.0 for x in a]])
    assert not shifted.agree and shifted.diff == pytest.approx(10.0) and shifted.ratio == pytest.approx(1.1)
    # Interval half-width: 1.96 * sqrt(se_a^2 + se_b^2); here se = sd / sqrt(n) = 1.5811 / sqrt(5) each.
    assert shifted.diff_half_ci == pytest.approx(1.96 * (2 * (1.5811388 / 5**0.5) ** 2) ** 0.5, rel=1e-6)
    assert shifted.round_spread == 0.0 and shifted.noise == shifted.diff_half_ci  # one round: no spread
    # The same shift hidden in a wide spread between requests is noise.
    noisy = agreement("ttft_ms", [[50.0, 150.0, 80.0, 120.0]], [[60.0, 160.0, 90.0, 130.0]])
    assert noisy.agree and noisy.diff == pytest.approx(10.0)
    # ... and so is one hidden in the gap between two rounds of the same tool (the machine's load moved).
    drift = agreement("itl_ms", [a, [x + 16.0 for x in a]], [[x + 10.0 for x in a]] * 2)
    assert drift.a_round_means == pytest.approx((100.0, 116.0)) and drift.round_spread == pytest.approx(16.0)
    assert drift.agree and drift.diff == pytest.approx(2.0) and drift.n_a == 10
    assert drift.round_ratios == pytest.approx((1.1, 110.0 / 116.0))
    steady = agreement("itl_ms", [a, a], [[x + 10.0 for x in a]] * 2)
    assert not steady.agree and steady.noise == steady.diff_half_ci
    with pytest.raises(ValueError, match="itl_ms"):
        agreement("itl_ms", [a], [[]])


def test_workload_bounds():
    with pytest.raises(ValueError, match="output_len"):
        Workload(output_len=1)
    with pytest.raises(ValueError, match="concurrency"):
        Workload(concurrency=0)


def test_guidellm_command_and_report_parsing_drop_the_warmup_and_the_tail():
    w = Workload(input_len=64, output_len=8, num_prompts=3, concurrency=2)
    argv = guidellm_argv("guidellm", "http://h:1", "smol", Path("/m"), w, Path("/o.json"), seed=5)
    joined = " ".join(argv)
    assert "kind=openai_http,target=http://h:1,model=smol,request_format=/v1/completions" in joined
    assert "kind=synthetic_text,prompt_tokens=64,output_tokens=8" in joined
    assert "kind=concurrent,streams=2" in joined and "kind=max_requests,count=7" in joined  # 2 + 3 + 2
    assert "kind=hf_auto,model=/m" in joined and "kind=static,value=5" in joined

    def req(start: float, ttft: float) -> dict:
        return {
            "request_start_time": start,
            "time_to_first_token_ms": ttft,
            "inter_token_latency_ms": ttft / 10,
            "prompt_tokens": 64,
            "output_tokens": 8,
        }

    doc = {
        "benchmarks": [
            {
                "requests": {
                    # started 1..5; the tail's last request is missing from every list
                    "successful": [
                        req(3.0, 30.0),
                        req(1.0, 10.0),
                        req(5.0, 50.0),
                        req(2.0, 20.0),
                        req(4.0, 40.0),
                    ],
                    "errored": [{}],
                    "incomplete": [],
                }
            }
        ]
    }
    s = guidellm_samples(doc, warmup=2, measured=2, sent=7)
    assert s.ttft_ms == (30.0, 40.0) and s.itl_ms == (3.0, 4.0)  # the 2 earliest and the tail dropped
    assert s.prompt_tokens == (64, 64) and s.output_tokens == (8, 8)
    assert s.failed == 1 and s.unreported == 1  # 7 sent: 5 successful, 1 errored, 1 in no list
    assert guidellm_samples(doc, warmup=2, measured=9).ttft_ms == (30.0, 40.0, 50.0)  # no more than there is


def test_bench_samples_average_itl_per_request_and_count_failures():
    class Result:
        records = (
            RequestRecord(
                0, 0.0, 0.0, 0.5, (0.1, 0.3, 0.6), (1, 1, 1), prompt_tokens=4, finish_reason="length"
            ),
            RequestRecord(1, 0.0, 0.0, 0.5, (), (), prompt_tokens=4, error="UNAVAILABLE: gone"),
        )

    s = bench_samples(Result())  # type: ignore[arg-type]
    assert s.ttft_ms == pytest.approx((100.0,)) and s.itl_ms == pytest.approx((250.0,))  # gaps 200, 300
    assert s.output_tokens == (3,) and s.prompt_tokens == (4,) and s.failed == 1
