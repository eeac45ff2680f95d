"""CPU tensors backed by transparent huge pages (2 MiB), for the big arrays a step streams through.

torch's CPU allocator leaves large tensors on 4 KiB pages; the KV cache and packed weights, read end to
end every step, then miss the TLB every 4 KiB and UCX moves them more slowly. Linux only, where THP is
``always`` or ``madvise``; elsewhere plain allocations. Advice must precede a page's first touch.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading

import torch

__all__ = [
    "HUGE_PAGE",
    "HugePageArena",
    "SharedTensor",
    "advise_huge_pages",
    "shared_memory_huge_pages",
    "zeros_huge_pages",
]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise_huge(start: int, end: int) -> bool:
    """Advise the whole huge pages inside ``[start, end)``; False when there are none or Linux refused."""
    first, last = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), end & ~(HUGE_PAGE - 1)
    if last <= first or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE) == 0


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor with transparent huge pages; call before first touch.

    Returns False where it does not apply (not Linux, not CPU, no whole huge page inside the tensor, or the
    kernel refused)."""
    if t.device.type != "cpu":
        return False
    start = t.data_ptr()
    return _madvise_huge(start, start + t.numel() * t.element_size())


def zeros_huge_pages(*size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(*size, dtype=dtype, device=device)``, backed by huge pages on CPU.

    Advised before the zeroing touches any page (``torch.zeros`` touches them first, after which the advice
    comes too late). Other devices: plain ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*size, dtype=dtype, device=device)
    t = torch.empty(*size, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()


_SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shared_memory_huge_pages() -> bool:
    """Whether shared memory (a memfd) may get transparent huge pages when advised: ``shmem_enabled``
    is ``always``, ``within_size``, ``advise`` or ``force`` (many distributions default to ``never``)."""
    try:
        with open(_SHMEM_THP) as f:
            text = f.read()
    except OSError:
        return False
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen in ("always", "within_size", "advise", "force")


class SharedTensor:
    """A zeroed CPU tensor in shared memory (a memfd), which another process of this host may map (by
    ``/proc/<pid>/fd/<fd>``, under the kernel's ptrace rule) and write with plain copies: the decode
    worker's KV cache for a same-host prefill worker (kv_transfer/writers/shm.py). ``fd`` stays open
    (close-on-exec) as long as this object lives; ``huge``: whether the pages were advised onto huge pages
    (``shared_memory_huge_pages``)."""

    def __init__(self, *size: int, dtype: torch.dtype, fd: int | None = None) -> None:
        """A new memfd of ``size``; or, with ``fd``, a mapping of that existing memfd of another process's
        ``SharedTensor`` (this object then owns ``fd``)."""
        import mmap
        import os

        nbytes = math.prod(size) * dtype.itemsize
        if nbytes <= 0:
            raise ValueError(f"a shared tensor needs a positive size, got {size}")
        fresh = fd is None
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC) if fd is None else fd
        try:
            if fresh:
                os.ftruncate(self.fd, nbytes)
            elif (held := os.fstat(self.fd).st_size) != nbytes:
                raise ValueError(f"the shared tensor's memfd holds {held} bytes, not {nbytes}")
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        flat = torch.frombuffer(self._map, dtype=torch.uint8)  # a fresh memfd reads as zeros
        self.huge = shared_memory_huge_pages() and _madvise_huge(flat.data_ptr(), flat.data_ptr() + nbytes)
        if fresh:
            flat[:: HUGE_PAGE if self.huge else 4096].zero_()  # touched now, after the advice, not mid-step
        self.tensor = flat.view(dtype).view(size)


class HugePageArena:
    """Many mid-sized CPU tensors (a model's packed weights: most are under 2 MiB, too small to get a huge
    page each) carved out of large huge-page-advised chunks, 64-byte aligned, back to back.

    Tensors are views that keep their chunk alive; nothing is ever freed back to the arena (it holds what
    lives as long as the model). A chunk's unused tail is never touched, so it costs address space, not
    memory."""

    ALIGN = 64

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        if chunk_bytes < HUGE_PAGE:
            raise ValueError(f"HugePageArena: chunk_bytes must be >= {HUGE_PAGE}, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8, starts on a huge page boundary
        self._used = 0
        self._lock = threading.Lock()
        self.advised = True  # False once Linux refused the advice for a chunk

    def _new_chunk(self, nbytes: int) -> None:
        size = max(self.chunk_bytes, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
        off = (-raw.data_ptr()) % HUGE_PAGE
        self._chunk = raw[off : off + size]
        self.advised = advise_huge_pages(self._chunk) and self.advised
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` in the arena."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._new_chunk(nbytes)
            assert self._chunk is not None
            view = self._chunk[self._used : self._used + nbytes]
            self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return view.view(dtype).view(shape)
