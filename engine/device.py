"""Where an engine runs and in which dtype: the one place ``--device`` and ``--dtype auto`` are resolved.

The ``check_*`` syntax checks import nothing heavy, so configs and the CLI validate without torch;
``resolve_*`` look at the host (torch, /proc/cpuinfo).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_HELP = "cpu, cuda (GPU 0) or cuda:N"
# CPU flags (as /proc/cpuinfo spells them) of native bf16 dot products: AVX512-BF16's vdpbf16ps, AMX tiles.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def check_device(device: str) -> str:
    """``device`` if it is ``cpu``, ``cuda`` or ``cuda:N``, else ValueError. Does not look for a GPU."""
    m = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ValueError(f"device must be {DEVICE_HELP}, got {device!r}")
    return device


def device_index(device: str) -> int | None:
    """The CUDA device index of a ``cuda``/``cuda:N`` string (``cuda`` is 0); None for ``cpu``."""
    m = _DEVICE.fullmatch(check_device(device))
    assert m is not None
    if m.group(1) == "cpu":
        return None
    return int(m.group(2) or 0)


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype


def check_gpu_memory_utilization(value: float) -> float:
    """A fraction in (0, 1]: the share of the GPU's memory this engine may use, as vLLM means it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {value!r}")
    return float(value)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, cuda_count: Callable[[], int] | None = None) -> str:
    """``cpu`` or ``cuda:N``, checked against this host; ValueError saying what is wrong otherwise.

    ``cuda_count`` returns how many CUDA devices this process sees (default: torch's count; for tests).
    """
    index = device_index(device)
    if index is None:
        return "cpu"
    count = (cuda_count or _cuda_count)()
    if count == 0:
        raise ValueError(
            f"device {device!r} asked for, but CUDA is not available here (no GPU visible to this process, "
            "or a CPU-only torch build); use --device cpu"
        )
    if index >= count:
        seen = ", ".join(f"cuda:{i}" for i in range(count))
        raise ValueError(f"device {device!r} asked for, but this process sees {count} CUDA device(s): {seen}")
    return f"cuda:{index}"


def host_cpu_flags() -> Collection[str]:
    """The instruction-set extensions of this CPU that matter here (``cpu_kernels.cpu_isa``'s list)."""
    from pdserve.engine.cpu_kernels import cpu_isa

    flags = cpu_isa()["flags"]
    assert isinstance(flags, list)
    return flags


def _cuda_bf16(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index) >= (8, 0)


def resolve_dtype(
    dtype: str,
    device: str,
    cpu_flags: Collection[str] | None = None,
    cuda_bf16: Callable[[int], bool] | None = None,
) -> str:
    """The dtype an engine on ``device`` runs in: ``dtype`` itself, or for ``auto`` the fast one there:
    bfloat16 on CUDA (float16 before Ampere, which has no bf16 tensor cores) and on CPUs with bf16 dot
    products, float32 elsewhere (an AVX2-only CPU emulates bfloat16, slower than float32).

    ``cpu_flags`` (default: this host's) and ``cuda_bf16`` (whether GPU N has bf16 tensor cores) are
    for tests.
    """
    if check_dtype(dtype) != "auto":
        return dtype
    index = device_index(device)
    if index is not None:
        return "bfloat16" if (cuda_bf16 or _cuda_bf16)(index) else "float16"
    flags = host_cpu_flags() if cpu_flags is None else cpu_flags
    return "bfloat16" if any(f in flags for f in BF16_CPU_FLAGS) else "float32"


def cuda_uuid(device: str) -> str:
    """NVML's name of CUDA device ``device`` (``GPU-<uuid>``), or "" for ``cpu`` or when torch cannot say.

    What telemetry needs to find the GPU a worker runs on whatever ``CUDA_VISIBLE_DEVICES`` renumbers.
    """
    index = device_index(device)
    if index is None:
        return ""
    try:
        import torch

        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    except Exception:  # noqa: BLE001 - no CUDA, no such device, an old torch: telemetry falls back to the index
        return ""
