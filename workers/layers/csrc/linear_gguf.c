/* GGUF block-quantized weights multiplied as they are stored: Q8_0, Q4_0 and Q4_1 (ggml's types
 * 8, 2 and 3), blocks of 32 consecutive values of a row. Each block is dequantized in registers
 * exactly as ggml and the gguf package dequantize it (float16 scale d, and Q4_1's minimum m, widened
 * to float32; Q8_0: d * q; Q4_0: d * (q - 8); Q4_1: d * q + m, rounded twice), and multiplied with
 * float32 activations: the products are those of the dequantized float32 weight, only summed in
 * another order. Few rows stream the blocks once per row of x; more rows dequantize TILE_N weight
 * rows into L1 and reuse them for every row (tile_matmul).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "linear_tiles.h"
#include "tern_kernels.h"

#define QK 32

static inline int block_bytes(int type) {
    switch (type) {
    case TERN_GGUF_Q8_0: return 34;
    case TERN_GGUF_Q4_0: return 18;
    case TERN_GGUF_Q4_1: return 20;
    default: return 0;
    }
}

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One block's 32 values as float32, as the gguf package computes them. */
static inline void dequant_block(const uint8_t *b, int type, float *out) {
    uint16_t dh, mh;
    memcpy(&dh, b, 2);
    float d = half_to_float(dh);
    if (type == TERN_GGUF_Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < QK; i++) out[i] = d * (float)q[i];
        return;
    }
    const uint8_t *qs = b + (type == TERN_GGUF_Q4_1 ? 4 : 2);
    if (type == TERN_GGUF_Q4_0) {
        for (int i = 0; i < QK / 2; i++) {
            out[i] = d * (float)((int)(qs[i] & 0x0f) - 8);
            out[i + QK / 2] = d * (float)((int)(qs[i] >> 4) - 8);
        }
        return;
    }
    memcpy(&mh, b + 2, 2);
    float m = half_to_float(mh);
    for (int i = 0; i < QK / 2; i++) {
        float lo = d * (float)(qs[i] & 0x0f), hi = d * (float)(qs[i] >> 4);
        out[i] = lo + m;
        out[i + QK / 2] = hi + m;
    }
}

#ifdef __AVX2__
/* The same 32 values in four vectors of 8. */
static inline void dequant_block8(const uint8_t *b, int type, __m256 v[4]) {
    uint16_t dh, mh;
    memcpy(&dh, b, 2);
    __m256 d = _mm256_set1_ps(half_to_float(dh));
    if (type == TERN_GGUF_Q8_0) {
        for (int j = 0; j < 4; j++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j));
            v[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        return;
    }
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + (type == TERN_GGUF_Q4_1 ? 4 : 2)));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    if (type == TERN_GGUF_Q4_0) {
        __m256 eight = _mm256_set1_ps(8.0f);
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_mul_ps(
                d, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), eight));
        return;
    }
    memcpy(&mh, b + 2, 2);
    __m256 m = _mm256_set1_ps(half_to_float(mh));
    for (int j = 0; j < 4; j++)
        v[j] = _mm256_add_ps(
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]))), m);
}
#endif

/* y[m, n] for rows [n0, n0 + nt) and every row m of x (M < GEMV_MAX_M): each weight row's blocks
 * are read once and dequantized once, for all M rows. */
static void gguf_gemv_rows(const float *x, const uint8_t *w, int type, const float *bias, float *y,
                           int M, int N, int K, int n0, int nt) {
    int nb = K / QK, bytes = block_bytes(type);
    for (int r = 0; r < nt; r++) {
        const uint8_t *wr = w + (int64_t)(n0 + r) * nb * bytes;
        float s[GEMV_MAX_M] = {0};
#ifdef __AVX2__
        __m256 acc[GEMV_MAX_M];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m256 v[4];
            dequant_block8(wr + (int64_t)b * bytes, type, v);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (int64_t)m * K + b * QK;
                for (int j = 0; j < 4; j++)
                    acc[m] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xb + 8 * j), acc[m]);
            }
        }
        for (int m = 0; m < M; m++) s[m] = hsum(acc[m]);
#else
        float v[QK];
        for (int b = 0; b < nb; b++) {
            dequant_block(wr + (int64_t)b * bytes, type, v);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (int64_t)m * K + b * QK;
                for (int i = 0; i < QK; i++) s[m] += v[i] * xb[i];
            }
        }
#endif
        for (int m = 0; m < M; m++)
            y[(int64_t)m * N + n0 + r] = s[m] + (bias ? bias[n0 + r] : 0.f);
    }
}

/* Dequantizes weight rows [n0, n0 + nt) into wf (TILE_N, K), the rows past nt zeroed; `scale`
 * carries the block type (matmul_widened_tiles' widener signature). */
static void gguf_tile(const void *w, const float *scale, int n0, int nt, int K, float *wf) {
    int type = (int)(intptr_t)scale, nb = K / QK, bytes = block_bytes(type);
    for (int r = 0; r < TILE_N; r++) {
        float *dst = wf + (int64_t)r * K;
        if (r >= nt) {
            memset(dst, 0, sizeof(float) * K);
            continue;
        }
        const uint8_t *wr = (const uint8_t *)w + (int64_t)(n0 + r) * nb * bytes;
        for (int b = 0; b < nb; b++) dequant_block(wr + (int64_t)b * bytes, type, dst + b * QK);
    }
}

/* y (M, N) = x (M, K) @ W.T + bias, W (N, K / 32 blocks) of `type`; x, bias, y float32. Returns 0,
 * -2 for a type or K it does not take, -1 when a thread cannot get its scratch tile. */
int tern_gguf_linear(const float *x, const uint8_t *w, int type, const float *bias, float *y,
                     int M, int N, int K) {
    if (block_bytes(type) == 0 || K % QK != 0) return -2;
    if (M < GEMV_MAX_M) {
        int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            int n0 = t * GEMV_ROWS;
            gguf_gemv_rows(x, w, type, bias, y, M, N, K, n0,
                           N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS);
        }
        return 0;
    }
    return matmul_widened_tiles(x, w, (const float *)(intptr_t)type, gguf_tile, bias, y, M, N, K);
}

/* out (N, K) float32 = the dequantized weight (for GEMMs of many rows and for checks). Returns 0,
 * or -2 for a type or K it does not take. */
int tern_gguf_dequantize(const uint8_t *w, int type, float *out, int N, int K) {
    int nb = K / QK, bytes = block_bytes(type);
    if (bytes == 0 || K % QK != 0) return -2;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (int64_t)n * nb * bytes;
        for (int b = 0; b < nb; b++)
            dequant_block(wr + (int64_t)b * bytes, type, out + (int64_t)n * K + b * QK);
    }
    return 0;
}

/* ---------------------------------------------------------------- quantized activations */

/* The fast path (llama.cpp's): each 32-value block of a row of x quantized to int8 with its own
 * scale dx = max|x| / 127, and each product of a weight block and an activation block taken in
 * integers (AVX2: vpmaddubsw, then vpmaddwd): per block
 *   Q8_0: d dx sum(q xq);  Q4_0: d dx (sum(q xq) - 8 sum(xq));  Q4_1: d dx sum(q xq) + m dx sum(xq)
 * with q the stored integers. The activations' rounding (below 0.4% of each block's largest value)
 * is the only difference from the exact path. */
#define Q8ACT_MAX_ROWS 16

typedef struct {
    int8_t *q;    /* (M, K) */
    float *scale; /* (M, K / 32) */
    int32_t *sum; /* (M, K / 32): sum of each block's q */
} QuantizedRows;

static void quantize_rows_q8(const float *x, int M, int K, QuantizedRows *out) {
    int nb = K / QK;
    for (int64_t i = 0; i < (int64_t)M * nb; i++) {
        const float *xb = x + i * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        int32_t s = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)lrintf(xb[j] * inv);
            out->q[i * QK + j] = (int8_t)q;
            s += q;
        }
        out->scale[i] = dx;
        out->sum[i] = s;
    }
}

#ifdef __AVX2__
/* The weight block's integers as 32 bytes in value order (unsigned nibbles for Q4_*, Q8_0's
 * signed bytes). */
static inline __m256i block_ints(const uint8_t *b, int type) {
    if (type == TERN_GGUF_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + (type == TERN_GGUF_Q4_1 ? 4 : 2)));
    __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

/* 8 int32 partial sums of q . xq over the block (vpmaddubsw takes unsigned x signed bytes: Q8_0's
 * signs move onto xq). */
static inline __m256i block_dot8(__m256i q, const int8_t *xq, int type) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq), p16;
    if (type == TERN_GGUF_Q8_0)
        p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
    else
        p16 = _mm256_maddubs_epi16(q, x);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#else
/* sum(q xq) of one block, in scalar code. */
static inline int32_t block_dot_i8(const uint8_t *b, int type, const int8_t *xq) {
    int32_t s = 0;
    if (type == TERN_GGUF_Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < QK; i++) s += q[i] * xq[i];
        return s;
    }
    const uint8_t *qs = b + (type == TERN_GGUF_Q4_1 ? 4 : 2);
    for (int i = 0; i < QK / 2; i++) s += (qs[i] & 0x0f) * xq[i] + (qs[i] >> 4) * xq[i + QK / 2];
    return s;
}
#endif

/* Rows m0 .. m0 + mb - 1 (mb <= 4) of x against weight row wr. */
static inline void q8act_rows(const uint8_t *wr, int type, int nb, int bytes,
                              const QuantizedRows *xq, int K, int m0, int mb, float *out) {
    float corr[4] = {0};
#ifdef __AVX2__
    __m256 acc[4];
    for (int m = 0; m < 4; m++) acc[m] = _mm256_setzero_ps();
#else
    float acc[4] = {0};
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wr + (int64_t)b * bytes;
        uint16_t dh, mh = 0;
        memcpy(&dh, blk, 2);
        float d = half_to_float(dh), mw = 0.f;
        if (type == TERN_GGUF_Q4_1) {
            memcpy(&mh, blk + 2, 2);
            mw = half_to_float(mh);
        }
#ifdef __AVX2__
        __m256i q = block_ints(blk, type);
#endif
        for (int m = 0; m < mb; m++) {
            int64_t i = (int64_t)(m0 + m) * nb + b;
            float dx = xq->scale[i];
#ifdef __AVX2__
            __m256i p32 = block_dot8(q, xq->q + i * QK, type);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(d * dx), acc[m]);
#else
            acc[m] += d * dx * (float)block_dot_i8(blk, type, xq->q + i * QK);
#endif
            if (type == TERN_GGUF_Q4_0) corr[m] -= 8.f * d * dx * (float)xq->sum[i];
            else if (type == TERN_GGUF_Q4_1) corr[m] += mw * dx * (float)xq->sum[i];
        }
    }
    for (int m = 0; m < mb; m++)
#ifdef __AVX2__
        out[m] = hsum(acc[m]) + corr[m];
#else
        out[m] = acc[m] + corr[m];
#endif
    (void)K;
}

/* y (M, N) = x (M, K) @ W.T + bias with x quantized per block (above); float32 x, bias, y.
 * Returns 0, -2 for a type or K it does not take, -1 without memory for the quantized rows. */
int tern_gguf_linear_q8act(const float *x, const uint8_t *w, int type, const float *bias,
                           float *y, int M, int N, int K) {
    int nb = K / QK, bytes = block_bytes(type);
    if (bytes == 0 || K % QK != 0) return -2;
    /* From Q8ACT_MAX_ROWS rows the float tiles win (measured: 16 rows of Q4_1 at par). */
    if (M >= Q8ACT_MAX_ROWS) return tern_gguf_linear(x, w, type, bias, y, M, N, K);
    QuantizedRows xq = {malloc((size_t)M * K), malloc(sizeof(float) * (size_t)M * nb),
                        malloc(sizeof(int32_t) * (size_t)M * nb)};
    int rc = -1;
    if (xq.q != NULL && xq.scale != NULL && xq.sum != NULL) {
        quantize_rows_q8(x, M, K, &xq);
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const uint8_t *wr = w + (int64_t)n * nb * bytes;
            for (int m0 = 0; m0 < M; m0 += 4) {
                int mb = M - m0 < 4 ? M - m0 : 4;
                float out[4];
                q8act_rows(wr, type, nb, bytes, &xq, K, m0, mb, out);
                for (int m = 0; m < mb; m++)
                    y[(int64_t)(m0 + m) * N + n] = out[m] + (bias ? bias[n] : 0.f);
            }
        }
        rc = 0;
    }
    free(xq.q);
    free(xq.scale);
    free(xq.sum);
    return rc;
}
