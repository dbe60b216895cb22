/* One decode step of a Gated DeltaNet layer (Qwen3.5's linear attention) for G sequences, from its
 * input projection's output to the gated norm before its output projection: the causal
 * convolution's step over each sequence's conv state, SiLU, q / k L2 norms, the gated delta rule's
 * recurrence over each sequence's float32 state, and the per-head RMSNorm times SiLU(z). In torch
 * these are ~40 microsecond-scale ops per layer; here two passes over the batch. bfloat16
 * activations are rounded wherever the torch path (gated_delta_net.py) rounds them.
 */
#include <math.h>
#include <omp.h>
#include <string.h>
#include "simd.h"

static inline float load_act(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_act(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

static inline float rnd(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

static inline float silu(float x) { return x / (1.f + expf(-x)); }

/* mixed (G, C) rows mixed_stride apart, C = 2 Hk dk + Hv dv channels [q | k | v]; z (G, Hv dv)
 * rows z_stride apart; b and a (G, Hv), in_proj_b's and in_proj_a's outputs, rows b_stride and
 * a_stride apart, give beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias)
 * (A_log, dt_bias (Hv,)); all non-float32 tensors in the activations' dtype (is_bf16). conv_weight (C, K); conv_states
 * (num_slots, C, K - 1) and recurrent (num_slots, Hv, dk, dv) float32 are read and updated at
 * slots[b]; fresh[b] != 0 starts sequence b's states from zeros. conv_scratch: G * C floats.
 * out (G, Hv dv). Returns 0, or -2 (having changed nothing) when a slot is outside the pools. */
int tern_gated_delta_decode(const void *mixed, int64_t mixed_stride, const void *z,
                            int64_t z_stride, const void *b_proj, int64_t b_stride,
                            const void *a_proj, int64_t a_stride, const void *A_log,
                            const void *dt_bias, const void *conv_weight, void *conv_states,
                            float *recurrent, const int64_t *slots, const uint8_t *fresh,
                            int64_t num_slots, const void *norm_weight, float eps,
                            float *conv_scratch, void *out, int G, int Hk, int Hv, int dk, int dv,
                            int K, int is_bf16) {
    int C = 2 * Hk * dk + Hv * dv, S = K - 1;
    for (int b = 0; b < G; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return -2;
    /* Pass 1: every channel's convolution step (its state shifted by one). */
    int chunk = 256, chunks = (C + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (int item = 0; item < G * chunks; item++) {
        int b = item / chunks, c0 = item % chunks * chunk;
        int c1 = c0 + chunk < C ? c0 + chunk : C;
        int64_t state0 = slots[b] * (int64_t)C * S;
        for (int c = c0; c < c1; c++) {
            float window[K];
            for (int t = 0; t < S; t++)
                window[t] = fresh[b] ? 0.f : load_act(conv_states, state0 + (int64_t)c * S + t, is_bf16);
            window[S] = load_act(mixed, b * mixed_stride + c, is_bf16);
            float acc = 0.f;
            for (int t = 0; t < K; t++)
                acc += window[t] * load_act(conv_weight, (int64_t)c * K + t, is_bf16);
            for (int t = 0; t < S; t++)
                store_act(conv_states, state0 + (int64_t)c * S + t, window[t + 1], is_bf16);
            conv_scratch[(int64_t)b * C + c] = rnd(silu(rnd(acc, is_bf16)), is_bf16);
        }
    }
    /* Pass 2: each (sequence, value head)'s recurrence and gated norm. */
    int group = Hv / Hk;
    float q_div = sqrtf((float)dk);
#pragma omp parallel for schedule(static)
    for (int item = 0; item < G * Hv; item++) {
        int b = item / Hv, h = item % Hv, kh = h / group;
        const float *x = conv_scratch + (int64_t)b * C;
        float q[dk], k[dk], delta[dv], o[dv];
        float qs = 0.f, ks = 0.f;
        for (int i = 0; i < dk; i++) {
            q[i] = x[kh * dk + i];
            k[i] = x[Hk * dk + kh * dk + i];
            qs += q[i] * q[i];
            ks += k[i] * k[i];
        }
        float q_inv = 1.f / sqrtf(qs + 1e-6f), k_inv = 1.f / sqrtf(ks + 1e-6f);
        for (int i = 0; i < dk; i++) {
            q[i] = q[i] * q_inv / q_div;
            k[i] = k[i] * k_inv;
        }
        const float *v = x + 2 * Hk * dk + h * dv;
        float *state = recurrent + ((slots[b] * Hv) + h) * (int64_t)dk * dv;
        if (fresh[b]) memset(state, 0, sizeof(float) * dk * dv);
        /* as the torch path: sigmoid in the activations' dtype, the decay in float32 */
        float beta_h = rnd(1.f / (1.f + expf(-load_act(b_proj, b * b_stride + h, is_bf16))), is_bf16);
        float a = load_act(a_proj, b * a_stride + h, is_bf16) + load_act(dt_bias, h, is_bf16);
        float softplus = a > 20.f ? a : log1pf(expf(a));
        float decay = expf(-expf(load_act(A_log, h, is_bf16)) * softplus);
        for (int j = 0; j < dv; j++) delta[j] = 0.f;
        for (int i = 0; i < dk; i++) {
            float *row = state + (int64_t)i * dv;
            for (int j = 0; j < dv; j++) {
                row[j] *= decay;
                delta[j] += k[i] * row[j]; /* the memory read at k */
            }
        }
        for (int j = 0; j < dv; j++) delta[j] = (v[j] - delta[j]) * beta_h;
        for (int j = 0; j < dv; j++) o[j] = 0.f;
        for (int i = 0; i < dk; i++) {
            float *row = state + (int64_t)i * dv;
            for (int j = 0; j < dv; j++) {
                row[j] += k[i] * delta[j];
                o[j] += q[i] * row[j];
            }
        }
        float ms = 0.f;
        for (int j = 0; j < dv; j++) {
            o[j] = rnd(o[j], is_bf16);
            ms += o[j] * o[j];
        }
        float inv = 1.f / sqrtf(ms / dv + eps);
        for (int j = 0; j < dv; j++) {
            float n = rnd(rnd(o[j] * inv, is_bf16) * load_act(norm_weight, j, is_bf16), is_bf16);
            float gate = load_act(z, b * z_stride + h * dv + j, is_bf16);
            store_act(out, (int64_t)b * Hv * dv + h * dv + j, n * silu(gate), is_bf16);
        }
    }
    return 0;
}
