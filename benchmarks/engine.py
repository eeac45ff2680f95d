"""Engine benchmark: pdserve's model runtime against transformers and against what the hardware allows.

    python -m benchmarks.engine [--out FILE] [--model smollm2-135m-instruct] [--engine runner|llm]
    python -m benchmarks.engine --device cuda [--random-model smollm2] [--out FILE]

``--device cuda`` hands over to the GPU suite (``benchmarks.engine_cuda``). Rows: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import engine_cuda
from benchmarks.engine_steps import greedy_tokens, runner_decode_steps
from pdserve.bench.machine import machine_info as host_machine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("none", "int8")
# Natural-language prompts for the int8 quality row (a model's own greedy text, teacher-forced).
QUALITY_PROMPTS = (
    "What is the capital of France, and what is it known for?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Why do cats purr?",
)


@dataclass(frozen=True)
class BenchConfig:
    model: str
    engine: str
    threads: int
    dtypes: tuple[str, ...]
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    prefill_len: int
    prefill_reps: int
    skip_transformers: bool
    seed: int
    quantizations: tuple[str, ...] = ("none",)
    quality_tokens: int = 48


def _best(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids: special tokens in most vocabularies.
    return torch.randint(10, vocab - 1, (n, length), generator=g).tolist()


def _rate(batch: int, steps: Sequence[float]) -> tuple[float, float]:
    """(tok/s over the total, tok/s at the median step)."""
    return batch * len(steps) / sum(steps), batch / statistics.median(steps)


# ---- pdserve ----------------------------------------------------------------------------------------


def pdserve_prefill(runner: Any, prompt: list[int], reps: int) -> float:
    from pdserve.engine.model_runner import PrefillItem

    table = list(range(-(-len(prompt) // runner.block_size)))

    def run() -> None:
        runner.prefill([PrefillItem(prompt, table)]).argmax(-1).tolist()

    run()
    return len(prompt) / _best(run, reps)


def llm_decode_time(llm: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode seconds of ``engine.LLM``: t(generate N) - t(generate 1), greedy, eos ignored."""
    from pdserve.engine import SamplingParams

    def gen(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    gen(2)
    return gen(new_tokens) - gen(1)


# ---- transformers ------------------------------------------------------------------------------------


class _StepClock:
    """A logits processor that timestamps every generation step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """Run greedy ``generate``; returns the decode step times (prefill excluded)."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts)
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
        )
    return [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]


def hf_prefill(model: Any, prompt: list[int], reps: int) -> float:
    ids = torch.tensor([prompt])

    def run() -> None:
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0
            )

    run()
    return len(prompt) / _best(run, reps)


# ---- hardware bounds -----------------------------------------------------------------------------------


def linear_floor(config: Any, dtype: torch.dtype, batch: int, reps: int = 5) -> float:
    """tok/s of the model's linear layers alone as plain matmuls (random weights, real shapes)."""
    c = config
    g = torch.Generator().manual_seed(0)
    shapes = [
        (c.q_size + 2 * c.kv_size, c.hidden_size),
        (c.hidden_size, c.q_size),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    layers = [
        [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in shapes] for _ in range(c.num_layers)
    ]
    head = (torch.randn(c.vocab_size, c.hidden_size, generator=g) * 0.02).to(dtype)
    xs = {n: torch.randn(batch, n, generator=g).to(dtype) for n in {i for _, i in shapes}}

    def step() -> None:
        for ws in layers:
            for w in ws:
                F.linear(xs[w.shape[1]], w)
        F.linear(xs[c.hidden_size], head)

    with torch.inference_mode():
        step()
        return batch / _best(step, reps)


def matmul_params(config: Any) -> int:
    """Weights one token multiplies by in a decode step: every layer's products and the LM head."""
    c = config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def product_pass(weights: Any, config: Any, batch: int, reps: int = 5) -> float:
    """Seconds of one pass of pdserve's own matmuls (the runner's ``Linear`` objects, packed or not) over
    every layer and the LM head, in a step's order, so weights stream from memory as in a step: best of
    ``reps`` at ``batch`` rows."""
    c = config
    g = torch.Generator().manual_seed(0)
    dtype = weights.embed.dtype
    xs = {
        n: torch.randn(batch, n, generator=g).to(dtype)
        for n in {c.hidden_size, c.q_size, c.intermediate_size}
    }
    calls = [
        (lin, xs[n])
        for lw in weights.layers
        for lin, n in (
            (lw.qkv, c.hidden_size),
            (lw.o_proj, c.q_size),
            (lw.gate_up, c.hidden_size),
            (lw.down, c.intermediate_size),
        )
    ]
    calls.append((weights.lm_head, xs[c.hidden_size]))

    def step() -> None:
        for lin, x in calls:
            lin(x)

    with torch.inference_mode():
        step()
        return _best(step, reps)


def read_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Bytes/s reading a ``mib`` MiB tensor with ``threads`` threads: the faster of a float32 sum and a
    float64 sum of the same bytes (the float32 reduction can be compute-bound before memory is)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        wide = x.view(torch.float64)
        x.sum(), wide.sum()
        return x.numel() * 4 / min(_best(x.sum, reps), _best(wide.sum, reps))
    finally:
        torch.set_num_threads(before)


# ---- the run -------------------------------------------------------------------------------------------


def machine_info(cfg: BenchConfig, bw: dict[str, float]) -> dict[str, Any]:
    """``bench.machine.machine_info`` (CPU, ISA, kernel build, cores, torch) plus what this bench adds."""
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        **host_machine(),
        "threads": cfg.threads,
        "transformers": tf_version,
        "read_gbps": bw,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def quality(model_dir: Path, dtype: torch.dtype, runners: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """How close int8 stays to the unquantised model on ``QUALITY_PROMPTS`` (see benchmarks/README.md)."""
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.model_runner import PrefillItem
    from pdserve.engine.tokenizer import Tokenizer

    base, quant = runners["none"], runners["int8"]
    try:
        tok = Tokenizer.from_dir(model_dir)
        chats = [tok.render_chat([{"role": "user", "content": q}]) for q in QUALITY_PROMPTS]
        prompts, source = [tok.encode(text, False) for text in chats], "chat"
    except FileNotFoundError:  # a model without a tokenizer (the tests' tiny ones): random token ids
        prompts, source = _prompts(len(QUALITY_PROMPTS), 16, base.config.vocab_size, 0), "random-ids"
    # One prompt at a time: the runners' caches are sized for the decode rows, not for this.
    conts = [greedy_tokens(base, [p], new_tokens)[0] for p in prompts]
    agree = total = 0
    kl = 0.0
    for prompt, cont in zip(prompts, conts, strict=True):
        seq = prompt + cont
        logp = []
        for runner in (base, quant):
            bm = BlockManager(runner.num_blocks, runner.block_size)
            logits = runner.prefill([PrefillItem(seq, bm.allocate(0, len(seq)))], all_logits=True)
            logp.append(logits[len(prompt) - 1 : -1].float().log_softmax(-1))  # predicting cont's tokens
        agree += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
        kl += float((logp[0].exp() * (logp[0] - logp[1])).sum())
        total += len(cont)
    exact = sum(c == greedy_tokens(quant, [p], new_tokens)[0] for p, c in zip(prompts, conts, strict=True))
    return {
        "phase": "quality",
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": "int8",
        "prompts": len(prompts),
        "prompt_source": source,
        "tokens": total,
        "top1_agreement": round(agree / total, 4),
        "kl_from_unquantized": round(kl / total, 5),  # mean KL(unquantised || int8) per position, nats
        "exact_continuations": exact,
    }


def run(cfg: BenchConfig) -> dict[str, Any]:
    from pdserve.engine.cpu_kernels import kernel_cache_dir, load_cpu_kernels
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.registry import resolve_model

    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model)
    bw = {"1_thread": read_bandwidth(1) / 1e9, f"{cfg.threads}_threads": read_bandwidth(cfg.threads) / 1e9}
    kernels = load_cpu_kernels(kernel_cache_dir())
    peak = None if kernels is None else kernels.fma_peak(cfg.threads)
    bf16_peak = None if kernels is None else kernels.bf16_dot_peak(cfg.threads)
    read_bps = max(bw.values()) * 1e9  # the bound uses the best read rate measured
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    max_batch = max(cfg.batches)
    for dname in cfg.dtypes:
        dtype = DTYPES[dname]
        hf = None
        if not cfg.skip_transformers:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            hf.generation_config.eos_token_id = None  # always generate the full length
        rate: dict[tuple[str, int, str], float] = {}  # (phase, batch, quantization) -> pdserve tok/s
        runners: dict[str, Any] = {}
        for quant in cfg.quantizations:
            tokens = max(cfg.prefill_len, max_batch * (cfg.prompt_len + cfg.new_tokens))
            runner = ModelRunner(
                model_dir, dtype=dtype, num_blocks=tokens // 16 + 2 * max_batch + 1, quantization=quant
            )
            runners[quant] = runner
            c = runner.config
            key = dname if quant == "none" else f"{dname}/{quant}"
            info[key] = {
                "backend": "cpu_kernels" if runner.kernels is not None else "torch",
                "linear": str(runner.linear_kind),
                "quantization": quant,
                "decode_weight_bytes": runner.weights.decode_bytes(),
            }
            with_hf = hf if quant == "none" else None

            row = functools.partial(_add_row, rows, rate, dname, quant)

            llm = None
            if cfg.engine == "llm":
                from pdserve.engine import LLM

                llm = LLM(
                    str(model_dir),
                    dtype=dname,
                    threads=cfg.threads,
                    max_num_seqs=max_batch,
                    num_blocks=runner.num_blocks,
                    quantization=quant,
                )

            prefill_prompt = _prompts(1, cfg.prefill_len, c.vocab_size, cfg.seed)[0]
            p_tok = pdserve_prefill(runner, prefill_prompt, cfg.prefill_reps)
            h_tok = hf_prefill(with_hf, prefill_prompt, cfg.prefill_reps) if with_hf is not None else None
            row("prefill", 1, p_tok, h_tok, tokens=cfg.prefill_len)

            decode_rate: dict[int, float] = {}
            for batch in cfg.batches:
                prompts = _prompts(batch, cfg.prompt_len, c.vocab_size, cfg.seed + batch)
                extra: dict[str, Any] = {"prompt_tokens": cfg.prompt_len, "new_tokens": cfg.new_tokens}
                if llm is not None:
                    p_tok = batch * (cfg.new_tokens - 1) / llm_decode_time(llm, prompts, cfg.new_tokens)
                else:
                    runner_decode_steps(runner, prompts, 4)  # warm-up at this batch
                    p_tok, extra["pdserve_median_tok_s"] = _rate(
                        batch, runner_decode_steps(runner, prompts, cfg.new_tokens)
                    )
                h_tok = None
                if with_hf is not None:
                    hf_generate(with_hf, prompts, 4)  # warm-up at this batch
                    h_tok, extra["transformers_median_tok_s"] = _rate(
                        batch, hf_generate(with_hf, prompts, cfg.new_tokens)
                    )
                decode_rate[batch] = p_tok
                row("decode", batch, p_tok, h_tok, **extra)

            if quant == "none":  # stock F.linear at this dtype: not a quantised product
                for batch in cfg.batches:
                    row("floor", batch, decode_rate[batch], None, bound_tok_s=linear_floor(c, dtype, batch))
            wbytes = runner.weights.decode_bytes()
            flops_per_token = 2 * matmul_params(c)
            # bfloat16 products run as AVX512-BF16 dot products where the host has them: twice the float32
            # FMA rate, so the float32 peak would be no bound for them.
            dot = dtype == torch.bfloat16 and bf16_peak is not None
            compute, peak_kind = (bf16_peak, "bf16_dot") if dot else (peak, "f32_fma")
            for batch in cfg.batches:
                # The hardware bound of a decode step: every weight read once, every product at the peak.
                steps_s = read_bps / wbytes
                if compute is not None:
                    steps_s = min(steps_s, compute / (flops_per_token * batch))
                row(
                    "bound",
                    batch,
                    decode_rate[batch],
                    None,
                    bound_tok_s=batch * steps_s,
                    bound_peak=peak_kind,
                )
                t = product_pass(runner.weights, c, batch)
                row(
                    "linear",
                    batch,
                    batch / t,
                    None,
                    bound_tok_s=batch * steps_s,
                    bound_peak=peak_kind,
                    gflops=flops_per_token * batch / t / 1e9,
                    gbps=wbytes / t / 1e9,
                    linear=str(runner.linear_kind),
                )
            row(
                "membw",
                1,
                decode_rate.get(1),
                None,
                bound_tok_s=read_bps / wbytes,
                weight_bytes_per_step=wbytes,
            )
            del llm
            gc.collect()
        if {"none", "int8"} <= runners.keys():
            rows.append(quality(model_dir, dtype, runners, cfg.quality_tokens))
            _log(rows[-1])
        del runners, hf
        gc.collect()
    machine = machine_info(cfg, bw)
    machine["fma_peak_gflops"] = None if peak is None else round(peak / 1e9, 1)
    machine["bf16_dot_peak_gflops"] = None if bf16_peak is None else round(bf16_peak / 1e9, 1)
    machine["kernel_isa"] = None if kernels is None else kernels.isa  # PDSERVE_KERNEL_ISA: native unless set
    return {"machine": {**machine, "pdserve": info}, "config": cfg.__dict__, "rows": rows}


def _add_row(
    rows: list[dict[str, Any]],
    rate: dict[tuple[str, int, str], float],
    dtype: str,
    quant: str,
    phase: str,
    batch: int,
    pdserve: float | None,
    transformers: float | None,
    **extra: Any,
) -> None:
    """Append (and log) one row of ``dtype``/``quant``; int8 rows of a rated phase get ``vs_unquantized``."""
    if pdserve is not None and phase in ("prefill", "decode", "linear"):
        rate[(phase, batch, quant)] = pdserve
        if quant != "none" and (phase, batch, "none") in rate:
            extra["vs_unquantized"] = pdserve / rate[(phase, batch, "none")]  # _row rounds it
    rows.append(_row(phase, batch, dtype, pdserve, transformers, quantization=quant, **extra))
    _log(rows[-1])


def _row(
    phase: str,
    batch: int,
    dtype: str,
    pdserve: float | None,
    transformers: float | None,
    bound_tok_s: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    ref = bound_tok_s if bound_tok_s is not None else transformers
    row: dict[str, Any] = {
        "phase": phase,
        "batch": batch,
        "dtype": dtype,
        "pdserve_tok_s": None if pdserve is None else round(pdserve, 2),
        "transformers_tok_s": None if transformers is None else round(transformers, 2),
        "ratio": None if pdserve is None or not ref else round(pdserve / ref, 3),
    }
    if bound_tok_s is not None:
        row["bound_tok_s"] = round(bound_tok_s, 2)
    row.update({k: round(v, 2) if isinstance(v, float) else v for k, v in extra.items()})
    return row


def _log(row: dict[str, Any]) -> None:
    print(json.dumps(row), file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, Path | None]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    p.add_argument(
        "--device",
        choices=("cpu",),
        default="cpu",
        help="cpu: this suite; cuda or cuda:N run benchmarks.engine_cuda (see --device cuda --help)",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or HF directory")
    p.add_argument(
        "--engine",
        choices=("runner", "llm"),
        default="runner",
        help="pdserve decode through ModelRunner + a greedy loop, or engine.LLM.generate",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads for everything measured")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each decode sequence")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per sequence")
    p.add_argument("--prefill-len", type=int, default=1024, help="tokens of the prefill prompt")
    p.add_argument("--prefill-reps", type=int, default=3, help="prefill runs (best kept)")
    p.add_argument("--skip-transformers", action="store_true", help="pdserve and the bounds only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantizations",
        default="none",
        help="comma-separated, among none,int8: int8 repeats pdserve's rows with int8 weights and adds a "
        "quality row",
    )
    p.add_argument(
        "--quality-tokens", type=int, default=48, help="greedy tokens per prompt of the int8 quality row"
    )
    a = p.parse_args(argv)
    dtypes = tuple(a.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        p.error(f"--dtypes must be among {sorted(DTYPES)}")
    quantizations = tuple(dict.fromkeys(a.quantizations.split(",")))
    if not set(quantizations) <= set(QUANTIZATIONS):
        p.error(f"--quantizations must be among {', '.join(QUANTIZATIONS)}")
    if a.quality_tokens < 1:
        p.error("--quality-tokens must be >= 1")
    if a.new_tokens < 3 or a.prompt_len < 1 or a.threads < 1:
        p.error("--new-tokens must be >= 3, --prompt-len and --threads >= 1")
    cfg = BenchConfig(
        model=a.model,
        engine=a.engine,
        threads=a.threads,
        dtypes=dtypes,
        batches=tuple(int(b) for b in a.batches.split(",")),
        prompt_len=a.prompt_len,
        new_tokens=a.new_tokens,
        prefill_len=a.prefill_len,
        prefill_reps=a.prefill_reps,
        skip_transformers=a.skip_transformers,
        seed=a.seed,
        quantizations=quantizations,
        quality_tokens=a.quality_tokens,
    )
    return cfg, a.out


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    if pre.parse_known_args(args)[0].device != "cpu":
        engine_cuda.main(args)  # the GPU suite parses everything itself, --help included
        return
    cfg, out = parse_args(args)
    result = run(cfg)
    text = json.dumps(result, indent=2)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
