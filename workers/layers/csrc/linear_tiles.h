/* The float32 register tiles shared by the float32, bfloat16-stored and int8 linears: TILE_N
 * weight rows (already float32, in L1) against every row of x. */
#ifndef TERN_LINEAR_TILES_H
#define TERN_LINEAR_TILES_H
#include <stdint.h>
#include <stdlib.h>
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
/* Fills wf (TILE_N, K) with weight rows [n0, n0 + nt) as float32, the rows past nt zeroed. */
typedef void (*TileWidener)(const void *w, const float *scale, int n0, int nt, int K, float *wf);

/* y (M, N) = x (M, K) @ W.T + bias, W read TILE_N rows at a time through `widen` into a per-thread
 * L1 tile that every row of x reuses. Returns 0, or -1 when a thread cannot get its tile. */
static inline int matmul_widened_tiles(const float *x, const void *w, const float *scale,
                                       TileWidener widen, const float *bias, float *y, int M,
                                       int N, int K) {
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
            widen(w, scale, n0, nt, K, wf);
            tile_matmul(x, wf, M, K, n0, nt, N, bias, y);
        }
        free(wf);
    }
    return failed ? -1 : 0;
}
#endif
