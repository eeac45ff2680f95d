"""Each cluster process's resident memory over a soak: sampled with psutil, judged for flatness, plotted.

One series per process (name + pid), so a replacement's start-up growth is never read as a leak of the
worker it replaced; how a series is judged: ``RssSeries.flatness``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_SAMPLES = 5
MIB = 1 << 20


@dataclass
class RssSeries:
    name: str  # the cluster's id (router, prefill-3, ...) or "soak-client"
    pid: int
    role: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)

    def flatness(self, warmup_s: float, ready_s: float = 0.0) -> dict[str, Any]:
        """Baseline, extremes and drift after this series' own warm-up, counted from when it was ready.

        ``max_drift``: the largest distance of a sample from the baseline (the median of the first three
        after warm-up), as a fraction of it. ``max_rise``, the one judged: the largest climb above the
        lowest sample before it, as a fraction of that low, on a running median of three. A leak climbs and
        stays; a one-time fall (the router returning memory when a worker's channel goes) would count in
        the drift for the rest of the run, and one sample's spike (a prefill's activations for one large
        batch) is no level the process holds. ``max_rise_raw``: the same unsmoothed, reported only. With
        fewer than ``MIN_SAMPLES`` samples after warm-up a series is reported, not judged.
        """
        out: dict[str, Any] = {
            "name": self.name,
            "pid": self.pid,
            "role": self.role,
            "first_s": self.samples[0][0] if self.samples else None,
            "last_s": self.samples[-1][0] if self.samples else None,
            "samples": len(self.samples),
            "peak_mib": round(max(r for _, r in self.samples) / MIB, 1) if self.samples else None,
            "baseline_mib": None,
            "max_drift": None,
            "max_rise": None,
        }
        if not self.samples:
            return out
        start = max(self.samples[0][0], ready_s)
        out["judged_from_s"] = round(start + warmup_s, 2)
        after = [r for t, r in self.samples if t - start >= warmup_s]
        out["samples_after_warmup"] = len(after)
        if len(after) < MIN_SAMPLES:
            return out
        base = statistics.median(after[:3])
        out["baseline_mib"] = round(base / MIB, 1)
        out["min_mib"] = round(min(after) / MIB, 1)
        out["max_mib"] = round(max(after) / MIB, 1)
        out["end_mib"] = round(after[-1] / MIB, 1)
        out["max_drift"] = round(max(abs(r - base) for r in after) / base, 4)
        out["max_rise"] = round(
            _rise([statistics.median(after[max(i - 1, 0) : i + 2]) for i in range(len(after))]), 4
        )
        out["max_rise_raw"] = round(_rise(after), 4)
        out["growth"] = round(
            (statistics.median(after[-3:]) - base) / base, 4
        )  # end vs baseline: a leak's sign
        return out


def _rise(values: Sequence[float]) -> float:
    """The largest climb of a value above the lowest value before it, as a fraction of that low."""
    low, rise = values[0], 0.0
    for v in values:
        low = min(low, v)
        rise = max(rise, (v - low) / low)
    return rise


class RssSampler:
    """Samples the RSS of the processes it is shown; one series per (name, pid)."""

    def __init__(self) -> None:
        import psutil  # a test extra; `pdserve bench soak` says so when it is missing

        self._psutil = psutil
        self._procs: dict[tuple[str, int], Any] = {}
        self.series: dict[tuple[str, int], RssSeries] = {}

    def sample(self, t: float, procs: Iterable[tuple[str, int, str]]) -> None:
        """``procs``: (name, pid, role) of every process alive now."""
        for name, pid, role in procs:
            key = (name, pid)
            try:
                proc = self._procs.get(key)
                if proc is None:
                    proc = self._procs[key] = self._psutil.Process(pid)
                rss = int(proc.memory_info().rss)
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            self.series.setdefault(key, RssSeries(name, pid, role)).samples.append((t, rss))

    def report(self, warmup_s: float, ready_s: Mapping[str, float]) -> list[dict[str, Any]]:
        """Flatness of every series; ``ready_s``: when a process started after the load was ready."""
        return [s.flatness(warmup_s, ready_s.get(s.name, 0.0)) for s in self.series.values()]

    def as_dict(self) -> list[dict[str, Any]]:
        return [
            {"name": s.name, "pid": s.pid, "role": s.role, "t_s": [round(t, 2) for t, _ in s.samples],
             "rss_mib": [round(r / MIB, 2) for _, r in s.samples]}
            for s in self.series.values()
        ]  # fmt: skip


_ROLE_COLOURS = {"router": "tab:green", "prefill": "tab:blue", "decode": "tab:orange", "client": "tab:grey"}


def plot(
    series: Sequence[Mapping[str, Any]],
    flatness: Sequence[Mapping[str, Any]],
    kills: Sequence[Mapping[str, Any]],
    limit: float,
    title: str,
    path: Path,
) -> Path:
    """Top: RSS (MiB) over time, one line per process (``RssSampler.as_dict``), kills as vertical lines.
    Bottom: each judged process's RSS after its warm-up relative to its baseline, with the +-limit band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judged = {(f["name"], f["pid"]): f for f in flatness if f["max_drift"] is not None}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, height_ratios=(3, 2))
    for s in series:
        if not s["t_s"]:
            continue
        colour = _ROLE_COLOURS.get(s["role"], "tab:purple")
        minutes = [t / 60 for t in s["t_s"]]
        top.plot(minutes, s["rss_mib"], color=colour, linewidth=1.2)
        top.annotate(
            s["name"], (minutes[-1], s["rss_mib"][-1]), fontsize=7, color=colour,
            xytext=(3, 0), textcoords="offset points", va="center",
        )  # fmt: skip
        f = judged.get((s["name"], s["pid"]))
        if f is not None:
            pts = [(t, r) for t, r in zip(minutes, s["rss_mib"], strict=True) if t * 60 >= f["judged_from_s"]]
            base = f["baseline_mib"]
            bottom.plot(
                [t for t, _ in pts], [100 * (r - base) / base for _, r in pts], color=colour, linewidth=1
            )
    for ax in (top, bottom):
        for i, k in enumerate(kills):
            if "worker" in k:
                ax.axvline(
                    k["t_s"] / 60,
                    color="red",
                    linestyle=":",
                    linewidth=1,
                    label="SIGKILL" if i == 0 else None,
                )
        ax.grid(alpha=0.3)
    for role, colour in _ROLE_COLOURS.items():
        top.plot([], [], color=colour, label=role)
    top.set_yscale("log")
    top.set_ylabel("RSS (MiB, log scale)")
    top.set_title(title, fontsize=9)
    top.legend(fontsize=8, loc="center right")
    bottom.axhspan(-100 * limit, 100 * limit, color="green", alpha=0.08, label=f"+-{limit:.0%}")
    bottom.set_ylabel("RSS vs baseline after warm-up (%)")
    bottom.set_xlabel("minutes since the load started")
    bottom.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
