"""Speculative decoding's decode speed, side by side with plain decoding in one run:

    python -m benchmarks.speculative_decoding [--k 4] [--max-tokens 128] [--rounds 2] [--out FILE]

The default model (SmolLM2-135M-Instruct) in four engines of one process: plain, speculating with the
n-gram proposer and its adaptive rule (``--speculative ngram``, k = ``--k``: what a worker runs), the
same without the adaptive rule (``ngram_fixed``: always k where a match is found), and the self-speculative
draft (``--speculative draft``: the model's first ``--draft-layers`` layers and LM head, adaptive), each
with ``--threads`` torch threads; they run in turn (then in reverse order in the next round) on the same
work:

- extraction: 8 questions about a committed ~1,100-token report (benchmarks/data/extraction_document.txt)
  whose answers are in its sentences, asked to answer from the document;
- chat: 8 open-ended prompts with nothing to copy from (what the adaptive rule protects).

Each workload runs at batch 1 (one request at a time), batch 8 (all at once, the batch draining as
requests end) and batch 8 sustained (``--passes`` times the workload's requests given at once to an engine
of 8 slots: a request that ends makes room for the next, as under serving load, so most steps decode 8
streams), greedy, up to ``--max-tokens`` tokens or eos. Reported per engine: decode tokens per second
(tokens made by steps that decode, over those steps' time: prompt prefill is the same work either way and
is left out), the speculating engines' acceptance rate and mean tokens per verify, and whether they made
the plain engine's tokens. A speed-up is the ratio to the plain engine in the same round; the result is
the median over rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json

DOCUMENT = Path(__file__).parent / "data" / "extraction_document.txt"
QUESTIONS = (
    "How many residents does the Authority supply with drinking water?",
    "Why was well number seven taken out of service, and when did it return?",
    "What did the upgrade of the Alder Creek filter galleries include?",
    "How many main breaks were there, and how quickly was supply restored?",
    "What were the results of the coliform testing in the distribution network?",
    "What did the hardship programme introduced in January do?",
    "How was the capital expenditure funded?",
    "What does the drought contingency plan approved by the board say?",
)
CHAT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying focused while working from home?",
    "Describe your ideal weekend in the mountains.",
    "Explain why the sky looks blue, in simple words.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Write a poem about autumn leaves.",
    "What should I pack for a week-long trip to a rainy city?",
    "Tell me about the benefits of learning a second language.",
)


def _log(msg: str) -> None:
    print(f"[speculative_decoding] {msg}", file=sys.stderr, flush=True)


def prompts(tokenizer: Any) -> dict[str, list[list[int]]]:
    doc = DOCUMENT.read_text()
    extraction = [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"{doc}\n\nAnswer the question from the report above, in its words.\n"
                    f"Question: {q}",
                }
            ],
            add_generation_prompt=True,
        )
        for q in QUESTIONS
    ]
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in CHAT
    ]
    return {"extraction": extraction, "chat": chat}


def run(engine: Any, batch: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    """Every prompt of ``batch`` at once through ``engine``; decode tokens and seconds, and the outputs."""
    from pdserve.engine.scheduler import BatchKind

    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, params)
    outputs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(batch))}
    decode_s, decode_tokens = 0.0, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        made = sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:
            outputs[d.request_id] += d.new_token_ids
        if engine.last_batch is not None and engine.last_batch.kind is BatchKind.DECODE:
            decode_s += dt
            decode_tokens += made
    return {"decode_s": decode_s, "decode_tokens": decode_tokens, "outputs": list(outputs.values())}


def workload(engine: Any, ps: list[list[int]], batch: int, params: Any, tag: str) -> dict[str, Any]:
    spec = engine.speculator
    before = None if spec is None else dataclasses.replace(spec.stats)  # a snapshot of the totals
    total = {"decode_s": 0.0, "decode_tokens": 0, "outputs": []}
    for start in range(0, len(ps), batch):
        r = run(engine, ps[start : start + batch], params, f"{tag}-{start}")
        total["decode_s"] += r["decode_s"]
        total["decode_tokens"] += r["decode_tokens"]
        total["outputs"] += r["outputs"]
    out = {
        "decode_tokens": total["decode_tokens"],
        "decode_seconds": round(total["decode_s"], 3),
        "decode_tokens_per_s": round(total["decode_tokens"] / total["decode_s"], 2),
        "outputs": total["outputs"],
    }
    if spec is not None and before is not None:
        s = spec.stats
        proposed, accepted = (
            s.proposed_tokens - before.proposed_tokens,
            s.accepted_tokens - before.accepted_tokens,
        )
        emitted, drafts = (
            s.emitted_tokens - before.emitted_tokens,
            s.streams_verified - before.streams_verified,
        )
        out |= {
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_tokens_per_verify": round(emitted / drafts, 3) if drafts else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=0, help="the draft's layers (default: a quarter)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3, help="the sustained case's passes over a workload")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engines (default 2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pdserve.engine import LLM, SamplingParams

    opts = {"dtype": args.dtype, "threads": args.threads, "max_num_seqs": 8}
    plain = LLM(**opts).engine
    engines = {
        "plain": plain,
        "ngram": LLM(**opts, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}).engine,
        "ngram_fixed": LLM(
            **opts,
            speculative_config={"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False},
        ).engine,
        "draft": LLM(
            **opts,
            speculative_config={
                "method": "draft",
                "num_speculative_tokens": args.k,
                "draft_layers": args.draft_layers,
            },
        ).engine,
    }
    speculating = ("ngram", "ngram_fixed", "draft")
    assert plain.tokenizer is not None
    ps = prompts(plain.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # (name, requests, batch): batch requests at once; the engines hold at most 8 streams.
    cases = [
        (f"{w}_{name}", ps[w] * passes, len(ps[w]) * passes if name != "batch1" else 1)
        for w in ("extraction", "chat")
        for name, passes in (("batch1", 1), ("batch8", 1), ("batch8_sustained", args.passes))
    ]
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = list(engines.items())
        if rnd % 2:
            order.reverse()
        row: dict[str, Any] = {}
        for case, requests, b in cases:
            got = {name: workload(eng, requests, b, params, f"r{rnd}-{case}-{name}") for name, eng in order}
            base = got["plain"]
            for name in speculating:
                g = got[name]
                same = sum(x == y for x, y in zip(base["outputs"], g["outputs"], strict=True))
                g["speedup"] = round(g["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
                g["identical_outputs"] = f"{same}/{len(requests)}"
            for g in got.values():
                del g["outputs"]
            row[case] = got
            _log(f"round {rnd} {case}: {row[case]}")
        rounds.append(row)

    def median(case: str, name: str, field: str) -> float:
        return statistics.median(r[case][name][field] for r in rounds)

    summary = {
        case: {
            "plain_decode_tokens_per_s": median(case, "plain", "decode_tokens_per_s"),
            **{
                name: {
                    "speedup_median": round(median(case, name, "speedup"), 3),
                    "speedups": [r[case][name]["speedup"] for r in rounds],
                    "decode_tokens_per_s": median(case, name, "decode_tokens_per_s"),
                    "acceptance_rate": rounds[-1][case][name]["acceptance_rate"],
                    "mean_tokens_per_verify": rounds[-1][case][name]["mean_tokens_per_verify"],
                    "identical_outputs": [r[case][name]["identical_outputs"] for r in rounds],
                }
                for name in speculating
            },
        }
        for case in rounds[0]
    }
    doc = {
        "benchmark": "speculative_decoding",
        "command": "python -m benchmarks.speculative_decoding " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "model": "smollm2-135m-instruct",
        "dtype": plain.dtype,
        "threads": args.threads,
        "num_speculative_tokens": args.k,
        "max_tokens": args.max_tokens,
        "summary": summary,
        "rounds": rounds,
        "draft_layers": engines["draft"].speculator.proposer.model.num_layers,
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
