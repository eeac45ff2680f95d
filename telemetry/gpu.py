"""GPU utilisation and memory through NVML (nvidia-ml-py), read at scrape time, only where a GPU is present.

No driver, library or device is not an error: nothing is registered, and that is logged at debug level.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

GPU_UTILIZATION = "pdserve_gpu_utilization_ratio"
GPU_MEMORY_USED = "pdserve_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "pdserve_gpu_memory_total_bytes"
GPU_METRICS = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL)
_LABELS = ["role", "gpu"]


class GpuCollector(Collector):
    def __init__(self, nvml: Any, handles: list[Any], role: str, names: list[str] | None = None) -> None:
        self._nvml = nvml
        self._handles = handles
        self._role = role
        self._names = names or [str(i) for i in range(len(handles))]  # the ``gpu`` label of each handle

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                GPU_UTILIZATION, "GPU busy time over NVML's last sample period (0-1).", labels=_LABELS
            ),
            GaugeMetricFamily(GPU_MEMORY_USED, "GPU memory in use.", labels=_LABELS),
            GaugeMetricFamily(GPU_MEMORY_TOTAL, "GPU memory installed.", labels=_LABELS),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        util, used, total = self._families()
        for name, h in zip(self._names, self._handles, strict=True):
            labels = [self._role, name]
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(h)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
            except Exception as e:  # noqa: BLE001 - one device's error must not fail the whole scrape
                log.debug("NVML read of GPU %s failed: %s", name, e)
                continue
            util.add_metric(labels, rates.gpu / 100.0)
            used.add_metric(labels, float(mem.used))
            total.add_metric(labels, float(mem.total))
        return iter((util, used, total))


def _import_nvml() -> ModuleType | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml


def _one_handle(nvml: Any, index: int, uuid: str) -> Any:
    """NVML's handle of the process's CUDA device ``index``: by UUID when given (right whatever
    ``CUDA_VISIBLE_DEVICES`` says), else by index (right when the process sees every GPU in PCI order)."""
    if uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception as e:  # noqa: BLE001
            log.debug("NVML does not know GPU %s (%s); taking NVML's device %d", uuid, e, index)
    return nvml.nvmlDeviceGetHandleByIndex(index)


def add_gpu_metrics(
    registry: CollectorRegistry, role: str = "", nvml: Any = None, *, index: int | None = None, uuid: str = ""
) -> bool:
    """Register the GPU collector on ``registry`` when a GPU is present. True when it was registered.

    ``index``: only the process's CUDA device ``index`` (a worker's ``cuda:N``; ``uuid``, NVML's
    ``GPU-...`` name of it, finds it when CUDA numbers devices differently: NVML numbers the whole
    machine's devices in PCI order, CUDA only those ``CUDA_VISIBLE_DEVICES`` shows); None: every GPU of
    the host (the router, which runs no model).
    ``nvml`` is the pynvml module (tests pass a stand-in); None imports nvidia-ml-py.
    """
    nvml = nvml if nvml is not None else _import_nvml()
    if nvml is None:
        log.debug("nvidia-ml-py is not installed: no GPU metrics")
        return False
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError subclasses, OSError: all mean "no usable GPU"
        log.debug("NVML did not start (%s): no GPU metrics", e)
        return False
    try:
        if index is None:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            names = [str(i) for i in range(len(handles))]
        else:
            handles, names = [_one_handle(nvml, index, uuid)], [str(index)]
    except Exception as e:  # noqa: BLE001
        log.debug("NVML lists no usable GPU (%s): no GPU metrics", e)
        handles = []
    if not handles:
        nvml.nvmlShutdown()
        return False
    registry.register(GpuCollector(nvml, handles, role, names))
    log.info("exporting metrics of GPU(s) %s", ", ".join(names))
    return True
