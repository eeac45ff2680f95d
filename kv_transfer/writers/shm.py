"""One-sided writes into a peer's KV cache in shared memory (``--kv-shared-memory``): plain copies into a
mapping of its memfd, opened through ``/proc/<pid>/fd/<fd>`` under the kernel's ptrace rule. Why beside
cross-memory attach, and its price on the decode side: docs/kv_transfer.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.plan import layer_runs
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers.cma import host_identity, open_pidfd, pidfd_alive

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them
_POPULATE_CHUNK = 64 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class ShmWriter:
    """Copies into a peer's KV cache mapped from its memfd. ``write_runs`` may be called from any thread
    (the forward thread writes each layer itself: handle.py); ``close`` may race with it (a lock keeps a
    copy from running into a mapping being unmapped). A peer that dies leaves its memory mapped here until
    the writer closes: a copy at its death lands in memory no one reads, and ``check`` (a pidfd, as cma.py)
    reports the death before Complete. The region's pid only opens the descriptor: once it is open, a
    reused pid cannot redirect a write."""

    synchronous = True
    direct = True
    path = "shared_memory"

    def __init__(self, mapping: mmap.mmap, length: int, pid: int, pidfd: int | None) -> None:
        self._map: mmap.mmap | None = mapping
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self.length = length
        self._pid, self._pidfd = pid, pidfd
        self._lock = threading.Lock()
        self._closed = False
        self._populating = threading.Lock()  # held by the populating thread while it touches the mapping
        self.populated = threading.Event()  # set when the thread is done (or gave up: older kernels)
        threading.Thread(target=self._populate, name=f"kv-shm-populate-{pid}", daemon=True).start()

    def _populate(self) -> None:
        """Fault the mapping's pages in, a chunk at a time, until done or closed (a GIL-free ctypes call
        per chunk; a kernel without MADV_POPULATE_WRITE leaves the faults to the copies). On a thread of
        its own, not on the event loop that opens the writer: for a large cache ``MAP_POPULATE`` would
        stall the loop for seconds. A copy that comes first faults its pages in itself."""
        try:
            for start in range(0, self.length, _POPULATE_CHUNK):
                with self._populating:
                    if self._closed:
                        return
                    n = min(_POPULATE_CHUNK, self.length - start)
                    if _libc.madvise(self._base + start, n, _MADV_POPULATE_WRITE) != 0:
                        return
        finally:
            self.populated.set()

    @classmethod
    def open(cls, region: RemoteRegion) -> ShmWriter:
        """A writer into ``region``'s shared KV cache, or TransferError saying why not (the caller writes
        by cross-memory attach instead)."""
        if region.shm_fd < 0:
            raise TransferError("the peer offers no shared KV cache")
        if not region.pid or not region.host or region.host != host_identity():
            raise TransferError("the peer is not a process of this host")
        if region.length <= 0:
            raise TransferError("empty region")
        pidfd = open_pidfd(region.pid)
        try:
            fd = os.open(f"/proc/{region.pid}/fd/{region.shm_fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            if pidfd is not None:
                os.close(pidfd)
            raise TransferError(f"opening the shared KV cache of pid {region.pid}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < region.length:
                why = f"the shared KV cache has {size} bytes, the region {region.length}"
            else:
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                mapping = mmap.mmap(fd, region.length, mmap.MAP_SHARED, prot)
                return cls(mapping, region.length, region.pid, pidfd)
        except OSError as exc:
            why = f"mapping the shared KV cache of pid {region.pid}: {exc}"
        finally:
            os.close(fd)  # the mapping keeps the pages
        if pidfd is not None:
            os.close(pidfd)
        raise TransferError(why)

    def _alive(self) -> bool:
        return not self._closed and pidfd_alive(self._pidfd)

    def _gone(self) -> PeerDiedError:
        """Why the peer cannot be written: this writer was closed (the connection ended), or the process
        exited (a closed writer was reported as the latter: misleading while the peer kept serving)."""
        if self._closed:
            return PeerDiedError(f"the connection to peer process {self._pid} is closed")
        return PeerDiedError(f"peer process {self._pid} has exited")

    def write_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copy each run ``(source, destination, nbytes)`` from address ``local + source`` to ``offset +
        destination`` bytes into the peer's cache, now."""
        for _, dst, nbytes in runs:
            if offset + dst < 0 or offset + dst + nbytes > self.length:
                raise ValueError(
                    f"a run of {nbytes} bytes at {offset + dst} is outside the {self.length}-byte region"
                )
        with self._lock:
            if self._closed:
                raise PeerDiedError(f"the connection to peer process {self._pid} is closed")
            remote = self._base + offset
            for src, dst, nbytes in runs:
                ctypes.memmove(remote + dst, local + src, nbytes)

    def write_layers(
        self,
        local: int,
        local_stride: int,
        offset: int,
        remote_stride: int,
        count: int,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        self.write_runs(local, offset, layer_runs(local_stride, remote_stride, count, runs))

    def check(self) -> TransferError | None:
        """What ``flush`` reports, now: every copy landed when it returned; the peer must still be there
        to read it."""
        return None if self._alive() else self._gone()

    def flush(self, on_done: Any) -> None:
        asyncio.get_running_loop().call_soon(on_done, self.check())

    def close(self) -> None:
        with self._lock, self._populating:  # no copy and no populating call is running, none starts after
            if self._closed:
                return
            self._closed = True
            mapping, self._map = self._map, None
        if mapping is not None:
            mapping.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
