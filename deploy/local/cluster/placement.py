"""Where the cluster's workers run: torch threads per worker, the cores each is pinned to, and the share of
a GPU each takes."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from pdserve.deploy.local.cluster import processes
from pdserve.deploy.local.cluster.state import ClusterError, ClusterState, ProcessEntry


def default_threads(n_workers: int, cpus: int | None = None) -> int:
    """Torch threads per worker: the cores shared evenly, at least one each, so workers do not
    oversubscribe the cores and slow each other down."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, cpus // max(n_workers, 1))


def running_on_cpu(state: ClusterState) -> list[ProcessEntry]:
    """The cluster's CPU workers whose process runs."""
    return [w for w in state.workers if processes.alive(w) and w.device in ("", "cpu")]


def cpu_threads(state: ClusterState) -> int:
    """Torch threads of the running CPU workers, together (each its own --threads)."""
    return sum(w.threads or state.threads for w in running_on_cpu(state))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> ``(0, 2, 3)``: the Linux cpu-list syntax (taskset -c, /sys cpulist files)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a cpu list: {text!r} (expected e.g. 0,2-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a cpu list: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"not a cpu list: {text!r}")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def choose_cpus(taken: Iterable[Iterable[int]], threads: int, available: Sequence[int]) -> tuple[int, ...]:
    """The ``threads`` cores (of ``available``) least used by the workers already pinned (``taken``).

    Ties go to the lowest core id, so a cluster's placement is the same every
    time: on 2 cores with 1 thread each, the first worker gets core 0 and the
    second core 1 whatever their roles, so one prefill and one decode worker
    run on the same cores as two colocated ones. More threads than cores: all of them.
    """
    if threads >= len(available):
        return tuple(sorted(available))
    use = dict.fromkeys(sorted(available), 0)
    for cpus in taken:
        for c in cpus:
            if c in use:
                use[c] += 1
    return tuple(sorted(sorted(use, key=lambda c: (use[c], c))[:threads]))


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask), else all of them."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def gpu_share(state: ClusterState, device: str, leaving: Iterable[ProcessEntry] = ()) -> float:
    """The share of GPU ``device`` that the cluster's live workers on it take (``leaving``: not counted)."""
    gone = {w.id for w in leaving}
    return sum(
        w.gpu_memory_utilization
        for w in state.workers
        if w.device == device and w.id not in gone and processes.alive(w)
    )


def check_gpu_shares(device: str, taken: float, count: int, each: float) -> None:
    """ClusterError unless ``count`` more workers of ``each`` fit on GPU ``device`` beside ``taken``."""
    if device == "cpu" or count == 0 or taken + count * each <= 1.0 + 1e-9:
        return
    room = max(1.0 - taken, 0.0)
    beside = f" beside the {taken:.2f} its workers already take" if taken else ""
    raise ClusterError(
        f"--gpu-memory-utilization {each:g} for each of {count} new worker(s) on {device} adds up to "
        f"{taken + count * each:.2f} of its memory{beside}; give at most {room / count:.3f} "
        "(each worker's share)"
    )
