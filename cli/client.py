"""Client side of the CLI: ``status`` (JSON and table) and ``generate`` (streaming)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, TextIO

from google.protobuf import json_format

from pdserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2
from pdserve.worker.dial import router_channel
from pdserve.worker.tls import NO_TLS, TLSConfig

ROLE_NAMES = {
    worker_pb2.ROLE_PREFILL: "prefill",
    worker_pb2.ROLE_DECODE: "decode",
    worker_pb2.ROLE_BOTH: "both",
}
STATE_NAMES = {
    worker_pb2.WORKER_STATE_LOADING: "loading",
    worker_pb2.WORKER_STATE_READY: "ready",
    worker_pb2.WORKER_STATE_DRAINING: "draining",
    worker_pb2.WORKER_STATE_STOPPED: "stopped",
    worker_pb2.WORKER_STATE_STANDBY: "standby",
}


def status_dict(status: worker_pb2.ClusterStatus, now_unix: float | None = None) -> dict[str, Any]:
    """The ``pdserve status --json`` document (output only: it never crosses back into a process)."""
    now_unix = time.time() if now_unix is None else now_unix
    workers = []
    for e in status.workers:
        info, load = e.info, e.load
        workers.append(
            {
                "id": info.worker_id,
                "role": ROLE_NAMES.get(info.role, "unknown"),
                "address": info.address,
                "state": STATE_NAMES.get(load.state, "unknown"),
                "running": load.running,
                "queued": load.queued,
                "kv_blocks_used": load.kv_blocks_used,  # referenced by requests: 0 when idle
                "kv_blocks_cached": load.kv_blocks_cached,  # the prefix cache's alone (evictable)
                "kv_blocks_total": load.kv_blocks_total,
                "metrics_url": info.metrics_url,
                "queued_prefill_tokens": load.queued_prefill_tokens,
                "prefill_tokens_per_s": round(load.prefill_tokens_per_s, 1),  # measured; 0: not yet
                "model": info.model,
                "device": info.device or "cpu",  # a worker that leaves the field empty runs on the CPU
                # processes of its tensor-parallel group (rank 0 registers; the others follow it)
                "tensor_parallel_size": max(info.tensor_parallel_size, 1),
                "rank_pids": list(info.rank_pids) or [info.pid],
                "dtype": info.dtype,
                "quantization": info.quantization or "none",
                "kv_layout": info.kv_layout,
                "tokenizer_digest": info.tokenizer_digest,
                "pid": info.pid,
                "heartbeat_age_s": round(max(now_unix - e.last_heartbeat_unix, 0.0), 3),
            }
        )
    by_role: dict[str, int] = {}
    for w in workers:
        by_role[w["role"]] = by_role.get(w["role"], 0) + 1
    totals = {
        "workers": len(workers),
        "by_role": by_role,
        **_sums(workers),
        # Each pool on its own: a prefill worker's KV blocks hold prompts in flight, a decode worker's
        # the running requests, and the sum of the two means neither.
        "pools": {role: _sums([w for w in workers if w["role"] == role]) for role in by_role},
    }
    router = {
        "address": status.router_address,
        "requests_running": status.requests_running,
        "requests_waiting": status.requests_waiting,
        "streams_moving": status.streams_moving,  # live moves under way (docs/live_migration.md)
        "metrics_url": status.metrics_url,
        "http_url": status.http_url,  # the OpenAI-compatible API's base URL; empty: off
    }
    return {"router": router, "workers": workers, "totals": totals}


_SUMMED = ("running", "queued", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_total")


def _sums(workers: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "ready": sum(w["state"] == "ready" for w in workers),
        **{k: sum(w.get(k, 0) for w in workers) for k in _SUMMED},
    }


def _dtype_cell(w: dict[str, Any]) -> str:
    """``float32``, or ``float32/int8`` for a worker with quantised weights."""
    quant = w.get("quantization", "none")
    return (w["dtype"] or "-") + ("" if quant == "none" else f"/{quant}")


def _device_cell(w: dict[str, Any]) -> str:
    """``cpu``, or ``cpu x2`` for a worker whose model is split over a tensor-parallel group of 2."""
    tp = w.get("tensor_parallel_size", 1)
    return w["device"] + ("" if tp == 1 else f" x{tp}")


def status_table(doc: dict[str, Any]) -> str:
    r, t = doc["router"], doc["totals"]
    lines = [f"router {r['address']}: {r['requests_running']} running, {r['requests_waiting']} waiting"]
    if r.get("streams_moving"):
        lines[0] += f", {r['streams_moving']} moving"
    if r.get("metrics_url"):
        lines[0] += f"; metrics {r['metrics_url']}"
    if r.get("http_url"):
        lines[0] += f"; OpenAI API {r['http_url']}/v1"
    routers = doc.get("routers") or []
    if len(routers) > 1:  # (`up --routers N`: each keeps its own registry of the same workers)
        for x in routers:
            if not x["alive"]:
                seen = "exited"
            elif x["workers"] is None:
                seen = f"not answering ({x.get('error', '?')})"
            else:
                seen = f"sees {x['workers']} workers, {x['requests_running']} running"
            lines.append(f"  router {x['address']} (pid {x['pid']}): {seen}")
    head = (
        "ID",
        "ROLE",
        "STATE",
        "DEVICE",
        "DTYPE",
        "ADDRESS",
        "RUNNING",
        "QUEUED",
        "KV USED/TOTAL",
        "METRICS",
    )
    rows = [head] + [
        (
            w["id"],
            w["role"],
            w["state"],
            _device_cell(w),
            _dtype_cell(w),
            w["address"],
            str(w["running"]),
            str(w["queued"]),
            f"{w['kv_blocks_used']}/{w['kv_blocks_total']}",
            w["metrics_url"] or "-",
        )
        for w in doc["workers"]
    ]
    # Processes of the cluster the router does not list (``pdserve status`` with a state dir).
    unregistered = doc.get("unregistered", [])
    rows += [
        (w["id"], w["role"], "not registered", w["device"], "-", f"pid {w['pid']}", "-", "-", "-", "-")
        for w in unregistered
    ]
    exited = doc.get("exited", [])
    rows += [
        (w["id"], w["role"], "exited", w["device"], "-", f"pid {w['pid']}", "-", "-", "-", w["log"] or "-")
        for w in exited
    ]
    # A TOTAL row per pool (see ``status_doc``): the KV of prefill and decode workers is not one sum; a
    # pool whose workers all run unregistered still gets one ("0/1 ready").
    pools = dict(t.get("pools", {}))
    counts = dict(t.get("by_role", {}))
    for w in [*unregistered, *exited]:
        pools.setdefault(w["role"], {"ready": 0, **dict.fromkeys(_SUMMED, 0)})
        counts[w["role"]] = counts.get(w["role"], 0) + 1
    for role, p in sorted(pools.items()):
        rows.append(
            (
                "TOTAL",
                role,
                f"{p['ready']}/{counts[role]} ready",
                "",
                "",
                "",
                str(p["running"]),
                str(p["queued"]),
                f"{p['kv_blocks_used']}/{p['kv_blocks_total']}",
                "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def build_request(
    prompt: str,
    *,
    chat: bool,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: list[str],
) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(stop=stop)
    # Only what the user set: unset fields keep the engine defaults.
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    if chat:
        messages = generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content=prompt)]
        )
        return generation_pb2.GenerateRequest(messages=messages, sampling=sampling)
    return generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling)


def stream(
    address: str, request: generation_pb2.GenerateRequest, timeout_s: float | None, tls: TLSConfig = NO_TLS
) -> Iterator[generation_pb2.GenerateResponse]:
    """``address``: one router or several (comma-separated): requests go round robin over them."""
    with router_channel(address, tls) as ch:
        yield from generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout_s)


def print_stream(
    responses: Iterator[generation_pb2.GenerateResponse], out: TextIO, err: TextIO, as_json: bool
) -> None:
    """Text (or JSON lines) to ``out`` as it arrives; the finish summary to ``err``."""
    last = None
    for m in responses:
        last = m
        if as_json:
            doc = json_format.MessageToDict(m, preserving_proto_field_name=True)
            out.write(json.dumps(doc) + "\n")
        else:
            out.write(m.text)
        out.flush()
    if not as_json:
        out.write("\n")
        out.flush()
        if last is not None and last.finish_reason:
            u = last.usage
            err.write(f"[{last.finish_reason}: {u.prompt_tokens} prompt + {u.completion_tokens} out]\n")
