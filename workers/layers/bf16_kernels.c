/* The elementwise glue of a bfloat16 decode step (RMSNorm with its residual add, rotary,
 * SiLU-and-mul), built into the same library as cpu_kernels.c (native.py): at a few tokens per
 * step each is a dozen microsecond-scale torch ops, and their dispatch is the cost. Computed in
 * float32 and rounded to bfloat16 (nearest even) wherever Hugging Face's bfloat16 modules round:
 * after every torch op. Threads: OpenMP, as in cpu_kernels.c.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f rounded to the nearest bfloat16, as a float: what a torch op on bfloat16 tensors returns. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* x (T, D) [+ res (T, D), the sum also written to res_out] -> out = w * norm(r), where Hugging
 * Face rounds r, norm(r) = r / sqrt(mean(r^2) + eps) (in float32) and the product. */
void tern_rms_norm_bf16(const uint16_t *x, const uint16_t *res, uint16_t *res_out,
                        const uint16_t *w, uint16_t *out, int T, int D, float eps) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const uint16_t *xt = x + (int64_t)t * D;
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
void tern_rotary_neox_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride,
                           const int64_t *positions, const float *cos_cache,
                           const float *sin_cache, int T, int H, int Hkv, int D) {
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        for (int h = 0; h < H + Hkv; h++) {
            uint16_t *x = h < H ? q + t * q_stride + (int64_t)h * D
                                : k + t * k_stride + (int64_t)(h - H) * D;
            for (int i = 0; i < half; i++) {
                float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
                float ci = round_bf16(c[i]), si = round_bf16(s[i]);
                x[i] = f32_to_bf16(round_bf16(a * ci) + round_bf16(-b * si));
                x[i + half] = f32_to_bf16(round_bf16(b * ci) + round_bf16(a * si));
            }
        }
    }
}

/* x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up, silu rounded before the product. */
void tern_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I) {
#pragma omp parallel for schedule(static) if (T * I >= 65536)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = x + (int64_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i++) {
            float gi = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(gi / (1.0f + expf(-gi))) * bf16_to_f32(u[i]));
        }
    }
}
