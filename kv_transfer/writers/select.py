"""Which writer a sender takes for a receiver's region: one of this host's writers (shared memory,
cross-memory attach, CUDA IPC), else the connection's UCX puts or, where puts do not pay, tagged messages.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.transport import RemoteWriter
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers import cma, cuda_ipc, shm

log = logging.getLogger(__name__)

# Transports whose puts UCX carries as messages (no one-sided hardware path between processes):
# an endpoint made only of these moves KV as tagged messages unless puts over tcp are on
# (TransferConfig.rma_over_tcp; by default on when every lane is tcp with 64 KB segments).
_NO_RMA_HARDWARE = frozenset({"tcp", "cuda_copy", "rocm_copy"})


def same_host_path(region: RemoteRegion, local: Any, same_host: bool) -> str | None:
    """Which writer of its own a sender whose KV bytes are ``local`` (``KVSpans.flat``: a numpy array
    for host memory, a torch tensor; None: host memory) tries for a receiver's ``region`` before UCX:
    "cross_memory" (host memory to host memory, cma.py, or shm.py where the region offers its memfd),
    "cuda_ipc" (device memory to device memory, cuda_ipc.py) or None. Cross-memory attach copies host
    memory only: a device-memory sender never takes it, whatever the receiver offers; nor does a
    host-memory sender take CUDA IPC."""
    if not same_host or not region.pid or not region.host:
        return None
    on_host = local is None or getattr(getattr(local, "device", None), "type", "cpu") == "cpu"
    if region.cuda_ipc:
        return None if on_host else "cuda_ipc"
    return "cross_memory" if on_host else None


def open_same_host_writer(
    region: RemoteRegion, local: Any, same_host: bool, peer: str
) -> RemoteWriter | None:
    """This host's writer into ``region`` (``same_host_path``), opened; None where none applies or none
    opens (the kernel does not permit it, the peer is gone, another host): the caller goes through UCX."""
    writer: RemoteWriter | None = None
    path = same_host_path(region, local, same_host)
    if path == "cross_memory" and region.shm_fd >= 0:
        try:
            writer = shm.ShmWriter.open(region)
            log.info("KV to %s: plain copies into its shared KV cache (pid %d)", peer, region.pid)
        except TransferError as exc:  # not permitted, or gone: cross-memory writes instead
            log.info("no shared KV cache of %s to map (%s); cross-memory writes instead", peer, exc)
    if path == "cross_memory" and writer is None:
        try:
            writer = cma.CmaWriter.open(region)
            log.info("KV to %s: one-sided writes by cross-memory attach (pid %d)", peer, region.pid)
        except TransferError as exc:  # another host, or not permitted: UCX's puts instead
            log.info("no cross-memory writes to %s (%s); UCX puts instead", peer, exc)
    elif path == "cuda_ipc":
        try:
            writer = cuda_ipc.CudaIpcWriter.open(region, local)
            log.info("KV to %s: one-sided writes by CUDA IPC (pid %d)", peer, region.pid)
        except TransferError as exc:  # another host, another GPU set: UCX's puts instead
            log.info("no CUDA IPC writes to %s (%s); UCX puts instead", peer, exc)
    return writer


def tagged_instead_of_puts(lanes: Sequence[tuple[str, str]], rma_over_tcp: bool | None) -> bool:
    """Whether an endpoint of these UCX ``lanes`` (transport, device) moves KV as tagged messages rather
    than puts: every lane lacks a one-sided hardware path and puts over tcp are not on (``rma_over_tcp``:
    True, always puts; None, puts where every lane is tcp; False, never over such lanes)."""
    if rma_over_tcp is True:
        return False
    tcp_puts = rma_over_tcp is None and all(tl == "tcp" for tl, _ in lanes)
    return bool(lanes) and all(tl in _NO_RMA_HARDWARE for tl, _ in lanes) and not tcp_puts
