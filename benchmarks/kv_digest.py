"""What the KV transfer's per-layer digest costs, side by side with it off, in one run:

    python -m benchmarks.kv_digest [--tokens 1024] [--reps 15] [--requests 8] [--out FILE]

1. The transfer: one decode and one prefill process per path (cross-memory writes on one host; UCX puts
   over tcp), the SmolLM2 layout in the host's serving dtype, ``--tokens`` tokens per transfer; digest on
   and off alternate, transfer by transfer (A B A B), on two process pairs. Reported: the median time from
   open to the decode side holding every byte (and, digest on, having checked it), and the digest's share.
2. A request: a 1P+1D cluster of the default model with ``--tokens``-token prompts (random, so no prefix
   is cached), the prefill worker hashing (default) or not (``--no-kv-digest``); clusters alternate
   on, off, on, off, ``--requests`` sequential requests each. Reported: median time to the first token
   (the prefill worker's answer, which does not wait for the transfer) and to the second (the decode
   worker's first, which runs only once the KV landed and was checked), and the digest's share of each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.kv_transfer import SMOLLM2, TRANSPORTS, _Pair
from benchmarks.local_cluster import free_port, pdserve
from pdserve.bench.machine import machine_info
from pdserve.bench.report import emit_json

PATHS = {"cross_memory": "shm", "ucx_puts": "tcp"}  # what the report calls it -> kv_transfer's transport


def _log(msg: str) -> None:
    print(f"[kv_digest] {msg}", file=sys.stderr, flush=True)


def transfer_costs(tokens: int, reps: int, dtype: str) -> list[dict[str, Any]]:
    rows = []
    layout = {**SMOLLM2, "dtype": dtype}
    blocks = tokens // layout["block_size"] + 8
    for path, transport in PATHS.items():
        tls, shm = TRANSPORTS[transport]
        with (
            _Pair(layout, blocks, tls, shm, digest=True) as on,
            _Pair(layout, blocks, tls, shm, digest=False) as off,
        ):
            for pair in (on, off):  # warm-up: connections, first-touch of the blocks
                pair.transfer(tokens)
            times: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(reps):
                for name, pair in (("on", on), ("off", off)):
                    times[name].append(pair.transfer(tokens)["landed_seconds"])
        t_on, t_off = statistics.median(times["on"]), statistics.median(times["off"])
        rows.append(
            {
                "path": path,
                "tokens": tokens,
                "dtype": dtype,
                "kv_bytes": tokens
                * layout["num_layers"]
                * 2
                * layout["num_kv_heads"]
                * layout["head_dim"]
                * (4 if dtype == "float32" else 2),
                "median_seconds_digest_on": t_on,
                "median_seconds_digest_off": t_off,
                "digest_share_of_transfer": (t_on - t_off) / t_on,
            }
        )
        _log(json.dumps(rows[-1]))
    return rows


def request_costs(tokens: int, requests: int, rounds: int, seed: int = 5) -> dict[str, Any]:
    import grpc

    from pdserve.proto import generation_pb2, generation_pb2_grpc

    rng = random.Random(seed)
    first: dict[str, list[float]] = {"on": [], "off": []}
    second: dict[str, list[float]] = {"on": [], "off": []}
    for rnd in range(rounds):
        for mode in ("on", "off"):
            with tempfile.TemporaryDirectory() as tmp:
                port = free_port()
                args = [
                    "up",
                    *("--prefill", "1", "--decode", "1", "--colocated", "0", "--no-http"),
                    *("--local-prefill-threshold", "1", "--no-enable-prefix-caching"),
                    *("--port", str(port), "--state-dir", tmp),
                    *(() if mode == "on" else ("--no-kv-digest",)),
                ]
                _log(f"round {rnd + 1}: digest {mode}: starting 1P+1D")
                pdserve(*args)
                try:
                    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                        stub = generation_pb2_grpc.GenerationStub(ch)
                        for i in range(requests + 1):  # the first warms the transfer's connection up
                            ids = [rng.randrange(100, 40000) for _ in range(tokens)]
                            req = generation_pb2.GenerateRequest(
                                request_id=f"{mode}-{rnd}-{i}",
                                prompt_token_ids=generation_pb2.TokenIds(ids=ids),
                            )
                            req.sampling.max_tokens = 2
                            req.sampling.ignore_eos = True
                            t0 = time.perf_counter()
                            at = []
                            for m in stub.Generate(req, timeout=300):
                                at += [time.perf_counter() - t0] * len(m.token_ids)
                            if i:
                                first[mode].append(at[0])
                                second[mode].append(at[1])
                finally:
                    pdserve("down", "--state-dir", tmp, "--timeout", "20", timeout=120)
    med = {
        k: {m: statistics.median(v) for m, v in d.items()} for k, d in (("first", first), ("second", second))
    }
    return {
        "tokens": tokens,
        "requests_per_cluster": requests,
        "rounds": rounds,
        "median_ttft_seconds": med["first"],
        "median_second_token_seconds": med["second"],
        "digest_share_of_ttft": (med["first"]["on"] - med["first"]["off"]) / med["first"]["on"],
        "digest_share_of_second_token": (med["second"]["on"] - med["second"]["off"]) / med["second"]["on"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=15, help="timed transfers per path and setting")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per cluster")
    parser.add_argument("--rounds", type=int, default=2, help="clusters per setting (alternating)")
    parser.add_argument("--skip-requests", action="store_true", help="the transfer part only")
    parser.add_argument("--out", help="write the JSON report here too")
    args = parser.parse_args(argv)
    host = machine_info("cpu")
    from pdserve.engine.device import resolve_dtype

    dtype = resolve_dtype("auto", "cpu")
    result: dict[str, Any] = {
        "command": "python -m benchmarks.kv_digest " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": host,
        "transfer": transfer_costs(args.tokens, args.reps, dtype),
    }
    if not args.skip_requests:
        result["request"] = request_costs(args.tokens, args.requests, args.rounds)
    emit_json(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
