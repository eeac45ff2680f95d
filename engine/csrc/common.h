
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
