
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
