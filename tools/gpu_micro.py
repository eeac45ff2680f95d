"""Kernel choices of the CUDA backend, measured the way a step runs them: inside a CUDA graph.

    python -m tools.gpu_micro [--what products,argmax,attention,steps] [--out FILE]

Each candidate runs once per layer on distinct tensors in one graph, so nothing stays in L2 that a step would
not find there; a row is device microseconds per call. The parts: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.bench.machine import machine_info
from pdserve.engine import triton_kernels as tk

LAYERS = 30
HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 49152, 9, 3, 64
DT = torch.bfloat16


def graph_us(fn: Callable[[int], Any], reps: int = LAYERS, replays: int = 20) -> float:
    """Device microseconds per ``fn(i)`` call, ``reps`` calls captured in one graph."""
    for i in range(reps):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)


def products() -> list[dict[str, Any]]:
    rows = []
    shapes = [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, False), ("o", HIDDEN, HIDDEN, False),
              ("gate_up", 2 * INTER, HIDDEN, False), ("down+silu", HIDDEN, INTER, True),
              ("lm_head", VOCAB, HIDDEN, False)]  # fmt: skip
    for name, n, k, silu in shapes:
        layers = 1 if name == "lm_head" else LAYERS
        ws = [torch.randn(n, k, device="cuda", dtype=DT) * 0.02 for _ in range(layers)]
        for m in (1, 4):
            x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=DT)

            def cublas(i: int, x=x, ws=ws, silu=silu) -> Any:
                w = ws[i % len(ws)]
                return F.linear(tk.silu_mul(x) if silu else x, w)

            row: dict[str, Any] = {"product": name, "n": n, "k": k, "rows": m, "cublas_us": graph_us(cublas)}
            row["gemv_default_us"] = graph_us(
                lambda i, x=x, ws=ws, silu=silu: tk.gemv(x, ws[i % len(ws)], silu_mul=silu)
            )
            for bn in (4, 8, 16, 32):
                for warps in (2, 4, 8):
                    try:
                        row[f"gemv_bn{bn}_w{warps}_us"] = graph_us(
                            lambda i, x=x, ws=ws, silu=silu, bn=bn, warps=warps: tk.gemv(
                                x, ws[i % len(ws)], silu_mul=silu, block_n=bn, num_warps=warps
                            )
                        )
                    except Exception as e:  # noqa: BLE001 - a config that does not compile
                        row[f"gemv_bn{bn}_w{warps}_us"] = repr(e)[:80]
            best = min((v, key) for key, v in row.items() if key.startswith("gemv") and isinstance(v, float))
            row["best"] = best[1]
            line = f"{name:10s} rows {m}: cuBLAS {row['cublas_us']:6.2f} us, gemv default "
            print(line + f"{row['gemv_default_us']:6.2f} us, best {best[1]} {best[0]:6.2f} us", flush=True)
            rows.append(row)
    return rows


def argmax() -> list[dict[str, Any]]:
    rows = []
    for n in (1, 32):
        logits = torch.randn(n, VOCAB, device="cuda")
        row: dict[str, Any] = {"rows": n, "torch_us": graph_us(lambda i, x=logits: x.argmax(-1))}
        for block in (2048, 4096, 8192):
            row[f"triton_b{block}_us"] = graph_us(lambda i, x=logits, b=block: tk.argmax_rows(x, block=b))
        print(
            f"argmax {n:3d} rows: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "rows"),
            flush=True,
        )
        rows.append(row)
    return rows


def attention(tokens: int = 1024) -> list[dict[str, Any]]:
    block = 16
    nb = tokens // block
    kvs = [torch.randn(nb, 2, block, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT) for _ in range(LAYERS)]
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=DT)
    tables = torch.randperm(nb, device="cuda").view(1, nb).to(torch.int64)
    cu = torch.tensor([0, tokens], device="cuda")
    start = torch.zeros(1, dtype=torch.int64, device="cuda")
    rows = []
    configs = [(64, 64, 4, None), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2),
               (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
               (128, 128, 8, 2)]  # fmt: skip
    flops = 4 * HEADS * HEAD_DIM * tokens * (tokens + 1) / 2
    for bm, bn, warps, stages in configs:
        try:
            us = graph_us(
                lambda i, bm=bm, bn=bn, w=warps, s=stages: tk.prefill_attention(
                    kvs[i], q, tables, cu, start, tokens, block_m=bm, block_n=bn, num_warps=w, num_stages=s
                )
            )
        except Exception as e:  # noqa: BLE001 - out of shared memory, say
            print(f"attention bm {bm} bn {bn} warps {warps} stages {stages}: {e!r}"[:160], flush=True)
            continue
        rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "us": us,
                     "tflops": flops / us / 1e6})  # fmt: skip
        print(f"attention {tokens} tokens bm {bm:3d} bn {bn:3d} warps {warps} stages {stages}: {us:7.2f} us "
              f"({flops / us / 1e6:.1f} TFLOP/s)", flush=True)  # fmt: skip
    return rows


def steps() -> dict[str, Any]:
    from benchmarks.engine_cuda import _prompts, llm_gen
    from benchmarks.hf_baselines import write_random_model
    from pdserve.engine import LLM
    from pdserve.engine.model_runner import PrefillItem

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_model("smollm2", Path(tmp) / "m", DT, "cuda")
        rows, fuse = tk.GEMV_MAX_ROWS, tk.FUSE_NORMS
        runs = dict.fromkeys(((rows, fuse), (rows, not fuse), (0, False)) if rows else ((0, False),))
        for gemv_rows, fuse_norms in runs:  # the defaults first
            tk.GEMV_MAX_ROWS, tk.FUSE_NORMS = gemv_rows, fuse_norms  # read when the graphs are captured
            llm = LLM(str(model), dtype="bfloat16", device="cuda", max_num_seqs=8, num_blocks=400)
            prompts = _prompts(1, 128, VOCAB, 1)
            gen = llm_gen(llm, prompts)
            gen(16)
            ms = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen(1)
                t1 = time.perf_counter()
                gen(65)
                tn = time.perf_counter()
                ms.append(((tn - t1) - (t1 - t0)) / 64 * 1e3)
            key = f"decode_b1_ms_gemv_rows_{gemv_rows}" + ("_fused_norms" if fuse_norms else "")
            out[key] = min(ms)
            print(f"{key}: {min(ms):.3f} ms/step ({1e3 / min(ms):.0f} tok/s)", flush=True)
            runner = llm.engine.runner
            if (gemv_rows, fuse_norms) != (rows, fuse):  # prefill runs no gemv: measured once
                del llm, runner
                torch.cuda.empty_cache()
                continue
            prompt = _prompts(1, 1024, VOCAB, 2)[0]
            table = list(range(64))
            for label in ("graph", "eager"):
                if label == "eager":
                    runner._prefill_graphs = None
                times = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    runner.argmax(runner.prefill([PrefillItem(prompt, table)])).tolist()
                    times.append((time.perf_counter() - t0) * 1e3)
                out[f"prefill_1024_ms_{label}"] = min(times)
                print(f"prefill 1024 {label}: {min(times):.3f} ms", flush=True)
            del llm, runner
            torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_micro", description=__doc__.split("\n")[0])
    p.add_argument("--what", default="products,argmax,attention,steps")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    parts = {"products": products, "argmax": argmax, "attention": attention, "steps": steps}
    result: dict[str, Any] = {
        "machine": machine_info("cuda"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    import triton

    result["triton"] = triton.__version__
    for what in a.what.split(","):
        t = time.perf_counter()
        print(f"== {what}", flush=True)
        result[what] = parts[what]()
        print(f"== {what}: {time.perf_counter() - t:.1f} s", flush=True)
        if a.out:
            a.out.write_text(json.dumps(result, indent=1, default=lambda v: None if math.isnan(v) else v))


if __name__ == "__main__":
    main()
