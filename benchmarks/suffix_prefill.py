"""Suffix prefill over a cached prefix: the engine step behind a prefix-cache hit's TTFT.

    python -m benchmarks.suffix_prefill [--prefix-len 768] [--suffix-len 32] [--reps 10] [--threads 2]

Builds a ``ModelRunner`` (float32 by default, the C kernels where they build), prefills a prefix once so
its K/V sit in the cache, then times a prefill of a different suffix over that prefix (``PrefillItem`` with
``start_pos``) plus the argmax of its last token, as the engine's greedy first token. Prints the median and
where the time goes: each part of the step timed on its own by wrapping the runner's calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pdserve.bench.machine import machine_info

# Breakdown labels timed inside another part (not added to the sum).
NESTED = "  of which "


def _suffix_step(runner: Any, prefix: list[int], suffix: list[int], table: list[int]) -> int:
    from pdserve.engine.model_runner import PrefillItem

    out = runner.prefill([PrefillItem(suffix, table, start_pos=len(prefix))])
    return int(runner.argmax(out)[0])


def time_steps(runner: Any, prefix: list[int], suffixes: list[list[int]], table: list[int]) -> list[float]:
    """Seconds of each suffix prefill (a different suffix each time, all over the same cached prefix)."""
    times = []
    for suffix in suffixes:
        t0 = time.perf_counter()
        _suffix_step(runner, prefix, suffix, table)
        times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def _timed(owner: Any, name: str, label: str, acc: dict[str, float]) -> Iterator[None]:
    """Wrap ``owner.name`` so each call's seconds add to ``acc[label]``."""
    orig = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def breakdown(
    runner: Any, prefix: list[int], suffixes: list[list[int]], table: list[int]
) -> dict[str, float]:
    """Milliseconds per step in each part: the products by weight, attention, norms, RoPE + store, the
    argmax, and the rest (Python, index building, embedding)."""
    import pdserve.engine.attention as attn_mod
    import pdserve.engine.model as model_mod
    import pdserve.engine.model_runner as runner_mod
    from pdserve.engine.weights import Linear

    acc: dict[str, float] = defaultdict(float)
    names: dict[int, str] = {}
    lw0 = runner.weights.layers
    for lw in lw0:
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            names[id(getattr(lw, attr))] = f"linear {attr}"
    names[id(runner.weights.lm_head)] = "linear lm_head"
    orig_call = Linear.__call__

    def linear_call(self: Linear, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return orig_call(self, x)
        finally:
            acc[names.get(id(self), "linear other")] += time.perf_counter() - t0

    ops_cls = type(runner._ops(torch.zeros(1, dtype=torch.int64), *(torch.zeros(1, dtype=torch.int64),) * 2))
    wraps: list[tuple[Any, str, str]] = [
        (runner_mod, "prefill_attention", "attention"),
        (attn_mod, "_gather", NESTED + "attention: gather cached K/V"),
        (attn_mod.F, "scaled_dot_product_attention", NESTED + "attention: sdpa"),
        (ops_cls, "add_rms_norm", "rms_norm"),
        (ops_cls, "rope_store", "rope + kv store"),
        (runner, "argmax", "argmax"),
        (model_mod.F, "embedding", "embedding"),
    ]
    Linear.__call__ = linear_call  # type: ignore[method-assign]
    try:
        with contextlib.ExitStack() as stack:
            for owner, name, label in wraps:
                stack.enter_context(_timed(owner, name, label, acc))
            total = sum(time_steps(runner, prefix, suffixes, table))
    finally:
        Linear.__call__ = orig_call  # type: ignore[method-assign]
    n = len(suffixes)
    # add_rms_norm's time inside norm_linear is separate from the product's (the product wraps only lin(x)).
    out = {k: 1e3 * v / n for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    out["other (python, indices, ...)"] = 1e3 * total / n - sum(
        v for k, v in out.items() if not k.startswith(NESTED)
    )
    out["total (instrumented)"] = 1e3 * total / n
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The timed suffix prefills and their breakdown, on ``args.threads`` torch threads (restored after)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.model_runner import ModelRunner, PrefillItem
    from pdserve.engine.registry import resolve_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    total = args.prefix_len + args.suffix_len
    runner = ModelRunner(resolve_model(args.model), dtype=dtype, num_blocks=total // 16 + 4)
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    prefix = tokens(args.prefix_len)
    table = BlockManager(runner.num_blocks, runner.block_size).allocate(0, total)
    runner.prefill([PrefillItem(prefix, table)])  # the prefix's K/V now sit in the cache
    suffixes = [tokens(args.suffix_len) for _ in range(args.reps)]
    time_steps(runner, prefix, suffixes[:3], table)  # warm-up
    rounds = [time_steps(runner, prefix, suffixes, table) for _ in range(args.rounds)]
    steps = [t for r in rounds for t in r]
    return {
        "machine": machine_info(),
        "threads": args.threads,
        "dtype": args.dtype,
        "backend": str(runner.backend),
        "linear": str(runner.linear_kind),
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "median_ms": round(1e3 * statistics.median(steps), 2),
        "min_ms": round(1e3 * min(steps), 2),
        "round_medians_ms": [round(1e3 * statistics.median(r), 2) for r in rounds],
        "breakdown_ms": {k: round(v, 2) for k, v in breakdown(runner, prefix, suffixes, table).items()},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suffix_prefill", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=10, help="suffix prefills per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def _print(result: dict[str, Any], emit: Callable[[str], None] = print) -> None:
    m = result["machine"]
    emit(
        f"machine: {m['cpu']} isa={m['isa']} flags={','.join(m['flags'])} cores={m['cores']} "
        f"torch={m['torch']}"
    )
    emit(
        f"{result['dtype']}, {result['threads']} threads, backend={result['backend']} "
        f"linear={result['linear']}: "
        f"{result['suffix_len']}-token suffix over a cached {result['prefix_len']}-token prefix"
    )
    emit(f"median {result['median_ms']} ms (min {result['min_ms']}; rounds {result['round_medians_ms']})")
    emit("breakdown (ms per step, instrumented run):")
    for k, v in result["breakdown_ms"].items():
        emit(f"  {k:32s} {v:8.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)


if __name__ == "__main__":
    main()
