"""engine.hugepages: the KV cache and the packed weights are advised onto transparent huge pages.

Whether Linux then backs a region with huge pages depends on free memory, so the tests check what is
deterministic: the advice was taken (``hg`` in the VmFlags of ``/proc/self/smaps`` for the tensor's mapping)
where the host's transparent huge pages are ``always`` or ``madvise``, and the values are right everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.cpu_kernels import kernel_cache_dir, load_cpu_kernels
from pdserve.engine.hugepages import HUGE_PAGE, HugePageArena, advise_huge_pages, zeros_huge_pages
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.weights import LinearKind

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_available = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="transparent huge pages are off (or not Linux) here",
)


def _thp_eligible(addr: int) -> bool:
    """Whether the mapping holding ``addr`` carries the huge-page advice: ``hg`` in its smaps VmFlags, which
    MADV_HUGEPAGE sets. (``THPeligible`` also weighs the kernel's momentary view and read 0 once for an
    advised mapping in a full suite run.)"""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"address {addr:#x} not found in /proc/self/smaps")


def _inner_page(t: torch.Tensor) -> int:
    """An address in the first whole huge page inside ``t``."""
    return (t.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)


def test_zeros_huge_pages_are_zeros() -> None:
    t = zeros_huge_pages(3, 1 << 20, dtype=torch.bfloat16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    small = zeros_huge_pages(5, dtype=torch.float32)  # smaller than a huge page: plain, still zeros
    assert not small.any() and not advise_huge_pages(small)


@thp_available
def test_zeros_huge_pages_advised() -> None:
    t = zeros_huge_pages(4 * HUGE_PAGE, dtype=torch.uint8)
    assert _thp_eligible(_inner_page(t))


def test_arena_views_are_aligned_disjoint_and_kept_alive() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    shapes = [
        ((3, 5), torch.float32),
        ((7,), torch.bfloat16),
        ((1000, 300), torch.int8),
        ((11, 2), torch.int64),
    ]
    views = [arena.empty(shape, dtype) for shape, dtype in shapes]
    spans = []
    for v, (shape, dtype) in zip(views, shapes, strict=True):
        assert tuple(v.shape) == shape and v.dtype == dtype and v.is_contiguous()
        assert v.data_ptr() % HugePageArena.ALIGN == 0
        spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    big = arena.empty((3 * HUGE_PAGE,), torch.uint8)  # larger than a chunk: a chunk of its own
    assert big.numel() == 3 * HUGE_PAGE
    for i, v in enumerate(views):
        v.fill_(i + 1)
    big.fill_(9)
    del arena  # the views hold their chunks
    for i, v in enumerate(views):
        assert bool((v == i + 1).all())
    assert bool((big == 9).all())


def test_arena_rejects_a_chunk_below_a_huge_page() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        HugePageArena(chunk_bytes=4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_into_an_arena_equals_plain_pack(dtype: torch.dtype) -> None:
    kernels = load_cpu_kernels(kernel_cache_dir())
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels are not built here")
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    arena = HugePageArena()
    assert torch.equal(kernels.pack_linear_weight(w, arena.empty), kernels.pack_linear_weight(w))
    with pytest.raises(ValueError, match="alloc gave"):
        kernels.pack_linear_weight(w, lambda shape, dt: torch.empty(3, dtype=dt))


@thp_available
def test_runner_kv_cache_and_packed_weights_are_advised(tiny_llama_dir) -> None:
    runner = ModelRunner(tiny_llama_dir, block_size=16, num_blocks=512)
    kv = runner.kv
    assert kv.numel() * kv.element_size() >= 2 * HUGE_PAGE, "the test needs a KV cache of whole huge pages"
    assert _thp_eligible(_inner_page(kv))
    lin = runner.weights.layers[0].qkv
    if lin.kind is LinearKind.PANELS:  # packed into the weights' arena, whose chunks are advised
        assert _thp_eligible(lin.weight.data_ptr())
