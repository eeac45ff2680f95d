"""C source of the CPU kernels (compiled and loaded by ``engine.cpu_kernels``).

Plain C11 with GCC vector extensions (16 floats per vector where AVX-512
exists, else 8; the compiler maps them to AVX-512, AVX2 or NEON), OpenMP for
threads, and float32 arithmetic for every dtype: float32, bfloat16 and float16 rows are widened on load and
rounded to nearest even on store.

Kernels (all return 0, or < 0 for unsupported shapes):
- ``paged_decode_attention``: one query token per sequence against its paged K/V (prefetching ahead,
  and the next layer's rows towards the last-level cache; AVX512-BF16 dot products for bfloat16).
- ``add_rms_norm``: ``x += res`` then ``h = rmsnorm(x) * w`` (residual add fused into the next norm).
- ``rope_store``: RoPE on the q and k heads of ``qkv`` in place, then K and V rows into the cache.
- ``silu_mul``: ``silu(gate) * up`` from the fused gate_up output.
- ``linear_packed`` (+ ``pack_linear_weight``): ``x @ w.T`` for decode-sized batches from weights packed
  into contiguous column panels at load, in the activations' dtype or as int8 with per-column scales;
  bfloat16 with AVX512-BF16 in k pairs, multiplied by dot products (``linear_bf16_pairs``).
- ``argmax_rows``: greedy tokens from float32 logits (torch's argmax took ~0.6 ms for 32 rows of a 49k
  vocabulary on 2 cores, 3% of a decode step).
- ``seeded_race``: seeded rows' draw (the sampler's counter noise, exponential race and argmax in one pass).
- ``fma_peak``: a probe, not a kernel: the float32 FMA rate the cores sustain (``bench.engine``'s bound).
- ``bf16_dot_peak``: the same for AVX512-BF16 dot products (``vdpbf16ps``), which bfloat16 products use
  where the host has them: twice the float32 rate per instruction, so the float32 peak is no bound there.
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>
/* HAVE_AVX512F / HAVE_BF16_DOT select the AVX-512 paths. PDSERVE_SIMDE_AVX512 (the tests' "simde-avx512"
   build, engine.cpu_kernels.KERNEL_ISAS) compiles them on a CPU without AVX-512 through SIMDe, which
   implements the intrinsics with narrower vectors: slow, but the same code, so its logic can be checked
   against the torch oracle on any x86 host. */
#if defined(PDSERVE_SIMDE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define HAVE_AVX512F 1
#define HAVE_BF16_DOT 1
#else
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512F 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_BF16_DOT 1
#endif
#endif

/* Floats per vector: the register width where AVX-512 exists, else 8 (two 128-bit or one 256-bit
   register: AVX2, NEON). 16-float vectors on AVX2 would be register pairs, and the 16-vector transposes of
   the attention kernel would spill; on an AVX2 EPYC the 8-float build ran decode attention ~2x faster. */
#if defined(HAVE_AVX512F)
#define W 16
#else
#define W 8
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef _Float16 vhf __attribute__((vector_size(W * 2)));
typedef int8_t vb __attribute__((vector_size(W)));

/* float32 -> bfloat16, round to nearest even as torch does; NaN stays a (quiet) NaN. */
static inline vh to_bf16(vf r) {
    vu u; memcpy(&u, &r, sizeof u);
    const vu is_nan = (u & 0x7fffffffu) > 0x7f800000u;  /* all-ones lanes where NaN */
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu quiet = (u >> 16) | 0x40u;
    return __builtin_convertvector((rounded & ~is_nan) | (quiet & is_nan), vh);
}

#if defined(PDSERVE_SIMDE_AVX512) && !defined(__AVX512BF16__)
/* SIMDe 0.8 has no _mm512_cvtneps_pbh: to_bf16 rounds as the instruction does. */
static inline __m256bh pd_cvtneps_pbh(__m512 a) {
    vf f; memcpy(&f, &a, sizeof f);
    const vh h = to_bf16(f);
    __m256bh out; memcpy(&out, &h, sizeof out); return out;
}
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh pd_cvtneps_pbh
#endif

static inline vf ld(const char* p, const int dt) {
    vf f;
    if (dt == 0) { memcpy(&f, p, sizeof f); return f; }
    if (dt == 1) {  /* bfloat16 is the high half of a float32 */
        vh h; memcpy(&h, p, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16; memcpy(&f, &u, sizeof f); return f;
    }
    vhf h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, vf);
}

static inline void st(char* p, vf r, const int dt) {
    if (dt == 0) { memcpy(p, &r, sizeof r); return; }
    if (dt == 2) { vhf h = __builtin_convertvector(r, vhf); memcpy(p, &h, sizeof h); return; }
    const vh h = to_bf16(r);
    memcpy(p, &h, sizeof h);
}

static inline float ld1(const char* p, const int dt) {
    if (dt == 0) { float f; memcpy(&f, p, 4); return f; }
    if (dt == 1) {
        uint16_t h; memcpy(&h, p, 2);
        uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
    }
    _Float16 h; memcpy(&h, p, 2); return (float)h;
}

static inline void st1(char* p, float v, const int dt) {
    if (dt == 0) { memcpy(p, &v, 4); return; }
    if (dt == 2) { _Float16 h = (_Float16)v; memcpy(p, &h, 2); return; }
    uint32_t u; memcpy(&u, &v, 4);
    uint16_t o = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    memcpy(p, &o, 2);
}

/* out[t] = sum of the lanes of v[t] for W vectors: a transpose-and-add tree (W - 1 shuffle pairs)
   instead of W horizontal sums. Step k pairs vectors holding 2^(k-1) tokens each and adds the two halves
   of every token's lanes; token order is kept. */
#if W == 16
static inline vf reduceW(const vf* v) {
    const vi m1a = {0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23};
    const vi m1b = {8,9,10,11,12,13,14,15,24,25,26,27,28,29,30,31};
    const vi m2a = {0,1,2,3,8,9,10,11,16,17,18,19,24,25,26,27};
    const vi m2b = {4,5,6,7,12,13,14,15,20,21,22,23,28,29,30,31};
    const vi m3a = {0,1,4,5,8,9,12,13,16,17,20,21,24,25,28,29};
    const vi m3b = {2,3,6,7,10,11,14,15,18,19,22,23,26,27,30,31};
    const vi m4a = {0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30};
    const vi m4b = {1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(v[2*i], v[2*i+1], m1a) + __builtin_shuffle(v[2*i], v[2*i+1], m1b);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2*i], a[2*i+1], m2a) + __builtin_shuffle(a[2*i], a[2*i+1], m2b);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2*i], b[2*i+1], m3a) + __builtin_shuffle(b[2*i], b[2*i+1], m3b);
    return __builtin_shuffle(c[0], c[1], m4a) + __builtin_shuffle(c[0], c[1], m4b);
}
#else
static inline vf reduceW(const vf* v) {
    const vi m1a = {0,1,2,3,8,9,10,11};
    const vi m1b = {4,5,6,7,12,13,14,15};
    const vi m2a = {0,1,4,5,8,9,12,13};
    const vi m2b = {2,3,6,7,10,11,14,15};
    const vi m3a = {0,2,4,6,8,10,12,14};
    const vi m3b = {1,3,5,7,9,11,13,15};
    vf a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shuffle(v[2*i], v[2*i+1], m1a) + __builtin_shuffle(v[2*i], v[2*i+1], m1b);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shuffle(a[2*i], a[2*i+1], m2a) + __builtin_shuffle(a[2*i], a[2*i+1], m2b);
    return __builtin_shuffle(b[0], b[1], m3a) + __builtin_shuffle(b[0], b[1], m3b);
}
#endif

/* Pointer to token j's row (K, or V when vsel is 1) at element offset hoff within the row. */
static inline const char* row_ptr(const char* kv, const int64_t* table, int64_t j, int64_t B,
                                  int64_t tok_stride, int64_t block_stride, int64_t hoff, int vsel,
                                  int64_t esz) {
    return kv + (table[j / B] * block_stride + (vsel * B + j % B) * tok_stride + hoff) * esz;
}

/* Load heads [h0, h0 + nh) of the K or V rows of tokens [j0, j0 + n) into buf[t][hh][c] (float32);
   zero the rest of the W-token group. The heads of a token are adjacent, so a block is read as one
   contiguous span when all heads are loaded together. */
static inline void load_group(vf* buf, const char* kv, const int64_t* table, int64_t j0, int64_t n,
                              int64_t B, int64_t tok_stride, int64_t block_stride, int64_t hoff, int64_t nh,
                              int vsel, const int dt, const int NC) {
    const int64_t esz = dt == 0 ? 4 : 2, per_tok = nh * NC;
    if (B % W == 0) {  /* the group lies in one block: one table lookup */
        const char* p = row_ptr(kv, table, j0, B, tok_stride, block_stride, hoff, vsel, esz);
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < per_tok; i++)
                buf[t * per_tok + i] = ld(p + (t * tok_stride + i * W) * esz, dt);
    } else {
        for (int64_t t = 0; t < n; t++) {
            const char* p = row_ptr(kv, table, j0 + t, B, tok_stride, block_stride, hoff, vsel, esz);
            for (int64_t i = 0; i < per_tok; i++) buf[t * per_tok + i] = ld(p + i * W * esz, dt);
        }
    }
    for (int64_t i = n * per_tok; i < W * per_tok; i++) buf[i] = (vf){0};
}

#ifndef PF_GROUPS
#define PF_GROUPS 1  /* groups of W tokens requested ahead of use */
#endif

/* One cache line towards L1. Inline asm on x86: GCC drops __builtin_prefetch from loops it vectorizes,
   and a loop of nothing but prefetches is vectorized away. The address goes in as a register, not a memory
   operand: an "m" operand of a char tells GCC the asm may read any memory, so it stores every accumulator
   array that could alias it before each prefetch (measured: the bf16 product tile ran at half speed). */
static inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 (%0)" : : "r"(p));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

/* One cache line towards the last-level cache only (for data needed a little later). */
static inline void prefetch_line_llc(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht2 (%0)" : : "r"(p));
#else
    __builtin_prefetch(p, 0, 1);
#endif
}

/* What one thread reads, in order: for each of its items, the K groups of the sequence, then its V
   groups. The blocks of a sequence are scattered and each group is only a few KB, so the hardware
   prefetcher alone leaves the loop waiting on memory; the loop asks for the group PF_GROUPS ahead in this
   stream, which crosses into the thread's next item (known under a static schedule). Each row asked for
   is also asked for, towards the last-level cache, in the next layer's cache (same block ids, one layer
   stride on): the matmuls between two attentions leave the memory bus idle, and the next layer's attention
   then finds its rows in cache. */
typedef struct {
    const char* kv;
    const int64_t* table;
    int64_t len, groups;
    const int64_t* next_table;  /* NULL when this is the thread's last item */
    int64_t next_len, B, tok_stride, block_stride, hoff, next_hoff, bytes, esz;
    int64_t next_layer;  /* bytes from this layer's cache to the next layer's; 0 for none */
} stream_t;

static inline void prefetch_rows(const stream_t* st_, const int64_t* table, int64_t len, int64_t hoff,
                                 int64_t j0, int vsel) {
    const int64_t n = len - j0 < W ? len - j0 : W;
    for (int64_t t = 0; t < n; t++) {
        const char* p = row_ptr(st_->kv, table, j0 + t, st_->B, st_->tok_stride, st_->block_stride, hoff,
                                vsel, st_->esz);
        for (int64_t o = 0; o < st_->bytes; o += 64) prefetch_line(p + o);
        if (st_->next_layer)
            for (int64_t o = 0; o < st_->bytes; o += 64) prefetch_line_llc(p + st_->next_layer + o);
    }
}

/* Request stream position pos: [0, groups) K groups, [groups, 2 groups) V groups, then the next item's K. */
static inline void prefetch_pos(const stream_t* st_, int64_t pos) {
    const int64_t groups = st_->groups;
    if (pos < groups) prefetch_rows(st_, st_->table, st_->len, st_->hoff, pos * W, 0);
    else if (pos < 2 * groups) prefetch_rows(st_, st_->table, st_->len, st_->hoff, (pos - groups) * W, 1);
    else if (st_->next_table && (pos - 2 * st_->groups) * W < st_->next_len)
        prefetch_rows(st_, st_->next_table, st_->next_len, st_->next_hoff, (pos - 2 * st_->groups) * W, 0);
}

/* One sequence, KV heads [h0, h0 + nh): their nh * G query heads against its len cached tokens.
   Scratch: qv and acc [nh * G][NC], buf [W][nh][NC] vectors; s [nh * G][len rounded up to W] and
   inv [nh * G] floats. */
static inline __attribute__((always_inline)) void decode_seq(
    const stream_t* sm, const char* qrow, char* orow, int64_t G, int64_t h0, int64_t nh, float scale,
    float* s, float* inv, vf* qv, vf* acc, vf* buf, const int dt, const int NC)
{
    const char* kv = sm->kv;
    const int64_t* table = sm->table;
    const int64_t len = sm->len, B = sm->B, tok_stride = sm->tok_stride, block_stride = sm->block_stride;
    const int64_t esz = dt == 0 ? 4 : 2, D = (int64_t)NC * W, hoff = h0 * D, nq = nh * G;
    const int64_t groups = sm->groups, s_stride = groups * W;
    const char* q0 = qrow + h0 * G * D * esz;  /* query heads of KV head h are h * G .. h * G + G - 1 */

#ifdef HAVE_BF16_DOT
    if (dt == 1 && NC % 2 == 0) {
        /* bfloat16: q.k with AVX512-BF16 dot products straight from the cache rows (no widening pass).
           Each product of two bfloat16 is exact in float32; the scale is applied to the sums. */
        __m512bh* qb = (__m512bh*)qv;  /* [nq][NC / 2] in the q scratch */
        for (int64_t i = 0; i < nq; i++)
            for (int c = 0; c < NC / 2; c++)
                qb[i * (NC / 2) + c] = (__m512bh)_mm512_loadu_si512(q0 + (i * D + c * 2 * W) * esz);
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
            prefetch_pos(sm, gi + PF_GROUPS);
            const char* rows[W];
            for (int64_t t = 0; t < n; t++)
                rows[t] = row_ptr(kv, table, j0 + t, B, tok_stride, block_stride, hoff, 0, esz);
            for (int64_t i = 0; i < nq; i++) {
                const __m512bh* qi = qb + i * (NC / 2);
                const int64_t koff = (i / G) * D * esz;
                vf part[W];
                for (int t = 0; t < W; t++) {
                    if (t >= n) { part[t] = (vf){0}; continue; }
                    const char* k = rows[t] + koff;
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qi[0], (__m512bh)_mm512_loadu_si512(k));
                    for (int c = 1; c < NC / 2; c++)
                        a = _mm512_dpbf16_ps(a, qi[c], (__m512bh)_mm512_loadu_si512(k + c * 2 * W * esz));
                    part[t] = (vf)a;
                }
                vf r = reduceW(part) * scale;
                memcpy(s + i * s_stride + j0, &r, sizeof r);
            }
        }
    } else
#endif
    {
        for (int64_t i = 0; i < nq; i++)
            for (int c = 0; c < NC; c++) qv[i * NC + c] = ld(q0 + (i * D + c * W) * esz, dt) * scale;
        for (int64_t gi = 0; gi < groups; gi++) {  /* scores */
            const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
            prefetch_pos(sm, gi + PF_GROUPS);
            load_group(buf, kv, table, j0, n, B, tok_stride, block_stride, hoff, nh, 0, dt, NC);
            for (int64_t i = 0; i < nq; i++) {
                const vf* qi = qv + i * NC;
                const vf* bh = buf + (i / G) * NC;  /* this query head's KV head within the group rows */
                vf part[W];
                for (int t = 0; t < W; t++) {
                    const vf* k = bh + t * nh * NC;
                    vf a = qi[0] * k[0];
                    for (int c = 1; c < NC; c++) a += qi[c] * k[c];
                    part[t] = a;
                }
                vf r = reduceW(part);
                memcpy(s + i * s_stride + j0, &r, sizeof r);
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {  /* softmax over the len valid scores */
        float* si = s + i * s_stride;
        float mx = si[0], sum = 0.f;
        for (int64_t j = 1; j < len; j++) mx = si[j] > mx ? si[j] : mx;
        #pragma omp simd reduction(+:sum)  /* vector expf (libmvec): a scalar one per score costs more
                                              than the q.k products on AVX2 */
        for (int64_t j = 0; j < len; j++) { const float e = expf(si[j] - mx); si[j] = e; sum += e; }
        inv[i] = 1.f / sum;
        for (int c = 0; c < NC; c++) acc[i * NC + c] = (vf){0};
    }
#ifdef HAVE_BF16_DOT
    if (dt == 1 && NC % 2 == 0 && G <= 16 * NC) {
        /* bfloat16: p x V with AVX512-BF16 dot products over token pairs. Each probability is split into
           two bfloat16, hi = bf16(p) and lo = bf16(p - hi), so p = hi + lo to ~16 bits (float32-like
           accuracy), and every product with a bfloat16 V is exact in float32. The V rows of tokens t and
           t + 1 are interleaved 16 bits at a time (unpacklo/hi within 128-bit lanes), so accumulator lanes
           hold dims in the order [lo of each lane, hi of each lane]; the store puts them back in order. */
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = len; j < s_stride; j++) s[i * s_stride + j] = 0.f;  /* pad tokens weigh 0 */
        uint32_t* pp = (uint32_t*)buf;  /* [nq][2][W / 2] probability pairs: hi then lo */
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
            prefetch_pos(sm, groups + gi + PF_GROUPS);
            for (int64_t i = 0; i < nq; i++) {
                const __m512 p = _mm512_loadu_ps(s + i * s_stride + j0);
                const __m256bh hi = _mm512_cvtneps_pbh(p);
                const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32((__m256i)hi), 16));
                const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(p, hi_f));
                _mm256_storeu_si256((__m256i*)(pp + i * W), (__m256i)hi);
                _mm256_storeu_si256((__m256i*)(pp + i * W + W / 2), (__m256i)lo);
            }
            for (int64_t t = 0; t < n; t += 2) {
                const char* r0 = row_ptr(kv, table, j0 + t, B, tok_stride, block_stride, hoff, 1, esz);
                const char* r1 = t + 1 < n
                    ? row_ptr(kv, table, j0 + t + 1, B, tok_stride, block_stride, hoff, 1, esz) : NULL;
                for (int64_t hh = 0; hh < nh; hh++) {
                    for (int c = 0; c < NC / 2; c++) {
                        const int64_t off = (hh * D + c * 2 * W) * esz;
                        const __m512i a = _mm512_loadu_si512(r0 + off);
                        const __m512i b = r1 ? _mm512_loadu_si512(r1 + off) : _mm512_setzero_si512();
                        const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b);
                        const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                        for (int64_t g = 0; g < G; g++) {
                            const int64_t i = hh * G + g;
                            const __m512bh ph = (__m512bh)_mm512_set1_epi32((int)pp[i * W + t / 2]);
                            const __m512bh pl = (__m512bh)_mm512_set1_epi32((int)pp[i * W + W / 2 + t / 2]);
                            __m512* ai = (__m512*)(acc + i * NC + 2 * c);
                            ai[0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(ai[0], ph, vlo), pl, vlo);
                            ai[1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(ai[1], ph, vhi), pl, vhi);
                        }
                    }
                }
            }
        }
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int64_t i = 0; i < nq; i++)
            for (int c = 0; c < NC / 2; c++) {
                const __m512 lo = (__m512)acc[i * NC + 2 * c], hi = (__m512)acc[i * NC + 2 * c + 1];
                acc[i * NC + 2 * c] = (vf)_mm512_permutex2var_ps(lo, first, hi);
                acc[i * NC + 2 * c + 1] = (vf)_mm512_permutex2var_ps(lo, second, hi);
            }
    } else
#endif
    for (int64_t gi = 0; gi < groups; gi++) {  /* probabilities x V */
        const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
        prefetch_pos(sm, groups + gi + PF_GROUPS);
        load_group(buf, kv, table, j0, n, B, tok_stride, block_stride, hoff, nh, 1, dt, NC);
        for (int64_t i = 0; i < nq; i++) {
            const float* si = s + i * s_stride + j0;
            const vf* bh = buf + (i / G) * NC;
            vf* ai = acc + i * NC;
            for (int64_t t = 0; t < n; t++)
                for (int c = 0; c < NC; c++) ai[c] += si[t] * bh[t * nh * NC + c];
        }
    }
    char* o0 = orow + h0 * G * D * esz;
    for (int64_t i = 0; i < nq; i++)
        for (int c = 0; c < NC; c++) st(o0 + (i * D + c * W) * esz, acc[i * NC + c] * inv[i], dt);
}

/* kv: one layer [N, 2, B, Hkv, D]; next_kv: the next layer's (same shape; prefetched into cache) or NULL;
   q: [bsz, q_row_stride] rows, head i at i * D; out: [bsz, H * D];
   tables: [bsz, max_blocks]; lens: [bsz] tokens to attend (position + 1). Returns 0, -1 for unsupported
   shapes, -2 when out of memory. */
int paged_decode_attention(const void* kv, const void* next_kv, const void* q, void* out,
                           const int64_t* tables, const int64_t* lens, int64_t bsz, int64_t max_blocks,
                           int64_t B, int64_t n_heads, int64_t n_kv_heads, int64_t D, int64_t q_row_stride,
                           int64_t max_len, float scale, int dt, int num_threads)
{
    const int64_t G = n_heads / n_kv_heads;
    if (D % W || n_heads % n_kv_heads || dt < 0 || dt > 2) return -1;
    const int64_t tok_stride = n_kv_heads * D, block_stride = 2 * B * tok_stride, esz = dt == 0 ? 4 : 2;
    const int64_t NC = D / W;
    /* With enough sequences each item is a whole sequence, so every block is streamed once as one
       contiguous span; otherwise items are (sequence, KV head) pairs, for parallelism. */
    const int64_t nh = bsz >= 2 * num_threads ? n_kv_heads : 1, per_seq = n_kv_heads / nh;
    const int64_t items = bsz * per_seq;
    const int64_t s_len = nh * G * ((max_len + W - 1) / W) * W;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float* s = (float*)malloc(sizeof(float) * (s_len + nh * G));
        vf* vecs = (vf*)aligned_alloc(64, sizeof(vf) * NC * (2 * nh * G + W * nh));
        if (!s || !vecs) {
            #pragma omp atomic write
            failed = 1;
        }
        const int nt = omp_get_num_threads();
        /* Static round-robin: a thread knows its next item, so its prefetch stream runs into it. */
        #pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!s || !vecs) continue;
            const int64_t b = item / per_seq, h0 = (item % per_seq) * nh;
            const int64_t nxt = item + nt, nb = nxt / per_seq;
            stream_t sm = {
                .kv = (const char*)kv, .table = tables + b * max_blocks, .len = lens[b],
                .groups = (lens[b] + W - 1) / W,
                .next_table = nxt < items ? tables + nb * max_blocks : NULL,
                .next_len = nxt < items ? lens[nb] : 0,
                .B = B, .tok_stride = tok_stride, .block_stride = block_stride,
                .hoff = h0 * D, .next_hoff = (nxt % per_seq) * nh * D,
                .next_layer = next_kv ? (const char*)next_kv - (const char*)kv : 0,
                .bytes = nh * D * esz, .esz = esz,
            };
            const char* qrow = (const char*)q + b * q_row_stride * esz;
            char* orow = (char*)out + b * n_heads * D * esz;
            vf* qv = vecs; vf* acc = qv + nh * G * NC; vf* buf = acc + nh * G * NC;
#define SEQ(DT, NCC) decode_seq(&sm, qrow, orow, G, h0, nh, scale, s, s + s_len, qv, acc, buf, DT, NCC)
#define BY_DTYPE(NCC) \
    switch (dt) { case 0: SEQ(0, NCC); break; case 1: SEQ(1, NCC); break; default: SEQ(2, NCC); }
            switch (NC) {
                case 4: BY_DTYPE(4); break;
                case 8: BY_DTYPE(8); break;
                default: BY_DTYPE((int)NC); break;
            }
        }
        free(s);
        free(vecs);
    }
    return failed ? -2 : 0;
}

/* ---- causal attention of fresh prompt tokens (no cached prefix) ----
   q: [n] rows q_stride elements apart, query head i at i * D; k, v: [n] rows kv_stride apart, KV head h
   at h * D; out: [n, H * D] contiguous. First every KV head's K is widened to float32 and transposed in
   tiles of W keys, kt[h][j / W][d][W] (a vector holds W keys' d-th element, and a tile is one contiguous
   D x W block: a plain [d][j] transpose put the rows of one tile a whole prompt apart, all in the same
   few L1 sets), and V widened, vv[h][j][D]. Then items = (KV head, block of PA_Q positions) with the
   block's G query heads as rows: scores by broadcast-FMA over W-key tiles (no horizontal sums), a causal
   softmax per row in float32 (expf vectorized), P x V by broadcast-FMA over V rows, every key loop
   stopping at the last key its rows may see. Head sizes of 4 and 8 vectors are compiled as constants, so
   the accumulators stay in registers. Largest blocks first, dynamic schedule. */
#define PA_Q 32
#define PA_SR 8  /* score rows per register group */

/* P x V for rows [r0, r0 + nr) (nr <= PVR) and column vectors [c0, c0 + PVC) of one item; rows beyond nr
   repeat row r0 and are not stored. */
static inline __attribute__((always_inline)) void prefill_pv_group(
    const float* sc, const float* inv, const vf* vh, char* out, int64_t npad, int64_t r0, int64_t nr,
    int64_t nk, int64_t p0, int64_t G, int64_t h, int64_t n_heads, int64_t c0, const int PVR, const int PVC,
    const int NC, const int dt)
{
    const int64_t D = (int64_t)NC * W, esz = dt == 0 ? 4 : 2;
    vf a[16][4];
    const float* pr[16];
    for (int i = 0; i < PVR; i++) {
        pr[i] = sc + (r0 + (i < nr ? i : 0)) * npad;
        for (int c = 0; c < PVC; c++) a[i][c] = (vf){0};
    }
    for (int64_t j = 0; j < nk; j++) {
        const vf* vj = vh + j * NC + c0;
        for (int i = 0; i < PVR; i++) {
            const float pj = pr[i][j];
            for (int c = 0; c < PVC; c++) a[i][c] += pj * vj[c];
        }
    }
    for (int i = 0; i < nr; i++) {
        const int64_t r = r0 + i;
        char* o = out + ((p0 + r / G) * n_heads * D + (h * G + r % G) * D + c0 * W) * esz;
        for (int c = 0; c < PVC; c++) st(o + c * W * esz, a[i][c] * inv[r], dt);
    }
}

/* One item: KV head h, positions [p0, p0 + np). sc: [rows rounded up to PA_SR][npad] scores, then
   [rows] inverse sums; qf: [rows rounded up to PA_SR][D] scaled float32 queries. */
static inline __attribute__((always_inline)) void prefill_item(
    const char* qc, const float* kh, const vf* vh, char* out, float* sc, float* qf, int64_t npad,
    int64_t p0, int64_t np, int64_t h, int64_t G, int64_t n_heads, int64_t q_stride, float scale,
    int64_t RP, const int NC, const int dt)
{
    const int64_t D = (int64_t)NC * W, esz = dt == 0 ? 4 : 2, rows = np * G;
    const int64_t rows_p = (rows + PA_SR - 1) / PA_SR * PA_SR;
    float* inv = sc + RP * npad;
    for (int64_t r = 0; r < rows; r++) {  /* row r: position p0 + r / G, query head h * G + r % G */
        const char* qr = qc + ((p0 + r / G) * q_stride + (h * G + r % G) * D) * esz;
        for (int c = 0; c < NC; c++) {
            const vf x = ld(qr + c * W * esz, dt) * scale;
            memcpy(qf + r * D + c * W, &x, sizeof x);
        }
    }
    memset(qf + rows * D, 0, sizeof(float) * (rows_p - rows) * D);
    for (int64_t r0 = 0; r0 < rows; r0 += PA_SR) {  /* scores of PA_SR rows, W keys at a time */
        const int64_t nr = rows - r0 < PA_SR ? rows - r0 : PA_SR;
        const int64_t nk = p0 + (r0 + nr - 1) / G + 1;  /* keys the group's last row sees */
        for (int64_t j0 = 0; j0 < nk; j0 += W) {
            const float* tile = kh + j0 * D;  /* [D][W] */
            vf a[PA_SR];
            for (int i = 0; i < PA_SR; i++) a[i] = (vf){0};
            for (int64_t d = 0; d < D; d++) {
                vf kd; memcpy(&kd, tile + d * W, sizeof kd);
                for (int i = 0; i < PA_SR; i++) a[i] += qf[(r0 + i) * D + d] * kd;
            }
            for (int i = 0; i < nr; i++) memcpy(sc + (r0 + i) * npad + j0, &a[i], sizeof a[i]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {  /* causal softmax: row r sees keys 0 .. p0 + r / G */
        float* sr = sc + r * npad;
        const int64_t len = p0 + r / G + 1;
        float mx = sr[0], sum = 0.f;
        for (int64_t j = 1; j < len; j++) mx = sr[j] > mx ? sr[j] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < len; j++) { const float e = expf(sr[j] - mx); sr[j] = e; sum += e; }
        inv[r] = 1.f / sum;
    }
    /* P x V: register groups of PVR rows x PVC column vectors (W == 16: 16 accumulators of 32 registers;
       W == 8: 12 of 16). Each row's loop stops at its group's last key; a row's keys past its own last
       (causal) are read as 0 from sc: zero them first. */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = p0 + r / G + 1, group_end = p0 + (PA_Q * G - 1) / G + 1;
        for (int64_t j = len; j < group_end && j < npad; j++) sc[r * npad + j] = 0.f;
    }
    const int PVC = NC % 4 == 0 ? 4 : NC % 2 == 0 ? 2 : 1, PVR = (W == 16 ? 16 : 12) / PVC;
    for (int64_t r0 = 0; r0 < rows; r0 += PVR) {
        const int64_t nr = rows - r0 < PVR ? rows - r0 : PVR;
        const int64_t nk = p0 + (r0 + nr - 1) / G + 1;
        for (int64_t c0 = 0; c0 < NC; c0 += PVC)
            prefill_pv_group(sc, inv, vh, out, npad, r0, nr, nk, p0, G, h, n_heads, c0, PVR, PVC, NC, dt);
    }
}

int prefill_attention(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t n_heads,
                      int64_t n_kv_heads, int64_t D, int64_t q_stride, int64_t kv_stride, float scale, int dt,
                      int num_threads)
{
    if (D % W || n_heads % n_kv_heads || dt < 0 || dt > 2 || n < 1) return -1;
    if (num_threads < 1) num_threads = 1;
    const int64_t G = n_heads / n_kv_heads, NC = D / W, esz = dt == 0 ? 4 : 2;
    const int64_t npad = (n + W - 1) / W * W, R = PA_Q * G;
    const int64_t blocks = (n + PA_Q - 1) / PA_Q, items = n_kv_heads * blocks;
    const char *qc = (const char*)q, *kc = (const char*)k, *vc = (const char*)v;
    float* kt = (float*)aligned_alloc(64, sizeof(float) * n_kv_heads * D * npad);
    vf* vv = (vf*)aligned_alloc(64, sizeof(vf) * n_kv_heads * npad * NC);
    if (!kt || !vv) { free(kt); free(vv); return -2; }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t ht = 0; ht < n_kv_heads * (npad / W); ht++) {  /* widen: K in tiles, V as rows */
            const int64_t h = ht / (npad / W), j0 = ht % (npad / W) * W, nj = n - j0 < W ? n - j0 : W;
            float* tile = kt + h * D * npad + j0 * D;  /* [D][W] */
            for (int64_t t = 0; t < W; t++) {
                float row[512];  /* D <= 512 (cpu_kernels.supports) */
                for (int64_t c = 0; c < NC; c++) {
                    const vf x = t < nj ? ld(kc + ((j0 + t) * kv_stride + h * D + c * W) * esz, dt) : (vf){0};
                    memcpy(row + c * W, &x, sizeof x);
                }
                for (int64_t d = 0; d < D; d++) tile[d * W + t] = row[d];
            }
            for (int64_t t = 0; t < W; t++) {
                vf* vr = vv + (h * npad + j0 + t) * NC;
                for (int64_t c = 0; c < NC; c++)
                    vr[c] = t < nj ? ld(vc + ((j0 + t) * kv_stride + h * D + c * W) * esz, dt) : (vf){0};
            }
        }
        const int64_t RP = (R + PA_SR - 1) / PA_SR * PA_SR;
        float* sc = (float*)aligned_alloc(64, sizeof(float) * (RP * npad + RP));
        float* qf = (float*)aligned_alloc(64, sizeof(float) * RP * D);
        if (!sc || !qf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!sc || !qf) continue;
            const int64_t blk = blocks - 1 - it / n_kv_heads, h = it % n_kv_heads;
            const int64_t p0 = blk * PA_Q, np = n - p0 < PA_Q ? n - p0 : PA_Q;
            const float* kh = kt + h * D * npad;
            const vf* vh = vv + h * npad * NC;
#define ITEM(NCC, DT) prefill_item(qc, kh, vh, (char*)out, sc, qf, npad, p0, np, h, G, n_heads, q_stride, \
                                   scale, RP, NCC, DT)
#define ITEM_DT(NCC) switch (dt) { case 0: ITEM(NCC, 0); break; case 1: ITEM(NCC, 1); break; \
                                   default: ITEM(NCC, 2); break; }
            switch (NC) {
                case 4: ITEM_DT(4); break;
                case 8: ITEM_DT(8); break;
                default: ITEM_DT((int)NC); break;
            }
#undef ITEM_DT
#undef ITEM
        }
        free(sc);
        free(qf);
    }
    free(kt);
    free(vv);
    return failed ? -2 : 0;
}

/* ---- row-wise argmax of float32 logits [n, V]: the first index of each row's largest value ----
   (torch.argmax's answer for rows without NaN; -ffast-math compiles comparisons as if no NaN existed).
   Per lane the largest value so far and its first index, then the lanes' best, ties to the lower index. */
int argmax_rows(const float* x, int64_t n, int64_t V, int64_t* out, int num_threads) {
    if (n < 0 || V < 1) return -1;
    #pragma omp parallel for num_threads(num_threads) if (n * V >= 262144) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float* row = x + r * V;
        int64_t best_i = 0;
        float best = row[0];
        const int64_t nv = V / W * W;
        if (nv > 0) {
            vf bv; memcpy(&bv, row, sizeof bv);
            vi bi, idx;
            for (int l = 0; l < W; l++) { bi[l] = l; idx[l] = l; }
            for (int64_t i = W; i < nv; i += W) {
                vf v; memcpy(&v, row + i, sizeof v);
                idx += W;
                const vi gt = v > bv;  /* strictly larger: an equal later value keeps the earlier index */
                bv = (vf)(((vi)v & gt) | ((vi)bv & ~gt));  /* (C has no vector ?:) */
                bi = (idx & gt) | (bi & ~gt);
            }
            best = bv[0]; best_i = bi[0];
            for (int l = 1; l < W; l++)
                if (bv[l] > best || (bv[l] == best && bi[l] < best_i)) { best = bv[l]; best_i = bi[l]; }
        }
        for (int64_t i = nv; i < V; i++)
            if (row[i] > best) { best = row[i]; best_i = i; }
        out[r] = best_i;
    }
    return 0;
}

/* ---- seeded rows' exponential race: out[r] = argmax_j probs[r, j] / q_j, q_j = -log(u_j), u_j in (0, 1)
   the counter uniform of (keys[r], j) (engine.sampler.counter_uniform: murmur3's 64-bit finaliser of
   key + (j + 1) * golden gamma, top 24 bits, centred), q at least FLT_MIN. Noise, quotient and argmax in
   one pass over each row, RACE_CHUNK columns at a time (vector logf from libmvec); first index on ties.
   The torch form (engine.sampler.seeded_race) builds [n, V] int64 tensors: ~3 ms for 8 rows of 49k. */
#define RACE_CHUNK 1024
int seeded_race(const float* probs, const int64_t* keys, int64_t n, int64_t V, int64_t* out, int nthreads) {
    if (n < 0 || V < 1) return -1;
    #pragma omp parallel for num_threads(nthreads) if (n * V >= 65536) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float* row = probs + r * V;
        const uint64_t key = (uint64_t)keys[r];
        float val[RACE_CHUNK];
        float best = -1.f;
        int64_t best_i = 0;
        for (int64_t j0 = 0; j0 < V; j0 += RACE_CHUNK) {
            const int64_t len = V - j0 < RACE_CHUNK ? V - j0 : RACE_CHUNK;
            #pragma omp simd
            for (int64_t j = 0; j < len; j++) {
                uint64_t x = key + (uint64_t)(j0 + j + 1) * 0x9E3779B97F4A7C15ull;
                x = (x ^ (x >> 33)) * 0xFF51AFD7ED558CCDull;
                x = (x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53ull;
                x ^= x >> 33;
                const float u = ((float)(int32_t)(x >> 40) + 0.5f) * (1.0f / 16777216.0f);
                const float q = fmaxf(-logf(u), 1.17549435e-38f);
                val[j] = row[j0 + j] / q;
            }
            for (int64_t j = 0; j < len; j++)
                if (val[j] > best) { best = val[j]; best_i = j0 + j; }
        }
        out[r] = best_i;
    }
    return 0;
}

/* ---- fused elementwise ops of a decoder layer; rows [T, n] contiguous unless a stride is given ---- */

#define PAR_MIN_ELEMS 16384  /* below this one thread is faster than waking the pool */

/* x += res (rounded to the dtype, as a separate add would be), then h = x / rms(x) * w. res may be NULL. */
static inline void add_rms_norm_row(char* x, const char* res, char* h, const char* w, int64_t n, float eps,
                                    const int dt) {
    const int64_t esz = dt == 0 ? 4 : 2, nv = n / W * W;
    vf acc = {0};
    float tail = 0.f;
    for (int64_t i = 0; i < nv; i += W) {
        vf v = ld(x + i * esz, dt);
        if (res) { st(x + i * esz, v + ld(res + i * esz, dt), dt); v = ld(x + i * esz, dt); }
        acc += v * v;
    }
    for (int64_t i = nv; i < n; i++) {
        float v = ld1(x + i * esz, dt);
        if (res) { st1(x + i * esz, v + ld1(res + i * esz, dt), dt); v = ld1(x + i * esz, dt); }
        tail += v * v;
    }
    float ss = tail;
    for (int i = 0; i < W; i++) ss += acc[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < nv; i += W)
        st(h + i * esz, (ld(x + i * esz, dt) * inv) * ld(w + i * esz, dt), dt);
    for (int64_t i = nv; i < n; i++)
        st1(h + i * esz, (ld1(x + i * esz, dt) * inv) * ld1(w + i * esz, dt), dt);
}

int add_rms_norm(void* x, const void* res, void* h, const void* w, int64_t T, int64_t n, float eps, int dt,
                 int num_threads) {
    const int64_t esz = dt == 0 ? 4 : 2;
    #pragma omp parallel for num_threads(num_threads) if (T * n >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        char* xr = (char*)x + t * n * esz;
        const char* rr = res ? (const char*)res + t * n * esz : NULL;
        char* hr = (char*)h + t * n * esz;
        switch (dt) {
            case 0: add_rms_norm_row(xr, rr, hr, (const char*)w, n, eps, 0); break;
            case 1: add_rms_norm_row(xr, rr, hr, (const char*)w, n, eps, 1); break;
            default: add_rms_norm_row(xr, rr, hr, (const char*)w, n, eps, 2); break;
        }
    }
    return 0;
}

/* In place on each token's row of qkv [T, row_stride]: rotate the first n_rot heads (q then k) by RoPE,
   out = x * cos + swap_halves(x) * sin_signed; then copy the token's K (rotated) and V heads to the cache
   rows k_rows[t] and v_rows[t] of one layer viewed as rows of n_kv * D. */
static inline void rope_store_row(char* row, const char* c, const char* s, int64_t n_rot, int64_t n_kv,
                                  int64_t D, char* kv, int64_t k_row, int64_t v_row, const int dt) {
    const int64_t esz = dt == 0 ? 4 : 2, half = D / 2, n_q = n_rot - n_kv;
    float tmp[512], cs[512], sn[512];
    for (int64_t i = 0; i < D; i++) { cs[i] = ld1(c + i * esz, dt); sn[i] = ld1(s + i * esz, dt); }
    for (int64_t hd = 0; hd < n_rot; hd++) {
        char* x = row + hd * D * esz;
        for (int64_t i = 0; i < D; i++) tmp[i] = ld1(x + i * esz, dt);
        for (int64_t i = 0; i < half; i++) st1(x + i * esz, tmp[i] * cs[i] + tmp[i + half] * sn[i], dt);
        for (int64_t i = half; i < D; i++) st1(x + i * esz, tmp[i] * cs[i] + tmp[i - half] * sn[i], dt);
    }
    memcpy(kv + k_row * n_kv * D * esz, row + n_q * D * esz, n_kv * D * esz);
    memcpy(kv + v_row * n_kv * D * esz, row + n_rot * D * esz, n_kv * D * esz);
}

int rope_store(void* qkv, int64_t T, int64_t row_stride, int64_t n_rot, int64_t n_kv, int64_t D,
               const void* cos, const void* sin_signed, const int64_t* positions, void* kv,
               const int64_t* k_rows, const int64_t* v_rows, int dt, int num_threads) {
    if (D > 512 || D % 2) return -1;
    const int64_t esz = dt == 0 ? 4 : 2;
    #pragma omp parallel for num_threads(num_threads) if (T * row_stride >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        char* row = (char*)qkv + t * row_stride * esz;
        const char* c = (const char*)cos + positions[t] * D * esz;
        const char* s = (const char*)sin_signed + positions[t] * D * esz;
        switch (dt) {
            case 0: rope_store_row(row, c, s, n_rot, n_kv, D, (char*)kv, k_rows[t], v_rows[t], 0); break;
            case 1: rope_store_row(row, c, s, n_rot, n_kv, D, (char*)kv, k_rows[t], v_rows[t], 1); break;
            default: rope_store_row(row, c, s, n_rot, n_kv, D, (char*)kv, k_rows[t], v_rows[t], 2); break;
        }
    }
    return 0;
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I], out [T, I]. Chunks of float32 so the exp
   loop vectorizes (libmvec). */
#define SILU_CHUNK 256
static inline void silu_mul_row(const char* gu, char* out, int64_t I, const int dt) {
    const int64_t esz = dt == 0 ? 4 : 2;
    float g[SILU_CHUNK], e[SILU_CHUNK];
    for (int64_t i0 = 0; i0 < I; i0 += SILU_CHUNK) {
        const int64_t n = I - i0 < SILU_CHUNK ? I - i0 : SILU_CHUNK, nv = n / W * W;
        for (int64_t i = 0; i < nv; i += W) {
            vf v = ld(gu + (i0 + i) * esz, dt);
            memcpy(g + i, &v, sizeof v);
        }
        for (int64_t i = nv; i < n; i++) g[i] = ld1(gu + (i0 + i) * esz, dt);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) e[i] = expf(-g[i]);
        for (int64_t i = 0; i < nv; i += W) {
            vf gv, ev;
            memcpy(&gv, g + i, sizeof gv); memcpy(&ev, e + i, sizeof ev);
            st(out + (i0 + i) * esz, gv / (1.f + ev) * ld(gu + (I + i0 + i) * esz, dt), dt);
        }
        for (int64_t i = nv; i < n; i++)
            st1(out + (i0 + i) * esz, g[i] / (1.f + e[i]) * ld1(gu + (I + i0 + i) * esz, dt), dt);
    }
}

int silu_mul(const void* gu, void* out, int64_t T, int64_t I, int dt, int num_threads) {
    const int64_t esz = dt == 0 ? 4 : 2;
    #pragma omp parallel for num_threads(num_threads) if (T * I >= PAR_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char* g = (const char*)gu + t * 2 * I * esz;
        char* o = (char*)out + t * I * esz;
        switch (dt) {
            case 0: silu_mul_row(g, o, I, 0); break;
            case 1: silu_mul_row(g, o, I, 1); break;
            default: silu_mul_row(g, o, I, 2); break;
        }
    }
    return 0;
}

/* ---- matrix products for decode-sized batches: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) ----
   The weight is packed once at load (pack_linear_weight) into panels of LP = 2W output columns,
   [N / LP][K][LP] (N padded with zero columns), so a panel is one contiguous stream: each thread takes a
   contiguous run of panels and reads its weights exactly once from memory, whatever M. Within a panel,
   rows of x go LM_ROWS at a time: LM_ROWS x 2 vector accumulators, 2 weight vectors and one broadcast
   stay in registers (15 of AVX2's 16: the classic 6 x 16 micro-kernel; 8 rows with AVX-512's 32, which
   measured 1-7% faster at 8-256 rows in float32 on a Zen 5 EPYC), and the panel is re-read from
   cache for the next rows. Accumulation is float32 for every dtype, in k order, rounded once on store. */
#define LP (2 * W)
#if W == 16
#define LM_ROWS 8  /* AVX-512's 32 registers: 16 accumulators */
#else
#define LM_ROWS 6
#endif

/* rows x LP outputs of one panel. With few rows the FMA chains alone would wait on each other (latency x
   ports needs ~8 independent chains), so k is split over `splits` accumulator sets, summed at the end.
   wq: the panel holds int8 weights in groups of `group` k (1 byte each), and `scales` this panel's
   [ceil(K / group)][LP] float32 scales: each weight is widened and multiplied by its group's scale, so
   the kernel multiplies by exactly the float32 weights q * scale stand for. */
static inline vf ldq(const char* p) {  /* W int8 -> W floats (GCC's vector conversion goes lane by lane) */
    vf f;
#if W == 16 && defined(__AVX512F__)  /* SIMDe 0.8 lacks this one: its build widens as below */
    const __m512 r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    memcpy(&f, &r, sizeof f);
#elif W == 8 && defined(__AVX2__)
    const __m256 r = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    memcpy(&f, &r, sizeof f);
#else
    vb b; memcpy(&b, p, sizeof b);
    f = __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
    return f;
}

#define WT_I8 3  /* weight type code of int8 panels (0-2: the float dtype codes) */

/* One row of a panel's outputs (two accumulator vectors) plus bias, rounded once into y; nn < LP: the last,
   partial panel, whose padding columns are not stored. */
static inline void store_panel_row(char* yr, vf a0, vf a1, const char* bias, int64_t n0, int64_t nn,
                                   const int dt) {
    const int64_t esz = dt == 0 ? 4 : 2;
    if (nn == LP) {
        if (bias) { a0 += ld(bias + n0 * esz, dt); a1 += ld(bias + (n0 + W) * esz, dt); }
        st(yr, a0, dt);
        st(yr + W * esz, a1, dt);
        return;
    }
    float out[LP];
    memcpy(out, &a0, sizeof a0);
    memcpy(out + W, &a1, sizeof a1);
    for (int64_t j = 0; j < nn; j++)
        st1(yr + j * esz, out[j] + (bias ? ld1(bias + (n0 + j) * esz, dt) : 0.f), dt);
}

/* The next panel's bytes [pf, pf_end) are requested pf_lines cache lines per k step of a tile (see
   next_panel_share). */
#define PREFETCH_STEP(pf, pf_end, pf_lines) \
    for (int l_ = 0; l_ < (pf_lines) && (pf) < (pf_end); l_++, (pf) += 64) prefetch_line(pf);

/* While a panel is multiplied, the next one (next: its start, NULL for none) is requested into cache, so
   its first row tile finds it there: otherwise that tile waits on memory while the later tiles of every
   panel leave the bus idle (measured on a Zen 5 EPYC, bf16 products of SmolLM2's shapes: 1.3x at 32 rows,
   1.07x at 8). Tile `tile` of `tiles` requests its share of the next panel's bytes, spread over its
   `steps` k steps: sets [*pf, *pf_end) and returns the lines per step. */
static inline int next_panel_share(const char* next, int64_t bytes, int64_t tile, int64_t tiles,
                                   int64_t steps, const char** pf, const char** pf_end) {
    if (!next) { *pf = *pf_end = NULL; return 0; }
    const int64_t lo = tile * bytes / tiles / 64 * 64, hi = ((tile + 1) * bytes / tiles + 63) / 64 * 64;
    *pf = next + lo;
    *pf_end = next + (hi < bytes ? hi : bytes);
    const int64_t lines = (hi - lo + 63) / 64;
    return (int)((lines + steps - 1) / steps);
}

/* linear_packed's act 1 (silu_mul): a row of a gate/up panel, whose first W columns are gate columns and
   last W the same up columns, stored as silu(gate) * up (W outputs at yr). Gate and up are rounded to the
   dtype first and the rest is silu_mul_row's arithmetic, so the result is that of the unfused product
   followed by silu_mul, bit for bit. */
static inline void store_silu_row(char* yr, vf a0, vf a1, const char* bias, int64_t n0, const int dt) {
    const int64_t esz = dt == 0 ? 4 : 2;
    if (bias) { a0 += ld(bias + n0 * esz, dt); a1 += ld(bias + (n0 + W) * esz, dt); }
    char rounded[2 * W * 4];
    st(rounded, a0, dt);
    st(rounded + W * esz, a1, dt);
    a0 = ld(rounded, dt);
    a1 = ld(rounded + W * esz, dt);
    float g[W], e[W];
    memcpy(g, &a0, sizeof g);
    #pragma omp simd
    for (int i = 0; i < W; i++) e[i] = expf(-g[i]);
    vf ev;
    memcpy(&ev, e, sizeof ev);
    st(yr, a0 / (1.f + ev) * a1, dt);
}

/* Row r of a tile: y's row for the plain product (N columns), or, with act 1, its row of N / 2 outputs. */
static inline void store_tile_row(char* y, int64_t r, vf a0, vf a1, const char* bias, int64_t N, int64_t n0,
                                  int64_t nn, const int dt, const int act) {
    const int64_t esz = dt == 0 ? 4 : 2;
    if (act) store_silu_row(y + (r * (N / 2) + n0 / 2) * esz, a0, a1, bias, n0, dt);
    else store_panel_row(y + (r * N + n0) * esz, a0, a1, bias, n0, nn, dt);
}

static inline __attribute__((always_inline)) void linear_tile(
    const char* x, const char* wp, const float* scales, int64_t group, const char* bias, char* y, int64_t K,
    int64_t N, int64_t n0, int64_t nn, const int rows, const int splits, const int dt, const int wt,
    const char* pf, const char* pf_end, const int pf_lines, const int act)
{
    const int wq = wt == WT_I8;
    const int64_t esz = dt == 0 ? 4 : 2, wsz = wq ? 1 : wt == 0 ? 4 : 2, G = wq ? group : K;
    vf acc[4][LM_ROWS][2];
    for (int sp = 0; sp < splits; sp++)
        for (int r = 0; r < rows; r++) { acc[sp][r][0] = (vf){0}; acc[sp][r][1] = (vf){0}; }
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        const int64_t g1 = K - g0 < G ? K : g0 + G;
        vf s0 = (vf){0} + 1.f, s1 = s0;
        if (wq) {
            memcpy(&s0, scales + (g0 / G) * LP, sizeof s0);
            memcpy(&s1, scales + (g0 / G) * LP + W, sizeof s1);
        }
#define LOAD_W(k) \
        vf w0 = wq ? ldq(wp + (k) * LP) * s0 : ld(wp + ((k) * LP) * wsz, wt); \
        vf w1 = wq ? ldq(wp + (k) * LP + W) * s1 : ld(wp + ((k) * LP + W) * wsz, wt);
        const int64_t kmain = g0 + (g1 - g0) / splits * splits;
        for (int64_t k0 = g0; k0 < kmain; k0 += splits) {
            for (int sp = 0; sp < splits; sp++) {
                const int64_t k = k0 + sp;
                PREFETCH_STEP(pf, pf_end, pf_lines)
                LOAD_W(k)
                for (int r = 0; r < rows; r++) {
                    const vf xb = (vf){0} + ld1(x + (r * K + k) * esz, dt);
                    acc[sp][r][0] += xb * w0;
                    acc[sp][r][1] += xb * w1;
                }
            }
        }
        for (int64_t k = kmain; k < g1; k++) {
            PREFETCH_STEP(pf, pf_end, pf_lines)
            LOAD_W(k)
            for (int r = 0; r < rows; r++) {
                const vf xb = (vf){0} + ld1(x + (r * K + k) * esz, dt);
                acc[0][r][0] += xb * w0;
                acc[0][r][1] += xb * w1;
            }
        }
#undef LOAD_W
    }
    for (int sp = 1; sp < splits; sp++)
        for (int r = 0; r < rows; r++) { acc[0][r][0] += acc[sp][r][0]; acc[0][r][1] += acc[sp][r][1]; }
    for (int r = 0; r < rows; r++) store_tile_row(y, r, acc[0][r][0], acc[0][r][1], bias, N, n0, nn, dt, act);
}

#ifdef HAVE_BF16_DOT
#define LB_ROWS 8  /* rows per tile: 2 * LB_ROWS accumulators of AVX-512's 32 registers (measured: 6 and
                     12 were slower or no faster at 8-64 rows on a Zen 5 EPYC) */
/* bfloat16 panels in pair layout (pack_linear_weight with pairs, K even): [K / 2][LP][2], the weights of
   k and k + 1 of one column side by side, so an AVX512-BF16 dot product multiplies a broadcast pair of x
   by 16 columns' pairs straight from the panel (no widening pass: half the instructions per weight byte
   of linear_tile). Each product of two bfloat16 is exact in float32; the pair is summed into the float32
   accumulator (in k order within each of the `splits` accumulator sets), rounded once on store. */
static inline __attribute__((always_inline)) void linear_tile_bf16_pairs(
    const char* x, const char* wp, const char* bias, char* y, int64_t K, int64_t N, int64_t n0, int64_t nn,
    const int rows, const int splits, const char* pf, const char* pf_end, const int pf_lines, const int act)
{
    __m512 acc[4][LB_ROWS][2];
    for (int sp = 0; sp < splits; sp++)
        for (int r = 0; r < rows; r++) { acc[sp][r][0] = _mm512_setzero_ps(); acc[sp][r][1] = acc[sp][r][0]; }
    const int64_t KP = K / 2, kmain = KP / splits * splits;
#define PAIR_STEP(SP, KP_) { \
        const char* wk = wp + (KP_) * LP * 4; \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 64); \
        PREFETCH_STEP(pf, pf_end, pf_lines) \
        for (int r = 0; r < rows; r++) { \
            int32_t xp; memcpy(&xp, x + (r * K + 2 * (KP_)) * 2, sizeof xp); \
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp); \
            acc[SP][r][0] = _mm512_dpbf16_ps(acc[SP][r][0], xb, w0); \
            acc[SP][r][1] = _mm512_dpbf16_ps(acc[SP][r][1], xb, w1); \
        } }
    for (int64_t k0 = 0; k0 < kmain; k0 += splits)
        for (int sp = 0; sp < splits; sp++) PAIR_STEP(sp, k0 + sp)
    for (int64_t kp = kmain; kp < KP; kp++) PAIR_STEP(0, kp)
#undef PAIR_STEP
    for (int sp = 1; sp < splits; sp++)
        for (int r = 0; r < rows; r++) {
            acc[0][r][0] = _mm512_add_ps(acc[0][r][0], acc[sp][r][0]);
            acc[0][r][1] = _mm512_add_ps(acc[0][r][1], acc[sp][r][1]);
        }
    for (int r = 0; r < rows; r++) {
        vf a0, a1;
        memcpy(&a0, &acc[0][r][0], sizeof a0);
        memcpy(&a1, &acc[0][r][1], sizeof a1);
        store_tile_row(y, r, a0, a1, bias, N, n0, nn, 1, act);
    }
}

static void linear_rows_bf16_pairs(const char* x, const char* w, const char* bias, char* y, int64_t M,
                                   int64_t K, int64_t N, int64_t n0, int64_t nn, const char* next,
                                   int64_t next_bytes, const int act)
{
    const int64_t tiles = (M + LB_ROWS - 1) / LB_ROWS, ycols = act ? N / 2 : N;
    for (int64_t m0 = 0; m0 < M; m0 += LB_ROWS) {
        const char* xm = x + m0 * K * 2;
        char* ym = y + m0 * ycols * 2;
        const char *pf, *pf_end;
        const int pf_lines = next_panel_share(next, next_bytes, m0 / LB_ROWS, tiles, K / 2, &pf, &pf_end);
#define TILE(R, S) linear_tile_bf16_pairs(xm, w, bias, ym, K, N, n0, nn, R, S, pf, pf_end, pf_lines, act)
#define TILE_NO_PF(R, S) linear_tile_bf16_pairs(xm, w, bias, ym, K, N, n0, nn, R, S, NULL, NULL, 0, act)
        switch (M - m0 < LB_ROWS ? (int)(M - m0) : LB_ROWS) {  /* constant row counts: registers */
            case 1: TILE_NO_PF(1, 4); break;  /* 1-3 rows: one tile, bound by memory; the prefetches cost */
            case 2: TILE_NO_PF(2, 2); break;  /* more than they bring (measured at 1 row: 0.91x) */
            case 3: TILE_NO_PF(3, 2); break;
            case 4: TILE(4, 1); break;
            case 5: TILE(5, 1); break;
            case 6: TILE(6, 1); break;
            case 7: TILE(7, 1); break;
            default: TILE(LB_ROWS, 1); break;
        }
#undef TILE
#undef TILE_NO_PF
    }
}
#endif

/* Whether pack_linear_weight lays bfloat16 weights of K inputs out in pairs (linear_tile_bf16_pairs): on
   builds with AVX512-BF16 dot products, for even K. */
int linear_bf16_pairs(int64_t K) {
#ifdef HAVE_BF16_DOT
    return K % 2 == 0;
#else
    (void)K;
    return 0;
#endif
}

/* int8 panel [K][LP] -> float32 [K][LP] in buf: each weight times its group's scale (as linear_tile does in
   registers), so the row tiles that follow re-read floats from cache instead of converting again. */
static void dequantize_panel(const char* w, const float* scales, int64_t group, int64_t K, float* buf) {
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        const int64_t g1 = K - g0 < group ? K : g0 + group;
        vf s0, s1;
        memcpy(&s0, scales + (g0 / group) * LP, sizeof s0);
        memcpy(&s1, scales + (g0 / group) * LP + W, sizeof s1);
        for (int64_t k = g0; k < g1; k++) {
            const vf w0 = ldq(w + k * LP) * s0, w1 = ldq(w + k * LP + W) * s1;
            memcpy(buf + k * LP, &w0, sizeof w0);
            memcpy(buf + k * LP + W, &w1, sizeof w1);
        }
    }
}

static inline __attribute__((always_inline)) void linear_rows(
    const char* x, const char* w, const float* s, int64_t group, const char* bias, char* y, int64_t M,
    int64_t K, int64_t N, int64_t n0, int64_t nn, const int dt, const int wt, const char* next,
    int64_t next_bytes, const int act)
{
    const int64_t tiles = (M + LM_ROWS - 1) / LM_ROWS, ycols = act ? N / 2 : N;
    for (int64_t m0 = 0; m0 < M; m0 += LM_ROWS) {
        const char* xm = x + m0 * K * (dt == 0 ? 4 : 2);
        char* ym = y + m0 * ycols * (dt == 0 ? 4 : 2);
        const char *pf, *pf_end;
        const int pf_lines = next_panel_share(next, next_bytes, m0 / LM_ROWS, tiles, K, &pf, &pf_end);
#define TILE(R, S) \
    linear_tile(xm, w, s, group, bias, ym, K, N, n0, nn, R, S, dt, wt, pf, pf_end, pf_lines, act)
#define TILE_NO_PF(R, S) \
    linear_tile(xm, w, s, group, bias, ym, K, N, n0, nn, R, S, dt, wt, NULL, NULL, 0, act)
        switch (M - m0 < LM_ROWS ? (int)(M - m0) : LM_ROWS) {  /* constant row counts: registers */
            case 1: TILE_NO_PF(1, 4); break;  /* as in linear_rows_bf16_pairs */
            case 2: TILE_NO_PF(2, 2); break;
            case 3: TILE_NO_PF(3, 2); break;
            case 4: TILE(4, 1); break;
            case 5: TILE(5, 1); break;
#if LM_ROWS > 6
            case 6: TILE(6, 1); break;
            case 7: TILE(7, 1); break;
#endif
            default: TILE(LM_ROWS, 1); break;
        }
#undef TILE
#undef TILE_NO_PF
    }
}

/* One panel for all M rows. int8 panels with more than two tiles of rows are dequantised once into buf
   (K * LP floats) and multiplied as float32 weights; with one tile they are widened in registers. */
static inline __attribute__((always_inline)) void linear_panel(
    const char* x, const char* wp, const float* scales, int64_t group, const char* bias, char* y, int64_t M,
    int64_t K, int64_t N, int64_t p, const int dt, const int wq, float* buf, const int act)
{
    const int64_t wsz = wq ? 1 : dt == 0 ? 4 : 2, n0 = p * LP, nn = N - n0 < LP ? N - n0 : LP;
    const int64_t bytes = K * LP * wsz;
    const char* w = wp + p * bytes;
    const char* next = n0 + LP < N ? w + bytes : NULL;  /* the next panel, prefetched meanwhile */
#ifdef HAVE_BF16_DOT
    if (!wq && dt == 1 && linear_bf16_pairs(K)) {
        linear_rows_bf16_pairs(x, w, bias, y, M, K, N, n0, nn, next, bytes, act);
        return;
    }
#endif
    if (!wq) { linear_rows(x, w, NULL, K, bias, y, M, K, N, n0, nn, dt, dt, next, bytes, act); return; }
    const float* s = scales + p * ((K + group - 1) / group) * LP;
    if (M > 2 * LM_ROWS && buf) {
        dequantize_panel(w, s, group, K, buf);
        linear_rows(x, (const char*)buf, NULL, K, bias, y, M, K, N, n0, nn, dt, 0, next, bytes, act);
    } else {
        linear_rows(x, w, s, group, bias, y, M, K, N, n0, nn, dt, WT_I8, next, bytes, act);
    }
}

/* x [M, K], y [M, N] contiguous in dtype dt; wp from pack_linear_weight; bias [N] or NULL.
   scales NULL: wp holds weights in dtype dt. Else wp holds int8 weights (pack_linear_weight with esz 1)
   and scales [ceil(N / LP)][ceil(K / group)][LP] float32: weight[n, k] = q[n, k] * scale(n, k / group).
   act 1 (silu_mul, N a multiple of LP): each panel's first W columns are gate columns and its last W the
   matching up columns, and y [M, N / 2] receives silu(gate) * up (store_silu_row) instead of the product. */
int linear_packed(const void* x, const void* wp, const void* scales, const void* bias, void* y, int64_t M,
                  int64_t K, int64_t N, int64_t group, int dt, int act, int num_threads) {
    if (dt < 0 || dt > 2 || M < 0 || K < 1 || N < 1 || (scales && group < 1)) return -1;
    if (act < 0 || act > 1 || (act && N % LP)) return -1;
    const int64_t panels = (N + LP - 1) / LP;
    const char *xc = (const char*)x, *wc = (const char*)wp, *bc = (const char*)bias;
    const float* sc = (const float*)scales;
    const int scratch = sc && M > 2 * LM_ROWS;
    #pragma omp parallel num_threads(num_threads) if (panels >= 2 * num_threads)
    {
        /* NULL (no scratch, or no memory): the int8 panels are widened in registers instead */
        const size_t bytes = ((size_t)K * LP * sizeof(float) + 63) / 64 * 64;
        float* buf = scratch ? (float*)aligned_alloc(64, bytes) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (sc) {
                switch (dt) {
                    case 0: linear_panel(xc, wc, sc, group, bc, (char*)y, M, K, N, p, 0, 1, buf, act); break;
                    case 1: linear_panel(xc, wc, sc, group, bc, (char*)y, M, K, N, p, 1, 1, buf, act); break;
                    default: linear_panel(xc, wc, sc, group, bc, (char*)y, M, K, N, p, 2, 1, buf, act); break;
                }
            } else {
                switch (dt) {
                    case 0: linear_panel(xc, wc, sc, K, bc, (char*)y, M, K, N, p, 0, 0, NULL, act); break;
                    case 1: linear_panel(xc, wc, sc, K, bc, (char*)y, M, K, N, p, 1, 0, NULL, act); break;
                    default: linear_panel(xc, wc, sc, K, bc, (char*)y, M, K, N, p, 2, 0, NULL, act); break;
                }
            }
        }
        free(buf);
    }
    return 0;
}

/* Row-major w [N, K] -> panels [ceil(N / LP)][K][LP], zero-padded (any dtype: element bytes esz). pairs
   (bfloat16 where linear_bf16_pairs(K)): each panel [K / 2][LP][2] instead, k and k + 1 side by side. */
int pack_linear_weight(const void* w, void* out, int64_t N, int64_t K, int64_t esz, int pairs) {
    if (pairs && (esz != 2 || K % 2)) return -1;
    const int64_t panels = (N + LP - 1) / LP;
    const char* src = (const char*)w;
    char* dst = (char*)out;
    memset(dst, 0, panels * K * LP * esz);
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = n / LP, j = n % LP;
        for (int64_t k = 0; k < K; k++) {
            const int64_t at = pairs ? (k / 2 * LP + j) * 2 + k % 2 : k * LP + j;
            memcpy(dst + (p * K * LP + at) * esz, src + (n * K + k) * esz, esz);
        }
    }
    return 0;
}

int linear_panel_width(void) { return LP; }

/* Float32 FLOPs done by num_threads threads, each running `iters` rounds of PEAK_CHAINS independent FMA
   chains on the widest native vectors (enough chains to cover FMA latency times the FMA ports of current
   x86 and Arm cores). a = a * m + c stays near c / (1 - m), so no value grows or turns subnormal.
   *sink receives a sum of the results, so the loop cannot be removed. */
#if defined(__AVX512F__)  /* the native width: an emulated AVX-512 build measures nothing real */
#define PEAK_BYTES 64
#else
#define PEAK_BYTES 32
#endif
#define PEAK_CHAINS 12
typedef float vpk __attribute__((vector_size(PEAK_BYTES)));

double fma_peak(int64_t iters, int num_threads, float* sink) {
    const int lanes = PEAK_BYTES / 4;
    float total = 0.f;
    #pragma omp parallel num_threads(num_threads) reduction(+:total)
    {
        vpk a[PEAK_CHAINS];
        const vpk m = (vpk){0} + 0.999999f, c = (vpk){0} + 1e-7f;
        for (int k = 0; k < PEAK_CHAINS; k++) a[k] = (vpk){0} + (float)k;
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < PEAK_CHAINS; k++) a[k] = a[k] * m + c;
        for (int k = 0; k < PEAK_CHAINS; k++)
            for (int l = 0; l < lanes; l++) total += a[k][l];
    }
    *sink = total;
    return 2.0 * lanes * PEAK_CHAINS * (double)iters * num_threads;
}

/* FLOPs of PEAK_CHAINS independent vdpbf16ps chains per thread (each float lane: two bfloat16 products and
   two adds), as fma_peak. a += 1.0 * 2^-20 twice a round: no value grows large or turns subnormal. 0 where
   the build has no native AVX512-BF16 (SIMDe's emulation would measure nothing real). */
double bf16_dot_peak(int64_t iters, int num_threads, float* sink) {
#if defined(HAVE_BF16_DOT) && !defined(PDSERVE_SIMDE_AVX512)
    float total = 0.f;
    #pragma omp parallel num_threads(num_threads) reduction(+:total)
    {
        __m512 a[PEAK_CHAINS];
        const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3580);
        for (int k = 0; k < PEAK_CHAINS; k++) a[k] = _mm512_set1_ps((float)k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < PEAK_CHAINS; k++) a[k] = _mm512_dpbf16_ps(a[k], x, y);
        for (int k = 0; k < PEAK_CHAINS; k++) total += _mm512_reduce_add_ps(a[k]);
    }
    *sink = total;
    return 4.0 * 16 * PEAK_CHAINS * (double)iters * num_threads;
#else
    (void)iters; (void)num_threads;
    *sink = 0.f;
    return 0.0;
#endif
}
"""
