/* One decoder layer for a decode step of a few sequences, in one call: at this size
 * the layer's ten kernels take ~270 us and the Python around them (module calls, wrappers, output
 * tensors) another ~110 us per layer. Two entry points, one body:
 * - bfloat16 activations and KV cache, bfloat16 or int8 weights (CPUs with AVX512-BF16);
 * - float32 activations and KV cache, float32, bfloat16-stored, int8 or GGUF-block weights (every
 *   CPU: what AVX2-only machines run).
 * Each stage calls the same kernel the layer's modules call one by one (rms norm, few-row linear
 * and its LoRA adapters, rotary, paged decode attention, SiLU-and-mul), in the same order, so the
 * result is bit for bit the unfused path's. fused_decode.py decides when a layer qualifies and
 * fills the structs.
 */
#include <stdlib.h>
#include <string.h>
#include "tern_kernels.h"

/* The kernel dense_linear / int8_matmul (linear.py, quantization.py) pick for these rows. */
static int linear_one(const TernLinear *l, const void *x, void *y, int m, int bf16) {
    if (l->scale != NULL)
        return bf16 ? tern_int8_linear_bf16(x, l->weight, l->scale, l->bias, y, m, l->n, l->k)
                    : tern_int8_linear(x, l->weight, l->scale, l->bias, y, m, l->n, l->k);
    if (!bf16 && l->weight_format >= TERN_WEIGHT_GGUF_Q8ACT)
        return tern_gguf_linear_q8act(x, l->weight, l->packed,
                                      l->weight_format - TERN_WEIGHT_GGUF_Q8ACT, l->bias, y, m,
                                      l->n, l->k);
    if (!bf16 && l->weight_format >= TERN_WEIGHT_GGUF)
        return tern_gguf_linear(x, l->weight, l->weight_format - TERN_WEIGHT_GGUF, l->bias, y, m,
                                l->n, l->k);
    if (!bf16)
        return l->weight_format == TERN_WEIGHT_BF16
                   ? tern_bf16w_linear(x, l->weight, l->bias, y, m, l->n, l->k)
                   : tern_f32_linear(x, l->weight, l->bias, y, m, l->n, l->k);
    if (m <= tern_bf16_gemv_available())
        return tern_bf16_gemv(x, l->weight, l->bias, y, m, l->n, l->k);
    return tern_bf16_amx_linear(x, l->weight, l->bias, y, m, l->n, l->k);
}

/* As linear_one, and a linear in row segments (TernLinear.rest) as gguf_blocks.segmented_linear:
 * each segment's products into its columns of y (through a scratch block from two rows). */
static int linear_base(const TernLinear *l, const void *x, void *y, int m, int bf16) {
    if (l->rest == NULL) return linear_one(l, x, y, m, bf16);
    if (bf16) return -2;
    float *out = y, *tmp = NULL;
    if (m > 1 && (tmp = malloc(sizeof(float) * (size_t)m * l->n)) == NULL) return -1;
    int col = 0, rc = 0;
    for (const TernLinear *s = l->rest; s != NULL && rc == 0; s = s->rest) {
        rc = linear_one(s, x, m > 1 ? tmp : out + col, m, 0);
        for (int r = 0; m > 1 && rc == 0 && r < m; r++)
            memcpy(out + (int64_t)r * l->n + col, tmp + (int64_t)r * s->n, sizeof(float) * s->n);
        col += s->n;
    }
    free(tmp);
    return rc;
}

/* y (m, n) = x (m, k) @ W.T + bias, then each token's LoRA adapter's product added (lora_slots:
 * the step's, NULL when it has none) as LinearBase._linear does: the same kernel after the same
 * base product. */
static int linear(const TernLinear *l, const void *x, void *y, int m, int bf16,
                  const int32_t *lora_slots) {
    int rc = linear_base(l, x, y, m, bf16);
    if (rc != 0 || l->lora_a == NULL || lora_slots == NULL) return rc;
    return tern_lora_add(x, l->k, y, l->n, lora_slots, m, l->k, l->n, l->lora_a, l->lora_b,
                         l->lora_num_slots, l->lora_rank, l->lora_nseg, l->lora_seg_rows, bf16);
}

static void rms_norm(const void *x, const void *res, void *res_out, const void *w, void *out,
                     int T, int D, float eps, int bf16) {
    if (bf16)
        tern_rms_norm_bf16(x, res, res_out, w, out, T, D, eps);
    else
        tern_rms_norm(x, res, res_out, w, out, T, D, eps);
}

/* The row-parallel projections' sum over the TP ranks, as ParallelContext.all_reduce. */
static int all_reduce(const TernDecodeLayer *L, void *x, int T, int64_t seq, int bf16) {
    if (L->tp_size == 1) return 0;
    int rc = tern_shm_all_reduce(L->shm, L->tp_rank, L->tp_size, seq, L->shm_slot_bytes, x,
                                 (int64_t)T * L->hidden, bf16, L->shm_timeout_s);
    return rc == 0 ? 0 : rc == -1 ? -3 : -1;
}

/* x *= s in place, n values, rounded as a torch product of a bfloat16 tensor and a scalar. */
static void scale_rows(void *x, float s, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *v = x;
        for (int64_t i = 0; i < n; i++) v[i] = f32_to_bf16(bf16_to_f32(v[i]) * s);
    } else {
        float *v = x;
        for (int64_t i = 0; i < n; i++) v[i] *= s;
    }
}

/* out = a + b (b NULL: a copy), n values, rounded as a torch add of bfloat16 tensors. */
static void add_rows(const void *a, const void *b, void *out, int64_t n, int bf16) {
    if (b == NULL) {
        memmove(out, a, (size_t)n * (bf16 ? 2 : 4));
    } else if (bf16) {
        const uint16_t *x = a, *y = b;
        uint16_t *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    } else {
        const float *x = a, *y = b;
        float *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
    }
}

/* x (T, hidden) and residual (T, hidden), or NULL at the first layer (the residual is then x) ->
 * out (T, hidden), the MLP's output, and res_out (T, hidden), the residual after attention.
 * A layer without an MLP here (intermediate 0: a mixture of experts, run by the caller) stops
 * before it: out is then the MLP's input, and only sequence number seq is used.
 * With tp_size > 1 the layer's two all-reduces take sequence numbers seq and seq + 1.
 * Returns 0; -1 when a kernel refuses the shapes, -2 for a position past the rotary tables or a
 * KV slot outside the cache (nothing is written to the cache in that case), -3 when a peer rank
 * did not reach an all-reduce in time. */
static int decode_layer(const TernDecodeLayer *L, const TernDecodeStep *S, const void *x,
                        const void *residual, void *out, void *res_out, int64_t seq, int bf16) {
    int T = S->num_tokens, H = L->num_heads, Hkv = L->num_kv_heads, D = L->head_dim;
    size_t elem = bf16 ? 2 : 4;
    int qh = L->output_gate ? 2 : 1; /* each query head's rows: its query (then its gate) */
    int64_t row = (int64_t)(qh * H + 2 * Hkv) * D; /* one token's q (gates), k and v in S->qkv */
    int64_t n = (int64_t)T * L->hidden;
    const void *attn_in = S->normed;
    if (L->input_norm == NULL) { /* attention reads the residual stream itself (OLMo 2) */
        add_rows(x, residual, res_out, n, bf16);
        attn_in = res_out;
    } else if (residual == NULL) {
        rms_norm(x, NULL, NULL, L->input_norm, S->normed, T, L->hidden, L->eps, bf16);
        memcpy(res_out, x, elem * (size_t)n);
    } else {
        rms_norm(x, residual, res_out, L->input_norm, S->normed, T, L->hidden, L->eps, bf16);
    }
    if (linear(&L->qkv, attn_in, S->qkv, T, bf16, S->lora_slots) != 0) return -1;
    char *qkv = (char *)S->qkv, *k = qkv + elem * qh * H * D, *v = k + elem * Hkv * D;
    char *q = (char *)S->q; /* the queries gathered contiguous (T, H, D), as attention takes them */
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++)
            memcpy(q + elem * ((int64_t)t * H + h) * D, qkv + elem * (t * row + (int64_t)h * qh * D),
                   elem * (size_t)D);
    if (L->q_norm != NULL) /* in place: per head (rows of D) or per projection */
        for (int t = 0; t < T; t++) {
            char *qt = q + elem * t * H * D, *kt = k + elem * t * row;
            int rows_q = L->qk_norm_full ? 1 : H, rows_k = L->qk_norm_full ? 1 : Hkv;
            rms_norm(qt, NULL, NULL, L->q_norm, qt, rows_q, H * D / rows_q, L->eps, bf16);
            rms_norm(kt, NULL, NULL, L->k_norm, kt, rows_k, Hkv * D / rows_k, L->eps, bf16);
        }
    int rc = 0;
    if (L->rotary_dim > 0)
        rc = bf16 ? tern_rotary_neox_bf16((uint16_t *)q, (int64_t)H * D, (uint16_t *)k, row,
                                          S->positions, L->num_positions, L->cos_cache,
                                          L->sin_cache, T, H, Hkv, D, L->rotary_dim,
                                          L->rotary_interleaved)
                  : tern_rotary_neox((float *)q, (int64_t)H * D, (float *)k, row, S->positions,
                                     L->num_positions, L->cos_cache, L->sin_cache, T, H, Hkv, D,
                                     L->rotary_dim, L->rotary_interleaved);
    if (rc != 0) return -2;
    rc = tern_paged_decode_attention(S->q, L->k_cache, L->v_cache, S->block_tables,
                                     S->table_stride, S->context_lens, S->attn, T, H, Hkv, D,
                                     L->block_size, L->attn_scale, L->kv_format, bf16, k, row, v, row,
                                     S->slots, L->num_slots, L->window, L->attn_softcap,
                                     L->sinks);
    if (rc != 0) return rc == -2 ? -2 : -1;
    if (L->output_gate) /* each head's output times the sigmoid of its gate */
        for (int h = 0; h < H; h++)
            bf16 ? tern_sigmoid_gate_bf16((uint16_t *)S->attn + h * D, (int64_t)H * D,
                                          (const uint16_t *)qkv + (int64_t)h * 2 * D + D, row, T,
                                          D)
                 : tern_sigmoid_gate((float *)S->attn + h * D, (int64_t)H * D,
                                     (const float *)qkv + (int64_t)h * 2 * D + D, row, T, D);
    if (linear(&L->o, S->attn, S->attn_out, T, bf16, S->lora_slots) != 0) return -1;
    if ((rc = all_reduce(L, S->attn_out, T, seq, bf16)) != 0) return rc;
    if (L->attn_out_norm != NULL)
        rms_norm(S->attn_out, NULL, NULL, L->attn_out_norm, S->attn_out, T, L->hidden, L->eps,
                 bf16);
    if (L->residual_scale != 1.f) scale_rows(S->attn_out, L->residual_scale, n, bf16);
    const void *mlp_in = S->normed;
    if (L->post_norm != NULL) {
        rms_norm(S->attn_out, res_out, res_out, L->post_norm, S->normed, T, L->hidden, L->eps,
                 bf16);
    } else { /* the MLP reads the residual stream itself */
        add_rows(S->attn_out, res_out, res_out, n, bf16);
        mlp_in = res_out;
    }
    if (L->intermediate == 0) {
        memcpy(out, mlp_in, elem * (size_t)n);
        return 0;
    }
    if (linear(&L->gate_up, mlp_in, S->gate_up, T, bf16, S->lora_slots) != 0) return -1;
    if (L->gelu)
        bf16 ? tern_gelu_tanh_and_mul_bf16(S->gate_up, S->act, T, L->intermediate)
             : tern_gelu_tanh_and_mul(S->gate_up, S->act, T, L->intermediate);
    else
        bf16 ? tern_silu_and_mul_bf16(S->gate_up, S->act, T, L->intermediate)
             : tern_silu_and_mul(S->gate_up, S->act, T, L->intermediate);
    if (linear(&L->down, S->act, out, T, bf16, S->lora_slots) != 0) return -1;
    if ((rc = all_reduce(L, out, T, seq + 1, bf16)) != 0) return rc;
    if (L->mlp_out_norm != NULL)
        rms_norm(out, NULL, NULL, L->mlp_out_norm, out, T, L->hidden, L->eps, bf16);
    if (L->residual_scale != 1.f) scale_rows(out, L->residual_scale, n, bf16);
    return 0;
}

int tern_decode_layer_bf16(const TernDecodeLayer *L, const TernDecodeStep *S, const uint16_t *x,
                           const uint16_t *residual, uint16_t *out, uint16_t *res_out,
                           int64_t seq) {
    return decode_layer(L, S, x, residual, out, res_out, seq, 1);
}

int tern_decode_layer_f32(const TernDecodeLayer *L, const TernDecodeStep *S, const float *x,
                          const float *residual, float *out, float *res_out, int64_t seq) {
    return decode_layer(L, S, x, residual, out, res_out, seq, 0);
}

/* A stack of num_layers such layers (every one with its MLP), each reading the one before's
 * output: layer i takes all-reduce sequence numbers seq + 2 i and seq + 2 i + 1. The layers
 * between write to tmp_out / tmp_res and out / res_out in turn, the last to out / res_out. One
 * call for a pipeline stage's layers instead of one each (the Python around a layer's call is
 * ~10 us, a tenth of a small model's layer at one sequence). Returns as decode_layer, at the
 * first layer that fails. */
static int decode_layers(const TernDecodeLayer *const *layers, int num_layers,
                         const TernDecodeStep *S, const void *x, const void *residual, void *out,
                         void *res_out, void *tmp_out, void *tmp_res, int64_t seq, int bf16) {
    for (int i = 0; i < num_layers; i++) {
        if (layers[i]->intermediate == 0) return -1;
        int last_parity = (num_layers - 1 - i) % 2 == 0;
        void *o = last_parity ? out : tmp_out, *r = last_parity ? res_out : tmp_res;
        int rc = decode_layer(layers[i], S, x, residual, o, r, seq + 2 * (int64_t)i, bf16);
        if (rc != 0) return rc;
        x = o;
        residual = r;
    }
    return 0;
}

int tern_decode_layers_bf16(const TernDecodeLayer *const *layers, int num_layers,
                            const TernDecodeStep *S, const uint16_t *x, const uint16_t *residual,
                            uint16_t *out, uint16_t *res_out, uint16_t *tmp_out,
                            uint16_t *tmp_res, int64_t seq) {
    return decode_layers(layers, num_layers, S, x, residual, out, res_out, tmp_out, tmp_res, seq,
                         1);
}

int tern_decode_layers_f32(const TernDecodeLayer *const *layers, int num_layers,
                           const TernDecodeStep *S, const float *x, const float *residual,
                           float *out, float *res_out, float *tmp_out, float *tmp_res,
                           int64_t seq) {
    return decode_layers(layers, num_layers, S, x, residual, out, res_out, tmp_out, tmp_res, seq,
                         0);
}
