"""Structured output on the real model: how often the output is a valid object with the grammar and
without it, and what constrained or penalised rows cost the plain ones in a shared decode batch.

    python -m benchmarks.structured_output [--part validity|cost|all] [--out /tmp/structured.json]

Validity: the 20 committed prompts of ``tests/structured_models.py`` (the test suite's), each with a system
message that gives the JSON schema of ``Contact``, temperature 1.0, 256 tokens, seed = the prompt's index;
an output is valid when pydantic validates it whole (``strict``) or validates the text from its first "{"
to its last "}" (``lenient``: what a client that strips code fences and chatter would get), and it did not
stop at ``max_tokens``. Cost: the decode step of the same batch (greedy) with only plain rows and with a
quarter of its rows under a regex grammar, or under presence, frequency and repetition penalties and a
logit bias, alternated (``mixed_batch_cost``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from openai.lib._pydantic import to_strict_json_schema
from pydantic import ValidationError

from pdserve.bench.machine import machine_info
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured import StructuredOutputsParams
from tests.structured_models import CONTACT_PROMPTS, Contact


def _valid(text: str, finish: str) -> tuple[bool, bool]:
    if finish != "stop":
        return False, False
    try:
        Contact.model_validate_json(text)
        return True, True
    except ValidationError:
        pass
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return False, False
    try:
        Contact.model_validate_json(text[start : end + 1])
        return False, True
    except ValidationError:
        return False, False


def validity(llm: LLM, grammar: bool) -> dict:
    schema = to_strict_json_schema(Contact)
    system = f"Answer with only a JSON object that matches this JSON schema:\n{json.dumps(schema)}"
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": p}] for p in CONTACT_PROMPTS]
    so = StructuredOutputsParams(json=schema) if grammar else None
    params = [
        SamplingParams(temperature=1.0, max_tokens=256, seed=i, structured_outputs=so)
        for i in range(len(chats))
    ]
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    checks = [_valid(o.text, o.finish_reason) for o in outs]
    return {
        "grammar": grammar,
        "prompts": len(outs),
        "valid_strict": sum(s for s, _ in checks),
        "valid_lenient": sum(lenient for _, lenient in checks),
        "finished_by_length": sum(o.finish_reason == "length" for o in outs),
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "seconds": round(seconds, 2),
        "examples": [o.text[:200] for o in outs[:3]],
    }


# The rows mixed into a plain batch: a grammar the tokens cannot complete (so every row runs to max_tokens
# and the batch keeps its size), or every penalty and a bias at once.
COST_ROWS = {
    "grammar": dict(structured_outputs=StructuredOutputsParams(regex="[a-zA-Z ,.]{2000}")),
    "penalties": dict(
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias=((13, -5.0), (28, 2.0), (30, -100.0)),
        ignore_eos=True,
    ),
}


def mixed_batch_cost(
    llm: LLM, kind: str, batch: int = 16, special: int = 4, tokens: int = 24, reps: int = 5
) -> dict:
    """Decode step times of a batch of ``batch`` greedy rows, all plain and with ``special`` of them
    carrying ``COST_ROWS[kind]``. The two batches alternate, ``reps`` times each, so that a busy host slows
    both alike; the figure is the median decode step of each and their ratio."""
    engine, tok = llm.engine, llm.tokenizer
    assert tok is not None
    plain = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rows = SamplingParams(temperature=0, max_tokens=tokens, **COST_ROWS[kind])
    prompts = [tok.encode(f"Tell me about the number {i}.") for i in range(batch)]
    runs = 0

    def decode_steps(k: int) -> list[float]:
        nonlocal runs
        runs += 1
        for i, p in enumerate(prompts):
            engine.add_request(f"cost-{runs}-{i}", p, rows if i < k else plain)
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return steps[1:]  # the first step prefills every prompt

    decode_steps(special)  # warm: a grammar compiled, the vocabulary read
    arms: dict[int, list[float]] = {0: [], special: []}
    for _ in range(reps):
        for k in arms:
            arms[k] += decode_steps(k)
    median = {k: statistics.median(v) for k, v in arms.items()}
    return {
        "rows": kind,
        "batch": batch,
        "special_rows": special,
        "decode_steps_per_arm": len(arms[0]),
        "median_step_ms_plain_batch": round(median[0] * 1e3, 2),
        "median_step_ms_mixed_batch": round(median[special] * 1e3, 2),
        "step_time_ratio": round(median[special] / median[0], 3),
        "batch_tok_s_plain": round(batch / median[0], 1),
        "batch_tok_s_mixed": round(batch / median[special], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--part", choices=("validity", "cost", "all"), default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, num_blocks=1024, block_size=16)
    report: dict = {"machine": machine_info(), "model": args.model, "dtype": args.dtype}
    if args.out and args.out.exists():  # the other part's figures stay
        report = {**json.loads(args.out.read_text()), **report}
    if args.part in ("validity", "all"):
        report["without_grammar"] = validity(llm, grammar=False)
        report["with_grammar"] = validity(llm, grammar=True)
    if args.part in ("cost", "all"):
        report["mixed_batch"] = {kind: mixed_batch_cost(llm, kind) for kind in COST_ROWS}
    print(json.dumps(report, indent=2, ensure_ascii=False))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
