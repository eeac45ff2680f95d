"""KV transfer benchmark: pdserve's layer-by-layer KV push against raw ucxx sends of the same bytes.

    python -m benchmarks.kv_transfer [--out FILE] [--transports tcp,shm] [--modes rma,tagged]
                                     [--tokens 16,1024] [--device cpu|cuda] [--burst N]

One decode and one prefill process per transport and mode; what is timed, each key: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.testing import PeerProcess, PeerSpec
from pdserve.kv_transfer.wire import PROTOCOL_VERSION

TOKENS = (16, 256, 1024, 4096)
SMOLLM2: dict[str, Any] = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
# 128 KiB blocks
PAYLOAD: dict[str, Any] = dict(num_layers=1, num_kv_heads=32, head_dim=64, block_size=16, dtype="bfloat16")
PAYLOAD_BYTES = 64 << 20
TRANSPORTS: dict[str, tuple[str, bool]] = {
    "tcp": ("tcp", False),
    "shm": ("tcp,sm,self", True),
    "shm_map": ("tcp,sm,self", True),  # the decode side's KV in shared memory (SHARED_KV)
    "cuda": ("tcp,cuda_copy,cuda_ipc,sm,self", False),  # no cuda_copy: ucxx refuses CUDA buffers
    "cuda_ipc": ("tcp,cuda_copy,cuda_ipc,sm,self", True),
}
# The device each transport moves KV in; --device picks the transports that may run.
TRANSPORT_DEVICE = {"tcp": "cpu", "shm": "cpu", "shm_map": "cpu", "cuda": "cuda", "cuda_ipc": "cuda"}
SHARED_KV = {"shm_map"}  # the decode process keeps its KV in a memfd (--kv-shared-memory): plain copies
DEVICES = ("cpu", "cuda")
MODES = ("rma", "tagged")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _machine(host: dict[str, Any]) -> dict[str, Any]:
    """``host`` (``bench.machine.machine_info``) with the UCX versions and the load at the end."""
    import ucxx

    return {
        **host,
        "ucx": ucxx.get_ucx_version(),
        "ucxx": ucxx.__version__,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine skews figures
    }


class _Pair:
    """A decode process (receiver + raw server) and a prefill process (sender + raw client)."""

    def __init__(
        self,
        layout: dict[str, Any],
        num_blocks: int,
        tls: str,
        shm: bool,
        ucx_env: tuple[tuple[str, str], ...] = (),
        rma: bool = True,
        device: str = "cpu",
        kv_shared: bool = False,
        digest: bool = True,
    ) -> None:
        config = TransferConfig(same_host=shm, deadline_s=60.0, rma=rma, rma_over_tcp=rma, digest=digest)
        spec = PeerSpec(
            num_blocks=num_blocks,
            config=config,
            env=(("UCX_TLS", tls), *ucx_env),
            device=device,
            **layout,
        )
        self.decode = PeerProcess(dataclasses.replace(spec, kv_shared=kv_shared), "bench-decode")
        self.prefill = PeerProcess(spec, "bench-prefill")
        self.num_layers: int = layout["num_layers"]
        self._n = 0

    def __enter__(self) -> _Pair:
        self.decode.call("start_receiver", timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.prefill.stop()
        self.decode.stop()

    def transfer(self, tokens: int, layer_interval_s: float = 0.0, burst: int = 0) -> dict[str, Any]:
        self._n += 1
        rid = f"bench-{self._n}"
        ticket = self.decode.call("reserve", request_id=rid, num_tokens=tokens, snapshot=False, track=True)
        kw = {"layer_interval_s": layer_interval_s, "fill": False, "burst": burst}
        stats = self.prefill.call("transfer", ticket=ticket, seed=self._n, **kw)
        done = self.decode.call("wait", request_id=rid)
        self.decode.call("release", request_id=rid)
        # The decode side has every byte and knows it (its ``wait`` resolved): one clock on one host.
        return {**stats, "landed_seconds": done["landed_at"] - stats["started_at"]}

    def bit_exact(self, tokens: int, seed: int = 0xC0FFEE) -> bool:
        """One transfer of seeded bytes (filled first, unlike the timed ones), checked on the decode side."""
        rid = f"check-{seed}"
        ticket = self.decode.call("reserve", request_id=rid, num_tokens=tokens, snapshot=False)
        self.prefill.call("transfer", ticket=ticket, seed=seed)
        self.decode.call("wait", request_id=rid)
        ok = bool(self.decode.call("verify", request_id=rid, seed=seed))
        self.decode.call("release", request_id=rid)
        return ok

    def raw(self, nbytes: int, reps: int, count: int = 1) -> list[float]:
        """Send to ack, per round."""
        address = self.decode.call("raw_serve", nbytes=nbytes, count=count)
        return self.prefill.call(
            "raw_run", address=address, nbytes=nbytes, reps=reps, count=count, timeout=300
        )

    def raw_timed(self, nbytes: int, reps: int) -> tuple[list[float], list[float]]:
        """Per round of one message: send to ack, and send to the receiver having every byte."""
        self.decode.call("raw_landings")  # clear: earlier rounds (warm-up, other views)
        times = self.raw(nbytes, reps)
        starts = self.prefill.call("raw_starts")
        landed = self.decode.call("raw_landings")
        return times, [b - a for a, b in zip(starts, landed, strict=True)]


def _row(
    pair: _Pair,
    transport: str,
    tokens: int | None,
    block_tokens: int,
    reps: int,
    mode: str = "rma",
    burst: int = 0,
) -> dict[str, Any]:
    request_tokens = tokens if tokens is not None else block_tokens
    for _ in range(2):  # warm-up: connection, page faults, UCX registration caches
        first = pair.transfer(request_tokens, burst=burst)
    nbytes = first["bytes"]
    pair.raw(nbytes, 2)  # warm-up, same as pdserve's
    pd_times, raw_times, messages = [], [], []
    pd_landed, raw_landed = [], []
    phases: dict[str, list[float]] = {"open": [], "push": [], "complete": []}
    paths: set[str | None] = set()
    for _ in range(reps):  # alternate, so both see the same machine noise
        stats = pair.transfer(request_tokens, burst=burst)
        paths.add(stats["path"])
        for phase, times_s in phases.items():
            times_s.append(stats[f"{phase}_seconds"])
        pd_times.append(stats["wall_seconds"])
        pd_landed.append(stats["landed_seconds"])
        messages.append(stats["messages"])
        times, landed = pair.raw_timed(nbytes, 1)
        raw_times.extend(times)
        raw_landed.extend(landed)
    pd, raw = statistics.median(pd_times), statistics.median(raw_times)
    pd_in, raw_in = statistics.median(pd_landed), statistics.median(raw_landed)
    count = round(statistics.median(messages))
    split = statistics.median(pair.raw(nbytes, reps + 1, count)[1:]) if count > 1 else raw
    # Paced run: layers slower than their transfer, so latency is the message's own.
    interval = max(0.002, 3 * pd / pair.num_layers)
    layer_s: list[float] = []
    for _ in range(2):
        layer_s.extend(pair.transfer(request_tokens, layer_interval_s=interval)["layer_seconds"])
    raw_layer = pair.raw(nbytes // pair.num_layers, 17)[2:]
    return {
        "transport": transport,
        "mode": mode,
        # How pdserve's KV moved in the timed runs: puts, cross_memory or tagged.
        "path": ",".join(sorted(str(p) for p in paths)),
        "burst": burst,  # layers per push call (0: one call per layer)
        "tokens": tokens,
        "bytes": nbytes,
        "pdserve_gbps": round(nbytes / pd / 1e9, 3),
        "raw_gbps": round(nbytes / raw / 1e9, 3),
        "ratio": round(raw / pd, 3),
        "pdserve_ms": round(pd * 1e3, 3),
        "raw_ms": round(raw * 1e3, 3),
        "messages": count,
        # Start to the decode side having every byte and knowing it (pdserve: its wait resolves,
        # after Complete; raw: its receive completes), read on the host's one monotonic clock.
        # The ratio above times the sender until the answer comes back (pdserve: CompleteAck;
        # raw: its ack), one control message more for pdserve: a one-sided write needs Complete
        # to tell the decode side, where raw's data message itself does.
        "landed": {
            "pdserve_ms": round(pd_in * 1e3, 3),
            "raw_ms": round(raw_in * 1e3, 3),
            "ratio": round(raw_in / pd_in, 3),
        },
        "raw_same_messages_ms": round(split * 1e3, 3),
        # Where pdserve's time goes (medians): ``open`` sends Open; ``push`` is the fake forward
        # pushing every layer (and the hop to its thread and back); ``complete`` flushes, sends
        # Complete and waits for the ack.
        "phases_ms": {phase: round(statistics.median(t) * 1e3, 3) for phase, t in phases.items()},
        # Noise on a shared machine only ever adds time: the fastest runs are the other view.
        "best": {
            "pdserve_gbps": round(nbytes / min(pd_times) / 1e9, 3),
            "raw_gbps": round(nbytes / min(raw_times) / 1e9, 3),
            "ratio": round(min(raw_times) / min(pd_times), 3),
        },
        "per_layer_latency_us": {
            "p50": round(_percentile(layer_s, 50) * 1e6, 1),
            "p99": round(_percentile(layer_s, 99) * 1e6, 1),
            "raw_p50": round(_percentile(raw_layer, 50) * 1e6, 1),
            "layer_bytes": nbytes // pair.num_layers,
            "layer_interval_ms": round(interval * 1e3, 2),
        },
        "reps": reps,
    }


def run(
    transports: list[str],
    reps: int,
    ucx_env: tuple[tuple[str, str], ...] = (),
    tokens: tuple[int, ...] = TOKENS,
    modes: tuple[str, ...] = MODES,
    device: str = "cpu",
    burst: int = 0,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    host = machine_info(device)  # in the parent, before its ucxx import (_machine): no data moves here
    block_bytes = 2 * PAYLOAD["block_size"] * PAYLOAD["num_kv_heads"] * PAYLOAD["head_dim"] * 2
    payload_blocks = PAYLOAD_BYTES // block_bytes
    payload_tokens = payload_blocks * PAYLOAD["block_size"]
    layouts: list[tuple[str, dict[str, Any], int, list[tuple[int | None, int]], int]] = [
        # name, layout, blocks, rows (tokens reported, tokens requested), tokens of the checked transfer
        ("smollm2", SMOLLM2, max(tokens) // SMOLLM2["block_size"] + 8, [(n, n) for n in tokens], min(tokens)),
        ("payload", PAYLOAD, payload_blocks, [(None, payload_tokens)], payload_tokens),
    ]
    for name in transports:
        tls, shm = TRANSPORTS[name]
        for mode in modes:
            for label, layout, blocks, sizes, checked in layouts:
                where = {"transport": name, "mode": mode, "layout": label}
                try:
                    shared = name in SHARED_KV
                    with _Pair(layout, blocks, tls, shm, ucx_env, mode == "rma", device, shared) as pair:
                        for reported, requested in sizes:
                            rows.append(_row(pair, name, reported, requested, reps, mode, burst))
                            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                        checks.append({**where, "tokens": checked, "ok": pair.bit_exact(checked)})
                        print(json.dumps({"bit_exact": checks[-1]}), file=sys.stderr, flush=True)
                except Exception as exc:  # one pair failed (e.g. a transport refused device memory): go on
                    errors.append({**where, "error": f"{type(exc).__name__}: {exc}"})
                    print(json.dumps({"failed": errors[-1]}), file=sys.stderr, flush=True)
    return {
        "machine": _machine(host),
        "device": host["device"],  # also in machine; at the top level for the report's readers
        "transports": {
            name: {"UCX_TLS": TRANSPORTS[name][0], "shared_memory_data_endpoint": TRANSPORTS[name][1]}
            for name in transports
        },  # fmt: skip
        "protocol": PROTOCOL_VERSION,  # the wire protocol the run spoke
        "ucx_env": dict(ucx_env),  # applied to both processes, pdserve and raw alike
        "burst": burst,
        "rows": rows,
        "bit_exact": checks,
        "errors": errors,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _check_device(device: str, names: list[str]) -> str | None:
    """Why ``names`` cannot run on ``device`` (a message for the parser), or None."""
    wrong = [n for n in names if TRANSPORT_DEVICE[n] != device]
    if wrong:
        fits = ",".join(n for n in TRANSPORTS if TRANSPORT_DEVICE[n] == device)
        return f"transports {','.join(wrong)} do not move {device} memory (with --device {device}: {fits})"
    if device == "cuda" and not torch.cuda.is_available():
        return f"--device cuda needs a CUDA device, and torch {torch.__version__} sees none"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("--reps", type=int, default=9, help="timed transfers per row (median reported)")
    parser.add_argument(
        "--transports",
        default=None,
        help="comma list of: "
        + ",".join(TRANSPORTS)
        + " (default: tcp,shm; with --device cuda: cuda,cuda_ipc)",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="where both processes hold KV and raw buffers"
    )
    parser.add_argument(
        "--ucx-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a UCX_* setting for both processes (pdserve and raw alike), repeatable",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of: " + ",".join(MODES))
    parser.add_argument(
        "--tokens", default=",".join(map(str, TOKENS)), help="request sizes in tokens, comma-separated"
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=0,
        metavar="N",
        help="layers the fake forward pushes per call (push_layers; 30: all, as a graphed prefill); 0: one",
    )
    args = parser.parse_args(argv)
    if args.burst < 0:
        parser.error(f"--burst must be >= 0, got {args.burst}")
    ucx_env: list[tuple[str, str]] = []
    for item in args.ucx_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("UCX_"):
            parser.error(f"--ucx-env takes UCX_KEY=VALUE, got {item!r}")
        ucx_env.append((key, value))
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    except ValueError:
        parser.error(f"--tokens takes integers, got {args.tokens!r}")
    if not tokens or min(tokens) < 1:
        parser.error("--tokens needs at least one size >= 1")
    default = ",".join(n for n in TRANSPORTS if TRANSPORT_DEVICE[n] == args.device and n not in SHARED_KV)
    names = [t for t in (args.transports or default).split(",") if t]
    unknown = set(names) - set(TRANSPORTS)
    if unknown or not names:
        parser.error(f"unknown transports: {sorted(unknown)}" if unknown else "--transports is empty")
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes a comma list of {', '.join(MODES)}, got {args.modes!r}")
    why = _check_device(args.device, names)
    if why:
        parser.error(why)
    report = run(names, args.reps, tuple(ucx_env), tokens, modes, args.device, args.burst)
    emit_json(report, args.out)
    bad = [c for c in report["bit_exact"] if not c["ok"]]
    if bad or report.get("errors"):
        sys.exit(f"failed pairs: {report.get('errors')}; KV received differs from what was sent: {bad}")


if __name__ == "__main__":
    main()
