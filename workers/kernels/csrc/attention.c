/* Paged decode attention: one query token per sequence attends its whole context straight from
 * the paged KV cache (no gathered, padded copy of K and V), with an online softmax per block.
 * Float32, bfloat16 or int8 cache (kv_int8.py's rows: D int8 values and a float32 scale per 16); the
 * AVX2 loops, the AVX-512 P.V loop and the AVX512-BF16 16-token loop side by side, the scalar
 * loops for builds without them.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256  /* tokens per cache block */
#define MAX_QUERY_FLOATS 32768  /* heads x head_dim of one token */

#define LOAD1_f32(p) (*(p))
#define LOAD1_bf16(p) bf16_to_f32(*(p))
#define LOAD1_i8(p) ((float)*(p))
#ifdef __AVX2__
static inline __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif
/* Elements from one head's row to the next in a token's slot: an int8 row carries its scales, one
 * float32 per KV_GROUP values after the D values (kv_int8.py's layout). */
#define KV_GROUP 16
#define HEAD_f32(D) (D)
#define HEAD_bf16(D) (D)
#define HEAD_i8(D) ((D) + (D) / KV_GROUP * 4)

/* One head's new K or V row (D float32 or bfloat16 values) as an int8 row and its scales, rounded
 * as kv_int8.quantize rounds it: per group of KV_GROUP values scale = max |x| / 127,
 * q = round-half-even(x / scale). */
static void write_i8_row(int8_t *dst, const void *src, int D, int src_bf16) {
    float x[MAX_HEAD_DIM];
    for (int d = 0; d < D; d++)
        x[d] = src_bf16 ? bf16_to_f32(((const uint16_t *)src)[d]) : ((const float *)src)[d];
    for (int g = 0; g < D / KV_GROUP; g++) {
        const float *xg = x + g * KV_GROUP;
        float amax = 0.f;
        for (int i = 0; i < KV_GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
        float scale = amax / 127.f, div = scale > 0.f ? scale : 1.f;
        for (int i = 0; i < KV_GROUP; i++) {
            float r = nearbyintf(xg[i] / div);
            dst[g * KV_GROUP + i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
        }
        memcpy(dst + D + 4 * g, &scale, sizeof scale);
    }
}

/* The float32 scale of group g of an int8 row of D values. */
static inline float group_scale(const int8_t *row, int D, int g) {
    float s;
    memcpy(&s, row + D + 4 * g, sizeof s);
    return s;
}

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

/* The int8 cache's P.V: acc (D,) += sum over t < n of p[t] * row t's values times their group's
 * scale. With D % 64 == 0, 64 features (four groups) at a time, their accumulators in 8 registers
 * while the rows stream past; else group by group. */
static inline void accumulate_i8_grouped(float *acc, const float *p, const int8_t *rows, int n,
                                         int64_t stride, int D) {
#ifdef __AVX2__
    if (D % 64 == 0) {
        for (int d0 = 0; d0 < D; d0 += 64) {
            __m256 a[8];
            for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
            for (int t = 0; t < n; t++) {
                const int8_t *r = rows + t * stride;
                for (int g = 0; g < 4; g++) {
                    __m256 pv = _mm256_set1_ps(p[t] * group_scale(r, D, d0 / KV_GROUP + g));
                    a[2 * g] = _mm256_fmadd_ps(pv, load8_i8(r + d0 + 16 * g), a[2 * g]);
                    a[2 * g + 1] = _mm256_fmadd_ps(pv, load8_i8(r + d0 + 16 * g + 8), a[2 * g + 1]);
                }
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);
        }
        return;
    }
#endif
    for (int g = 0; g < D / KV_GROUP; g++) {
        float *ag = acc + g * KV_GROUP;
        for (int t = 0; t < n; t++) {
            const int8_t *r = rows + t * stride;
            float pg = p[t] * group_scale(r, D, g);
            for (int i = 0; i < KV_GROUP; i++) ag[i] += pg * r[g * KV_GROUP + i];
        }
    }
}

/* The bfloat16 cache's hot loops on AVX-512: P.V with 16-wide FMAs, and with AVX512-BF16 the
 * scores as bf16 pair dot products (vdpbf16ps) of the unscaled bf16 query and the cached key,
 * exact products summed in float32, scaled afterwards. At 32 sequences these were ~35% of a
 * bfloat16 decode step with the 8-wide loops above. */
#ifdef __AVX512F__

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
#define ACCUMULATE_i8 accumulate_i8_grouped

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

/* One cached token's scores for the G query heads of its KV head: out[g * stride]. */
#define DEFINE_SCORES(SUFFIX, KV_T)                                                             \
    static inline void scores_##SUFFIX(const float *qh, const uint16_t *qbh, const KV_T *kp,    \
                                       int D, float scale, int G, float *out, int stride) {     \
        for (int g = 0; g < G; g++)                                                             \
            out[g * stride] =                                                                   \
                SCORE_##SUFFIX(qh + g * D, qbh != NULL ? qbh + g * D : NULL, kp, D, scale);     \
    }
DEFINE_SCORES(f32, float)
DEFINE_SCORES(bf16, uint16_t)
#define SCORES_f32 scores_f32
#define SCORES_bf16 scores_bf16

/* A block's scores, out[g * out_stride + t] for its n tokens (token t's key row at k0 + t *
 * stride) and the G query heads. On AVX2 (D % 8 == 0, float32 queries) 8 tokens at a time: per
 * query head and token one accumulator over the row, and the 8 tokens' horizontal sums taken
 * together (hsum8_in_order: 9 shuffles and adds for 8 scores, where one score's own horizontal
 * sum takes 5-6): fewer instructions where the cache is in L2 (streamed from memory, the loop is
 * bound by memory either way). A token past the last full 8 takes the same sums in the same order
 * (hsum_in_hsum8_order), so a score does not depend on where its token falls. */
#ifdef __AVX2__
/* The horizontal sums of a[0..7], in order. */
static inline __m256 hsum8_in_order(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* One vector's horizontal sum, added as hsum8_in_order adds each of its vectors. */
static inline float hsum_in_hsum8_order(__m256 a) {
    __m256 h = _mm256_hadd_ps(a, a);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

/* EIGHT_AT_A_TIME: whether the 8-token loop takes the cache's rows (load8_##SUFFIX widens them
 * to the values a float32 cache holds; not the int8 rows, whose scales it does not apply). */
#define DEFINE_BLOCK_SCORES(SUFFIX, KV_T, EIGHT_AT_A_TIME)                                        \
    static inline void block_scores_##SUFFIX(const float *qh, const uint16_t *qbh,               \
                                             const KV_T *k0, int64_t stride, int n, int D,        \
                                             float scale, int G, float *out, int out_stride) {    \
        BLOCK_SCORES_AVX2(SUFFIX, EIGHT_AT_A_TIME)                                                \
        for (int t = 0; t < n; t++)                                                               \
            SCORES_##SUFFIX(qh, qbh, k0 + t * stride, D, scale, G, out + t, out_stride);          \
    }
#ifdef __AVX2__
#define BLOCK_SCORES_AVX2(SUFFIX, EIGHT_AT_A_TIME)                                                \
    if (EIGHT_AT_A_TIME && D % 8 == 0 && qbh == NULL) {                                           \
        for (int g = 0; g < G; g++) {                                                             \
            const float *qg = qh + (int64_t)g * D;                                                \
            float *sg = out + (int64_t)g * out_stride;                                            \
            int t = 0;                                                                            \
            for (; t + 8 <= n; t += 8) {                                                          \
                __m256 a[8];                                                                      \
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();                           \
                for (int d = 0; d < D; d += 8) {                                                  \
                    __m256 qv = _mm256_loadu_ps(qg + d);                                          \
                    for (int i = 0; i < 8; i++)                                                   \
                        a[i] = _mm256_fmadd_ps(qv, load8_##SUFFIX(k0 + (t + i) * stride + d),     \
                                               a[i]);                                             \
                }                                                                                 \
                _mm256_storeu_ps(sg + t, hsum8_in_order(a));                                      \
            }                                                                                     \
            for (; t < n; t++) {                                                                  \
                __m256 a = _mm256_setzero_ps();                                                   \
                for (int d = 0; d < D; d += 8)                                                    \
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d),                                  \
                                        load8_##SUFFIX(k0 + t * stride + d), a);                  \
                sg[t] = hsum_in_hsum8_order(a);                                                   \
            }                                                                                     \
        }                                                                                         \
        (void)scale;                                                                              \
        return;                                                                                   \
    }
#else
#define BLOCK_SCORES_AVX2(SUFFIX, EIGHT_AT_A_TIME)
#endif
DEFINE_BLOCK_SCORES(f32, float, 1)
DEFINE_BLOCK_SCORES(bf16, uint16_t, 1)

/* An int8 key row is widened and scaled once, into the float32 values a float32 cache would hold
 * (the same products, so the same scores), then dotted with each of the G queries. */
static inline void scores_i8(const float *qh, const uint16_t *qbh, const int8_t *kp, int D,
                             float scale, int G, float *out, int stride) {
    float kf[MAX_HEAD_DIM];
    for (int g = 0; g < D / KV_GROUP; g++) {
        float s = group_scale(kp, D, g);
#ifdef __AVX2__
        __m256 sv = _mm256_set1_ps(s);
        for (int i = 0; i < KV_GROUP; i += 8)
            _mm256_storeu_ps(kf + g * KV_GROUP + i,
                             _mm256_mul_ps(load8_i8(kp + g * KV_GROUP + i), sv));
#else
        for (int i = 0; i < KV_GROUP; i++) kf[g * KV_GROUP + i] = (float)kp[g * KV_GROUP + i] * s;
#endif
    }
    for (int g = 0; g < G; g++) out[g * stride] = dot_f32(qh + g * D, kf, D);
    (void)qbh;
    (void)scale;
}
#define SCORES_i8 scores_i8
DEFINE_BLOCK_SCORES(i8, int8_t, 0)

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
 * over ctx cached tokens, block by block with an online softmax. k and v point at head h0's part
 * of slot 0; slot s is s * slot_stride elements further. `qs` (nh * G, D) holds the queries
 * already multiplied by the softmax scale; `out` is (nh * G, D). A block's keys, then its values,
 * are read DECODE_CHUNK slots at a time for all nh heads: a slot holds every head's row, so the
 * cache is read in order, each chunk from L1 for its heads after its first. Read head by head
 * through the whole block instead (skipping the slots' other heads' bytes, re-read later), the
 * default model's decode step at 32 sequences took ~9% longer (AVX2, Q8_0 file: 54 -> 49 ms). The
 * float32 cache still streams at only ~22 GB/s there (a sum over memory reads 40-48): it waits on
 * memory between blocks rather than computing while the next one arrives. */
#define DECODE_CHUNK 8

/* A context part's softmax state, for merge_parts (part_max NULL: the context is one part). */
static inline void keep_softmax_state(float *part_max, float *part_sum, const float *row_max,
                                      const float *row_sum, int R) {
    if (part_max == NULL) return;
    memcpy(part_max, row_max, sizeof(float) * R);
    memcpy(part_sum, row_sum, sizeof(float) * R);
}
#define DEFINE_DECODE_HEADS(SUFFIX, KV_T)                                                        \
    static void decode_heads_##SUFFIX(const float *qs, const uint16_t *qb, float scale,          \
                                      const KV_T *k, const KV_T *v, const int32_t *table,        \
                                      int start, int ctx, int nh, int G, int D, int block_size,  \
                                      int64_t slot_stride, float softcap, const float *sinks,    \
                                      float *out, float *part_max, float *part_sum) {            \
        int R = nh * G;                                                                          \
        float scores[R * block_size]; /* [r][t]: the current block's */                          \
        float acc[R * D], row_max[R], row_sum[R];                                                \
        for (int r = 0; r < R; r++) { /* a sink is one more score, with a zero value row */      \
            row_max[r] = sinks != NULL ? sinks[r] : -INFINITY;                                   \
            row_sum[r] = sinks != NULL ? 1.f : 0.f;                                              \
        }                                                                                        \
        memset(acc, 0, sizeof(float) * R * D);                                                   \
        int64_t row_stride = slot_stride * (int64_t)sizeof(KV_T);                                \
        int num_blocks = (ctx + block_size - 1) / block_size;                                    \
        for (int j = start / block_size; j < num_blocks; j++) {                                  \
            int64_t base = (int64_t)table[j] * block_size;                                       \
            int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;       \
            if (j == start / block_size) { /* a sliding window starts inside this block */       \
                base += start % block_size;                                                      \
                n -= start % block_size;                                                         \
            }                                                                                    \
            /* blocks are scattered: the next one's slots fetched chunk by chunk as this one's  \
             * are read (one burst of its whole 24 KB at the block's start was ~8% slower) */    \
            int64_t next =                                                                       \
                j + 1 < num_blocks ? (int64_t)table[j + 1] * block_size * slot_stride : -1;      \
            int slot_bytes = nh * HEAD_##SUFFIX(D) * (int)sizeof(KV_T);                          \
            for (int t0 = 0; t0 < n; t0 += DECODE_CHUNK) {                                       \
                int nt = n - t0 < DECODE_CHUNK ? n - t0 : DECODE_CHUNK;                          \
                if (next >= 0)                                                                   \
                    prefetch_rows((const char *)(k + next + t0 * slot_stride), nt, row_stride,   \
                                  slot_bytes);                                                   \
                for (int h = 0; h < nh; h++)                                                     \
                    block_scores_##SUFFIX(qs + (int64_t)h * G * D,                               \
                                          qb != NULL ? qb + (int64_t)h * G * D : NULL,           \
                                          k + (base + t0) * slot_stride + h * HEAD_##SUFFIX(D),  \
                                          slot_stride, nt, D, scale, G,                          \
                                          scores + (int64_t)h * G * block_size + t0, block_size); \
            }                                                                                    \
            for (int r = 0; r < R; r++) {                                                        \
                float *sr = scores + (int64_t)r * block_size;                                    \
                if (softcap > 0.f) /* Gemma 2: cap * tanh(s / cap) */                            \
                    for (int t = 0; t < n; t++) sr[t] = softcap * tanhf(sr[t] / softcap);        \
                float m = row_max[r];                                                            \
                for (int t = 0; t < n; t++) m = sr[t] > m ? sr[t] : m;                           \
                float corr = expf(row_max[r] - m);                                               \
                row_max[r] = m;                                                                  \
                row_sum[r] = row_sum[r] * corr + exp_sub(sr, n, m);                              \
                if (corr != 1.f)                                                                 \
                    for (int d = 0; d < D; d++) acc[r * D + d] *= corr;                          \
            }                                                                                    \
            for (int t0 = 0; t0 < n; t0 += DECODE_CHUNK) {                                       \
                int nt = n - t0 < DECODE_CHUNK ? n - t0 : DECODE_CHUNK;                          \
                if (next >= 0)                                                                   \
                    prefetch_rows((const char *)(v + next + t0 * slot_stride), nt, row_stride,   \
                                  slot_bytes);                                                   \
                for (int r = 0; r < R; r++)                                                      \
                    ACCUMULATE_##SUFFIX(acc + (int64_t)r * D,                                    \
                                        scores + (int64_t)r * block_size + t0,                   \
                                        v + (base + t0) * slot_stride + r / G * HEAD_##SUFFIX(D), \
                                        nt, slot_stride, D);                                     \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++) {                                                            \
            float inv = 1.f / row_sum[r];                                                        \
            for (int d = 0; d < D; d++) out[r * D + d] = acc[r * D + d] * inv;                   \
        }                                                                                        \
        keep_softmax_state(part_max, part_sum, row_max, row_sum, R);                             \
    }
DEFINE_DECODE_HEADS(f32, float)
DEFINE_DECODE_HEADS(bf16, uint16_t)
DEFINE_DECODE_HEADS(i8, int8_t)

#ifdef __AVX512BF16__
/* The bfloat16 cache with bfloat16 queries and D % 64 == 0, 16 tokens at a time (~2.5x fewer
 * instructions than decode_heads_bf16, which was bound by them, not by memory):
 * - scores: per (query head, token) a 16-lane vdpbf16ps partial, and the 16 tokens' partials
 *   summed across lanes together (hsum16) instead of one horizontal sum per score;
 * - P.V: a cached V row is widened to float32 by interleaving it with zeros (one shuffle per 16
 *   values, but the values land in a fixed permuted order within each 32: `acc` is kept in that
 *   order and put back in place once, at the end), with up to 4 query heads' accumulators held in
 *   registers while the rows stream past. */

/* Where the value for feature i (< 32) of a 32-feature chunk sits in the chunk's two widened
 * vectors (unpacklo then unpackhi with zeros, 16 floats each). */
static inline int widened_index(int i) {
    int lane = i / 8, hi = (i % 8) / 4;
    return hi * 16 + lane * 4 + i % 4;
}

#define PV_HEADS 4 /* query heads whose accumulators stay in registers */

static void decode_heads_bf16_x16(const uint16_t *qb, float scale, const uint16_t *k,
                                  const uint16_t *v, const int32_t *table, int start, int ctx,
                                  int nh, int G, int D, int block_size, int64_t slot_stride,
                                  float *out, float *part_max, float *part_sum) {
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
    for (int j = start / block_size; j < num_blocks; j++) {
        int64_t base = (int64_t)table[j] * block_size;
        int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;
        if (j == start / block_size) { /* a sliding window starts inside this block */
            base += start % block_size;
            n -= start % block_size;
        }
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
    keep_softmax_state(part_max, part_sum, row_max, row_sum, R);
}
#endif

/* A query's context is attended in parts of PART_TOKENS (at multiples of it), each a work item of
 * its own: one long context keeps every thread busy (a lone sequence's 3 KV heads on 2 threads
 * left one idle a third of the time), and the parts are merged from their softmax states. */
#define PART_TOKENS 256

/* The first token a query of context ctx attends: its window's first, else 0. */
static inline int attended_from(int ctx, int window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* How many parts the tokens [begin, ctx) fall in. */
static inline int num_parts(int begin, int ctx) {
    return (ctx - 1) / PART_TOKENS - begin / PART_TOKENS + 1;
}

/* The sequence whose items hold `item`: first_item (B + 1) ascending. */
static inline int sequence_of(const int *first_item, int B, int item) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first_item[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* One query's KV-head group from its `parts` parts (each R rows of D outputs normalised by its
 * own softmax, then its R row maxima and R sums; `stride` floats apart), in order: each part
 * weighted by its share of the whole softmax, into out (R, D) float32 or bfloat16. */
static void merge_parts(const float *part, int64_t stride, int parts, int R, int D, void *out,
                        int out_bf16) {
    for (int r = 0; r < R; r++) {
        float m = -INFINITY, total = 0.f, weight[parts];
        for (int p = 0; p < parts; p++) {
            float pm = part[stride * p + (int64_t)R * D + r];
            m = pm > m ? pm : m;
        }
        for (int p = 0; p < parts; p++) {
            const float *state = part + stride * p + (int64_t)R * D;
            weight[p] = state[R + r] * expf(state[r] - m);
            total += weight[p];
        }
        for (int d = 0; d < D; d++) {
            float v = 0.f;
            for (int p = 0; p < parts; p++) v += part[stride * p + (int64_t)r * D + d] * weight[p];
            v /= total;
            if (out_bf16)
                ((uint16_t *)out)[(int64_t)r * D + d] = f32_to_bf16(v);
            else
                ((float *)out)[(int64_t)r * D + d] = v;
        }
    }
}

/* q, out: (B, H, D) float32 (io_is_bf16 = 0) or bfloat16 (1). k_cache, v_cache: (num_blocks *
 * block_size, Hkv, D) float32 (kv_format 0) or bfloat16 (1), or (..., Hkv, HEAD_i8(D)) bytes of int8
 * rows with their group scales (2; no `slots`: the caller writes the rows). block_tables: (B, table_stride) int32. context_lens:
 * (B,) int32, each >= 1. With `slots` (B,) int64, this step's k_new and v_new (B, Hkv, D) in the
 * cache's dtype, token rows k_new_stride / v_new_stride elements apart, are first written to those
 * cache slots
 * (each work item writes the heads it then reads). `window` > 0: each query sees only its last
 * `window` tokens (a sliding-window layer: keys q - window < k <= q). `softcap` > 0: scores become
 * softcap * tanh(score / softcap) before the softmax (Gemma 2). `sinks` (H,) or NULL: each head's
 * attention sink (gpt-oss), a logit in the softmax's denominator with no value. Returns 0, -1 when
 * the shapes exceed the kernel's fixed buffers, -2 (having written nothing) when a slot is outside
 * [0, num_slots). */
int tern_paged_decode_attention(const void *q, void *k_cache, void *v_cache,
                                const int32_t *block_tables, int64_t table_stride,
                                const int32_t *context_lens, void *out, int B, int H, int Hkv,
                                int D, int block_size, float scale, int kv_format,
                                int io_is_bf16, const void *k_new, int64_t k_new_stride,
                                const void *v_new, int64_t v_new_stride, const int64_t *slots,
                                int64_t num_slots, int window, float softcap,
                                const float *sinks) {
    int G = H / Hkv;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || block_size > MAX_BLOCK || G * Hkv != H ||
        H * D > MAX_QUERY_FLOATS)
        return -1;
    int kv_is_bf16 = kv_format == 1, kv_is_i8 = kv_format == 2;
    if (kv_is_i8 && D % KV_GROUP) return -1;
    int64_t slot_stride = (int64_t)Hkv * (kv_is_i8 ? HEAD_i8(D) : D);
    for (int b = 0; slots != NULL && b < B; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return -2;
    /* Work items: per query, its KV heads (all in one item, or one each when there are too few
     * queries to keep the threads busy) and its attended context cut into parts at multiples of
     * PART_TOKENS. Parts depend on the context alone, never on the batch, so a query's sums are
     * the same in any batch (--batch-invariant relies on it); a context of several parts is
     * merged from each part's softmax state. */
    int *first_item = malloc(sizeof(int) * (B + 1));
    if (first_item == NULL) return -1;
    first_item[0] = 0;
    for (int b = 0; b < B; b++)
        first_item[b + 1] =
            first_item[b] + num_parts(attended_from(context_lens[b], window), context_lens[b]);
    /* KV heads in one item where the parts alone keep the threads busy: a slot's heads are then
     * read together, front to back (a head's share of each slot alone left the rest of its cache
     * lines to be fetched again by other items). The heads' sums do not depend on it. */
    int nh = first_item[B] >= 2 * omp_get_max_threads() ? Hkv : 1;
    int groups = Hkv / nh, R = nh * G, n = R * D, split = first_item[B] > B;
    for (int b = 1; b <= B; b++) first_item[b] *= groups;
    int num_items = first_item[B];
    int64_t part_floats = (int64_t)n + 2 * R; /* a part's output, then its row maxima and sums */
    float *parts_out = split ? malloc(sizeof(float) * part_floats * num_items) : NULL;
    if (split && parts_out == NULL) {
        free(first_item);
        return -1;
    }
#pragma omp parallel
    {
    /* Every new row is written before any query reads: several queries may be one sequence's
     * consecutive tokens (speculative decoding verifies drafts as such rows), each attending to
     * the rows of the tokens before it. */
    int num_writes = slots != NULL ? B * groups : 0;
#pragma omp for schedule(static)
    for (int item = 0; item < num_writes; item++) {
        int b = item / groups;
        int h0 = item % groups * nh;
        if (kv_is_i8) {
            size_t io = io_is_bf16 ? 2 : 4;
            for (int h = h0; h < h0 + nh; h++) {
                int64_t dst = slots[b] * slot_stride + (int64_t)h * HEAD_i8(D);
                write_i8_row((int8_t *)k_cache + dst,
                             (const char *)k_new + ((int64_t)b * k_new_stride + h * D) * io, D,
                             io_is_bf16);
                write_i8_row((int8_t *)v_cache + dst,
                             (const char *)v_new + ((int64_t)b * v_new_stride + h * D) * io, D,
                             io_is_bf16);
            }
        } else {
            size_t elem = kv_is_bf16 ? 2 : 4, bytes = (size_t)nh * D * elem;
            int64_t dst = (slots[b] * slot_stride + (int64_t)h0 * D) * elem;
            int64_t k_src = ((int64_t)b * k_new_stride + (int64_t)h0 * D) * elem;
            int64_t v_src = ((int64_t)b * v_new_stride + (int64_t)h0 * D) * elem;
            memcpy((char *)k_cache + dst, (const char *)k_new + k_src, bytes);
            memcpy((char *)v_cache + dst, (const char *)v_new + v_src, bytes);
        }
    }
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < num_items; item++) {
        int b = sequence_of(first_item, B, item);
        int local = item - first_item[b], whole = first_item[b + 1] - first_item[b] == groups;
        int part = local / groups, h0 = local % groups * nh;
        int64_t first = ((int64_t)b * H + (int64_t)h0 * G) * D;
        int ctx = context_lens[b], begin = attended_from(ctx, window);
        int lo = begin / PART_TOKENS + part;
        int part_begin = lo * PART_TOKENS > begin ? lo * PART_TOKENS : begin;
        int part_end = (lo + 1) * PART_TOKENS < ctx ? (lo + 1) * PART_TOKENS : ctx;
        float qs[n], os[n];
        for (int i = 0; i < n; i++)
            qs[i] = (io_is_bf16 ? bf16_to_f32(((const uint16_t *)q)[first + i])
                                : ((const float *)q)[first + i]) * scale;
        const int32_t *table = block_tables + (int64_t)b * table_stride;
        float *o = io_is_bf16 ? os : (float *)out + first, *pmax = NULL, *psum = NULL;
        if (!whole) {
            o = parts_out + part_floats * item;
            pmax = o + n;
            psum = pmax + R;
        }
        /* bf16 queries against a bf16 cache: the pair dot products (when the build has them) */
        const uint16_t *qb =
            kv_is_bf16 && io_is_bf16 && D % 32 == 0 ? (const uint16_t *)q + first : NULL;
        /* a sink counts once: in the first part's softmax */
        const float *item_sinks = sinks != NULL && part == 0 ? sinks + (int64_t)h0 * G : NULL;
#ifdef __AVX512BF16__
        if (qb != NULL && D % 64 == 0 && softcap <= 0.f && sinks == NULL)
            decode_heads_bf16_x16(qb, scale, (const uint16_t *)k_cache + h0 * D,
                                  (const uint16_t *)v_cache + h0 * D, table, part_begin,
                                  part_end, nh, G, D, block_size, slot_stride, o, pmax, psum);
        else
#endif
        if (kv_is_i8)
            decode_heads_i8(qs, NULL, scale, (const int8_t *)k_cache + (int64_t)h0 * HEAD_i8(D),
                            (const int8_t *)v_cache + (int64_t)h0 * HEAD_i8(D), table,
                            part_begin, part_end, nh, G, D, block_size, slot_stride, softcap,
                            item_sinks, o, pmax, psum);
        else if (kv_is_bf16)
            decode_heads_bf16(qs, qb, scale, (const uint16_t *)k_cache + h0 * D,
                              (const uint16_t *)v_cache + h0 * D, table, part_begin, part_end,
                              nh, G, D, block_size, slot_stride, softcap, item_sinks, o, pmax,
                              psum);
        else
            decode_heads_f32(qs, NULL, scale, (const float *)k_cache + h0 * D,
                             (const float *)v_cache + h0 * D, table, part_begin, part_end, nh,
                             G, D, block_size, slot_stride, softcap, item_sinks, o, pmax, psum);
        if (whole && io_is_bf16)
            for (int i = 0; i < n; i++) ((uint16_t *)out)[first + i] = f32_to_bf16(os[i]);
    }
#pragma omp for schedule(static)
    for (int pair = 0; pair < (split ? B * groups : 0); pair++) {
        int b = pair / groups, grp = pair % groups;
        int parts = (first_item[b + 1] - first_item[b]) / groups;
        if (parts == 1) continue;
        int64_t first = ((int64_t)b * H + (int64_t)grp * nh * G) * D;
        merge_parts(parts_out + part_floats * (first_item[b] + grp), part_floats * groups, parts,
                    R, D, (char *)out + first * (io_is_bf16 ? 2 : 4), io_is_bf16);
    }
    }
    free(parts_out);
    free(first_item);
    return 0;
}
