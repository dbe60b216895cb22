/* Weight-only int8 linear: y = x @ (w * scale[:, None]).T + bias with int8 weights and one
 * float32 scale per output row. Few rows multiply them in 16-bit integers with the rows of x
 * quantized to int16 (AVX2, and a scalar loop); more rows dequantize a tile at a time into L1 for
 * tile_matmul, in float32.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "linear_tiles.h"


/* Dequantize rows [n0, n0 + nt) of w (N, K) into wf (nt, K); with `pad`, also zero the rows of
 * wf from nt to TILE_N. */
static void dequant_tile(const int8_t *w, const float *scale, int n0, int nt, int K, float *wf,
                         int pad) {
    for (int r = 0; r < (pad ? TILE_N : nt); r++) {
        float *dst = wf + (int64_t)r * K;
        if (r >= nt) { memset(dst, 0, sizeof(float) * K); continue; }
        const int8_t *src = w + (int64_t)(n0 + r) * K;
        float s = scale[n0 + r];
        int k = 0;
#ifdef __AVX2__
        __m256 vs = _mm256_set1_ps(s);
        for (; k + 8 <= K; k += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(src + k));
            __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            _mm256_storeu_ps(dst + k, _mm256_mul_ps(f, vs));
        }
#endif
        for (; k < K; k++) dst[k] = (float)src[k] * s;
    }
}



static void dequant_tile_padded(const void *w, const float *scale, int n0, int nt, int K,
                                float *wf) {
    dequant_tile((const int8_t *)w, scale, n0, nt, K, wf, 1);
}

/* Few activation rows: x is quantized to int16 (one scale per row: max|x| / 32767, an error below
 * 2e-5 of the row's largest value, finer than bfloat16's 4e-3) and multiplied with the int8
 * weights in 16-bit integer pairs (vpmaddwd): per 16 weights one widening, one multiply-add and one
 * add, half the work of widening them to float32 and using FMAs, which made this loop the limit
 * rather than memory (AVX2: 13.8 GB/s of weights at one row). Integer sums are exact; they are
 * moved to float every FLUSH_K values of k, before any int32 lane could overflow
 * (2 * 127 * 32767 * FLUSH_K / 16 < 2^31). */
#define FLUSH_K 2048

/* xq (K,) int16 . wr (K,) int8, exactly, as a float sum of exact int32 partial sums. */
static inline float dot_i16_i8(const int16_t *xq, const int8_t *wr, int K) {
    float total = 0.f;
    for (int k0 = 0; k0 < K; k0 += FLUSH_K) {
        int k1 = K - k0 < FLUSH_K ? K : k0 + FLUSH_K, k = k0;
        int32_t part = 0;
#ifdef __AVX512BW__ /* 32 weights a step, 16 int32 lanes: 2 * 127 * 32767 * FLUSH_K / 32 < 2^31 */
        __m512i acc512 = _mm512_setzero_si512();
        for (; k + 32 <= k1; k += 32) {
            __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k)));
            acc512 = _mm512_add_epi32(acc512, _mm512_madd_epi16(w16, _mm512_loadu_si512(xq + k)));
        }
        part = _mm512_reduce_add_epi32(acc512);
#elif defined(__AVX2__)
        __m256i acc = _mm256_setzero_si256();
        for (; k + 16 <= k1; k += 16) {
            __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k)));
            acc = _mm256_add_epi32(
                acc, _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(xq + k))));
        }
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        part = _mm_cvtsi128_si32(h);
#endif
        for (; k < k1; k++) part += (int32_t)xq[k] * wr[k];
        total += (float)part;
    }
    return total;
}

/* Row m of x (K,) as int16 in xq, returning its scale. */
static float quantize_row_i16(const float *x, int16_t *xq, int K) {
    float amax = 0.f;
    for (int k = 0; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    if (amax == 0.f) {
        memset(xq, 0, sizeof(int16_t) * (size_t)K);
        return 0.f;
    }
    float inv = 32767.f / amax;
    for (int k = 0; k < K; k++) xq[k] = (int16_t)lrintf(x[k] * inv);
    return amax / 32767.f;
}

/* Four weight rows (row stride K) dotted with xq at once: x loaded once for the four, four
 * independent sums in flight, one horizontal reduction for all four. At the LM head's short rows
 * (K = 576) the per-row reduction of dot_i16_i8 was half the work. */
static inline void dot4_i16_i8(const int16_t *xq, const int8_t *w, int K, float out[4]) {
    out[0] = out[1] = out[2] = out[3] = 0.f;
    for (int k0 = 0; k0 < K; k0 += FLUSH_K) {
        int k1 = K - k0 < FLUSH_K ? K : k0 + FLUSH_K, k = k0;
        int32_t part[4] = {0, 0, 0, 0};
#ifdef __AVX2__
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 16 <= k1; k += 16) {
            if ((k & 63) == 0) /* 16 rows ahead: four streams outrun the hardware prefetcher */
                for (int r = 0; r < 4; r++) __builtin_prefetch(w + (int64_t)(r + 16) * K + k);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + k));
#define TERN_W16(r) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (int64_t)(r) * K + k)))
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(TERN_W16(0), xv));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(TERN_W16(1), xv));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(TERN_W16(2), xv));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(TERN_W16(3), xv));
#undef TERN_W16
        }
        /* lanes of hadd(hadd(a0, a1), hadd(a2, a3)): row r's partial sums at r and r + 4 */
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)part, s4);
#endif
        for (int r = 0; r < 4; r++) {
            const int8_t *wr = w + (int64_t)r * K;
            for (int kk = k; kk < k1; kk++) part[r] += (int32_t)xq[kk] * wr[kk];
            out[r] += (float)part[r];
        }
    }
}

/* Outputs [n0, n0 + GEMV_ROWS) of every row of x, from x quantized (xq (M, K), xs (M,)). */
static void gemv_rows(const int16_t *xq, const float *xs, const int8_t *w, const float *scale,
                      const float *bias, float *y, int M, int N, int K, int n0) {
    int nt = N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS;
    for (int m = 0; m < M; m++) {
        const int16_t *xm = xq + (int64_t)m * K;
        float *ym = y + (int64_t)m * N;
        int r = 0;
#ifndef __AVX512BW__ /* AVX-512: row after row (dot_i16_i8), one stream the prefetcher follows */
        for (; r + 4 <= nt; r += 4) {
            float dots[4];
            dot4_i16_i8(xm, w + (int64_t)(n0 + r) * K, K, dots);
            for (int i = 0; i < 4; i++) {
                int n = n0 + r + i;
                ym[n] = dots[i] * xs[m] * scale[n] + (bias ? bias[n] : 0.f);
            }
        }
#endif
        for (; r < nt; r++) {
            int n = n0 + r;
            ym[n] = dot_i16_i8(xm, w + (int64_t)n * K, K) * xs[m] * scale[n] + (bias ? bias[n] : 0.f);
        }
    }
}

/* x (M, K) float32, w (N, K) int8, scale (N,) float32, bias (N,) float32 or NULL -> y (M, N).
 * Returns 0, or -1 when there is no memory for a scratch tile or the quantized rows. */
int tern_int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias,
                     float *y, int M, int N, int K) {
    if (M < GEMV_MAX_M) {
        int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)M * K);
        if (xq == NULL) return -1;
        float xs[GEMV_MAX_M];
        for (int m = 0; m < M; m++) xs[m] = quantize_row_i16(x + (int64_t)m * K, xq + (int64_t)m * K, K);
        int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < num_tiles; t++)
            gemv_rows(xq, xs, w, scale, bias, y, M, N, K, t * GEMV_ROWS);
        free(xq);
        return 0;
    }
    return matmul_widened_tiles(x, w, scale, dequant_tile_padded, bias, y, M, N, K);
}


/* tern_int8_linear for bfloat16 x, bias and y: converted here, saving the caller two tensor ops
 * per call. Returns 0, or -1 when there is no memory for the float32 copies. */
int tern_int8_linear_bf16(const uint16_t *x, const int8_t *w, const float *scale,
                          const uint16_t *bias, uint16_t *y, int M, int N, int K) {
    /* 3-32 rows: AMX where the CPU has it and the shape fits (the AVX2 float32 tiles below
     * are compute-bound there: a decode step of 32 rows took 3x bfloat16's) */
    if (M >= 3 && tern_int8_amx_linear_bf16(x, w, scale, bias, y, M, N, K) == 0) return 0;
    float *xf = (float *)malloc(sizeof(float) * (size_t)M * K);
    float *yf = (float *)malloc(sizeof(float) * (size_t)M * N);
    float *bf = bias != NULL ? (float *)malloc(sizeof(float) * (size_t)N) : NULL;
    int rc = -1;
    if (xf != NULL && yf != NULL && (bias == NULL || bf != NULL)) {
        for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
        for (int n = 0; bias != NULL && n < N; n++) bf[n] = bf16_to_f32(bias[n]);
        rc = tern_int8_linear(xf, w, scale, bf, yf, M, N, K);
        for (int64_t i = 0; rc == 0 && i < (int64_t)M * N; i++) y[i] = f32_to_bf16(yf[i]);
    }
    free(xf);
    free(yf);
    free(bf);
    return rc;
}

/* out (N, K) float32 = w (N, K) int8 * scale[:, None]: large batches dequantize once and use the
 * float GEMM. */
void tern_int8_dequantize(const int8_t *w, const float *scale, float *out, int N, int K) {
    int num_tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        int n0 = t * TILE_N;
        int nt = N - n0 < TILE_N ? N - n0 : TILE_N;
        dequant_tile(w, scale, n0, nt, K, out + (int64_t)n0 * K, 0);
    }
}
