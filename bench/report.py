"""Presenting a run: the summary table (laid out as ``vllm bench serve`` prints it) and strict JSON.

Pure: works on the result document (a plain dict), so a saved result can be
printed again later.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import PERCENTILES, percentile_key

WIDTH = 50
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def json_safe(value: Any) -> Any:
    """Infinite or NaN floats become strings ("inf"), which strict JSON can carry."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` as JSON; gzipped (reproducibly: no name, no time in the header) for a ``.gz`` path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a stray inf/NaN fails here instead of writing a file other tools reject.
    data = (json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n").encode("utf-8")
    if path.suffix == ".gz":
        with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(data)
    else:
        path.write_bytes(data)


def emit_json(doc: Mapping[str, Any], out: str | Path | None) -> None:
    """A benchmark's result: printed to stdout, and written to ``out`` as well when given (``write_json``)."""
    print(json.dumps(json_safe(doc), indent=2, allow_nan=False), flush=True)
    if out:
        write_json(Path(out), doc)


def read_json(path: Path) -> Any:
    """Read what ``write_json`` wrote (gzipped or not)."""
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)


def _fmt(value: Any, decimals: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    return str(value)


def _row(label: str, value: Any) -> str:
    return f"{label:<40} {_fmt(value):<10}".rstrip()


def format_summary(doc: Mapping[str, Any]) -> str:
    cfg = doc.get("config", {})
    lines = ["{:=^{n}}".format(" Serving Benchmark Result ", n=WIDTH)]
    lines.append(_row("Successful requests:", doc["completed"]))
    lines.append(_row("Failed requests:", doc["failed"]))
    if cfg.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", cfg["max_concurrency"]))
    rate = cfg.get("request_rate")
    if rate is not None and math.isfinite(float(rate)):  # a loaded file holds "inf" as a string
        lines.append(_row("Request rate configured (RPS):", float(rate)))
    if cfg.get("cpu_count") is not None:
        lines.append(_row("Machine cores (os.cpu_count):", cfg["cpu_count"]))
    lines.append(_row("Benchmark duration (s):", doc["duration"]))
    lines.append(_row("Total input tokens:", doc["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", doc["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", doc["request_throughput"]))
    if doc.get("request_goodput") is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in doc.get("goodput_slo", {}).items())
        lines.append(_row("Goodput SLOs:", slo))
        lines.append(_row("Request goodput (req/s):", doc["request_goodput"]))
        attainment = doc.get("slo_attainment")
        lines.append(_row("SLO attainment (%):", None if attainment is None else attainment * 100.0))
    lines.append(_row("Output token throughput (tok/s):", doc["output_throughput"]))
    lines.append(_row("Total token throughput (tok/s):", doc["total_token_throughput"]))
    for key, short, header in _SECTIONS:
        lines.append("{:-^{n}}".format(header, n=WIDTH))
        lines.append(_row(f"Mean {short} (ms):", doc.get(f"mean_{key}_ms")))
        lines.append(_row(f"Median {short} (ms):", doc.get(f"median_{key}_ms")))
        for p in PERCENTILES:
            pk = percentile_key(p)
            lines.append(_row(f"{pk.upper()} {short} (ms):", doc.get(f"{pk}_{key}_ms")))
    lines.append("=" * WIDTH)
    if doc["failed"]:
        errors = [r["error"] for r in doc.get("requests", []) if r.get("error")]
        lines.append(f"First errors ({min(len(errors), 5)} of {len(errors)}):")
        lines.extend(f"  {e}" for e in errors[:5])
    return "\n".join(lines)
