
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

/* One sequence, KV heads [h0, h0 + nh): the nh * G query heads of each of its Q query rows against its
   cached tokens, row r attending to lens[r] of them (the last row to sm->len). Q > 1 are the consecutive
   positions a speculative step verifies: each K/V group is read once for all of them, and every query's
   sums run in the same order as alone. q and out rows are q_stride and o_stride bytes apart.
   Scratch: qv and acc [Q * nh * G][NC], buf [W][nh][NC] vectors; s [Q * nh * G][len rounded up to W] and
   inv [Q * nh * G] floats. */
static inline __attribute__((always_inline)) void decode_seq(
    const stream_t* sm, const char* qrow, char* orow, int64_t Q, const int64_t* lens, int64_t q_stride,
    int64_t o_stride, int64_t G, int64_t h0, int64_t nh, float scale, float* s, float* inv, vf* qv, vf* acc,
    vf* buf, const int dt, const int NC)
{
    const char* kv = sm->kv;
    const int64_t* table = sm->table;
    const int64_t len = sm->len, B = sm->B, tok_stride = sm->tok_stride, block_stride = sm->block_stride;
    const int64_t esz = dt == 0 ? 4 : 2, D = (int64_t)NC * W, hoff = h0 * D, nq = nh * G, nqq = Q * nq;
    const int64_t groups = sm->groups, s_stride = groups * W;
    const char* q0 = qrow + h0 * G * D * esz;  /* query heads of KV head h are h * G .. h * G + G - 1 */
    /* Query i is head i % nq of row i / nq. */
#define QPTR(i) (q0 + ((i) / nq) * q_stride + ((i) % nq) * D * esz)

#ifdef HAVE_BF16_DOT
    if (dt == 1 && NC % 2 == 0) {
        /* bfloat16: q.k with AVX512-BF16 dot products straight from the cache rows (no widening pass).
           Each product of two bfloat16 is exact in float32; the scale is applied to the sums. */
        __m512bh* qb = (__m512bh*)qv;  /* [nq][NC / 2] in the q scratch */
        for (int64_t i = 0; i < nqq; i++)
            for (int c = 0; c < NC / 2; c++)
                qb[i * (NC / 2) + c] = (__m512bh)_mm512_loadu_si512(QPTR(i) + c * 2 * W * esz);
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
            prefetch_pos(sm, gi + PF_GROUPS);
            const char* rows[W];
            for (int64_t t = 0; t < n; t++)
                rows[t] = row_ptr(kv, table, j0 + t, B, tok_stride, block_stride, hoff, 0, esz);
            for (int64_t i = 0; i < nqq; i++) {
                const __m512bh* qi = qb + i * (NC / 2);
                const int64_t koff = ((i % nq) / G) * D * esz;
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
        for (int64_t i = 0; i < nqq; i++)
            for (int c = 0; c < NC; c++) qv[i * NC + c] = ld(QPTR(i) + c * W * esz, dt) * scale;
        for (int64_t gi = 0; gi < groups; gi++) {  /* scores */
            const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
            prefetch_pos(sm, gi + PF_GROUPS);
            load_group(buf, kv, table, j0, n, B, tok_stride, block_stride, hoff, nh, 0, dt, NC);
            for (int64_t i = 0; i < nqq; i++) {
                const vf* qi = qv + i * NC;
                const vf* bh = buf + ((i % nq) / G) * NC;  /* this query head's KV head in the group rows */
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
    for (int64_t i = 0; i < nqq; i++) {  /* softmax over each row's valid scores; later ones weigh 0 */
        float* si = s + i * s_stride;
        const int64_t li = lens[i / nq];
        float mx = si[0], sum = 0.f;
        for (int64_t j = 1; j < li; j++) mx = si[j] > mx ? si[j] : mx;
        #pragma omp simd reduction(+:sum)  /* vector expf (libmvec): a scalar one per score costs more
                                              than the q.k products on AVX2 */
        for (int64_t j = 0; j < li; j++) { const float e = expf(si[j] - mx); si[j] = e; sum += e; }
        for (int64_t j = li; j < len; j++) si[j] = 0.f;
        inv[i] = 1.f / sum;
        for (int c = 0; c < NC; c++) acc[i * NC + c] = (vf){0};
    }
#ifdef HAVE_BF16_DOT
    if (dt == 1 && NC % 2 == 0 && Q * G <= 16 * NC) {
        /* bfloat16: p x V with AVX512-BF16 dot products over token pairs. Each probability is split into
           two bfloat16, hi = bf16(p) and lo = bf16(p - hi), so p = hi + lo to ~16 bits (float32-like
           accuracy), and every product with a bfloat16 V is exact in float32. The V rows of tokens t and
           t + 1 are interleaved 16 bits at a time (unpacklo/hi within 128-bit lanes), so accumulator lanes
           hold dims in the order [lo of each lane, hi of each lane]; the store puts them back in order. */
        for (int64_t i = 0; i < nqq; i++)
            for (int64_t j = len; j < s_stride; j++) s[i * s_stride + j] = 0.f;  /* pad tokens weigh 0 */
        uint32_t* pp = (uint32_t*)buf;  /* [nqq][2][W / 2] probability pairs: hi then lo */
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t j0 = gi * W, n = len - j0 < W ? len - j0 : W;
            prefetch_pos(sm, groups + gi + PF_GROUPS);
            for (int64_t i = 0; i < nqq; i++) {
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
                        for (int64_t g = 0; g < Q * G; g++) {
                            const int64_t i = (g / G) * nq + hh * G + g % G;
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
        for (int64_t i = 0; i < nqq; i++)
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
        for (int64_t i = 0; i < nqq; i++) {
            const float* si = s + i * s_stride + j0;
            const vf* bh = buf + ((i % nq) / G) * NC;
            vf* ai = acc + i * NC;
            /* The sums in registers over the group: through ai, which may alias bh and si for the
               compiler, every product was a store and a reload. */
            vf a[64];  /* NC <= 512 / 8 (supports()) */
            for (int c = 0; c < NC; c++) a[c] = ai[c];
            for (int64_t t = 0; t < n; t++)
                for (int c = 0; c < NC; c++) a[c] += si[t] * bh[t * nh * NC + c];
            for (int c = 0; c < NC; c++) ai[c] = a[c];
        }
    }
    char* o0 = orow + h0 * G * D * esz;
    for (int64_t i = 0; i < nqq; i++) {
        char* oi = o0 + (i / nq) * o_stride + (i % nq) * D * esz;
        for (int c = 0; c < NC; c++) st(oi + c * W * esz, acc[i * NC + c] * inv[i], dt);
    }
#undef QPTR
}

/* Item -> its rows [r0, r1] (r1 < r0: none) and first KV head: chunk j of the rows of (sequence b, heads
   h0 ..), items numbered chunk-major. */
static inline void item_rows(int64_t item, int64_t pairs, int64_t per_seq, int64_t nh, int64_t chunks,
                             const int64_t* seq_rows, int64_t* r0, int64_t* r1, int64_t* h0) {
    const int64_t j = item / pairs, pair = item % pairs, b = pair / per_seq;
    *h0 = (pair % per_seq) * nh;
    const int64_t first = seq_rows ? seq_rows[b] : b, last = seq_rows ? seq_rows[b + 1] - 1 : b;
    const int64_t per_chunk = (last - first + chunks) / chunks;  /* ceil(rows / chunks) */
    *r0 = first + j * per_chunk;
    *r1 = first + (j + 1) * per_chunk - 1 < last ? first + (j + 1) * per_chunk - 1 : last;
}

/* kv: one layer [N, 2, B, Hkv, D]; next_kv: the next layer's (same shape; prefetched into cache) or NULL;
   q: [bsz, q_row_stride] rows, head i at i * D; out: [bsz, H * D];
   tables: [bsz, max_blocks]; lens: [bsz] tokens to attend (position + 1). seq_rows: NULL (each row its
   own sequence), or [nseq + 1] starts of runs of rows of one sequence (its consecutive positions,
   verified together: their K/V is read once, through the last row's table). Returns 0, -1 for unsupported shapes, -2 when
   out of memory. */
int paged_decode_attention(const void* kv, const void* next_kv, const void* q, void* out,
                           const int64_t* tables, const int64_t* lens, const int64_t* seq_rows, int64_t nseq,
                           int64_t bsz, int64_t max_blocks, int64_t B, int64_t n_heads, int64_t n_kv_heads,
                           int64_t D, int64_t q_row_stride, int64_t max_len, float scale, int dt,
                           int num_threads)
{
    const int64_t G = n_heads / n_kv_heads;
    if (D % W || n_heads % n_kv_heads || dt < 0 || dt > 2) return -1;
    if (!seq_rows) nseq = bsz;
    int64_t max_q = 1;
    for (int64_t b = 0; seq_rows && b < nseq; b++) {
        const int64_t nr = seq_rows[b + 1] - seq_rows[b];
        if (nr < 1) return -1;
        if (nr > max_q) max_q = nr;
    }
    if (seq_rows && seq_rows[nseq] != bsz) return -1;
    const int64_t tok_stride = n_kv_heads * D, block_stride = 2 * B * tok_stride, esz = dt == 0 ? 4 : 2;
    const int64_t NC = D / W;
    /* With enough sequences each item is a whole sequence, so every block is streamed once as one
       contiguous span; otherwise items are (sequence, KV head) pairs, for parallelism, and where those
       are still fewer than two per thread, a sequence's verified rows split into chunks too (each chunk
       reads the K/V again: cheap next to threads left idle). Items run chunk-major, so that the round
       robin below spreads the larger first chunks across the threads. */
    const int64_t nh = nseq >= 2 * num_threads ? n_kv_heads : 1, per_seq = n_kv_heads / nh;
    const int64_t pairs = nseq * per_seq, want = (2 * num_threads + pairs - 1) / pairs;
    const int64_t chunks = max_q < want ? max_q : want, items = pairs * chunks;
    const int64_t nqq = ((max_q + chunks - 1) / chunks) * nh * G;
    const int64_t s_len = nqq * ((max_len + W - 1) / W) * W;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float* s = (float*)malloc(sizeof(float) * (s_len + nqq));
        vf* vecs = (vf*)aligned_alloc(64, sizeof(vf) * NC * (2 * nqq + W * nh));
        if (!s || !vecs) {
            #pragma omp atomic write
            failed = 1;
        }
        const int nt = omp_get_num_threads();
        /* Static round-robin: a thread knows its next item, so its prefetch stream runs into it. */
        #pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!s || !vecs) continue;
            int64_t r0, r1, h0, nr0 = 0, nr1 = -1, nh0 = 0;
            item_rows(item, pairs, per_seq, nh, chunks, seq_rows, &r0, &r1, &h0);
            if (r1 < r0) continue;  /* a sequence with fewer rows than chunks */
            const int64_t nxt = item + nt;
            if (nxt < items) item_rows(nxt, pairs, per_seq, nh, chunks, seq_rows, &nr0, &nr1, &nh0);
            const int has_next = nxt < items && nr1 >= nr0;
            stream_t sm = {
                /* the chunk's last row: its table and length cover the others' */
                .kv = (const char*)kv, .table = tables + r1 * max_blocks, .len = lens[r1],
                .groups = (lens[r1] + W - 1) / W,
                .next_table = has_next ? tables + nr1 * max_blocks : NULL,
                .next_len = has_next ? lens[nr1] : 0,
                .B = B, .tok_stride = tok_stride, .block_stride = block_stride,
                .hoff = h0 * D, .next_hoff = has_next ? nh0 * D : 0,
                .next_layer = next_kv ? (const char*)next_kv - (const char*)kv : 0,
                .bytes = nh * D * esz, .esz = esz,
            };
            const char* qrow = (const char*)q + r0 * q_row_stride * esz;
            char* orow = (char*)out + r0 * n_heads * D * esz;
            const int64_t Q = r1 - r0 + 1, q_stride = q_row_stride * esz, o_stride = n_heads * D * esz;
            vf* qv = vecs; vf* acc = qv + nqq * NC; vf* buf = acc + nqq * NC;
#define SEQ(DT, NCC) decode_seq(&sm, qrow, orow, Q, lens + r0, q_stride, o_stride, G, h0, nh, scale, s, \
                                s + s_len, qv, acc, buf, DT, NCC)
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
