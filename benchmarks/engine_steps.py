"""The decode-step loop both engine benchmarks time (``benchmarks.engine`` on CPU, ``engine_cuda`` on GPU).

Each step ends in a host copy of the argmax (``ModelRunner.argmax``, as the engine's greedy sampling), which
synchronizes the device, so wall-clock time around ``runner.decode`` is the step's time on CUDA as well.
"""

from __future__ import annotations

import time
from typing import Any


def runner_decode_steps(runner: Any, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """Prefill ``prompts`` together, then time each greedy decode step (decode + argmax)."""
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.model_runner import DecodeItem, PrefillItem

    bm = BlockManager(runner.num_blocks, runner.block_size)
    items = [PrefillItem(p, bm.allocate(i, len(p) + new_tokens)) for i, p in enumerate(prompts)]
    next_ids = runner.argmax(runner.prefill(items)).tolist()
    steps = []
    for s in range(new_tokens - 1):
        pos = len(prompts[0]) + s
        dec = [DecodeItem(t, pos, it.block_table) for t, it in zip(next_ids, items, strict=True)]
        t0 = time.perf_counter()
        next_ids = runner.argmax(runner.decode(dec)).tolist()
        steps.append(time.perf_counter() - t0)
    return steps


def greedy_tokens(runner: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``new_tokens`` greedy tokens for each prompt (any lengths), decoded together; no early stop."""
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.model_runner import DecodeItem, PrefillItem

    bm = BlockManager(runner.num_blocks, runner.block_size)
    items = [PrefillItem(p, bm.allocate(i, len(p) + new_tokens)) for i, p in enumerate(prompts)]
    out = [[t] for t in runner.argmax(runner.prefill(items)).tolist()]
    for s in range(new_tokens - 1):
        dec = [
            DecodeItem(o[-1], len(p) + s, it.block_table)
            for o, p, it in zip(out, prompts, items, strict=True)
        ]
        for o, t in zip(out, runner.argmax(runner.decode(dec)).tolist(), strict=True):
            o.append(t)
    return out
