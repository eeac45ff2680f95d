"""Plain copies into a peer's KV cache in shared memory (``kv_transfer/writers/shm.py``), and the
cache itself (``engine.hugepages.SharedTensor``). The peer is a child process holding a memfd; it is
killed by the fixture, even when a test fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.wire import RemoteRegion
from pdserve.kv_transfer.writers import cma, shm

SIZE = 1 << 20

# Holds a memfd of SIZE bytes, says its pid and fd, then answers each line on stdin with its checksum.
_CHILD = """
import mmap, os, sys, zlib
size = int(sys.argv[1])
fd = os.memfd_create("kv", 0)
os.ftruncate(fd, size)
m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
print(os.getpid(), fd, flush=True)
for _ in sys.stdin:
    print(zlib.crc32(m[:]), flush=True)
"""

pytestmark = pytest.mark.skipif(not cma.host_identity(), reason="no /proc here: no same-host writers")


class Child:
    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        pid, fd = self.proc.stdout.readline().split()
        assert int(pid) == self.proc.pid
        self.fd = int(fd)

    def region(self, **kw: object) -> RemoteRegion:
        fields: dict = {"key": b"", "base": 1, "length": self.size, "layer_bytes": 0, "shm_fd": self.fd}
        fields.update(pid=self.proc.pid, host=cma.host_identity())
        fields.update(kw)
        return RemoteRegion(**fields)

    def checksum(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child()
    try:
        yield c
    finally:
        c.proc.kill()
        c.proc.wait(timeout=10)


def test_runs_and_layers_land_in_the_peers_shared_memory(child: Child) -> None:
    writer = shm.ShmWriter.open(child.region())
    src = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8)
    runs = [(0, 50_000, 4096), (4096, 0, 100), (10_000, SIZE - 1777, 777)]
    writer.write_runs(src.ctypes.data, 1000, runs)
    expect = bytearray(SIZE)
    for s, d, n in runs:
        expect[1000 + d : 1000 + d + n] = src[s : s + n].tobytes()
    assert child.checksum() == zlib.crc32(bytes(expect))
    layer_runs = [(0, 0, 5000), (6000, 9000, 3000)]  # three layers at strides 100,000 / 200,000
    writer.write_layers(src.ctypes.data, 100_000, 300_000, 200_000, 3, layer_runs)
    for i in range(3):
        for s, d, n in layer_runs:
            at = 300_000 + i * 200_000 + d
            expect[at : at + n] = src[i * 100_000 + s : i * 100_000 + s + n].tobytes()
    assert child.checksum() == zlib.crc32(bytes(expect))
    with pytest.raises(ValueError, match="outside"):  # nothing written past the region's end
        writer.write_runs(src.ctypes.data, 0, [(0, SIZE - 10, 100)])
    assert writer.check() is None
    writer.close()
    with pytest.raises(PeerDiedError, match="is closed"):  # a closed writer copies nothing
        writer.write_runs(src.ctypes.data, 0, [(0, 0, 10)])
    # ... and says so: the peer has not exited (it was reported as exited while it kept serving)
    assert "is closed" in str(writer.check()) and child.proc.poll() is None
    writer.close()  # twice: nothing more


def test_a_dead_peer_is_reported_and_never_crashes_a_write(child: Child) -> None:
    writer = shm.ShmWriter.open(child.region())
    child.proc.kill()
    child.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while writer.check() is None:  # the pidfd reads ready once it has exited
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert isinstance(writer.check(), PeerDiedError) and "has exited" in str(writer.check())
    src = np.ones(4096, dtype=np.uint8)
    writer.write_runs(src.ctypes.data, 0, [(0, 0, 4096)])  # the mapping outlives it: lands nowhere read
    writer.close()


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split(" ", 1)[0] and int(line.split("-", 1)[0], 16) == address:
            rss = next(x for x in lines[i + 1 :] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)


def test_the_mapping_is_populated_off_the_opening_thread_and_left_unchanged(child: Child) -> None:
    """open returns without touching the pages (a large cache took 0.08 s a GiB on the caller's event
    loop); a thread faults them in without changing a byte."""
    before = child.checksum()
    writer = shm.ShmWriter.open(child.region())
    try:
        assert writer.populated.wait(10)
        assert child.checksum() == before
        if _kernel_at_least(5, 14):  # MADV_POPULATE_WRITE
            assert _resident_bytes(writer._base) == SIZE
    finally:
        writer.close()


def test_closing_while_the_pages_are_populated_stops_the_thread() -> None:
    big = Child(size=256 << 20)  # four chunks of 64 MiB
    try:
        writer = shm.ShmWriter.open(big.region())
        writer.close()  # waits for at most the chunk being populated
        assert writer.populated.wait(10)
        with pytest.raises(PeerDiedError, match="closed"):
            writer.write_runs(0, 0, [(0, 0, 1)])
    finally:
        big.proc.kill()
        big.proc.wait(timeout=10)


def test_open_refuses_what_it_cannot_map(child: Child) -> None:
    with pytest.raises(TransferError, match="no shared KV cache"):
        shm.ShmWriter.open(child.region(shm_fd=-1))
    with pytest.raises(TransferError, match="not a process of this host"):
        shm.ShmWriter.open(child.region(host="another-boot:1"))
    with pytest.raises(TransferError, match="opening the shared KV cache"):
        shm.ShmWriter.open(child.region(shm_fd=999))  # no such descriptor in the peer
    with pytest.raises(TransferError, match="has 1048576 bytes"):
        shm.ShmWriter.open(child.region(length=2 * SIZE))  # a region larger than the memfd
