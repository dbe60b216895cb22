/* CPU kernels of tern's hot loops, called through ctypes (workers/layers/native.py builds this).
 *
 * 1. Paged decode attention: one query token per sequence attends its whole context straight from
 *    the paged KV cache (no gathered, padded copy of K and V), with an online softmax per block.
 * 2. Weight-only int8 linear: y = x @ (w * scale[:, None]).T + bias with int8 weights and one
 *    float32 scale per output row, dequantized a tile at a time into L1; tern's few-row float32
 *    linear for decode steps.
 * 3. The elementwise glue of a decode step: RMSNorm with its residual add, rotary, SiLU-and-mul.
 * 4. Shared-memory all-reduce and all-gather for the tensor-parallel ranks of one host.
 *
 * Threads: OpenMP, the same runtime torch uses (libgomp.so.1 is resolved to the copy torch has
 * already loaded), so torch.set_num_threads governs these loops too.
 * Activations and outputs are float32; the KV cache is float32 or bfloat16.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep under -std=c11 */
#include <math.h>
#include <sched.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256  /* tokens per cache block */
#define MAX_QUERY_FLOATS 32768  /* heads x head_dim of one token */

int tern_abi_version(void) { return 1; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

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
#endif

/* ---------------------------------------------------------------- paged decode attention */

#define LOAD1_f32(p) (*(p))
#define LOAD1_bf16(p) bf16_to_f32(*(p))

/* dot_T(q, row, D): q . row; axpy_T(acc, p, row, D): acc += p * row (row: one cached K or V
 * vector of this KV head, float32 or bfloat16). Vectorised when D % 8 == 0. */
#ifdef __AVX2__
#define DEFINE_ROW_OPS(SUFFIX, KV_T)                                                             \
    static inline float dot_##SUFFIX(const float *q, const KV_T *kp, int D) {                    \
        if (D % 8) {                                                                             \
            float s = 0.f;                                                                       \
            for (int d = 0; d < D; d++) s += q[d] * LOAD1_##SUFFIX(kp + d);                      \
            return s;                                                                            \
        }                                                                                        \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                               \
        int d = 0;                                                                               \
        for (; d + 16 <= D; d += 16) {                                                           \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_##SUFFIX(kp + d), a0);            \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8_##SUFFIX(kp + d + 8), a1);    \
        }                                                                                        \
        if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_##SUFFIX(kp + d), a0);     \
        return hsum(_mm256_add_ps(a0, a1));                                                      \
    }                                                                                            \
    static inline void axpy_##SUFFIX(float *a, float p, const KV_T *vp, int D) {                 \
        if (D % 8) {                                                                             \
            for (int d = 0; d < D; d++) a[d] += p * LOAD1_##SUFFIX(vp + d);                      \
            return;                                                                              \
        }                                                                                        \
        __m256 pv = _mm256_set1_ps(p);                                                           \
        for (int d = 0; d < D; d += 8) {                                                         \
            __m256 r = _mm256_fmadd_ps(pv, load8_##SUFFIX(vp + d), _mm256_loadu_ps(a + d));      \
            _mm256_storeu_ps(a + d, r);                                                          \
        }                                                                                        \
    }
#else
#define DEFINE_ROW_OPS(SUFFIX, KV_T)                                                             \
    static inline float dot_##SUFFIX(const float *q, const KV_T *kp, int D) {                    \
        float s = 0.f;                                                                           \
        for (int d = 0; d < D; d++) s += q[d] * LOAD1_##SUFFIX(kp + d);                          \
        return s;                                                                                \
    }                                                                                            \
    static inline void axpy_##SUFFIX(float *a, float p, const KV_T *vp, int D) {                 \
        for (int d = 0; d < D; d++) a[d] += p * LOAD1_##SUFFIX(vp + d);                          \
    }
#endif
DEFINE_ROW_OPS(f32, float)
DEFINE_ROW_OPS(bf16, uint16_t)

/* acc (D,) += sum over t < n of p[t] * row t, rows `stride` elements apart. With D % 64 == 0 the
 * accumulator stays in 8 registers per 64 features while the rows stream past. */
#ifdef __AVX2__
#define DEFINE_ACCUMULATE(SUFFIX, KV_T)                                                          \
    static inline void accumulate_##SUFFIX(float *acc, const float *p, const KV_T *rows, int n,  \
                                           int64_t stride, int D) {                              \
        if (D % 64) {                                                                            \
            for (int t = 0; t < n; t++) axpy_##SUFFIX(acc, p[t], rows + t * stride, D);          \
            return;                                                                              \
        }                                                                                        \
        for (int d0 = 0; d0 < D; d0 += 64) {                                                     \
            __m256 a[8];                                                                         \
            for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(acc + d0 + 8 * c);               \
            for (int t = 0; t < n; t++) {                                                        \
                __m256 pv = _mm256_set1_ps(p[t]);                                                \
                const KV_T *r = rows + t * stride + d0;                                          \
                for (int c = 0; c < 8; c++)                                                      \
                    a[c] = _mm256_fmadd_ps(pv, load8_##SUFFIX(r + 8 * c), a[c]);                 \
            }                                                                                    \
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);               \
        }                                                                                        \
    }
#else
#define DEFINE_ACCUMULATE(SUFFIX, KV_T)                                                          \
    static inline void accumulate_##SUFFIX(float *acc, const float *p, const KV_T *rows, int n,  \
                                           int64_t stride, int D) {                              \
        for (int t = 0; t < n; t++) axpy_##SUFFIX(acc, p[t], rows + t * stride, D);              \
    }
#endif
DEFINE_ACCUMULATE(f32, float)
DEFINE_ACCUMULATE(bf16, uint16_t)

/* The bfloat16 cache's hot loops on AVX-512: P.V with 16-wide FMAs, and with AVX512-BF16 the
 * scores as bf16 pair dot products (vdpbf16ps) of the unscaled bf16 query and the cached key,
 * exact products summed in float32, scaled afterwards. At 32 sequences these were ~35% of a
 * bfloat16 decode step with the 8-wide loops above. */
#ifdef __AVX512F__
static inline __m512 load16_bf16(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

static inline void accumulate_bf16_wide(float *acc, const float *p, const uint16_t *rows, int n,
                                        int64_t stride, int D) {
    if (D % 64) {
        accumulate_bf16(acc, p, rows, n, stride, D);
        return;
    }
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 a[4];
        for (int c = 0; c < 4; c++) a[c] = _mm512_loadu_ps(acc + d0 + 16 * c);
        for (int t = 0; t < n; t++) {
            __m512 pv = _mm512_set1_ps(p[t]);
            const uint16_t *r = rows + t * stride + d0;
            for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(pv, load16_bf16(r + 16 * c), a[c]);
        }
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + d0 + 16 * c, a[c]);
    }
}
#define ACCUMULATE_bf16 accumulate_bf16_wide
#else
#define ACCUMULATE_bf16 accumulate_bf16
#endif
#define ACCUMULATE_f32 accumulate_f32

#ifdef __AVX512BF16__
static inline float dot_bf16_pairs(const uint16_t *a, const uint16_t *b, int D) { /* D % 32 == 0 */
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d),
                               (__m512bh)_mm512_loadu_si512(b + d));
    return _mm512_reduce_add_ps(acc);
}
#define SCORE_bf16(qs, qb, kp, D, scale) \
    ((qb) != NULL ? dot_bf16_pairs((qb), (kp), (D)) * (scale) : dot_bf16((qs), (kp), (D)))
#else
#define SCORE_bf16(qs, qb, kp, D, scale) dot_bf16((qs), (kp), (D))
#endif
#define SCORE_f32(qs, qb, kp, D, scale) dot_f32((qs), (kp), (D))

/* s[t] = exp(s[t] - m) for t < n (every s[t] <= m); returns their sum. */
static inline float exp_sub(float *s, int n, float m) {
    float sum = 0.f;
    int t = 0;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(m), total = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, p);
        total = _mm256_add_ps(total, p);
    }
    sum = hsum(total);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* Prefetch n rows of row_bytes each, row_stride bytes apart, into the cache. */
static inline void prefetch_rows(const char *p, int n, int64_t row_stride, int row_bytes) {
    for (int t = 0; t < n; t++)
        for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + t * row_stride + off);
}

/* One sequence's query heads of KV heads [h0, h0 + nh): G query heads of dimension D per KV head,
 * over ctx cached tokens, block by block with an online softmax. All nh heads are done block by
 * block, so each cache block (scattered in memory) is read in one short burst. k and v point at
 * head h0's part of slot 0; slot s is s * slot_stride elements further. `qs` (nh * G, D) holds
 * the queries already multiplied by the softmax scale; `out` is (nh * G, D). */
#define DEFINE_DECODE_HEADS(SUFFIX, KV_T)                                                        \
    static void decode_heads_##SUFFIX(const float *qs, const uint16_t *qb, float scale,          \
                                      const KV_T *k, const KV_T *v, const int32_t *table,        \
                                      int ctx, int nh, int G, int D, int block_size,             \
                                      int64_t slot_stride, float *out) {                         \
        int R = nh * G;                                                                          \
        float scores[MAX_GROUP * MAX_BLOCK]; /* [g][t]: one KV head of the current block */      \
        float acc[R * D], row_max[R], row_sum[R];                                                \
        for (int r = 0; r < R; r++) {                                                            \
            row_max[r] = -INFINITY;                                                              \
            row_sum[r] = 0.f;                                                                    \
        }                                                                                        \
        memset(acc, 0, sizeof(float) * R * D);                                                   \
        int64_t row_stride = slot_stride * (int64_t)sizeof(KV_T);                                \
        int num_blocks = (ctx + block_size - 1) / block_size;                                    \
        for (int j = 0; j < num_blocks; j++) {                                                   \
            int64_t base = (int64_t)table[j] * block_size;                                       \
            int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;       \
            if (j + 1 < num_blocks) { /* blocks are scattered: fetch the next one early */       \
                int64_t next = (int64_t)table[j + 1] * block_size * slot_stride;                 \
                int bytes = nh * D * (int)sizeof(KV_T);                                          \
                prefetch_rows((const char *)(k + next), block_size, row_stride, bytes);          \
                prefetch_rows((const char *)(v + next), block_size, row_stride, bytes);          \
            }                                                                                    \
            for (int h = 0; h < nh; h++) {                                                       \
                const float *qh = qs + (int64_t)h * G * D;                                       \
                const uint16_t *qbh = qb != NULL ? qb + (int64_t)h * G * D : NULL;               \
                for (int t = 0; t < n; t++) {                                                    \
                    const KV_T *kp = k + (base + t) * slot_stride + h * D;                       \
                    for (int g = 0; g < G; g++)                                                  \
                        scores[g * block_size + t] = SCORE_##SUFFIX(                             \
                            qh + g * D, qbh != NULL ? qbh + g * D : NULL, kp, D, scale);         \
                }                                                                                \
                for (int g = 0; g < G; g++) {                                                    \
                    int r = h * G + g;                                                           \
                    float *sg = scores + g * block_size;                                         \
                    float m = row_max[r];                                                        \
                    for (int t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;                       \
                    float corr = expf(row_max[r] - m);                                           \
                    row_max[r] = m;                                                              \
                    row_sum[r] = row_sum[r] * corr + exp_sub(sg, n, m);                          \
                    if (corr != 1.f)                                                             \
                        for (int d = 0; d < D; d++) acc[r * D + d] *= corr;                      \
                    ACCUMULATE_##SUFFIX(acc + r * D, sg, v + base * slot_stride + h * D, n,      \
                                        slot_stride, D);                                         \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++) {                                                            \
            float inv = 1.f / row_sum[r];                                                        \
            for (int d = 0; d < D; d++) out[r * D + d] = acc[r * D + d] * inv;                   \
        }                                                                                        \
    }
DEFINE_DECODE_HEADS(f32, float)
DEFINE_DECODE_HEADS(bf16, uint16_t)

#ifdef __AVX512BF16__
/* The bfloat16 cache with bfloat16 queries and D % 64 == 0, 16 tokens at a time (~2.5x fewer
 * instructions than decode_heads_bf16, which was bound by them, not by memory):
 * - scores: per (query head, token) a 16-lane vdpbf16ps partial, and the 16 tokens' partials
 *   summed across lanes together (hsum16) instead of one horizontal sum per score;
 * - P.V: a cached V row is widened to float32 by interleaving it with zeros (one shuffle per 16
 *   values, but the values land in a fixed permuted order within each 32: `acc` is kept in that
 *   order and put back in place once, at the end), with up to 4 query heads' accumulators held in
 *   registers while the rows stream past. */
static inline __m512 exp512_nonpositive(__m512 x) { /* exp_nonpositive on each half */
    __m256 lo = exp_nonpositive(_mm512_castps512_ps256(x));
    __m256 hi = exp_nonpositive(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
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

/* Where the value for feature i (< 32) of a 32-feature chunk sits in the chunk's two widened
 * vectors (unpacklo then unpackhi with zeros, 16 floats each). */
static inline int widened_index(int i) {
    int lane = i / 8, hi = (i % 8) / 4;
    return hi * 16 + lane * 4 + i % 4;
}

#define PV_HEADS 4 /* query heads whose accumulators stay in registers */

static void decode_heads_bf16_x16(const uint16_t *qb, float scale, const uint16_t *k,
                                  const uint16_t *v, const int32_t *table, int ctx, int nh, int G,
                                  int D, int block_size, int64_t slot_stride, float *out) {
    int R = nh * G;
    float acc[R * D], row_max[R], row_sum[R], p[MAX_GROUP][16], corr[MAX_GROUP];
    for (int r = 0; r < R; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.f;
    }
    memset(acc, 0, sizeof(float) * R * D);
    const __m512i zero = _mm512_setzero_si512();
    int64_t row_stride = slot_stride * (int64_t)sizeof(uint16_t);
    int num_blocks = (ctx + block_size - 1) / block_size;
    for (int j = 0; j < num_blocks; j++) {
        int64_t base = (int64_t)table[j] * block_size;
        int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;
        for (int h = 0; h < nh; h++) {
            const uint16_t *qh = qb + (int64_t)h * G * D;
            for (int c0 = 0; c0 < n; c0 += 16) {
                int nc = n - c0 < 16 ? n - c0 : 16;
                __mmask16 live = (__mmask16)((1u << nc) - 1u);
                const uint16_t *kc = k + (base + c0) * slot_stride + h * D;
                const uint16_t *vc = v + (base + c0) * slot_stride + h * D;
                /* Blocks are scattered: this chunk's rows of the next block are fetched while
                 * its scores are computed (one burst per block stalled on full fill buffers). */
                const char *kf = NULL, *vf = NULL;
                if (j + 1 < num_blocks) {
                    int64_t ahead = ((int64_t)table[j + 1] * block_size + c0) * slot_stride;
                    ahead += h * D;
                    kf = (const char *)(k + ahead);
                    vf = (const char *)(v + ahead);
                }
                for (int g = 0; g < G; g++) {
                    __m512 part[16];
                    for (int t = 0; t < 16; t++) {
                        if (g == 0 && kf != NULL && t < nc)
                            for (int off = 0; off < D * 2; off += 64) {
                                __builtin_prefetch(kf + t * row_stride + off);
                                __builtin_prefetch(vf + t * row_stride + off);
                            }
                        __m512 a = _mm512_setzero_ps();
                        if (t < nc)
                            for (int d = 0; d < D; d += 32)
                                a = _mm512_dpbf16_ps(
                                    a, (__m512bh)_mm512_loadu_si512(qh + g * D + d),
                                    (__m512bh)_mm512_loadu_si512(kc + t * slot_stride + d));
                        part[t] = a;
                    }
                    __m512 s = _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale));
                    s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), s);
                    int r = h * G + g;
                    float m = _mm512_reduce_max_ps(s);
                    m = m > row_max[r] ? m : row_max[r];
                    corr[g] = expf(row_max[r] - m);
                    row_max[r] = m;
                    __m512 e = _mm512_maskz_mov_ps(
                        live, exp512_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m))));
                    row_sum[r] = row_sum[r] * corr[g] + _mm512_reduce_add_ps(e);
                    _mm512_storeu_ps(p[g], e);
                }
                for (int d0 = 0; d0 < D; d0 += 64) {
                    for (int g0 = 0; g0 < G; g0 += PV_HEADS) {
                        int gn = G - g0 < PV_HEADS ? G - g0 : PV_HEADS;
                        __m512 a[PV_HEADS][4] = {{0}};
                        for (int gi = 0; gi < PV_HEADS; gi++) {
                            if (gi >= gn) break;
                            float *ar = acc + (int64_t)(h * G + g0 + gi) * D + d0;
                            __m512 cv = _mm512_set1_ps(corr[g0 + gi]);
                            for (int c = 0; c < 4; c++)
                                a[gi][c] = _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * c), cv);
                        }
                        for (int t = 0; t < nc; t++) {
                            const uint16_t *vp = vc + t * slot_stride + d0;
                            __m512i v0 = _mm512_loadu_si512(vp), v1 = _mm512_loadu_si512(vp + 32);
                            __m512 f[4] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v0)),
                                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v0)),
                                           _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v1)),
                                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v1))};
                            for (int gi = 0; gi < PV_HEADS; gi++) {
                                if (gi >= gn) break;
                                __m512 pv = _mm512_set1_ps(p[g0 + gi][t]);
                                for (int c = 0; c < 4; c++)
                                    a[gi][c] = _mm512_fmadd_ps(pv, f[c], a[gi][c]);
                            }
                        }
                        for (int gi = 0; gi < PV_HEADS; gi++) {
                            if (gi >= gn) break;
                            float *ar = acc + (int64_t)(h * G + g0 + gi) * D + d0;
                            for (int c = 0; c < 4; c++) _mm512_storeu_ps(ar + 16 * c, a[gi][c]);
                        }
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float inv = 1.f / row_sum[r];
        for (int d = 0; d < D; d++)
            out[r * D + d] = acc[r * D + d / 32 * 32 + widened_index(d % 32)] * inv;
    }
}
#endif

/* q, out: (B, H, D) float32 (io_is_bf16 = 0) or bfloat16 (1). k_cache, v_cache: (num_blocks *
 * block_size, Hkv, D) float32 or bfloat16. block_tables: (B, table_stride) int32. context_lens:
 * (B,) int32, each >= 1. With `slots` (B,) int64, this step's k_new and v_new (B, Hkv, D) in the
 * cache's dtype, token rows k_new_stride / v_new_stride elements apart, are first written to those
 * cache slots
 * (each work item writes the heads it then reads). Returns 0, -1 when the shapes exceed the
 * kernel's fixed buffers, -2 (having written nothing) when a slot is outside [0, num_slots). */
int tern_paged_decode_attention(const void *q, void *k_cache, void *v_cache,
                                const int32_t *block_tables, int64_t table_stride,
                                const int32_t *context_lens, void *out, int B, int H, int Hkv,
                                int D, int block_size, float scale, int kv_is_bf16,
                                int io_is_bf16, const void *k_new, int64_t k_new_stride,
                                const void *v_new, int64_t v_new_stride, const int64_t *slots,
                                int64_t num_slots) {
    int G = H / Hkv;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || block_size > MAX_BLOCK || G * Hkv != H ||
        H * D > MAX_QUERY_FLOATS)
        return -1;
    int64_t slot_stride = (int64_t)Hkv * D;
    for (int b = 0; slots != NULL && b < B; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return -2;
    /* One work item per sequence (all its KV heads); with too few sequences to keep the threads
     * busy, one per (sequence, KV head). */
    int nh = B >= 2 * omp_get_max_threads() ? Hkv : 1;
    int num_items = B * (Hkv / nh);
#pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < num_items; item++) {
        int b = item / (Hkv / nh);
        int h0 = item % (Hkv / nh) * nh;
        int64_t first = ((int64_t)b * H + (int64_t)h0 * G) * D;
        int n = nh * G * D;
        if (slots != NULL) {
            size_t elem = kv_is_bf16 ? 2 : 4, bytes = (size_t)nh * D * elem;
            int64_t dst = (slots[b] * slot_stride + (int64_t)h0 * D) * elem;
            int64_t k_src = ((int64_t)b * k_new_stride + (int64_t)h0 * D) * elem;
            int64_t v_src = ((int64_t)b * v_new_stride + (int64_t)h0 * D) * elem;
            memcpy((char *)k_cache + dst, (const char *)k_new + k_src, bytes);
            memcpy((char *)v_cache + dst, (const char *)v_new + v_src, bytes);
        }
        float qs[n], os[n];
        for (int i = 0; i < n; i++)
            qs[i] = (io_is_bf16 ? bf16_to_f32(((const uint16_t *)q)[first + i])
                                : ((const float *)q)[first + i]) * scale;
        const int32_t *table = block_tables + (int64_t)b * table_stride;
        float *o = io_is_bf16 ? os : (float *)out + first;
        /* bf16 queries against a bf16 cache: the pair dot products (when the build has them) */
        const uint16_t *qb =
            kv_is_bf16 && io_is_bf16 && D % 32 == 0 ? (const uint16_t *)q + first : NULL;
#ifdef __AVX512BF16__
        if (qb != NULL && D % 64 == 0)
            decode_heads_bf16_x16(qb, scale, (const uint16_t *)k_cache + h0 * D,
                                  (const uint16_t *)v_cache + h0 * D, table, context_lens[b], nh,
                                  G, D, block_size, slot_stride, o);
        else
#endif
        if (kv_is_bf16)
            decode_heads_bf16(qs, qb, scale, (const uint16_t *)k_cache + h0 * D,
                              (const uint16_t *)v_cache + h0 * D, table, context_lens[b], nh, G,
                              D, block_size, slot_stride, o);
        else
            decode_heads_f32(qs, NULL, scale, (const float *)k_cache + h0 * D,
                             (const float *)v_cache + h0 * D, table, context_lens[b], nh, G, D,
                             block_size, slot_stride, o);
        if (io_is_bf16)
            for (int i = 0; i < n; i++) ((uint16_t *)out)[first + i] = f32_to_bf16(os[i]);
    }
    return 0;
}

/* ---------------------------------------------------------------- int8 weight-only linear */

#define TILE_N 4

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

#define GEMV_ROWS 8
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
#define GEMV_MAX_M 4

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

int tern_int8_amx_linear_bf16(const uint16_t *x, const int8_t *w, const float *scale,
                              const uint16_t *bias, uint16_t *y, int M, int N, int K);

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

/* ---------------------------------------------------------------- float32 skinny linear */

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

/* Returns 0, or -1 when a thread cannot get its scratch tile. */
int tern_f32_linear(const float *x, const float *w, const float *bias, float *y, int M, int N,
                    int K) {
    if (M < GEMV_MAX_M) {
        int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            int n0 = t * GEMV_ROWS;
            f32_gemv_rows(x, w, bias, y, M, N, K, n0, N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS);
        }
        return 0;
    }
    int num_tiles = (N + TILE_N - 1) / TILE_N;
    int failed = 0;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        int n0 = t * TILE_N;
        int nt = N - n0 < TILE_N ? N - n0 : TILE_N;
        if (nt == TILE_N) {  /* whole tiles read the weight rows in place */
            tile_matmul(x, w + (int64_t)n0 * K, M, K, n0, nt, N, bias, y);
            continue;
        }
        float *wf = (float *)calloc((size_t)TILE_N * K, sizeof(float));  /* the last, padded */
        if (wf == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        memcpy(wf, w + (int64_t)n0 * K, sizeof(float) * nt * (size_t)K);
        tile_matmul(x, wf, M, K, n0, nt, N, bias, y);
        free(wf);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- decode-step elementwise ops
 * The per-layer glue of a decode step (RMSNorm with its residual add, rotary embedding, SiLU gate)
 * is a handful of microsecond-scale torch ops each; at one token per sequence their dispatch, not
 * their arithmetic, is the cost. Each is one call here, computed in the order Hugging Face's
 * float32 modules compute it (products and sums rounded separately: no contraction into FMAs). */

static float sum_of_squares(const float *r, int D) {
    int i = 0;
    float total = 0.f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= D; i += 8) {
        __m256 v = _mm256_loadu_ps(r + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    total = hsum(acc);
#endif
    for (; i < D; i++) total += r[i] * r[i];
    return total;
}

/* x (T, D) [+ res (T, D), the sum also written to res_out] -> out = w * (r / sqrt(mean(r^2) + eps)) */
void tern_rms_norm(const float *x, const float *res, float *res_out, const float *w, float *out,
                   int T, int D, float eps) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * D;
        float *r = (float *)xt;
        if (res != NULL) {
            r = res_out + (int64_t)t * D;
            const float *rt = res + (int64_t)t * D;
            for (int i = 0; i < D; i++) r[i] = xt[i] + rt[i];
        }
        float inv = 1.0f / sqrtf(sum_of_squares(r, D) / (float)D + eps);
        float *o = out + (int64_t)t * D;
        for (int i = 0; i < D; i++) o[i] = w[i] * (r[i] * inv);
    }
}

/* In place, neox style: for each head, (a, b) halves -> (a cos - b sin, b cos + a sin), with the
 * cos/sin rows (D/2,) of each token's position. q (T, H, D) and k (T, Hkv, D) have token strides
 * q_stride and k_stride (floats) and contiguous heads. Returns -1 (and changes nothing) when a
 * position is outside the table's num_positions rows. */
int tern_rotary_neox(float *q, int64_t q_stride, float *k, int64_t k_stride,
                     const int64_t *positions, int64_t num_positions, const float *cos_cache,
                     const float *sin_cache, int T, int H, int Hkv, int D) {
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        for (int h = 0; h < H + Hkv; h++) {
            float *x = h < H ? q + t * q_stride + (int64_t)h * D : k + t * k_stride + (int64_t)(h - H) * D;
            for (int i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                x[i] = ac - bs;
                x[i + half] = bc + as;
            }
        }
    }
    return 0;
}

/* x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up, silu(g) = g / (1 + exp(-g)). */
void tern_silu_and_mul(const float *x, float *out, int T, int I) {
#pragma omp parallel for schedule(static) if (T * I >= 65536)
    for (int t = 0; t < T; t++) {
        const float *g = x + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

#ifdef __AVX2__
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

/* bfloat16 x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up, silu rounded to bfloat16
 * before the product as torch's F.silu(gate) * up does. Vectorised, unlike the float32 version:
 * in bfloat16 torch's two ops cost ~40 us per layer per 1000 tokens of prefill. The sigmoid comes
 * from e = exp(-|g|), which cannot overflow: 1 / (1 + e) for g >= 0, e / (1 + e) below. */
void tern_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= 16384)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = x + (int64_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)t * I;
        int i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = load8_bf16(g + i);
            __m256 e = exp_nonpositive(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), gv)));
            __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(gv, zero, _CMP_GE_OQ));
            __m256 silu = round8_bf16(_mm256_mul_ps(gv, _mm256_div_ps(num, _mm256_add_ps(one, e))));
            store8_bf16(o + i, round8_bf16(_mm256_mul_ps(silu, load8_bf16(u + i))));
        }
#endif
        for (; i < I; i++) {
            float gi = bf16_to_f32(g[i]);
            float silu = bf16_to_f32(f32_to_bf16(gi / (1.0f + expf(-gi))));
            o[i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
        }
    }
}

/* ---------------------------------------------------------------- shared-memory collectives
 * All-reduce and all-gather among the tensor-parallel ranks of one host through a shared segment
 * (workers/shm_collectives.py maps it): gloo's TCP round trip costs about a millisecond per
 * collective here even for a few kilobytes, and a decode step makes two per layer.
 *
 * Segment: SHM_MAX_RANKS flags, one per 64-byte line, then two buffers of `world` slots of
 * slot_bytes each. Collective number `seq` (1, 2, ... in the same order on every rank) uses buffer
 * seq % 2: a rank copies its tensor into its slot, publishes flags[rank] = seq (release), waits
 * until every flag reaches seq (acquire), then reads every slot. A rank can only start collective
 * seq + 2 (same buffer) after seeing all flags at seq + 1, which each rank publishes only after it
 * has finished reading buffer seq: two buffers need no second barrier. Sums run in rank order, so
 * every rank gets bit-identical results. */


#define SHM_MAX_RANKS 64
#define SHM_FLAG_STRIDE 8 /* int64s: one flag per 64-byte cache line */
#define SHM_HEADER_BYTES (SHM_MAX_RANKS * SHM_FLAG_STRIDE * 8)

int64_t tern_shm_header_bytes(void) { return SHM_HEADER_BYTES; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Spin briefly (the peer is usually microseconds away), then yield, then sleep: a waiting rank
 * must not hold a core the engine or the other ranks need. Returns -1 after timeout_s. */
static int shm_wait_all(char *seg, int world, int64_t seq, double timeout_s) {
    volatile int64_t *flags = (volatile int64_t *)seg;
    double start = 0.0;
    for (int j = 0; j < world; j++) {
        int64_t polls = 0;
        while (__atomic_load_n(&flags[j * SHM_FLAG_STRIDE], __ATOMIC_ACQUIRE) < seq) {
            polls++;
            if (polls < 4096) {
#ifdef __AVX2__
                _mm_pause();
#endif
                continue;
            }
            if (start == 0.0) start = now_s();
            double waited = now_s() - start;
            if (waited > timeout_s) return -1;
            if (waited < 1e-3) {
                sched_yield();
            } else {
                struct timespec ts = {0, 20000};
                nanosleep(&ts, NULL);
            }
        }
    }
    return 0;
}

static char *shm_slot(char *seg, int world, int64_t seq, int64_t slot_bytes, int rank) {
    return seg + SHM_HEADER_BYTES + ((seq & 1) * world + rank) * slot_bytes;
}

static void shm_publish(char *seg, int rank, int64_t seq) {
    __atomic_store_n(&((int64_t *)seg)[rank * SHM_FLAG_STRIDE], seq, __ATOMIC_RELEASE);
}

/* x (n,) float32 (is_bf16 = 0) or bfloat16 (1), summed over the ranks in place. */
int tern_shm_all_reduce(char *seg, int rank, int world, int64_t seq, int64_t slot_bytes, void *x,
                        int64_t n, int is_bf16, double timeout_s) {
    int64_t nbytes = n * (is_bf16 ? 2 : 4);
    if (world > SHM_MAX_RANKS || nbytes > slot_bytes) return -2;
    memcpy(shm_slot(seg, world, seq, slot_bytes, rank), x, nbytes);
    shm_publish(seg, rank, seq);
    if (shm_wait_all(seg, world, seq, timeout_s) != 0) return -1;
    if (!is_bf16) {
        float *out = (float *)x;
        const float *s0 = (const float *)shm_slot(seg, world, seq, slot_bytes, 0);
        for (int64_t i = 0; i < n; i++) out[i] = s0[i];
        for (int j = 1; j < world; j++) {
            const float *sj = (const float *)shm_slot(seg, world, seq, slot_bytes, j);
            for (int64_t i = 0; i < n; i++) out[i] += sj[i];
        }
        return 0;
    }
    uint16_t *out = (uint16_t *)x;
    const uint16_t *slots[SHM_MAX_RANKS];
    for (int j = 0; j < world; j++)
        slots[j] = (const uint16_t *)shm_slot(seg, world, seq, slot_bytes, j);
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) { /* the sum in float32, rounded once: as the scalar loop below */
        __m256 acc = load8_bf16(slots[0] + i);
        for (int j = 1; j < world; j++) acc = _mm256_add_ps(acc, load8_bf16(slots[j] + i));
        store8_bf16(out + i, round8_bf16(acc));
    }
#endif
    for (; i < n; i++) {
        float acc = bf16_to_f32(slots[0][i]);
        for (int j = 1; j < world; j++) acc += bf16_to_f32(slots[j][i]);
        out[i] = f32_to_bf16(acc);
    }
    return 0;
}

/* Every rank's nbytes of x, in rank order, into out (world * nbytes). */
int tern_shm_all_gather(char *seg, int rank, int world, int64_t seq, int64_t slot_bytes,
                        const void *x, int64_t nbytes, void *out, double timeout_s) {
    if (world > SHM_MAX_RANKS || nbytes > slot_bytes) return -2;
    memcpy(shm_slot(seg, world, seq, slot_bytes, rank), x, nbytes);
    shm_publish(seg, rank, seq);
    if (shm_wait_all(seg, world, seq, timeout_s) != 0) return -1;
    for (int j = 0; j < world; j++)
        memcpy((char *)out + j * nbytes, shm_slot(seg, world, seq, slot_bytes, j), nbytes);
    return 0;
}

/* ------------------------------------------------------------------ grammar token bitmask
 * logits[rows[r]][t] = -inf where bit t of bitmask[r] is clear (xgrammar's packing: bit j of
 * int32 word w is token 32 w + j). Most words of a grammar's mask are all-clear or all-set, so
 * those take one pass of stores or none; the others go bit by bit. */
void tern_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask,
                              int64_t words_per_row, const int64_t *rows, int n_rows, int vocab) {
    const float neg_inf = -__builtin_inff();
    for (int r = 0; r < n_rows; r++) {
        float *row = logits + rows[r] * row_stride;
        const int32_t *bits = bitmask + (int64_t)r * words_per_row;
        for (int64_t w = 0; w < words_per_row; w++) {
            const uint32_t word = (uint32_t)bits[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t t0 = w * 32;
            const int n = vocab - t0 < 32 ? (int)(vocab - t0) : 32;
            if (n <= 0) break;
            float *p = row + t0;
            if (word == 0) {
                for (int j = 0; j < n; j++) p[j] = neg_inf;
            } else {
                for (int j = 0; j < n; j++)
                    if (!((word >> j) & 1u)) p[j] = neg_inf;
            }
        }
    }
}
