/* Small vector helpers shared by the kernels, one block per instruction-set tier: a kernel writes
 * its algorithm once against these and keeps a scalar loop for the tail (and for builds without
 * the tier). Every helper is static inline: each kernel file is compiled for one tier at a time.
 */
#ifndef TERN_SIMD_H
#define TERN_SIMD_H
#include <stdint.h>
#include "tern_kernels.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ---- AVX2 (x86-64-v3): 8 floats */
#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* exp(x) for x <= 0 (Cephes' single-precision polynomial, within 2 ulp of expf). */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_cvtps_epi32(n);
    e = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

/* g * sigmoid(g) for 8 floats, the sigmoid from e = exp(-|g|), which cannot overflow:
 * 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static inline __m256 silu8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    __m256 e = exp_nonpositive(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
    __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
    return _mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e)));
}

/* 8 floats rounded to the nearest bfloat16 (even on ties), still as floats. */
static inline __m256 round8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline void store8_bf16(uint16_t *p, __m256 rounded) {
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}
#endif

/* ---- AVX-512F (x86-64-v4): 16 floats */
#ifdef __AVX512F__
static inline __m512 load16_bf16(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

/* exp_nonpositive on 16 lanes: the same operations lane for lane, so the same results. */
static inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_cvtps_epi32(n);
    e = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* Lane i of the result is the sum of the 16 lanes of v[i]. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sums of v[4i .. 4i + 3] */
        __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], even),
                              _mm512_shuffle_f32x4(y[0], y[1], odd));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], even),
                              _mm512_shuffle_f32x4(y[2], y[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, even), _mm512_shuffle_f32x4(w0, w1, odd));
}
#endif

/* ---- AVX512-BF16: rounding to bfloat16 in one instruction */
#ifdef __AVX512BF16__
/* 16 float32 values rounded to bfloat16 (nearest even, as f32_to_bf16), and back as floats. */
static inline __m256i narrow16(__m512 f) { return (__m256i)_mm512_cvtneps_pbh(f); }
static inline __m512 round16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16(f)), 16));
}
static inline void store16_bf16(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, narrow16(f));
}
#endif
#endif
