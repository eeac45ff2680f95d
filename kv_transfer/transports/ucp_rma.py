"""A ctypes binding of the few libucp calls ucxx's Python API lacks: memory registration, remote keys,
one-sided puts and endpoint queries. Requests the event loop waits for (control frames, flushes) are
ucp_tag.py's.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Any

from pdserve.kv_transfer.errors import PeerDiedError, TransferError

# ucp.h / ucs/type/status.h constants (UCX >= 1.14 ABI; the wheel pins the library).
_MEM_MAP_FIELD_ADDRESS = 1 << 0
_MEM_MAP_FIELD_LENGTH = 1 << 1
_MEM_MAP_FIELD_FLAGS = 1 << 2
_MEM_MAP_FIELD_MEMORY_TYPE = 1 << 4
_MEM_MAP_ALLOCATE = 1 << 1
OP_ATTR_FIELD_CALLBACK = 1 << 1
OP_ATTR_FIELD_USER_DATA = 1 << 2
UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
MEMORY_TYPE_HOST = 0
MEMORY_TYPE_CUDA = 1


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


SendCallback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)


class _MemAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("mem_type", ctypes.c_int),
    ]


def _request_param_fields(callback: Any) -> list[tuple[str, Any]]:
    """``ucp_request_param_t``'s fields; ``cb`` is a union of callback pointers, typed as the one set."""
    vp = ctypes.c_void_p
    return [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", vp),
        ("cb", callback),
        ("datatype", ctypes.c_uint64),
        ("user_data", vp),
        ("reply_buffer", vp),
        ("memory_type", ctypes.c_int),
        ("recv_info", vp),
        ("memh", vp),
    ]


class RequestParam(ctypes.Structure):
    """For sends, puts and flushes."""

    _fields_ = _request_param_fields(SendCallback)


class TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


RecvCallback = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(TagRecvInfo), ctypes.c_void_p
)


class RecvRequestParam(ctypes.Structure):
    """For tagged receives."""

    _fields_ = _request_param_fields(RecvCallback)


class _TransportEntry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [
        ("entries", ctypes.POINTER(_TransportEntry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    ]


class _EpAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * 32),  # UCP_ENTITY_NAME_MAX
        ("local_sockaddr", ctypes.c_uint64 * 16),  # struct sockaddr_storage: 128 bytes, 8-aligned
        ("remote_sockaddr", ctypes.c_uint64 * 16),
        ("transports", _Transports),
        ("user_data", ctypes.c_void_p),
    ]


_EP_ATTR_FIELD_TRANSPORTS = 1 << 3


def endpoint_transports(ep: int) -> list[tuple[str, str]]:
    """(transport, device) of each lane of endpoint ``ep`` (``ucp_ep_query``); [] if UCX cannot say."""
    entries = (_TransportEntry * 32)()
    attr = _EpAttr()
    attr.field_mask = _EP_ATTR_FIELD_TRANSPORTS
    attr.transports.entries = entries
    attr.transports.num_entries = len(entries)
    attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
    if lib().ep_query is None or lib().ep_query(ep, ctypes.byref(attr)) != UCS_OK:
        return []
    lanes = entries[: min(attr.transports.num_entries, len(entries))]
    return [((e.transport_name or b"").decode(), (e.device_name or b"").decode()) for e in lanes]


def status_of(ptr: int | None) -> int:
    """``UCS_PTR_STATUS``: UCS_OK for NULL, the (negative) error for an error pointer,
    UCS_INPROGRESS for a request."""
    if not ptr:
        return UCS_OK
    if ptr >= (1 << 64) + _UCS_ERR_LAST:
        return ptr - (1 << 64)
    return UCS_INPROGRESS


class _Lib:
    """libucp's functions. ctypes over the copy ucxx already loaded, not a compiled extension: nothing to
    build at first use, and a put is one foreign call. ucxx creates its worker thread-safe
    (``UCS_THREAD_MODE_MULTI``), so calls from the event loop thread may run beside its progress thread."""

    def __init__(self) -> None:
        import libucx  # the wheel ucxx loads libucp from; the same soname resolves to the same copy

        path = Path(libucx.__file__).parent / "lib" / "libucp.so"
        lib = ctypes.CDLL(os.fspath(path), mode=ctypes.RTLD_GLOBAL)
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.mem_map = _fn(lib.ucp_mem_map, i32, [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)])
        self.mem_query = _fn(lib.ucp_mem_query, i32, [vp, ctypes.POINTER(_MemAttr)])
        self.mem_unmap = _fn(lib.ucp_mem_unmap, i32, [vp, vp])
        self.rkey_pack = _fn(lib.ucp_rkey_pack, i32, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)])
        self.rkey_buffer_release = _fn(lib.ucp_rkey_buffer_release, None, [vp])
        self.ep_rkey_unpack = _fn(lib.ucp_ep_rkey_unpack, i32, [vp, ctypes.c_char_p, ctypes.POINTER(vp)])
        self.rkey_destroy = _fn(lib.ucp_rkey_destroy, None, [vp])
        self.put_nbx = _fn(
            lib.ucp_put_nbx, vp, [vp, vp, sz, ctypes.c_uint64, vp, ctypes.POINTER(RequestParam)]
        )
        self.ep_flush_nbx = _fn(lib.ucp_ep_flush_nbx, vp, [vp, ctypes.POINTER(RequestParam)])
        self.request_free = _fn(lib.ucp_request_free, None, [vp])
        # Tagged messages (ucp_tag.py): the control frames' fast path.
        self.tag_send_nbx = _fn(
            lib.ucp_tag_send_nbx, vp, [vp, vp, sz, ctypes.c_uint64, ctypes.POINTER(RequestParam)]
        )
        self.tag_recv_nbx = _fn(
            lib.ucp_tag_recv_nbx,
            vp,
            [vp, vp, sz, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(RecvRequestParam)],
        )
        self.request_cancel = _fn(lib.ucp_request_cancel, None, [vp, vp])
        self.worker_signal = _fn(lib.ucp_worker_signal, i32, [vp])
        self.ep_query: Any = _fn(lib.ucp_ep_query, i32, [vp, vp]) if hasattr(lib, "ucp_ep_query") else None
        self.status_string = (
            _fn(lib.ucs_status_string, ctypes.c_char_p, [i32]) if hasattr(lib, "ucs_status_string") else None
        )


def _fn(f: Any, restype: Any, argtypes: list[Any]) -> Any:
    f.restype, f.argtypes = restype, argtypes
    return f


@functools.cache
def lib() -> _Lib:
    return _Lib()


def status_text(status: int) -> str:
    fn = lib().status_string
    if fn is None:
        return f"UCS status {status}"
    return f"{fn(status).decode()} ({status})"


class Registration:
    """A memory region mapped with UCX for remote writes, and its packed remote key.

    ``allocate=True`` lets UCX allocate the region (``UCP_MEM_MAP_ALLOCATE``): memory
    that UCX itself can share with peers on this host (posix shared memory), where a
    caller's own memory is reachable only by cross-memory attach.
    """

    def __init__(
        self,
        context: int,
        address: int,
        length: int,
        memory_type: int = MEMORY_TYPE_HOST,
        *,
        allocate: bool = False,
    ) -> None:
        if length <= 0:
            raise ValueError("cannot register an empty region")
        self._context = context
        params = _MemMapParams()
        params.field_mask = _MEM_MAP_FIELD_LENGTH | _MEM_MAP_FIELD_MEMORY_TYPE
        params.length = length
        params.memory_type = memory_type
        if allocate:
            params.field_mask |= _MEM_MAP_FIELD_FLAGS
            params.flags = _MEM_MAP_ALLOCATE
        else:
            params.field_mask |= _MEM_MAP_FIELD_ADDRESS
            params.address = address
        memh = ctypes.c_void_p()
        status = lib().mem_map(context, ctypes.byref(params), ctypes.byref(memh))
        if status != UCS_OK:
            raise TransferError(f"ucp_mem_map of {length} bytes failed: {status_text(status)}")
        self._memh: int | None = memh.value
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        status = lib().rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size))
        if status != UCS_OK:
            self.close()
            raise TransferError(f"ucp_rkey_pack failed: {status_text(status)}")
        self.packed_rkey = ctypes.string_at(buf, size.value)
        lib().rkey_buffer_release(buf)
        self.length = length
        self.address = address
        if allocate:  # the region is UCX's: ask where it is
            attr = _MemAttr()
            attr.field_mask = 0b11  # UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH
            status = lib().mem_query(self._memh, ctypes.byref(attr))
            if status != UCS_OK or not attr.address or attr.length < length:
                self.close()
                raise TransferError(f"ucp_mem_query failed: {status_text(status)}")
            self.address = attr.address

    def close(self) -> None:
        if self._memh is not None:
            lib().mem_unmap(self._context, self._memh)
            self._memh = None

    def __del__(self) -> None:  # a forgotten registration must not pin memory past the context
        try:
            self.close()
        except Exception:
            pass


class RemoteKey:
    """A peer's remote key unpacked on one endpoint: puts into the peer's registered region."""

    def __init__(self, ep: int, packed: bytes, base_address: int, length: int) -> None:
        rkey = ctypes.c_void_p()
        status = lib().ep_rkey_unpack(ep, packed, ctypes.byref(rkey))
        if status != UCS_OK:
            raise TransferError(f"ucp_ep_rkey_unpack failed: {status_text(status)}")
        self._ep = ep
        self._rkey: int | None = rkey.value
        self.base = base_address
        self.length = length
        self._param = RequestParam()  # no callback: an unfinished put's request is freed at once

    def put(self, local_address: int, nbytes: int, offset: int) -> None:
        """Start writing ``nbytes`` from ``local_address`` at ``offset`` into the remote region.

        Fire and forget: a later :func:`flush` of the endpoint completes it, or fails.
        Raises PeerDiedError when UCX refuses the put at once (a broken endpoint).
        """
        if self._rkey is None:
            raise PeerDiedError("remote key already released")
        if offset < 0 or offset + nbytes > self.length:
            raise ValueError(f"put of {nbytes} bytes at {offset} outside the {self.length}-byte region")
        ptr = lib().put_nbx(self._ep, local_address, nbytes, self.base + offset, self._rkey, self._param)
        status = status_of(ptr)
        if status == UCS_INPROGRESS:
            lib().request_free(ptr)  # released by UCX once the put completes
        elif status != UCS_OK:
            raise PeerDiedError(f"put refused: {status_text(status)}")

    def close(self) -> None:
        if self._rkey is not None:
            lib().rkey_destroy(self._rkey)
            self._rkey = None
