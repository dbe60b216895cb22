/* LoRA adapters' products added to a linear layer's output, each row on its own adapter
 * (workers/layers/lora.py): for row t on slot s = slots[t] (-1: none) and each fused projection i
 * (output columns [c_i, c_i + seg_rows[i])),
 *     shrink = a[s, i R : (i + 1) R] @ x[t]              (R values)
 *     y[t, c_i + n] += b[s, c_i + n] . shrink            (n < seg_rows[i])
 * in float32 (bfloat16 x widened, each bfloat16 y rounded once after its add).
 *
 * Both steps are dot products (the shrink's of length K, the expand's of length R), taken VL at
 * a time: VL accumulators, one per dot product, each summed along its vector's lanes at the end
 * (vsum_lanes), so every value is one fixed sequence of operations on its own row and column,
 * whichever tile, work item or thread computes it: a row's result does not depend on the rows
 * beside it or on the thread count, and the fused decode layer (decode_layer.c) and the module
 * path agree bit for bit. The rows on one adapter are taken together (up to GROUP_ROWS, and 4 or
 * 2 in one register tile of the shrink), so each tile of a and b is read from memory once for
 * them: at K 4096, 8 rows on one adapter take 3x one row's time rather than 8x.
 */
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#if defined(__SSE2__) && !defined(__AVX2__)
#include <emmintrin.h>
#endif

/* Below this many multiply-adds a call runs on the calling thread: an OpenMP region's start-up
 * and barriers cost more than the second core saves. Measured on a 2-core Zen 4 (AVX-512, R 16,
 * 3 projections), one thread / two: K 576, N 1728 at 1 row 3.7 / 4.3 us, 2 rows (110K) 4.4 /
 * 4.6, 3 rows (166K) 5.1 / 4.9; K 2048, N 3072 at 1 row (147K) 7.1 / 7.0; K 96: 2 us / 3. */
#ifndef LORA_PARALLEL_MIN_FMAS
#define LORA_PARALLEL_MIN_FMAS (1 << 17)
#endif
/* Columns of b in one expand work item (a multiple of every tier's VL: 4 KB of b at rank 16, in
 * L1 for every row of its group), and the rows of one adapter in one work item (groups of a
 * batch on one adapter leave work items for every thread). */
#define CHUNK_COLS 64
#define GROUP_ROWS 8

/* ---- VL floats at a time: vzero, vload (VL values), vload_part (n < VL, the rest zero),
 * vstore_part, vfma (a * b + acc), vadd, vsum_lanes (lane i: the sum of v[i]'s lanes). */
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vload_part(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline void vstore_part(float *p, vec v, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
static inline vec vfma(vec a, vec b, vec acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsum_lanes(const vec *v) { return hsum16(v); }
#elif defined(__AVX2__)
#define VL 8
typedef __m256 vec;
static inline __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vload_part(const float *p, int n) {
    return _mm256_maskload_ps(p, lanes_below(n));
}
static inline void vstore_part(float *p, vec v, int n) {
    _mm256_maskstore_ps(p, lanes_below(n), v);
}
static inline vec vfma(vec a, vec b, vec acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsum_lanes(const vec *v) {
    __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    /* per 128-bit half: the half's sums of v[0..3], of v[4..7] */
    __m256 lo4 = _mm256_hadd_ps(s01, s23), hi4 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20),
                         _mm256_permute2f128_ps(lo4, hi4, 0x31));
}
#elif defined(__SSE2__)
#define VL 4
typedef __m128 vec;
static inline vec vzero(void) { return _mm_setzero_ps(); }
static inline vec vload(const float *p) { return _mm_loadu_ps(p); }
static inline vec vload_part(const float *p, int n) {
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    memcpy(t, p, sizeof(float) * n);
    return _mm_loadu_ps(t);
}
static inline void vstore_part(float *p, vec v, int n) {
    float t[4];
    _mm_storeu_ps(t, v);
    memcpy(p, t, sizeof(float) * n);
}
static inline vec vfma(vec a, vec b, vec acc) { return _mm_add_ps(_mm_mul_ps(a, b), acc); }
static inline vec vadd(vec a, vec b) { return _mm_add_ps(a, b); }
static inline vec vsum_lanes(const vec *v) {
    __m128 r0 = v[0], r1 = v[1], r2 = v[2], r3 = v[3];
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    return _mm_add_ps(_mm_add_ps(r0, r1), _mm_add_ps(r2, r3));
}
#else /* other architectures: scalar */
#define VL 1
typedef float vec;
static inline vec vzero(void) { return 0.f; }
static inline vec vload(const float *p) { return *p; }
static inline vec vload_part(const float *p, int n) { return n > 0 ? *p : 0.f; }
static inline void vstore_part(float *p, vec v, int n) {
    if (n > 0) *p = v;
}
static inline vec vfma(vec a, vec b, vec acc) { return a * b + acc; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vsum_lanes(const vec *v) { return v[0]; }
#endif

/* y[0 .. nc) = round_bf16(y + d), nc <= VL: a whole vector through the tier's integer rounding,
 * a part through f32_to_bf16 (the same bits: nearest even, NaN kept quiet). */
static inline void add_bf16(uint16_t *y, vec d, int nc) {
#if defined(__AVX512F__)
    if (nc == VL) {
        __m512 v = _mm512_add_ps(load16_bf16(y), d);
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
        _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        return;
    }
#elif defined(__AVX2__)
    if (nc == VL) {
        __m256 v = _mm256_add_ps(load8_bf16(y), d);
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
        r = _mm256_srli_epi32(r, 16);
        __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(lo, hi));
        return;
    }
#endif
    float t[VL];
    vstore_part(t, d, nc);
    for (int i = 0; i < nc; i++) y[i] = f32_to_bf16(bf16_to_f32(y[i]) + t[i]);
}

/* What the three loops read; rows[] are the batch rows with an adapter, num_rows of them. */
typedef struct {
    const float *x; /* float32 rows x_stride apart, or `widened` (rows K apart) */
    int64_t x_stride;
    const uint16_t *x_bf16; /* bfloat16 x (rows x_bf16_stride apart), widened into `widened` */
    int64_t x_bf16_stride;
    float *widened; /* (num_rows, K) */
    void *y;
    int64_t y_stride;
    const int32_t *slots;
    const int32_t *rows;   /* the rows with an adapter, by slot (then row) */
    const int32_t *groups; /* runs of at most GROUP_ROWS of them on one slot: (first, count) */
    int num_rows, num_groups, K, N, R;
    int J, Jp; /* shrink values per row (nseg R), and the row stride of `shrink` (VL-padded) */
    const float *a, *b;
    float *shrink;        /* (num_rows, Jp) */
    const int32_t *cols;  /* the expand's column chunks: (segment, first column, end) each */
    int num_chunks, is_bf16;
} LoraJob;

/* Lane l < n: m[l] . v, the rows of m `stride` floats apart, `len` floats each; one accumulator
 * per row, its lanes summed at the end. Rows past n repeat the last: computed, not wanted. */
static inline __attribute__((always_inline)) vec dot_rows(const float *m, int64_t stride, int n,
                                                          const float *v, int len) {
    vec acc[VL];
    for (int l = 0; l < VL; l++) acc[l] = vzero();
    int k = 0;
    for (; k + VL <= len; k += VL) {
        vec vk = vload(v + k);
        for (int l = 0; l < VL; l++)
            acc[l] = vfma(vload(m + (l < n ? l : n - 1) * stride + k), vk, acc[l]);
    }
    if (k < len) {
        vec vk = vload_part(v + k, len - k);
        for (int l = 0; l < VL; l++)
            acc[l] = vfma(vload_part(m + (l < n ? l : n - 1) * stride + k, len - k), vk, acc[l]);
    }
    return vsum_lanes(acc);
}

/* shrink[i0 + m, j0 + j] = a[s, j0 + j] . x[rows[i0 + m]] for m < n <= MB rows on slot s and
 * j < VL / MB: a tile of lanes (j, m), each a[s] vector loaded once for the MB rows (rows and
 * a's rows past the last repeat it: computed, not stored). Each value's arithmetic is one
 * accumulator along k, its lanes summed, whatever the tile. */
static inline __attribute__((always_inline)) void shrink_tile(const LoraJob *jb, int i0, int n,
                                                              int j0, const int MB) {
    const int JB = VL / MB;
    int K = jb->K, nj = jb->J - j0 < JB ? jb->J - j0 : JB;
    const float *xs[VL], *as[VL];
    for (int m = 0; m < MB; m++) {
        int i = i0 + (m < n ? m : n - 1);
        xs[m] = jb->x + (int64_t)(jb->is_bf16 ? i : jb->rows[i]) * jb->x_stride;
    }
    const float *a = jb->a + ((int64_t)jb->slots[jb->rows[i0]] * jb->J + j0) * K;
    for (int j = 0; j < JB; j++) as[j] = a + (int64_t)(j < nj ? j : nj - 1) * K;
    vec acc[VL];
    for (int l = 0; l < VL; l++) acc[l] = vzero();
    int k = 0;
    for (; k + VL <= K; k += VL) {
        vec xv[VL];
        for (int m = 0; m < MB; m++) xv[m] = vload(xs[m] + k);
        for (int j = 0; j < JB; j++) {
            vec av = vload(as[j] + k);
            for (int m = 0; m < MB; m++) acc[j * MB + m] = vfma(av, xv[m], acc[j * MB + m]);
        }
    }
    if (k < K) {
        vec xv[VL];
        for (int m = 0; m < MB; m++) xv[m] = vload_part(xs[m] + k, K - k);
        for (int j = 0; j < JB; j++) {
            vec av = vload_part(as[j] + k, K - k);
            for (int m = 0; m < MB; m++) acc[j * MB + m] = vfma(av, xv[m], acc[j * MB + m]);
        }
    }
    float out[VL];
    vstore_part(out, vsum_lanes(acc), VL);
    for (int m = 0; m < n; m++)
        for (int j = 0; j < nj; j++)
            jb->shrink[(int64_t)(i0 + m) * jb->Jp + j0 + j] = out[j * MB + m];
}

/* shrink[i, j0 .. j0 + VL) for a group's rows i0 .. i0 + n: tiles of 4 rows (3 as 4), then of
 * 2 or 1 (fewer lanes of x: a 4-row tile's FMAs for one row would cost more than the loads of a
 * it saves). */
static void shrink_group(const LoraJob *jb, int i0, int n, int j0) {
    int i = i0, end = i0 + n;
#if VL >= 2
    int jend = j0 + VL < jb->J ? j0 + VL : jb->J;
#endif
#if VL >= 4
    for (; i + 3 <= end; i += 4)
        for (int j = j0; j < jend; j += VL / 4) shrink_tile(jb, i, end - i < 4 ? 3 : 4, j, 4);
#endif
#if VL >= 2
    for (; i + 2 <= end; i += 2)
        for (int j = j0; j < jend; j += VL / 2) shrink_tile(jb, i, 2, j, 2);
#endif
    for (; i < end; i++) shrink_tile(jb, i, 1, j0, 1);
}

/* y[rows[i], c] += b[s, c] . the segment's shrink values, for the columns c of one chunk: VL
 * columns at a time. */
static void expand_chunk(const LoraJob *jb, int i, const int32_t *chunk) {
    int t = jb->rows[i], R = jb->R, seg = chunk[0], c = chunk[1], end = chunk[2];
    const float *sh = jb->shrink + (int64_t)i * jb->Jp + (int64_t)seg * R;
    const float *b = jb->b + ((int64_t)jb->slots[t] * jb->N + c) * R;
    float *yf = (float *)jb->y + t * jb->y_stride;
    uint16_t *yb = (uint16_t *)jb->y + t * jb->y_stride;
    for (; c + VL <= end; c += VL, b += VL * R) {
        vec d = dot_rows(b, R, VL, sh, R);
        if (jb->is_bf16)
            add_bf16(yb + c, d, VL);
        else
            vstore_part(yf + c, vadd(vload(yf + c), d), VL);
    }
    if (c < end) {
        vec d = dot_rows(b, R, end - c, sh, R);
        if (jb->is_bf16)
            add_bf16(yb + c, d, end - c);
        else
            vstore_part(yf + c, vadd(vload_part(yf + c, end - c), d), end - c);
    }
}

static void widen_row(const LoraJob *jb, int i) {
    const uint16_t *src = jb->x_bf16 + (int64_t)jb->rows[i] * jb->x_bf16_stride;
    float *dst = jb->widened + (int64_t)i * jb->K;
    for (int k = 0; k < jb->K; k++) dst[k] = bf16_to_f32(src[k]);
}

/* The three loops: shared by a team when called inside a parallel region (one region start-up
 * and a barrier between loops, rather than a region per loop), all on this thread outside one.
 * A work item runs a tile of a (VL rows) or b (CHUNK_COLS rows) through every row of a group:
 * the tile is read from memory once and from cache for the group's other rows. */
static void run(const LoraJob *jb) {
    int jblocks = (jb->J + VL - 1) / VL, chunks = jb->num_chunks;
    if (jb->is_bf16) {
#pragma omp for schedule(static)
        for (int i = 0; i < jb->num_rows; i++) widen_row(jb, i);
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < (int64_t)jb->num_groups * jblocks; w++) {
        const int32_t *g = jb->groups + w / jblocks * 2;
        shrink_group(jb, g[0], g[1], (int)(w % jblocks) * VL);
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < (int64_t)jb->num_groups * chunks; w++) {
        const int32_t *g = jb->groups + w / chunks * 2;
        for (int i = g[0]; i < g[0] + g[1]; i++) expand_chunk(jb, i, jb->cols + w % chunks * 3);
    }
}

/* y (M, N) += the LoRA products of x (M, K) (rows x_stride and y_stride elements apart, float32
 * or, is_bf16, bfloat16), slots (M,) int32 in [-1, num_slots), a (num_slots, nseg R, K) and
 * b (num_slots, N, R) float32 contiguous, seg_rows (nseg,) summing to N. Returns 0; -1 for bad
 * arguments (nothing written); -2 when there is no memory for the scratch rows. */
int tern_lora_add(const void *x, int64_t x_stride, void *y, int64_t y_stride,
                  const int32_t *slots, int M, int K, int N, const float *a, const float *b,
                  int num_slots, int R, int nseg, const int32_t *seg_rows, int is_bf16) {
    if (M < 0 || K < 1 || N < 1 || R < 1 || nseg < 1 || num_slots < 0) return -1;
    if (M == 0) return 0;
    if (!x || !y || !slots || !a || !b || !seg_rows) return -1;
    if (M > 1 && (x_stride < K || y_stride < N)) return -1;
    int64_t cols = 0, num_chunks = 0;
    for (int i = 0; i < nseg; i++) {
        if (seg_rows[i] < 0) return -1;
        cols += seg_rows[i];
        num_chunks += (seg_rows[i] + CHUNK_COLS - 1) / CHUNK_COLS;
    }
    int num_rows = 0;
    for (int t = 0; t < M; t++) {
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
        num_rows += slots[t] >= 0;
    }
    if (cols != N) return -1;
    if (num_rows == 0) return 0;
    int J = nseg * R, Jp = (J + VL - 1) / VL * VL;
    size_t widened = is_bf16 ? (size_t)num_rows * K : 0;
    size_t floats = widened + (size_t)num_rows * Jp;
    size_t ints = (size_t)num_slots + 1 + 3 * (size_t)num_rows + 3 * (size_t)num_chunks;
    float *scratch = malloc(sizeof(float) * floats + sizeof(int32_t) * ints);
    if (scratch == NULL) return -2;
    int32_t *start = (int32_t *)(scratch + floats), *rows = start + num_slots + 1;
    int32_t *groups = rows + num_rows, *chunks = groups + 2 * num_rows;
    /* the rows sorted by slot (counting sort: each slot's rows start at start[slot]) */
    memset(start, 0, sizeof(int32_t) * (num_slots + 1));
    for (int t = 0; t < M; t++)
        if (slots[t] >= 0) start[slots[t] + 1]++;
    for (int s = 0; s < num_slots; s++) start[s + 1] += start[s];
    for (int t = 0; t < M; t++)
        if (slots[t] >= 0) rows[start[slots[t]]++] = t; /* start[s] ends as slot s's end */
    int num_groups = 0; /* runs of one slot's rows, GROUP_ROWS at most */
    for (int i = 0; i < num_rows; i++) {
        int32_t *last = groups + 2 * (num_groups - 1);
        if (i > 0 && slots[rows[i]] == slots[rows[i - 1]] && last[1] < GROUP_ROWS) {
            last[1]++;
        } else {
            groups[2 * num_groups] = i;
            groups[2 * num_groups++ + 1] = 1;
        }
    }
    for (int i = 0, c = 0, *p = chunks; i < nseg; c += seg_rows[i++])
        for (int col = c; col < c + seg_rows[i]; col += CHUNK_COLS, p += 3) {
            p[0] = i;
            p[1] = col;
            p[2] = col + CHUNK_COLS < c + seg_rows[i] ? col + CHUNK_COLS : c + seg_rows[i];
        }
    LoraJob jb = {
        .x = is_bf16 ? scratch : (const float *)x, .x_stride = is_bf16 ? K : x_stride,
        .x_bf16 = is_bf16 ? x : NULL, .x_bf16_stride = x_stride, .widened = scratch, .y = y,
        .y_stride = y_stride, .slots = slots, .rows = rows, .groups = groups,
        .num_rows = num_rows, .num_groups = num_groups, .K = K, .N = N, .R = R, .J = J, .Jp = Jp,
        .a = a, .b = b, .shrink = scratch + widened, .cols = chunks,
        .num_chunks = (int)num_chunks, .is_bf16 = is_bf16,
    };
    if ((int64_t)num_rows * ((int64_t)J * K + (int64_t)N * R) < LORA_PARALLEL_MIN_FMAS) {
        run(&jb); /* its omp for loops orphaned: this thread alone */
    } else {
#pragma omp parallel
        run(&jb);
    }
    free(scratch);
    return 0;
}
