/* Weight-only int8 linear: y = x @ (w * scale[:, None]).T + bias with int8 weights and one
 * float32 scale per output row. Few rows convert the weights in registers (AVX-512 and AVX2 loops
 * side by side); more rows dequantize a tile at a time into L1 for tile_matmul.
 */
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



/* Few activation rows: convert the int8 weights in registers and FMA them directly (the scale is
 * applied once per output); no scratch tile, each weight byte is read once per row of x. */
static void gemv_rows(const float *x, const int8_t *w, const float *scale, const float *bias,
                      float *y, int M, int N, int K, int n0) {
    int nt = N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS;
    for (int m = 0; m < M; m++) {
        const float *xm = x + (int64_t)m * K;
        float sums[GEMV_ROWS] = {0};
        int k = 0;
#if defined(__AVX512F__)
        if (nt == GEMV_ROWS) { /* four rows at a time: each 16 features of x loaded once */
            for (int r = 0; r < GEMV_ROWS; r += 4) {
                const int8_t *w0 = w + (int64_t)(n0 + r) * K, *w1 = w0 + K, *w2 = w1 + K,
                             *w3 = w2 + K;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                int kk = 0;
                for (; kk + 16 <= K; kk += 16) {
                    __m512 xv = _mm512_loadu_ps(xm + kk);
                    if ((kk & 63) == 0) { /* 16 rows ahead: 4 streams outrun the prefetcher */
                        __builtin_prefetch(w0 + 16 * (int64_t)K + kk);
                        __builtin_prefetch(w1 + 16 * (int64_t)K + kk);
                        __builtin_prefetch(w2 + 16 * (int64_t)K + kk);
                        __builtin_prefetch(w3 + 16 * (int64_t)K + kk);
                    }
#define TERN_I8x16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
                    a0 = _mm512_fmadd_ps(xv, TERN_I8x16(w0 + kk), a0);
                    a1 = _mm512_fmadd_ps(xv, TERN_I8x16(w1 + kk), a1);
                    a2 = _mm512_fmadd_ps(xv, TERN_I8x16(w2 + kk), a2);
                    a3 = _mm512_fmadd_ps(xv, TERN_I8x16(w3 + kk), a3);
#undef TERN_I8x16
                }
                float s[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                              _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
                for (int i = 0; i < 4; i++) {
                    const int8_t *wr = w0 + (int64_t)i * K;
                    for (int kt = kk; kt < K; kt++) s[i] += xm[kt] * (float)wr[kt];
                    sums[r + i] = s[i];
                }
            }
            k = K;
        }
#elif defined(__AVX2__)
        if (nt == GEMV_ROWS) {
            for (int r = 0; r < GEMV_ROWS; r++) {
                const int8_t *wr = w + (int64_t)(n0 + r) * K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                int kk = 0;
                for (; kk + 32 <= K; kk += 32) {
                    __m256i b = _mm256_loadu_si256((const __m256i *)(wr + kk));
                    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + kk),
                                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + kk + 8),
                                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + kk + 16),
                                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + kk + 24),
                                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), a3);
                }
                float s0 = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
                for (; kk < K; kk++) s0 += xm[kk] * (float)wr[kk];
                sums[r] = s0;
            }
            k = K;
        }
#endif
        for (int r = 0; r < nt; r++) {
            const int8_t *wr = w + (int64_t)(n0 + r) * K;
            float s0 = sums[r];
            for (int kk = k; kk < K; kk++) s0 += xm[kk] * (float)wr[kk];
            y[(int64_t)m * N + n0 + r] = s0 * scale[n0 + r] + (bias ? bias[n0 + r] : 0.f);
        }
    }
}

/* Below this many activation rows the int8 weights are converted in registers (gemv_rows);
 * from it on a tile of rows is dequantized once into L1 and reused by every row (tile_matmul). */

/* x (M, K) float32, w (N, K) int8, scale (N,) float32, bias (N,) float32 or NULL -> y (M, N).
 * Returns 0, or -1 when a thread cannot get its scratch tile. */
int tern_int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias,
                     float *y, int M, int N, int K) {
    if (M < GEMV_MAX_M) {
        int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < num_tiles; t++) gemv_rows(x, w, scale, bias, y, M, N, K, t * GEMV_ROWS);
        return 0;
    }
    int num_tiles = (N + TILE_N - 1) / TILE_N;
    int failed = 0;
#pragma omp parallel
    {
        float *wf = (float *)malloc(sizeof(float) * TILE_N * (size_t)K);
        if (wf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            if (wf == NULL) continue;
            int n0 = t * TILE_N;
            int nt = N - n0 < TILE_N ? N - n0 : TILE_N;
            dequant_tile(w, scale, n0, nt, K, wf, 1);
            tile_matmul(x, wf, M, K, n0, nt, N, bias, y);
        }
        free(wf);
    }
    return failed ? -1 : 0;
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
