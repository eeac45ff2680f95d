"""``bench.engine`` end to end on a tiny model: the rows it promises, with the host's ISA and bounds."""

from __future__ import annotations

import math

from pdserve.bench import engine as bench
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import kernel_cache_dir, load_cpu_kernels


def test_fma_peak_is_measured() -> None:
    k = load_cpu_kernels(kernel_cache_dir())
    if k is None:
        return  # no C compiler: the bench then bounds by memory alone (covered below)
    one = k.fma_peak(1, seconds=0.05)
    assert math.isfinite(one) and one > 1e8  # any CPU of this century does 0.1 GFLOP/s on one core


def test_matmul_params_counts_every_product(tiny_llama_dir) -> None:
    c = ModelConfig.from_dir(tiny_llama_dir)
    attn = c.hidden_size * (c.q_size + 2 * c.kv_size + c.q_size)
    per_layer = attn + 3 * c.hidden_size * c.intermediate_size
    assert bench.matmul_params(c) == c.num_layers * per_layer + c.vocab_size * c.hidden_size


def test_engine_bench_rows_on_a_tiny_model(tiny_llama_dir) -> None:
    cfg, _ = bench.parse_args(
        [
            "--model", str(tiny_llama_dir), "--dtypes", "float32", "--batches", "1,2",
            "--prompt-len", "4", "--new-tokens", "3", "--prefill-len", "8", "--prefill-reps", "1",
            "--skip-transformers", "--threads", "1",
        ]
    )  # fmt: skip
    result = bench.run(cfg)
    m = result["machine"]
    assert m["isa"] and "flags" in m and m["read_gbps"]
    rows = {(r["phase"], r["batch"]): r for r in result["rows"]}
    for batch in (1, 2):
        bound, lin = rows[("bound", batch)], rows[("linear", batch)]
        assert bound["bound_tok_s"] > 0 and bound["pdserve_tok_s"] > 0
        assert lin["gflops"] > 0 and lin["gbps"] > 0 and lin["bound_tok_s"] == bound["bound_tok_s"]
        assert rows[("decode", batch)]["pdserve_tok_s"] > 0
    assert rows[("membw", 1)]["weight_bytes_per_step"] > 0
