/* One Llama decoder layer for an all-decode step (one new token per sequence) whose linear
 * layers are GGUF blocks or bfloat16 rows (tq_layout segments; a float checkpoint in bfloat16
 * runs float32 activations, so everything below is float32 either way), as a single call: the same kernels the layer's modules call one by
 * one (RMSNorm + residual, qkv matmul, RoPE, paged decode attention with the K/V write, o_proj,
 * RMSNorm + residual, gate_up matmul, SwiGLU, down_proj), in the same order on the same
 * values, so the result is bit for bit the module path's. What it saves is the Python
 * between them: ~10 calls, their argument checks and temporaries per layer and step.
 *
 *   x [B, H]         in: the layer's input (previous layer's MLP output, or the embeddings);
 *                    out: this layer's MLP output
 *   residual [B, H]  the residual stream: x is added into it (first layer: set to x)
 *   scratch          B * (2 H + QKV + Hq D + 3 I) floats
 */
#include <string.h>

#include "tq.h"

void tq_llama_layer_decode(float *x, float *residual, int first, const float *in_norm, const float *post_norm,
                           float eps, const tq_layout *layouts, const uint8_t *qkv_w, const float *qkv_bias,
                           const uint8_t *o_w, const uint8_t *gate_up_w, const uint8_t *down_w,
                           const float *cos_sin, const int64_t *positions, void *k_cache, void *v_cache,
                           const int64_t *slots, const int32_t *block_tables, const int32_t *seq_lens, int64_t B,
                           int64_t max_blocks, int64_t block_size, int64_t H, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t window, float scale,
                           int kv_format, float *scratch) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv = q_size + 2 * kv_size;
    float *h = scratch, *qkv_out = h + B * H, *attn = qkv_out + B * qkv, *o = attn + B * q_size;
    float *gate_up = o + B * H, *act = gate_up + B * 2 * inter;
    if (first) { /* residual <- x, normalized as it is */
        memcpy(residual, x, (size_t)(B * H) * sizeof(float));
        tq_rms_norm(residual, NULL, in_norm, h, B, H, H, eps);
    } else {
        tq_rms_norm(x, residual, in_norm, h, B, H, H, eps);
    }
    tq_matmul(&layouts[0], qkv_w, h, qkv_out, qkv_bias, B, qkv, H);
    tq_rope(qkv_out, cos_sin, positions, B, num_heads + num_kv_heads, head_dim, qkv); /* q and k heads */
    tq_paged_decode(qkv_out, qkv_out + q_size, qkv_out + q_size + kv_size, qkv, qkv, qkv, k_cache, v_cache, slots,
                    block_tables, seq_lens, B, max_blocks, block_size, num_heads, num_kv_heads, head_dim, window,
                    scale, kv_format, attn);
    tq_matmul(&layouts[1], o_w, attn, o, NULL, B, H, q_size);
    tq_rms_norm(o, residual, post_norm, h, B, H, H, eps);
    tq_matmul(&layouts[2], gate_up_w, h, gate_up, NULL, B, 2 * inter, H);
    tq_silu_mul(gate_up, act, B, inter, 2 * inter);
    tq_matmul(&layouts[3], down_w, act, x, NULL, B, H, inter);
}
