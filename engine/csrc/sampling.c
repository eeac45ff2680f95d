
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
