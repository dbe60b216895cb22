/* CPU kernels of tern's hot loops, called through ctypes (workers/layers/native.py builds this).
 *
 * 1. Paged decode attention: one query token per sequence attends its whole context straight from
 *    the paged KV cache (no gathered, padded copy of K and V), with an online softmax per block.
 * 2. Weight-only int8 linear: y = x @ (w * scale[:, None]).T + bias with int8 weights and one
 *    float32 scale per output row, dequantized a tile at a time into L1.
 *
 * Threads: OpenMP, the same runtime torch uses (libgomp.so.1 is resolved to the copy torch has
 * already loaded), so torch.set_num_threads governs these loops too.
 * Activations and outputs are float32; the KV cache is float32 or bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256  /* tokens per cache block */

int tern_abi_version(void) { return 1; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---------------------------------------------------------------- paged decode attention */

/* One (sequence, KV head): G query heads of dimension D over ctx cached tokens.
 * k, v point at the cache of this KV head: token slot s is at k + s * slot_stride. */
#define DECODE_BODY(LOAD)                                                                    \
    float scores[MAX_BLOCK * MAX_GROUP];                                                     \
    float acc[MAX_GROUP * MAX_HEAD_DIM];                                                     \
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];                                            \
    for (int g = 0; g < G; g++) { row_max[g] = -INFINITY; row_sum[g] = 0.f; }               \
    memset(acc, 0, sizeof(float) * G * D);                                                   \
    int num_blocks = (ctx + block_size - 1) / block_size;                                    \
    for (int j = 0; j < num_blocks; j++) {                                                   \
        int64_t base = (int64_t)table[j] * block_size;                                       \
        int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;       \
        for (int t = 0; t < n; t++) {                                                        \
            const KV_T *kp = k + (base + t) * slot_stride;                                   \
            for (int g = 0; g < G; g++) {                                                    \
                const float *qg = q + g * D;                                                 \
                float s = 0.f;                                                               \
                _Pragma("omp simd reduction(+:s)")                                           \
                for (int d = 0; d < D; d++) s += qg[d] * LOAD(kp[d]);                        \
                scores[t * G + g] = s * scale;                                               \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; g++) {                                                        \
            float m = row_max[g];                                                            \
            for (int t = 0; t < n; t++) m = scores[t * G + g] > m ? scores[t * G + g] : m;   \
            float corr = expf(row_max[g] - m);                                               \
            row_max[g] = m;                                                                  \
            row_sum[g] *= corr;                                                              \
            float *ag = acc + g * D;                                                         \
            for (int d = 0; d < D; d++) ag[d] *= corr;                                       \
            for (int t = 0; t < n; t++) {                                                    \
                float p = expf(scores[t * G + g] - m);                                       \
                scores[t * G + g] = p;                                                       \
                row_sum[g] += p;                                                             \
            }                                                                                \
        }                                                                                    \
        for (int t = 0; t < n; t++) {                                                        \
            const KV_T *vp = v + (base + t) * slot_stride;                                   \
            for (int g = 0; g < G; g++) {                                                    \
                float p = scores[t * G + g];                                                 \
                float *ag = acc + g * D;                                                     \
                _Pragma("omp simd")                                                          \
                for (int d = 0; d < D; d++) ag[d] += p * LOAD(vp[d]);                        \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int g = 0; g < G; g++) {                                                            \
        float inv = row_sum[g] > 0.f ? 1.f / row_sum[g] : 0.f;                               \
        for (int d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;                   \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

#define KV_T float
static void decode_one_f32(const float *q, const float *k, const float *v, const int32_t *table,
                           int ctx, int G, int D, int block_size, int64_t slot_stride,
                           float scale, float *out) {
    DECODE_BODY(LOAD_F32)
}
#undef KV_T
#define KV_T uint16_t
static void decode_one_bf16(const float *q, const uint16_t *k, const uint16_t *v,
                            const int32_t *table, int ctx, int G, int D, int block_size,
                            int64_t slot_stride, float scale, float *out) {
    DECODE_BODY(LOAD_BF16)
}
#undef KV_T

/* q, out: (B, H, D) float32. k_cache, v_cache: (num_blocks * block_size, Hkv, D) float32 or
 * bfloat16. block_tables: (B, table_stride) int32. context_lens: (B,) int32.
 * Returns 0, or -1 when the shapes exceed the kernel's fixed buffers. */
int tern_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, int64_t table_stride,
                                const int32_t *context_lens, float *out, int B, int H, int Hkv,
                                int D, int block_size, float scale, int kv_is_bf16) {
    int G = H / Hkv;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || block_size > MAX_BLOCK || G * Hkv != H) return -1;
    int64_t slot_stride = (int64_t)Hkv * D;
#pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; item++) {
        int b = item / Hkv, h = item % Hkv;
        const float *qb = q + ((int64_t)b * H + (int64_t)h * G) * D;
        float *ob = out + ((int64_t)b * H + (int64_t)h * G) * D;
        const int32_t *table = block_tables + (int64_t)b * table_stride;
        if (kv_is_bf16)
            decode_one_bf16(qb, (const uint16_t *)k_cache + h * D, (const uint16_t *)v_cache + h * D,
                            table, context_lens[b], G, D, block_size, slot_stride, scale, ob);
        else
            decode_one_f32(qb, (const float *)k_cache + h * D, (const float *)v_cache + h * D,
                           table, context_lens[b], G, D, block_size, slot_stride, scale, ob);
    }
    return 0;
}

/* ---------------------------------------------------------------- int8 weight-only linear */

#define TILE_N 4

/* Dequantize rows [n0, n0 + nt) of w (N, K) into wf (TILE_N, K), zero rows past nt. */
static void dequant_tile(const int8_t *w, const float *scale, int n0, int nt, int K, float *wf) {
    for (int r = 0; r < TILE_N; r++) {
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

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
#endif

/* y[m, n0 + r] = wf[r] . x[m] for the tile's rows, two activation rows at a time. */
static void tile_matmul(const float *x, const float *wf, int M, int K, int n0, int nt, int N,
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

/* x (M, K) float32, w (N, K) int8, scale (N,) float32, bias (N,) float32 or NULL -> y (M, N).
 * Returns 0, or -1 when a thread cannot get its scratch tile. */
int tern_int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias,
                     float *y, int M, int N, int K) {
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
            dequant_tile(w, scale, n0, nt, K, wf);
            tile_matmul(x, wf, M, K, n0, nt, N, bias, y);
        }
        free(wf);
    }
    return failed ? -1 : 0;
}
