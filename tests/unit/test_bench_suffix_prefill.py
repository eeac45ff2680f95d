"""``benchmarks.suffix_prefill`` on a tiny model: a median, the machine's ISA, and a breakdown whose parts
add up to the instrumented step."""

from __future__ import annotations

from benchmarks import suffix_prefill


def test_suffix_prefill_reports_a_median_and_its_parts(tiny_llama_dir, capsys) -> None:
    args = suffix_prefill.parse_args(
        [
            "--model",
            str(tiny_llama_dir),
            "--prefix-len",
            "40",
            "--suffix-len",
            "5",
            "--reps",
            "2",
            "--rounds",
            "1",
        ]
    )
    result = suffix_prefill.run(args)
    assert result["machine"]["isa"] and result["prefix_len"] == 40 and result["suffix_len"] == 5
    assert result["median_ms"] > 0 and len(result["round_medians_ms"]) == 1
    parts = result["breakdown_ms"]
    assert {"attention", "linear qkv", "linear lm_head", "argmax"} <= parts.keys()
    summed = sum(
        v for k, v in parts.items() if not k.startswith(suffix_prefill.NESTED) and k != "total (instrumented)"
    )
    assert abs(summed - parts["total (instrumented)"]) < 0.05
    suffix_prefill._print(result)
    assert "isa=" in capsys.readouterr().out
