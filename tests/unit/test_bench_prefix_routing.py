"""benchmarks.prefix_routing without a cluster: the KV sizing, the workload, reading and attributing the
decode workers' counters, and the figures and targets it reports."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import prefix_routing as pr
from pdserve.bench.datasets import TokenSpace

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
SPACE = TokenSpace(vocab_size=1000, excluded_ids=frozenset({0, 1, 2}))


def test_kv_sizing_from_the_model_shape() -> None:
    # 30 layers x (K, V) x 3 KV heads x head dim 64 x 2 bytes.
    assert pr.kv_bytes_per_token(SMOLLM2, "bfloat16") == 23040
    assert pr.kv_bytes_per_token({**SMOLLM2, "head_dim": 32}, "float32") == 30 * 2 * 3 * 32 * 4
    assert pr.kv_bytes_per_token(
        {k: v for k, v in SMOLLM2.items() if k != "num_key_value_heads"}, "float32"
    ) == (30 * 2 * 9 * 64 * 4)
    cfg = pr.parse_args([])
    # Ten 768-token prefixes, plus the suffix and output of each of the 2 requests in flight.
    tokens = 10 * 768 + 2 * (32 + 32)
    assert pr.kv_cache_mib(23040, cfg) == -(-tokens * 23040 // 2**20) == 172


def test_workload_is_every_prefix_with_each_suffix_shuffled() -> None:
    cfg = pr.parse_args(["--num-prefixes", "5", "--suffixes", "3", "--prefix-len", "20", "--suffix-len", "4"])
    prompts, warm = pr.workload(cfg, SPACE)
    assert len(prompts) == 15 and len(warm) == 2
    by_prefix: dict[int, list[pr.Prompt]] = {}
    for p in prompts:
        assert len(p.token_ids) == 24
        by_prefix.setdefault(p.prefix, []).append(p)
    assert sorted(by_prefix) == list(range(5)) and all(len(v) == 3 for v in by_prefix.values())
    for group in by_prefix.values():
        assert len({p.token_ids[:20] for p in group}) == 1  # one prefix
        assert len({p.token_ids[20:] for p in group}) == 3  # its own suffixes
    assert len({p.token_ids[:20] for p in prompts}) == 5
    assert [p.prefix for p in prompts] != sorted(p.prefix for p in prompts)  # shuffled
    assert pr.workload(cfg, SPACE) == (prompts, warm)  # seeded
    assert all(len(w.token_ids) == 24 and w.prefix == -1 for w in warm)
    assert not {w.token_ids[:20] for w in warm} & {p.token_ids[:20] for p in prompts}
    other, _ = pr.workload(pr.parse_args([*cfg.argv, "--seed", "1"]), SPACE)
    assert other != prompts


def _page(
    landed: float, not_sent: float = 0, transfers: int = 0, prefilled: int = 0, inflight: int = 0
) -> str:
    return f"""# HELP pdserve_kv_transfer_bytes_total KV bytes moved.
# TYPE pdserve_kv_transfer_bytes_total counter
pdserve_kv_transfer_bytes_total{{role="decode"}} {landed}
# HELP pdserve_kv_transfer_bytes_not_sent_total not sent.
# TYPE pdserve_kv_transfer_bytes_not_sent_total counter
pdserve_kv_transfer_bytes_not_sent_total{{role="decode"}} {not_sent}
# HELP pdserve_kv_transfer_seconds Duration.
# TYPE pdserve_kv_transfer_seconds histogram
pdserve_kv_transfer_seconds_bucket{{le="+Inf",role="decode"}} {transfers}
pdserve_kv_transfer_seconds_count{{role="decode"}} {transfers}
pdserve_kv_transfer_seconds_sum{{role="decode"}} 0.5
# HELP pdserve_prefill_tokens_total Prompt tokens prefilled.
# TYPE pdserve_prefill_tokens_total counter
pdserve_prefill_tokens_total{{role="decode"}} {prefilled}
# HELP pdserve_kv_transfer_inflight Transfers.
# TYPE pdserve_kv_transfer_inflight gauge
pdserve_kv_transfer_inflight{{role="decode"}} {inflight}
"""


def test_metrics_are_read_and_a_request_is_attributed_to_the_worker_that_moved() -> None:
    page = pr.parse_metrics(_page(100.0, 5.0, 2, 7, 1))
    assert pr.value(page, *pr.LANDED) == 100.0 and pr.value(page, *pr.NOT_SENT) == 5.0
    assert pr.value(page, "pdserve_kv_transfer_seconds_count", {"role": "decode"}) == 2
    assert pr.value(page, *pr.INFLIGHT) == 1 and pr.value(page, "absent", {}) == 0
    before = {"d1": pr.parse_metrics(_page(100, 0, 1)), "d2": pr.parse_metrics(_page(50, 0, 1))}
    # A remote prefill: bytes landed on d2 (and its prefix cache held some more).
    remote = {"d1": before["d1"], "d2": pr.parse_metrics(_page(450, 64, 2))}
    assert pr.attribute(before, remote) == pr.Attribution("d2", 400.0, 64.0)
    # A local prefill on d1: no transfer, its prefilled tokens moved.
    local = {"d1": pr.parse_metrics(_page(100, 0, 1, prefilled=32)), "d2": before["d2"]}
    assert pr.attribute(before, local) == pr.Attribution("d1", 0.0, 0.0)
    # Nothing moved yet, or both did: no worker named.
    assert pr.attribute(before, before).worker is None
    both = {"d1": local["d1"], "d2": remote["d2"]}
    assert pr.attribute(before, both).worker is None


ROUTER = """# HELP pdserve_router_routes_total Routing decisions.
# TYPE pdserve_router_routes_total counter
pdserve_router_routes_total{{reason="remote",role="router"}} {remote}
pdserve_router_routes_total{{reason="cached_prefix",role="router"}} {cached}
# HELP pdserve_router_predicted_cached_tokens_total Predicted.
# TYPE pdserve_router_predicted_cached_tokens_total counter
pdserve_router_predicted_cached_tokens_total{{leg="decode",role="router"}} {predicted}
"""


def _results(workers: list[str | None], kv: list[float], ttft: list[float]) -> list[pr.RequestResult]:
    out = []
    for i, (w, b, t) in enumerate(zip(workers, kv, ttft, strict=True)):
        r = pr.RequestResult(
            i, i % 2, ttft_ms=t, e2e_ms=t + 100, output_tokens=4, decode_worker=w, kv_bytes=b
        )
        r.full_prefix = b >= 1000
        out.append(r)
    return out


def _policy(name: str, workers, kv, ttft, landed: dict[str, float]) -> dict:
    results = _results(workers, kv, ttft)
    router = (
        pr.parse_metrics(ROUTER.format(remote=1, cached=0, predicted=0)),
        pr.parse_metrics(
            ROUTER.format(remote=1 + sum(b > 0 for b in kv), cached=sum(b == 0 for b in kv), predicted=96)
        ),
    )
    decode = (
        {w: pr.parse_metrics(_page(10)) for w in landed},
        {w: pr.parse_metrics(_page(10 + b)) for w, b in landed.items()},
    )
    return pr.summarize_policy(name, results, results[:0], router, decode, 2.0)


def test_policy_summary_and_targets() -> None:
    kv = _policy(
        "kv-aware", ["d1", "d2", "d1", "d1"], [1200, 1200, 0, 100], [50, 70, 10, 20], {"d1": 1300, "d2": 1200}
    )
    assert kv["full_prefix_transfers"] == 2 and kv["requests_per_decode_worker"] == {"d1": 3, "d2": 1}
    assert kv["kv_bytes_total"] == 2500 == kv["kv_bytes_attributed"] and kv["kv_bytes_per_request"] == 625
    assert kv["median_ttft_ms"] == 35 and kv["busier_over_other"] == 3 and kv["unattributed"] == 0
    assert kv["routes"] == {"remote": 3, "cached_prefix": 1} and kv["predicted_cached_tokens"] == {
        "decode": 96
    }
    assert (
        kv["output_tok_s"] == 8.0
        and len(kv["per_request"]) == 4
        and "first_token" not in kv["per_request"][0]
    )
    load = _policy("load", ["d1", "d2", "d1", "d2"], [1200] * 4, [80, 90, 60, 70], {"d1": 2400, "d2": 2400})
    lines = pr.acceptance({"kv-aware": kv, "load": load}, 2)
    assert len(lines) == 4
    full = next(a for a in lines if "full-prefix" in a["target"])
    assert full["value"] == 2 and full["bound"] == 2.5 and full["pass"]
    busier = next(a for a in lines if "busier" in a["target"])
    assert busier["value"] == 3 and not busier["pass"]
    saved = next(a for a in lines if "bytes" in a["target"])
    assert saved["value"] == pytest.approx(1 - 625 / 1200) and saved["pass"]
    ttft = next(a for a in lines if "TTFT" in a["target"])
    assert ttft["value"] == pytest.approx(35 / 75) and ttft["pass"]
    # One policy alone: only its own targets.
    assert len(pr.acceptance({"kv-aware": kv}, 2)) == 2 and pr.acceptance({"load": load}, 2) == []

    result = {
        "machine": {"cpu": "cpu", "isa": "avx2", "cores": 2},
        "dtype": "float32",
        "threads_per_worker": 1,
        "kv_cache_mib": 29,
        "workload": vars(pr.parse_args([])) | {"seed": 0},
        "policies": {"kv-aware": kv, "load": load},
        "acceptance": pr.acceptance({"kv-aware": kv, "load": load}, 2),
    }
    text = pr.report(result)
    assert "| kv-aware | 2 |" in text and "FAIL kv-aware: the busier decode worker" in text
    assert "PASS kv-aware median TTFT below load-only's" in text


def test_arguments() -> None:
    cfg = pr.parse_args([])
    assert (cfg.num_prefixes, cfg.suffixes, cfg.prefix_len, cfg.suffix_len, cfg.output_len) == (
        16,
        4,
        768,
        32,
        32,
    )
    assert cfg.concurrency == 2 and cfg.cache_prefixes == 10 and cfg.policies == ("kv-aware", "load")
    assert not cfg.save and cfg.dtype in ("float32", "bfloat16")
    assert pr.parse_args(["--policies", "load"]).policies == ("load",)
    for bad in (["--policies", "random"], ["--concurrency", "0"], ["--prefix-len", "0"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            pr.parse_args(bad)
    assert isinstance(cfg, argparse.Namespace)
