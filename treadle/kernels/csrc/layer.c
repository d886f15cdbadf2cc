/* One Llama decoder layer for an all-decode step (one new token per sequence) whose linear
 * layers are GGUF blocks or bfloat16 rows (tq_layout segments; a float checkpoint in bfloat16
 * runs float32 activations, so everything below is float32 either way), as a single call: the same kernels the layer's modules call one by
 * one (RMSNorm + residual, qkv matmul, RoPE, paged decode attention with the K/V write, o_proj,
 * RMSNorm + residual, gate_up matmul, SwiGLU, down_proj), in the same order on the same
 * values, so the result is bit for bit the module path's. What it saves is the Python
 * between them: ~10 calls, their argument checks and temporaries per layer and step.
 *
 * tq_llama_layers_decode runs n such layers back to back (a model's whole stack, so no Python runs
 * between its layers either); each layer's weights, shapes and KV cache are one tq_decoder_layer.
 *
 *   x [B, H]         in: the layer's input (previous layer's MLP output, or the embeddings);
 *                    out: this layer's MLP output
 *   residual [B, H]  the residual stream: x is added into it (first layer: set to x)
 *   scratch          B * (2 H + QKV + Hq D + 3 I) floats
 */
#include <string.h>

#include "tq.h"

/* A decoder layer's start, shared with gemma_layer.c: x joins the residual stream (the model's
 * first layer: the stream is set to x), h = RMSNorm(stream), qkv_out = h W_qkv (+ bias). */
void tq_layer_norm_qkv(const tq_decoder_layer *L, const float *x, float *residual, int first, int64_t B, int64_t H,
                       float *h, float *qkv_out) {
    if (first) { /* residual <- x, normalized as it is */
        memcpy(residual, x, (size_t)(B * H) * sizeof(float));
        tq_rms_norm(residual, NULL, L->in_norm, h, B, H, H, L->eps);
    } else {
        tq_rms_norm(x, residual, L->in_norm, h, B, H, H, L->eps);
    }
    const int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    tq_matmul(&L->layouts[0], L->qkv_w, h, qkv_out, L->qkv_bias, B, qkv, H);
}

static void layer_decode(const tq_decoder_layer *L, float *x, float *residual, int first, const int64_t *positions,
                         const int64_t *slots, const int32_t *block_tables, const int32_t *seq_lens, int64_t B,
                         int64_t max_blocks, int64_t H, float *scratch) {
    const int64_t q_size = L->num_heads * L->head_dim, kv_size = L->num_kv_heads * L->head_dim;
    const int64_t qkv = q_size + 2 * kv_size, inter = L->inter;
    float *h = scratch, *qkv_out = h + B * H, *attn = qkv_out + B * qkv, *o = attn + B * q_size;
    float *gate_up = o + B * H, *act = gate_up + B * 2 * inter;
    tq_layer_norm_qkv(L, x, residual, first, B, H, h, qkv_out);
    tq_rope(qkv_out, L->cos_sin, positions, B, L->num_heads + L->num_kv_heads, L->head_dim, qkv); /* q and k heads */
    tq_paged_decode(qkv_out, qkv_out + q_size, qkv_out + q_size + kv_size, qkv, qkv, qkv, L->k_cache, L->v_cache,
                    slots, block_tables, seq_lens, B, max_blocks, L->block_size, L->num_heads, L->num_kv_heads,
                    L->head_dim, L->window, L->scale, L->kv_format, attn);
    tq_matmul(&L->layouts[1], L->o_w, attn, o, NULL, B, H, q_size);
    tq_rms_norm(o, residual, L->post_norm, h, B, H, H, L->eps);
    tq_matmul(&L->layouts[2], L->gate_up_w, h, gate_up, NULL, B, 2 * inter, H);
    tq_silu_mul(gate_up, act, B, inter, 2 * inter);
    tq_matmul(&L->layouts[3], L->down_w, act, x, NULL, B, H, inter);
}

/* n consecutive layers, one after another on the same x / residual: the model's whole stack
 * in one call on an all-decode step (first: layers[0] is the model's first layer). */
void tq_llama_layers_decode(const tq_decoder_layer *layers, int64_t n, float *x, float *residual, int first,
                            const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                            const int32_t *seq_lens, int64_t B, int64_t max_blocks, int64_t H, float *scratch) {
    for (int64_t i = 0; i < n; i++)
        layer_decode(layers + i, x, residual, first && i == 0, positions, slots, block_tables, seq_lens, B,
                     max_blocks, H, scratch);
}
