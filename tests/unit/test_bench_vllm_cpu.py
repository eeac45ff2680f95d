"""benchmarks.vllm_cpu without vLLM: its arguments, the command lines of the servers it compares and of
vLLM's client, and the summary it builds from result files."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import vllm_cpu


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_servers_compute_in_the_dtype_asked_for(tmp_path: Path, dtype: str) -> None:
    # pdserve's own default (auto) is bfloat16 on AVX512-BF16 hosts: a side-by-side must not leave it there
    # while vLLM runs float32.
    cfg = vllm_cpu.parse_args(["--dtype", dtype, "--servers", "vllm,pdserve,pdserve-int8"])
    assert cfg.dtype == dtype
    for kind in cfg.servers:
        server = vllm_cpu.Server(kind, Path("/x/vllm"), Path("/m"), 2, tmp_path, cfg.dtype)
        cmd = server.command()
        assert _flag(cmd, "--dtype") == dtype, kind
        assert ("serve" in cmd) == (kind == "vllm")
    int8 = vllm_cpu.Server("pdserve-int8", Path("/x/vllm"), Path("/m"), 2, tmp_path, dtype).command()
    assert _flag(int8, "--quantization") == "int8"


def test_arguments_are_checked() -> None:
    from pdserve.engine.device import resolve_dtype

    # auto: bfloat16 where the CPU has bf16 dot products, float32 elsewhere (pdserve's own rule).
    assert vllm_cpu.parse_args([]).dtype == resolve_dtype("auto", "cpu")
    assert vllm_cpu.parse_args(["--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--dtype", "float16"])
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--servers", "sglang"])
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--dataset", "sharegpt"])
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--prefix-repetition-prefix-len", "0"])


def test_each_dataset_has_its_own_defaults() -> None:
    plain = vllm_cpu.parse_args([])
    assert (plain.dataset, plain.num_prompts, plain.concurrency) == ("random", 24, [1, 8])
    assert plain.servers == ("vllm", "pdserve")
    prefix = vllm_cpu.parse_args(["--dataset", "prefix_repetition"])
    assert (prefix.num_prompts, prefix.concurrency) == (32, [1, 4])
    assert prefix.servers == vllm_cpu.PREFIX_SERVERS
    mine = vllm_cpu.parse_args(["--dataset", "prefix_repetition", "--num-prompts", "4", "--concurrency", "2"])
    assert (mine.num_prompts, mine.concurrency) == (4, [2])


def test_vllm_client_gets_the_prefix_repetition_workload(tmp_path: Path) -> None:
    cfg = vllm_cpu.parse_args(
        ["--dataset", "prefix_repetition", "--prefix-repetition-prefix-len", "100", "--num-prompts", "8"]
    )
    cmd = vllm_cpu.bench_command(
        Path("/v/vllm"), "http://h:1", "model", Path("/m"), cfg, 4, tmp_path / "r.json"
    )
    assert cmd[1:3] == ["bench", "serve"] and "--ignore-eos" in cmd
    assert _flag(cmd, "--dataset-name") == "prefix_repetition"
    assert _flag(cmd, "--prefix-repetition-prefix-len") == "100"
    assert _flag(cmd, "--prefix-repetition-suffix-len") == "32"
    assert _flag(cmd, "--prefix-repetition-num-prefixes") == "4"
    assert _flag(cmd, "--prefix-repetition-output-len") == "32"
    assert _flag(cmd, "--num-prompts") == "8" and _flag(cmd, "--max-concurrency") == "4"
    assert "--random-input-len" not in cmd
    plain = vllm_cpu.bench_command(
        Path("/v/vllm"), "http://h:1", "m", Path("/m"), vllm_cpu.parse_args([]), 1, tmp_path / "r.json"
    )
    assert _flag(plain, "--dataset-name") == "random" and _flag(plain, "--random-input-len") == "256"


def test_server_shapes_caching_and_threads(tmp_path: Path) -> None:
    def command(kind: str, caching: bool = False) -> list[str]:
        return vllm_cpu.Server(kind, Path("/x/vllm"), Path("/m"), 4, tmp_path, "float32", caching).command()

    for kind in ("pdserve", "pdserve-no-cache"):
        cmd = command(kind)
        assert (_flag(cmd, "--prefill"), _flag(cmd, "--decode"), _flag(cmd, "--colocated")) == ("0", "0", "1")
        assert _flag(cmd, "--threads") == "4"
    for kind in ("pdserve-1p1d", "pdserve-1p1d-no-cache"):
        cmd = command(kind)
        assert (_flag(cmd, "--prefill"), _flag(cmd, "--decode"), _flag(cmd, "--colocated")) == ("1", "1", "0")
        assert _flag(cmd, "--threads") == "2"  # the cores shared out between the two workers
    for kind in vllm_cpu.PDSERVE_VARIANTS:
        assert ("--no-enable-prefix-caching" in command(kind)) == kind.endswith("no-cache"), kind
    assert "--no-enable-prefix-caching" in command("vllm")
    on = command("vllm", caching=True)
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" not in on


def _row(tok_s: float, median_ttft: float) -> dict:
    raw = {
        "completed": 8, "failed": 0, "output_throughput": tok_s, "mean_ttft_ms": median_ttft * 1.1,
        "median_ttft_ms": median_ttft, "mean_tpot_ms": 20.0, "median_tpot_ms": 19.0, "duration": 3.0,
    }  # fmt: skip
    return vllm_cpu.result_row(raw)


def test_ratios_and_targets_from_the_rounds(tmp_path: Path) -> None:
    results = {
        "vllm": {1: [_row(50, 100), _row(40, 80)], 4: [_row(100, 300), _row(110, 320)]},
        "pdserve": {1: [_row(70, 60), _row(65, 70)], 4: [_row(120, 280), _row(100, 250)]},
        "pdserve-1p1d": {1: [_row(60, 40), _row(60, 30)], 4: [_row(90, 90), _row(90, 100)]},
        "pdserve-1p1d-no-cache": {1: [_row(30, 300), _row(30, 330)], 4: [_row(40, 300), _row(40, 310)]},
    }
    r = vllm_cpu.ratios(results)
    # Throughput: best round over best round; median TTFT: lowest round over lowest round.
    assert r["colocated_over_vllm_output_tok_s"] == {"1": 1.4, "4": round(120 / 110, 3)}
    assert r["colocated_over_vllm_median_ttft"] == {"1": 0.75, "4": round(250 / 300, 3)}
    assert r["pd_no_cache_over_cache_median_ttft"] == {"1": 10.0, "4": round(300 / 90, 3)}
    lines = {(x["ratio"], x["concurrency"]): x for x in vllm_cpu.acceptance(r)}
    assert len(lines) == 6
    assert lines[("colocated_over_vllm_output_tok_s", 1)]["pass"]
    assert not lines[("colocated_over_vllm_output_tok_s", 4)]["pass"]
    assert lines[("colocated_over_vllm_median_ttft", 1)]["pass"]
    assert not lines[("colocated_over_vllm_median_ttft", 4)]["pass"]
    assert lines[("pd_no_cache_over_cache_median_ttft", 1)]["target"] == ">= 5.0"
    assert [lines[("pd_no_cache_over_cache_median_ttft", c)]["pass"] for c in (1, 4)] == [True, False]
    # A ratio whose servers did not run is left out, not guessed.
    assert vllm_cpu.ratios({"vllm": results["vllm"]}) == {}

    result = {
        "machine": {"cpu": "cpu", "isa": "avx2", "flags": ["avx2"], "threads": 2},
        "config": {"dtype": "float32", "dataset": "prefix_repetition", "num_prompts": 8},
        "vllm_cpu": vllm_cpu.VLLM_CPU,
        "vllm_prefix_caching": True,
        "best": {k: {str(c): max(rows, key=lambda x: x["output_tok_s"]) for c, rows in v.items()}
                 for k, v in results.items()},
        "over_vllm_output_tok_s": {},
        "acceptance": vllm_cpu.acceptance(r),
    }  # fmt: skip
    md = vllm_cpu.markdown(result)
    assert "median TTFT ms" in md and "FAIL C=4: colocated_over_vllm_median_ttft" in md
    assert "PASS C=1: pd_no_cache_over_cache_median_ttft = 10.00 (want >= 5.0)" in md
    png = tmp_path / "summary.png"
    if vllm_cpu.plot(result, png):
        assert png.stat().st_size > 0


def test_a_server_that_failed_is_reported_and_left_out() -> None:
    cfg = vllm_cpu.parse_args(["--dataset", "prefix_repetition", "--concurrency", "1"])
    results = {
        "vllm": {1: [{**_row(50, 100), "round": 1}, {**_row(40, 90), "round": 2}]},
        "pdserve": {1: [{**_row(70, 60), "round": 2}]},  # round 1 failed
        "pdserve-1p1d": {1: [{**_row(60, 40), "round": 1}]},
        "pdserve-1p1d-no-cache": {1: []},  # every round failed
    }
    failures = [
        {"server": "pdserve", "round": 1, "error": "boom", "logs": "/x"},
        {"server": "pdserve-1p1d-no-cache", "round": 1, "error": "boom", "logs": "/y"},
    ]
    doc = vllm_cpu.summarize(cfg, results, failures)
    assert set(doc["best"]) == {"vllm", "pdserve", "pdserve-1p1d"}
    assert doc["over_vllm_by_round"]["pdserve"] == {"1": [1.75]}  # paired with vLLM's round 2 only
    assert set(doc["ratios"]) == {"colocated_over_vllm_output_tok_s", "colocated_over_vllm_median_ttft"}
    assert doc["failures"] == failures and doc["command"].startswith("python -m benchmarks.vllm_cpu")
    md = vllm_cpu.markdown(doc)
    assert "FAILED to run: pdserve-1p1d-no-cache in round 1 (logs: /y)" in md
