"""One-sided writes into another process's CUDA memory on one host by CUDA IPC: the decode worker exports
its KV tensor's allocation once (``export``), and a prefill worker opens it once per peer and copies each
layer's runs into it with ``cudaMemcpyAsync`` on the forward's own stream.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers.cma import host_identity, open_pidfd, pidfd_alive

log = logging.getLogger(__name__)

# ``flush`` re-checks its event on every loop iteration for this long (a request's copies are short on
# the GPU), then every millisecond. A shorter timer is no finer: asyncio rounds it up to the millisecond
# of its epoll wait, and uvloop's fires on the next iteration, so the loop would spin without end.
_SPIN_S = 2e-3
_POLL_S = 1e-3


class _Export(msgspec.Struct, array_like=True, frozen=True):
    """What ``torch.multiprocessing`` sends for a CUDA storage, and where the tensor starts in it."""

    device_uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int  # elements (bytes: the tensor is uint8) into the storage
    nbytes: int


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export(buf: torch.Tensor) -> bytes:
    """The CUDA IPC export of ``buf`` (a contiguous uint8 CUDA tensor), for ``RemoteRegion.cuda_ipc``;
    b"" when this allocation cannot be shared (logged)."""
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        return b""
    try:
        shared = buf.untyped_storage()._share_cuda_()
        _, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync = shared
        spec = _Export(
            device_uuid=_uuid(buf.device),
            handle=bytes(handle),
            size_bytes=int(size_bytes),
            offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_handle or b""),
            ref_counter_offset=int(ref_offset or 0),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync),
            tensor_offset=int(buf.storage_offset()),
            nbytes=buf.numel(),
        )
    except (RuntimeError, TypeError, ValueError) as exc:  # e.g. expandable segments: not shareable
        log.warning("KV tensor not shareable by CUDA IPC (UCX moves it instead): %s", exc)
        return b""
    return msgspec.msgpack.encode(spec)


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (device to device, or peer)
_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch: the largest pitch a 2D copy takes
_EVENT_DISABLE_TIMING = 2
_NOT_READY = 600  # cudaErrorNotReady


class _Cudart:
    """The few CUDA runtime calls a layer's copies need, through ctypes on the libcudart torch loaded:
    torch's own ops (two slices, a copy, an event per layer) cost several times a runtime call's host
    time each, on every layer of every transfer."""

    def __init__(self, lib: Any) -> None:
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.memcpy = lib.cudaMemcpyAsync
        self.memcpy.argtypes, self.memcpy.restype = [vp, vp, sz, ctypes.c_int, vp], ctypes.c_int
        # (dst, dpitch, src, spitch, width, height, kind, stream): a run of every layer in one call
        self.memcpy2d = lib.cudaMemcpy2DAsync
        self.memcpy2d.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
        self.memcpy2d.restype = ctypes.c_int
        self.get_attribute = lib.cudaDeviceGetAttribute
        self.get_attribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.get_attribute.restype = ctypes.c_int
        self.event_create = lib.cudaEventCreateWithFlags
        self.event_create.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.event_create.restype = ctypes.c_int
        for name in ("cudaEventQuery", "cudaEventSynchronize", "cudaEventDestroy"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [vp], ctypes.c_int
        self.event_query, self.event_sync = lib.cudaEventQuery, lib.cudaEventSynchronize
        self.event_destroy = lib.cudaEventDestroy
        self.event_record = lib.cudaEventRecord
        self.event_record.argtypes, self.event_record.restype = [vp, vp], ctypes.c_int
        self.get_device, self.set_device = lib.cudaGetDevice, lib.cudaSetDevice
        self.get_device.argtypes, self.get_device.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        self.set_device.argtypes, self.set_device.restype = [ctypes.c_int], ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise TransferError(f"CUDA {what} failed with error {rc}")

    def new_event(self) -> int:
        ev = ctypes.c_void_p()
        self.check(self.event_create(ctypes.byref(ev), _EVENT_DISABLE_TIMING), "event creation")
        return int(ev.value or 0)

    def max_pitch(self, index: int) -> int:
        """The largest pitch of a 2D copy on device ``index`` (0: unknown, no 2D copies)."""
        value = ctypes.c_int(0)
        return value.value if self.get_attribute(ctypes.byref(value), _DEV_ATTR_MAX_PITCH, index) == 0 else 0

    def on_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device (the legacy stream is per device)."""
        cur = ctypes.c_int(-1)
        self.check(self.get_device(ctypes.byref(cur)), "cudaGetDevice")
        if cur.value != index:
            self.check(self.set_device(index), "cudaSetDevice")


def _current_stream(index: int) -> int:
    """The calling thread's current CUDA stream on device ``index``, as a raw handle: torch's getter of
    the raw handle where it has one (what Triton's launcher calls), which builds no ``torch.cuda.Stream``
    object, else the public API."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


@functools.cache
def _cudart() -> _Cudart | None:
    """The CUDA runtime this process's torch loaded (None: not found, e.g. linked statically)."""
    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart.so" in line), None)
        return None if path is None else _Cudart(ctypes.CDLL(path))
    except (OSError, AttributeError) as exc:
        log.info("no ctypes CUDA runtime for CUDA IPC copies (torch's copies instead): %s", exc)
        return None


def _local_device(uuid: str) -> torch.device | None:
    for i in range(torch.cuda.device_count()):
        if _uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    return None


def _open_remote(spec: _Export, device: torch.device) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, (spec.nbytes,), (1,), spec.tensor_offset, torch.UntypedStorage, torch.uint8,
        device.index, spec.handle, spec.size_bytes, spec.offset_bytes, False, spec.ref_counter_handle,
        spec.ref_counter_offset, spec.event_handle or None, spec.event_sync_required,
    )  # fmt: skip


class CudaIpcWriter:
    """Copies into a peer process's KV tensor opened by CUDA IPC.

    ``write_runs`` may be called from any thread (the forward thread writes each layer itself:
    handle.py); the copies go on that thread's current stream of the source's device, after the work
    already there: a layer's copies follow the forward's writes of it without waiting for them. An
    event recorded after each call's copies is what ``flush`` waits for. A peer that dies keeps its
    memory mapped here until this writer closes (CUDA keeps an allocation alive while another process
    has it open), so a copy at its death lands in memory no one reads, and ``check`` (a pidfd, as
    cma.py) reports the death. A handle cannot be opened in the process that made it, nor where the
    device (by UUID) is not visible."""

    synchronous = False
    direct = True
    path = "cuda_ipc"

    def __init__(self, remote: torch.Tensor, local: torch.Tensor, pid: int, pidfd: int | None) -> None:
        self._remote, self._local = remote, local
        self._local_address, self._remote_address = local.data_ptr(), remote.data_ptr()
        self._local_bytes = local.numel()
        self.length = remote.numel()
        self._pid, self._pidfd = pid, pidfd
        self._lock = threading.Lock()
        self._last: torch.cuda.Event | None = None  # recorded after the latest call's copies (torch path)
        self._closed = False
        # The ctypes path: one event, recorded again after every call's copies (on one stream, its latest
        # record comes after every earlier copy: what ``flush`` waits for).
        self._rt = _cudart()
        index = local.device.index
        self._device_index = index if index is not None else torch.cuda.current_device()
        self._event = 0
        self._max_pitch = 0
        if self._rt is not None:
            self._rt.on_device(self._device_index)  # the event belongs to the copies' device
            self._event = self._rt.new_event()
            self._max_pitch = self._rt.max_pitch(self._device_index)
        self._recorded = False

    @classmethod
    def open(cls, region: RemoteRegion, local: Any) -> CudaIpcWriter:
        """A writer from ``local`` (this process's KV bytes, a uint8 CUDA tensor) into ``region``, or
        TransferError saying why not (the caller falls back to UCX)."""
        if not region.cuda_ipc:
            raise TransferError("the peer offers no CUDA IPC export")
        if not isinstance(local, torch.Tensor) or local.device.type != "cuda":
            raise TransferError("CUDA IPC copies from device memory only")
        if not region.pid or not region.host or region.host != host_identity():
            raise TransferError("the peer is not a process of this host")
        if region.pid == os.getpid():
            raise TransferError("a CUDA IPC handle cannot be opened by the process that made it")
        try:
            spec = msgspec.msgpack.decode(region.cuda_ipc, type=_Export)
        except msgspec.DecodeError as exc:
            raise TransferError(f"malformed CUDA IPC export: {exc}") from exc
        if spec.nbytes != region.length:
            raise TransferError(f"CUDA IPC export of {spec.nbytes} bytes for a {region.length}-byte region")
        device = _local_device(spec.device_uuid)
        if device is None:
            raise TransferError(f"the peer's GPU {spec.device_uuid} is not visible here")
        pidfd = open_pidfd(region.pid)
        try:
            with torch.cuda.device(device):
                remote = _open_remote(spec, device)
        except RuntimeError as exc:
            if pidfd is not None:
                os.close(pidfd)
            raise TransferError(f"opening the peer's CUDA IPC handle: {exc}") from exc
        return cls(remote, local, region.pid, pidfd)

    def _alive(self) -> bool:
        return not self._closed and pidfd_alive(self._pidfd)

    def _check_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        base = local - self._local_address
        for src, dst, nbytes in runs:
            if offset + dst < 0 or offset + dst + nbytes > self.length:
                raise ValueError(
                    f"a run of {nbytes} bytes at {offset + dst} is outside the {self.length}-byte region"
                )
            if base + src < 0 or base + src + nbytes > self._local_bytes:
                raise ValueError(f"a run of {nbytes} bytes at {base + src} is outside the local tensor")
        if not self._alive():  # (a cheap pidfd poll: no copy starts into a peer known to be dead)
            raise PeerDiedError(f"peer process {self._pid} has exited")

    def write_runs(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        """Enqueue a copy of each run ``(source, destination, nbytes)``: from ``local + source`` (an
        address inside this writer's local tensor) to ``offset + destination`` bytes into the region."""
        self._check_runs(local, offset, runs)
        rt = self._rt
        if rt is not None:
            remote = self._remote_address + offset

            def copy(stream: int) -> None:
                for src, dst, n in runs:
                    rt.check(rt.memcpy(remote + dst, local + src, n, _MEMCPY_DEFAULT, stream), "memcpy")

            self._enqueue(copy)
            return
        self._torch_copy(local, offset, runs)

    def write_layers(
        self,
        local: int,
        local_stride: int,
        offset: int,
        remote_stride: int,
        count: int,
        runs: Sequence[tuple[int, int, int]],
    ) -> None:
        """``count`` layers' runs with one 2D copy per run (rows: the layers), where the strides fit a
        2D copy's pitch; else a call per layer."""
        rt = self._rt
        fits = all(n <= min(local_stride, remote_stride) for _, _, n in runs)
        if rt is None or count == 1 or not fits or max(local_stride, remote_stride) > self._max_pitch:
            for i in range(count):
                self.write_runs(local + i * local_stride, offset + i * remote_stride, runs)
            return
        self._check_runs(local, offset, runs)  # the first layer and the last bound every one between
        self._check_runs(local + (count - 1) * local_stride, offset + (count - 1) * remote_stride, runs)
        remote = self._remote_address + offset

        def copy(stream: int) -> None:
            for src, dst, n in runs:
                to, at = remote + dst, local + src
                rc = rt.memcpy2d(to, remote_stride, at, local_stride, n, count, _MEMCPY_DEFAULT, stream)
                rt.check(rc, "2D memcpy")

        self._enqueue(copy)

    def _enqueue(self, copies: Callable[[int], None]) -> None:
        """Run ``copies(stream)`` (the runtime's copy calls) and record the event after them, on the
        calling thread's current stream: the forward's, so the copies follow its writes."""
        rt = self._rt
        assert rt is not None
        stream = _current_stream(self._device_index)
        rt.on_device(self._device_index)
        with self._lock:
            if self._closed:  # (close takes the lock: no copy starts into a mapping being closed)
                raise PeerDiedError(f"the connection to peer process {self._pid} is closed")
            copies(stream)
            rt.check(rt.event_record(self._event, stream), "event record")
            self._recorded = True

    def _torch_copy(self, local: int, offset: int, runs: Sequence[tuple[int, int, int]]) -> None:
        base = local - self._local_address
        with self._lock, torch.cuda.device(self._local.device):
            if self._closed:
                raise PeerDiedError(f"the connection to peer process {self._pid} is closed")
            for src, dst, nbytes in runs:
                a, b = offset + dst, base + src
                self._remote[a : a + nbytes].copy_(self._local[b : b + nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._last = event

    def check(self) -> TransferError | None:
        """Whether the peer is still there (the copies' own state: ``flush``)."""
        return None if self._alive() else PeerDiedError(f"peer process {self._pid} has exited")

    def flush(self, on_done: Callable[[TransferError | None], None]) -> None:
        """``on_done`` on the loop once every copy enqueued so far has finished: at once, inside this
        call, when they already have (a request's copies commonly take less GPU time than the Python
        between the last push and here), else from a later loop iteration."""
        loop = asyncio.get_running_loop()
        with self._lock:
            event = self._last
        rt = self._rt
        spin_until = time.perf_counter() + _SPIN_S

        def poll() -> None:
            if rt is not None:
                rc = rt.event_query(self._event) if self._recorded and self._event else 0
                if rc not in (0, _NOT_READY):
                    on_done(TransferError(f"CUDA IPC copies failed with error {rc}"))
                    return
                done = rc == 0
            else:
                done = event is None or event.query()
            if done:
                on_done(self.check())
            elif time.perf_counter() < spin_until:
                loop.call_soon(poll)  # other callbacks run in between
            else:
                loop.call_later(_POLL_S, poll)

        poll()

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:  # no write_runs is between its copies and its record, and none starts after
            self._closed = True
            event = self._last
            if self._rt is not None and self._event:
                if self._recorded:
                    self._rt.event_sync(self._event)  # no copy into the mapping is in flight when it goes
                self._rt.event_destroy(self._event)
                self._event = 0
            if event is not None:
                event.synchronize()  # no copy into the mapping is in flight when it goes
            self._remote = torch.empty(0, dtype=torch.uint8)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
