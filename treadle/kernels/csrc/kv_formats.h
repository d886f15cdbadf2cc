/* The KV cache's stored formats other than float32 (paged_attention.c's tq_paged_decode writes and
 * reads them): float8 e4m3fn and int8 rows with a float32 scale after them (layers/attention/
 * kv_quant.py's arithmetic), and bfloat16 rows written rounded to nearest even. Included once, by
 * paged_attention.c. */
#ifndef TQ_KV_FORMATS_H
#define TQ_KV_FORMATS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "tq.h"

/* float -> float8 e4m3fn bits, round half to even, for |x| <= 448 (the caller clamps). */
static uint8_t fp8_e4m3_encode(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(x);
    if (a < 0.015625f) /* below 2^-6: subnormal steps of 2^-9 (a result of 8 is the smallest normal) */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    memcpy(&u, &a, sizeof u);
    uint32_t code = ((((u >> 23) & 0xFF) - 127 + 7) << 3) | ((u >> 20) & 7);
    const uint32_t rest = u & 0xFFFFF, half = 0x80000;
    if (rest > half || (rest == half && (code & 1))) code++; /* a carry moves into the exponent */
    return sign | (uint8_t)code;
}

/* The 256 values of float8 e4m3fn (0x7F / 0xFF, NaN, never written: values are clamped). */
static void fp8_e4m3_table(float *lut) {
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        const float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        lut[c] = (c & 0x80) ? -mag : mag;
    }
}

/* One row of D floats -> D quantized bytes and the float32 scale after them (kv_quant.quantize). */
static void quantize_row(const float *x, uint8_t *dst, int64_t D, int kv_format) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float qmax = kv_format == TQ_KV_INT8 ? 127.0f : 448.0f, s = amax / qmax, div = s > 0.0f ? s : 1.0f;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / div;
        if (kv_format == TQ_KV_INT8) {
            y = nearbyintf(y);
            y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
            dst[d] = (uint8_t)(int8_t)y;
        } else {
            dst[d] = fp8_e4m3_encode(y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y));
        }
    }
    memcpy(dst + D, &s, sizeof s);
}

#ifdef TQ_AVX2
/* 8 bytes -> 8 floats: int8 values, or float8 e4m3fn built in the float32 bits (exponent e - 7 + 127,
 * the 3 mantissa bits on top; below exponent 1, m * 2^-9), the same values as fp8_e4m3_table. */
static inline __m256 load8_dequant(const uint8_t *p, int kv_format) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    if (kv_format == TQ_KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    const __m256i b = _mm256_cvtepu8_epi32(raw);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    const __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}
#endif

/* float -> bfloat16 bits, round to nearest even (finite x) */
static inline uint16_t bf16_encode(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n floats -> n bfloat16 (bf16_encode's bits: the same integer steps, 8 lanes at a time) */
static void bf16_encode_row(const float *x, uint16_t *out, int64_t n) {
    int64_t e = 0;
#ifdef TQ_AVX2
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    for (; e + 8 <= n; e += 8) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(x + e));
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
        /* r < 2^16 in every lane: pack unsigned without saturation, then the 64-bit halves in order */
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(out + e), _mm256_castsi256_si128(w));
    }
#endif
    for (; e < n; e++) out[e] = bf16_encode(x[e]);
}

/* n quantized rows (`stride` bytes apart) -> n * D floats (D apart), each value times its row's scale. */
static void dequantize_rows(const uint8_t *rows, int64_t stride, int64_t n, int64_t D, int kv_format,
                            const float *lut, float *out) {
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *r = rows + j * stride;
        float s;
        memcpy(&s, r + D, sizeof s);
        float *o = out + j * D;
        int64_t d = 0;
#if defined(TQ_AVX2) && defined(__AVX512F__)
        if (kv_format == TQ_KV_INT8) /* 16 at a time: the same products */
            for (const __m512 vs16 = _mm512_set1_ps(s); d + 16 <= D; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                          _mm_loadu_si128((const __m128i *)(r + d)))), vs16));
#endif
#ifdef TQ_AVX2
        const __m256 vs = _mm256_set1_ps(s);
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(load8_dequant(r + d, kv_format), vs));
#endif
        if (kv_format == TQ_KV_INT8) {
            const int8_t *qi = (const int8_t *)r;
            for (; d < D; d++) o[d] = (float)qi[d] * s;
        } else {
            for (; d < D; d++) o[d] = lut[r[d]] * s;
        }
    }
}

#endif
