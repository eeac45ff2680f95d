
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
