"""The C kernels of ``engine.cpu_kernels`` against the torch path they replace, op by op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention import DecodeMeta, PrefillMeta, decode_attention, prefill_attention, write_kv
from pdserve.engine.cpu_kernels import CSRC_DIR, SOURCE_FILES, kernel_source, supports
from pdserve.engine.model import apply_rope, rms_norm
from pdserve.engine.sampler import seeded_race, token_seed

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n_h", "n_kv", "d", "block"),
    [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 5), (6, 1, 16, 4), (5, 1, 80, 16), (64, 2, 16, 16)],
)
@pytest.mark.parametrize("n_seq", [1, 6])  # few sequences: items are (sequence, KV head); many: sequences
def test_decode_attention_matches_torch(kernels_every_isa, dtype, n_h, n_kv, d, block, n_seq):
    g = torch.Generator().manual_seed(n_h * d + block)
    n_blocks = 96
    kv = torch.randn(n_blocks, 2, block, n_kv, d, generator=g).to(dtype)  # [N, 2, B, Hkv, D]
    lens = [57, 1, block - 1, block, block + 1, 3 * block + 2][:n_seq]
    perm = torch.randperm(n_blocks, generator=g).tolist()
    items = []
    for n in lens:  # scattered, non-contiguous tables
        nb = -(-n // block)
        items.append((n - 1, perm[:nb]))
        perm = perm[nb:]
    meta = DecodeMeta.build(items, block, n_blocks, torch.device("cpu"))
    qkv = torch.randn(len(lens), (n_h + 2 * n_kv) * d, generator=g).to(dtype)
    q = qkv[:, : n_h * d].view(len(lens), n_h, d)  # strided rows, as in the model
    _close(decode_attention(kv, meta, q, kernels_every_isa), decode_attention(kv, meta, q, None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n_h", "n_kv", "d", "block"), [(9, 3, 64, 16), (8, 2, 128, 32), (64, 2, 16, 16)])
@pytest.mark.parametrize("runs", [(5,), (1, 5, 3, 1, 2), (2, 2, 2, 2, 2, 2)])
@pytest.mark.parametrize("threads", [1, 4])  # few sequences on many threads: their rows split into chunks
def test_verified_rows_attend_together_exactly_as_alone(
    kernels_every_isa, dtype, n_h, n_kv, d, block, runs, threads, monkeypatch
):
    # A speculative step's rows: each sequence's consecutive positions share its table object, and the
    # kernel reads their K/V once for all of them. Every row's output equals that row attended alone, bit
    # for bit (the same sums in the same order), and the torch oracle within rounding.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(n_h + d + len(runs))
    n_blocks = 160
    kv = torch.randn(n_blocks, 2, block, n_kv, d, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    items: list[tuple[int, list[int]]] = []
    for i, n in enumerate(runs):
        start = (7, 90, block - 2, 1, 3 * block, 40)[i]
        nb = -(-(start + n) // block)
        table, perm = perm[:nb], perm[nb:]
        items += [(start + j, table) for j in range(n)]
    meta = DecodeMeta.build(items, block, n_blocks, torch.device("cpu"))
    assert meta.seq_rows is not None and meta.seq_rows.tolist()[-1] == len(items)
    assert len(meta.seq_rows) == len(runs) + 1
    qkv = torch.randn(len(items), (n_h + 2 * n_kv) * d, generator=g).to(dtype)
    q = qkv[:, : n_h * d].view(len(items), n_h, d)
    got = decode_attention(kv, meta, q, kernels_every_isa)
    for i, (pos, table) in enumerate(items):
        alone = DecodeMeta.build([(pos, list(table))], block, n_blocks, torch.device("cpu"))
        assert alone.seq_rows is None
        assert torch.equal(got[i], decode_attention(kv, alone, q[i : i + 1], kernels_every_isa)[0]), i
    _close(got, decode_attention(kv, meta, q, None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_next_layer_prefetch_changes_nothing(kernels_every_isa, dtype):
    g = torch.Generator().manual_seed(7)
    n_blocks, block, n_h, n_kv, d = 40, 16, 9, 3, 64
    kv = torch.randn(2, n_blocks, 2, block, n_kv, d, generator=g).to(dtype)  # [L, N, 2, B, Hkv, D]
    perm = torch.randperm(n_blocks, generator=g).tolist()
    items = [(pos, perm[i * 5 : i * 5 + 5]) for i, pos in enumerate([70, 3, 40, 79, 16, 55, 9])]
    meta = DecodeMeta.build(items, block, n_blocks, torch.device("cpu"), with_mask=False)
    q = torch.randn(len(items), n_h, d, generator=g).to(dtype)
    plain = decode_attention(kv[0], meta, q, kernels_every_isa)
    hinted = decode_attention(kv[0], meta, q, kernels_every_isa, kv[1])
    assert torch.equal(plain, hinted)
    with pytest.raises(ValueError, match="next_kv_layer"):
        decode_attention(kv[0], meta, q, kernels_every_isa, kv[1, :10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n_h", "n_kv", "d"), [(9, 3, 64), (8, 2, 128), (4, 4, 32), (5, 1, 80), (64, 2, 16), (6, 3, 256)]
)
@pytest.mark.parametrize("n", [1, 31, 33, 100, 300])  # blocks of 32 positions: partial, whole, several
def test_prefill_attention_matches_torch(kernels_every_isa, dtype, n_h, n_kv, d, n):
    # q, k, v as the model hands them over: strided views of one fused qkv row per token.
    g = torch.Generator().manual_seed(n * d + n_h)
    qkv = torch.randn(n, (n_h + 2 * n_kv) * d, generator=g).to(dtype)
    q = qkv[:, : n_h * d].view(n, n_h, d)
    k = qkv[:, n_h * d : (n_h + n_kv) * d].view(n, n_kv, d)
    v = qkv[:, (n_h + n_kv) * d :].view(n, n_kv, d)
    got = kernels_every_isa.prefill_attention(q, k, v)
    heads = [t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, n, D]
    want = F.scaled_dot_product_attention(*heads, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    assert got.shape == (n, n_h * d) and got.dtype == dtype
    _close(got, want.reshape(n, n_h * d).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n_h", "n_kv", "d", "block"), [(9, 3, 64, 16), (8, 2, 128, 32), (6, 1, 16, 5)])
@pytest.mark.parametrize(("start", "n"), [(768, 32), (5, 1), (16, 16), (33, 70), (100, 3)])
def test_prefill_over_a_cached_prefix_matches_torch(kernels_every_isa, dtype, n_h, n_kv, d, block, start, n):
    """New tokens after ``start`` cached ones, their K/V already in scattered blocks: the paged kernel
    against SDPA over the gathered blocks (the torch path), as one prompt and beside a fresh one."""
    g = torch.Generator().manual_seed(start * 7 + n + d)
    n_blocks = -(-(start + n) // block) + 4
    kv = torch.randn(n_blocks, 2, block, n_kv, d, generator=g).to(dtype)  # [N, 2, B, Hkv, D]
    table = torch.randperm(n_blocks, generator=g)[: -(-(start + n) // block)].tolist()
    fresh_table = sorted(set(range(n_blocks)) - set(table))[:1]
    for items in ([(n, table, start)], [(3, fresh_table, 0), (n, table, start)]):
        meta = PrefillMeta.build(items, block, n_blocks, torch.device("cpu"))
        t = sum(i[0] for i in items)
        qkv = torch.randn(t, (n_h + 2 * n_kv) * d, generator=g).to(dtype)
        q = qkv[:, : n_h * d].view(t, n_h, d)  # strided rows, as in the model
        k = qkv[:, n_h * d : (n_h + n_kv) * d].view(t, n_kv, d)
        v = qkv[:, (n_h + n_kv) * d :].view(t, n_kv, d)
        write_kv(kv, meta.k_rows, meta.v_rows, k, v)
        got = prefill_attention(kv, meta, q, k, v, kernels_every_isa)
        assert got.shape == (t, n_h * d) and got.dtype == dtype
        _close(got, prefill_attention(kv.float(), meta, q.float(), k.float(), v.float(), None), dtype)


def test_prefill_attention_paged_refuses_what_it_cannot_read(kernels_every_isa):
    kv, q = torch.zeros(4, 2, 16, 1, 16), torch.randn(4, 2, 16)
    table = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(ValueError, match="prefill_attention_paged"):
        kernels_every_isa.prefill_attention_paged(q, kv, table, 29)  # the table covers 32 positions, not 33
    with pytest.raises(ValueError, match="prefill_attention_paged"):
        kernels_every_isa.prefill_attention_paged(q, kv, table.int(), 0)
    with pytest.raises(ValueError, match="prefill_attention_paged"):
        kernels_every_isa.prefill_attention_paged(q.bfloat16(), kv, table, 0)


def test_prefill_attention_refuses_what_it_cannot_read(kernels_every_isa):
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match="prefill kernel"):
        kernels_every_isa.prefill_attention(q, k, torch.randn(4, 1, 16).bfloat16())
    with pytest.raises(ValueError, match="prefill kernel"):
        kernels_every_isa.prefill_attention(q.transpose(1, 2), k, k)


def test_the_library_is_built_from_every_file_of_csrc() -> None:
    """A C file added to engine/csrc but not to SOURCE_FILES would be shipped and never compiled."""
    assert sorted(SOURCE_FILES) == sorted(p.name for p in CSRC_DIR.iterdir() if p.suffix in (".c", ".h"))
    assert kernel_source().count("int paged_decode_attention(") == 1


def test_unsupported_shapes_are_reported():
    assert supports(9, 3, 64, torch.bfloat16)
    assert not supports(9, 3, 72, torch.float32)  # head_dim not a multiple of 16
    assert supports(64, 2, 64, torch.float32)  # 32 query heads per KV head
    assert not supports(8, 2, 64, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_fused_elementwise_match_torch(kernels_every_isa, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    n, inter = 72, 200  # not multiples of 16: exercises the scalar tails
    x = torch.randn(rows, n, generator=g).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    xk = x.clone()
    h = kernels_every_isa.add_rms_norm(xk, res, w, 1e-5)
    assert torch.equal(xk, x + res)  # the residual add rounds exactly like torch's add
    _close(h, rms_norm(x + res, w, 1e-5), dtype)
    _close(kernels_every_isa.add_rms_norm(x.clone(), None, w, 1e-5), rms_norm(x, w, 1e-5), dtype)

    gu = torch.randn(rows, 2 * inter, generator=g).to(dtype)
    _close(kernels_every_isa.silu_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_torch(kernels_every_isa, dtype):
    g = torch.Generator().manual_seed(3)
    t, n_h, n_kv, d, block, n_blocks, max_pos = 11, 6, 2, 32, 4, 16, 64
    qkv = torch.randn(t, (n_h + 2 * n_kv) * d, generator=g).to(dtype)
    angles = torch.rand(max_pos, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)  # [P, D]
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    k_rows = torch.randperm(n_blocks * 2 * block, generator=g)[:t]
    k_rows = k_rows - k_rows % (2 * block) + k_rows % block  # K half of some block
    v_rows = k_rows + block

    want_qk = apply_rope(
        qkv[:, : (n_h + n_kv) * d].view(t, n_h + n_kv, d), cos[positions, None], sin[positions, None]
    )
    want_kv = torch.zeros(n_blocks, 2, block, n_kv, d, dtype=dtype)
    write_kv(want_kv, k_rows, v_rows, want_qk[:, n_h:], qkv[:, (n_h + n_kv) * d :].view(t, n_kv, d))

    got_kv = torch.zeros_like(want_kv)
    got = qkv.clone()
    kernels_every_isa.rope_store(got, n_h, n_kv, d, cos, sin, positions, got_kv, k_rows, v_rows)
    _close(got[:, : (n_h + n_kv) * d].view(t, n_h + n_kv, d), want_qk, dtype)
    assert torch.equal(got[:, (n_h + n_kv) * d :], qkv[:, (n_h + n_kv) * d :])  # v untouched
    _close(got_kv, want_kv, dtype)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 17), (8, 49157), (33, 1000)])
def test_argmax_rows_matches_torch(kernels_every_isa, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(kernels_every_isa.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 1025), (8, 49157), (64, 4096)])
def test_seeded_race_draws_what_the_sampler_draws(kernels_every_isa, shape):
    """The kernel's noise is the sampler's counter noise, bit for bit, and its race picks the same token."""
    m, vocab = shape
    g = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(m, vocab, generator=g) * 2).softmax(-1)
    probs[:, 1::3] = 0.0  # cut tokens (top-k / top-p): never drawn
    keys = torch.tensor([token_seed(1000 + r, 7 * r) for r in range(m)], dtype=torch.int64)
    want = seeded_race(probs.clone(), keys)
    got = kernels_every_isa.seeded_race(probs, keys)
    assert torch.equal(got, want)
    assert bool((probs[torch.arange(m), got] > 0).all())
    # the draw depends on the key alone: rows reversed, draws reversed
    assert torch.equal(kernels_every_isa.seeded_race(probs.flip(0), keys.flip(0)), got.flip(0))


def test_seeded_race_rejects_bad_keys_and_leaves_other_tensors_to_torch(kernels_every_isa):
    probs = torch.rand(3, 50)
    keys = torch.tensor([token_seed(s, 0) for s in range(3)])
    with pytest.raises(ValueError, match="keys"):
        kernels_every_isa.seeded_race(probs, keys[:2])
    assert torch.equal(kernels_every_isa.seeded_race(probs.double(), keys), seeded_race(probs.double(), keys))


def test_argmax_rows_ties_and_masked_rows_pick_the_first_largest(kernels_every_isa):
    x = torch.full((4, 100), float("-inf"))
    x[0, 50] = x[0, 70] = 1.0  # tie: the earlier index
    x[1, 99] = 0.0  # only the last (tail) entry is finite
    x[2, 3] = x[2, 90] = 5.0
    x[3] = 2.0  # all equal: index 0
    assert kernels_every_isa.argmax(x).tolist() == x.argmax(-1).tolist() == [50, 99, 3, 0]
    # not float32, or not 2-D: torch's argmax
    assert kernels_every_isa.argmax(x.to(torch.bfloat16)).tolist() == [50, 99, 3, 0]
