/* Block-quantized weights multiplied as they are stored: GGUF's (ggml's types) Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1 (blocks of 32 values) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256 values:
 * 8 sub-blocks of 32 with 6-bit scales and minimums, or Q6_K's 16 of 16 with int8 scales); and
 * tern's INT4_ZP (32 int4 values q, a float32 scale d and a zero point z: d * (q - z), what GPTQ
 * and AWQ checkpoints hold per group). Every type is read as 32-value chunks: the chunk's
 * integers in value order, one scale per 16 values (equal for every type but Q6_K), an offset
 * subtracted from the integers (Q4_0 8, Q5_0 16, Q6_K 32, INT4_ZP its zero point) and a term
 * added to each value (Q4_1 / Q5_1's minimum m, the K-quants' -dmin * min).
 *
 * The exact path dequantizes each chunk in registers as ggml and the gguf package do, in the same
 * float32 operations (d * (q - offset) + m; for the K-quants (d * scale) * q - dmin * min) and
 * multiplies with float32 activations: the products are those of the dequantized float32 weight,
 * only summed in another order. Few rows stream the blocks once per row of x; more rows
 * dequantize TILE_N weight rows into L1 and reuse them for every row (tile_matmul).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "linear_tiles.h"
#include "tern_kernels.h"

#define QK 32

/* Functions below take a block (or super-block) b and the index of a 32-value chunk inside it;
 * the row loops run with `type` a constant (one function per type: rows_of) and the chunk index
 * a constant in each unrolled copy (FOR_EACH_CHUNK), so each type's unpacking compiles to its own
 * straight code (measured: 1.5-2x faster at one row than switching on the type per chunk). */
#define INLINE static inline __attribute__((always_inline))

/* Loops over the chunks c of a row of nc chunks: b the block holding c, sub (a constant in each
 * unrolled copy) its index there. Close with END_CHUNKS. */
#define FOR_EACH_CHUNK(row, type, nc)                                         \
    {                                                                          \
        int values_, bytes_ = block_shape(type, &values_);                     \
        const int per_ = values_ / QK;                                         \
        for (int c0_ = 0; c0_ < (nc); c0_ += per_) {                           \
            const uint8_t *b = (row) + (int64_t)(c0_ / per_) * bytes_;         \
            _Pragma("GCC unroll 8") for (int sub = 0; sub < per_; sub++) {     \
                int c = c0_ + sub;
#define END_CHUNKS \
    }              \
    }              \
    }

/* Every block type: X(name, its type constant). */
#define EACH_BLOCK_TYPE(X)                                                                     \
    X(q8_0, TERN_GGUF_Q8_0) X(q4_0, TERN_GGUF_Q4_0) X(q4_1, TERN_GGUF_Q4_1)                    \
    X(q5_0, TERN_GGUF_Q5_0) X(q5_1, TERN_GGUF_Q5_1) X(q4_k, TERN_GGUF_Q4_K)                    \
    X(q5_k, TERN_GGUF_Q5_K) X(q6_k, TERN_GGUF_Q6_K) X(int4_zp, TERN_BLOCK_INT4_ZP)

/* Values per block and bytes per block of `type`, or 0 bytes for a type this file does not take. */
INLINE int block_shape(int type, int *values) {
    *values = 32;
    switch (type) {
    case TERN_GGUF_Q8_0: return 34;
    case TERN_GGUF_Q4_0: return 18;
    case TERN_GGUF_Q4_1: return 20;
    case TERN_GGUF_Q5_0: return 22;
    case TERN_GGUF_Q5_1: return 24;
    case TERN_BLOCK_INT4_ZP: return 21;  /* float32 d, uint8 zero point, 16 bytes of nibbles */
    }
    *values = 256;
    switch (type) {
    case TERN_GGUF_Q4_K: return 144;
    case TERN_GGUF_Q5_K: return 176;
    case TERN_GGUF_Q6_K: return 210;
    }
    return 0;
}

/* Bytes of one row of K values, or 0 when the type is unknown or K does not split into blocks. */
static inline int64_t row_bytes(int type, int K) {
    int values, bytes = block_shape(type, &values);
    return bytes == 0 || K % values ? 0 : (int64_t)K / values * bytes;
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

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* How chunk values are formed from its integers q: d[i / 16] * (q - offset) + m. */
typedef struct {
    float d[2];
    float m;
    int offset;
} ChunkScale;

/* A K-quant super-block's 6-bit scale and minimum of sub-block j (12 packed bytes). */
INLINE void k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q6_K's super-block: its float16 d at byte Q6_K_D, and the int8 scale of half h of chunk sub. */
#define Q6_K_D 208
INLINE int q6_k_scale(const uint8_t *b, int sub, int h) { return (int8_t)b[192 + 2 * sub + h]; }

INLINE ChunkScale chunk_scale(const uint8_t *b, int type, int sub) {
    ChunkScale s = {{0.f, 0.f}, 0.f, 0};
    switch (type) {
    case TERN_GGUF_Q4_K:
    case TERN_GGUF_Q5_K: {
        int scale, min;
        k_scale_min(b + 4, sub, &scale, &min);
        s.d[0] = s.d[1] = half_at(b) * (float)scale;
        s.m = -(half_at(b + 2) * (float)min);
        return s;
    }
    case TERN_GGUF_Q6_K: {
        float d = half_at(b + Q6_K_D);
        s.d[0] = d * (float)q6_k_scale(b, sub, 0);
        s.d[1] = d * (float)q6_k_scale(b, sub, 1);
        s.offset = 32;
        return s;
    }
    case TERN_BLOCK_INT4_ZP:
        memcpy(&s.d[0], b, 4);
        s.d[1] = s.d[0];
        s.offset = b[4];
        return s;
    }
    s.d[0] = s.d[1] = half_at(b);
    if (type == TERN_GGUF_Q4_1 || type == TERN_GGUF_Q5_1) s.m = half_at(b + 2);
    if (type == TERN_GGUF_Q4_0) s.offset = 8;
    if (type == TERN_GGUF_Q5_0) s.offset = 16;
    return s;
}

/* Chunk c's 32 stored integers in value order (Q8_0's as int8, the others unsigned). */
INLINE void chunk_ints(const uint8_t *b, int type, int sub, uint8_t *q) {
    uint32_t qh;
    switch (type) {
    case TERN_GGUF_Q8_0:
        memcpy(q, b + 2, QK);
        return;
    case TERN_GGUF_Q4_0:
    case TERN_GGUF_Q4_1:
    case TERN_BLOCK_INT4_ZP: {
        const uint8_t *qs = b + (type == TERN_GGUF_Q4_1 ? 4 : type == TERN_BLOCK_INT4_ZP ? 5 : 2);
        for (int i = 0; i < 16; i++) { q[i] = qs[i] & 0x0f; q[i + 16] = qs[i] >> 4; }
        return;
    }
    case TERN_GGUF_Q5_0:
    case TERN_GGUF_Q5_1: {
        int at = type == TERN_GGUF_Q5_1 ? 4 : 2;
        const uint8_t *qs = b + at + 4;
        memcpy(&qh, b + at, 4);
        for (int i = 0; i < 16; i++) {
            q[i] = (qs[i] & 0x0f) | (((qh >> i) & 1) << 4);
            q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
        return;
    }
    case TERN_GGUF_Q4_K: {
        const uint8_t *qs = b + 16 + (sub / 2) * 32;
        for (int i = 0; i < QK; i++) q[i] = sub % 2 ? qs[i] >> 4 : qs[i] & 0x0f;
        return;
    }
    case TERN_GGUF_Q5_K: {
        const uint8_t *hs = b + 16, *qs = b + 48 + (sub / 2) * 32;
        for (int i = 0; i < QK; i++)
            q[i] = (sub % 2 ? qs[i] >> 4 : qs[i] & 0x0f) | (((hs[i] >> sub) & 1) << 4);
        return;
    }
    case TERN_GGUF_Q6_K: {
        int h = sub / 4, s = sub % 4;
        const uint8_t *ql = b + h * 64 + (s % 2) * 32, *hs = b + 128 + h * 32;
        for (int i = 0; i < QK; i++)
            q[i] = (s < 2 ? ql[i] & 0x0f : ql[i] >> 4) | (((hs[i] >> (2 * s)) & 3) << 4);
        return;
    }
    }
}

/* One chunk's 32 values as float32, as the gguf package computes them. */
INLINE void dequant_chunk(const uint8_t *b, int type, int sub, float *out) {
    ChunkScale s = chunk_scale(b, type, sub);
    uint8_t q[QK];
    chunk_ints(b, type, sub, q);
    for (int i = 0; i < QK; i++) {
        int v = type == TERN_GGUF_Q8_0 ? (int)(int8_t)q[i] : (int)q[i] - s.offset;
        out[i] = s.d[i / 16] * (float)v + s.m;
    }
}

#ifdef __AVX2__
/* Byte i of the result: 0x10 when bit i of bits is set, else 0. */
static inline __m256i bit_to_0x10(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                              0x0303030303030303LL);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), select);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, select), _mm256_set1_epi8(0x10));
}

/* Low nibbles of 16 bytes as values 0-15, high nibbles as 16-31. */
static inline __m256i nibbles16(const uint8_t *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

/* chunk_ints in one vector. */
INLINE __m256i chunk_ints8(const uint8_t *b, int type, int sub) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    uint32_t qh;
    switch (type) {
    case TERN_GGUF_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case TERN_GGUF_Q4_0: return nibbles16(b + 2);
    case TERN_GGUF_Q4_1: return nibbles16(b + 4);
    case TERN_BLOCK_INT4_ZP: return nibbles16(b + 5);
    case TERN_GGUF_Q5_0:
        memcpy(&qh, b + 2, 4);
        return _mm256_or_si256(nibbles16(b + 6), bit_to_0x10(qh));
    case TERN_GGUF_Q5_1:
        memcpy(&qh, b + 4, 4);
        return _mm256_or_si256(nibbles16(b + 8), bit_to_0x10(qh));
    case TERN_GGUF_Q4_K:
    case TERN_GGUF_Q5_K: {
        int at = type == TERN_GGUF_Q4_K ? 16 : 48;
        __m256i raw = _mm256_loadu_si256((const __m256i *)(b + at + (sub / 2) * 32));
        __m256i q = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(raw, 4) : raw, low4);
        if (type == TERN_GGUF_Q4_K) return q;
        __m256i hs = _mm256_loadu_si256((const __m256i *)(b + 16));
        hs = _mm256_and_si256(_mm256_srl_epi16(hs, _mm_cvtsi32_si128(sub)), _mm256_set1_epi8(1));
        return _mm256_or_si256(q, _mm256_slli_epi16(hs, 4));
    }
    case TERN_GGUF_Q6_K: {
        int h = sub / 4, s = sub % 4;
        __m256i raw = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (s % 2) * 32));
        __m256i q = _mm256_and_si256(s < 2 ? raw : _mm256_srli_epi16(raw, 4), low4);
        __m256i hs = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
        hs = _mm256_and_si256(_mm256_srl_epi16(hs, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
        return _mm256_or_si256(q, _mm256_slli_epi16(hs, 4));
    }
    }
    return _mm256_setzero_si256();
}

/* The chunk's 32 values in four vectors of 8, as dequant_chunk computes them. */
INLINE void dequant_chunk8(const uint8_t *b, int type, int sub, __m256 v[4]) {
    ChunkScale s = chunk_scale(b, type, sub);
    __m256i q = chunk_ints8(b, type, sub);
    __m128i parts[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    __m256i off = _mm256_set1_epi32(s.offset);
    __m256 m = _mm256_set1_ps(s.m);
    for (int j = 0; j < 4; j++) {
        __m128i p = j % 2 ? _mm_srli_si128(parts[j / 2], 8) : parts[j / 2];
        __m256i wide = type == TERN_GGUF_Q8_0 ? _mm256_cvtepi8_epi32(p) : _mm256_cvtepu8_epi32(p);
        __m256 qf = _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, off));
        v[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s.d[j / 2]), qf), m);
    }
}
#endif

/* y[m, n] for rows [n0, n0 + nt) and every row m of x (M < GEMV_MAX_M): each weight row's chunks
 * are read once and dequantized once, for all M rows. */
INLINE void gguf_gemv_rows(const float *x, const uint8_t *w, int type, const float *bias, float *y,
                           int M, int N, int K, int n0, int nt) {
    int nc = K / QK;
    int64_t rb = row_bytes(type, K);
    for (int r = 0; r < nt; r++) {
        const uint8_t *wr = w + (int64_t)(n0 + r) * rb;
        float s[GEMV_MAX_M] = {0};
#ifdef __AVX2__
        __m256 acc[GEMV_MAX_M];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        FOR_EACH_CHUNK(wr, type, nc)
            __m256 v[4];
            dequant_chunk8(b, type, sub, v);
            for (int m = 0; m < M; m++) {
                const float *xc = x + (int64_t)m * K + c * QK;
                for (int j = 0; j < 4; j++)
                    acc[m] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xc + 8 * j), acc[m]);
            }
        END_CHUNKS
        for (int m = 0; m < M; m++) s[m] = hsum(acc[m]);
#else
        float v[QK];
        FOR_EACH_CHUNK(wr, type, nc)
            dequant_chunk(b, type, sub, v);
            for (int m = 0; m < M; m++) {
                const float *xc = x + (int64_t)m * K + c * QK;
                for (int i = 0; i < QK; i++) s[m] += v[i] * xc[i];
            }
        END_CHUNKS
#endif
        for (int m = 0; m < M; m++)
            y[(int64_t)m * N + n0 + r] = s[m] + (bias ? bias[n0 + r] : 0.f);
    }
}

INLINE void dequant_row_t(const uint8_t *row, int type, int K, float *out) {
    FOR_EACH_CHUNK(row, type, K / QK)
#ifdef __AVX2__
        __m256 v[4];
        dequant_chunk8(b, type, sub, v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + c * QK + 8 * j, v[j]);
#else
        dequant_chunk(b, type, sub, out + c * QK);
#endif
    END_CHUNKS
}

/* ---------------------------------------------------------------- quantized activations */

/* The fast path (llama.cpp's): each 32-value block of a row of x quantized to int8 with its own
 * scale dx = max|x| / 127, and each product of a weight chunk and an activation block taken in
 * integers: per chunk
 *   dx * sum_halves(d[h] * sum(q' xq)) + m dx sum(xq),   q' = q - offset
 * with q the stored integers. The activations' rounding (below 0.4% of each block's largest
 * value) is the only difference from the exact path. */
/* Measured per layer of the default model's shapes (2 threads), against the float32 tiles: AVX2
 * and AVX-512 builds 1.7-2.3x faster at 32 rows, 1.2-1.8x at 128-1024 (the integer products of
 * 4 rows per unpacking, x8_group_rows); a build without AVX2 from 4 rows the float32 tiles. With
 * AVX512-BF16 the integer products win below 32 rows (2-3x at 4), the bfloat16 tiles from 32 (at
 * par at 32, 1.3-1.6x at 128-384). */
#define Q8ACT_MAX_ROWS 4
#define BF16_TILES_MIN_ROWS 32

typedef struct {
    int8_t *q;    /* (M, K) */
    float *scale; /* (M, K / 32) */
    int32_t *sum; /* (M, K / 32): sum of each block's q */
    int32_t *sum_lo; /* (M, K / 32): sum of each block's first 16 q (Q6_K's halves) */
    float *dxsum; /* (M, K / 32): scale * sum */
} QuantizedRows;

static void quantize_rows_q8(const float *x, int M, int K, QuantizedRows *out) {
    int nb = K / QK;
    for (int64_t i = 0; i < (int64_t)M * nb; i++) {
        const float *xb = x + i * QK;
#ifdef __AVX2__
        /* The scalar loop's operations in vectors (cvtps rounds to nearest even, as lrintf). */
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], amax8 = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
        float amax = _mm_cvtss_f32(_mm_max_ss(a4, _mm_shuffle_ps(a4, a4, 1)));
        float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        __m256i q[4], total = _mm256_setzero_si256(), first = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
            total = _mm256_add_epi32(total, q[j]);
            if (j == 1) first = total;
        }
        /* packs interleave the 128-bit lanes: dwords 0 4 1 5 2 6 3 7 back in order */
        __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                         _mm256_packs_epi32(q[2], q[3]));
        q16 = _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(out->q + i * QK), q16);
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total),
                                   _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        int32_t s = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
        __m128i f4 = _mm_add_epi32(_mm256_castsi256_si128(first),
                                   _mm256_extracti128_si256(first, 1));
        f4 = _mm_add_epi32(f4, _mm_shuffle_epi32(f4, 0x4e));
        int32_t s_lo = _mm_cvtsi128_si32(_mm_add_epi32(f4, _mm_shuffle_epi32(f4, 0xb1)));
#else
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        int32_t s = 0, s_lo = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)lrintf(xb[j] * inv);
            out->q[i * QK + j] = (int8_t)q;
            s += q;
            if (j == 15) s_lo = s;
        }
#endif
        out->scale[i] = dx;
        out->sum[i] = s;
        out->sum_lo[i] = s_lo;
        out->dxsum[i] = dx * (float)s;
    }
}

/* ---------------------------------------------------------------- rows repacked in groups of 8 */

/* The same quantized-activation products, 8 weight rows at a time from a layout repacked at load
 * (tern_gguf_repack_x8; llama.cpp repacks Q4_0 likewise): per group of 8 rows and 32-value chunk
 * one record of
 *   d[8]     each row's chunk scale (Q6_K: d[16], the first 16 values' then the last's; the
 *            K-quants' integer sub-block scales, a byte each)
 *   m[8]     each row's minimum, added to every value (Q4_1, Q5_1; the K-quants' min and
 *            INT4_ZP's zero point z, a byte each, for -dmin * min and -z * d)
 *   values   interleaved so that 32-bit lane r of a 256-bit vector holds 4 values of row r:
 *            vector j of 4- and 5-bit types holds values 4j..4j+3 in low nibbles and
 *            16+4j..16+4j+3 in high nibbles (4 vectors), 5-bit types then their fifth bits (a
 *            vector: bit 2j + h of byte b is the fifth bit of vector j's byte b, low nibble h = 0,
 *            high h = 1); Q6_K its q (0-63) as 4-bit types, then the top two bits (two vectors:
 *            bits 4 (j % 2) + 2h and the next of vector j / 2's byte b are those of vector j's
 *            byte b, low nibble h = 0, high h = 1); Q8_0 one signed byte per value, vector j
 *            values 4j..4j+3 (8 vectors).
 * d and m are the blocks' own float16 for the types that store them so (Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0: records as large as the blocks); INT4_ZP's float32 d and its zero points' bytes, the
 * kernel forming m = -z * d (as large as the blocks too). The K-quants' records hold their
 * integer sub-block scales (and minimums), a byte each, after a header per super-block (8
 * records) of each row's float16 d (and dmin): 1.0-1.03x the blocks, where float32 scales
 * took 1.22-1.33x, and the one-row products stream the weights at the read bandwidth; the
 * kernel forms d * scale and -(dmin * min) as chunk_scale does. Q4_0's, Q5_0's and Q6_K's
 * offset (8, 16, 32) is subtracted from the integer sums (offset * the activations' block sum,
 * Q6_K's per half). Each vector is
 * multiplied by 4 activation values broadcast to every lane, so a lane sums its row's products
 * and a chunk needs no horizontal sum: ~5 instructions per row and chunk against ~20 unpacking
 * each row's block on its own. At one row of x the products then stream the weights at about the
 * machine's read bandwidth, hence the compact records. */
#define X8 8

enum { X8_NIBBLES, X8_FIVE_BITS, X8_SIX_BITS, X8_SIGNED };

/* With VNNI (vpdpbusd sums unsigned x signed byte products into 32 bits without saturating),
 * Q8_0's records hold each value + 128 as an unsigned byte: a vector's products are one
 * instruction instead of three (elsewhere the values' signs move onto the activations so that
 * vpmaddubsw's 16-bit pairs cannot saturate), and 128 times the activations' block sum is
 * subtracted once per chunk. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define X8_Q8_0_UNSIGNED 1
#else
#define X8_Q8_0_UNSIGNED 0
#endif

INLINE int x8_kind(int type) {
    switch (type) {
    case TERN_GGUF_Q4_0:
    case TERN_GGUF_Q4_1:
    case TERN_GGUF_Q4_K:
    case TERN_BLOCK_INT4_ZP: return X8_NIBBLES;
    case TERN_GGUF_Q8_0: return X8_SIGNED;
    case TERN_GGUF_Q6_K: return X8_SIX_BITS;
    }
    return X8_FIVE_BITS;
}

INLINE int x8_scales(int type) { return type == TERN_GGUF_Q6_K ? 2 : 1; }

/* Whether d and m are float16 (the blocks' own), else float32. */
INLINE int x8_half(int type) {
    return type == TERN_GGUF_Q4_0 || type == TERN_GGUF_Q4_1 || type == TERN_GGUF_Q5_0 ||
           type == TERN_GGUF_Q5_1 || type == TERN_GGUF_Q8_0;
}

INLINE int x8_has_min(int type) {
    return type == TERN_GGUF_Q4_1 || type == TERN_GGUF_Q5_1 || type == TERN_GGUF_Q4_K ||
           type == TERN_GGUF_Q5_K || type == TERN_BLOCK_INT4_ZP;
}

/* The offset subtracted from the integer sums (Q4_0, Q5_0, Q6_K), per half of a chunk where the
 * type has a scale per half (the activations' sums of each 16 values). */
INLINE int x8_int_offset(int type) {
    return type == TERN_GGUF_Q4_0   ? 8
           : type == TERN_GGUF_Q5_0 ? 16
           : type == TERN_GGUF_Q6_K ? 32
                                    : 0;
}

/* Whether the type's records come in super-blocks (the K-quants): a header of each row's float16
 * d (and dmin), then X8_SUPER records whose scales are the blocks' own integer sub-block scales
 * (and minimums), one byte each. */
INLINE int x8_super(int type) {
    return type == TERN_GGUF_Q4_K || type == TERN_GGUF_Q5_K || type == TERN_GGUF_Q6_K;
}
#define X8_SUPER 8

/* Bytes of the scales (d, then m) at the start of a record. */
INLINE int x8_scale_bytes(int type) {
    if (type == TERN_BLOCK_INT4_ZP) return X8 * 4 + X8; /* float32 d, the zero points' bytes */
    int width = x8_super(type) ? 1 : x8_half(type) ? 2 : 4;
    return X8 * width * (x8_scales(type) + x8_has_min(type));
}

/* Bytes of a super-block's header (0 for the types without one). */
INLINE int x8_header_bytes(int type) {
    return x8_super(type) ? X8 * 2 * (1 + x8_has_min(type)) : 0;
}

/* Records per header: X8_SUPER for the K-quants, else 1 (and no header). */
INLINE int x8_per_header(int type) { return x8_super(type) ? X8_SUPER : 1; }

static inline int64_t x8_record_bytes(int type) {
    int kind = x8_kind(type);
    int vectors = kind == X8_SIGNED ? 8 : kind == X8_SIX_BITS ? 6 : kind == X8_FIVE_BITS ? 5 : 4;
    return x8_scale_bytes(type) + vectors * 32;
}

/* Where chunk c's record and its super-block's header start in a group's bytes. */
INLINE int64_t x8_header_at(int type, int c) {
    int per = x8_per_header(type);
    return (int64_t)(c / per) * (x8_header_bytes(type) + per * x8_record_bytes(type));
}
INLINE int64_t x8_record_at(int type, int c) {
    return x8_header_at(type, c) + x8_header_bytes(type) +
           (c % x8_per_header(type)) * x8_record_bytes(type);
}

/* Bytes of a group's nc chunks (nc a multiple of X8_SUPER for the K-quants). */
static inline int64_t x8_group_bytes(int type, int nc) { return x8_header_at(type, nc); }

/* Writes row r's chunk `sub` of block b into its group's record (and, for the K-quants, the
 * super-block's header). */
INLINE void x8_pack_chunk(const uint8_t *b, int type, int sub, int r, uint8_t *header,
                          uint8_t *record) {
    uint8_t q[QK];
    chunk_ints(b, type, sub, q);
    int kind = x8_kind(type);
    if (type == TERN_GGUF_Q6_K) { /* d, then the int8 scales of the chunk's two halves */
        memcpy(header + 2 * r, b + Q6_K_D, 2);
        record[r] = (uint8_t)q6_k_scale(b, sub, 0);
        record[X8 + r] = (uint8_t)q6_k_scale(b, sub, 1);
    } else if (x8_super(type)) { /* d and dmin, then the 6-bit scale and minimum */
        int scale, min;
        k_scale_min(b + 4, sub, &scale, &min);
        memcpy(header + 2 * r, b, 2);
        memcpy(header + 2 * X8 + 2 * r, b + 2, 2);
        record[r] = (uint8_t)scale;
        record[X8 + r] = (uint8_t)min;
    } else if (x8_half(type)) { /* d at the block's start, Q4_1's and Q5_1's m after it */
        memcpy(record + 2 * r, b, 2);
        if (x8_has_min(type)) memcpy(record + 2 * X8 + 2 * r, b + 2, 2);
    } else { /* INT4_ZP: d, then the zero point */
        memcpy(record + 4 * r, b, 4);
        record[4 * X8 + r] = b[4];
    }
    uint8_t *values = record + x8_scale_bytes(type);
    for (int i = 0; i < QK; i++) {
        int j = (i % 16) / 4, h = i / 16, lane = 4 * r + i % 4;
        if (kind == X8_SIGNED) {
            int v = (int)(int8_t)q[i];
            if (X8_Q8_0_UNSIGNED) v += 128;
            values[32 * (i / 4) + lane] = (uint8_t)v;
            continue;
        }
        values[32 * j + lane] |= (uint8_t)((q[i] & 0x0f) << (4 * h));
        if (kind == X8_FIVE_BITS && (q[i] & 0x10)) values[128 + lane] |= (uint8_t)(1 << (2 * j + h));
        if (kind == X8_SIX_BITS)
            values[128 + 32 * (j / 2) + lane] |= (uint8_t)(((q[i] >> 4) & 3) << (4 * (j % 2) + 2 * h));
    }
}

#ifdef __AVX2__
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 8 scales, float16 or float32. */
INLINE __m256 load_scales8(const uint8_t *p, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))
                : _mm256_loadu_ps((const float *)p);
}

/* 8 bytes as floats, signed or unsigned. */
INLINE __m256 bytes8_to_ps(const uint8_t *p, int is_signed) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

/* The 16-bit lanes of v shifted left by n (right by -n), |n| <= 4. */
INLINE __m256i shift_bits(__m256i v, int n) {
    return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n);
}

/* acc + the sums of 4 products of unsigned u and signed s bytes in each 32-bit lane (u * s pairs
 * stay within int16: u <= 31 or |u| <= 128 against |s| <= 127). */
INLINE __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}
#endif

/* Scale k (0..15 for d, then m) of chunk c's record in the group at g, as chunk_scale forms it. */
INLINE float x8_scale(const uint8_t *g, int type, int c, int k) {
    const uint8_t *record = g + x8_record_at(type, c);
    if (x8_super(type)) {
        const uint8_t *header = g + x8_header_at(type, c);
        int ns = x8_scales(type), r = k % X8;
        if (k < ns * X8)
            return half_at(header + 2 * r) *
                   (float)(type == TERN_GGUF_Q6_K ? (int)(int8_t)record[k] : (int)record[k]);
        return -(half_at(header + 2 * X8 + 2 * r) * (float)record[k]);
    }
    if (x8_half(type)) return half_at(record + 2 * k);
    float d; /* INT4_ZP */
    memcpy(&d, record + 4 * (k % X8), 4);
    return k < X8 ? d : 0.f - (float)record[4 * X8 + k % X8] * d;
}

/* Rows of x per pass over a group's records in the integer products of 4+ rows (AVX2 builds):
 * each chunk's values unpacked once for X8_BLOCK_M rows. */
#define X8_BLOCK_M 4

#ifdef __AVX2__
/* out[i * 8 + r] = row r of the group at `g` times row m0 + i of x (its quantized blocks), for
 * i < MB (a constant at every call, so the accumulators stay in registers): each chunk's values
 * unpacked once for the MB rows. Each row's sums are taken in the same order whatever MB. */
INLINE void x8_group_rows(const uint8_t *g, int type, int nc, const QuantizedRows *xq, int m0,
                          const int MB, float *out) {
    const int kind = x8_kind(type), ns = x8_scales(type), half = x8_half(type);
    const int has_min = x8_has_min(type), offset = x8_int_offset(type), super = x8_super(type);
    const int values_at = x8_scale_bytes(type), sb = X8 * (half ? 2 : 4);
    __m256 acc[X8_BLOCK_M], corr[X8_BLOCK_M];
    for (int i = 0; i < MB; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 d_super = _mm256_setzero_ps(), dmin_super = _mm256_setzero_ps();
    for (int c = 0; c < nc; c++) {
        const uint8_t *record = g + x8_record_at(type, c), *v = record + values_at;
        if (super && c % X8_SUPER == 0) {
            const uint8_t *header = g + x8_header_at(type, c);
            d_super = load_scales8(header, 1);
            if (has_min) dmin_super = load_scales8(header + 2 * X8, 1);
        }
        __m256i u[8]; /* 4- and 5-bit types: vector j's low values, then its high ones; signed
                       * types: |values| (each row of x takes the values' signs) */
        if (kind != X8_SIGNED) {
            const __m256i bit4 = _mm256_set1_epi8(0x10), bits45 = _mm256_set1_epi8(0x30);
            __m256i fifth = kind == X8_FIVE_BITS ? _mm256_loadu_si256((const __m256i *)(v + 128))
                                                 : _mm256_setzero_si256();
            __m256i top[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            if (kind == X8_SIX_BITS) {
                top[0] = _mm256_loadu_si256((const __m256i *)(v + 128));
                top[1] = _mm256_loadu_si256((const __m256i *)(v + 160));
            }
            for (int j = 0; j < 4; j++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 32 * j));
                __m256i lo = _mm256_and_si256(raw, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                if (kind == X8_FIVE_BITS) {
                    /* bit 2j (+1) to bit 4 of each byte: 16-bit shifts of at most 4 bring no
                     * neighbouring byte's bit there */
                    lo = _mm256_or_si256(lo, _mm256_and_si256(shift_bits(fifth, 4 - 2 * j), bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(shift_bits(fifth, 3 - 2 * j), bit4));
                }
                if (kind == X8_SIX_BITS) { /* the top two bits to bits 4-5, alike */
                    const __m256i t = top[j / 2];
                    lo = _mm256_or_si256(lo, _mm256_and_si256(shift_bits(t, 4 - 4 * (j % 2)), bits45));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(shift_bits(t, 2 - 4 * (j % 2)), bits45));
                }
                u[j] = lo;
                u[4 + j] = hi;
            }
        } else {
            for (int j = 0; j < 8; j++) {
                u[j] = _mm256_loadu_si256((const __m256i *)(v + 32 * j));
                if (!X8_Q8_0_UNSIGNED) u[j] = _mm256_abs_epi8(u[j]);
            }
        }
        __m256 d0, d1, mins = _mm256_setzero_ps();
        if (super) { /* chunk_scale's products: d * scale, -(dmin * min) */
            d0 = _mm256_mul_ps(d_super, bytes8_to_ps(record, type == TERN_GGUF_Q6_K));
            d1 = ns == 2 ? _mm256_mul_ps(d_super, bytes8_to_ps(record + X8, 1)) : d0;
            if (has_min)
                mins = _mm256_xor_ps(_mm256_mul_ps(dmin_super, bytes8_to_ps(record + X8, 0)),
                                     _mm256_set1_ps(-0.0f));
        } else if (type == TERN_BLOCK_INT4_ZP) { /* chunk_scale's d, m - z * d with m = 0 */
            d0 = d1 = _mm256_loadu_ps((const float *)record);
            mins = _mm256_sub_ps(_mm256_setzero_ps(),
                                 _mm256_mul_ps(bytes8_to_ps(record + 4 * X8, 0), d0));
        } else {
            d0 = load_scales8(record, half);
            d1 = ns == 2 ? load_scales8(record + sb, half) : d0;
            if (has_min) mins = load_scales8(record + ns * sb, half);
        }
        for (int i = 0; i < MB; i++) {
            int64_t ix = (int64_t)(m0 + i) * nc + c;
            const int8_t *xc = xq->q + ix * QK;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            if (kind != X8_SIGNED) { /* the high values into s1 where the halves have scales */
                for (int j = 0; j < 4; j++) {
                    __m256i x_hi = _mm256_set1_epi32(load_i32(xc + 16 + 4 * j));
                    s0 = dot_u8s8(s0, u[j], _mm256_set1_epi32(load_i32(xc + 4 * j)));
                    if (ns == 2)
                        s1 = dot_u8s8(s1, u[4 + j], x_hi);
                    else
                        s0 = dot_u8s8(s0, u[4 + j], x_hi);
                }
                if (offset && ns == 2) {
                    int32_t lo_sum = xq->sum_lo[ix];
                    s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(offset * lo_sum));
                    s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(offset * (xq->sum[ix] - lo_sum)));
                } else if (offset) {
                    s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(offset * xq->sum[ix]));
                }
            } else if (X8_Q8_0_UNSIGNED) {
                for (int j = 0; j < 8; j++)
                    s0 = dot_u8s8(s0, u[j], _mm256_set1_epi32(load_i32(xc + 4 * j)));
                s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(128 * xq->sum[ix]));
            } else {
                for (int j = 0; j < 8; j++) {
                    __m256i signs = _mm256_loadu_si256((const __m256i *)(v + 32 * j));
                    __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xc + 4 * j)), signs);
                    s0 = dot_u8s8(s0, u[j], xs);
                }
            }
            __m256 dx = _mm256_set1_ps(xq->scale[ix]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, dx), acc[i]);
            if (ns == 2)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, dx), acc[i]);
            if (has_min)
                corr[i] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xq->dxsum[ix]), corr[i]);
        }
    }
    for (int i = 0; i < MB; i++) _mm256_storeu_ps(out + X8 * i, _mm256_add_ps(acc[i], corr[i]));
}
#else
/* out[r] = row r of the group at `g` times row m of x (its quantized blocks). */
INLINE void x8_group(const uint8_t *g, int type, int nc, const QuantizedRows *xq, int m,
                     float *out) {
    const int kind = x8_kind(type), ns = x8_scales(type);
    const int has_min = x8_has_min(type), offset = x8_int_offset(type);
    const int values_at = x8_scale_bytes(type);
    float acc[X8] = {0}, corr[X8] = {0};
    for (int c = 0; c < nc; c++) {
        const uint8_t *v = g + x8_record_at(type, c) + values_at;
        int64_t i = (int64_t)m * nc + c;
        const int8_t *xc = xq->q + i * QK;
        for (int r = 0; r < X8; r++) {
            int32_t dot[2] = {0, 0};
            for (int k = 0; k < QK; k++) {
                int lane = 4 * r + k % 4, u;
                if (kind == X8_SIGNED) {
                    u = (int8_t)v[32 * (k / 4) + lane];
                } else {
                    int j = (k % 16) / 4, h = k / 16;
                    u = (v[32 * j + lane] >> (4 * h)) & 0x0f;
                    if (kind == X8_FIVE_BITS) u |= ((v[128 + lane] >> (2 * j + h)) & 1) << 4;
                    if (kind == X8_SIX_BITS)
                        u |= ((v[128 + 32 * (j / 2) + lane] >> (4 * (j % 2) + 2 * h)) & 3) << 4;
                }
                dot[ns == 2 ? k / 16 : 0] += u * xc[k];
            }
            if (ns == 2) {
                dot[0] -= offset * xq->sum_lo[i];
                dot[1] -= offset * (xq->sum[i] - xq->sum_lo[i]);
            } else {
                dot[0] -= offset * xq->sum[i];
            }
            float dx = xq->scale[i];
            acc[r] += (float)dot[0] * (x8_scale(g, type, c, r) * dx);
            if (ns == 2) acc[r] += (float)dot[1] * (x8_scale(g, type, c, X8 + r) * dx);
            if (has_min) corr[r] += x8_scale(g, type, c, ns * X8 + r) * xq->dxsum[i];
        }
    }
    for (int r = 0; r < X8; r++) out[r] = acc[r] + corr[r];
}
#endif

/* ---------------------------------------------------------------- per block type */

/* The row loops compiled once per block type, each a function of its own with `type` a constant:
 * with all of them inlined into one function GCC stopped optimizing the later types (Q4_K's
 * one-row product 2.6x slower once a ninth type was added). */
typedef void (*GemvRows)(const float *x, const uint8_t *w, const float *bias, float *y, int M,
                         int N, int K, int n0, int nt);
typedef void (*DequantRow)(const uint8_t *row, int K, float *out);
typedef struct {
    GemvRows gemv;
    DequantRow dequant;
} TypeRows;
typedef void (*X8Rows)(const uint8_t *g, int nc, const QuantizedRows *xq, int m0, int mb,
                       float *out);

/* out[i * 8 + r] for rows m0 .. m0 + mb - 1 of x (mb <= X8_BLOCK_M). */
#ifdef __AVX2__
#define X8_ROWS_BODY(T)                                                        \
    if (mb == X8_BLOCK_M) {                                                    \
        x8_group_rows(g, T, nc, xq, m0, X8_BLOCK_M, out);                      \
        return;                                                                \
    }                                                                          \
    for (int i = 0; i < mb; i++) x8_group_rows(g, T, nc, xq, m0 + i, 1, out + X8 * i);
#else
#define X8_ROWS_BODY(T) \
    for (int i = 0; i < mb; i++) x8_group(g, T, nc, xq, m0 + i, out + X8 * i);
#endif

#define DEFINE_TYPE_ROWS(name, T)                                                              \
    static void gemv_rows_##name(const float *x, const uint8_t *w, const float *bias, float *y, \
                                 int M, int N, int K, int n0, int nt) {                        \
        gguf_gemv_rows(x, w, T, bias, y, M, N, K, n0, nt);                                     \
    }                                                                                          \
    static void dequant_row_##name(const uint8_t *row, int K, float *out) {                    \
        dequant_row_t(row, T, K, out);                                                         \
    }                                                                                          \
    static void x8_rows_##name(const uint8_t *g, int nc, const QuantizedRows *xq, int m0,      \
                               int mb, float *out) {                                           \
        X8_ROWS_BODY(T)                                                                        \
    }
EACH_BLOCK_TYPE(DEFINE_TYPE_ROWS)

/* The row loops of `type` (a type block_shape takes). */
static TypeRows rows_of(int type) {
#define TYPE_ROWS_CASE(name, T) \
    case T: return (TypeRows){gemv_rows_##name, dequant_row_##name};
    switch (type) { EACH_BLOCK_TYPE(TYPE_ROWS_CASE) }
#undef TYPE_ROWS_CASE
    return (TypeRows){NULL, NULL};
}

/* The group loop of `type` (a type block_shape takes). */
static X8Rows x8_rows_of(int type) {
#define X8_ROWS_CASE(name, T) \
    case T: return x8_rows_##name;
    switch (type) { EACH_BLOCK_TYPE(X8_ROWS_CASE) }
#undef X8_ROWS_CASE
    return NULL;
}

/* ---------------------------------------------------------------- float32 products */

/* Dequantizes weight rows [n0, n0 + nt) into wf (TILE_N, K), the rows past nt zeroed; `scale`
 * carries the block type (matmul_widened_tiles' widener signature). */
static void gguf_tile(const void *w, const float *scale, int n0, int nt, int K, float *wf) {
    int type = (int)(intptr_t)scale;
    int64_t rb = row_bytes(type, K);
    DequantRow dequant = rows_of(type).dequant;
    for (int r = 0; r < TILE_N; r++) {
        float *dst = wf + (int64_t)r * K;
        if (r >= nt)
            memset(dst, 0, sizeof(float) * K);
        else
            dequant((const uint8_t *)w + (int64_t)(n0 + r) * rb, K, dst);
    }
}

/* y (M, N) = x (M, K) @ W.T + bias, W (N, K) in blocks of `type`; x, bias, y float32. Returns 0,
 * -2 for a type or K it does not take, -1 when a thread cannot get its scratch tile. */
int tern_gguf_linear(const float *x, const uint8_t *w, int type, const float *bias, float *y,
                     int M, int N, int K) {
    if (row_bytes(type, K) == 0) return -2;
    if (M < GEMV_MAX_M) {
        GemvRows gemv = rows_of(type).gemv;
        int num_tiles = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            int n0 = t * GEMV_ROWS;
            gemv(x, w, bias, y, M, N, K, n0, N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS);
        }
        return 0;
    }
    return matmul_widened_tiles(x, w, (const float *)(intptr_t)type, gguf_tile, bias, y, M, N, K);
}

/* out (N, K) float32 = the dequantized weight (for GEMMs of many rows and for checks). Returns 0,
 * or -2 for a type or K it does not take. */
int tern_gguf_dequantize(const uint8_t *w, int type, float *out, int N, int K) {
    int64_t rb = row_bytes(type, K);
    if (rb == 0) return -2;
    DequantRow dequant = rows_of(type).dequant;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) dequant(w + (int64_t)n * rb, K, out + (int64_t)n * K);
    return 0;
}

/* ---------------------------------------------------------------- bfloat16 tiles */

#ifdef __AVX512BF16__
/* The fast path from BF16_TILES_MIN_ROWS rows on tiers with bfloat16 arithmetic (a c=32 decode
 * step, a prefill): BF16_TILE_N weight rows dequantized into L1 and rounded to bfloat16, x rounded
 * once, products in vdpbf16ps (32 multiply-adds an instruction against float32's 16), register
 * blocks of 4 rows of x by 4 weight rows summed by one hsum16. */
#define BF16_TILE_N 8

/* y[m, n + r] = x[m] . wt[r] + bias[n + r] for m < mb, r < nr (x, wt: bfloat16 rows of K). */
INLINE void bf16_block4(const uint16_t *x, const uint16_t *wt, const float *bias, float *y,
                        int mb, int N, int K, int n, int nr) {
    const uint16_t *xr[4], *wr[4];
    for (int i = 0; i < 4; i++) { /* missing rows repeat row 0 (x) or are zero (the tile) */
        xr[i] = x + (int64_t)(i < mb ? i : 0) * K;
        wr[i] = wt + (int64_t)i * K;
    }
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512bh xv[4];
        for (int m = 0; m < 4; m++) xv[m] = (__m512bh)_mm512_loadu_si512(xr[m] + k);
        for (int r = 0; r < 4; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[r] + k);
            for (int m = 0; m < 4; m++) acc[4 * m + r] = _mm512_dpbf16_ps(acc[4 * m + r], xv[m], wv);
        }
    }
    float s[16];
    _mm512_storeu_ps(s, hsum16(acc));
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < nr; r++)
            y[(int64_t)m * N + n + r] = s[4 * m + r] + (bias ? bias[n + r] : 0.f);
}

/* n values of src rounded to bfloat16 (n a multiple of 32). */
static inline void narrow_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t k = 0; k < n; k += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
        _mm512_storeu_si512(dst + k, (__m512i)v);
    }
}

static int gguf_linear_bf16_tiles(const float *x, const uint8_t *w, int type, const float *bias,
                                  float *y, int M, int N, int K) {
    uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)M * K);
    if (xb == NULL) return -1;
    narrow_bf16(x, xb, (int64_t)M * K);
    int64_t rb = row_bytes(type, K);
    DequantRow dequant = rows_of(type).dequant;
    int num_tiles = (N + BF16_TILE_N - 1) / BF16_TILE_N, failed = 0;
#pragma omp parallel
    {
        uint16_t *wt = (uint16_t *)malloc(sizeof(uint16_t) * BF16_TILE_N * (size_t)K);
        float *row = (float *)malloc(sizeof(float) * (size_t)K);
        if (wt == NULL || row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            if (wt == NULL || row == NULL) continue;
            int n0 = t * BF16_TILE_N, nt = N - n0 < BF16_TILE_N ? N - n0 : BF16_TILE_N;
            for (int r = 0; r < BF16_TILE_N; r++) {
                uint16_t *dst = wt + (int64_t)r * K;
                if (r >= nt) {
                    memset(dst, 0, sizeof(uint16_t) * K);
                    continue;
                }
                dequant(w + (int64_t)(n0 + r) * rb, K, row);
                narrow_bf16(row, dst, K);
            }
            for (int m0 = 0; m0 < M; m0 += 4)
                for (int n = n0; n < n0 + nt; n += 4)
                    bf16_block4(xb + (int64_t)m0 * K, wt + (int64_t)(n - n0) * K, bias,
                                y + (int64_t)m0 * N, M - m0 < 4 ? M - m0 : 4, N, K, n,
                                n0 + nt - n < 4 ? n0 + nt - n : 4);
        }
        free(wt);
        free(row);
    }
    free(xb);
    return failed ? -1 : 0;
}
#endif

/* ---------------------------------------------------------------- quantized-activation products */

/* y (M, N) = x (M, K) @ W.T + bias with x quantized per block (above) and W's rows read from
 * `packed` (tern_gguf_repack_x8 of w); float32 x, bias, y. From BF16_TILES_MIN_ROWS rows on
 * tiers with bfloat16 arithmetic the bfloat16 tiles (above); without `packed`, and from
 * Q8ACT_MAX_ROWS rows on builds without AVX2, the float32 product of w (tern_gguf_linear).
 * Returns 0, -2 for a type or K it does not take, -1 without memory for the quantized rows or a
 * tile. */
int tern_gguf_linear_q8act(const float *x, const uint8_t *w, const uint8_t *packed, int type,
                           const float *bias, float *y, int M, int N, int K) {
    int nc = K / QK;
    if (row_bytes(type, K) == 0) return -2;
#if defined(__AVX512BF16__)
    if (M >= BF16_TILES_MIN_ROWS) return gguf_linear_bf16_tiles(x, w, type, bias, y, M, N, K);
#elif !defined(__AVX2__)
    if (M >= Q8ACT_MAX_ROWS) return tern_gguf_linear(x, w, type, bias, y, M, N, K);
#endif
    if (packed == NULL) return tern_gguf_linear(x, w, type, bias, y, M, N, K);
    QuantizedRows xq = {malloc((size_t)M * K), malloc(sizeof(float) * (size_t)M * nc),
                        malloc(sizeof(int32_t) * (size_t)M * nc),
                        malloc(sizeof(int32_t) * (size_t)M * nc),
                        malloc(sizeof(float) * (size_t)M * nc)};
    int rc = -1;
    if (xq.q != NULL && xq.scale != NULL && xq.sum != NULL && xq.sum_lo != NULL &&
        xq.dxsum != NULL) {
        quantize_rows_q8(x, M, K, &xq);
        X8Rows x8 = x8_rows_of(type);
        int64_t gb = x8_group_bytes(type, nc);
#pragma omp parallel for schedule(static)
        for (int g = 0; g < (N + X8 - 1) / X8; g++) {
            int rows = N - g * X8 < X8 ? N - g * X8 : X8;
            for (int m0 = 0; m0 < M; m0 += X8_BLOCK_M) {
                int mb = M - m0 < X8_BLOCK_M ? M - m0 : X8_BLOCK_M;
                float out[X8_BLOCK_M * X8];
                x8(packed + g * gb, nc, &xq, m0, mb, out);
                for (int i = 0; i < mb; i++)
                    for (int r = 0; r < rows; r++)
                        y[(int64_t)(m0 + i) * N + g * X8 + r] =
                            out[X8 * i + r] + (bias ? bias[g * X8 + r] : 0.f);
            }
        }
        rc = 0;
    }
    free(xq.q);
    free(xq.scale);
    free(xq.sum);
    free(xq.sum_lo);
    free(xq.dxsum);
    return rc;
}

/* Bytes of tern_gguf_repack_x8's layout of N rows of K values of `type`, or -2 for a type or K
 * it does not take. */
int64_t tern_gguf_x8_bytes(int type, int N, int K) {
    if (row_bytes(type, K) == 0 || N < 0) return -2;
    return (int64_t)((N + X8 - 1) / X8) * x8_group_bytes(type, K / QK);
}

/* out (tern_gguf_x8_bytes) = rows w (N, row bytes of K) of `type` repacked in groups of 8 (above);
 * the last group's missing rows zero. Returns 0, or -2 for a type or K it does not take. */
int tern_gguf_repack_x8(const uint8_t *w, int type, int N, int K, uint8_t *out) {
    int64_t rb = row_bytes(type, K);
    int nc = K / QK;
    if (rb == 0) return -2;
    int64_t total = tern_gguf_x8_bytes(type, N, K);
    memset(out, 0, (size_t)total);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        int g = n / X8, r = n % X8;
        const uint8_t *wr = w + (int64_t)n * rb;
        uint8_t *group = out + g * x8_group_bytes(type, nc);
        FOR_EACH_CHUNK(wr, type, nc)
            x8_pack_chunk(b, type, sub, r, group + x8_header_at(type, c),
                          group + x8_record_at(type, c));
        END_CHUNKS
    }
    return 0;
}
