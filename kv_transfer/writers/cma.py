"""One-sided writes between processes of one host by cross-memory attach (``process_vm_writev``), which
fails one transfer with ``ESRCH`` where UCX's own shared-memory path would abort the writing process
(docs/kv_transfer.md); also the host identity and pidfd liveness check the other writers use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import select
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.plan import layer_runs
from pdserve.kv_transfer.wire import RemoteRegion

# Larger writes go in pieces: one call copies at most this much (keeps each call short).
_MAX_WRITE = 1 << 30
# The kernel's limit on iovecs per side of one call (UIO_MAXIOV).
_MAX_IOV = 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name in ("process_vm_writev", "process_vm_readv"):
        fn = getattr(libc, name)
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
    return libc


@functools.cache
def host_identity() -> str:
    """Equal in two processes exactly when a pid means the same process to both: the same boot of the
    same kernel and the same pid namespace. "" where it cannot be told (no cross-memory writes)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{pid_ns}"


def open_pidfd(pid: int) -> int | None:
    """A pidfd of the peer process ``pid`` (Linux >= 5.3), to tell its exit apart from a reused pid;
    None where Python has no ``pidfd_open`` (the liveness check is then best effort). PeerDiedError
    when the process is already gone."""
    try:
        return os.pidfd_open(pid)
    except AttributeError:
        return None
    except OSError as exc:
        raise PeerDiedError(f"peer process {pid}: {os.strerror(exc.errno or 0)}") from exc


def pidfd_alive(pidfd: int | None) -> bool:
    """Whether the process of ``pidfd`` (``open_pidfd``) still runs: a pidfd reads ready once it exits."""
    if pidfd is None:
        return True
    try:
        readable, _, _ = select.select([pidfd], [], [], 0)
    except (OSError, ValueError):  # closed by another thread meanwhile
        return False
    return not readable


def _call(fn: Any, pid: int, local: int, remote: int, nbytes: int) -> int:
    liov = _IoVec(local, nbytes)
    riov = _IoVec(remote, nbytes)
    n = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
    return n if n >= 0 else -ctypes.get_errno()


class CmaWriter:
    """Writes into a peer process's exposed region (``RemoteRegion`` with ``pid`` and ``host``).

    ``put`` is a plain copy, done when it returns, and may be called from any thread (the
    forward thread writes each layer itself: handle.py); ``close`` may race with it. Before every
    write a pidfd says whether the process it opened still runs, so a pid reused after the peer's
    death is never written to. Permission is the kernel's ptrace rule (same user and Yama's
    ``ptrace_scope`` 0, or root): :meth:`open` probes it with a one-byte read and says why not.
    """

    synchronous = True
    direct = True
    path = "cross_memory"

    def __init__(self, region: RemoteRegion, pidfd: int | None) -> None:
        self.base = region.base
        self.length = region.length
        self._pid = region.pid
        self._pidfd = pidfd
        self._closed = False

    @classmethod
    def open(cls, region: RemoteRegion) -> CmaWriter:
        """A writer for ``region``, or TransferError saying why this host/peer cannot take one."""
        if not region.pid or not region.host or region.host != host_identity():
            raise TransferError("the peer is not a process of this host")
        if region.length <= 0:
            raise TransferError("empty region")
        writer = cls(region, open_pidfd(region.pid))
        probe = ctypes.create_string_buffer(1)
        got = _call(_libc().process_vm_readv, region.pid, ctypes.addressof(probe), region.base, 1)
        if got != 1:
            writer.close()
            why = os.strerror(-got) if got < 0 else "short read"
            raise TransferError(f"cross-memory attach to pid {region.pid} refused: {why}")
        return writer

    def _alive(self) -> bool:
        return not self._closed and pidfd_alive(self._pidfd)

    def _gone(self) -> PeerDiedError:
        """Why the peer cannot be written: this writer was closed (the connection ended), or the process
        exited; the two are told apart, since a closed writer's peer may still be serving."""
        if self._closed:
            return PeerDiedError(f"the connection to peer process {self._pid} is closed")
        return PeerDiedError(f"peer process {self._pid} has exited")

    def put(self, buf: Any, offset: int) -> None:
        """Copy ``buf`` (a contiguous host numpy array or torch tensor) to ``base + offset`` now."""
        if hasattr(buf, "data_ptr"):  # torch
            if buf.device.type != "cpu":
                raise TransferError("cross-memory writes take host memory only")
            address, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        else:  # numpy
            address, nbytes = buf.ctypes.data, buf.nbytes
        self.write(address, nbytes, offset)

    def write(self, address: int, nbytes: int, offset: int) -> None:
        if offset < 0 or offset + nbytes > self.length:
            raise ValueError(f"write of {nbytes} bytes at {offset} outside the {self.length}-byte region")
        fn = _libc().process_vm_writev
        done = 0
        while done < nbytes:
            if not self._alive():
                raise self._gone()
            step = min(nbytes - done, _MAX_WRITE)
            n = _call(fn, self._pid, address + done, self.base + offset + done, step)
            if n < 0:
                if -n in (errno.ESRCH, errno.EPERM):
                    raise PeerDiedError(f"write into peer process {self._pid}: {os.strerror(-n)}")
                raise TransferError(f"write into peer process {self._pid}: {os.strerror(-n)}")
            if n == 0:
                raise TransferError(f"write into peer process {self._pid} made no progress")
            done += n

    def write_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copy each run ``(source, destination, nbytes)`` from address ``local + source`` to
        ``base + offset + destination``, in one system call where the kernel's limits allow (a
        layer of a request whose blocks are scattered is one call, not one per run)."""
        n = len(runs)
        total = 0
        for _, dst, nbytes in runs:
            if offset + dst < 0 or offset + dst + nbytes > self.length:
                raise ValueError(
                    f"a run of {nbytes} bytes at {offset + dst} is outside the {self.length}-byte region"
                )
            total += nbytes
        if n == 0:
            return
        if n > _MAX_IOV or total > _MAX_WRITE:  # past the kernel's limits: as many calls as it takes
            group: list[tuple[int, int, int]] = []
            size = 0
            for run in runs:
                if run[2] > _MAX_WRITE:
                    self.write(local + run[0], run[2], offset + run[1])  # in pieces
                    continue
                if len(group) == _MAX_IOV or size + run[2] > _MAX_WRITE:
                    self.write_runs(local, offset, group)
                    group, size = [], 0
                group.append(run)
                size += run[2]
            self.write_runs(local, offset, group)
            return
        if not self._alive():
            raise self._gone()
        liov, riov = (_IoVec * n)(), (_IoVec * n)()
        remote = self.base + offset
        for i, (src, dst, nbytes) in enumerate(runs):
            liov[i].iov_base, liov[i].iov_len = local + src, nbytes
            riov[i].iov_base, riov[i].iov_len = remote + dst, nbytes
        got = _libc().process_vm_writev(self._pid, liov, n, riov, n, 0)
        if got == total:
            return
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.ESRCH, errno.EPERM):
                raise PeerDiedError(f"write into peer process {self._pid}: {os.strerror(err)}")
            raise TransferError(f"write into peer process {self._pid}: {os.strerror(err)}")
        # A short write (the kernel stops at a run it cannot reach): the rest run by run, which says why.
        for src, dst, nbytes in runs:
            done = min(max(got, 0), nbytes)
            got -= nbytes
            if done < nbytes:
                self.write(local + src + done, nbytes - done, offset + dst + done)

    def write_layers(
        self,
        local: int,
        local_stride: int,
        offset: int,
        remote_stride: int,
        count: int,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        """Every run of ``count`` layers in as few system calls as the kernel's limits allow."""
        self.write_runs(local, offset, layer_runs(local_stride, remote_stride, count, runs))

    def check(self) -> TransferError | None:
        """What ``flush`` reports, now: every write has landed when it returned."""
        return None if self._alive() else self._gone()

    def flush(self, on_done: Any) -> None:
        """Every write has landed when it returned; report at once (on the running loop)."""
        import asyncio

        asyncio.get_running_loop().call_soon(on_done, self.check())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
