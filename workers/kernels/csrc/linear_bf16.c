#define _GNU_SOURCE /* syscall() */
/* bfloat16 linears for few activation rows: the AVX512-BF16 few-row kernel (1-2 rows) and the AMX
 * tile kernel (3-32 rows; also the int8 weights' path there, widened to bfloat16 on the way in).
 * Builds without the instructions export the same functions, returning "unavailable".
 */
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define TERN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef __AVX512BF16__
/* Rows [n0, n0 + nt) of w against the M <= GEMV_MAX_ROWS rows of x: y[m, n] = x[m] . w[n]. Each
 * weight row is read once, front to back, for all M rows of x, the rows one after another: the
 * tile is one contiguous stream, which the hardware prefetcher follows (four rows read side by
 * side with software prefetches reached ~2/3 of the streaming bandwidth). Up to 2 rows this beats
 * oneDNN's packed bf16; from 3 rows the vdpbf16ps work, not the weights' bytes, is the limit. */
#define GEMV_MAX_ROWS 2
#define GEMV_TILE 8
static void gemv_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                           int M, int N, int K, int n0, int nt) {
    const uint16_t *xa = x, *xb = M == 2 ? x + K : x;
    for (int r = n0; r < n0 + nt; r++) {
        const uint16_t *wr = w + (int64_t)r * K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        int k = 0;
        for (; k + 64 <= K; k += 64) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xa + k), w0);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xa + k + 32), w1);
            if (M == 2) {
                b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(xb + k), w0);
                b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(xb + k + 32), w1);
            }
        }
        for (; k < K; k += 32) {
            __mmask32 mask = K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1u;
            __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mask, xa + k), w0);
            if (M == 2)
                b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + k), w0);
        }
        float add = bias != NULL ? bf16_to_f32(bias[r]) : 0.f;
        y[r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + add);
        if (M == 2) y[(int64_t)N + r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(b0, b1)) + add);
    }
}
#endif

int tern_bf16_gemv_available(void) {
#ifdef __AVX512BF16__
    return GEMV_MAX_ROWS;
#else
    return 0;
#endif
}

/* y (M, N) = x (M, K) @ w (N, K).T + bias (N,) or NULL, all bfloat16, float32 accumulation,
 * M <= tern_bf16_gemv_available(). Returns 0, or -1 when this build has no AVX512-BF16 or M is
 * out of range. */
int tern_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M,
                   int N, int K) {
#ifdef __AVX512BF16__
    if (M < 1 || M > GEMV_MAX_ROWS) return -1;
    int num_tiles = (N + GEMV_TILE - 1) / GEMV_TILE;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        int n0 = t * GEMV_TILE;
        gemv_rows_bf16(x, w, bias, y, M, N, K, n0, N - n0 < GEMV_TILE ? N - n0 : GEMV_TILE);
    }
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -1;
#endif
}

#ifdef TERN_AMX
/* y (M, N) = x (M, K) @ w (N, K).T for 3 <= M <= 32 on AMX, the weight in its plain row-major
 * layout: w's rows are the A tiles (16 rows x 32 values, read straight from the matrix) and x,
 * rearranged once into bf16 pairs, the B tiles (16 of x's rows each); a C tile holds 16 outputs
 * for 16 of x's rows. Each block of 32 weight rows is 32 * K contiguous values, read once for all
 * M rows of x: the model's linears per decode step take 9.0 / 9.1 / 11.8 ms at 8 / 16 / 32 rows
 * (oneDNN's packed weights: 12.4 / 12.4 / 16.1 ms; tern's one-row kernel 8.7 ms). */
#define AMX_MAX_ROWS 32

/* GCC's tile load/store intrinsics are asm with no memory operands: without this the compiler
 * may drop stores to a buffer only a tile load reads, or read a tile store's target too early. */
#define MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_permitted(void) { /* Linux hands out AMX state on request, once per process */
    static int state = 0;
    if (state == 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : -1;
    return state == 1;
}

static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { /* 0-3: C (weight block, x half); 4, 5: A; 6, 7: B */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 rows x 32 values of an int8 weight (row stride K) as bfloat16 (exact: |w| <= 128). */
static void int8_rows_to_bf16(const int8_t *w, int K, uint16_t *out) {
    for (int r = 0; r < 16; r++) {
        __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + (int64_t)r * K)));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
        _mm512_storeu_si512(out + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Load A tile `tile` (a constant: tile numbers are immediates) with 16 weight rows at column k:
 * straight from the bfloat16 matrix w, or from the int8 one w8 widened into buf. */
#define LOAD_WEIGHT_TILE(tile, w, w8, K, k, buf)  \
    do {                                          \
        if ((w8) == NULL) {                       \
            _tile_loadd(tile, (w) + (k), (K) * 2); \
        } else {                                  \
            int8_rows_to_bf16((w8) + (k), K, buf); \
            MEMORY_BARRIER();                     \
            _tile_loadd(tile, buf, 64);           \
        }                                         \
    } while (0)

/* Outputs [n0, n0 + 16 * nt) (nt = 1 or 2 blocks of 16 weight rows) for all M rows, from the
 * bfloat16 weight w or (w8 != NULL) the int8 weight w8 with its per-row scales. x_pairs holds one
 * (K / 2, 16, 2) array per 16 rows of x. */
static void amx_block(const uint16_t *x_pairs, const uint16_t *w, const int8_t *w8,
                      const float *scale, const uint16_t *bias, uint16_t *y, int M, int N, int K,
                      int n0, int nt) {
    float c[4][16][16]; /* [2 * block + half][weight row][x row] */
    uint16_t buf[2][16 * 32];
    const uint16_t *w0 = w8 == NULL ? w + (int64_t)n0 * K : NULL;
    const uint16_t *w1 = w8 == NULL ? w0 + (int64_t)16 * K : NULL;
    const int8_t *v0 = w8 != NULL ? w8 + (int64_t)n0 * K : NULL;
    const int8_t *v1 = w8 != NULL ? v0 + (int64_t)16 * K : NULL;
    const uint16_t *x1 = x_pairs + (int64_t)K * 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        _tile_loadd(6, x_pairs + (int64_t)k * 16, 64);
        if (M > 16) _tile_loadd(7, x1 + (int64_t)k * 16, 64);
        LOAD_WEIGHT_TILE(4, w0, v0, K, k, buf[0]);
        _tile_dpbf16ps(0, 4, 6);
        if (M > 16) _tile_dpbf16ps(1, 4, 7);
        if (nt == 2) {
            LOAD_WEIGHT_TILE(5, w1, v1, K, k, buf[1]);
            _tile_dpbf16ps(2, 5, 6);
            if (M > 16) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    MEMORY_BARRIER();
    /* y[m][n0 + 16 b + r] = c[2 b + m / 16][r][m % 16]: a column of a C tile per 16 outputs */
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                               5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int b = 0; b < nt; b++) {
        int n = n0 + 16 * b;
        __m512 add = bias != NULL ? load16_bf16(bias + n) : _mm512_setzero_ps();
        __m512 mul = scale != NULL ? _mm512_loadu_ps(scale + n) : _mm512_set1_ps(1.f);
        for (int m = 0; m < M; m++) {
            __m512 v = _mm512_i32gather_ps(column, &c[2 * b + m / 16][0][m % 16], 4);
            store16_bf16(y + (int64_t)m * N + n, _mm512_fmadd_ps(v, mul, add));
        }
    }
}

int tern_bf16_amx_max_rows(void) { return amx_permitted() ? AMX_MAX_ROWS : 0; }

/* y (M, N) = x (M, K) @ w (N, K).T + bias (N,) or NULL, bfloat16, float32 accumulation, for
 * M <= tern_bf16_amx_max_rows(), K % 32 == 0, N % 16 == 0. Returns 0, -1 when these do not hold. */
static int amx_linear(const uint16_t *x, const uint16_t *w, const int8_t *w8, const float *scale,
                      const uint16_t *bias, uint16_t *y, int M, int N, int K) {
    if (!amx_permitted() || M < 1 || M > AMX_MAX_ROWS || K % 32 || N % 16) return -1;
    /* x as B tiles: for rows m of x, pair p of half m / 16 holds (x[m][2p], x[m][2p + 1]) at
     * column m % 16 (zeros for rows past M) */
    uint16_t *x_pairs = (uint16_t *)calloc((size_t)K * 32, sizeof(uint16_t));
    if (x_pairs == NULL) return -1;
    for (int m = 0; m < M; m++) { /* a transpose of 32-bit pairs: (M, K / 2) -> (K / 2, 16) */
        uint32_t *half = (uint32_t *)(x_pairs + (int64_t)(m / 16) * K * 16) + m % 16;
        const uint32_t *row = (const uint32_t *)(x + (int64_t)m * K);
        for (int p = 0; p < K / 2; p++) half[(int64_t)p * 16] = row[p];
    }
    int num_pairs = N / 32, odd = (N / 16) % 2;
#pragma omp parallel
    {
        amx_configure();
#pragma omp for schedule(static)
        for (int b = 0; b < num_pairs + odd; b++)
            amx_block(x_pairs, w, w8, scale, bias, y, M, N, K, 32 * b, b < num_pairs ? 2 : 1);
        _tile_release();
    }
    free(x_pairs);
    return 0;
}

int tern_bf16_amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                         int M, int N, int K) {
    return amx_linear(x, w, NULL, NULL, bias, y, M, N, K);
}

/* y (M, N) = x (M, K) @ (w (N, K) int8 * scale (N,)).T + bias, bfloat16 x, bias and y, on the
 * same terms as tern_bf16_amx_linear: each 16 x 32 weight tile is widened to bfloat16 (exactly)
 * on the way into AMX, the scales applied to the sums. The int8 linear's path for 3-32 rows. */
int tern_int8_amx_linear_bf16(const uint16_t *x, const int8_t *w, const float *scale,
                              const uint16_t *bias, uint16_t *y, int M, int N, int K) {
    return amx_linear(x, NULL, w, scale, bias, y, M, N, K);
}
#else
int tern_int8_amx_linear_bf16(const uint16_t *x, const int8_t *w, const float *scale,
                              const uint16_t *bias, uint16_t *y, int M, int N, int K) {
    (void)x, (void)w, (void)scale, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -1;
}
int tern_bf16_amx_max_rows(void) { return 0; }
int tern_bf16_amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                         int M, int N, int K) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -1;
}
#endif
