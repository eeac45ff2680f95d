"""The machine a benchmark ran on: the ``machine`` block of every benchmark's JSON.

A figure compares only with one from the same CPU, instruction set, kernel build and device, so each result
says which produced it; every benchmark records these keys and adds its own beside them.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        return next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor()


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """``cpu`` (model name); ``isa``, ``flags`` (the extensions that change which code runs: amx_bf16,
    avx512_bf16, avx512f, avx2, ...) and ``machine`` (the architecture), from ``engine.cpu_kernels.cpu_isa``;
    ``kernel_isa``: the build of pdserve's C kernels an engine on this machine loads (``PDSERVE_KERNEL_ISA``,
    else native; workers a benchmark starts inherit it; None where the engine runs on a GPU, which does not
    use them); ``cores``; ``python``; ``torch``; ``device``: ``{"type": "cpu"}``, or the GPU's name and
    CUDA version for ``cuda``/``cuda:N``."""
    import torch

    from pdserve.engine.cpu_kernels import cpu_isa
    from pdserve.engine.env import EngineEnv

    on_gpu = device.startswith("cuda")
    return {
        "cpu": cpu_name(),
        **cpu_isa(),
        "kernel_isa": None if on_gpu else EngineEnv.from_environ().kernel_isa or "native",
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device_info(device),
    }


def device_info(device: str) -> dict[str, Any]:
    """``{"type": "cpu"}``, or for ``cuda``/``cuda:N`` its type, GPU name and torch's CUDA version (name None
    where this process sees no GPU: the workers that ran on it were elsewhere)."""
    import torch

    kind = device.split(":", 1)[0]
    if kind != "cuda":
        return {"type": kind}
    name = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else None
    return {"type": kind, "name": name, "torch_cuda": torch.version.cuda}
