"""Triton kernels of the CUDA backend over the KV layout ``kv [L, N, 2, B, Hkv, D]`` (``engine.attention``).

Each op rounds to the model dtype where transformers' modules do (as ``engine.model.TorchStepOps``);
float32 ``tl.dot`` runs in IEEE float32 (no TF32). Every kernel also runs on CPU under
``TRITON_INTERPRET=1``, where the tests compare it with the torch path.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "FUSE_NORMS",
    "GEMV_MAX_ROWS",
    "gemv_wins",
    "add_rms_norm",
    "argmax_rows",
    "decode_attention",
    "decode_split_options",
    "decode_splits",
    "gemv",
    "prefill_attention",
    "rope_store",
    "silu_mul",
    "supports",
]


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): ``triton.next_power_of_2`` without its
    per-call wrapper, which costs microseconds on the host of every decode step."""
    return 1 << max(0, n - 1).bit_length()


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernels take: a power-of-two head_dim of at least 16 (``tl.arange`` and ``tl.dot``)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and num_heads % num_kv_heads == 0


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# Triton's interpreter (3.6) multiplies half-precision tiles wrongly in ``tl.dot``; there the operands go in
# as float32, which is the same math (products of bf16/fp16 values are exact in float32, and the GPU
# accumulates in float32 too), so the tests still check the kernels' logic.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
_DOT_F32 = _INTERPRETED


@triton.jit
def _dot(a, b, PREC: tl.constexpr, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _kv_tile(kv_ptr, table, kpos, km, kvh, d, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """K and V ``[len(kpos), D]`` of KV head ``kvh`` at token positions ``kpos`` of a sequence whose block
    table starts at ``table``; masked-off positions (``km`` false) read zeros."""
    block = tl.load(table + kpos // BLOCK, mask=km, other=0).to(tl.int64)
    rows = ((block * 2) * BLOCK + kpos % BLOCK) * (HKV * D) + kvh * D
    k = tl.load(kv_ptr + rows[:, None] + d[None, :], mask=km[:, None], other=0.0)
    v = tl.load(kv_ptr + rows[:, None] + BLOCK * HKV * D + d[None, :], mask=km[:, None], other=0.0)
    return k, v


# -- RoPE + K/V store --------------------------------------------------------------------------------------


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    qkv_stride,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    kv_ptr,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    NQK: tl.constexpr,  # next power of two >= H + HKV
    NKV: tl.constexpr,  # next power of two >= HKV
):
    t = tl.program_id(0)
    dt = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, D)
    swap = (d + D // 2) % D  # rotate_half's partner; its sign lives in sin_signed
    cos = tl.load(cos_ptr + pos * D + d).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * D + d).to(tl.float32)[None, :]
    row = qkv_ptr + t.to(tl.int64) * qkv_stride

    # q and k rotate in place (x * cos + swapped * sin, each product and the sum rounded as torch does).
    h = tl.arange(0, NQK)
    hm = (h < H + HKV)[:, None]
    x = tl.load(row + h[:, None] * D + d[None, :], mask=hm, other=0.0).to(tl.float32)
    xs = tl.load(row + h[:, None] * D + swap[None, :], mask=hm, other=0.0).to(tl.float32)
    a = (x * cos).to(dt).to(tl.float32)
    b = (xs * sin).to(dt).to(tl.float32)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        # k rotated again from its own loads, before the in-place store below overwrites them.
        hk = tl.arange(0, NKV)
        km = (hk < HKV)[:, None]
        kx = tl.load(row + (H + hk)[:, None] * D + d[None, :], mask=km, other=0.0).to(tl.float32)
        kxs = tl.load(row + (H + hk)[:, None] * D + swap[None, :], mask=km, other=0.0).to(tl.float32)
        k = (kx * cos).to(dt).to(tl.float32) + (kxs * sin).to(dt).to(tl.float32)
        v = tl.load(row + (H + HKV + hk)[:, None] * D + d[None, :], mask=km, other=0.0)
        block = slot // BLOCK
        base = kv_ptr + ((block * 2) * BLOCK + slot % BLOCK) * (HKV * D)
        tl.store(base + hk[:, None] * D + d[None, :], k.to(dt), mask=km)
        tl.store(base + BLOCK * HKV * D + hk[:, None] * D + d[None, :], v, mask=km)
    tl.debug_barrier()
    tl.store(row + h[:, None] * D + d[None, :], (a + b).to(dt), mask=hm)


def rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    positions: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """RoPE on q and k of ``qkv [T, (H + 2Hkv) * D]`` in place; K/V of token ``t`` into cache slot
    ``slots[t]`` of ``kv_layer [N, 2, B, Hkv, D]`` (nothing for -1). ``cos, sin_signed [P, D]``."""
    t = qkv.shape[0]
    if t == 0:
        return
    assert qkv.stride(1) == 1 and kv_layer.is_contiguous()
    _rope_store_kernel[(t,)](
        qkv,
        qkv.stride(0),
        cos,
        sin_signed,
        positions,
        slots,
        kv_layer,
        H=num_heads,
        HKV=num_kv_heads,
        D=head_dim,
        BLOCK=kv_layer.shape[2],
        NQK=_pow2(num_heads + num_kv_heads),
        NKV=_pow2(num_kv_heads),
    )


# -- residual add + RMSNorm, SiLU * up -------------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + r * n + cols, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + r * n + cols, mask=m, other=0.0).to(tl.float32)).to(dt)
        tl.store(x_ptr + r * n + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * inv).to(dt).to(tl.float32)  # transformers: weight * hidden.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * n + cols, (y * w).to(dt), mask=m)


def add_rms_norm(x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += res`` in place (when given); returns ``rmsnorm(x) * weight``. ``x, res [T, hidden]``."""
    t, n = x.shape
    out = torch.empty_like(x)
    if t:
        assert x.is_contiguous() and (res is None or res.is_contiguous())
        _add_rms_norm_kernel[(t,)](
            x, x if res is None else res, weight, out, n, eps, HAS_RES=res is not None,
            BLOCK=_pow2(n),
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inter
    dt = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + r * 2 * inter + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * 2 * inter + inter + c, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + r * inter + c, (s * u).to(dt), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[T, 2I]`` -> ``[T, I]``."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        assert gate_up.is_contiguous()
        block = min(1024, _pow2(inter))
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


# -- small-batch products and greedy argmax -------------------------------------------------------------

# Rows up to which a decode step's products run as ``gemv`` instead of cuBLAS, for products whose
# outputs give cuBLAS's 64-wide tiles fewer than two per SM (``gemv_wins``): there cuBLAS leaves SMs idle
# at one row, and the down product can take silu(gate) * up in its loads (one kernel less). Where cuBLAS
# fills the GPU (a large LM head), or at a few rows, cuBLAS is as fast or faster.
GEMV_MAX_ROWS = int(os.environ.get("PDSERVE_GEMV_MAX_ROWS", "1"))
# Where the products around a norm run as ``gemv``, PDSERVE_GEMV_FUSE_NORMS=1 puts the norm into the
# product after it (``norm``) and the residual add into the product before it (``add_to``): two launches
# less a layer. Off by default: fused, a step is no faster than with the separate add_rms_norm kernel,
# since every gemv program normalises its input rows itself and the adds serialise on the residual stream.
FUSE_NORMS = os.environ.get("PDSERVE_GEMV_FUSE_NORMS", "0") == "1"


def gemv_wins(rows: int, n_out: int, num_sms: int) -> bool:
    """Whether ``gemv`` beats cuBLAS for ``rows`` rows of a product with ``n_out`` outputs."""
    return rows <= GEMV_MAX_ROWS and triton.cdiv(n_out, 64) < 2 * num_sms


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    x_stride,
    nw_ptr,
    eps,
    M: tl.constexpr,
    MP: tl.constexpr,  # M padded to a power of two
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x is [M, 2K] gate|up: the input is silu(gate) * up, rounded as silu_mul does
    NORM: tl.constexpr,  # the input is rmsnorm(x) * nw, rounded as add_rms_norm does (every program
    # normalises the rows itself: they are a few KB, read anyway)
    ADD: tl.constexpr,  # out += the product (out is the residual stream; each program owns its outputs)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, MP)
    mm = m < M
    kk = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    if NORM:
        ss = tl.zeros([MP], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            xm = mm[:, None] & (k < K)[None, :]
            xs = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=xm, other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([MP, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        km = k < K
        w = tl.load(
            w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0
        )
        xm = mm[:, None] & km[None, :]
        if SILU_MUL:
            g = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + m[:, None] * x_stride + K + k[None, :], mask=xm, other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            x = (s * u).to(dt).to(tl.float32)
        else:
            x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=xm, other=0.0).to(tl.float32)
            if NORM:
                nw = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
                x = ((x * inv[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc = acc.to(dt).to(tl.float32) + tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    om = mm[:, None] & nm[None, :]
    if ADD:  # as ``out += product`` with the product rounded to the model dtype first
        prev = tl.load(out_ptr + m[:, None] * N + n[None, :], mask=om, other=0.0).to(tl.float32)
        acc = prev + acc.to(dt).to(tl.float32)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(dt), mask=om)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    add_to: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 2,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a few rows (``x [M, K]``, ``M <= 8``; ``weight [N, K]``), float32
    accumulation, rounded once to the model dtype (as cuBLAS). ``silu_mul``: ``x`` is ``[M, 2K]``
    gate|up and the product takes ``silu(gate) * up`` (``silu_mul``'s rounding) as its input.
    ``norm=(weight, eps)``: the input is ``rmsnorm(x) * weight``, rounded where ``add_rms_norm`` rounds it
    (that kernel fused in: one launch less; its sum of squares goes in ``block_k`` chunks, so in half
    precision a value may differ from the separate kernel's by an ulp). ``add_to [M, N]``: the product
    is added into it in place (``add_to += product``, the product rounded first, as ``add_rms_norm``
    adds a residual), and it is returned."""
    m = x.shape[0]
    n, k = weight.shape
    assert 1 <= m <= 8 and weight.is_contiguous() and x.stride(1) == 1
    assert x.shape[1] == (2 * k if silu_mul else k)
    assert not (silu_mul and norm is not None)
    if add_to is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        assert add_to.shape == (m, n) and add_to.dtype == x.dtype and add_to.is_contiguous()
        # Programs read all of x and write their own outputs: the two must not share memory.
        assert norm is None and add_to.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        out = add_to
    nw, eps = norm if norm is not None else (out, 0.0)
    mp = _pow2(m)
    # Defaults: the fastest tiling at one row on the default model's products (4 outputs, 2 warps). The
    # interpreter pays per program, not per element: there, 64 outputs a program (the same code; the
    # tests check that tilings agree) keeps the interpreted tests quick.
    if block_n is None:
        block_n = 64 if _INTERPRETED else 4
    if block_k is None:
        block_k = max(64, min(512, 256 // mp * (4 if block_n <= 8 else 2 if block_n <= 16 else 1)))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out if bias is None else bias, out, n, k, x.stride(0), nw, eps,
        M=m, MP=mp, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        ADD=add_to is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _argmax_part_kernel(x_ptr, val_ptr, idx_ptr, V, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    c = p * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * V + c, mask=c < V, other=float("-inf"))
    best = tl.max(x, axis=0)
    # The first index holding the largest value (torch.argmax's answer for rows without NaN).
    i = tl.min(tl.where(x == best, c, 2147483647), axis=0)
    tl.store(val_ptr + r * PARTS + p, best)
    tl.store(idx_ptr + r * PARTS + p, i)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, PARTS: tl.constexpr, PP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PP)
    pm = p < PARTS
    v = tl.load(val_ptr + r * PARTS + p, mask=pm, other=float("-inf"))
    i = tl.load(idx_ptr + r * PARTS + p, mask=pm, other=2147483647)
    best = tl.max(v, axis=0)
    tl.store(out_ptr + r, tl.min(tl.where(v == best, i, 2147483647), axis=0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """``logits.argmax(-1)`` for float32 ``[n, V]`` rows without NaN, in two kernels (a slice of the row
    per program, then a merge): torch's one-block reduction leaves most of the GPU idle."""
    n, v = logits.shape
    assert logits.is_contiguous() and logits.dtype == torch.float32
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    parts = triton.cdiv(v, block)
    vals = torch.empty(n, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(n, parts, dtype=torch.int32, device=logits.device)
    _argmax_part_kernel[(n, parts)](logits, vals, idx, v, PARTS=parts, BLOCK=block)
    _argmax_merge_kernel[(n,)](vals, idx, out, PARTS=parts, PP=_pow2(parts))
    return out


# -- decode attention ------------------------------------------------------------------------------------


@triton.jit
def _decode_attn_kernel(
    q_ptr,
    q_stride,
    kv_ptr,
    tables_ptr,
    table_stride,
    lens_ptr,
    out_ptr,  # [Bsz, H, D] when SPLITS == 1, else partial sums [Bsz, H, SPLITS, D] float32
    ml_ptr,  # [Bsz, H, SPLITS, 2] float32 running max and sum (SPLITS > 1)
    scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,  # G padded to a tile of at least 16 rows
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(seq_len, start + chunk)

    g = tl.arange(0, GP)
    gm = g < G
    d = tl.arange(0, D)
    heads = kvh * G + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * q_stride + heads[:, None] * D + d[None, :], mask=gm[:, None], other=0.0
    )
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = tables_ptr + b.to(tl.int64) * table_stride
    for k0 in range(start, end, BLOCK_N):
        kpos = k0 + n
        km = kpos < end
        k, v = _kv_tile(kv_ptr, table, kpos, km, kvh, d, HKV, D, BLOCK)  # [BLOCK_N, D] each
        s = _dot(q, tl.trans(k), PREC, DOT_F32) * scale  # [GP, BLOCK_N] float32
        s = tl.where(km[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, DOT_F32)
        m_i = m_new

    if SPLITS == 1:
        o = acc / tl.maximum(l_i, 1e-30)[:, None]  # a padding row (length 0) gives zeros
        tl.store(out_ptr + (b.to(tl.int64) * (HKV * G) + heads[:, None]) * D + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gm[:, None])  # fmt: skip
    else:
        part = (b.to(tl.int64) * (HKV * G) + heads) * SPLITS + sp  # [GP]
        tl.store(out_ptr + part[:, None] * D + d[None, :], acc, mask=gm[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=gm)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=gm)


@triton.jit
def _decode_merge_kernel(part_ptr, ml_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # one (sequence, head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (r * SPLITS + s) * 2)  # -inf for an empty slice
    l_s = tl.load(ml_ptr + (r * SPLITS + s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # [SPLITS]
    acc = tl.load(part_ptr + (r * SPLITS + s)[:, None] * D + d[None, :])  # [SPLITS, D]
    o = tl.sum(acc * w[:, None], axis=0) / tl.maximum(tl.sum(l_s * w, axis=0), 1e-30)
    tl.store(out_ptr + r * D + d, o.to(out_ptr.dtype.element_ty))


# Fewest keys a split gets: one tile of the kernel (BLOCK_N). Even at batch 1 with contexts of a few
# tiles, the split kernel plus its merge beats one program walking every tile of a KV head; so short
# contexts are still split per tile, and the split count follows the batch's longest context (graphs per
# count), not the model's.
MIN_SPLIT_KEYS = 64


def decode_splits(
    batch: int, num_kv_heads: int, max_len: int, num_sms: int, min_keys: int = MIN_SPLIT_KEYS
) -> int:
    """How many slices to split each sequence's context into so about two programs run per SM;
    a power of two, at most 16, and no more than the longest context has runs of ``min_keys`` keys
    (so 1, no merge, for contexts of up to ``min_keys`` tokens)."""
    want = max(1, (2 * num_sms) // max(1, batch * num_kv_heads))
    splits = min(16, _pow2(want), _pow2(max(1, -(-max_len // min_keys))))
    return max(1, splits)


def decode_split_options(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> list[int]:
    """Every value ``decode_splits`` takes for this batch over contexts of 1 to ``max_len`` tokens
    (it changes only just past ``MIN_SPLIT_KEYS * 2**k``), ascending."""
    lengths = [1, max_len]
    edge = MIN_SPLIT_KEYS
    while edge < max_len:
        lengths.append(edge + 1)
        edge *= 2
    return sorted({decode_splits(batch, num_kv_heads, n, num_sms) for n in lengths})


def decode_attention(
    kv_layer: torch.Tensor,
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    splits: int = 1,
    block_n: int = 64,
) -> torch.Tensor:
    """``q [Bsz, H, D]`` (row stride free) against the cache; ``tables [Bsz, M]`` block ids (int32 or
    int64, only the first ``ceil(len / B)`` of a row are read), ``lens [Bsz]`` tokens attended (0: a
    padding row, output zeros). Returns ``[Bsz, H * D]``. ``splits``: a power of two (see
    ``decode_splits``); the result does not depend on it beyond float32 rounding.

    One program per (sequence, KV head, split) serves the KV head's ``H / Hkv`` query heads as the rows of
    one tile, online softmax in float32; with ``splits > 1`` each covers a slice of the context and a
    second kernel merges the slices, so small batches and long contexts still fill the GPU."""
    bsz, n_h, d = q.shape
    _, _, block, n_kv, _ = kv_layer.shape
    assert q.stride(2) == 1 and q.stride(1) == d and kv_layer.is_contiguous() and tables.stride(1) == 1
    assert splits >= 1 and splits & (splits - 1) == 0, "splits must be a power of two"
    g = n_h // n_kv
    out = torch.empty(bsz, n_h, d, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out.view(0, n_h * d)
    meta = dict(
        HKV=n_kv, G=g, GP=max(16, _pow2(g)), D=d, BLOCK=block, BLOCK_N=block_n,
        SPLITS=splits, PREC=_dot_precision(q.dtype), DOT_F32=_DOT_F32,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(d)
    if splits == 1:
        _decode_attn_kernel[(bsz, n_kv, 1)](
            q, q.stride(0), kv_layer, tables, tables.stride(0), lens, out, out, scale, **meta
        )
    else:
        part = torch.empty(bsz, n_h, splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(bsz, n_h, splits, 2, dtype=torch.float32, device=q.device)
        _decode_attn_kernel[(bsz, n_kv, splits)](
            q, q.stride(0), kv_layer, tables, tables.stride(0), lens, part, ml, scale, **meta
        )
        _decode_merge_kernel[(bsz * n_h,)](part, ml, out, D=d, SPLITS=splits)
    return out.view(bsz, n_h * d)


# -- prefill attention -----------------------------------------------------------------------------------


@triton.jit
def _prefill_attn_kernel(
    q_ptr,
    q_stride,
    kv_ptr,
    tables_ptr,
    table_stride,
    cu_ptr,  # [n + 1] first row of each prompt chunk in the flattened batch
    start_ptr,  # [n] tokens already cached before each chunk
    out_ptr,  # [T, H, D]
    scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows of keys start first
    h = tl.program_id(1)
    s = tl.program_id(2)
    row0 = tl.load(cu_ptr + s)
    n_new = tl.load(cu_ptr + s + 1) - row0
    start_pos = tl.load(start_ptr + s)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < n_new
    qpos = start_pos + m
    d = tl.arange(0, D)
    kvh = h // G
    rows_q = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows_q[:, None] * q_stride + h * D + d[None, :], mask=mm[:, None], other=0.0)
    # Keys up to this tile's last query (none when the tile is past the chunk's end).
    k_end = tl.where(mb * BLOCK_M < n_new, start_pos + tl.minimum((mb + 1) * BLOCK_M, n_new), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = tables_ptr + s.to(tl.int64) * table_stride
    for k0 in range(0, k_end, BLOCK_N):
        kpos = k0 + n
        km = kpos < k_end
        k, v = _kv_tile(kv_ptr, table, kpos, km, kvh, d, HKV, D, BLOCK)  # [BLOCK_N, D] each
        sc = _dot(q, tl.trans(k), PREC, DOT_F32) * scale  # [BLOCK_M, BLOCK_N]
        sc = tl.where(km[None, :] & (kpos[None, :] <= qpos[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows past the chunk see no keys
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, DOT_F32)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (rows_q[:, None] * (HKV * G) + h) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mm[:, None])  # fmt: skip


def prefill_attention(
    kv_layer: torch.Tensor,
    q: torch.Tensor,
    tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    max_new: int,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = 2,
) -> torch.Tensor:
    """``q [T, H, D]`` of ``n`` prompt chunks flattened (chunk ``i``: rows ``cu_seqlens[i:i+2]``, positions
    from ``start_pos[i]``), whose K/V are already in the cache, attends causally over the cache
    through ``tables [n, M]``. ``max_new``: the longest chunk. Returns ``[T, H * D]``."""
    t, n_h, d = q.shape
    _, _, block, n_kv, _ = kv_layer.shape
    n = start_pos.shape[0]
    assert q.stride(2) == 1 and q.stride(1) == d and kv_layer.is_contiguous() and tables.stride(1) == 1
    out = torch.empty(t, n_h, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out.view(0, n_h * d)
    if block_n is None:
        # 128 keys a tile in half precision, faster than 64 on long prompts; float32 tiles (and head
        # dims past 128) keep 64, within shared memory.
        block_n = 128 if q.element_size() == 2 and d <= 128 else 64
    grid = (triton.cdiv(max_new, block_m), n_h, n)
    _prefill_attn_kernel[grid](
        q, q.stride(0), kv_layer, tables, tables.stride(0), cu_seqlens, start_pos, out, 1.0 / math.sqrt(d),
        HKV=n_kv, G=n_h // n_kv, D=d, BLOCK=block, BLOCK_M=block_m, BLOCK_N=block_n,
        PREC=_dot_precision(q.dtype), DOT_F32=_DOT_F32, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return out.view(t, n_h * d)
