/* The float32 register tiles shared by the float32, bfloat16-stored and int8 linears: TILE_N
 * weight rows (already float32, in L1) against every row of x. */
#ifndef TERN_LINEAR_TILES_H
#define TERN_LINEAR_TILES_H
#include <stdint.h>
#include "simd.h"

#define TILE_N 4
/* Rows of w one few-row pass converts and streams at a time. */
#define GEMV_ROWS 8
/* Below this many activation rows the weights are converted in registers (the gemv loops);
 * from it on a tile of rows is converted once into L1 and reused by every row (tile_matmul). */
#define GEMV_MAX_M 4

/* y[m, n0 + r] = wf[r] . x[m] for the tile's rows, two activation rows at a time. */
static inline void tile_matmul(const float *x, const float *wf, int M, int K, int n0, int nt, int N,
                        const float *bias, float *y) {
    int m = 0;
#ifdef __AVX2__
    int K8 = K & ~7;
    for (; m + 2 <= M; m += 2) {
        const float *x0 = x + (int64_t)m * K, *x1 = x0 + K;
        __m256 a[2][TILE_N];
        for (int r = 0; r < TILE_N; r++) a[0][r] = a[1][r] = _mm256_setzero_ps();
        for (int k = 0; k < K8; k += 8) {
            __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
            for (int r = 0; r < TILE_N; r++) {
                __m256 wv = _mm256_loadu_ps(wf + (int64_t)r * K + k);
                a[0][r] = _mm256_fmadd_ps(v0, wv, a[0][r]);
                a[1][r] = _mm256_fmadd_ps(v1, wv, a[1][r]);
            }
        }
        for (int r = 0; r < nt; r++) {
            float s0 = hsum(a[0][r]), s1 = hsum(a[1][r]);
            const float *wr = wf + (int64_t)r * K;
            for (int k = K8; k < K; k++) { s0 += x0[k] * wr[k]; s1 += x1[k] * wr[k]; }
            float b = bias ? bias[n0 + r] : 0.f;
            y[(int64_t)m * N + n0 + r] = s0 + b;
            y[(int64_t)(m + 1) * N + n0 + r] = s1 + b;
        }
    }
    for (; m < M; m++) {
        const float *x0 = x + (int64_t)m * K;
        __m256 a[TILE_N];
        for (int r = 0; r < TILE_N; r++) a[r] = _mm256_setzero_ps();
        for (int k = 0; k < K8; k += 8) {
            __m256 v0 = _mm256_loadu_ps(x0 + k);
            for (int r = 0; r < TILE_N; r++)
                a[r] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(wf + (int64_t)r * K + k), a[r]);
        }
        for (int r = 0; r < nt; r++) {
            float s0 = hsum(a[r]);
            const float *wr = wf + (int64_t)r * K;
            for (int k = K8; k < K; k++) s0 += x0[k] * wr[k];
            y[(int64_t)m * N + n0 + r] = s0 + (bias ? bias[n0 + r] : 0.f);
        }
    }
#else
    for (; m < M; m++) {
        const float *x0 = x + (int64_t)m * K;
        for (int r = 0; r < nt; r++) {
            const float *wr = wf + (int64_t)r * K;
            float s0 = 0.f;
#pragma omp simd reduction(+:s0)
            for (int k = 0; k < K; k++) s0 += x0[k] * wr[k];
            y[(int64_t)m * N + n0 + r] = s0 + (bias ? bias[n0 + r] : 0.f);
        }
    }
#endif
}
#endif
