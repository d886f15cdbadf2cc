/* Gemma 3 decoder layers for an all-decode step (one new token per sequence), as one call for
 * a model's whole stack: the kernels its modules (models/gemma3.py) call one by one, in the
 * same order on the same values, so the result is bit for bit the module path's:
 *
 *   h = rms_norm(x + residual) * in_norm                   (residual += x; first layer: residual = x)
 *   qkv = h @ Wqkv;  each q and k head: rms_norm(head) * q_norm / k_norm, then RoPE (the layer's table)
 *   attn = paged decode attention (K/V written; the layer's window, scale and block tables)
 *   h = rms_norm(attn @ Wo) * post_norm                     (the attention output's norm)
 *   h = rms_norm(h + residual) * pre_ff_norm               (residual += h)
 *   x = rms_norm(down(gelu_tanh(gate) * up)) * post_ff_norm (the MLP output's norm: the layer's output)
 *
 * Hybrid KV (core/kv_groups.py): layer i reads and writes its cache through its own group's
 * slots[i] / block_tables[i] (max_blocks[i] columns); positions and seq_lens are the step's.
 *
 *   x [B, H]         in: the embeddings (first) or the previous layer's output; out: the last layer's output
 *   residual [B, H]  the residual stream
 *   scratch          B * (2 H + QKV + Hq D + 3 I) floats, as layer.c
 */
#include <string.h>

#include "tq.h"

static void gemma_decode(const tq_gemma_layer *G, float *x, float *residual, int first, const int64_t *positions,
                         const int64_t *slots, const int32_t *block_tables, int64_t max_blocks,
                         const int32_t *seq_lens, int64_t B, int64_t H, float *scratch) {
    const tq_decoder_layer *L = G->base;
    const int64_t D = L->head_dim, q_size = L->num_heads * D, kv_size = L->num_kv_heads * D;
    const int64_t qkv = q_size + 2 * kv_size, inter = L->inter;
    float *h = scratch, *qkv_out = h + B * H, *attn = qkv_out + B * qkv, *o = attn + B * q_size;
    float *gate_up = o + B * H, *act = gate_up + B * 2 * inter;
    tq_layer_norm_qkv(L, x, residual, first, B, H, h, qkv_out);
    for (int64_t b = 0; b < B; b++) { /* per-head norms in place (each value depends on its own head only) */
        float *q = qkv_out + b * qkv;
        tq_rms_norm(q, NULL, G->q_norm, q, L->num_heads, D, D, L->eps);
        tq_rms_norm(q + q_size, NULL, G->k_norm, q + q_size, L->num_kv_heads, D, D, L->eps);
    }
    tq_rope(qkv_out, L->cos_sin, positions, B, L->num_heads + L->num_kv_heads, D, qkv); /* q and k heads */
    tq_paged_decode(qkv_out, qkv_out + q_size, qkv_out + q_size + kv_size, qkv, qkv, qkv, L->k_cache, L->v_cache,
                    slots, block_tables, seq_lens, B, max_blocks, L->block_size, L->num_heads, L->num_kv_heads, D,
                    L->window, L->scale, L->kv_format, attn);
    tq_matmul(&L->layouts[1], L->o_w, attn, o, NULL, B, H, q_size);
    tq_rms_norm(o, NULL, L->post_norm, h, B, H, H, L->eps);
    tq_rms_norm(h, residual, G->pre_ff_norm, o, B, H, H, L->eps);
    tq_matmul(&L->layouts[2], L->gate_up_w, o, gate_up, NULL, B, 2 * inter, H);
    tq_gelu_tanh_mul(gate_up, act, B, inter, 2 * inter);
    tq_matmul(&L->layouts[3], L->down_w, act, h, NULL, B, H, inter);
    tq_rms_norm(h, NULL, G->post_ff_norm, x, B, H, H, L->eps);
}

void tq_gemma_layers_decode(const tq_gemma_layer *layers, int64_t n, float *x, float *residual, int first,
                            const int64_t *positions, const int64_t *const *slots, const int32_t *const *block_tables,
                            const int64_t *max_blocks, const int32_t *seq_lens, int64_t B, int64_t H, float *scratch) {
    for (int64_t i = 0; i < n; i++)
        gemma_decode(layers + i, x, residual, first && i == 0, positions, slots[i], block_tables[i], max_blocks[i],
                     seq_lens, B, H, scratch);
}
