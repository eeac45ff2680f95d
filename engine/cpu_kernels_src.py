"""C source of the CPU kernels (compiled and loaded by ``engine.cpu_kernels``).

Plain C11 with GCC vector extensions (16 floats per vector; the compiler maps
them to AVX-512, AVX2 or NEON), OpenMP for threads, and float32 arithmetic for
every dtype: float32, bfloat16 and float16 rows are widened on load and
rounded to nearest even on store.

Kernels (all return 0, or < 0 for unsupported shapes):
- ``paged_decode_attention``: one query token per sequence against its paged K/V.
- ``add_rms_norm``: ``x += res`` then ``h = rmsnorm(x) * w`` (residual add fused into the next norm).
- ``rope_store``: RoPE on the q and k heads of ``qkv`` in place, then K and V rows into the cache.
- ``silu_mul``: ``silu(gate) * up`` from the fused gate_up output.
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#define W 16      /* floats per vector */

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef _Float16 vhf __attribute__((vector_size(32)));

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
    /* bfloat16: round to nearest even as torch does; NaN stays a (quiet) NaN. */
    vu u; memcpy(&u, &r, sizeof u);
    const vu is_nan = (u & 0x7fffffffu) > 0x7f800000u;  /* all-ones lanes where NaN */
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu quiet = (u >> 16) | 0x40u;
    vh h = __builtin_convertvector((rounded & ~is_nan) | (quiet & is_nan), vh);
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

/* out[t] = sum of the lanes of v[t] for 16 vectors: a transpose-and-add tree (15 shuffle pairs)
   instead of 16 horizontal sums. */
static inline vf reduce16(const vf* v) {
    /* Step k pairs vectors holding 2^(k-1) tokens each and adds the two halves of every token's lanes. */
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

/* Pointer to token j's row (K, or V when vsel is 1) at element offset hoff within the row. */
static inline const char* row_ptr(const char* kv, const int64_t* table, int64_t j, int64_t B,
                                  int64_t tok_stride, int64_t block_stride, int64_t hoff, int vsel,
                                  int64_t esz) {
    return kv + (table[j / B] * block_stride + (vsel * B + j % B) * tok_stride + hoff) * esz;
}

/* Load heads [h0, h0 + nh) of the K or V rows of tokens [j0, j0 + n) into buf[t][hh][c] (float32);
   zero the rest of the 16-token group. The heads of a token are adjacent, so a block is read as one
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

/* One sequence, KV heads [h0, h0 + nh): their nh * G query heads against its len cached tokens.
   Scratch: qv and acc [nh * G][NC], buf [W][nh][NC] vectors; s [nh * G][len rounded up to 16] and
   inv [nh * G] floats. */
static inline __attribute__((always_inline)) void decode_seq(
    const char* kv, const char* qrow, char* orow, const int64_t* table, int64_t len, int64_t B, int64_t G,
    int64_t h0, int64_t nh, int64_t tok_stride, int64_t block_stride, float scale, float* s, float* inv,
    vf* qv, vf* acc, vf* buf, const int dt, const int NC)
{
    const int64_t esz = dt == 0 ? 4 : 2, D = (int64_t)NC * W, hoff = h0 * D, nq = nh * G;
    const int64_t groups = (len + W - 1) / W, s_stride = groups * W;
    const char* q0 = qrow + h0 * G * D * esz;  /* query heads of KV head h are h * G .. h * G + G - 1 */
    for (int64_t i = 0; i < nq; i++)
        for (int c = 0; c < NC; c++) qv[i * NC + c] = ld(q0 + (i * D + c * W) * esz, dt) * scale;

    for (int64_t gi = 0; gi < groups; gi++) {  /* scores */
        const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
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
            vf r = reduce16(part);
            memcpy(s + i * s_stride + j0, &r, sizeof r);
        }
    }
    for (int64_t i = 0; i < nq; i++) {  /* softmax over the len valid scores */
        float* si = s + i * s_stride;
        float mx = si[0], sum = 0.f;
        for (int64_t j = 1; j < len; j++) mx = si[j] > mx ? si[j] : mx;
        for (int64_t j = 0; j < len; j++) { si[j] = expf(si[j] - mx); sum += si[j]; }
        inv[i] = 1.f / sum;
        for (int c = 0; c < NC; c++) acc[i * NC + c] = (vf){0};
    }
    for (int64_t gi = 0; gi < groups; gi++) {  /* probabilities x V */
        const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
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

/* kv: one layer [N, 2, B, Hkv, D]; q: [bsz, q_row_stride] rows, head i at i * D; out: [bsz, H * D];
   tables: [bsz, max_blocks]; lens: [bsz] tokens to attend (position + 1). Returns 0, -1 for unsupported
   shapes, -2 when out of memory. */
int paged_decode_attention(const void* kv, const void* q, void* out, const int64_t* tables,
                           const int64_t* lens, int64_t bsz, int64_t max_blocks, int64_t B, int64_t n_heads,
                           int64_t n_kv_heads, int64_t D, int64_t q_row_stride, int64_t max_len, float scale,
                           int dt, int num_threads)
{
    const int64_t G = n_heads / n_kv_heads;
    if (D % W || n_heads % n_kv_heads || dt < 0 || dt > 2) return -1;
    const int64_t tok_stride = n_kv_heads * D, block_stride = 2 * B * tok_stride, esz = dt == 0 ? 4 : 2;
    const int64_t NC = D / W;
    /* With enough sequences each item is a whole sequence, so every block is streamed once as one
       contiguous span; otherwise items are (sequence, KV head) pairs, for parallelism. */
    const int64_t nh = bsz >= 2 * num_threads ? n_kv_heads : 1, items = bsz * (n_kv_heads / nh);
    const int64_t s_len = nh * G * ((max_len + W - 1) / W) * W;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float* s = (float*)malloc(sizeof(float) * (s_len + nh * G));
        vf* vecs = (vf*)aligned_alloc(64, sizeof(vf) * NC * (2 * nh * G + W * nh));
        if (!s || !vecs) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!s || !vecs) continue;
            const int64_t b = item / (n_kv_heads / nh), h0 = (item % (n_kv_heads / nh)) * nh;
            const char* qrow = (const char*)q + b * q_row_stride * esz;
            char* orow = (char*)out + b * n_heads * D * esz;
            const int64_t* table = tables + b * max_blocks;
            vf* qv = vecs; vf* acc = qv + nh * G * NC; vf* buf = acc + nh * G * NC;
#define SEQ(DT, NCC) decode_seq((const char*)kv, qrow, orow, table, lens[b], B, G, h0, nh, tok_stride, \
                                block_stride, scale, s, s + s_len, qv, acc, buf, DT, NCC)
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
"""
