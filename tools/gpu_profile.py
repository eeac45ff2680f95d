"""Where the CUDA engine's time goes: torch.profiler over prefill and decode, cProfile over the host side.

    python -m tools.gpu_profile [--batches 1,32,256] [--prefill-len 1024] [--top 18]

Text for a person, on a random-weight model of SmolLM2-135M's shape; the engine benchmark keeps the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_cuda import _prompts, llm_gen
from benchmarks.engine_steps import runner_decode_steps
from benchmarks.hf_baselines import write_random_model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kernels(fn, top: int) -> str:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if e.self_device_time_total > 0)
    head = f"wall {wall * 1e3:.2f} ms (profiled), GPU kernels {gpu_us / 1e3:.2f} ms in {launches} launches\n"
    return head + events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60)


def _host(fn, top: int) -> str:  # type: ignore[no-untyped-def]
    pr = cProfile.Profile()
    pr.enable()
    fn()
    _sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in s.getvalue().splitlines() if line.strip())


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_profile", description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    p.add_argument("--random-model", default="smollm2", help="smollm2, or tiny for a smoke test")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    from pdserve.engine import LLM
    from pdserve.engine.model_runner import PrefillItem

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_model(a.random_model, Path(tmp) / "m", torch.bfloat16, a.device)
        t = time.perf_counter()
        llm = LLM(
            str(model),
            dtype="bfloat16",
            device=a.device,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, a.prefill_len),
            num_blocks=max(batches) * 12 + 80,
        )
        capture = getattr(llm.engine.runner, "graph_capture_s", None)
        print(f"LLM init {time.perf_counter() - t:.2f} s, graph capture {capture} s")
        runner = llm.engine.runner
        prompt = _prompts(1, a.prefill_len, runner.config.vocab_size, 0)[0]
        table = list(range(-(-len(prompt) // runner.block_size)))

        def runner_prefill() -> None:
            runner.prefill([PrefillItem(prompt, table)]).argmax(-1).tolist()

        print(f"\n=== prefill {a.prefill_len} tokens: ModelRunner.prefill")
        print(_kernels(runner_prefill, a.top))
        print(f"\n=== prefill {a.prefill_len} tokens: LLM.generate, 1 token")
        gen1 = llm_gen(llm, [prompt])
        print(_kernels(lambda: gen1(1), a.top))
        print(_host(lambda: gen1(1), a.top))
        for b in batches:
            prompts = _prompts(b, 128, runner.config.vocab_size, b)
            gen = llm_gen(llm, prompts)
            gen(a.new_tokens)
            _sync()
            t0 = time.perf_counter()
            gen(1)
            _sync()
            t1 = time.perf_counter()
            gen(a.new_tokens)
            _sync()
            tn = time.perf_counter()
            step_ms = ((tn - t1) - (t1 - t0)) / (a.new_tokens - 1) * 1e3
            runner_decode_steps(runner, prompts, 4)
            steps = runner_decode_steps(runner, prompts, 16)
            print(f"\n=== decode batch {b}: LLM.generate {step_ms:.3f} ms/step, runner step "
                  f"{1e3 * sorted(steps)[len(steps) // 2]:.3f} ms (median)")  # fmt: skip
            print(_kernels(lambda gen=gen: gen(8), a.top))
            print(_host(lambda gen=gen: gen(a.new_tokens), a.top))


if __name__ == "__main__":
    main()
