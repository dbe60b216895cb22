/* Prefill attention: a prompt chunk's queries attend causally (optionally within a sliding
 * window) over their sequence's keys straight from the paged KV cache, flash style: keys in
 * groups of 16, an online softmax per query row, no score matrix. torch's CPU flash attention
 * (SDPA) reaches ~50 GFLOP/s at these head sizes (a 2,000-token prompt of the default model spent
 * more time in it than in its linears); this kernel's inner loops are register tiles:
 * - scores: 12 query rows (a KV head's query heads at consecutive positions) x 16 keys, one
 *   accumulator per row; the keys are packed once per call so that a group's keys are columns
 *   (bfloat16: pairs of features, for vdpbf16ps; float32: one feature per 16-key vector);
 * - P.V: 16 features of the 12 rows' outputs in registers while the 16 keys' value rows stream
 *   past: float32 products, or in bfloat16 (vdpbf16ps over pairs of keys, their values packed
 *   like the keys) with the probabilities rounded to bfloat16, as torch's bfloat16 flash
 *   attention rounds them for its P.V product; a row's sum is of the same rounded values.
 * Float32 (AVX-512F: 16 keys a group; AVX2: 8) or bfloat16 (AVX512-BF16) q, cache and output;
 * builds without them report the kernel unavailable and attention takes torch's path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#ifdef __AVX512F__
#define KEYS 16 /* keys per group: one vector of scores */
#else
#define KEYS 8
#endif
#define ROWS 12          /* query rows per work item, each an accumulator */
#define MAX_FEATURES 256 /* head_dim */

#if defined(__AVX512F__) || defined(__AVX2__)
#define PREFILL_TIERS 1
#endif

/* The longest context the kernel is worth its place for on this build (0: any). AVX2's 8-key
 * groups need a broadcast load per product (no embedded broadcasts): measured beside torch's AVX2
 * SDPA (ATEN_CPU_CAPABILITY=avx2) 0.67x at 256 tokens, 0.94x at 1,000, 1.13x at 2,000. */
int tern_prefill_attention_max_context(void) {
#ifdef __AVX512F__
    return 0;
#else
    return 1024;
#endif
}

int tern_prefill_attention_available(int bf16) {
#if defined(__AVX512BF16__)
    (void)bf16;
    return 1;
#elif defined(PREFILL_TIERS) /* AVX-512F or AVX2: float32 */
    return !bf16;
#else
    (void)bf16;
    return 0;
#endif
}

#ifdef PREFILL_TIERS
/* The slot of key `key` of a sequence: its block table's block, the offset in it. */
static inline int64_t slot_of(const int32_t *table, int block_size, int key) {
    return (int64_t)table[key / block_size] * block_size + key % block_size;
}

#ifdef __AVX512BF16__
/* Values of keys [g * 16, g * 16 + 16) of KV head h (bfloat16) as (8, D) pairs of consecutive
 * keys' values (zeros past ctx), the operand of vdpbf16ps for P.V. */
static void pack_value_pairs(const uint16_t *v_cache, const int32_t *table, int block_size,
                             int64_t slot_stride, int h, int D, int g, int ctx, uint16_t *dst) {
    for (int j = 0; j < KEYS; j++) {
        int key = g * KEYS + j;
        const uint16_t *row =
            key < ctx ? v_cache + slot_of(table, block_size, key) * slot_stride + (int64_t)h * D
                      : NULL;
        uint16_t *out = dst + (int64_t)(j / 2) * D * 2 + j % 2;
        for (int d = 0; d < D; d++) out[2 * d] = row != NULL ? row[d] : 0;
    }
}
#endif

/* Keys [g * 16, g * 16 + 16) of KV head h as a group's columns (zeros past ctx): bfloat16 as
 * (D / 2, 16) feature pairs, float32 as (D, 16). */
static void pack_group(const void *k_cache, const int32_t *table, int block_size,
                       int64_t slot_stride, int h, int D, int g, int ctx, int bf16, void *dst) {
    for (int j = 0; j < KEYS; j++) {
        int key = g * KEYS + j;
        if (bf16) {
            uint32_t *out = (uint32_t *)dst + j;
            const uint32_t *row = key < ctx ? (const uint32_t *)((const uint16_t *)k_cache +
                                                                 slot_of(table, block_size, key) *
                                                                     slot_stride +
                                                                 (int64_t)h * D)
                                            : NULL;
            for (int p = 0; p < D / 2; p++) out[p * KEYS] = row != NULL ? row[p] : 0;
        } else {
            float *out = (float *)dst + j;
            const float *row = key < ctx ? (const float *)k_cache +
                                               slot_of(table, block_size, key) * slot_stride +
                                               (int64_t)h * D
                                         : NULL;
            for (int d = 0; d < D; d++) out[d * KEYS] = row != NULL ? row[d] : 0.f;
        }
    }
}

/* One work item: up to ROWS query rows of KV head h (row i: query head h * G + i % G at position
 * first_pos + i / G of the chunk), over their keys, into out. */
typedef struct {
    const void *q[ROWS];  /* each row's query (D values) */
    void *out[ROWS];      /* each row's output */
    int last_key[ROWS];   /* the row's position: the last key it sees */
    int first_key[ROWS];  /* the first (its window's), 0 without a window */
} Rows;

#ifdef __AVX512F__
static void attend(const Rows *rows, int num_rows, const void *packed,
                   const uint16_t *packed_values, const void *v_cache, const int32_t *table,
                   int block_size, int64_t slot_stride, int h, int D, float scale, int bf16) {
    float acc[ROWS][MAX_FEATURES], row_max[ROWS], corr[ROWS];
    uint32_t p_pairs[ROWS][KEYS / 2]; /* bfloat16: each row's probabilities, key pairs */
    __m512 row_sum[ROWS]; /* lane by lane: summed across lanes once, at the end */
    float p[ROWS][KEYS] __attribute__((aligned(64)));
    int lo = rows->first_key[0], hi = rows->last_key[0];
    for (int r = 0; r < ROWS; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = _mm512_setzero_ps();
        memset(acc[r], 0, sizeof(float) * D);
        if (r < num_rows) {
            lo = rows->first_key[r] < lo ? rows->first_key[r] : lo;
            hi = rows->last_key[r] > hi ? rows->last_key[r] : hi;
        }
    }
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    size_t group_elems = (size_t)KEYS * D;
    for (int g = lo / KEYS; g <= hi / KEYS; g++) {
        __m512 s[ROWS];
        for (int r = 0; r < ROWS; r++) s[r] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
        if (bf16) {
            const uint32_t *kp = (const uint32_t *)((const uint16_t *)packed + group_elems * g);
            for (int pair = 0; pair < D / 2; pair++) {
                __m512bh kv = (__m512bh)_mm512_loadu_si512(kp + pair * KEYS);
                for (int r = 0; r < ROWS; r++)
                    s[r] = _mm512_dpbf16_ps(
                        s[r], kv,
                        (__m512bh)_mm512_set1_epi32(((const int32_t *)rows->q[r])[pair]));
            }
        } else
#endif
        {
            const float *kp = (const float *)packed + group_elems * g;
            for (int d = 0; d < D; d++) {
                __m512 kv = _mm512_loadu_ps(kp + d * KEYS);
                for (int r = 0; r < ROWS; r++)
                    s[r] = _mm512_fmadd_ps(_mm512_set1_ps(((const float *)rows->q[r])[d]), kv,
                                           s[r]);
            }
        }
        __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(g * KEYS), lanes);
        for (int r = 0; r < ROWS; r++) {
            __mmask16 live = 0;
            if (r < num_rows)
                live = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(rows->last_key[r])) &
                       _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(rows->first_key[r]));
            if (live == 0) { /* nothing of this group for the row: its state stays */
                corr[r] = 1.f;
                _mm512_store_ps(p[r], _mm512_setzero_ps());
                memset(p_pairs[r], 0, sizeof p_pairs[r]);
                continue;
            }
            __m512 sc = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
            float m = _mm512_mask_reduce_max_ps(live, sc);
            m = m > row_max[r] ? m : row_max[r];
            corr[r] = expf(row_max[r] - m); /* 0 for the row's first keys: acc is still 0 */
            row_max[r] = m;
            __m512 e = _mm512_maskz_mov_ps(
                live, exp512_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
#ifdef __AVX512BF16__
            if (packed_values != NULL) { /* P.V in bfloat16, as the sums: the rounded values */
                _mm256_storeu_si256((__m256i *)p_pairs[r], narrow16(e));
                e = round16(e);
            }
#endif
            row_sum[r] = _mm512_fmadd_ps(row_sum[r], _mm512_set1_ps(corr[r]), e);
            _mm512_store_ps(p[r], e);
        }
#ifdef __AVX512BF16__
        if (packed_values != NULL) {
            const uint32_t *vp = (const uint32_t *)(packed_values + group_elems * g);
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512 a[ROWS];
                for (int r = 0; r < ROWS; r++)
                    a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d0), _mm512_set1_ps(corr[r]));
                for (int i = 0; i < KEYS / 2; i++) {
                    __m512bh v = (__m512bh)_mm512_loadu_si512(vp + (int64_t)i * D + d0);
                    for (int r = 0; r < ROWS; r++)
                        a[r] = _mm512_dpbf16_ps(a[r], v,
                                                (__m512bh)_mm512_set1_epi32((int)p_pairs[r][i]));
                }
                for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc[r] + d0, a[r]);
            }
            continue;
        }
#endif
        int first = g * KEYS, num_keys = hi + 1 - first < KEYS ? hi + 1 - first : KEYS;
        const char *value[KEYS];
        size_t elem = bf16 ? 2 : 4;
        for (int j = 0; j < num_keys; j++)
            value[j] = (const char *)v_cache +
                       (slot_of(table, block_size, first + j) * slot_stride + (int64_t)h * D) *
                           elem;
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 a[ROWS];
            for (int r = 0; r < ROWS; r++)
                a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d0), _mm512_set1_ps(corr[r]));
            for (int j = 0; j < num_keys; j++) {
                __m512 v = bf16 ? load16_bf16((const uint16_t *)value[j] + d0)
                                : _mm512_loadu_ps((const float *)value[j] + d0);
                for (int r = 0; r < ROWS; r++)
                    a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), v, a[r]);
            }
            for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc[r] + d0, a[r]);
        }
    }
    for (int r = 0; r < num_rows; r++) {
        float inv = 1.f / _mm512_reduce_add_ps(row_sum[r]);
        for (int d = 0; d < D; d++) {
            float v = acc[r][d] * inv;
            if (bf16)
                ((uint16_t *)rows->out[r])[d] = f32_to_bf16(v);
            else
                ((float *)rows->out[r])[d] = v;
        }
    }
}
#else
/* The AVX2 build's (float32 only): the same loops, 8 keys a group. */
static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static void attend(const Rows *rows, int num_rows, const void *packed,
                   const uint16_t *packed_values, const void *v_cache, const int32_t *table,
                   int block_size, int64_t slot_stride, int h, int D, float scale, int bf16) {
    (void)packed_values, (void)bf16;
    float acc[ROWS][MAX_FEATURES], row_max[ROWS], corr[ROWS];
    float p[ROWS][KEYS] __attribute__((aligned(32)));
    __m256 row_sum[ROWS];
    int lo = rows->first_key[0], hi = rows->last_key[0];
    for (int r = 0; r < ROWS; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = _mm256_setzero_ps();
        memset(acc[r], 0, sizeof(float) * D);
        if (r < num_rows) {
            lo = rows->first_key[r] < lo ? rows->first_key[r] : lo;
            hi = rows->last_key[r] > hi ? rows->last_key[r] : hi;
        }
    }
    const __m256i lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    size_t group_elems = (size_t)KEYS * D;
    for (int g = lo / KEYS; g <= hi / KEYS; g++) {
        __m256 s[ROWS];
        for (int r = 0; r < ROWS; r++) s[r] = _mm256_setzero_ps();
        const float *kp = (const float *)packed + group_elems * g;
        for (int d = 0; d < D; d++) {
            __m256 kv = _mm256_loadu_ps(kp + d * KEYS);
            for (int r = 0; r < ROWS; r++)
                s[r] = _mm256_fmadd_ps(_mm256_set1_ps(((const float *)rows->q[r])[d]), kv, s[r]);
        }
        __m256i keys = _mm256_add_epi32(_mm256_set1_epi32(g * KEYS), lanes);
        for (int r = 0; r < ROWS; r++) {
            __m256 live = _mm256_setzero_ps();
            if (r < num_rows)
                live = _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(rows->last_key[r] + 1), keys),
                    _mm256_cmpgt_epi32(keys, _mm256_set1_epi32(rows->first_key[r] - 1))));
            if (_mm256_movemask_ps(live) == 0) { /* nothing of this group for the row */
                corr[r] = 1.f;
                _mm256_store_ps(p[r], _mm256_setzero_ps());
                continue;
            }
            __m256 sc =
                _mm256_blendv_ps(minus_inf, _mm256_mul_ps(s[r], _mm256_set1_ps(scale)), live);
            float m = max8(sc);
            m = m > row_max[r] ? m : row_max[r];
            corr[r] = expf(row_max[r] - m);
            row_max[r] = m;
            __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(sc, _mm256_set1_ps(m))), live);
            row_sum[r] = _mm256_fmadd_ps(row_sum[r], _mm256_set1_ps(corr[r]), e);
            _mm256_store_ps(p[r], e);
        }
        int first = g * KEYS, num_keys = hi + 1 - first < KEYS ? hi + 1 - first : KEYS;
        const float *value[KEYS];
        for (int j = 0; j < num_keys; j++)
            value[j] = (const float *)v_cache +
                       slot_of(table, block_size, first + j) * slot_stride + (int64_t)h * D;
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 a[ROWS];
            for (int r = 0; r < ROWS; r++)
                a[r] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d0), _mm256_set1_ps(corr[r]));
            for (int j = 0; j < num_keys; j++) {
                __m256 v = _mm256_loadu_ps(value[j] + d0);
                for (int r = 0; r < ROWS; r++)
                    a[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][j]), v, a[r]);
            }
            for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(acc[r] + d0, a[r]);
        }
    }
    for (int r = 0; r < num_rows; r++) {
        float inv = 1.f / hsum(row_sum[r]);
        for (int d = 0; d < D; d++) ((float *)rows->out[r])[d] = acc[r][d] * inv;
    }
}
#endif
#endif

/* q, out: (T, H, D) float32 or bfloat16 (bf16 = 1), token rows q_stride / out_stride elements
 * apart; k_cache, v_cache (num_slots, Hkv, D) in q's dtype, this step's keys and values already
 * written. For each of the B sequences: its chunk's q_len[b] queries start at flat token
 * q_start[b] and sit at positions ctx_start[b] .. ctx_start[b] + q_len[b] - 1; each attends to
 * keys up to its own position (from position - window + 1 with window > 0), read through its
 * block table (block_tables + b * table_stride). Only these sequences' output rows are written.
 * D % 32 == 0, D <= 256, H % Hkv == 0. Returns 0; -1 when this build lacks the kernel, the shapes
 * do not fit it, or memory runs out. */
int tern_prefill_attention(const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_start,
                           void *out, int64_t out_stride, int B, int H, int Hkv, int D,
                           int block_size, float scale, int window, int bf16) {
#ifdef PREFILL_TIERS
    if (!tern_prefill_attention_available(bf16) || D % 32 || D > MAX_FEATURES || H % Hkv ||
        B < 1)
        return -1;
    int G = H / Hkv;
    int64_t slot_stride = (int64_t)Hkv * D;
    size_t elem = bf16 ? 2 : 4, group_bytes = (size_t)KEYS * D * elem;
    /* Per (sequence, KV head): its packed keys' first group and its work items' first. */
    int64_t *first_group = malloc(sizeof(int64_t) * (B + 1));
    int *first_item = malloc(sizeof(int) * ((size_t)B * Hkv + 1));
    if (first_group == NULL || first_item == NULL) {
        free(first_group);
        free(first_item);
        return -1;
    }
    first_group[0] = 0;
    first_item[0] = 0;
    for (int b = 0; b < B; b++) {
        int ctx = ctx_start[b] + q_len[b];
        first_group[b + 1] = first_group[b] + (int64_t)Hkv * ((ctx + KEYS - 1) / KEYS);
        int items = (q_len[b] * G + ROWS - 1) / ROWS;
        for (int h = 0; h < Hkv; h++)
            first_item[b * Hkv + h + 1] = first_item[b * Hkv + h] + items;
    }
    /* the keys' groups, then (bfloat16) the values' */
    int pack_values = 0;
#ifdef __AVX512BF16__
    pack_values = bf16;
#endif
    char *packed = malloc(group_bytes * (size_t)first_group[B] * (1 + pack_values) + 64);
    if (packed == NULL) {
        free(first_group);
        free(first_item);
        return -1;
    }
    int num_groups = (int)first_group[B], num_items = first_item[B * Hkv];
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int i = 0; i < num_groups; i++) {
            int b = 0;
            while (first_group[b + 1] <= i) b++;
            int per_head = (int)((first_group[b + 1] - first_group[b]) / Hkv);
            int local = (int)(i - first_group[b]), h = local / per_head, g = local % per_head;
            pack_group(k_cache, block_tables + b * table_stride, block_size, slot_stride, h, D, g,
                       ctx_start[b] + q_len[b], bf16, packed + group_bytes * i);
#ifdef __AVX512BF16__
            if (pack_values)
                pack_value_pairs(v_cache, block_tables + b * table_stride, block_size,
                                 slot_stride, h, D, g, ctx_start[b] + q_len[b],
                                 (uint16_t *)(packed + group_bytes * (num_groups + (int64_t)i)));
#endif
        }
        /* Later items (rows further into a chunk) see more keys: handed out one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_items; item++) {
            int bh = 0;
            while (first_item[bh + 1] <= item) bh++;
            int b = bh / Hkv, h = bh % Hkv;
            int first_row = (item - first_item[bh]) * ROWS;
            int num_rows = q_len[b] * G - first_row < ROWS ? q_len[b] * G - first_row : ROWS;
            Rows rows;
            for (int r = 0; r < ROWS; r++) {
                int row = first_row + (r < num_rows ? r : 0);
                int pos = row / G, head = h * G + row % G;
                int64_t token = q_start[b] + pos;
                rows.q[r] = (const char *)q + (token * q_stride + (int64_t)head * D) * elem;
                rows.out[r] = (char *)out + (token * out_stride + (int64_t)head * D) * elem;
                rows.last_key[r] = ctx_start[b] + pos;
                rows.first_key[r] = window > 0 && rows.last_key[r] >= window
                                        ? rows.last_key[r] - window + 1
                                        : 0;
            }
            int per_head = (int)((first_group[b + 1] - first_group[b]) / Hkv);
            int64_t first = first_group[b] + (int64_t)h * per_head;
            const uint16_t *values =
                pack_values ? (const uint16_t *)(packed + group_bytes * (num_groups + first))
                            : NULL;
            attend(&rows, num_rows, packed + group_bytes * first, values, v_cache,
                   block_tables + b * table_stride, block_size, slot_stride, h, D, scale, bf16);
        }
    }
    free(packed);
    free(first_item);
    free(first_group);
    return 0;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_tables,
        (void)table_stride, (void)q_start, (void)q_len, (void)ctx_start, (void)out,
        (void)out_stride, (void)B, (void)H, (void)Hkv, (void)D, (void)block_size, (void)scale,
        (void)window, (void)bf16;
    return -1;
#endif
}
