"""``pdserve bench sweep`` and ``pdserve bench compare``: goodput of cluster shapes, side by side.

A shape is a layout (``1P+1D``, ``2C``, ``2P+1D``, ...). ``sweep`` runs ``pdserve bench`` on one shape at
rising request rates; ``compare`` runs several, alternating at each rate, and writes the ratio of their
goodputs, SLO-attainment curves and TTFT/ITL CDFs. Goodput (DistServe's): the highest rate at which
``--attainment`` of the requests meet both the TTFT and the TPOT SLO.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.datasets import DatasetName, TokenSpace
from pdserve.bench.machine import machine_info as host_machine
from pdserve.bench.metrics import RequestRecord, Slo
from pdserve.bench.report import read_json, write_json
from pdserve.bench.serve import (
    DEFAULT_MODEL,
    BenchConfig,
    BenchError,
    BenchResult,
    add_load_arguments,
    add_result_arguments,
    add_workload_arguments,
    config_from_args,
    model_token_space,
    run_benchmark,
)

DEFAULT_ATTAINMENT = 0.9  # DistServe's goal: 90% of requests within both SLOs
DEFAULT_STOP_BELOW = 0.5

_SHAPE_PART = re.compile(r"^\s*(\d+)\s*x?\s*(p|prefill|d|decode|c|colocated|both)\s*$", re.IGNORECASE)
_ROLE_OF = {"p": "prefill", "prefill": "prefill", "d": "decode", "decode": "decode"}


@dataclass(frozen=True)
class Shape:
    """A cluster layout: how many workers of each role."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError(f"worker counts must be >= 0, got {self}")
        if not (self.decode or self.colocated):
            raise ValueError(f"shape {self.label} has no decode or colocated worker to serve requests")

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``"1P+1D"``, ``"2C"``, ``"2x colocated"``, ``"1prefill+2decode"`` -> Shape."""
        counts = {"prefill": 0, "decode": 0, "colocated": 0}
        for part in text.split("+"):
            m = _SHAPE_PART.match(part)
            if m is None:
                raise ValueError(
                    f"bad shape {text!r}: expected parts like 1P, 1D, 2C joined by '+' (e.g. 1P+1D or 2C)"
                )
            counts[_ROLE_OF.get(m.group(2).lower(), "colocated")] += int(m.group(1))
        return cls(**counts)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def label(self) -> str:
        parts = [f"{n}{r}" for n, r in ((self.prefill, "P"), (self.decode, "D"), (self.colocated, "C")) if n]
        return "+".join(parts)

    def up_args(self) -> list[str]:
        return [
            "--prefill",
            str(self.prefill),
            "--decode",
            str(self.decode),
            "--colocated",
            str(self.colocated),
        ]


@dataclass(frozen=True)
class ClusterSpec:
    """What every shape of one sweep is started with, besides its layout."""

    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    threads: int = 1
    pin_cpus: bool = True
    host: str = "127.0.0.1"
    extra_up_args: tuple[str, ...] = ()  # more `pdserve up` flags, the same for every shape
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        # The sweep sets these itself (the shape, the port it connects to, what the report records): an
        # --up-arg naming one would start a cluster other than the one measured or recorded.
        for arg in self.extra_up_args:
            flag = arg.split("=", 1)[0]
            if flag in _OWN_UP_FLAGS:
                raise ValueError(
                    f"--up-arg {arg}: the sweep sets {flag} itself (its own option, if it has one)"
                )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"extra_up_args": list(self.extra_up_args)}


_OWN_UP_FLAGS = frozenset(
    ("--prefill", "--decode", "--colocated", "--model", "--dtype", "--threads", "--host", "--port",
     "--state-dir", "--timeout", "--pin-cpus")
)  # fmt: skip


# ---- clusters -----------------------------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def stop_cluster(state_dir: Path) -> None:
    """``pdserve down`` (drain, bounded), then SIGKILL whatever the state file still lists as alive."""
    from pdserve.deploy.local import cluster

    with contextlib.suppress(Exception):
        subprocess.run(
            _cli("down", "--state-dir", str(state_dir), "--timeout", "20"),
            capture_output=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    cluster.stop_survivors(state_dir)


def _asks_http(up_args: Sequence[str]) -> bool:
    return any(a.split("=", 1)[0] in ("--http-port", "--no-http") for a in up_args)


@contextlib.contextmanager
def local_cluster(shape: Shape, spec: ClusterSpec, state_dir: Path) -> Iterator[dict[str, Any]]:
    """A running cluster of ``shape`` (``pdserve up``); yields its address and pinning. Always stopped."""
    from pdserve.deploy.local import cluster

    port = _free_port(spec.host)
    argv = _cli(
        "up",
        *shape.up_args(),
        "--model", spec.model,
        "--dtype", spec.dtype,
        "--threads", str(spec.threads),
        "--host", spec.host,
        "--port", str(port),
        "--state-dir", str(state_dir),
        "--timeout", str(spec.timeout_s),
        *(["--pin-cpus"] if spec.pin_cpus else []),
        # gRPC only, unless asked: the OpenAI front would take port 8000 by default.
        *([] if _asks_http(spec.extra_up_args) else ["--no-http"]),
        *spec.extra_up_args,
    )  # fmt: skip
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=spec.timeout_s + 60,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if out.returncode != 0:
            raise BenchError(f"`pdserve up` for {shape.label} failed:\n{out.stderr.strip()[-3000:]}")
        state = cluster.load_state(state_dir)
        workers = [] if state is None else state.workers
        yield {
            "shape": shape.label,
            "router": f"{spec.host}:{port}",
            "command": shlex.join(["pdserve", *argv[3:]]),
            "workers": [
                {"id": w.id, "role": w.role.value if w.role else None, "cpus": list(w.cpus)} for w in workers
            ],
        }
    finally:
        stop_cluster(state_dir)


# ---- goodput ------------------------------------------------------------------------------------------


def find_goodput(
    points: Sequence[tuple[float, float | None]], goal: float = DEFAULT_ATTAINMENT
) -> dict[str, Any]:
    """Goodput from (rate, attainment) points; attainment None: the rate was skipped (a miss).

    Rates are taken in increasing order; the goodput is the last rate before the
    first miss (0 when the lowest rate misses). ``interpolated`` is where the
    straight line between that rate and the first missing one crosses ``goal``
    (a skipped rate counts as attainment 0 there; 0 when the lowest rate
    misses). ``saturated`` is False when no swept rate missed: the true goodput
    is at least ``goodput_rps``.
    """
    pts = sorted(points)
    if not pts:
        raise ValueError("no points")
    best: tuple[float, float] | None = None  # (rate, attainment) of the last rate that met the goal
    for rate, att in pts:
        a = 0.0 if att is None else att
        if a >= goal:
            best = (rate, a)
            continue
        if best is None:  # the lowest rate already misses: no evidence of any goodput (sweep lower)
            return {
                "goodput_rps": 0.0,
                "goodput_interpolated_rps": 0.0,
                "saturated": True,
                "first_miss_rps": rate,
            }
        r0, a0 = best
        return {
            "goodput_rps": r0,
            "goodput_interpolated_rps": r0 + (a0 - goal) / (a0 - a) * (rate - r0),
            "saturated": True,
            "first_miss_rps": rate,
        }
    assert best is not None
    return {
        "goodput_rps": best[0],
        "goodput_interpolated_rps": best[0],
        "saturated": False,
        "first_miss_rps": None,
    }


def attainment_split(records: Sequence[RequestRecord], slo: Slo) -> dict[str, float | None]:
    """Share of requests meeting each SLO alone, and both (failed requests miss all)."""
    n = len(records)
    if not n:
        return {"slo_attainment": None, "ttft_attainment": None, "tpot_attainment": None}
    only = {name: Slo(**{f"{name}_ms": getattr(slo, f"{name}_ms")}) for name in ("ttft", "tpot")}
    return {
        "slo_attainment": sum(slo.met_by(r) for r in records) / n,
        **{f"{name}_attainment": sum(s.met_by(r) for r in records) / n for name, s in only.items()},
    }


_POINT_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "mean_ttft_ms",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p50_tpot_ms",
    "p90_tpot_ms",
    "p50_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
)


def point_summary(rate: float, result: BenchResult, run_file: str) -> dict[str, Any]:
    return {
        "rate": rate,
        **attainment_split(result.records, result.config.slo),
        **{k: result.metrics.get(k) for k in _POINT_KEYS},
        "warmup_failed": result.warmup_failed,
        "result_file": run_file,
    }


# ---- a sweep ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepConfig:
    shapes: tuple[Shape, ...]
    rates: tuple[float, ...]
    bench: BenchConfig  # the workload, SLOs and load; its router and request rate are set per run
    cluster: ClusterSpec
    out_dir: Path
    goal: float = DEFAULT_ATTAINMENT
    stop_below: float = DEFAULT_STOP_BELOW
    cdf_rate: float | None = None  # None: the highest rate every shape ran

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("no shapes to sweep")
        if len({s.label for s in self.shapes}) != len(self.shapes):
            raise ValueError("shapes must differ")
        if not self.rates or any(not (0 < r < math.inf) for r in self.rates):
            raise ValueError(f"rates must be finite and > 0, got {list(self.rates)}")
        if len(set(self.rates)) != len(self.rates):
            raise ValueError(f"rates must differ, got {list(self.rates)}")
        slo = self.bench.slo
        if slo.ttft_ms is None or slo.tpot_ms is None:
            raise ValueError("goodput needs both SLOs: --goodput ttft:MS tpot:MS")
        if slo.e2el_ms is not None:  # the scan, the summary and the plots are in TTFT and TPOT alone
            raise ValueError("a sweep's goodput is by TTFT and TPOT: --goodput ttft:MS tpot:MS, no e2el")
        if self.cdf_rate is not None and self.cdf_rate not in self.rates:
            raise ValueError(f"cdf_rate must be one of the rates {sorted(self.rates)}, got {self.cdf_rate}")
        if not 0 < self.goal <= 1 or not 0 <= self.stop_below <= self.goal:
            raise ValueError(f"need 0 <= stop_below <= goal <= 1, got {self.stop_below}, {self.goal}")


def machine_info(threads: int, extra_up_args: Sequence[str] = ()) -> dict[str, Any]:
    """``bench.machine.machine_info`` (CPU, ISA, kernel build, cores, torch, device) with the threads per
    worker and the load."""
    return {
        **host_machine(_up_device(extra_up_args)),
        "threads_per_worker": threads,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _up_device(up_args: Sequence[str]) -> str:
    """The workers' ``--device`` from ``--up-arg`` (``--device=cuda`` or ``--device cuda``), else cpu."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--device", default="cpu")
    return parser.parse_known_args(list(up_args))[0].device


def _cores(machine: Mapping[str, Any]) -> Any:
    """The core count, under ``cores`` or, in documents without a ``bench.machine`` block, ``cpu_count``."""
    return machine.get("cores", machine.get("cpu_count"))


def _isa(machine: Mapping[str, Any]) -> str:
    """ ", <isa>[, <GPU>]" for the summary line; empty for a document that names no ISA."""
    dev = machine.get("device") or {}
    gpu = f", {dev.get('name') or dev['type']}" if dev.get("type", "cpu") != "cpu" else ""
    return f", {machine['isa']}{gpu}" if "isa" in machine else gpu


def _rate_tag(rate: float) -> str:
    return f"{rate:g}".replace(".", "p")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _sweep_async(
    cfg: SweepConfig, token_space: TokenSpace | None, clusters: Mapping[str, dict]
) -> dict:
    runs: dict[str, list[dict[str, Any]]] = {s.label: [] for s in cfg.shapes}
    records: dict[tuple[str, float], tuple[RequestRecord, ...]] = {}
    stopped: set[str] = set()
    order = list(cfg.shapes)
    for i, rate in enumerate(sorted(cfg.rates)):
        # ABBA: alternate which shape goes first, so slow drift in the machine hits all alike.
        for shape in order if i % 2 == 0 else order[::-1]:
            label = shape.label
            if label in stopped:
                runs[label].append({"rate": rate, "skipped": True, "slo_attainment": None})
                continue
            bench = dataclasses.replace(
                cfg.bench,
                router=clusters[label]["router"],
                arrivals=dataclasses.replace(cfg.bench.arrivals, request_rate=rate),
            )
            _say(f"[{label}] {rate:g} req/s: {bench.num_prompts} requests (+{bench.warmup} warmup)")
            result = await run_benchmark(bench, token_space=token_space)
            # Per-request records are most of a run's bytes: kept gzipped.
            run_file = Path("runs") / f"{label}_rate{_rate_tag(rate)}.json.gz"
            result.save(cfg.out_dir / run_file)
            point = point_summary(rate, result, str(run_file))
            runs[label].append(point)
            records[(label, rate)] = result.records
            _say(
                f"[{label}] {rate:g} req/s: SLO attainment {_pct(point['slo_attainment'])} "
                f"(TTFT {_pct(point['ttft_attainment'])}, TPOT {_pct(point['tpot_attainment'])}), "
                f"p90 TTFT {_ms(point['p90_ttft_ms'])}, p90 TPOT {_ms(point['p90_tpot_ms'])}"
            )
            if (point["slo_attainment"] or 0.0) < cfg.stop_below:
                stopped.add(label)
    return {"runs": runs, "records": records}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


ClusterFactory = Callable[[Shape, ClusterSpec, Path], contextlib.AbstractContextManager[dict[str, Any]]]


def run_sweep(
    cfg: SweepConfig, command: str = "", start_cluster: ClusterFactory | None = None
) -> dict[str, Any]:
    """Bring every shape up, sweep the rates over all of them, write the outputs; returns the document.

    A fair comparison, every item recorded in the document: every shape started by ``pdserve up`` with the
    same model, dtype, threads and worker flags (pinned to their own cores, least used first, unless
    ``--no-pin-cpus``; shapes of different worker counts refused unless ``--allow-unequal``); the same
    seeded request stream at each rate; warmup requests first, unmeasured; every shape up for the whole
    run, idle unless measured; the machine stated. Once a shape's attainment falls below ``--stop-below``
    its higher rates are skipped (misses): past saturation queues only grow.

    Outputs in ``out_dir``: ``runs/<shape>_rate<r>.json.gz`` (each run's full result),
    ``sweep.json`` or ``compare.json`` and the plots ``slo_attainment.png``, ``ttft_cdf.png``,
    ``itl_cdf.png``. Every cluster is stopped when the run ends, whatever happens.

    ``start_cluster`` (default ``local_cluster``) yields a running cluster's
    description, at least ``{"router": "host:port"}``, and stops it on exit.
    """
    import uvloop

    start_cluster = start_cluster or local_cluster

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    token_space = None
    if cfg.bench.workload.dataset != DatasetName.JSONL:
        token_space = model_token_space(cfg.bench.model)
    with contextlib.ExitStack() as stack:
        clusters: dict[str, dict[str, Any]] = {}
        for shape in cfg.shapes:
            _say(f"starting {shape.label} ...")
            state_dir = cfg.out_dir / "clusters" / shape.label.replace("+", "_")
            clusters[shape.label] = stack.enter_context(start_cluster(shape, cfg.cluster, state_dir))
        t0 = time.monotonic()
        swept = uvloop.run(_sweep_async(cfg, token_space, clusters))
        wall_s = time.monotonic() - t0
    doc = build_document(cfg, swept["runs"], clusters, wall_s, command)
    doc["slo_scan"] = scan_slos(cfg, swept["records"])
    doc["plots"] = write_plots(cfg, doc, swept["records"])
    write_json(cfg.out_dir / ("compare.json" if len(cfg.shapes) > 1 else "sweep.json"), doc)
    return doc


def build_document(
    cfg: SweepConfig,
    runs: Mapping[str, list[dict[str, Any]]],
    clusters: Mapping[str, dict[str, Any]],
    wall_s: float,
    command: str,
) -> dict[str, Any]:
    shapes: dict[str, Any] = {}
    for shape in cfg.shapes:
        points = runs[shape.label]
        shapes[shape.label] = {
            "workers": shape.workers,
            "cluster": clusters[shape.label],
            **find_goodput([(p["rate"], p["slo_attainment"]) for p in points], cfg.goal),
            "points": points,
        }
    doc: dict[str, Any] = {
        "kind": "compare" if len(cfg.shapes) > 1 else "sweep",
        "machine": machine_info(cfg.cluster.threads, cfg.cluster.extra_up_args),
        "cluster": cfg.cluster.as_dict(),
        "workload": cfg.bench.as_dict() | {"router": None, "request_rate": None},
        "slo": cfg.bench.slo.as_dict(),
        "goal_attainment": cfg.goal,
        "stop_below": cfg.stop_below,
        "rates": sorted(cfg.rates),
        "shapes": shapes,
        "wall_s": wall_s,
        "command": command,
    }
    if len(cfg.shapes) >= 2:
        a, b = (shapes[s.label] for s in cfg.shapes[:2])
        doc["ratio"] = {
            "shapes": [cfg.shapes[0].label, cfg.shapes[1].label],
            "goodput": _ratio(a["goodput_rps"], b["goodput_rps"]),
            "goodput_interpolated": _ratio(a["goodput_interpolated_rps"], b["goodput_interpolated_rps"]),
            # Only the first shape never missed: its goodput is at least that, so the ratio is a lower
            # bound (only the second: an upper bound; neither: both are bounds, the ratio says nothing).
            "lower_bound": not a["saturated"] and b["saturated"],
            "upper_bound": a["saturated"] and not b["saturated"],
            "undetermined": not a["saturated"] and not b["saturated"],
        }
    return doc


def _bound_note(ratio: Mapping[str, Any]) -> str:
    """What a ratio of goodputs is when a shape never missed (a document may have ``lower_bound`` only)."""
    if ratio.get("undetermined"):
        return " (undetermined: neither shape missed at the swept rates; sweep higher)"
    if ratio.get("upper_bound"):
        return " (upper bound)"
    return " (lower bound)" if ratio.get("lower_bound") else ""


SCAN_TTFT = (0.5, 1.0, 2.0)  # multiples of the sweep's TTFT SLO
SCAN_TPOT = (0.75, 1.0, 1.5, 2.0)  # and of its TPOT SLO


def scan_slos(
    cfg: SweepConfig, records: Mapping[tuple[str, float], Sequence[RequestRecord]]
) -> list[dict[str, Any]]:
    """Goodput of every shape (and the ratio) under other SLO pairs, rescored from the same requests.

    Shows how much a comparison's verdict depends on the SLOs chosen. A rate
    skipped in the sweep counts as a miss, so SLOs looser than the sweep's may
    understate the goodput of a shape that was cut short.
    """
    ttft, tpot = cfg.bench.slo.ttft_ms, cfg.bench.slo.tpot_ms
    assert ttft is not None and tpot is not None
    rows = []
    for ft in SCAN_TTFT:
        for fp in SCAN_TPOT:
            slo = Slo(ttft_ms=ttft * ft, tpot_ms=tpot * fp)
            goodput = {}
            for shape in cfg.shapes:
                pts = []
                for rate in cfg.rates:
                    recs = records.get((shape.label, rate))
                    pts.append(
                        (rate, None if recs is None else attainment_split(recs, slo)["slo_attainment"])
                    )
                goodput[shape.label] = find_goodput(pts, cfg.goal)
            row: dict[str, Any] = {
                "ttft_ms": slo.ttft_ms,
                "tpot_ms": slo.tpot_ms,
                "goodput_rps": {k: v["goodput_rps"] for k, v in goodput.items()},
                "goodput_interpolated_rps": {k: v["goodput_interpolated_rps"] for k, v in goodput.items()},
            }
            if len(cfg.shapes) >= 2:
                a, b = (goodput[s.label] for s in cfg.shapes[:2])
                row["ratio"] = _ratio(a["goodput_rps"], b["goodput_rps"])
                row["ratio_interpolated"] = _ratio(
                    a["goodput_interpolated_rps"], b["goodput_interpolated_rps"]
                )
            rows.append(row)
    return rows


def _ratio(a: float, b: float) -> float | None:
    if b > 0:
        return a / b
    return None if a == 0 else math.inf


# ---- plots --------------------------------------------------------------------------------------------


def _cdf_rate(cfg: SweepConfig, doc: Mapping[str, Any]) -> float | None:
    if cfg.cdf_rate is not None:
        return cfg.cdf_rate
    common = [
        r
        for r in sorted(cfg.rates)
        if all(
            any(p["rate"] == r and not p.get("skipped") for p in s["points"]) for s in doc["shapes"].values()
        )
    ]
    return common[-1] if common else None


def write_plots(
    cfg: SweepConfig, doc: Mapping[str, Any], records: Mapping[tuple[str, float], Sequence[RequestRecord]]
) -> dict[str, Any]:
    """SLO attainment vs rate for every shape; TTFT and ITL CDFs of every shape at one rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    slo = cfg.bench.slo
    title = (
        f"{cfg.cluster.model} {cfg.cluster.dtype}, {_cores(doc['machine'])} cores, "
        f"{cfg.cluster.threads} thread(s)/worker"
    )
    paths: dict[str, Any] = {}

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, key, name in zip(
        axes,
        ("slo_attainment", "ttft_attainment", "tpot_attainment"),
        (
            f"TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms",
            f"TTFT <= {slo.ttft_ms:g} ms",
            f"TPOT <= {slo.tpot_ms:g} ms",
        ),
        strict=True,
    ):
        for label, s in doc["shapes"].items():
            # Skipped rates are not drawn: they were not measured.
            pts = [(p["rate"], 100 * (p.get(key) or 0.0)) for p in s["points"] if not p.get("skipped")]
            ax.plot([r for r, _ in pts], [a for _, a in pts], marker="o", label=label)
        ax.axhline(100 * cfg.goal, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("requests within SLO (%)")
    axes[0].legend()
    fig.suptitle(f"SLO attainment: {title}", fontsize=10)
    fig.tight_layout()
    paths["slo_attainment"] = str(_save(fig, cfg.out_dir / "slo_attainment.png"))
    plt.close(fig)

    rate = _cdf_rate(cfg, doc)
    paths["cdf_rate"] = rate
    if rate is None:
        return paths
    for metric, unit_name, limit in (("ttft", "TTFT", slo.ttft_ms), ("itl", "ITL", slo.tpot_ms)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label in doc["shapes"]:
            recs = [r for r in records.get((label, rate), ()) if r.ok]
            if metric == "ttft":
                xs = [r.ttft * 1000 for r in recs if r.ttft is not None]
            else:
                xs = [x * 1000 for r in recs for x in r.itl]
            if not xs:
                continue
            sorted_xs = np.sort(np.asarray(xs))
            ax.step(sorted_xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
        assert limit is not None  # SweepConfig requires both SLOs
        ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xscale("log")
        ax.set_xlabel(f"{unit_name} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "tokens"))
        ax.set_title(f"{unit_name} CDF at {rate:g} req/s: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths[f"{metric}_cdf"] = str(_save(fig, cfg.out_dir / f"{metric}_cdf.png"))
        plt.close(fig)
    return paths


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# ---- summary ------------------------------------------------------------------------------------------


def format_summary(doc: Mapping[str, Any]) -> str:
    slo = doc["slo"]
    m = doc["machine"]
    lines = [
        f"{' pdserve bench ' + doc['kind'] + ' ':=^78}",
        f"machine: {_cores(m)} cores ({m['cpu']}{_isa(m)}), {m['threads_per_worker']} thread(s) per worker, "
        f"pinned: {doc['cluster']['pin_cpus']}",
        f"SLOs: TTFT <= {slo['ttft']:g} ms, TPOT <= {slo['tpot']:g} ms; "
        f"goal {100 * doc['goal_attainment']:.0f}%",
        f"{'shape':<10}{'rate':>7}{'SLO %':>8}{'TTFT %':>8}{'TPOT %':>8}"
        f"{'p90 TTFT':>11}{'p90 TPOT':>10}{'p99 ITL':>10}{'req/s':>7}",
    ]
    for label, s in doc["shapes"].items():
        for p in s["points"]:
            if p.get("skipped"):
                lines.append(f"{label:<10}{p['rate']:>7g}{'(skipped: below --stop-below earlier)':>45}")
                continue
            keys = ("slo_attainment", "ttft_attainment", "tpot_attainment")
            att = "".join(f"{_num(p[k], 100):>8}" for k in keys)
            lat = f"{_num(p['p90_ttft_ms']):>11}{_num(p['p90_tpot_ms']):>10}{_num(p['p99_itl_ms']):>10}"
            lines.append(f"{label:<10}{p['rate']:>7g}{att}{lat}{_num(p['request_throughput'], 1, 2):>7}")
    lines.append("-" * 78)
    for label, s in doc["shapes"].items():
        bound = "" if s["saturated"] else " (at least: never missed)"
        lines.append(
            f"goodput {label:<10} {s['goodput_rps']:g} req/s{bound}, interpolated "
            f"{s['goodput_interpolated_rps']:.3f} req/s"
        )
    if "ratio" in doc:
        r = doc["ratio"]
        a, b = r["shapes"]
        lines.append(
            f"goodput ratio {a} / {b}: {_num(r['goodput'], 1, 2)} "
            f"(interpolated {_num(r['goodput_interpolated'], 1, 2)})" + _bound_note(r)
        )
    scan = doc.get("slo_scan") or []
    if scan and "ratio" in doc:
        lines.append("goodput ratio under other SLOs (same requests, rescored; interpolated in brackets):")
        tpots = sorted({r["tpot_ms"] for r in scan})
        lines.append(f"{'TTFT / TPOT ms':>14}" + "".join(f"{t:>14g}" for t in tpots))
        for ttft in sorted({r["ttft_ms"] for r in scan}):
            cells = {r["tpot_ms"]: r for r in scan if r["ttft_ms"] == ttft}
            row = "".join(f"{_ratio_cell(cells[t]):>14}" for t in tpots)
            lines.append(f"{ttft:>14g}{row}")
    for name, path in doc.get("plots", {}).items():
        if name != "cdf_rate" and path:
            lines.append(f"plot {name}: {path}")
    lines.append("=" * 78)
    return "\n".join(lines)


def _ratio_cell(row: Mapping[str, Any]) -> str:
    return f"{_num(row['ratio'], 1, 2)} [{_num(row['ratio_interpolated'], 1, 2)}]"


def _num(x: float | str | None, scale: float = 1.0, digits: int = 0) -> str:
    if x is None:
        return "-"
    x = float(x)  # a saved document carries infinities as "inf"
    if math.isinf(x):
        return "inf"
    return f"{x * scale:.{digits}f}"


# ---- command line -------------------------------------------------------------------------------------


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: expected numbers like 0.5,1,2") from None
    if not rates or any(not (0 < r < math.inf) for r in rates):
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: every rate must be finite and > 0")
    return rates


def _shape(text: str) -> Shape:
    try:
        return Shape.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser, *, compare: bool) -> None:
    where = parser.add_argument_group("clusters")
    if compare:
        where.add_argument(
            "--shapes",
            type=_shape,
            nargs="+",
            default=[Shape(prefill=1, decode=1), Shape(colocated=2)],
            metavar="SHAPE",
            help="cluster shapes, e.g. 1P+1D 2C (default); the ratio is first / second",
        )
        where.add_argument(
            "--allow-unequal", action="store_true", help="allow shapes with different worker counts"
        )
    else:
        where.add_argument("--shape", type=_shape, required=True, help="cluster shape, e.g. 1P+1D or 2C")
    where.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default: %(default)s)")
    where.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="the clusters' dtype, fixed rather than `up`'s auto so that runs compare across hosts "
        "(default: %(default)s)",
    )
    where.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker, the same for every shape (default: cores / largest worker count)",
    )
    where.add_argument("--no-pin-cpus", action="store_true", help="do not pin workers to cores")
    where.add_argument(
        "--up-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a `pdserve up` flag for every shape, repeatable, e.g. --up-arg=--max-batched-tokens=512",
    )
    add_workload_arguments(parser)
    add_load_arguments(parser, request_rate=False)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--rates", type=parse_rates, required=True, help="request rates to sweep, req/s, e.g. 0.25,0.5,1"
    )
    sweep.add_argument(
        "--attainment", type=float, default=DEFAULT_ATTAINMENT, help="goodput's goal (default %(default)s)"
    )
    sweep.add_argument(
        "--stop-below",
        type=float,
        default=DEFAULT_STOP_BELOW,
        help="skip a shape's higher rates once its attainment falls below this (default %(default)s)",
    )
    sweep.add_argument(
        "--cdf-rate", type=float, default=None, help="rate of the CDF plots (default: highest common)"
    )
    sweep.add_argument("--out-dir", type=Path, required=True, help="where results and plots go")
    add_result_arguments(parser)


def sweep_config_from_args(args: argparse.Namespace, *, compare: bool) -> SweepConfig:
    shapes = tuple(args.shapes) if compare else (args.shape,)
    if compare:
        if len(shapes) < 2:
            raise ValueError("compare needs at least two shapes")
        if len({s.workers for s in shapes}) > 1 and not args.allow_unequal:
            raise ValueError(
                "shapes have different worker counts ("
                + ", ".join(f"{s.label}: {s.workers}" for s in shapes)
                + "); an honest comparison uses the same number (--allow-unequal to override)"
            )
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(s.workers for s in shapes))
    bench = config_from_args(args, router="unset", model=args.model)
    return SweepConfig(
        shapes=shapes,
        rates=tuple(args.rates),
        bench=bench,
        cluster=ClusterSpec(
            model=args.model,
            dtype=args.dtype,
            threads=threads,
            pin_cpus=not args.no_pin_cpus,
            extra_up_args=tuple(args.up_arg),
        ),
        out_dir=args.out_dir,
        goal=args.attainment,
        stop_below=args.stop_below,
        cdf_rate=args.cdf_rate,
    )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_sweep, which stops every cluster it started


def run_from_args(args: argparse.Namespace, *, compare: bool, argv: Sequence[str] | None = None) -> int:
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        cfg = sweep_config_from_args(args, compare=compare)
        command = shlex.join(["pdserve", *(argv if argv is not None else sys.argv[1:])])
        doc = run_sweep(cfg, command)
    except (BenchError, ValueError, OSError) as e:
        print(f"pdserve bench {'compare' if compare else 'sweep'}: {e}", file=sys.stderr)
        return 1
    print(format_summary(doc), flush=True)
    return 0


# ---- redrawing a finished run -------------------------------------------------------------------------


def _record_from_dict(d: Mapping[str, Any]) -> RequestRecord:
    return RequestRecord(
        index=d["index"],
        scheduled_time=d["scheduled_time"],
        start_time=d["start_time"],
        end_time=d["end_time"],
        token_times=tuple(d["token_times"]),
        token_counts=tuple(d["token_counts"]),
        prompt_tokens=d["prompt_tokens"],
        error=d["error"],
        finish_reason=d.get("finish_reason", ""),
        request_id=d.get("request_id", ""),
    )


def redraw(out_dir: Path) -> dict[str, Any]:
    """Rescore and redraw a finished sweep/compare from its saved runs (no cluster, no requests)."""
    name = "compare.json" if (out_dir / "compare.json").is_file() else "sweep.json"
    doc = json.loads((out_dir / name).read_text())
    records: dict[tuple[str, float], tuple[RequestRecord, ...]] = {}
    for label, shape_doc in doc["shapes"].items():
        for p in shape_doc["points"]:
            if not p.get("skipped"):
                run = read_json(out_dir / p["result_file"])
                records[(label, p["rate"])] = tuple(_record_from_dict(r) for r in run["requests"])
    c = doc["cluster"]
    cfg = SweepConfig(
        shapes=tuple(Shape.parse(label) for label in doc["shapes"]),
        rates=tuple(doc["rates"]),
        bench=BenchConfig(router="unset", slo=Slo(ttft_ms=doc["slo"]["ttft"], tpot_ms=doc["slo"]["tpot"])),
        cluster=ClusterSpec(model=c["model"], dtype=c["dtype"], threads=c["threads"], pin_cpus=c["pin_cpus"]),
        out_dir=out_dir,
        goal=doc["goal_attainment"],
        stop_below=doc["stop_below"],
    )
    doc["slo_scan"] = scan_slos(cfg, records)
    doc["plots"] = write_plots(cfg, doc, records)
    write_json(out_dir / name, doc)
    return doc


if __name__ == "__main__":
    # python -m pdserve.bench.sweep redraw DIR: the plots and SLO scan of a finished run, from its saved runs.
    if len(sys.argv) != 3 or sys.argv[1] != "redraw":
        sys.exit("usage: python -m pdserve.bench.sweep redraw OUT_DIR")
    print(format_summary(redraw(Path(sys.argv[2]))))
