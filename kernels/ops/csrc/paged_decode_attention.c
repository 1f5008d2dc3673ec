/* Native CPU paged decode attention (fp32, bf16, fp16), loaded by kvrelay.kernels.cpu_native
 * through ctypes. Same contract as kvrelay.kernels.reference.paged_decode_attention; every
 * function returns 0, -1 when a thread could not allocate its scratch buffers, or -2 when a
 * block table entry in use lies outside the cache (checked so it cannot read out of bounds). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define KVRELAY_AVX2 1 /* AVX2 without AVX-512 (e.g. AMD Zen 2/3): 8-lane forms below */
#endif

/* Blocks ahead of the one being read whose rows are prefetched (benchmarks/decode_attention.py):
 * on an AVX-512 Intel machine 2 read fastest, 1 and 4 slower; on an AVX2 AMD EPYC 2 was ~8%
 * slower than 4, and 4 equal to no prefetch at all. */
#if defined(__AVX512F__)
#define PREFETCH_AHEAD 2
#else
#define PREFETCH_AHEAD 4
#endif

/* Prefetch into L2 a block's rows for one task: row_bytes at each of block_size tokens. */
#define PREFETCH_ROWS(ptr, block_size, token_stride, row_bytes)                                 \
    do {                                                                                        \
        const char *p_ = (const char *)(ptr);                                                   \
        const int64_t step_ = (token_stride) * (int64_t)sizeof(*(ptr));                         \
        for (int64_t t_ = 0; t_ < (block_size); t_++)                                           \
            for (int64_t o_ = 0; o_ < (row_bytes); o_ += 64) __builtin_prefetch(p_ + t_ * step_ + o_, 0, 2); \
    } while (0)

/* glibc's libmvec has vector expf (within 4 ulp), which math.h declares only under -ffast-math;
 * the softmax loop calls it a vector at a time (kvrelay.kernels.cpu_native links it on x86-64). */
#if defined(__x86_64__) && defined(__GLIBC__)
#pragma omp declare simd notinbranch
float expf(float);
#endif

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_load(_Float16 x) { return (float)x; }
static inline _Float16 f16_store(float x) { return (_Float16)x; }

/* q . k over D elements: each product rounded to fp32, the sum kept in fp64 (random test models
 * amplify fp32 summation error past the 1e-4 logprob tolerance). One per dtype, for DOTS below. */
#define GENERIC_DOT(name, T, LOAD)                                           \
    static inline double name(const float *q, const T *k, int64_t D) {      \
        double s = 0.0;                                                      \
        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) \
            s += q[d] * LOAD(k[d]);                                          \
        return s;                                                            \
    }
GENERIC_DOT(dot_f32_generic, float, f32_load)
GENERIC_DOT(dot_bf16, uint16_t, bf16_load)
GENERIC_DOT(dot_f16, _Float16, f16_load)

#if defined(KVRELAY_AVX2)
/* Eight lanes of q[i] * k[i] + q[i + 8] * k[i + 8], each pair summed in fp32 (one FMA) before
 * the fp64 sum: half the fp32 -> fp64 conversions, which bound the AVX2 dot product's speed,
 * for one more fp32 rounding per pair, of the same size as the products' own. */
#define PAIR_SUM8(q, k) \
    _mm256_fmadd_ps(_mm256_loadu_ps((q) + 8), _mm256_loadu_ps((k) + 8), _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k)))

static inline double hsum_pd256(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
#endif

/* The compiler's fp64 reduction above ends in seven dependent scalar adds per row, which made it
 * the kernel's largest cost; this one keeps two vector sums and reduces them as a tree. */
static inline double dot_f32(const float *q, const float *k, int64_t D) {
#if defined(__AVX512F__)
    if ((D & 15) == 0) {
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (int64_t d = 0; d < D; d += 16) {
            __m512 p = _mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d));
            a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
            a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))));
        }
        return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    }
#elif defined(KVRELAY_AVX2)
    if ((D & 15) == 0) {
        __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
        for (int64_t d = 0; d < D; d += 16) {
            __m256 p = PAIR_SUM8(q + d, k + d);
            a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
            a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
        }
        return hsum_pd256(_mm256_add_pd(a0, a1));
    }
#endif
    return dot_f32_generic(q, k, D);
}

/* out[t] = scale * q . k[t * k_stride : +D] for n tokens of one head (products in fp32, sums in
 * fp64, as above). The AVX-512 form keeps q in registers across the tokens. */
#define GENERIC_DOTS(name, T, DOTFN)                                                               \
    static inline void name(float *out, const float *q, const T *k, int64_t n, int64_t k_stride,   \
                            int64_t D, float scale) {                                              \
        for (int64_t t = 0; t < n; t++) out[t] = (float)DOTFN(q, k + t * k_stride, D) * scale;     \
    }
GENERIC_DOTS(dots_f32_generic, float, dot_f32)
GENERIC_DOTS(dots_bf16, uint16_t, dot_bf16)
GENERIC_DOTS(dots_f16, _Float16, dot_f16)

#if defined(__AVX512F__)
static inline void dots_f32_regs(float *out, const float *q, const float *k, int64_t n, int64_t k_stride,
                                 float scale, const int nc) { /* D = 16 * nc; inlined with nc constant */
    __m512 qv[8];
    for (int c = 0; c < nc; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t t = 0; t < n; t++) {
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (int c = 0; c < nc; c++) {
            __m512 p = _mm512_mul_ps(qv[c], _mm512_loadu_ps(k + t * k_stride + 16 * c));
            a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
            a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))));
        }
        out[t] = (float)_mm512_reduce_add_pd(_mm512_add_pd(a0, a1)) * scale;
    }
}
#endif

static inline void dots_f32(float *out, const float *q, const float *k, int64_t n, int64_t k_stride, int64_t D,
                            float scale) {
#if defined(__AVX512F__)
    if (D == 64) return dots_f32_regs(out, q, k, n, k_stride, scale, 4);
    if (D == 128) return dots_f32_regs(out, q, k, n, k_stride, scale, 8);
#endif /* off AVX-512 the K pass asks for one token at a time: dot_f32's loop, q from L1 */
    dots_f32_generic(out, q, k, n, k_stride, D, scale);
}

/* acc[0:D] += sum over n tokens of p[t] * v[t * v_stride : +D], for one head. The generic form
 * reloads and stores acc for every token; the fp32 AVX-512 form keeps acc in registers. */
#define GENERIC_AXPY(name, T, LOAD)                                                                  \
    static inline void name(float *acc, const float *p, const T *v, int64_t n, int64_t v_stride,     \
                            int64_t D) {                                                             \
        for (int64_t t = 0; t < n; t++) {                                                            \
            const T *vt = v + t * v_stride;                                                          \
            _Pragma("omp simd") for (int64_t d = 0; d < D; d++) acc[d] += p[t] * LOAD(vt[d]);         \
        }                                                                                            \
    }
GENERIC_AXPY(axpy_f32_generic, float, f32_load)
GENERIC_AXPY(axpy_bf16, uint16_t, bf16_load)
GENERIC_AXPY(axpy_f16, _Float16, f16_load)

#if defined(__AVX512F__)
static inline void axpy_f32_regs(float *acc, const float *p, const float *v, int64_t n, int64_t v_stride,
                                 const int nc) { /* D = 16 * nc; inlined with nc constant */
    __m512 a[8];
    for (int c = 0; c < nc; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t t = 0; t < n; t++) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int c = 0; c < nc; c++) a[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + t * v_stride + 16 * c), a[c]);
    }
    for (int c = 0; c < nc; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

#if defined(KVRELAY_AVX2)
/* acc[0:64] += sum of p[t] * v[t][0:64], with acc in 8 registers; D = 64 * nh runs as nh slices
 * of 64 (inlined with nh constant). */
static inline void axpy_f32_avx2(float *acc, const float *p, const float *v, int64_t n, int64_t v_stride,
                                 const int nh) {
    for (int h = 0; h < nh; h++) {
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(acc + 64 * h + 8 * c);
        for (int64_t t = 0; t < n; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            const float *vt = v + t * v_stride + 64 * h;
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + 64 * h + 8 * c, a[c]);
    }
}
#endif

static inline void axpy_f32(float *acc, const float *p, const float *v, int64_t n, int64_t v_stride, int64_t D) {
#if defined(__AVX512F__)
    if (D == 64) return axpy_f32_regs(acc, p, v, n, v_stride, 4);
    if (D == 128) return axpy_f32_regs(acc, p, v, n, v_stride, 8);
#elif defined(KVRELAY_AVX2)
    if (D == 64) return axpy_f32_avx2(acc, p, v, n, v_stride, 1);
    if (D == 128) return axpy_f32_avx2(acc, p, v, n, v_stride, 2);
#endif
    axpy_f32_generic(acc, p, v, n, v_stride, D);
}

#define T float
#define DOTS dots_f32
#define AXPY axpy_f32
#define LOAD f32_load
#define STORE f32_store
#define FN paged_decode_attention_f32
#include "paged_decode_attention_impl.h"

#define T uint16_t
#define DOTS dots_bf16
#define AXPY axpy_bf16
#define LOAD bf16_load
#define STORE bf16_store
#define FN paged_decode_attention_bf16
#include "paged_decode_attention_impl.h"

#define T _Float16
#define DOTS dots_f16
#define AXPY axpy_f16
#define LOAD f16_load
#define STORE f16_store
#define FN paged_decode_attention_f16
#include "paged_decode_attention_impl.h"
