/* Float32 arithmetic linears for the few activation rows of a decode step, where BLAS GEMMs run
 * far below the machine's bandwidth and FMA rate: float32 weights, and bfloat16-stored weights
 * widened to float32 in registers (half float32's memory traffic on CPUs without bfloat16
 * arithmetic, where torch's bfloat16 matmul is emulated).
 */
#include <stdlib.h>
#include <string.h>
#include "linear_tiles.h"
#include "tern_kernels.h"

/* y (M, N) = x (M, K) @ w (N, K).T + bias for the few activation rows of a decode step, where
 * BLAS GEMMs run far below the machine's bandwidth and FMA rate. */
static void f32_gemv_rows(const float *x, const float *w, const float *bias, float *y, int M,
                          int N, int K, int n0, int nt) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + (int64_t)m * K;
        for (int r = 0; r < nt; r++) {
            const float *wr = w + (int64_t)(n0 + r) * K;
            float s0 = 0.f;
            int k = 0;
#ifdef __AVX2__
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (; k + 32 <= K; k += 32) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), _mm256_loadu_ps(wr + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 8), _mm256_loadu_ps(wr + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 16), _mm256_loadu_ps(wr + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 24), _mm256_loadu_ps(wr + k + 24), a3);
            }
            s0 = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
            for (; k < K; k++) s0 += xm[k] * wr[k];
            y[(int64_t)m * N + n0 + r] = s0 + (bias ? bias[n0 + r] : 0.f);
        }
    }
}

/* y (M, N) = x (M, K) @ w (N, K).T + bias, GEMV_ROWS weight rows per task: below GEMV_MAX_M
 * rows each weight row is streamed once per row of x, from it in register blocks. Returns 0. */
int tern_f32_linear(const float *x, const float *w, const float *bias, float *y, int M, int N,
                    int K) {
    int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        int n0 = t * GEMV_ROWS, nt = N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS;
        if (M < GEMV_MAX_M)
            f32_gemv_rows(x, w, bias, y, M, N, K, n0, nt);
        else
            f32_blocked_rows(x, w + (int64_t)n0 * K, bias, y, M, N, K, n0, nt);
    }
    return 0;
}

/* f32_blocked_rows for every M: each y[m, n] is the same sequence of operations on x[m] and w[n]
 * (f32_block: one accumulator vector over K in order, its lanes summed, the tail, the bias) in
 * whichever block its row falls and however many rows there are. Returns 0. */
int tern_f32_linear_invariant(const float *x, const float *w, const float *bias, float *y, int M,
                              int N, int K) {
    int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        int n0 = t * GEMV_ROWS, nt = N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS;
        f32_blocked_rows(x, w + (int64_t)n0 * K, bias, y, M, N, K, n0, nt);
    }
    return 0;
}

/* ---------------------------------------------------------------- bfloat16-stored weights */

/* One weight row (K bfloat16 values) dotted with one row of x, the weight widened to float32 in
 * registers: bfloat16 is the top half of a float32, so the widening is exact (a shift). */
static inline float dot_bf16w(const float *x, const uint16_t *w, int K) {
    float s = 0.f;
    int k = 0;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16_bf16(w + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16_bf16(w + k + 16), a1);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__AVX2__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8_bf16(w + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8_bf16(w + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load8_bf16(w + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load8_bf16(w + k + 24), a3);
    }
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; k++) s += x[k] * bf16_to_f32(w[k]);
    return s;
}

/* Rows [n0, n0 + nt) of w widened into wf (TILE_N, K), the rows past nt zeroed. */
static void widen_tile(const void *weight, const float *scale, int n0, int nt, int K, float *wf) {
    const uint16_t *w = (const uint16_t *)weight;
    (void)scale;
    for (int r = 0; r < TILE_N; r++) {
        float *dst = wf + (int64_t)r * K;
        if (r >= nt) {
            memset(dst, 0, sizeof(float) * K);
            continue;
        }
        const uint16_t *src = w + (int64_t)(n0 + r) * K;
        int k = 0;
#ifdef __AVX2__
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8_bf16(src + k));
#endif
        for (; k < K; k++) dst[k] = bf16_to_f32(src[k]);
    }
}

/* y (M, N) = x (M, K) @ w (N, K).T + bias (N,) or NULL; x, bias, y float32, w bfloat16. Few rows
 * stream the weight once per row of x at half float32's bytes; more rows widen TILE_N weight
 * rows at a time into L1 and reuse them for every row (tile_matmul). The caller takes torch's
 * GEMM on a widened copy from about 64 rows, where the arithmetic, not the weight, is the cost.
 * Returns 0, or -1 when a thread cannot get its scratch tile. */
int tern_bf16w_linear(const float *x, const uint16_t *w, const float *bias, float *y, int M, int N,
                      int K) {
    if (M < GEMV_MAX_M) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            for (int m = 0; m < M; m++)
                y[(int64_t)m * N + n] =
                    dot_bf16w(x + (int64_t)m * K, w + (int64_t)n * K, K) + (bias ? bias[n] : 0.f);
        return 0;
    }
    return matmul_widened_tiles(x, w, NULL, widen_tile, bias, y, M, N, K);
}

/* ---------------------------------------------------------------- mixture-of-experts decode */

/* The routed experts of a decode step's few tokens in one call (two parallel regions instead of
 * two per token and expert): pair p takes token pair_token[p] through expert pair_expert[p],
 *   h = SiLU(gate) * up of x[token] @ w13[e].T (+ b13[e]),  y = h @ w2[e].T (+ b2[e]),
 * and out[token] += y * pair_weight[p], pairs added in their order (the caller sorts each token's
 * by expert, as the grouped path adds them). x (T, H); w13 (E, 2I, H), b13 (E, 2I) or NULL;
 * w2 (E, H, I), b2 (E, H) or NULL; gate_up (P, 2I), act (P, I), y (P, H) scratch; out (T, H),
 * zeroed by the caller. Each product is tern_f32_linear's arithmetic for one row. */
void tern_f32_moe_experts(const float *x, int H, const int64_t *pair_token,
                          const int64_t *pair_expert, const float *pair_weight, int P,
                          const float *w13, const float *b13, const float *w2, const float *b2,
                          int I, float *gate_up, float *act, float *y, float *out) {
    int up_tiles = (2 * I + GEMV_ROWS - 1) / GEMV_ROWS, down_tiles = (H + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < P * up_tiles; t++) {
        int p = t / up_tiles, n0 = t % up_tiles * GEMV_ROWS;
        int64_t e = pair_expert[p];
        f32_gemv_rows(x + pair_token[p] * H, w13 + e * 2 * I * H, b13 ? b13 + e * 2 * I : NULL,
                      gate_up + (int64_t)p * 2 * I, 1, 2 * I, H, n0,
                      2 * I - n0 < GEMV_ROWS ? 2 * I - n0 : GEMV_ROWS);
    }
    tern_silu_and_mul(gate_up, act, P, I);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < P * down_tiles; t++) {
        int p = t / down_tiles, n0 = t % down_tiles * GEMV_ROWS;
        int64_t e = pair_expert[p];
        f32_gemv_rows(act + (int64_t)p * I, w2 + e * H * I, b2 ? b2 + e * H : NULL,
                      y + (int64_t)p * H, 1, H, I, n0, H - n0 < GEMV_ROWS ? H - n0 : GEMV_ROWS);
    }
    for (int p = 0; p < P; p++) {
        float *o = out + pair_token[p] * H;
        const float *yp = y + (int64_t)p * H;
        for (int i = 0; i < H; i++) o[i] += yp[i] * pair_weight[p];
    }
}
