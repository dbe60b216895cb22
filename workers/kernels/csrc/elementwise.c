/* The per-layer glue of a step: RMSNorm with its residual add, rotary embedding, SiLU gate (float32
 * and bfloat16), and the grammar token bitmask. At one token per sequence each is a handful of
 * microsecond-scale torch ops, whose dispatch, not arithmetic, is the cost; over a 2048-token
 * bfloat16 prefill the 16-lane loops take RMSNorm from 0.67 to 0.21 ms and rotary from 0.43 to
 * 0.16 ms. Float32 versions compute in the order Hugging Face's float32 modules do (products and
 * sums rounded separately: no contraction into FMAs); bfloat16 versions compute in float32 and
 * round to bfloat16 wherever Hugging Face's bfloat16 modules round: after every torch op.
 */
#include <math.h>
#include <string.h>
#include "simd.h"

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

/* In place, over the first R features of each head (the rest is not rotated: partial rotation):
 * neox style, (a, b) halves of those R -> (a cos - b sin, b cos + a sin); interleaved (GLM), the
 * pairs (x[2i], x[2i + 1]) alike; with the cos/sin rows (R/2,) of each token's position. q (T, H, D)
 * and k (T, Hkv, D) have token strides q_stride and k_stride (floats) and contiguous heads.
 * Returns -1 (and changes nothing) when a position is outside the table's num_positions rows. */
int tern_rotary_neox(float *q, int64_t q_stride, float *k, int64_t k_stride,
                     const int64_t *positions, int64_t num_positions, const float *cos_cache,
                     const float *sin_cache, int T, int H, int Hkv, int D, int R,
                     int interleaved) {
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    int half = R / 2, step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        for (int h = 0; h < H + Hkv; h++) {
            float *x = h < H ? q + t * q_stride + (int64_t)h * D : k + t * k_stride + (int64_t)(h - H) * D;
            for (int i = 0; i < half; i++) {
                float *xa = x + i * step, *xb = xa + other;
                float a = *xa, b = *xb;
                float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                *xa = ac - bs;
                *xb = bc + as;
            }
        }
    }
    return 0;
}

/* x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up, silu(g) = g / (1 + exp(-g)) (simd.h's
 * silu8, and the same sigmoid in the scalar tail). Vectorised, so one kernel serves every row count (the fused decode layer and the module path
 * then agree bit for bit at any batch). */
void tern_silu_and_mul(const float *x, float *out, int T, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= 16384)
    for (int t = 0; t < T; t++) {
        const float *g = x + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        int i = 0;
#ifdef __AVX2__
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)),
                                                  _mm256_loadu_ps(u + i)));
#endif
        for (; i < I; i++) {
            float e = expf(-fabsf(g[i]));
            o[i] = g[i] * ((g[i] >= 0.f ? 1.f : e) / (1.f + e)) * u[i];
        }
    }
}

/* bfloat16 x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up, silu rounded to bfloat16
 * before the product as torch's F.silu(gate) * up does. Vectorised, unlike the float32 version:
 * in bfloat16 torch's two ops cost ~40 us per layer per 1000 tokens of prefill. */
void tern_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= 16384)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = x + (int64_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)t * I;
        int i = 0;
#ifdef __AVX2__
        for (; i + 8 <= I; i += 8) {
            __m256 silu = round8_bf16(silu8(load8_bf16(g + i)));
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
/* o (T, n) *= sigmoid(gate), the rows of o and gate o_stride and gate_stride apart (Qwen3.5's
 * attention output gate); in bfloat16 the sigmoid is rounded before the product, as torch's two
 * ops round. */
void tern_sigmoid_gate(float *o, int64_t o_stride, const float *gate, int64_t gate_stride, int T,
                       int n) {
    for (int t = 0; t < T; t++)
        for (int i = 0; i < n; i++)
            o[t * o_stride + i] *= 1.f / (1.f + expf(-gate[t * gate_stride + i]));
}

void tern_sigmoid_gate_bf16(uint16_t *o, int64_t o_stride, const uint16_t *gate,
                            int64_t gate_stride, int T, int n) {
    for (int t = 0; t < T; t++)
        for (int i = 0; i < n; i++) {
            float s = round_bf16(1.f / (1.f + expf(-bf16_to_f32(gate[t * gate_stride + i]))));
            uint16_t *v = o + t * o_stride + i;
            *v = f32_to_bf16(bf16_to_f32(*v) * s);
        }
}

/* x (T, 2I) = [gate | up] -> out (T, I) = gelu(gate) * up with gelu's tanh approximation (Gemma's
 * gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's formula; in
 * bfloat16 the gelu is rounded before the product, as torch's two ops round. */
static inline float gelu_tanh(float g) {
    const float beta = (float)0.7978845608028654, kappa = 0.044715f; /* sqrt(2 / pi) */
    float cube = g * g * g;
    return 0.5f * g * (1.f + tanhf(beta * (g + kappa * cube)));
}

void tern_gelu_tanh_and_mul(const float *x, float *out, int T, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= 16384)
    for (int t = 0; t < T; t++) {
        const float *g = x + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i++) o[i] = gelu_tanh(g[i]) * u[i];
    }
}

void tern_gelu_tanh_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= 16384)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = x + (int64_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i++)
            o[i] = f32_to_bf16(round_bf16(gelu_tanh(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
    }
}

#ifdef __AVX512BF16__
/* One row of tern_rms_norm_bf16 with D % 16 == 0 (the sum of squares in 16 lanes). */
static void rms_norm_row16(const uint16_t *xt, const uint16_t *rt, uint16_t *rs,
                           const uint16_t *w, uint16_t *o, int D, float eps) {
    const uint16_t *r = xt;
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        __m512 v = load16_bf16(xt + i);
        if (rt != NULL) {
            v = round16(_mm512_add_ps(v, load16_bf16(rt + i)));
            store16_bf16(rs + i, v);
        }
        total = _mm512_fmadd_ps(v, v, total);
    }
    if (rt != NULL) r = rs;
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(total) / (float)D + eps));
    for (int i = 0; i < D; i += 16)
        store16_bf16(o + i, _mm512_mul_ps(load16_bf16(w + i), round16(_mm512_mul_ps(load16_bf16(r + i), inv))));
}
#endif

/* x (T, D) [+ res (T, D), the sum also written to res_out] -> out = w * norm(r), where Hugging
 * Face rounds r, norm(r) = r / sqrt(mean(r^2) + eps) (in float32) and the product. */
void tern_rms_norm_bf16(const uint16_t *x, const uint16_t *res, uint16_t *res_out,
                        const uint16_t *w, uint16_t *out, int T, int D, float eps) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const uint16_t *xt = x + (int64_t)t * D;
#ifdef __AVX512BF16__
        if (D % 16 == 0) {
            rms_norm_row16(xt, res != NULL ? res + (int64_t)t * D : NULL,
                           res != NULL ? res_out + (int64_t)t * D : NULL, w,
                           out + (int64_t)t * D, D, eps);
            continue;
        }
#endif
        const uint16_t *r = xt;
        if (res != NULL) {
            uint16_t *rs = res_out + (int64_t)t * D;
            const uint16_t *rt = res + (int64_t)t * D;
            for (int i = 0; i < D; i++) rs[i] = f32_to_bf16(bf16_to_f32(xt[i]) + bf16_to_f32(rt[i]));
            r = rs;
        }
        float total = 0.f;
        for (int i = 0; i < D; i++) {
            float v = bf16_to_f32(r[i]);
            total += v * v;
        }
        float inv = 1.0f / sqrtf(total / (float)D + eps);
        uint16_t *o = out + (int64_t)t * D;
        for (int i = 0; i < D; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(r[i]) * inv));
    }
}

/* In place, neox style, as rotary.py's torch path in bfloat16: cos and sin rounded to bfloat16,
 * then (a, b) -> (a cos - b sin, b cos + a sin) with each product and sum rounded. */
int tern_rotary_neox_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride,
                          const int64_t *positions, int64_t num_positions, const float *cos_cache,
                          const float *sin_cache, int T, int H, int Hkv, int D, int R,
                          int interleaved) {
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    int half = R / 2, step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        float cr[half], sr[half]; /* this token's cos and sin, rounded once for all its heads */
        for (int i = 0; i < half; i++) {
            cr[i] = round_bf16(c[i]);
            sr[i] = round_bf16(s[i]);
        }
        for (int h = 0; h < H + Hkv; h++) {
            uint16_t *x = h < H ? q + t * q_stride + (int64_t)h * D
                                : k + t * k_stride + (int64_t)(h - H) * D;
            int i = 0;
#ifdef __AVX512BF16__
            for (; !interleaved && i + 16 <= half; i += 16) {
                __m512 a = load16_bf16(x + i), b = load16_bf16(x + i + half);
                __m512 c16 = _mm512_loadu_ps(cr + i), s16 = _mm512_loadu_ps(sr + i);
                __m512 neg_b = _mm512_xor_ps(b, _mm512_set1_ps(-0.0f));
                __m512 x1 = _mm512_add_ps(round16(_mm512_mul_ps(a, c16)),
                                          round16(_mm512_mul_ps(neg_b, s16)));
                __m512 x2 = _mm512_add_ps(round16(_mm512_mul_ps(b, c16)),
                                          round16(_mm512_mul_ps(a, s16)));
                store16_bf16(x + i, x1);
                store16_bf16(x + i + half, x2);
            }
#endif
            for (; i < half; i++) {
                uint16_t *xa = x + i * step, *xb = xa + other;
                float a = bf16_to_f32(*xa), b = bf16_to_f32(*xb);
                *xa = f32_to_bf16(round_bf16(a * cr[i]) + round_bf16(-b * sr[i]));
                *xb = f32_to_bf16(round_bf16(b * cr[i]) + round_bf16(a * sr[i]));
            }
        }
    }
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

/* MurmurHash3's 32-bit finaliser. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

/* The sampler's uniforms (workers/layers/sampler.py, exponential_noise): out[r][j] =
 * ((h >> 8) + 0.5) / 2^24 with h = mix32(row_keys[r] ^ mix32(id + 0x632BE5AB)), id the token ids
 * (k,) shared by every row (ids_per_row 0) or row r's (n_rows, k); keys and ids below 2^32. The
 * same bits as the torch expression, which takes ~25 int64 passes over (n_rows, k): at 32 rows of
 * a 49152-token vocabulary 34 ms against this loop's ~1. */
void tern_exponential_uniforms(const int64_t *row_keys, int n_rows, const int64_t *token_ids,
                               int64_t k, int ids_per_row, float *out) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int r = 0; r < n_rows; r++) {
        for (int64_t j0 = 0; j0 < k; j0 += 4096) {
            const uint32_t key = (uint32_t)row_keys[r];
            const int64_t *ids = token_ids + (ids_per_row ? (int64_t)r * k : 0);
            float *o = out + (int64_t)r * k;
            const int64_t j1 = j0 + 4096 < k ? j0 + 4096 : k;
            for (int64_t j = j0; j < j1; j++) {
                uint32_t h = mix32(key ^ mix32((uint32_t)ids[j] + 0x632BE5ABu));
                /* exact in float32: below 2^24, then a half, then a power of two */
                o[j] = ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
            }
        }
    }
}
