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

/* From GEMV_MAX_M rows: register blocks of BLOCK_M rows of x by BLOCK_N weight rows, so each
 * vector of weights loaded is used BLOCK_M times and each vector of x BLOCK_N times. The loads,
 * not the FMAs, bound these products at a few rows; blocks of 6 x 4 (AVX-512's 32 registers) and
 * 3 x 4 (AVX2's 16) measured fastest from 4 to 32 rows (1.2-1.6x two-row tiles, 2-core EPYCs). */
#if defined(__AVX512F__)
#define BLOCK_M 6
#define VEC 16
typedef __m512 vec_t;
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_fma _mm512_fmadd_ps
#define vec_sum _mm512_reduce_add_ps
#elif defined(__AVX2__)
#define BLOCK_M 3
#define VEC 8
typedef __m256 vec_t;
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_fma _mm256_fmadd_ps
#define vec_sum hsum
#endif
#define BLOCK_N 4

#ifdef VEC
/* y[m, n + r] = x[m] . wb[r] + bias[n + r] for m < mb <= BLOCK_M, r < nr <= BLOCK_N (wb: weight
 * row n); inlined for each constant mb, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void f32_block(const float *x, const float *wb,
                                                            const float *bias, float *y, int mb,
                                                            int N, int K, int n, int nr) {
    vec_t acc[BLOCK_M][BLOCK_N];
    const float *wr[BLOCK_N];
    for (int r = 0; r < BLOCK_N; r++) wr[r] = wb + (int64_t)(r < nr ? r : 0) * K;
    for (int m = 0; m < BLOCK_M; m++)
        for (int r = 0; r < BLOCK_N; r++) acc[m][r] = vec_zero();
    int kv = K / VEC * VEC;
    for (int k = 0; k < kv; k += VEC) {
        vec_t xv[BLOCK_M];
        for (int m = 0; m < BLOCK_M; m++)
            if (m < mb) xv[m] = vec_load(x + (int64_t)m * K + k);
        for (int r = 0; r < BLOCK_N; r++) {
            vec_t wv = vec_load(wr[r] + k);
            for (int m = 0; m < BLOCK_M; m++)
                if (m < mb) acc[m][r] = vec_fma(xv[m], wv, acc[m][r]);
        }
    }
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < nr; r++) {
            float s = vec_sum(acc[m][r]);
            const float *xm = x + (int64_t)m * K;
            for (int k = kv; k < K; k++) s += xm[k] * wr[r][k];
            y[(int64_t)m * N + n + r] = s + (bias ? bias[n + r] : 0.f);
        }
}
#endif

/* Weight rows [n0, n0 + nt) (w0: row n0, the rest after it) against every row of x, the rows
 * re-read from L1 by each block. */
static inline void f32_blocked_rows(const float *x, const float *w0, const float *bias, float *y,
                                    int M, int N, int K, int n0, int nt) {
#ifdef VEC
    for (int m0 = 0; m0 < M; m0 += BLOCK_M) {
        int mb = M - m0 < BLOCK_M ? M - m0 : BLOCK_M;
        const float *xb = x + (int64_t)m0 * K;
        float *yb = y + (int64_t)m0 * N;
        for (int n = n0; n < n0 + nt; n += BLOCK_N) {
            int nr = n0 + nt - n < BLOCK_N ? n0 + nt - n : BLOCK_N;
            const float *w = w0 + (int64_t)(n - n0) * K;
            switch (mb) {
            case 1: f32_block(xb, w, bias, yb, 1, N, K, n, nr); break;
            case 2: f32_block(xb, w, bias, yb, 2, N, K, n, nr); break;
#if BLOCK_M > 3
            case 3: f32_block(xb, w, bias, yb, 3, N, K, n, nr); break;
            case 4: f32_block(xb, w, bias, yb, 4, N, K, n, nr); break;
            case 5: f32_block(xb, w, bias, yb, 5, N, K, n, nr); break;
#endif
            default: f32_block(xb, w, bias, yb, BLOCK_M, N, K, n, nr); break;
            }
        }
    }
#else
    for (int m = 0; m < M; m++) {
        const float *xm = x + (int64_t)m * K;
        for (int n = n0; n < n0 + nt; n++) {
            const float *wr = w0 + (int64_t)(n - n0) * K;
            float s = 0.f;
#pragma omp simd reduction(+:s)
            for (int k = 0; k < K; k++) s += xm[k] * wr[k];
            y[(int64_t)m * N + n] = s + (bias ? bias[n] : 0.f);
        }
    }
#endif
}

/* y[m, n0 + r] = wf[r] . x[m] for the tile's rows (wf: TILE_N rows, K), in register blocks. */
static inline void tile_matmul(const float *x, const float *wf, int M, int K, int n0, int nt, int N,
                               const float *bias, float *y) {
    f32_blocked_rows(x, wf, bias, y, M, N, K, n0, nt);
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
