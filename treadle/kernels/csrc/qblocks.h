/* GGUF block types as qmatmul.c reads them: sizes, scales, and the integers of one block of 32.
 *
 * A weight row is a run of units: one block of 32 inputs for the legacy types, a super-block of
 * 256 (8 blocks of 32) for the K-quants. qmatmul.c walks every row one block of 32 at a time and
 * needs, per block, its 32 integers q (block_ints / block_weights) and, from the unit's header
 * (unit_scales), the scale of the block (of each half of 16 for Q2_K, Q3_K, Q6_K) and the
 * coefficients of the activation sums:
 *
 *   w[j] = d * q[j]  +  m                  (Q4_1, Q5_1, Q4_K, Q5_K: m per block of 32)
 *   w[j] = d[j / 16] * q[j]  +  mh[j / 16] (Q2_K: a minimum per half)
 *
 * (Q4_0 and Q5_0 read q - 8 and q - 16 as signed integers; Q8_0, Q3_K, Q6_K are signed too.)
 * Every product d * q is exact in float32 (at most 23 significant bits), so w is the value
 * the gguf package's reference dequantizer computes, bit for bit.
 *
 * Layouts (little-endian; d, dmin, m float16; element e of a super-block, l = e % 32, b = e / 32,
 * h = b / 4, r = b % 4; sub-scales of 16 elements are indexed by e / 16, of 32 by b):
 *   Q4_0  (18 B / 32): d | qs[16]               q = qs[l%16] nibble (low: l < 16)      w = d (q - 8)
 *   Q4_1  (20 B / 32): d | m | qs[16]           as Q4_0                                w = d q + m
 *   Q5_0  (22 B / 32): d | qh[4] | qs[16]       as Q4_0, bit l of qh is bit 4          w = d (q - 16)
 *   Q5_1  (24 B / 32): d | m | qh[4] | qs[16]   as Q5_0                                w = d q + m
 *   Q8_0  (34 B / 32): d | qs[32] int8                                                 w = d q
 *   Q2_K  (84 B / 256): sc[16] | qs[64] | d | dmin     q = qs[32h + l] >> 2r & 3
 *                       w = d (sc & 15) q - dmin (sc >> 4)
 *   Q3_K (110 B / 256): hm[32] | qs[64] | sc[12] | d   q = (qs[32h + l] >> 2r & 3) - (hm[l] bit b ? 0 : 4)
 *                       w = d (sc - 32) q, sc 6-bit: low 4 in sc[i % 8] (>> 4 for i >= 8),
 *                       high 2 in sc[8 + i % 4] >> 2 (i / 4)
 *   Q4_K (144 B / 256): d | dmin | sc[12] | qs[128]    q = qs[32 (b/2) + l] >> 4 (b%2) & 15
 *                       w = d sc_b q - dmin mn_b, 6-bit sc/mn packed as in k4_scale_min
 *   Q5_K (176 B / 256): d | dmin | sc[12] | qh[32] | qs[128]   as Q4_K, bit b of qh[l] is bit 4
 *   Q6_K (210 B / 256): ql[128] | qh[64] | sc[16] int8 | d
 *                       q = (ql[64h + 32 (r%2) + l] >> 4 (r/2) & 15 | (qh[32h + l] >> 2r & 3) << 4) - 32
 *                       w = d sc q
 */
#ifndef TQ_QBLOCKS_H
#define TQ_QBLOCKS_H

#include <stdint.h>
#include <string.h>
#include "tq.h"

/* inlined into qmatmul.c's tiles, where the block type is a constant: the switches fold away */
#define TQ_INLINE static inline __attribute__((always_inline))

/* GGML's own type numbers (the gguf package's GGMLQuantizationType), as native.QTYPES */
enum { TQ_Q4_0 = 2, TQ_Q4_1 = 3, TQ_Q5_0 = 6, TQ_Q5_1 = 7, TQ_Q8_0 = 8,
       TQ_Q2_K = 10, TQ_Q3_K = 11, TQ_Q4_K = 12, TQ_Q5_K = 13, TQ_Q6_K = 14 };
#define QK 32
/* TQ_PACKED + Q4_0 / Q4_1 (packed_type), + Q5_0 / Q5_1 (packed_five), + Q4_K / Q6_K (packed_k) and + Q8_0:
 * the same blocks repacked 8 rows at a time for the 8-bit activation path (q8pack.c's tq_q8_pack
 * documents the layouts); same bytes per row */
#define TQ_PACKED 100
TQ_INLINE int packed_type(int t) { return t == TQ_PACKED + TQ_Q4_0 || t == TQ_PACKED + TQ_Q4_1; }
TQ_INLINE int packed_five(int t) { return t == TQ_PACKED + TQ_Q5_0 || t == TQ_PACKED + TQ_Q5_1; }
TQ_INLINE int packed_k(int t) { return t == TQ_PACKED + TQ_Q4_K || t == TQ_PACKED + TQ_Q6_K; }
TQ_INLINE int packed_q8_0(int t) { return t == TQ_PACKED + TQ_Q8_0; }
TQ_INLINE int is_packed(int t) { return packed_type(t) || packed_five(t) || packed_k(t) || packed_q8_0(t); }
TQ_INLINE int base_type(int t) { return is_packed(t) ? t - TQ_PACKED : t; }
/* packed rows that take 16-bit activations split in two bytes (q8pack.c tq_q16_split; native.SPLIT_16);
 * packed Q6_K keeps 8-bit ones (its int32 scale fold would overflow with 16-bit values) */
TQ_INLINE int packed_split16(int t) { return packed_type(t) || packed_five(t) || packed_q8_0(t) || t == TQ_PACKED + TQ_Q4_K; }

TQ_INLINE int is_k_quant(int t) { return base_type(t) >= TQ_Q2_K && base_type(t) <= TQ_Q6_K; }
TQ_INLINE int unit_blocks(int t) { return is_k_quant(t) ? 8 : 1; } /* blocks of 32 per unit */
/* the K-quants with an 8-bit activation path (q8act.c, q8batch.c, q8amx.c), packed or not */
TQ_INLINE int q8_kquant(int t) { return base_type(t) == TQ_Q4_K || base_type(t) == TQ_Q5_K || base_type(t) == TQ_Q6_K; }
/* rows per packed group (q8pack.c's tq_q8_pack), and per group of q8act.c's panel */
#define GR 8
/* a packed Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 group block's scales: its 8 rows' d (Q4_1 / Q5_1: then m) */
TQ_INLINE int scale_bytes(int t) { return base_type(t) == TQ_Q4_1 || base_type(t) == TQ_Q5_1 ? 4 * GR : 2 * GR; }
/* the bytes before its steps: the scales, and for Q5_0 / Q5_1 the rows' fifth bits (tq_q8_pack) */
TQ_INLINE int step_offset(int t) { return scale_bytes(t) + (packed_five(t) ? 4 * GR : 0); }
/* packed Q5_0 / Q5_1 group block p's fifth bits for step s, half h (0: the low nibbles' elements,
 * 1: the high ones'): bit 4 j + c belongs to byte 4 j + c of the step */
TQ_INLINE uint32_t fifth_mask(int t, const uint8_t *p, int s, int h) {
    uint32_t m;
    memcpy(&m, p + scale_bytes(t) + 8 * s + 4 * h, 4);
    return m;
}
/* a Q4_1 / Q5_1 block (packed or not) stores its minimum; Q4_0 / Q5_0 read as unsigned q with
 * minimum -q_bias d */
TQ_INLINE int stores_min(int t) { return base_type(t) == TQ_Q4_1 || base_type(t) == TQ_Q5_1; }
TQ_INLINE int q_bias(int t) { return base_type(t) == TQ_Q4_0 ? 8 : base_type(t) == TQ_Q5_0 ? 16 : 0; }
/* a Q4_0 / Q4_1 / Q5_0 / Q5_1 block's 16 nibble bytes (byte i: q[i] low, q[i + 16] high) */
TQ_INLINE const uint8_t *nibbles(int t, const uint8_t *u) {
    return u + (t == TQ_Q4_0 ? 2 : t == TQ_Q4_1 ? 4 : t == TQ_Q5_0 ? 6 : 8);
}

TQ_INLINE int unit_bytes(int t) {
    switch (base_type(t)) {
        case TQ_Q4_0: return 18;
        case TQ_Q4_1: return 20;
        case TQ_Q5_0: return 22;
        case TQ_Q5_1: return 24;
        case TQ_Q8_0: return 34;
        case TQ_Q2_K: return 84;
        case TQ_Q3_K: return 110;
        case TQ_Q4_K: return 144;
        case TQ_Q5_K: return 176;
        default: return 210; /* Q6_K */
    }
}

/* a packed K-quant super-block's whole dwords per row (q8pack.c tq_q8_pack); Q6_K's 8 d follow them */
TQ_INLINE int kwords(int t) { return unit_bytes(t) / 4; }
/* row j's unit of a packed K-quant super-block p, as the file has it (q8pack.c's layout) */
TQ_INLINE void unpack_kunit(int t, const uint8_t *p, int j, uint8_t *u) {
    const int c4 = kwords(t), tail = unit_bytes(t) % 4;
    for (int c = 0; c < c4; c++) memcpy(u + 4 * c, p + 32 * c + 4 * j, 4);
    memcpy(u + 4 * c4, p + 32 * c4 + tail * j, (size_t)tail);
}
TQ_INLINE int64_t row_bytes(int t, int64_t K) { return K / (QK * unit_blocks(t)) * unit_bytes(t); }
TQ_INLINE int split_scales(int t) { return t == TQ_Q2_K || t == TQ_Q3_K || t == TQ_Q6_K; } /* dh per 16 */
TQ_INLINE int min_per_block(int t) { return t == TQ_Q4_1 || t == TQ_Q5_1 || t == TQ_Q4_K || t == TQ_Q5_K; }
TQ_INLINE int min_per_half(int t) { return t == TQ_Q2_K; }

TQ_INLINE float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef TQ_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* A unit's scales: d per block of 32 (per half of 16 for split_scales types: d[2b], d[2b + 1]),
 * m per block of 32, mh per half (Q2_K). */
typedef struct {
    float d[16], m[8], mh[16];
} unit_scales_t;

TQ_INLINE int scale_index(int t, int b, int half) { return split_scales(t) ? 2 * b + half : b; }

/* Q4_K / Q5_K: the 6-bit scales (bytes 0..7) and minimums (8..15) of the 8 blocks, from the 12
 * packed bytes: block j < 4 in the low 6 bits of s[j] (s[j + 4]); j >= 4 in the low (high)
 * nibble of s[j + 4] with its top 2 bits in the top bits of s[j - 4] (s[j]). */
TQ_INLINE void k4_scales_mins(const uint8_t *s, uint8_t out[16]) {
    uint32_t a[3], v[4];
    memcpy(a, s, 12);
    v[0] = a[0] & 0x3f3f3f3fu;
    v[1] = (a[2] & 0x0f0f0f0fu) | ((a[0] >> 2) & 0x30303030u);
    v[2] = a[1] & 0x3f3f3f3fu;
    v[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | ((a[1] >> 2) & 0x30303030u);
    memcpy(out, v, 16);
}

/* Q3_K: the 16 6-bit scales (biased by 32): low 4 bits in the nibbles of s[0..8), high 2 bits
 * in s[8..12). */
TQ_INLINE void q3k_scales(const uint8_t *s, uint8_t out[16]) {
    uint32_t a[3], v[4];
    memcpy(a, s, 12);
    v[0] = a[0] & 0x0f0f0f0fu;
    v[1] = a[1] & 0x0f0f0f0fu;
    v[2] = (a[0] >> 4) & 0x0f0f0f0fu;
    v[3] = (a[1] >> 4) & 0x0f0f0f0fu;
    for (int g = 0; g < 4; g++) v[g] |= ((a[2] >> (2 * g)) & 0x03030303u) << 4;
    memcpy(out, v, 16);
}

/* out[i] = scale * (b[i] - bias) for 8 bytes (int8 when is_signed, else uint8) */
TQ_INLINE void scale_bytes8(const uint8_t *b, int is_signed, int bias, float scale, float *out) {
#ifdef TQ_AVX2
    const __m128i raw = _mm_loadl_epi64((const __m128i *)b);
    const __m256i v = _mm256_sub_epi32(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw),
                                       _mm256_set1_epi32(bias));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(v)));
#else
    for (int i = 0; i < 8; i++) out[i] = scale * (float)((is_signed ? (int)(int8_t)b[i] : (int)b[i]) - bias);
#endif
}

TQ_INLINE void unit_scales(int t, const uint8_t *u, unit_scales_t *s) {
    uint8_t b[16];
    switch (t) {
        case TQ_Q4_0: case TQ_Q5_0: case TQ_Q8_0:
            s->d[0] = half_to_float(u);
            return;
        case TQ_Q4_1: case TQ_Q5_1:
            s->d[0] = half_to_float(u);
            s->m[0] = half_to_float(u + 2);
            return;
        case TQ_Q2_K: {
            uint32_t a[4], lo[4], hi[4];
            memcpy(a, u, 16);
            for (int i = 0; i < 4; i++) {
                lo[i] = a[i] & 0x0f0f0f0fu;
                hi[i] = (a[i] >> 4) & 0x0f0f0f0fu;
            }
            memcpy(b, lo, 16);
            const float d = half_to_float(u + 80), nmin = -half_to_float(u + 82);
            scale_bytes8(b, 0, 0, d, s->d);
            scale_bytes8(b + 8, 0, 0, d, s->d + 8);
            memcpy(b, hi, 16);
            scale_bytes8(b, 0, 0, nmin, s->mh);
            scale_bytes8(b + 8, 0, 0, nmin, s->mh + 8);
            return;
        }
        case TQ_Q3_K: {
            const float d = half_to_float(u + 108);
            q3k_scales(u + 96, b);
            scale_bytes8(b, 0, 32, d, s->d);
            scale_bytes8(b + 8, 0, 32, d, s->d + 8);
            return;
        }
        case TQ_Q4_K: case TQ_Q5_K: {
            k4_scales_mins(u + 4, b);
            scale_bytes8(b, 0, 0, half_to_float(u), s->d);
            scale_bytes8(b + 8, 0, 0, -half_to_float(u + 2), s->m);
            return;
        }
        default: { /* Q6_K */
            const float d = half_to_float(u + 208);
            scale_bytes8(u + 192, 1, 0, d, s->d);
            scale_bytes8(u + 200, 1, 0, d, s->d + 8);
            return;
        }
    }
}

/* The 32 integers of block b (0 .. unit_blocks - 1) of unit u: the plain-C reference. */
TQ_INLINE void block_ints(int t, const uint8_t *u, int b, int q[QK]) {
    const int h = b / 4, r = b % 4;
    switch (t) {
        case TQ_Q8_0:
            for (int l = 0; l < QK; l++) q[l] = ((const int8_t *)(u + 2))[l];
            return;
        case TQ_Q4_0: case TQ_Q4_1: case TQ_Q5_0: case TQ_Q5_1: {
            const int five = t == TQ_Q5_0 || t == TQ_Q5_1;
            const uint8_t *qs = u + (t == TQ_Q4_0 ? 2 : t == TQ_Q4_1 ? 4 : t == TQ_Q5_0 ? 6 : 8);
            uint32_t qh = 0;
            if (five) memcpy(&qh, qs - 4, 4);
            const int bias = t == TQ_Q4_0 ? 8 : t == TQ_Q5_0 ? 16 : 0; /* the types without a minimum */
            for (int l = 0; l < 16; l++) {
                q[l] = ((qs[l] & 15) | (int)((qh >> l) & 1) << 4) - bias;
                q[l + 16] = ((qs[l] >> 4) | (int)((qh >> (l + 16)) & 1) << 4) - bias;
            }
            return;
        }
        case TQ_Q2_K:
            for (int l = 0; l < QK; l++) q[l] = (u[16 + 32 * h + l] >> (2 * r)) & 3;
            return;
        case TQ_Q3_K:
            for (int l = 0; l < QK; l++) q[l] = ((u[32 + 32 * h + l] >> (2 * r)) & 3) - ((u[l] >> b) & 1 ? 0 : 4);
            return;
        case TQ_Q4_K: case TQ_Q5_K: {
            const uint8_t *qs = u + (t == TQ_Q4_K ? 16 : 48) + 32 * (b / 2);
            for (int l = 0; l < QK; l++) {
                q[l] = (qs[l] >> (4 * (b % 2))) & 15;
                if (t == TQ_Q5_K) q[l] |= ((u[16 + l] >> b) & 1) << 4;
            }
            return;
        }
        default: /* Q6_K */
            for (int l = 0; l < QK; l++) {
                const int lo = (u[64 * h + 32 * (r % 2) + l] >> (4 * (r / 2))) & 15, hi = (u[128 + 32 * h + l] >> (2 * r)) & 3;
                q[l] = (lo | (hi << 4)) - 32;
            }
            return;
    }
}

#ifdef TQ_AVX2
/* 32 bytes, 0xff where bit i of `bits` is set */
TQ_INLINE __m256i bits_to_bytes(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* 32 bytes, 0xff where bit b of byte l is set */
TQ_INLINE __m256i bit_of_bytes(const uint8_t *p, int b) {
    const __m256i bit = _mm256_set1_epi8((char)(1 << b));
    return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), bit), bit);
}

/* (p[l] >> shift) & mask for 32 bytes */
TQ_INLINE __m256i bits_at(const uint8_t *p, int shift, int mask) {
    const __m256i v = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)p), _mm_cvtsi32_si128(shift));
    return _mm256_and_si256(v, _mm256_set1_epi8((char)mask));
}

TQ_INLINE void widen(__m256i q, int is_signed, __m256i w[2]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = is_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
    w[1] = is_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
}

TQ_INLINE int k_signed(int t) { return t == TQ_Q3_K || t == TQ_Q6_K; } /* block_ints signed (else 0 .. 31) */

/* block_ints of a K-quant block as 32 bytes (int8 where k_signed, else uint8), byte l = element l */
TQ_INLINE __m256i kblock_bytes(int t, const uint8_t *u, int b) {
    const int h = b / 4, r = b % 4;
    switch (t) {
        case TQ_Q2_K:
            return bits_at(u + 16 + 32 * h, 2 * r, 3);
        case TQ_Q3_K: {
            const __m256i hi = _mm256_and_si256(bit_of_bytes(u, b), _mm256_set1_epi8(4));
            return _mm256_sub_epi8(_mm256_or_si256(bits_at(u + 32 + 32 * h, 2 * r, 3), hi), _mm256_set1_epi8(4));
        }
        case TQ_Q4_K: case TQ_Q5_K: {
            __m256i q = bits_at(u + (t == TQ_Q4_K ? 16 : 48) + 32 * (b / 2), 4 * (b % 2), 15);
            if (t == TQ_Q5_K) q = _mm256_or_si256(q, _mm256_and_si256(bit_of_bytes(u + 16, b), _mm256_set1_epi8(16)));
            return q;
        }
        default: { /* Q6_K */
            const __m256i lo = bits_at(u + 64 * h + 32 * (r % 2), 4 * (r / 2), 15);
            const __m256i hi = _mm256_slli_epi16(bits_at(u + 128 + 32 * h, 2 * r, 3), 4);
            return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        }
    }
}

/* Q4_K / Q5_K: unit_scales' d[0..8) and m[0..8) (the same values) in two vectors, k4_scales_mins
 * done in lanes: dword j of v is k4_scales_mins' v[j]. */
TQ_INLINE void k4_scale_vectors(const uint8_t *u, __m256 *d, __m256 *m) {
    uint32_t a[3];
    memcpy(a, u + 4, 12);
    const __m128i raw = _mm_setr_epi32((int)a[0], (int)a[1], (int)a[2], 0);
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(raw, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(raw, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                     _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i v = _mm_or_si128(lo, hi);
    *d = _mm256_mul_ps(_mm256_set1_ps(half_to_float(u)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *m = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(u + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

/* block_ints, widened to 16 bits: w[0] = elements 0..15, w[1] = 16..31. */
TQ_INLINE void block_weights(int t, const uint8_t *u, int b, __m256i w[2]) {
    switch (t) {
        case TQ_Q8_0:
            w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u + 2)));
            w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u + 18)));
            return;
        case TQ_Q4_0: case TQ_Q4_1: {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(u + (t == TQ_Q4_0 ? 2 : 4)));
            const __m128i mask = _mm_set1_epi8(15), lo = _mm_and_si128(raw, mask);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            if (t == TQ_Q4_0) { /* q - 8, signed */
                const __m128i eight = _mm_set1_epi8(8);
                w[0] = _mm256_cvtepi8_epi16(_mm_sub_epi8(lo, eight));
                w[1] = _mm256_cvtepi8_epi16(_mm_sub_epi8(hi, eight));
            } else {
                w[0] = _mm256_cvtepu8_epi16(lo);
                w[1] = _mm256_cvtepu8_epi16(hi);
            }
            return;
        }
        case TQ_Q5_0: case TQ_Q5_1: {
            const uint8_t *qs = u + (t == TQ_Q5_0 ? 6 : 8);
            const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
            uint32_t qh;
            memcpy(&qh, qs - 4, 4);
            const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
            const __m256i set = bits_to_bytes(qh), sixteen = _mm256_set1_epi8(16);
            if (t == TQ_Q5_0) /* q - 16 = low nibble - 16 where bit 4 is clear, signed */
                widen(_mm256_sub_epi8(q, _mm256_andnot_si256(set, sixteen)), 1, w);
            else
                widen(_mm256_or_si256(q, _mm256_and_si256(set, sixteen)), 0, w);
            return;
        }
        default: /* the K-quants */
            widen(kblock_bytes(t, u, b), k_signed(t), w);
            return;
    }
}

#if defined(__AVX512BW__)
/* block_ints of a K-quant block in one vector: 32 16-bit integers (element l in word l) */
TQ_INLINE __m512i kblock_words(int t, const uint8_t *u, int b) {
    const __m256i q = kblock_bytes(t, u, b);
    return k_signed(t) ? _mm512_cvtepi8_epi16(q) : _mm512_cvtepu8_epi16(q);
}
#endif
#endif

#endif
