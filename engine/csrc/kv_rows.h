
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
