"""Which same-host path (cross-memory attach or CUDA IPC) a sender takes for a region and its KV memory."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers import select


def test_a_writer_of_its_own_follows_the_memory_on_both_sides() -> None:
    """process_vm_writev copies host memory, CUDA IPC device memory: a sender whose KV is on a device
    never writes by cross-memory attach (a CUDA prefill beside a host-memory decode worker, which offers
    its pid), nor a host sender by CUDA IPC. The meta device stands in for CUDA: only the type matters."""
    host_kv, device_kv = np.zeros(4, dtype=np.uint8), torch.empty(4, dtype=torch.uint8, device="meta")
    host_region = RemoteRegion(key=b"k", base=1, length=4, layer_bytes=4, pid=7, host="h")
    device_region = RemoteRegion(key=b"k", base=1, length=4, layer_bytes=4, pid=7, host="h", cuda_ipc=b"x")
    assert select.same_host_path(host_region, host_kv, True) == "cross_memory"
    assert select.same_host_path(host_region, torch.zeros(4, dtype=torch.uint8), True) == "cross_memory"
    assert select.same_host_path(host_region, None, True) == "cross_memory"
    assert select.same_host_path(host_region, device_kv, True) is None
    assert select.same_host_path(device_region, device_kv, True) == "cuda_ipc"
    assert select.same_host_path(device_region, host_kv, True) is None
    assert select.same_host_path(host_region, host_kv, False) is None  # switched off
    no_pid = RemoteRegion(key=b"k", base=1, length=4, layer_bytes=4)
    assert select.same_host_path(no_pid, host_kv, True) is None
