"""``benchmarks.engine`` end to end on a tiny model: the rows it promises, with the host's ISA and bounds."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import engine as bench
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import cpu_isa, kernel_cache_dir, load_cpu_kernels


def test_fma_peak_is_measured() -> None:
    k = load_cpu_kernels(kernel_cache_dir())
    if k is None:
        return  # no C compiler: the bench then bounds by memory alone (covered below)
    one = k.fma_peak(1, seconds=0.05)
    assert math.isfinite(one) and one > 1e8  # any CPU of this century does 0.1 GFLOP/s on one core


def test_bf16_dot_peak_only_where_the_host_has_avx512_bf16() -> None:
    k = load_cpu_kernels(kernel_cache_dir())
    if k is None:
        return
    dot = k.bf16_dot_peak(1, seconds=0.05)
    if "avx512_bf16" not in cpu_isa()["flags"]:  # type: ignore[operator]
        assert dot is None  # bfloat16 products widen to float32 here: fma_peak bounds them
        return
    assert dot is not None and math.isfinite(dot) and dot > 1e8
    # Builds below AVX512-BF16 have no such instruction: no bf16 peak, so the bench falls back to float32.
    avx2 = load_cpu_kernels(kernel_cache_dir(), "avx2")
    assert avx2 is not None and avx2.bf16_dot_peak(1, seconds=0.01) is None


def test_matmul_params_counts_every_product(tiny_llama_dir) -> None:
    c = ModelConfig.from_dir(tiny_llama_dir)
    attn = c.hidden_size * (c.q_size + 2 * c.kv_size + c.q_size)
    per_layer = attn + 3 * c.hidden_size * c.intermediate_size
    assert bench.matmul_params(c) == c.num_layers * per_layer + c.vocab_size * c.hidden_size


def _tiny_run(model_dir, dtype: str, batches: str) -> dict:
    cfg, _ = bench.parse_args(
        [
            "--model", str(model_dir), "--dtypes", dtype, "--batches", batches,
            "--prompt-len", "4", "--new-tokens", "3", "--prefill-len", "8", "--prefill-reps", "1",
            "--skip-transformers", "--threads", "1",
        ]
    )  # fmt: skip
    return bench.run(cfg)


@pytest.mark.slow  # seconds of work: make test runs it, test-fast does not
def test_engine_bench_rows_on_a_tiny_model(tiny_llama_dir) -> None:
    result = _tiny_run(tiny_llama_dir, "float32", "1,2")
    m = result["machine"]
    assert m["isa"] and "flags" in m and m["read_gbps"]
    assert m["cpu"] and m["cores"] and m["torch"] and m["device"] == {"type": "cpu"} and "kernel_isa" in m
    rows = {(r["phase"], r["batch"]): r for r in result["rows"]}
    for batch in (1, 2):
        bound, lin = rows[("bound", batch)], rows[("linear", batch)]
        assert bound["bound_tok_s"] > 0 and bound["pdserve_tok_s"] > 0
        assert lin["gflops"] > 0 and lin["gbps"] > 0 and lin["bound_tok_s"] == bound["bound_tok_s"]
        assert rows[("decode", batch)]["pdserve_tok_s"] > 0
    assert rows[("membw", 1)]["weight_bytes_per_step"] > 0
    assert {r["bound_peak"] for r in result["rows"] if r["phase"] in ("bound", "linear")} == {"f32_fma"}


@pytest.mark.slow  # seconds of work: make test runs it, test-fast does not
def test_bf16_rows_are_bounded_by_the_bf16_peak_where_there_is_one(tiny_llama_dir) -> None:
    result = _tiny_run(tiny_llama_dir, "bfloat16", "1")
    m = result["machine"]
    kinds = {r["bound_peak"] for r in result["rows"] if r["phase"] in ("bound", "linear")}
    if m["bf16_dot_peak_gflops"] is None:
        assert kinds == {"f32_fma"}  # no AVX512-BF16 (or no C compiler): bf16 products run as float32
    else:
        assert kinds == {"bf16_dot"} and m["bf16_dot_peak_gflops"] > 0


@pytest.mark.slow  # seconds of work: make test runs it, test-fast does not
def test_engine_bench_int8_rows_and_quality(tiny_llama_dir) -> None:
    cfg, _ = bench.parse_args(
        [
            "--model", str(tiny_llama_dir), "--dtypes", "float32", "--batches", "1,2",
            "--prompt-len", "4", "--new-tokens", "3", "--prefill-len", "8", "--prefill-reps", "1",
            "--skip-transformers", "--threads", "1", "--quantizations", "none,int8", "--quality-tokens", "5",
        ]
    )  # fmt: skip
    result = bench.run(cfg)
    rows = {(r["phase"], r["batch"], r["quantization"]): r for r in result["rows"] if r["phase"] != "quality"}
    for batch in (1, 2):
        q8, fp = rows[("decode", batch, "int8")], rows[("decode", batch, "none")]
        # Rates and the ratio are rounded to 0.01 each: the bound is those roundings' (a host's stall can
        # make one rate small and the ratio large).
        a, b = q8["pdserve_tok_s"], fp["pdserve_tok_s"]
        assert abs(q8["vs_unquantized"] - a / b) <= 5e-3 + (a / b) * (5e-3 / a + 5e-3 / b) + 1e-9
        assert "vs_unquantized" not in fp
    assert ("floor", 1, "none") in rows and ("floor", 1, "int8") not in rows
    info = result["machine"]["pdserve"]
    assert info["float32/int8"]["decode_weight_bytes"] < info["float32"]["decode_weight_bytes"] / 2
    q = next(r for r in result["rows"] if r["phase"] == "quality")
    assert q["tokens"] == 8 * 5 and 0 <= q["top1_agreement"] <= 1 and 0 <= q["exact_continuations"] <= 8
    assert q["prompt_source"] == "random-ids" and q["kl_from_unquantized"] >= 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--quantizations", "int4"])


# ---- the GPU suite (benchmarks.engine_cuda), run on CPU with a tiny model ----------------------------------


def test_random_smollm2_has_the_packaged_models_shape(tmp_path) -> None:
    from benchmarks.hf_baselines import random_config

    random_config("smollm2").save_pretrained(tmp_path)
    c = ModelConfig.from_dir(tmp_path)
    # The packaged SmolLM2-135M-Instruct's config.json (rms_norm_eps there is 1e-5 rounded to float32).
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        576, 1536, 30, 9, 3, 64,
    )  # fmt: skip
    assert (c.vocab_size, c.max_position_embeddings, c.rope_theta) == (49152, 8192, 100000.0)
    assert c.tie_word_embeddings and math.isclose(c.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert c.rope_scaling is None and c.model_type == "llama"


def test_step_bytes_counts_weights_norms_and_kv(tiny_llama_dir) -> None:
    import torch

    from benchmarks.engine_cuda import step_bytes

    c = ModelConfig.from_dir(tiny_llama_dir)
    weights, kv = step_bytes(c, torch.bfloat16)
    norms = (2 * c.num_layers + 1) * c.hidden_size
    assert weights == 2 * (bench.matmul_params(c) + norms)
    assert kv == 2 * c.num_layers * 2 * c.num_kv_heads * c.head_dim


def test_acceptance_checks_the_issue_targets() -> None:
    from benchmarks.engine_cuda_report import acceptance

    rows = [
        {"phase": "prefill", "batch": 1, "tokens": 1024, "llm_ms": 2.5},
        {"phase": "decode", "batch": 1, "llm_tok_s": 1200.0, "llm_vs_static": 1.4},
        {"phase": "decode", "batch": 8, "llm_tok_s": 9000.0, "llm_vs_static": 2.0},
        {"phase": "decode", "batch": 32, "llm_tok_s": 19000.0},  # no static baseline: not measured
    ]
    acc = acceptance(rows, issue_setting=True)
    got = {ck["check"]: ck["pass"] for ck in acc["checks"]}
    assert got == {
        "prefill 1024 tokens, LLM.generate ms": True,
        "decode batch 1, LLM.generate tok/s": True,
        "decode batch 1, LLM.generate / static+compile": False,
        "decode batch 8, LLM.generate / static+compile": True,
        "decode batch 32, LLM.generate tok/s": False,
        "decode batch 32, LLM.generate / static+compile": None,
    }
    assert acc["all_pass"] is None and acc["issue_setting"] is True


def test_engine_bench_hands_cuda_to_the_gpu_suite(monkeypatch) -> None:
    from benchmarks import engine_cuda

    seen = []
    monkeypatch.setattr(engine_cuda, "main", seen.append)
    bench.main(["--device", "cuda:1", "--random-model", "smollm2"])
    assert seen == [["--device", "cuda:1", "--random-model", "smollm2"]]
    cfg, out = engine_cuda.parse_args(["--device", "cpu", "--quick", "--batches", "1,4", "--out", "x.json"])
    assert (
        cfg.batches == (1, 4) and cfg.random_model == "tiny" and cfg.new_tokens == 4 and str(out) == "x.json"
    )
    defaults, _ = engine_cuda.parse_args(["--device", "cpu"])
    assert defaults.batches == (1, 8, 32, 128, 256) and defaults.dtype == "bfloat16"
    assert (defaults.prefill_len, defaults.prompt_len, defaults.new_tokens) == (1024, 128, 64)


@pytest.mark.slow  # seconds of work: make test runs it, test-fast does not
def test_gpu_suite_runs_on_cpu(tmp_path, capsys) -> None:
    from benchmarks import engine_cuda

    out = tmp_path / "engine_cuda.json"
    engine_cuda.main(["--device", "cpu", "--quick", "--dtype", "float32", "--out", str(out)])
    result = json.loads(out.read_text())
    assert "decode tok/s" in capsys.readouterr().out  # the table
    d = result["device"]
    assert d["device"] == "cpu" and d["torch"] and d["bandwidth"]["read_gbps"] > 0
    assert result["machine"]["isa"] and result["machine"]["device"] == {"type": "cpu"}
    assert d["transformers_static"] == "skipped: cpu" and "graph_capture_s" in d["pdserve"]
    assert result["work"]["decode_prompt_tokens"] == 8 and result["work"]["decode_new_tokens"] == 4
    rows = {(r["phase"], r["batch"]): r for r in result["rows"]}
    pre = rows[("prefill", 1)]
    assert pre["tokens"] == 16 and pre["runner_ms"] > 0 and pre["llm_ms"] > 0 and pre["transformers_ms"] > 0
    for batch in (1, 2):
        r = rows[("decode", batch)]
        assert r["runner_tok_s"] > 0 and "transformers_error" not in r
        assert "transformers_static_tok_s" not in r
        assert r["bound_tok_s"] > 0 and r["bound_bytes_per_step"] > result["work"]["weight_bytes_per_step"]
        # t(N) - t(1) can come out <= 0 for 3 tiny steps on a busy host: then it is None, never negative
        for name in ("llm_tok_s", "transformers_tok_s"):
            assert r[name] is None or r[name] > 0, name
    acc = result["acceptance"]
    assert acc["issue_setting"] is False and acc["all_pass"] is None  # no static baseline on CPU
    assert [ck["check"] for ck in acc["checks"]][:2] == [
        "prefill 16 tokens, LLM.generate ms",
        "decode batch 1, LLM.generate tok/s",
    ]
