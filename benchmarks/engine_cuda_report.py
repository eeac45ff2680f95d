"""The GPU engine benchmark's verdict and text: the GPU targets checked on a result of
``benchmarks.engine_cuda``, and the result as a readable table."""

from __future__ import annotations

from typing import Any

# The GPU targets, on LLM.generate.
DECODE_TARGETS = {1: 1_000.0, 32: 20_000.0, 256: 60_000.0}
PREFILL_TARGET_MS = 3.0
VS_STATIC_TARGET = 1.5


def acceptance(rows: list[dict[str, Any]], issue_setting: bool) -> dict[str, Any]:
    """Pass/fail of each GPU target on the LLM.generate figures (None: not measured)."""
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, op: str, target: float) -> None:
        ok = None if value is None else (value >= target if op == ">=" else value <= target)
        checks.append({"check": name, "value": value, "target": f"{op} {target:g}", "pass": ok})

    for r in rows:
        if r["phase"] == "prefill":
            check(f"prefill {r['tokens']} tokens, LLM.generate ms", r.get("llm_ms"), "<=", PREFILL_TARGET_MS)
            continue
        b = r["batch"]
        if b in DECODE_TARGETS:
            check(f"decode batch {b}, LLM.generate tok/s", r.get("llm_tok_s"), ">=", DECODE_TARGETS[b])
        check(
            f"decode batch {b}, LLM.generate / static+compile", r.get("llm_vs_static"), ">=", VS_STATIC_TARGET
        )
    results = [c["pass"] for c in checks]
    return {
        "issue_setting": issue_setting,
        "all_pass": None if None in results else all(results),
        "checks": checks,
    }


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, int | float) else str(v)


def table(result: dict[str, Any]) -> str:
    """The result as readable text: device, prefill, decode rows, acceptance."""
    d = result["device"]
    pd = d["pdserve"]
    lines = [
        f"{d.get('gpu', d.get('cpu'))} ({d['device']}), torch {d['torch']}, CUDA {d['cuda']}, "
        f"Triton {d['triton']}, transformers {d['transformers']}",
        f"read {d['bandwidth']['read_gbps']} GB/s, copy {d['bandwidth']['copy_gbps']} GB/s; "
        f"LLM init {pd['llm_init_s']} s, graph capture {_fmt(pd['graph_capture_s'], 2)} s; "
        f"static baseline: {d['transformers_static']}",
        f"{result['config']['dtype']}; decode: {result['work']['decode_prompt_tokens']}-token prompts, "
        f"{result['work']['decode_new_tokens']} greedy tokens",
        "",
    ]
    for r in result["rows"]:
        if r["phase"] == "prefill":
            lines.append(
                f"prefill {r['tokens']} tokens: runner {_fmt(r['runner_ms'], 2)} ms, LLM.generate "
                f"{_fmt(r['llm_ms'], 2)} ms, transformers {_fmt(r.get('transformers_ms'), 2)} ms"
            )
    head = (
        "batch",
        "runner",
        "LLM.generate",
        "transformers",
        "static+compile",
        "bound",
        "LLM/static",
        "LLM/bound",
    )
    lines += ["", "decode tok/s", " | ".join(f"{h:>14}" for h in head)]
    for r in result["rows"]:
        if r["phase"] == "decode":
            vals = [
                _fmt(r["batch"]),
                _fmt(r["runner_tok_s"]),
                _fmt(r["llm_tok_s"]),
                _fmt(r.get("transformers_tok_s")),
                _fmt(r.get("transformers_static_tok_s")),
                _fmt(r["bound_tok_s"]),
                _fmt(r.get("llm_vs_static"), 2),
                _fmt(r.get("llm_vs_bound"), 3),
            ]
            lines.append(" | ".join(f"{v:>14}" for v in vals))
    for r in result["rows"]:
        for k, v in r.items():
            if k.endswith("_error"):
                lines.append(f"  batch {r['batch']}: {k[: -len('_error')]} failed: {v}")
    acc = result["acceptance"]
    lines += ["", f"acceptance (issue setting: {acc['issue_setting']}; all pass: {acc['all_pass']})"]
    for ck in acc["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[ck["pass"]]
        lines.append(f"  {verdict:4}  {ck['check']}: {_fmt(ck['value'], 2)} (target {ck['target']})")
    return "\n".join(lines)
