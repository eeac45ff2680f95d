"""``python -m pdserve.engine.chat``: stream a chat answer from the default model, token by token."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.engine.device import DEVICE_HELP, DTYPE_CHOICES

DEFAULT_QUESTION = "What is the capital of France? Answer in two sentences."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pdserve.engine.chat", description=__doc__)
    ap.add_argument("-q", "--question", default=DEFAULT_QUESTION, help="the user message")
    ap.add_argument("--system", default=None, help="an optional system message")
    ap.add_argument("--model", default=None, help="model name, .gguf path or HF directory (default: SmolLM2)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: what the device runs fast")
    ap.add_argument("--device", default="cpu", help=DEVICE_HELP)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pdserve.engine.llm import LLM
    from pdserve.engine.params import SamplingParams
    from pdserve.engine.registry import DEFAULT_MODEL

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        # One conversation needs little KV memory; the runner's default sizes for 8 full contexts.
        llm = LLM(
            args.model or DEFAULT_MODEL,
            dtype=args.dtype,
            device=args.device,
            threads=args.threads,
            kv_cache_bytes=256 << 20,
        )
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.question}
        ]
        prompt = llm.encode_chat(messages)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"> {args.question}\n", flush=True)
    reason = None
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.new_text)
        sys.stdout.flush()
        reason = delta.finish_reason
    print(f"\n\n[finish_reason={reason}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
