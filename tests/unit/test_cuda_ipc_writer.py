"""``CudaIpcWriter``'s host side without a GPU: which runtime copies it enqueues for a layer
(``write_runs``) and for layers pushed together (``write_layers``: one 2D copy per run, or a copy per
layer where a pitch is past the device's limit), their bounds, and a closed writer. A stand-in runtime
copies host memory with ``memmove``, so the bytes that land are checked too; the real runtime's copies
are checked on the GPU machine (``tests/e2e/test_kv_transfer_cuda.py``)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from pdserve.kv_transfer.errors import PeerDiedError
from pdserve.kv_transfer.writers import cuda_ipc


class FakeRuntime:
    """The ``_Cudart`` calls the writer makes, on host memory, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def memcpy(self, dst: int, src: int, n: int, kind: int, stream: int) -> int:
        self.calls.append(("memcpy", (n,)))
        ctypes.memmove(dst, src, n)
        return 0

    def memcpy2d(
        self, dst: int, dpitch: int, src: int, spitch: int, w: int, h: int, kind: int, s: int
    ) -> int:
        self.calls.append(("memcpy2d", (w, h)))
        assert w <= dpitch and w <= spitch
        for row in range(h):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, w)
        return 0

    def event_record(self, event: int, stream: int) -> int:
        self.calls.append(("record", ()))
        return 0

    def on_device(self, index: int) -> None:
        pass

    def check(self, rc: int, what: str) -> None:
        assert rc == 0, what


def _writer(local: torch.Tensor, remote: torch.Tensor, max_pitch: int) -> cuda_ipc.CudaIpcWriter:
    w = object.__new__(cuda_ipc.CudaIpcWriter)  # no CUDA here: the fields __init__ would set
    w._remote, w._local = remote, local
    w._local_address, w._remote_address = local.data_ptr(), remote.data_ptr()
    w._local_bytes, w.length = local.numel(), remote.numel()
    w._pid, w._pidfd, w._closed, w._last = 0, None, False, None
    w._lock = threading.Lock()
    w._rt = FakeRuntime()  # type: ignore[assignment]
    w._device_index, w._event, w._max_pitch, w._recorded = 0, 1, max_pitch, False
    return w


@pytest.fixture(autouse=True)
def _no_cuda_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ipc, "_current_stream", lambda index: 0)


LAYERS, SRC_STRIDE, DST_STRIDE = 5, 4096, 6000
RUNS = [(0, 1000, 512), (1024, 0, 100), (2048, 3000, 2000)]  # (source, destination, bytes) in a layer


def _expected(src: torch.Tensor, first: int, count: int, start: int) -> torch.Tensor:
    want = torch.zeros(LAYERS * DST_STRIDE + 100, dtype=torch.uint8)
    for i in range(first, first + count):
        for s, d, n in RUNS:
            at = start + i * DST_STRIDE + d
            want[at : at + n] = src[i * SRC_STRIDE + s : i * SRC_STRIDE + s + n]
    return want


@pytest.mark.parametrize(
    ("max_pitch", "calls"),
    [
        (1 << 20, [("memcpy2d", (n, 4)) for _, _, n in RUNS]),
        (5000, [("memcpy", (n,)) for _, _, n in RUNS] * 4),
    ],
    ids=["2d", "pitch-past-the-limit"],
)
def test_layers_pushed_together_take_one_2d_copy_per_run(max_pitch: int, calls: list[object]) -> None:
    src = torch.randint(0, 256, (LAYERS * SRC_STRIDE,), dtype=torch.uint8)
    dst = torch.zeros(LAYERS * DST_STRIDE + 100, dtype=torch.uint8)
    w = _writer(src, dst, max_pitch)
    rt = w._rt
    assert isinstance(rt, FakeRuntime)
    # layers 1 .. 4 of a request whose first layer starts 100 bytes into the region
    w.write_layers(src.data_ptr() + SRC_STRIDE, SRC_STRIDE, 100 + DST_STRIDE, DST_STRIDE, 4, RUNS)
    assert torch.equal(dst, _expected(src, 1, 4, 100))
    copies = [c for c in rt.calls if c[0] != "record"]
    assert copies == calls
    assert rt.calls[-1][0] == "record" and w._recorded  # what flush waits for, after the copies


def test_one_layer_and_the_bounds() -> None:
    src = torch.randint(0, 256, (LAYERS * SRC_STRIDE,), dtype=torch.uint8)
    dst = torch.zeros(LAYERS * DST_STRIDE + 100, dtype=torch.uint8)
    w = _writer(src, dst, 1 << 20)
    w.write_layers(src.data_ptr(), SRC_STRIDE, 100, DST_STRIDE, 1, RUNS)  # one layer: plain copies
    assert [c[0] for c in w._rt.calls] == ["memcpy"] * 3 + ["record"]  # type: ignore[attr-defined]
    assert torch.equal(dst, _expected(src, 0, 1, 100))
    with pytest.raises(ValueError, match="outside the"):  # the last layer would pass the region's end
        w.write_layers(src.data_ptr(), SRC_STRIDE, 100 + DST_STRIDE, DST_STRIDE, LAYERS, RUNS)
    with pytest.raises(ValueError, match="local tensor"):  # or the local tensor's
        w.write_layers(src.data_ptr() + SRC_STRIDE, SRC_STRIDE, 100, DST_STRIDE, LAYERS, RUNS)
    w._closed = True
    with pytest.raises(PeerDiedError):
        w.write_layers(src.data_ptr(), SRC_STRIDE, 100, DST_STRIDE, 2, RUNS)


def test_flush_checks_the_event_on_every_loop_iteration_until_the_copies_are_done() -> None:
    """The copies of a request take tens of microseconds of GPU time: ``flush`` re-checks its event on the
    loop's next iterations rather than on a timer (at least a millisecond: the loop's epoll resolution)."""
    import asyncio

    src = torch.zeros(LAYERS * SRC_STRIDE, dtype=torch.uint8)
    w = _writer(src, torch.zeros(LAYERS * DST_STRIDE, dtype=torch.uint8), 1 << 20)
    rt = w._rt
    assert isinstance(rt, FakeRuntime)
    answers = [cuda_ipc._NOT_READY] * 5 + [0]
    rt.event_query = lambda event: answers.pop(0)  # type: ignore[attr-defined]
    w.write_runs(src.data_ptr(), 0, RUNS)

    async def main() -> object:
        done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        w.flush(done.set_result)
        return await asyncio.wait_for(done, 5)

    assert asyncio.run(main()) is None and answers == []  # landed, after six looks at the event
    answers.extend([cuda_ipc._NOT_READY, 719])  # a failed copy (e.g. cudaErrorLaunchFailure) is reported
    err = asyncio.run(main())
    assert isinstance(err, Exception) and "719" in str(err)


def test_flush_reports_copies_already_done_inside_the_call() -> None:
    """Copies that are done by the time ``complete`` flushes (the usual case: tens of microseconds of GPU
    time) are reported inside ``flush`` itself, so Complete goes out without waiting a loop iteration."""
    import asyncio

    src = torch.zeros(LAYERS * SRC_STRIDE, dtype=torch.uint8)
    w = _writer(src, torch.zeros(LAYERS * DST_STRIDE, dtype=torch.uint8), 1 << 20)
    rt = w._rt
    assert isinstance(rt, FakeRuntime)
    rt.event_query = lambda event: 0  # type: ignore[attr-defined]
    w.write_runs(src.data_ptr(), 0, RUNS)
    got: list[object] = []

    async def main() -> None:
        w.flush(got.append)
        assert got == [None]  # before any await

    asyncio.run(main())
