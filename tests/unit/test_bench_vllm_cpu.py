"""benchmarks.vllm_cpu without vLLM: its arguments and the command lines of the servers it compares."""

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
    assert vllm_cpu.parse_args([]).dtype == "float32"
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--dtype", "float16"])
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--servers", "sglang"])
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--concurrency", "0"])
