"""Cross-memory writes (``kv_transfer/writers/cma.py``) into a child process's buffer.

The reason the module exists: a write into a peer that has died must be an error of that write, not
the end of the writing process (UCX's shared-memory endpoints abort the process). Every child is
killed by the fixture, even when a test fails.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers import cma

SIZE = 1 << 20

# Holds a buffer, says where it is, then answers each line on stdin with the buffer's checksum.
_CHILD = f"""
import ctypes, sys, zlib
buf = ctypes.create_string_buffer({SIZE})
print(ctypes.addressof(buf), flush=True)
for _ in sys.stdin:
    print(zlib.crc32(buf.raw), flush=True)
"""


class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.address = int(self.proc.stdout.readline())

    def region(self, **kw: object) -> RemoteRegion:
        fields: dict = {"key": b"", "base": self.address, "length": SIZE, "layer_bytes": 0}
        fields.update(pid=self.proc.pid, host=cma.host_identity())
        fields.update(kw)
        return RemoteRegion(**fields)

    def checksum(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child()
    try:
        yield c
    finally:
        c.proc.kill()
        c.proc.wait(timeout=10)


def test_writes_land_in_the_peer_at_the_offsets_given(child: Child) -> None:
    import zlib

    if not cma.host_identity():
        pytest.skip("no /proc here: cross-memory writes are off")
    writer = cma.CmaWriter.open(child.region())
    expect = bytearray(SIZE)
    rng = np.random.default_rng(0)
    for offset, n in ((0, 4096), (SIZE - 100, 100), (12345, 70000)):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        writer.put(data, offset)
        expect[offset : offset + n] = data.tobytes()
    assert child.checksum() == zlib.crc32(bytes(expect))
    with pytest.raises(ValueError):
        writer.put(np.zeros(2, np.uint8), SIZE - 1)  # past the region's end
    writer.close()


def test_a_dead_peer_is_an_error_of_the_write_not_of_the_writer(child: Child) -> None:
    if not cma.host_identity():
        pytest.skip("no /proc here: cross-memory writes are off")
    writer = cma.CmaWriter.open(child.region())
    writer.put(np.ones(4096, np.uint8), 0)
    child.kill()
    deadline = time.monotonic() + 10
    while child.proc.poll() is None:  # killed; reaped or not, the next write must fail cleanly
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(PeerDiedError):
        for _ in range(100):
            writer.put(np.ones(SIZE, np.uint8), 0)
    writer.close()


def test_open_refuses_another_host_and_a_missing_process(child: Child) -> None:
    with pytest.raises(TransferError, match="not a process of this host"):
        cma.CmaWriter.open(child.region(host="another-boot:1"))
    with pytest.raises(TransferError, match="not a process of this host"):
        cma.CmaWriter.open(child.region(pid=0))
    if not cma.host_identity():
        return
    child.kill()
    child.proc.wait(timeout=10)  # reaped: the pid names nothing now
    with pytest.raises(TransferError):
        cma.CmaWriter.open(child.region())


@pytest.mark.parametrize("max_iov", [1024, 2], ids=["one-call", "in-groups"])
def test_write_runs_lands_every_run_at_its_offset(
    child: Child, max_iov: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's scattered runs go in one vectored call; past the kernel's iovec limit, in groups."""
    import zlib

    if not cma.host_identity():
        pytest.skip("no /proc here: cross-memory writes are off")
    monkeypatch.setattr(cma, "_MAX_IOV", max_iov)
    writer = cma.CmaWriter.open(child.region())
    src = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8)
    # (source offset, destination offset, length): out of order, of uneven sizes, one at the region's end
    runs = [(0, 50_000, 4096), (4096, 0, 100), (10_000, SIZE - 1777, 777), (20_000, 9_000, 150_000)]
    writer.write_runs(src.ctypes.data, 1000, runs)  # 1000: where the layer starts in the region
    expect = bytearray(SIZE)
    for s, d, n in runs:
        expect[1000 + d : 1000 + d + n] = src[s : s + n].tobytes()
    assert child.checksum() == zlib.crc32(bytes(expect))
    with pytest.raises(ValueError):  # one run past the region's end: nothing is written
        writer.write_runs(src.ctypes.data, 0, [(0, 0, 10), (0, SIZE - 50, 100)])
    assert child.checksum() == zlib.crc32(bytes(expect))
    writer.close()


@pytest.mark.parametrize(
    ("max_iov", "max_write"),
    [(1024, 1 << 30), (4, 1 << 30), (1024, 5000)],
    ids=["one-call", "iovecs", "bytes"],
)
def test_write_layers_lands_every_run_of_every_layer(
    child: Child, max_iov: int, max_write: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several layers at once (a CUDA-graph prefill's push): layer i's runs go from ``i * local_stride``
    to ``i * remote_stride``, in one call where the kernel's limits allow, else in groups (a run past
    the size limit in pieces)."""
    import zlib

    if not cma.host_identity():
        pytest.skip("no /proc here: cross-memory writes are off")
    monkeypatch.setattr(cma, "_MAX_IOV", max_iov)
    monkeypatch.setattr(cma, "_MAX_WRITE", max_write)
    writer = cma.CmaWriter.open(child.region())
    layers, local_stride, remote_stride, start = 3, 60_000, 100_000, 1000
    src = np.random.default_rng(2).integers(0, 256, layers * local_stride, dtype=np.uint8)
    runs = [(0, 20_000, 4096), (10_000, 0, 100), (30_000, 40_000, 20_000)]  # apart on both sides
    writer.write_layers(src.ctypes.data, local_stride, start, remote_stride, layers, runs)
    expect = bytearray(SIZE)
    for i in range(layers):
        for s, d, n in runs:
            at = start + i * remote_stride + d
            expect[at : at + n] = src[i * local_stride + s : i * local_stride + s + n].tobytes()
    assert child.checksum() == zlib.crc32(bytes(expect))
    writer.close()


def test_write_runs_reports_a_fault_after_the_runs_before_it_landed(child: Child) -> None:
    """The kernel stops a vectored write at a run it cannot reach: the runs before it land, and the
    rest are retried one by one, so the error says what went wrong."""
    import zlib

    if not cma.host_identity():
        pytest.skip("no /proc here: cross-memory writes are off")
    far = 1 << 40  # nothing is mapped a terabyte past a small heap buffer
    writer = cma.CmaWriter.open(child.region(length=far + SIZE))
    src = np.full(8192, 7, dtype=np.uint8)
    with pytest.raises(TransferError, match="write into peer process"):
        writer.write_runs(src.ctypes.data, 0, [(0, 0, 4096), (4096, far, 4096)])
    assert child.checksum() == zlib.crc32(bytes(src[:4096]) + bytes(SIZE - 4096))
    writer.close()


def test_the_direction_benchmark_times_both_directions_and_stops_its_peer() -> None:
    """``tools.cma_direction`` (why one-host writes are slower than UCX's reads on some kernels)."""
    if not cma.host_identity():
        pytest.skip("no /proc here: cross-memory writes are off")
    import multiprocessing

    from tools import cma_direction

    report = cma_direction.measure(layers=2, layer_bytes=64 << 10, reps=2)
    for direction in ("write", "read"):
        assert report[direction]["per_layer_ms"] > 0 and report[direction]["one_call_ms"] > 0
    assert report["per_layer_ratio"] > 0
    assert not multiprocessing.active_children()  # the peer holding the buffer is gone
