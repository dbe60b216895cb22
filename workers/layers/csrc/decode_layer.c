/* One Llama-style decoder layer for a decode step of a few sequences (bfloat16 activations,
 * bfloat16 or int8 weights), in one call: at this size the layer's ten kernels take ~270 us and
 * the Python around them (module calls, wrappers, output tensors) another ~110 us per layer.
 * Each stage calls the same kernel the layer's modules call one by one (rms norm, few-row linear,
 * rotary, paged decode attention, SiLU-and-mul), in the same order, so the result is bit for bit
 * the unfused path's. fused_decode.py decides when a layer qualifies and fills the structs.
 */
#include <string.h>
#include "tern_kernels.h"

/* The kernel dense_linear (linear.py) picks for these rows: the few-row one, then AMX. */
static int linear(const TernLinear *l, const uint16_t *x, uint16_t *y, int m) {
    if (l->scale == NULL && m <= tern_bf16_gemv_available())
        return tern_bf16_gemv(x, (const uint16_t *)l->weight, l->bias, y, m, l->n, l->k);
    if (l->scale == NULL)
        return tern_bf16_amx_linear(x, (const uint16_t *)l->weight, l->bias, y, m, l->n, l->k);
    return tern_int8_linear_bf16(x, (const int8_t *)l->weight, l->scale, l->bias, y, m, l->n,
                                 l->k);
}

/* The row-parallel projections' sum over the TP ranks, as ParallelContext.all_reduce. */
static int all_reduce(const TernDecodeLayer *L, uint16_t *x, int T, int64_t seq) {
    if (L->tp_size == 1) return 0;
    int rc = tern_shm_all_reduce(L->shm, L->tp_rank, L->tp_size, seq, L->shm_slot_bytes, x,
                                 (int64_t)T * L->hidden, 1, L->shm_timeout_s);
    return rc == 0 ? 0 : rc == -1 ? -3 : -1;
}

/* x (T, hidden) and residual (T, hidden), or NULL at the first layer (the residual is then x) ->
 * out (T, hidden), the MLP's output, and res_out (T, hidden), the residual after attention.
 * With tp_size > 1 the layer's two all-reduces take sequence numbers seq and seq + 1.
 * Returns 0; -1 when a kernel refuses the shapes, -2 for a position past the rotary tables or a
 * KV slot outside the cache (nothing is written to the cache in that case), -3 when a peer rank
 * did not reach an all-reduce in time. */
int tern_decode_layer_bf16(const TernDecodeLayer *L, const TernDecodeStep *S, const uint16_t *x,
                           const uint16_t *residual, uint16_t *out, uint16_t *res_out,
                           int64_t seq) {
    int T = S->num_tokens, H = L->num_heads, Hkv = L->num_kv_heads, D = L->head_dim;
    int64_t row = (int64_t)(H + 2 * Hkv) * D; /* one token's q, k and v in S->qkv */
    if (residual == NULL) {
        tern_rms_norm_bf16(x, NULL, NULL, L->input_norm, S->normed, T, L->hidden, L->eps);
        memcpy(res_out, x, sizeof(uint16_t) * (size_t)T * L->hidden);
    } else {
        tern_rms_norm_bf16(x, residual, res_out, L->input_norm, S->normed, T, L->hidden, L->eps);
    }
    if (linear(&L->qkv, S->normed, S->qkv, T) != 0) return -1;
    uint16_t *k = S->qkv + (int64_t)H * D, *v = k + (int64_t)Hkv * D;
    if (tern_rotary_neox_bf16(S->qkv, row, k, row, S->positions, L->num_positions, L->cos_cache,
                              L->sin_cache, T, H, Hkv, D) != 0)
        return -2;
    for (int t = 0; t < T; t++) /* the attention kernel takes the queries contiguous */
        memcpy(S->q + (int64_t)t * H * D, S->qkv + t * row, sizeof(uint16_t) * (size_t)H * D);
    int rc = tern_paged_decode_attention(
        S->q, L->k_cache, L->v_cache, S->block_tables, S->table_stride, S->context_lens, S->attn,
        T, H, Hkv, D, L->block_size, L->attn_scale, 1, 1, k, row, v, row, S->slots, L->num_slots);
    if (rc != 0) return rc == -2 ? -2 : -1;
    if (linear(&L->o, S->attn, S->attn_out, T) != 0) return -1;
    if ((rc = all_reduce(L, S->attn_out, T, seq)) != 0) return rc;
    tern_rms_norm_bf16(S->attn_out, res_out, res_out, L->post_norm, S->normed, T, L->hidden,
                       L->eps);
    if (linear(&L->gate_up, S->normed, S->gate_up, T) != 0) return -1;
    tern_silu_and_mul_bf16(S->gate_up, S->act, T, L->intermediate);
    if (linear(&L->down, S->act, out, T) != 0) return -1;
    return all_reduce(L, out, T, seq + 1);
}
