"""Plain copies into a peer's KV cache in shared memory (``kv_transfer/transports/shm.py``), and the
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
import torch

from pdserve.engine.hugepages import SharedTensor, shared_memory_huge_pages
from pdserve.kv_transfer.errors import PeerDiedError, TransferError
from pdserve.kv_transfer.transports import cma, shm
from pdserve.kv_transfer.wire import RemoteRegion

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


def test_a_shared_tensor_is_zeroed_and_seen_through_its_memfd() -> None:
    t = SharedTensor(4, 8, 16, dtype=torch.bfloat16)
    assert t.tensor.shape == (4, 8, 16) and t.tensor.dtype == torch.bfloat16
    assert not t.tensor.any() and t.nbytes == 4 * 8 * 16 * 2
    assert os.readlink(f"/proc/self/fd/{t.fd}").startswith("/memfd:pdserve-kv")
    assert t.huge == (t.huge and shared_memory_huge_pages())  # advised only where the kernel allows it
    t.tensor[1, 2, 3] = 1.5
    with open(f"/proc/self/fd/{t.fd}", "rb") as f:  # what a peer mapping the memfd sees
        raw = f.read()
    seen = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(4, 8, 16)
    assert seen[1, 2, 3].item() == 1.5 and int(seen.count_nonzero()) == 1
    with pytest.raises(ValueError):
        SharedTensor(0, 4, dtype=torch.float32)


def test_a_runner_with_its_kv_cache_in_shared_memory_computes_the_same(tiny_llama_dir) -> None:
    from pdserve.engine.model_runner import ModelRunner, PrefillItem

    plain = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=4)
    shared = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=4, kv_shared=True)
    assert plain.kv_shared_fd is None and shared.kv_shared_fd is not None
    item = [PrefillItem(list(range(3, 20)), list(range(5)))]
    torch.testing.assert_close(shared.prefill(item), plain.prefill(item), rtol=0, atol=0)
    torch.testing.assert_close(shared.kv, plain.kv, rtol=0, atol=0)


def test_the_step_benchmark_times_both_caches(tiny_llama_dir) -> None:
    """``bench.kv_shared_steps`` (the price of --kv-shared-memory), on a tiny model."""
    from pdserve.bench import kv_shared_steps

    tiny = str(tiny_llama_dir)
    report = kv_shared_steps.measure(tiny, batch=2, prompt_len=8, dtype=torch.float32, rounds=1)
    assert set(report["step_ms"]) == {"anonymous", "shared"}
    assert all(len(v) == 1 and v[0] > 0 for v in report["step_ms"].values())
    assert report["shared_over_anonymous"] > 0
