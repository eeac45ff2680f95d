
/* ---- matrix products for decode-sized batches: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) ----
   The weight is packed once at load (pack_linear_weight) into panels of LP = 2W output columns,
   [N / LP][K][LP] (N padded with zero columns), so a panel is one contiguous stream: each thread takes a
   contiguous run of panels and reads its weights exactly once from memory, whatever M. Within a panel,
   rows of x go up to LM_ROWS at a time (the M rows shared evenly by the tiles): LM_ROWS x 2 vector
   accumulators, 2 weight vectors and one broadcast stay in registers (15 of AVX2's 16: the classic
   6 x 16 micro-kernel; 12 rows with AVX-512's 32), and the panel is re-read from cache for the next rows.
   A second tile's products do not overlap the weights' stream from memory, so a tile as tall as the
   registers allow matters where a batch is just past a tile: on a Zen 4 EPYC (float32, SmolLM2's
   shapes), 9-12 rows took 0.75-0.86x the time in tiles of 12 that they took in tiles of 8, and 8, 16
   and 24-40 rows the same or a few percent less. Accumulation is float32 for
   every dtype, in k order, rounded once on store. */
#define LP (2 * W)
#if W == 16
#define LM_ROWS 12  /* AVX-512's 32 registers: 24 accumulators */
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

/* The products of a tile of `rows` rows of x by one panel, into out[r][0..1] (unrounded float32). */
static inline __attribute__((always_inline)) void linear_tile_acc(
    const char* x, const char* wp, const float* scales, int64_t group, int64_t K, const int rows,
    const int splits, const int dt, const int wt, const char* pf, const char* pf_end, const int pf_lines,
    vf out[LM_ROWS][2])
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
    for (int r = 0; r < rows; r++) { out[r][0] = acc[0][r][0]; out[r][1] = acc[0][r][1]; }
}

/* linear_tile_acc for each row count (with its accumulator splits, linear_rows') in a function of its own
   per dtype pair. Inlined into linear_packed's body, or beside the stores (whose SiLU calls expf, which
   clobbers every vector register), GCC spilled an accumulator of the full AVX2 tile, and the store and
   reload in every k step made the chain through it the bound, far below the FMA peak. */
#if LM_ROWS > 6
#define MORE_ROW_CASES(DT, WT) \
        case 6: linear_tile_acc(x, wp, scales, group, K, 6, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        case 7: linear_tile_acc(x, wp, scales, group, K, 7, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        case 8: linear_tile_acc(x, wp, scales, group, K, 8, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        case 9: linear_tile_acc(x, wp, scales, group, K, 9, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        case 10: linear_tile_acc(x, wp, scales, group, K, 10, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        case 11: linear_tile_acc(x, wp, scales, group, K, 11, 1, DT, WT, pf, pf_end, pf_lines, out); break;
#else
#define MORE_ROW_CASES(DT, WT)
#endif
#define TILE_ACC_FN(DT, WT) \
    static __attribute__((noinline)) void linear_tile_acc_##DT##_##WT( \
        const char* x, const char* wp, const float* scales, int64_t group, int64_t K, const int rows, \
        const char* pf, const char* pf_end, const int pf_lines, vf out[LM_ROWS][2]) { \
        switch (rows) { \
        case 1: linear_tile_acc(x, wp, scales, group, K, 1, 4, DT, WT, NULL, NULL, 0, out); break; \
        case 2: linear_tile_acc(x, wp, scales, group, K, 2, 2, DT, WT, NULL, NULL, 0, out); break; \
        case 3: linear_tile_acc(x, wp, scales, group, K, 3, 2, DT, WT, NULL, NULL, 0, out); break; \
        case 4: linear_tile_acc(x, wp, scales, group, K, 4, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        case 5: linear_tile_acc(x, wp, scales, group, K, 5, 1, DT, WT, pf, pf_end, pf_lines, out); break; \
        MORE_ROW_CASES(DT, WT) \
        default: linear_tile_acc(x, wp, scales, group, K, LM_ROWS, 1, DT, WT, pf, pf_end, pf_lines, out); \
        } \
    }
TILE_ACC_FN(0, 0)
TILE_ACC_FN(1, 1)
TILE_ACC_FN(2, 2)
TILE_ACC_FN(1, 0)
TILE_ACC_FN(2, 0)
TILE_ACC_FN(0, 3)
TILE_ACC_FN(1, 3)
TILE_ACC_FN(2, 3)
#undef TILE_ACC_FN
#undef MORE_ROW_CASES

/* `rows` rows of x (rows <= LM_ROWS) by one panel, stored into y (store_tile_row). 1-3 rows: bound by
   memory, without prefetches (as in linear_rows_bf16_pairs), and with k split over 4 or 2 accumulator
   sets, as the FMA chains alone would wait on each other. */
static inline __attribute__((always_inline)) void linear_tile(
    const char* x, const char* wp, const float* scales, int64_t group, const char* bias, char* y, int64_t K,
    int64_t N, int64_t n0, int64_t nn, const int rows, const int dt, const int wt, const char* pf,
    const char* pf_end, const int pf_lines, const int act)
{
    vf out[LM_ROWS][2];
#define ACC(DT, WT) linear_tile_acc_##DT##_##WT(x, wp, scales, group, K, rows, pf, pf_end, pf_lines, out)
    if (wt == WT_I8) {
        if (dt == 0) ACC(0, 3); else if (dt == 1) ACC(1, 3); else ACC(2, 3);
    } else if (wt == 0) {
        if (dt == 0) ACC(0, 0); else if (dt == 1) ACC(1, 0); else ACC(2, 0);
    } else if (dt == 1) {
        ACC(1, 1);
    } else {
        ACC(2, 2);
    }
#undef ACC
    for (int r = 0; r < rows; r++) store_tile_row(y, r, out[r][0], out[r][1], bias, N, n0, nn, dt, act);
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
    /* The rows shared evenly by the tiles (32 rows on AVX2: 6, 6, 5, 5, 5, 5), not full tiles and a short
       last one: a tile of fewer than 4 rows takes about as long as one of 4 (FMA latency). */
    for (int64_t m0 = 0, t = 0; m0 < M; t++) {
        const char* xm = x + m0 * K * (dt == 0 ? 4 : 2);
        char* ym = y + m0 * ycols * (dt == 0 ? 4 : 2);
        const char *pf, *pf_end;
        const int pf_lines = next_panel_share(next, next_bytes, t, tiles, K, &pf, &pf_end);
        const int rows = (int)(M / tiles + (t < M % tiles));
        linear_tile(xm, w, s, group, bias, ym, K, N, n0, nn, rows, dt, wt, pf, pf_end, pf_lines, act);
        m0 += rows;
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
