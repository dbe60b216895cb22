/* tern's CPU kernels: the one contract between the C sources and the bindings (workers/kernels/).
 *
 * Every exported function is declared between TERN_EXPORTS_BEGIN and TERN_EXPORTS_END, one
 * declaration per statement; kernel_library.py reads that block to declare the functions' ctypes
 * signatures (void, int, int64_t, float, double and pointers only), so a prototype changed here
 * is a signature changed there. The structs the fused decode layer takes are mirrored by ctypes
 * Structures whose sizes kernel_library.py checks against tern_struct_sizes() at load.
 *
 * The sources are compiled once per instruction-set tier (kernel_library.py: baseline, avx2, avx512,
 * avx512_bf16, amx); each file keeps its tiers side by side behind the helpers of simd.h, and a
 * build without an instruction still exports every function (returning "unavailable" where the
 * kernel needs it). Threads: OpenMP, the runtime torch already loaded, so torch.set_num_threads
 * governs these loops too.
 */
#ifndef TERN_KERNELS_H
#define TERN_KERNELS_H
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------- shared structs */

/* A linear layer's weight (n, k): int8 with float32 scales (scale != NULL); else by weight_format:
 * 0 in the activations' dtype, TERN_WEIGHT_BF16 bfloat16-stored under float32 activations,
 * TERN_WEIGHT_GGUF + a block type (TERN_GGUF_*, TERN_BLOCK_*) blocks under float32 activations, multiplied
 * exactly, or TERN_WEIGHT_GGUF_Q8ACT + the type with the activations quantized. The bias
 * (n,), or NULL, is in the activations' dtype. */
typedef struct TernLinear {
    const void *weight;
    const float *scale;
    const void *bias;
    int n, k;
    int weight_format;
    /* Rows in segments of different block types (a fused projection's, float32 activations):
     * weight NULL, n the segments' rows together, rest the first segment, each segment's rest
     * the next (NULL after the last). NULL for a linear of one format. */
    const struct TernLinear *rest;
    /* The LoRA adapters it serves (workers/layers/lora.py's LoraStack), added after the base
     * product (after every segment's): a (lora_num_slots, lora_nseg lora_rank, k) and b
     * (lora_num_slots, n, lora_rank) float32, lora_seg_rows (lora_nseg,) summing to n; lora_a
     * NULL (and the rest 0) for a linear without them. */
    const float *lora_a, *lora_b;
    const int32_t *lora_seg_rows;
    int lora_rank, lora_nseg, lora_num_slots;
    /* TERN_WEIGHT_GGUF_Q8ACT: the rows repacked in groups of 8 (tern_gguf_repack_x8), which
     * products of few rows read, or NULL. */
    const void *packed;
} TernLinear;
#define TERN_WEIGHT_BF16 1
#define TERN_WEIGHT_GGUF 256
#define TERN_WEIGHT_GGUF_Q8ACT 512

/* What stays fixed between steps: weights, norms, rotary tables, this layer's KV cache (norms in
 * the activations' dtype; the cache too, or int8 rows with their scales: kv_format). */
typedef struct {
    TernLinear qkv, o, gate_up, down;
    /* The norms before attention and before the MLP (Llama's two), and of the attention's and
     * the MLP's outputs (sandwich and post norms: Gemma, GLM-4, OLMo 2); each may be NULL. */
    const void *input_norm, *post_norm, *attn_out_norm, *mlp_out_norm;
    const void *q_norm, *k_norm; /* RMSNorm weights of q and k, or NULL: per head (D,), or ... */
    int qk_norm_full;            /* ... over the whole projection (H D,) and (Hkv D,) (OLMo 2) */
    float eps, attn_scale;
    float attn_softcap; /* Gemma 2's cap on the attention scores, or 0 */
    int rotary_dim;     /* the features of each head rotated (partial rotation), 0: none (NoPE) */
    int rotary_interleaved; /* pairs (GLM) rather than halves */
    int gelu;               /* the MLP's gate: 0 SiLU, 1 GELU with the tanh approximation (Gemma) */
    float residual_scale;   /* multiplies each branch before its residual add (Granite), else 1 */
    int output_gate; /* q_proj gives each head its query then a gate: o *= sigmoid(gate) (Qwen3.5) */
    int hidden, num_heads, num_kv_heads, head_dim, intermediate;
    const float *cos_cache, *sin_cache;
    int64_t num_positions;
    void *k_cache, *v_cache;
    int64_t num_slots;
    int block_size;
    int window; /* a sliding-window layer's window, or 0 */
    int kv_format; /* the cache: the activations' dtype (0 float32, 1 bfloat16) or 2: int8 rows */
    const float *sinks; /* each head's attention sink (gpt-oss), or NULL */
    /* tensor parallelism: the TP group's shared-memory segment (shm_collectives.py), or tp_size 1 */
    char *shm;
    int tp_rank, tp_size;
    int64_t shm_slot_bytes;
    double shm_timeout_s;
} TernDecodeLayer;

/* What one step shares across its layers: its sequences and scratch rows (in the activations'
 * dtype) for every stage. */
typedef struct {
    int num_tokens;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *context_lens;
    int64_t table_stride;
    void *normed, *qkv, *q, *attn, *attn_out, *gate_up, *act;
    const int32_t *lora_slots; /* each token's LoRA slot (-1: none), or NULL: no LoRA this step */
} TernDecodeStep;

/* ---------------------------------------------------------------- bfloat16 scalars */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f rounded to the nearest bfloat16, as a float: what a torch op on bfloat16 tensors returns. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* ---------------------------------------------------------------- exported functions */
/* GGUF block types tern multiplies as stored (ggml's type ids). */
#define TERN_GGUF_Q4_0 2
#define TERN_GGUF_Q4_1 3
#define TERN_GGUF_Q5_0 6
#define TERN_GGUF_Q5_1 7
#define TERN_GGUF_Q8_0 8
#define TERN_GGUF_Q4_K 12
#define TERN_GGUF_Q5_K 13
#define TERN_GGUF_Q6_K 14
/* tern's own block: 32 int4 values with a zero point (GPTQ, AWQ, --quantization int4). */
#define TERN_BLOCK_INT4_ZP 64

/* TERN_EXPORTS_BEGIN */

/* info.c: the ABI version, the tier this library was compiled for ("avx2", ...), and the sizes
 * of TernLinear, TernDecodeLayer, TernDecodeStep written to sizes[0..2]. */
int tern_abi_version(void);
const char *tern_compiled_tier(void);
void tern_struct_sizes(int64_t *sizes);

/* attention.c: q, out (B, H, D) float32 (io_is_bf16 = 0) or bfloat16 (1); k_cache, v_cache
 * (num_slots, Hkv, D) float32 (kv_format 0) or bfloat16 (1), or int8 rows with scales (2); see
 * the definition. */
int tern_paged_decode_attention(const void *q, void *k_cache, void *v_cache, const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens, void *out, int B, int H, int Hkv, int D, int block_size, float scale, int kv_format, int io_is_bf16, const void *k_new, int64_t k_new_stride, const void *v_new, int64_t v_new_stride, const int64_t *slots, int64_t num_slots, int window, float softcap, const float *sinks);

/* prefill_attention.c: a prompt chunk's causal attention over the paged cache (see the
 * definition); available for float32 (bf16 = 0) on AVX-512 builds, bfloat16 on AVX512-BF16 ones. */
int tern_prefill_attention_available(int bf16);
int tern_prefill_attention_max_context(void);
int tern_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables, int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_start, void *out, int64_t out_stride, int B, int H, int Hkv, int D, int block_size, float scale, int window, int bf16);

/* linear_f32.c: y (M, N) = x (M, K) @ w (N, K).T + bias, float32 arithmetic; w float32, or
 * bfloat16-stored (bf16w) widened to float32 in registers. */
int tern_f32_linear(const float *x, const float *w, const float *bias, float *y, int M, int N, int K);
/* The same product with one arithmetic for every row whatever M (the register-block tiles; each
 * output a fixed-order sum over K): a row's result does not depend on the batch (--batch-invariant). */
int tern_f32_linear_invariant(const float *x, const float *w, const float *bias, float *y, int M,
                              int N, int K);
/* linear_f32.c: a decode step's routed experts (token, expert, weight pairs) through SiLU-gated
 * expert MLPs w13 (E, 2I, H) / w2 (E, H, I), biases or NULL, summed into out (T, H). */
void tern_f32_moe_experts(const float *x, int H, const int64_t *pair_token, const int64_t *pair_expert, const float *pair_weight, int P, const float *w13, const float *b13, const float *w2, const float *b2, int I, float *gate_up, float *act, float *y, float *out);
int tern_bf16w_linear(const float *x, const uint16_t *w, const float *bias, float *y, int M, int N, int K);

/* linear_int8.c: int8 weights with per-row float32 scales. */
int tern_int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int M, int N, int K);
int tern_int8_linear_bf16(const uint16_t *x, const int8_t *w, const float *scale, const uint16_t *bias, uint16_t *y, int M, int N, int K);
void tern_int8_dequantize(const int8_t *w, const float *scale, float *out, int N, int K);

/* linear_gguf.c: GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and INT4_ZP dequantized in registers, float32 arithmetic. */
int tern_gguf_linear(const float *x, const uint8_t *w, int type, const float *bias, float *y, int M, int N, int K);
int tern_gguf_dequantize(const uint8_t *w, int type, float *out, int N, int K);
int tern_gguf_linear_q8act(const float *x, const uint8_t *w, const uint8_t *packed, int type, const float *bias, float *y, int M, int N, int K);
int64_t tern_gguf_x8_bytes(int type, int N, int K);
int tern_gguf_repack_x8(const uint8_t *w, int type, int N, int K, uint8_t *out);

/* linear_bf16.c: bfloat16 activations and weights, float32 accumulation. */
int tern_bf16_gemv_available(void);
int tern_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K);
int tern_bf16_amx_max_rows(void);
int tern_bf16_amx_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K);
int tern_int8_amx_linear_bf16(const uint16_t *x, const int8_t *w, const float *scale, const uint16_t *bias, uint16_t *y, int M, int N, int K);

/* elementwise.c */
void tern_rms_norm(const float *x, const float *res, float *res_out, const float *w, float *out, int T, int D, float eps);
void tern_rms_norm_bf16(const uint16_t *x, const uint16_t *res, uint16_t *res_out, const uint16_t *w, uint16_t *out, int T, int D, float eps);
int tern_rotary_neox(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions, int64_t num_positions, const float *cos_cache, const float *sin_cache, int T, int H, int Hkv, int D, int R, int interleaved);
int tern_rotary_neox_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride, const int64_t *positions, int64_t num_positions, const float *cos_cache, const float *sin_cache, int T, int H, int Hkv, int D, int R, int interleaved);
void tern_silu_and_mul(const float *x, float *out, int T, int I);
void tern_silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I);
void tern_gelu_tanh_and_mul(const float *x, float *out, int T, int I);
void tern_sigmoid_gate(float *o, int64_t o_stride, const float *gate, int64_t gate_stride, int T, int n);
void tern_sigmoid_gate_bf16(uint16_t *o, int64_t o_stride, const uint16_t *gate, int64_t gate_stride, int T, int n);
void tern_gelu_tanh_and_mul_bf16(const uint16_t *x, uint16_t *out, int T, int I);
void tern_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words_per_row, const int64_t *rows, int n_rows, int vocab);
void tern_exponential_uniforms(const int64_t *row_keys, int n_rows, const int64_t *token_ids, int64_t k, int ids_per_row, float *out);

/* lora.c: y (M, N) += each row's LoRA adapter's product with x (M, K), float32 or bfloat16
 * (is_bf16), rows x_stride / y_stride elements apart; see the definition. */
int tern_lora_add(const void *x, int64_t x_stride, void *y, int64_t y_stride, const int32_t *slots, int M, int K, int N, const float *a, const float *b, int num_slots, int R, int nseg, const int32_t *seg_rows, int is_bf16);

/* collectives.c: all-reduce and all-gather among the TP ranks of one host. */
int64_t tern_shm_header_bytes(void);
int tern_shm_all_reduce(char *seg, int rank, int world, int64_t seq, int64_t slot_bytes, void *x, int64_t n, int is_bf16, double timeout_s);
int tern_shm_all_gather(char *seg, int rank, int world, int64_t seq, int64_t slot_bytes, const void *x, int64_t nbytes, void *out, double timeout_s);

/* gated_delta_net.c: a Gated DeltaNet layer's decode step from its input projection to its gated
 * norm; see the definition. */
int tern_gated_delta_decode(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b_proj, int64_t b_stride, const void *a_proj, int64_t a_stride, const void *A_log, const void *dt_bias, const void *conv_weight, void *conv_states, float *recurrent, const int64_t *slots, const uint8_t *fresh, int64_t num_slots, const void *norm_weight, float eps, float *conv_scratch, void *out, int G, int Hk, int Hv, int dk, int dv, int K, int is_bf16);

/* decode_layer.c: one Llama-style decoder layer of a decode step, bfloat16 or float32. */
int tern_decode_layer_bf16(const TernDecodeLayer *L, const TernDecodeStep *S, const uint16_t *x, const uint16_t *residual, uint16_t *out, uint16_t *res_out, int64_t seq);
int tern_decode_layer_f32(const TernDecodeLayer *L, const TernDecodeStep *S, const float *x, const float *residual, float *out, float *res_out, int64_t seq);
/* A stack of such layers (each with its MLP) in one call; see decode_layer.c. */
int tern_decode_layers_bf16(const TernDecodeLayer *const *layers, int num_layers, const TernDecodeStep *S, const uint16_t *x, const uint16_t *residual, uint16_t *out, uint16_t *res_out, uint16_t *tmp_out, uint16_t *tmp_res, int64_t seq);
int tern_decode_layers_f32(const TernDecodeLayer *const *layers, int num_layers, const TernDecodeStep *S, const float *x, const float *residual, float *out, float *res_out, float *tmp_out, float *tmp_res, int64_t seq);

/* TERN_EXPORTS_END */
#endif
