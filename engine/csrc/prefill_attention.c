
/* ---- causal attention of fresh prompt tokens (no cached prefix) ----
   q: [n] rows q_stride elements apart, query head i at i * D; k, v: [n] rows kv_stride apart, KV head h
   at h * D; out: [n, H * D] contiguous. First every KV head's K is widened to float32 and transposed in
   tiles of W keys, kt[h][j / W][d][W] (a vector holds W keys' d-th element, and a tile is one contiguous
   D x W block: a plain [d][j] transpose put the rows of one tile a whole prompt apart, all in the same
   few L1 sets), and V widened, vv[h][j][D] (float32 V is read in place). Then items = (KV head, block of
   PA_Q positions) with the block's G query heads as rows: scores by broadcast-FMA over W-key tiles (no
   horizontal sums), a causal softmax per row in float32 (an inlined vector exp), P x V by broadcast-FMA
   over V rows into float32 sums, every key loop stopping at the last key its rows may see. Scores and
   P x V go through the keys in chunks small enough for L1, every row group over one chunk before the
   next. Head sizes of 4 and 8 vectors are compiled as constants, so the accumulators stay in registers.
   Largest blocks first, dynamic schedule.
   prefill_attention_paged: the same for new tokens that continue a cached prefix: queries at positions
   [start, start + n), keys [0, start + n) read through a block table from one layer of the paged cache
   (which already holds the new tokens' K/V), widened the same way. */
#define PA_Q 32
/* Score register group: PA_SR rows x PA_KT key tiles. With 16 registers (W == 8), 6 rows x 2 tiles keep 12
   FMA chains in flight for 8 loads a step (8 rows x 1 tile: 8 chains for 9 loads). */
#if W == 16
#define PA_SR 8
#define PA_KT 1
#else
#define PA_SR 6
#define PA_KT 2
#endif
#ifndef PA_KC
#define PA_KC 64  /* keys per L1 chunk (a multiple of PA_KT * W) */
#endif

/* Key j's K (vsel 0) or V (vsel 1) row of KV head h: from contiguous k / v rows kv_stride apart, or,
   with a table, from the paged cache layer kv [N, 2, B, Hkv, D]. */
typedef struct {
    const char *k, *v;  /* contiguous rows (table NULL) */
    int64_t kv_stride;
    const char* kv;  /* paged layer (table set) */
    const int64_t* table;
    int64_t B, tok_stride;
} key_src_t;

static inline const char* key_row(const key_src_t* ks, int64_t j, int64_t h, int64_t D, int vsel,
                                  int64_t esz) {
    if (!ks->table) return (vsel ? ks->v : ks->k) + (j * ks->kv_stride + h * D) * esz;
    const int64_t B = ks->B, row = (ks->table[j / B] * 2 + vsel) * B + j % B;
    return ks->kv + (row * ks->tok_stride + h * D) * esz;
}

/* e^x for x <= 0 (a softmax's terms) in float32 vectors, inlined (libmvec's expf is a call per vector):
   Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial in r times 2^n; x below -87 is
   read as -87 (e^-87 < 2e-38 adds nothing next to the row's largest term, 1). */
static inline vf exp_nonpos(vf x) {
    const vi low = x < -87.f;
    x = (vf)(((vi)x & ~low) | ((vi)((vf){0} - 87.f) & low));
    const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  /* truncates: ceil(y - 1/2) */
    const vf fn = __builtin_convertvector(n, vf);
    const vf r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    return p * (vf)((n + 127) << 23);
}

/* P x V for rows [r0, r0 + nr) (nr <= PVR), column vectors [c0, c0 + PVC) and keys [j0, j1) of one item
   (vrow[j - j0]: key j's V row), added to the float32 sums acc [rows][D]; rows beyond nr repeat row r0
   and are not stored. */
static inline __attribute__((always_inline)) void prefill_pv_group(
    const float* sc, const float* const* vrow, float* acc, int64_t npad, int64_t r0, int64_t nr, int64_t j0,
    int64_t j1, int64_t c0, const int PVR, const int PVC, const int NC)
{
    const int64_t D = (int64_t)NC * W;
    vf a[16][4];
    const float* pr[16];
    for (int i = 0; i < PVR; i++) {
        pr[i] = sc + (r0 + (i < nr ? i : 0)) * npad;
        const float* ar = acc + (r0 + (i < nr ? i : 0)) * D + c0 * W;
        for (int c = 0; c < PVC; c++) memcpy(&a[i][c], ar + c * W, sizeof(vf));
    }
    for (int64_t j = j0; j < j1; j++) {
        vf vj[4];
        for (int c = 0; c < PVC; c++) memcpy(&vj[c], vrow[j - j0] + (c0 + c) * W, sizeof(vf));
        for (int i = 0; i < PVR; i++) {
            const float pj = pr[i][j];
            for (int c = 0; c < PVC; c++) a[i][c] += pj * vj[c];
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < PVC; c++) memcpy(acc + (r0 + i) * D + (c0 + c) * W, &a[i][c], sizeof(vf));
}

/* One item: KV head h, positions [p0, p0 + np). sc: [rows rounded up to PA_SR][npad] scores, then
   [rows] inverse sums; qf: [rows rounded up to PA_SR][D] scaled float32 queries. */
static inline __attribute__((always_inline)) void prefill_item(
    const char* qc, const float* kh, const vf* vh, const key_src_t* ks, char* out, float* sc, float* qf,
    int64_t npad, int64_t p0, int64_t np, int64_t q0, int64_t qblock, int64_t h, int64_t G, int64_t n_heads,
    int64_t q_stride, float scale, int64_t RP, const int NC, const int dt)
{
    /* p0: the block's first position (keys 0 .. p0 + r / G for row r); q0: its row in q and out */
    const int64_t D = (int64_t)NC * W, esz = dt == 0 ? 4 : 2, rows = np * G;
    const int64_t rows_p = (rows + PA_SR - 1) / PA_SR * PA_SR;
    float* inv = sc + RP * npad;
    for (int64_t r = 0; r < rows; r++) {  /* row r: position p0 + r / G, query head h * G + r % G */
        const char* qr = qc + ((q0 + r / G) * q_stride + (h * G + r % G) * D) * esz;
        for (int c = 0; c < NC; c++) {
            const vf x = ld(qr + c * W * esz, dt) * scale;
            memcpy(qf + r * D + c * W, &x, sizeof x);
        }
    }
    memset(qf + rows * D, 0, sizeof(float) * (rows_p - rows) * D);
    /* Keys in chunks of PA_KC, every row group over one chunk before the next: the chunk's K (and below,
       its V and scores) stays in L1 while all rows use it. */
    for (int64_t k0 = 0; k0 < npad; k0 += PA_KC)
    for (int64_t r0 = 0; r0 < rows; r0 += PA_SR) {  /* scores of PA_SR rows, PA_KT x W keys at a time */
        const int64_t nr = rows - r0 < PA_SR ? rows - r0 : PA_SR;
        const int64_t nk = p0 + (r0 + nr - 1) / G + 1;  /* keys the group's last row sees */
        const int64_t k1 = nk < k0 + PA_KC ? nk : k0 + PA_KC;
        for (int64_t j0 = k0; j0 < k1; j0 += PA_KT * W) {  /* npad is whole groups of PA_KT tiles */
            const float* tile = kh + j0 * D;  /* PA_KT tiles [D][W], one after the other */
            vf a[PA_SR][PA_KT];
            for (int i = 0; i < PA_SR; i++)
                for (int t = 0; t < PA_KT; t++) a[i][t] = (vf){0};
            for (int64_t d = 0; d < D; d++) {
                vf kd[PA_KT];
                for (int t = 0; t < PA_KT; t++) memcpy(&kd[t], tile + t * D * W + d * W, sizeof kd[t]);
                for (int i = 0; i < PA_SR; i++) {
                    const float qd = qf[(r0 + i) * D + d];
                    for (int t = 0; t < PA_KT; t++) a[i][t] += qd * kd[t];
                }
            }
            for (int i = 0; i < nr; i++)
                for (int t = 0; t < PA_KT; t++)
                    memcpy(sc + (r0 + i) * npad + j0 + t * W, &a[i][t], sizeof(vf));
        }
    }
    for (int64_t r = 0; r < rows; r++) {  /* causal softmax: row r sees keys 0 .. p0 + r / G */
        float* sr = sc + r * npad;
        const int64_t len = p0 + r / G + 1;
        float mx = sr[0], sum = 0.f;
        for (int64_t j = 1; j < len; j++) mx = sr[j] > mx ? sr[j] : mx;
        vf sums = {0};
        int64_t j = 0;
        for (; j + W <= len; j += W) {
            vf x; memcpy(&x, sr + j, sizeof x);
            const vf e = exp_nonpos(x - mx);
            memcpy(sr + j, &e, sizeof e);
            sums += e;
        }
        if (j < len) {  /* rows are whole vectors wide; lanes past len (later keys' scores, or unset) -> 0 */
            vf x; memcpy(&x, sr + j, sizeof x);
            vi lane;
            for (int i = 0; i < W; i++) lane[i] = i;
            const vf e = (vf)((vi)exp_nonpos(x - mx) & (lane < (vi){0} + (int32_t)(len - j)));
            memcpy(sr + j, &e, sizeof e);
            sums += e;
        }
        for (int i = 0; i < W; i++) sum += sums[i];
        inv[r] = 1.f / sum;
    }
    /* P x V: register groups of PVR rows x PVC column vectors (W == 16: 16 accumulators of 32 registers;
       W == 8: 12 of 16). Each row's loop stops at its group's last key; a row's keys past its own last
       (causal) are read as 0 from sc: zero them first. */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = p0 + r / G + 1, group_end = p0 + (qblock * G - 1) / G + 1;
        for (int64_t j = len; j < group_end && j < npad; j++) sc[r * npad + j] = 0.f;
    }
    const int PVC = W == 8 && NC % 2 == 0 ? 2 : NC % 4 == 0 ? 4 : NC % 2 == 0 ? 2 : 1;
    const int PVR = (W == 16 ? 16 : 12) / PVC;
    float* acc = qf;  /* the queries are done with: [rows][D] float32 sums */
    memset(acc, 0, sizeof(float) * rows * D);
    const float* vrow[PA_KC];  /* the chunk's V rows: float32 ones in place, others widened */
    for (int64_t k0 = 0; k0 < npad; k0 += PA_KC) {
        int64_t vend = k0;  /* vrow is set for keys [k0, vend) */
        for (int64_t r0 = 0; r0 < rows; r0 += PVR) {
            const int64_t nr = rows - r0 < PVR ? rows - r0 : PVR;
            const int64_t nk = p0 + (r0 + nr - 1) / G + 1;
            const int64_t k1 = nk < k0 + PA_KC ? nk : k0 + PA_KC;
            for (; vend < k1; vend++)
                vrow[vend - k0] = dt == 0 ? (const float*)key_row(ks, vend, h, D, 1, 4)
                                          : (const float*)(vh + vend * NC);
            for (int64_t c0 = 0; c0 < NC && k0 < k1; c0 += PVC)
                prefill_pv_group(sc, vrow, acc, npad, r0, nr, k0, k1, c0, PVR, PVC, NC);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        char* o = out + ((q0 + r / G) * n_heads * D + (h * G + r % G) * D) * esz;
        for (int c = 0; c < NC; c++) {
            vf x; memcpy(&x, acc + r * D + c * W, sizeof x);
            st(o + c * W * esz, x * inv[r], dt);
        }
    }
}

/* In-place transpose of W vectors of W floats (r[i][j] -> r[j][i]): log2(W) stages, each pairing rows
   b apart and interleaving their blocks of b lanes. */
static inline void transpose_w(vf* r) {
#define STAGE(B, LO, HI) \
    for (int i = 0; i < W; i++) if (!(i & (B))) { \
        const vf a = r[i], b = r[i + (B)]; \
        r[i] = __builtin_shuffle(a, b, LO); r[i + (B)] = __builtin_shuffle(a, b, HI); }
#if W == 16
    const vi lo8 = {0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23};
    const vi hi8 = {8,9,10,11,12,13,14,15,24,25,26,27,28,29,30,31};
    const vi lo4 = {0,1,2,3,16,17,18,19,8,9,10,11,24,25,26,27};
    const vi hi4 = {4,5,6,7,20,21,22,23,12,13,14,15,28,29,30,31};
    const vi lo2 = {0,1,16,17,4,5,20,21,8,9,24,25,12,13,28,29};
    const vi hi2 = {2,3,18,19,6,7,22,23,10,11,26,27,14,15,30,31};
    const vi lo1 = {0,16,2,18,4,20,6,22,8,24,10,26,12,28,14,30};
    const vi hi1 = {1,17,3,19,5,21,7,23,9,25,11,27,13,29,15,31};
    STAGE(8, lo8, hi8) STAGE(4, lo4, hi4) STAGE(2, lo2, hi2) STAGE(1, lo1, hi1)
#else
    const vi lo4 = {0,1,2,3,8,9,10,11}, hi4 = {4,5,6,7,12,13,14,15};
    const vi lo2 = {0,1,8,9,4,5,12,13}, hi2 = {2,3,10,11,6,7,14,15};
    const vi lo1 = {0,8,2,10,4,12,6,14}, hi1 = {1,9,3,11,5,13,7,15};
    STAGE(4, lo4, hi4) STAGE(2, lo2, hi2) STAGE(1, lo1, hi1)
#endif
#undef STAGE
}

/* Queries at positions [start, start + n) (rows 0 .. n - 1 of q and out) against keys [0, start + n). */
static int prefill_attention_impl(const void* q, const key_src_t* ks, void* out, int64_t start, int64_t n,
                                  int64_t n_heads, int64_t n_kv_heads, int64_t D, int64_t q_stride,
                                  float scale, int dt, int num_threads)
{
    if (D % W || n_heads % n_kv_heads || dt < 0 || dt > 2 || n < 1 || start < 0) return -1;
    if (num_threads < 1) num_threads = 1;
    const int64_t G = n_heads / n_kv_heads, NC = D / W, esz = dt == 0 ? 4 : 2, total = start + n;
    const int64_t npad = (total + PA_KT * W - 1) / (PA_KT * W) * (PA_KT * W), R = PA_Q * G;
    /* Query blocks of PA_Q positions, halved (down to 8) while there are too few items to share out:
       a row's result does not depend on its block. */
    int64_t qblock = PA_Q;
    while (qblock > 8 && n_kv_heads * ((n + qblock - 1) / qblock) < 2 * num_threads) qblock /= 2;
    const int64_t blocks = (n + qblock - 1) / qblock, items = n_kv_heads * blocks;
    const char* qc = (const char*)q;
    float* kt = (float*)aligned_alloc(64, sizeof(float) * n_kv_heads * D * npad);
    vf* vv = (vf*)aligned_alloc(64, sizeof(vf) * n_kv_heads * npad * NC);
    if (!kt || !vv) { free(kt); free(vv); return -2; }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t ht = 0; ht < n_kv_heads * (npad / W); ht++) {  /* widen: K in tiles, V as rows */
            const int64_t h = ht / (npad / W), j0 = ht % (npad / W) * W, nj = total - j0 < W ? total - j0 : W;
            float* tile = kt + h * D * npad + j0 * D;  /* [D][W] */
            const char* kr[W];
            for (int64_t t = 0; t < W; t++) kr[t] = t < nj ? key_row(ks, j0 + t, h, D, 0, esz) : NULL;
            for (int64_t c = 0; c < NC; c++) {  /* W keys x W dims at a time, transposed in registers */
                vf blk[W];
                for (int64_t t = 0; t < W; t++) blk[t] = kr[t] ? ld(kr[t] + c * W * esz, dt) : (vf){0};
                transpose_w(blk);
                memcpy(tile + c * W * W, blk, sizeof blk);
            }
            for (int64_t t = 0; t < W && dt != 0; t++) {  /* float32 V is read in place */
                vf* vr = vv + (h * npad + j0 + t) * NC;
                const char* vsrc = t < nj ? key_row(ks, j0 + t, h, D, 1, esz) : NULL;
                for (int64_t c = 0; c < NC; c++) vr[c] = vsrc ? ld(vsrc + c * W * esz, dt) : (vf){0};
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
            const int64_t q0 = blk * qblock, np = n - q0 < qblock ? n - q0 : qblock;
            const float* kh = kt + h * D * npad;
            const vf* vh = vv + h * npad * NC;
#define ITEM(NCC, DT) prefill_item(qc, kh, vh, ks, (char*)out, sc, qf, npad, start + q0, np, q0, qblock, h, \
                                   G, n_heads, q_stride, scale, RP, NCC, DT)
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

int prefill_attention(const void* q, const void* k, const void* v, void* out, int64_t n, int64_t n_heads,
                      int64_t n_kv_heads, int64_t D, int64_t q_stride, int64_t kv_stride, float scale, int dt,
                      int num_threads)
{
    const key_src_t ks = {.k = (const char*)k, .v = (const char*)v, .kv_stride = kv_stride};
    return prefill_attention_impl(q, &ks, out, 0, n, n_heads, n_kv_heads, D, q_stride, scale, dt,
                                  num_threads);
}

/* New tokens continuing a cached prefix: q [n] rows q_stride apart (positions start .. start + n - 1),
   kv one cache layer [N, 2, B, Hkv, D] holding positions [0, start + n) in the blocks of table
   [ceil((start + n) / B)], out [n, H * D]. */
int prefill_attention_paged(const void* q, const void* kv, const int64_t* table, void* out, int64_t start,
                            int64_t n, int64_t B, int64_t n_heads, int64_t n_kv_heads, int64_t D,
                            int64_t q_stride, float scale, int dt, int num_threads)
{
    if (B < 1 || !table) return -1;
    const key_src_t ks = {.kv = (const char*)kv, .table = table, .B = B, .tok_stride = n_kv_heads * D};
    return prefill_attention_impl(q, &ks, out, start, n, n_heads, n_kv_heads, D, q_stride, scale, dt,
                                  num_threads);
}
