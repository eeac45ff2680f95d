"""The CUDA backend's Triton kernels against the torch path (engine.attention / engine.model.TorchStepOps).

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so CI checks
the kernels' indexing, masking and softmax on small shapes; on the GPU machine the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the CUDA backend's kernels)")

from pdserve.engine import triton_kernels as tk  # noqa: E402
from pdserve.engine.attention import (  # noqa: E402
    DecodeMeta,
    PrefillMeta,
    decode_attention,
    prefill_attention,
    write_kv,
)
from pdserve.engine.model import apply_rope, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B = 16  # block size


def _cache(n_blocks: int, h_kv: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_blocks, 2, B, h_kv, d, generator=g).to(DEVICE, dtype)  # one layer


def _tables(lens: list[int], n_blocks: int, seed: int = 1) -> list[list[int]]:
    """Disjoint, shuffled block tables covering each length."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    out, i = [], 0
    for n in lens:
        k = -(-n // B)
        out.append(perm[i : i + k])
        i += k
    return out


def _padded(tables: list[list[int]]) -> torch.Tensor:
    m = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (m - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_matches_the_torch_path(dtype, splits):
    h, h_kv, d = 6, 2, 16
    lens = [1, 17, 40, 5]
    n_blocks = 16
    kv = _cache(n_blocks, h_kv, d, dtype)
    tables = _tables(lens, n_blocks)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    meta = DecodeMeta.build(
        [(n - 1, t) for n, t in zip(lens, tables, strict=True)], B, n_blocks, torch.device(DEVICE)
    )
    want = decode_attention(kv, meta, q)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = tk.decode_attention(kv, q, _padded(tables), lens_t, splits=splits, block_n=16)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def test_decode_attention_padding_rows_give_zeros_and_touch_nothing():
    h, h_kv, d = 4, 4, 16
    kv = _cache(4, h_kv, d, torch.float32)
    q = torch.randn(3, h, d).to(DEVICE)
    tables = torch.tensor([[0, 1], [2, 0], [3, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 0, 3], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = tk.decode_attention(kv, q, tables, lens, splits=splits, block_n=16)
        assert torch.isfinite(out).all()
        assert out[1].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_the_torch_path_with_cached_prefixes(dtype):
    h, h_kv, d = 4, 2, 16
    # (new tokens, tokens already cached): a fresh prompt, chunks continuing a prefix, a one-token chunk.
    items = [(20, 0), (7, 16), (33, 5), (1, 40)]
    n_blocks = 24
    kv = _cache(n_blocks, h_kv, d, dtype)
    tables = _tables([n + s for n, s in items], n_blocks)
    t = sum(n for n, _ in items)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(t, h, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(t, h_kv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(t, h_kv, d, generator=g).to(DEVICE, dtype)
    meta = PrefillMeta.build(
        [(n, tab, s) for (n, s), tab in zip(items, tables, strict=True)], B, n_blocks, torch.device(DEVICE)
    )
    write_kv(kv, meta.k_rows, meta.v_rows, k, v)
    want = prefill_attention(kv, meta, q, k, v)
    cu = torch.tensor(
        [0] + list(torch.tensor([n for n, _ in items]).cumsum(0)), dtype=torch.int32, device=DEVICE
    )
    start = torch.tensor([s for _, s in items], dtype=torch.int32, device=DEVICE)
    got = tk.prefill_attention(
        kv, q, _padded(tables), cu, start, max(n for n, _ in items), block_m=16, block_n=16
    )
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_the_torch_path_and_skips_slot_minus_one(dtype):
    h, h_kv, d, p = 3, 1, 16, 64
    n_blocks = 4
    g = torch.Generator().manual_seed(4)
    cos = torch.randn(p, d, generator=g).to(DEVICE, dtype)
    sin = torch.randn(p, d, generator=g).to(DEVICE, dtype)
    qkv = torch.randn(5, (h + 2 * h_kv) * d, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 63, 2, 9], device=DEVICE)
    slots = torch.tensor([3, 17, 40, -1, 63], device=DEVICE)
    kv = torch.zeros(n_blocks, 2, B, h_kv, d, dtype=dtype, device=DEVICE)
    want_kv = kv.clone()

    qk = apply_rope(
        qkv[:, : (h + h_kv) * d].view(5, h + h_kv, d), cos[positions][:, None], sin[positions][:, None]
    )
    v = qkv[:, (h + h_kv) * d :].view(5, h_kv, d)
    keep = slots >= 0
    rows = (slots // B) * 2 * B + slots % B
    write_kv(want_kv, rows[keep], rows[keep] + B, qk[keep, h:], v[keep])

    got = qkv.clone()
    tk.rope_store(got, h, h_kv, d, cos, sin, positions, kv, slots)
    torch.testing.assert_close(got[:, : (h + h_kv) * d].view(5, h + h_kv, d), qk, **_tol(dtype))
    torch.testing.assert_close(got[:, (h + h_kv) * d :], qkv[:, (h + h_kv) * d :], atol=0, rtol=0)
    torch.testing.assert_close(kv, want_kv, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rms_norm_and_silu_mul_match_torch(dtype, with_res):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 48, generator=g).to(DEVICE, dtype)
    res = torch.randn(3, 48, generator=g).to(DEVICE, dtype) if with_res else None
    w = torch.randn(48, generator=g).to(DEVICE, dtype)
    want_x = x + res if with_res else x.clone()
    want = rms_norm(want_x, w, 1e-5)
    got_x = x.clone()
    got = tk.add_rms_norm(got_x, res, w, 1e-5)
    # float32: the same add; bf16: the interpreter's rounding to bf16 may differ by an ulp from the GPU's.
    torch.testing.assert_close(
        got_x, want_x, **({"atol": 0, "rtol": 0} if dtype == torch.float32 else _tol(dtype))
    )
    torch.testing.assert_close(got, want, **_tol(dtype))

    gu = torch.randn(3, 2 * 40, generator=g).to(DEVICE, dtype)
    want_s = torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]
    torch.testing.assert_close(tk.silu_mul(gu), want_s, **_tol(dtype))


def test_decode_splits_fill_the_gpu_and_stay_bounded():
    assert tk.decode_splits(1, 3, 4096, 132) == 16
    assert tk.decode_splits(256, 3, 4096, 132) == 1
    assert tk.decode_splits(1, 3, 10, 132) == 1  # one tile of keys: nothing to split
    assert tk.decode_splits(1, 3, 64, 132) == 1 and tk.decode_splits(1, 3, 65, 132) == 2
    assert tk.decode_splits(1, 3, 150, 132) == 4  # split per tile of keys, not for the model's context


def test_decode_split_options_are_every_split_count_a_context_can_ask_for():
    for batch in (1, 2, 8, 24, 32, 48, 256):
        for max_len in (1, 200, 256, 257, 1000, 8192):
            want = sorted({tk.decode_splits(batch, 3, n, 132) for n in range(1, max_len + 1)})
            assert tk.decode_split_options(batch, 3, max_len, 132) == want, (batch, max_len)
    assert tk.supports(9, 3, 64) and not tk.supports(8, 2, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_gemv_matches_a_product_rounded_once(dtype, rows):
    """Decode's small-batch products: float32 accumulation rounded once (what cuBLAS returns), with a
    bias, and with silu(gate) * up taken in the down product's loads (rounded as ``silu_mul``)."""
    g = torch.Generator().manual_seed(rows)
    n, k = 40, 200  # k not a multiple of the kernel's K tile, n not one of its N tile
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    gu = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)
    # One ulp of the output's magnitude in half precision; summation order alone in float32.
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.25, "rtol": 1.0 / 128}
    ref = (x.float() @ w.float().T).to(dtype)
    torch.testing.assert_close(tk.gemv(x, w), ref, **tol)
    torch.testing.assert_close(tk.gemv(x, w, b), (ref.float() + b.float()).to(dtype), **tol)
    act = tk.silu_mul(gu)
    torch.testing.assert_close(tk.gemv(gu, w, silu_mul=True), (act.float() @ w.float().T).to(dtype), **tol)
    # Any tiling gives the same values up to summation order.
    torch.testing.assert_close(tk.gemv(x, w, block_n=4, block_k=64), tk.gemv(x, w, block_n=32), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_takes_the_norm_and_the_residual_add_of_its_neighbours(dtype, rows):
    """``norm=``: the product of ``rmsnorm(x) * w`` equals ``add_rms_norm`` then ``gemv``; ``add_to=``:
    ``x += product`` in place equals ``gemv`` then the residual add of ``add_rms_norm``; both together with
    a bias and with ``silu_mul`` as a layer calls them."""
    g = torch.Generator().manual_seed(10 + rows)
    n, k = 40, 200
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype) * 3
    nw = torch.randn(k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.25, "rtol": 1.0 / 128}
    want = tk.gemv(tk.add_rms_norm(x.clone(), None, nw, 1e-5), w, b)
    x_before = x.clone()
    torch.testing.assert_close(tk.gemv(x, w, b, norm=(nw, 1e-5)), want, **tol)
    assert torch.equal(x, x_before)  # the norm reads x, never writes it
    # The residual stream: [rows, n]; the product is added into it and nothing else changes.
    a = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    stream = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    want_stream = stream.clone()
    tk.add_rms_norm(want_stream, tk.gemv(a, w, b), torch.ones(n, dtype=dtype, device=DEVICE), 1e-5)
    got = stream.clone()
    assert tk.gemv(a, w, b, add_to=got) is got
    exact = {"atol": 0, "rtol": 0} if dtype == torch.float32 else tol
    torch.testing.assert_close(got, want_stream, **exact)
    gu = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)
    want_stream = stream + tk.gemv(gu, w, silu_mul=True)
    got = stream.clone()
    tk.gemv(gu, w, silu_mul=True, add_to=got)
    torch.testing.assert_close(got, want_stream, **exact)


def test_argmax_rows_gives_torch_argmax_first_index_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g).to(DEVICE)
    logits[1, 7] = logits[1, 4999] = 50.0  # a tie across slices: the first index wins
    logits[2, 1030] = logits[2, 1031] = 60.0  # a tie within one slice
    got = tk.argmax_rows(logits, block=1024)
    assert got.tolist() == logits.argmax(-1).tolist() == [got[0].item(), 7, 1030]
    assert tk.argmax_rows(logits[:0]).shape == (0,)
