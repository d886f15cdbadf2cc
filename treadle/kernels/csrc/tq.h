/* Shared by Treadle's CPU kernels: the SIMD switch, small helpers, and the exported
 * functions (called from Python through ctypes, and from layer.c). */
#ifndef TQ_H
#define TQ_H

#include <stddef.h>
#include <stdint.h>

/* TQ_PLAIN_C: build the plain-C reference paths even where the CPU has SIMD (tests compare both) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TQ_PLAIN_C)
#include <immintrin.h>
#define TQ_AVX2 1

static inline float hsum(__m256 v) { /* the sum of 8 floats */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* The 32 floats of an activation block loaded into xv, and the largest |x| among them (max is
 * exact in any order, so this equals the plain loop of fmaxf). */
static inline float block_absmax(const float *xb, __m256 xv[4]) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        xv[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_and_ps(xv[j], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}
/* round(x * id) clamped to [-lim, lim] (cvtps2dq rounds to nearest even, as nearbyintf) */
static inline __m256i round_clamp(__m256 x, float id, int lim) {
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(id)));
    return _mm256_max_epi32(_mm256_min_epi32(r, _mm256_set1_epi32(lim)), _mm256_set1_epi32(-lim));
}
static inline int hsum_epi32(__m256i v) { /* the sum of 8 int32 lanes (exact) */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
/* AVX-512 VNNI with 256-bit forms (the avx512-vnni build): vpdpwssd, a 16-bit multiply-add and
 * the sum in one instruction */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TQ_VNNI 1
#endif
/* AVX-512 BF16 (the avx512-bf16 build): vdpbf16ps, bfloat16 pair products summed into float32 */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TQ_BF16 1
#endif
/* AVX-512 with BW, VL and VNNI (the avx512-vnni, avx512-bf16 and amx builds): q8batch.c's zmm strips,
 * and the packed rows' 16-bit activations (tq_q16_split) at their speed */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TQ_ZMM 1
#endif
#endif

/* qmatmul.c */
#define TQ_MAX_SEGMENTS 4
/* A weight's rows as runs of one GGUF block type each, stored back to back (a fused q/k/v layer
 * whose shards differ in type, as llama.cpp's K-quant mixes write them), or of bfloat16 rows
 * (TQ_W_BF16: a float checkpoint in --dtype bfloat16, multiplied by bf16matmul.c). */
#define TQ_W_BF16 30 /* GGML's number for bfloat16 */
typedef struct {
    int32_t count;
    int32_t qtype[TQ_MAX_SEGMENTS]; /* GGML type numbers (qblocks.h), or TQ_W_BF16 */
    int64_t rows[TQ_MAX_SEGMENTS];
    int32_t act_bits; /* 16, or 8: the types q8act.c reads (tq_q8_type: the legacy types, Q4_K, Q5_K,
                         Q6_K) take 8-bit activations */
    int32_t small_256; /* 1: batches of up to 4 rows that q8act.c reads straight into 256-bit registers (takes_registers)
                          skip the AVX-512 builds' zmm strips (q8batch.c); the same bits either way */
} tq_layout;
void tq_matmul(const tq_layout *layout, const uint8_t *w, const float *x, float *y, const float *bias, int64_t M,
               int64_t N, int64_t K);
void tq_gather_rows(int qtype, const uint8_t *w, const int64_t *ids, int64_t n, int64_t K, float *out);
void tq_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out);
/* bf16matmul.c */
void tq_bf16_matmul(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, const float *bias, int64_t M,
                    int64_t N, int64_t K);
void tq_bf16_rows(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t ldy, const float *bias,
                  int64_t M, int64_t N, int64_t K); /* y's rows ldy elements apart */
/* q8act.c: tq_matmul's 8-bit activation path */
typedef struct { /* activation rows as int8 blocks of 32, or (l set) 16-bit ones split in two bytes */
    const int8_t *q; /* [M, K]; split: the high bytes, v >> 8 */
    const float *d, *s; /* [M, K/32] scales; [M, K/32] scale * sum of the block's values */
    const int32_t *h; /* [M, 2 K/32]: sum(q) of each half block of 16 (Q6_K's q - 32 term; both: Q8_0's offset) */
    const uint8_t *l; /* NULL, or (tq_q16_split) [M, K] the low bytes, v & 255: v = 256 q + l */
} tq_q8acts;
/* rows m0.. of x */
static inline tq_q8acts tq_q8_rows_from(tq_q8acts x, int64_t m0, int64_t K) {
    const int64_t nb = K / 32;
    const tq_q8acts r = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * nb, x.h + 2 * m0 * nb, x.l ? x.l + m0 * K : NULL};
    return r;
}
/* activation element i's value: q, or 256 q + l when split */
static inline int32_t q8_value(tq_q8acts x, int64_t i) { return x.l ? 256 * (int32_t)x.q[i] + x.l[i] : x.q[i]; }
/* the integer sum of activation block i (Q8_0's +128 offset term): its two halves' */
static inline int32_t q8_block_sum(tq_q8acts x, int64_t i) { return x.h[2 * i] + x.h[2 * i + 1]; }
int tq_q8_type(int qtype);
tq_q8acts tq_q8_quantize(const float *x, int64_t M, int64_t K);
tq_q8acts tq_q16_split(const float *x, int64_t M, int64_t K); /* qmatmul.c's 16-bit rounding, split in two bytes */
void tq_q8_free(tq_q8acts a);
void tq_q8_rows(int qtype, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                int64_t N, int64_t K, int small_256);
void tq_q8_pack(int qtype, uint8_t *w, int64_t N, int64_t K); /* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K rows, N % 8 == 0, in place */
void tq_q8_unpack_row(int packed_qtype, const uint8_t *w, int64_t n, int64_t K, uint8_t *out);
/* q8batch.c: the whole groups of packed Q4 / Q8_0 / Q4_K / Q5_K / Q6_K rows at batches it takes (AVX-512 VNNI builds);
 * returns the rows done (0: none, the caller does them) */
int64_t tq_q8_batch_rows(int qtype, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias,
                         int64_t M, int64_t N, int64_t K);
/* q8amx.c: the same on AMX-INT8 (the amx build; 0 elsewhere, or where the kernel refuses AMX) */
int64_t tq_q8_amx_rows(int qtype, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias,
                       int64_t M, int64_t N, int64_t K);
/* ops.c */
void tq_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t hidden,
                 int64_t x_stride, float eps);
void tq_rope(float *x, const float *cos_sin, const int64_t *positions, int64_t tokens, int64_t heads,
             int64_t head_dim, int64_t row_stride);
void tq_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t d, int64_t in_stride);
void tq_gelu_tanh_mul(const float *gate_up, float *out, int64_t rows, int64_t d, int64_t in_stride);
/* paged_attention.c; kv_format: what the cache holds */
enum { TQ_KV_FLOAT32 = 0, TQ_KV_INT8 = 1, TQ_KV_FP8 = 2, TQ_KV_BF16 = 3 };
void tq_paged_decode(const float *q, const float *k, const float *v, int64_t q_stride, int64_t k_stride,
                     int64_t v_stride, void *k_cache, void *v_cache, const int64_t *slots,
                     const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs, int64_t max_blocks,
                     int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                     float scale, int kv_format, float *out);
/* w8a8.c: int8 x int8 with exact int32 sums (compressed-tensors W8A8 checkpoints) */
void tq_w8a8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs);
void tq_w8a8_matmul(const int8_t *xq, const float *xs, const int8_t *w, const float *ws, const int32_t *wsum,
                    const float *bias, float *y, int64_t M, int64_t N, int64_t K);
/* layer.c */
typedef struct { /* one Llama decoder layer: its weights and shapes (tq_layout segments), and its KV cache */
    const float *in_norm, *post_norm;
    const tq_layout *layouts; /* [4]: qkv, o, gate_up, down */
    const uint8_t *qkv_w, *o_w, *gate_up_w, *down_w;
    const float *qkv_bias, *cos_sin; /* bias [q + 2 kv] or NULL; RoPE table [positions, head_dim] */
    void *k_cache, *v_cache;
    int64_t num_heads, num_kv_heads, head_dim, inter, window, block_size;
    float eps, scale;
    int32_t kv_format;
} tq_decoder_layer;
void tq_layer_norm_qkv(const tq_decoder_layer *L, const float *x, float *residual, int first, int64_t B, int64_t H,
                       float *h, float *qkv_out);
void tq_llama_layers_decode(const tq_decoder_layer *layers, int64_t n, float *x, float *residual, int first,
                            const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                            const int32_t *seq_lens, int64_t B, int64_t max_blocks, int64_t H, float *scratch);
/* gemma_layer.c */
typedef struct { /* one Gemma 3 decoder layer: a Llama layer's fields (post_norm: the attention output's
                    norm) and Gemma's other norms, each multiplier (1 + w) as the model holds it */
    const tq_decoder_layer *base;
    const float *q_norm, *k_norm; /* [head_dim], over each query / key head before RoPE */
    const float *pre_ff_norm, *post_ff_norm; /* [H]: the MLP's input (with the residual add) and output */
} tq_gemma_layer;
void tq_gemma_layers_decode(const tq_gemma_layer *layers, int64_t n, float *x, float *residual, int first,
                            const int64_t *positions, const int64_t *const *slots, const int32_t *const *block_tables,
                            const int64_t *max_blocks, const int32_t *seq_lens, int64_t B, int64_t H, float *scratch);

#endif
