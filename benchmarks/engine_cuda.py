"""Engine benchmark on a GPU: pdserve against transformers (eager and compiled) and the memory bound.

    python -m benchmarks.engine --device cuda --random-model smollm2 --out engine_cuda.json
    python -m benchmarks.engine_cuda --device cpu --quick          # the same code on CPU, tiny model

Rows, bounds and the GPU targets: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_cuda_report import acceptance, table
from benchmarks.engine_steps import runner_decode_steps
from benchmarks.hf_baselines import (
    RANDOM_MODELS,
    STATIC_RECIPES,
    hf_gen,
    load_transformers,
    make_static,
    write_random_model,
)
from pdserve.bench.machine import cpu_name, machine_info

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GpuBenchConfig:
    device: str = "cuda"
    model: str | None = None  # a model name or HF directory; None: --random-model
    random_model: str | None = "smollm2"
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = (1, 8, 32, 128, 256)
    prompt_len: int = 128
    new_tokens: int = 64
    prefill_len: int = 1024
    reps: int = 3
    transformers: bool = True
    compiled: str = "auto"  # the static-cache baseline: auto (on for CUDA, off for CPU), on, off
    static_recipe: str = "auto"  # generate | forward | auto (generate where transformers has CompileConfig)
    bandwidth_mib: int | None = None  # None: 2048 on CUDA, 64 elsewhere
    seed: int = 0

    @property
    def issue_setting(self) -> bool:
        return (
            torch.device(self.device).type == "cuda"
            and self.dtype == "bfloat16"
            and (self.prefill_len, self.prompt_len, self.new_tokens) == (1024, 128, 64)
        )


QUICK: dict[str, Any] = dict(
    batches=(1, 2), prompt_len=8, new_tokens=4, prefill_len=16, reps=1, random_model="tiny"
)


# ---- the model ---------------------------------------------------------------------------------------


def step_bytes(config: Any, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes one decode step reads, K/V bytes per cached token) of a pdserve ``ModelConfig``."""
    c = config
    elt = torch.empty((), dtype=dtype).element_size()
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size  # + the two norms
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size  # LM head, final norm
    return weights * elt, c.num_layers * 2 * c.kv_size * elt


# ---- timing --------------------------------------------------------------------------------------------


def _kernel_choices() -> dict[str, Any]:
    """The CUDA backend's switches read from the environment (``triton_kernels``): a row is comparable
    only with rows of the same choices."""
    from pdserve.engine import triton_kernels as tk

    return {"gemv_max_rows": tk.GEMV_MAX_ROWS, "fuse_norms": tk.FUSE_NORMS}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def read_bandwidth(device: torch.device, mib: int, reps: int = 10) -> dict[str, float]:
    """GB/s summing a ``mib`` MiB float32 tensor (reads only) and copying it (read + write bytes counted).
    On CUDA each figure is the best of 3 rounds of ``reps`` calls between two CUDA events."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)

    def rate(fn: Callable[[], Any], nbytes: int) -> float:
        fn()
        _sync(device)
        if device.type == "cuda":
            best = float("inf")
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3 / reps)
        else:
            best = min(_timed(fn, device) for _ in range(reps))
        return nbytes / best / 1e9

    out = {"read_gbps": rate(x.sum, x.nbytes), "copy_gbps": rate(lambda: y.copy_(x), 2 * x.nbytes)}
    return {k: round(v, 1) for k, v in out.items()} | {"tensor_mib": mib}


def gen_seconds(
    gen: Callable[[int], Any], new_tokens: int, reps: int, device: torch.device
) -> dict[str, float]:
    """Warm-up, then the best of ``reps`` of ``gen(1)`` and of ``gen(new_tokens)``: whole-call seconds."""
    t = time.perf_counter()
    gen(new_tokens)
    gen(1)
    _sync(device)
    warm = time.perf_counter() - t
    one, full = [], []
    for _ in range(reps):
        one.append(_timed(lambda: gen(1), device))
        full.append(_timed(lambda: gen(new_tokens), device))
    return {"warmup_s": warm, "t1_s": min(one), "tn_s": min(full)}


def decode_rate(batch: int, new_tokens: int, times: dict[str, float]) -> float | None:
    """tok/s of the N - 1 decode steps: batch * (N - 1) / (t(N) - t(1))."""
    dt = times["tn_s"] - times["t1_s"]
    return batch * (new_tokens - 1) / dt if dt > 0 else None


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (n, length), generator=g).tolist()  # low ids: special tokens


# ---- pdserve -------------------------------------------------------------------------------------------


def runner_prefill_ms(runner: Any, prompt: list[int], reps: int) -> float:
    from pdserve.engine.model_runner import PrefillItem

    table = list(range(-(-len(prompt) // runner.block_size)))

    def run() -> None:
        runner.prefill([PrefillItem(prompt, table)]).argmax(-1).tolist()

    run()
    return 1e3 * min(_timed(run, runner.device) for _ in range(reps))


def llm_gen(llm: Any, prompts: list[list[int]]) -> Callable[[int], Any]:
    from pdserve.engine import SamplingParams

    def gen(n: int) -> Any:
        return llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )

    return gen


# ---- the run -------------------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict[str, Any]:
    def version(mod: str) -> str | None:
        try:
            return str(__import__(mod).__version__)
        except ImportError:
            return None

    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "sm_count": p.multi_processor_count,
        }
    else:
        info["cpu"] = cpu_name()
        info["threads"] = torch.get_num_threads()
    return info


def run(cfg: GpuBenchConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        if cfg.model is not None:
            from pdserve.engine.registry import resolve_model

            model_dir = resolve_model(cfg.model)
        else:
            assert cfg.random_model is not None
            model_dir = write_random_model(
                cfg.random_model, Path(tmp) / cfg.random_model, DTYPES[cfg.dtype], cfg.device, cfg.seed
            )
        return _run(cfg, model_dir)


def _run(cfg: GpuBenchConfig, model_dir: Path) -> dict[str, Any]:
    from pdserve.engine import LLM
    from pdserve.engine.config import ModelConfig

    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    c = ModelConfig.from_dir(model_dir)
    info = device_info(device)
    bw = read_bandwidth(device, cfg.bandwidth_mib or (2048 if device.type == "cuda" else 64))
    info["bandwidth"] = bw
    weight_bytes, kv_per_token = step_bytes(c, dtype)
    max_batch = max(cfg.batches)

    t = time.perf_counter()
    tokens = max(cfg.prefill_len, max_batch * (cfg.prompt_len + cfg.new_tokens))
    llm = LLM(
        str(model_dir),
        dtype=cfg.dtype,
        device=cfg.device,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, cfg.prefill_len),
        num_blocks=tokens // 16 + 2 * max_batch + 2,
    )
    runner = llm.engine.runner  # the runner rows reuse its weights, cache and graphs while LLM is idle
    _sync(device)
    info["pdserve"] = {
        "llm_init_s": round(time.perf_counter() - t, 2),
        "graph_capture_s": getattr(runner, "graph_capture_s", None),
        "backend": str(getattr(runner, "backend", None)),
        "num_blocks": runner.num_blocks,
        "kernel_choices": _kernel_choices(),
    }
    compiled = cfg.compiled == "on" or (cfg.compiled == "auto" and device.type == "cuda")
    hf = static = None
    recipe = "skipped: --skip-transformers"
    if cfg.transformers:
        hf = load_transformers(model_dir, dtype, device)
        recipe = "skipped: --compiled off" if cfg.compiled == "off" else f"skipped: {device.type}"
        if compiled:
            static = load_transformers(model_dir, dtype, device)
            recipe = make_static(static, cfg.static_recipe)
    info["transformers_static"] = STATIC_RECIPES.get(recipe, recipe)

    rows: list[dict[str, Any]] = []
    prompt = _prompts(1, cfg.prefill_len, c.vocab_size, cfg.seed)[0]
    row: dict[str, Any] = {"phase": "prefill", "batch": 1, "tokens": cfg.prefill_len}
    row["runner_ms"] = runner_prefill_ms(runner, prompt, cfg.reps)
    row["llm_ms"] = 1e3 * gen_seconds(llm_gen(llm, [prompt]), 1, cfg.reps, device)["t1_s"]
    if hf is not None:
        row["transformers_ms"] = 1e3 * gen_seconds(hf_gen(hf, [prompt]), 1, cfg.reps, device)["t1_s"]
    row["llm_tok_s"] = cfg.prefill_len / row["llm_ms"] * 1e3
    rows.append(_log(row))

    for batch in cfg.batches:
        prompts = _prompts(batch, cfg.prompt_len, c.vocab_size, cfg.seed + batch)
        row = {"phase": "decode", "batch": batch}
        runner_decode_steps(runner, prompts, min(4, cfg.new_tokens))  # warm-up at this batch
        steps = runner_decode_steps(runner, prompts, cfg.new_tokens)
        row["runner_tok_s"] = batch * len(steps) / sum(steps)
        row["runner_median_tok_s"] = batch / statistics.median(steps)
        times = gen_seconds(llm_gen(llm, prompts), cfg.new_tokens, cfg.reps, device)
        row["llm_tok_s"] = decode_rate(batch, cfg.new_tokens, times)
        row["llm_warmup_s"] = times["warmup_s"]
        for name, model in (("transformers", hf), ("transformers_static", static)):
            if model is None:
                continue
            try:
                times = gen_seconds(hf_gen(model, prompts), cfg.new_tokens, cfg.reps, device)
            except Exception as e:  # a baseline that breaks must not cost the run's other rows
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            row[f"{name}_tok_s"] = decode_rate(batch, cfg.new_tokens, times)
            row[f"{name}_warmup_s"] = times["warmup_s"]
        if static is not None and recipe == "generate":
            row["transformers_static_compiled"] = hasattr(static, "_compiled_call")  # generate did compile
        mean_ctx = cfg.prompt_len + cfg.new_tokens / 2
        read = weight_bytes + batch * kv_per_token * mean_ctx
        row["bound_tok_s"] = batch * bw["read_gbps"] * 1e9 / read
        row["bound_bytes_per_step"] = int(read)
        row |= _ratios(row)
        rows.append(_log(row))
        gc.collect()

    capture = getattr(runner, "graph_capture_s", None)  # read again: capture may happen on first use
    info["pdserve"]["graph_capture_s"] = None if capture is None else round(capture, 3)
    del llm, runner, hf, static
    gc.collect()
    work = {
        "decode_prompt_tokens": cfg.prompt_len,
        "decode_new_tokens": cfg.new_tokens,
        "decode_timing": "whole generate calls: t(N tokens) - t(1 token); runner: sum of synchronized steps",
        "bound_mean_context": cfg.prompt_len + cfg.new_tokens / 2,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
    }
    rows = [_rounded(r) for r in rows]
    return {
        "machine": machine_info(str(device)),  # the host: CPU, ISA, cores; its GPU in device too
        "device": info,
        "config": asdict(cfg) | {"model_dir": str(model_dir) if cfg.model else None},
        "work": work,
        "rows": rows,
        "acceptance": acceptance(rows, cfg.issue_setting),
    }


def _ratios(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    llm = row.get("llm_tok_s")
    for key, ref in (("vs_static", "transformers_static_tok_s"), ("vs_transformers", "transformers_tok_s"),
                     ("vs_bound", "bound_tok_s")):  # fmt: skip
        if llm and row.get(ref):
            out[f"llm_{key}"] = llm / row[ref]
    return out


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


def _log(row: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(_rounded(row)), file=sys.stderr, flush=True)
    return row


def parse_args(argv: Sequence[str] | None = None) -> tuple[GpuBenchConfig, Path | None]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine --device cuda", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the same code, for smoke tests)")
    p.add_argument("--out", type=Path, help="write the JSON here and print a table (default: print the JSON)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model name or HF directory (default: --random-model smollm2)")
    src.add_argument("--random-model", choices=sorted(RANDOM_MODELS), help="random weights of this shape")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--batches", help="decode batch sizes, comma-separated (default 1,8,32,128,256)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens of each decode sequence (default 128)")
    p.add_argument("--new-tokens", type=int, help="greedy tokens per sequence (default 64)")
    p.add_argument("--prefill-len", type=int, help="tokens of the prefill prompt (default 1024)")
    p.add_argument("--reps", type=int, help="timed repetitions, best kept (default 3)")
    p.add_argument("--skip-transformers", action="store_true", help="pdserve and the bound only")
    p.add_argument("--compiled", choices=("auto", "on", "off"), default="auto",
                   help="the static-cache + torch.compile baseline (auto: on CUDA only)")  # fmt: skip
    p.add_argument("--static-recipe", choices=("auto", "generate", "forward"), default="auto",
                   help="generate: transformers' own compile_config (the decode forward; prefill eager); "
                   "forward: model.forward = torch.compile(...) (the 4.x recipe; with transformers 5.17 "
                   "it failed on overwritten CUDA-graph outputs); auto: generate where transformers has "
                   "CompileConfig")  # fmt: skip
    p.add_argument("--bandwidth-mib", type=int, help="tensor size for the bandwidth probe")
    p.add_argument(
        "--quick", action="store_true", help="tiny random model, batches 1,2, short prompts, 1 rep"
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = GpuBenchConfig(
        device=a.device,
        dtype=a.dtype,
        transformers=not a.skip_transformers,
        compiled=a.compiled,
        static_recipe=a.static_recipe,
        bandwidth_mib=a.bandwidth_mib,
        seed=a.seed,
    )
    if a.quick:
        cfg = replace(cfg, **QUICK)
    given = {
        "model": a.model,
        "random_model": a.random_model,
        "batches": None if a.batches is None else _batches(p, a.batches),
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "prefill_len": a.prefill_len,
        "reps": a.reps,
    }
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if a.model is not None:
        cfg = replace(cfg, random_model=None)
    if (
        cfg.new_tokens < 2
        or cfg.prompt_len < 1
        or cfg.prefill_len < 1
        or cfg.reps < 1
        or min(cfg.batches) < 1
    ):
        p.error("--new-tokens must be >= 2; --prompt-len, --prefill-len, --reps and batches >= 1")
    try:
        dev = torch.device(cfg.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {cfg.device}: torch {torch.__version__} sees no CUDA device here")
    return cfg, a.out


def _batches(p: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {text!r}")


def main(argv: Sequence[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    result = run(cfg)
    if out is None:
        print(json.dumps(result, indent=2))
    else:
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(table(result))


if __name__ == "__main__":
    main()
