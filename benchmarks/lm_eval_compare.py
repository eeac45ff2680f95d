"""lm-evaluation-harness against pdserve: its ``local-completions`` model on pdserve's ``/v1/completions``
and its ``hf`` model (transformers, float32) on the same weights, over the small multiple-choice task in
``benchmarks/lm_eval/`` (a local file: no hub download). Reports each item's loglikelihoods from both, their
largest difference and both accuracies.

    pdserve up --prefill 1 --decode 1 --dtype float32 --http-port 8000 --state-dir .pdserve/lm-eval
    python -m benchmarks.lm_eval_compare --state-dir .pdserve/lm-eval [--limit N]

lm-eval scores a choice with ``echo=true, logprobs=1, max_tokens=1`` on the context and continuation's
token ids, as its API models do; it tokenizes with the served model's own tokenizer files (``tokenizer=``
its directory), so both models see the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

TASK_DIR = Path(__file__).resolve().parent / "lm_eval"
TASK_FILE = TASK_DIR / "pdserve_mc.yaml"
TASK = "pdserve_mc"
# The task's data, the model and its tokenizer are local files: nothing is fetched from the Hugging Face hub.
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def task_config() -> dict[str, Any]:
    """The committed task, its data file given by absolute path (the YAML's is relative to the repo)."""
    config = yaml.safe_load(TASK_FILE.read_text())
    config["dataset_kwargs"] = {"data_files": {"test": str(TASK_DIR / "pdserve_mc.jsonl")}}
    return config


def evaluate(model: str, model_args: dict[str, Any], limit: int | None) -> tuple[list[list[float]], float]:
    """lm-eval's per-item loglikelihoods (one per choice, items in the task's order) and accuracy."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    out = evaluator.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task_config()],
        task_manager=TaskManager(include_defaults=False),  # (indexing lm-eval's thousands of tasks: slow)
        limit=limit,
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return lls, float(out["results"][TASK]["acc,none"])


@dataclass(frozen=True)
class Comparison:
    items: int
    max_abs_diff: float  # the largest |pdserve - hf| over every choice's loglikelihood
    acc_pdserve: float
    acc_hf: float
    same_choices: bool  # each item's highest-scoring choice is the same
    seconds_pdserve: float
    seconds_hf: float
    loglikelihoods_pdserve: list[list[float]]
    loglikelihoods_hf: list[list[float]]


def compare(completions_url: str, model_name: str, model_dir: Path, limit: int | None = None) -> Comparison:
    """lm-eval's ``local-completions`` at ``completions_url`` (``.../v1/completions``, serving
    ``model_name``) against its ``hf`` model on ``model_dir``, float32, one request at a time."""
    t0 = time.perf_counter()
    ours, acc_ours = evaluate(
        "local-completions",
        {
            "base_url": completions_url,
            "model": model_name,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(model_dir),
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        limit,
    )
    t1 = time.perf_counter()
    ref, acc_ref = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, limit)
    t2 = time.perf_counter()
    diffs = [abs(a - b) for xs, ys in zip(ours, ref, strict=True) for a, b in zip(xs, ys, strict=True)]
    best = [max(range(len(x)), key=x.__getitem__) for x in ours]
    best_ref = [max(range(len(x)), key=x.__getitem__) for x in ref]
    return Comparison(
        items=len(ours),
        max_abs_diff=max(diffs),
        acc_pdserve=acc_ours,
        acc_hf=acc_ref,
        same_choices=best == best_ref,
        seconds_pdserve=t1 - t0,
        seconds_hf=t2 - t1,
        loglikelihoods_pdserve=ours,
        loglikelihoods_hf=ref,
    )


def format_report(c: Comparison) -> str:
    return (
        f"lm-eval {TASK}: {c.items} items; accuracy pdserve {c.acc_pdserve:.4f}, hf {c.acc_hf:.4f}; "
        f"largest loglikelihood difference {c.max_abs_diff:.2e}; same choices: {c.same_choices}; "
        f"{c.seconds_pdserve:.0f}s through pdserve, {c.seconds_hf:.0f}s with hf"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lm_eval_compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--state-dir", type=Path, default=Path(".pdserve"), help="the cluster's (`pdserve up`)")
    p.add_argument("--limit", type=int, default=None, help="the first N items (default: all)")
    p.add_argument("--save-result", type=Path, default=None)
    args = p.parse_args(argv)
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    from benchmarks.tool_compare import target_from_state

    try:
        target = target_from_state(args.state_dir)
    except RuntimeError as e:
        print(f"benchmarks.lm_eval_compare: {e}", file=sys.stderr)
        return 1
    c = compare(f"{target.http_url}/v1/completions", target.model, target.model_dir, args.limit)
    print(format_report(c), flush=True)
    if args.save_result is not None:
        from pdserve.bench.machine import machine_info

        args.save_result.write_text(
            json.dumps({**asdict(c), "model": target.model, "machine": machine_info()})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
