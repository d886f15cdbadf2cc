/* q8act.c's 256-bit lane helpers (the AVX2 / AVX-VNNI builds, and the AVX-512 builds' 256-bit
 * paths): the exact 4-byte dot steps, the 8-row transpose, K-quant scales decoded in lanes (lane
 * j = weight row j). Included once, by q8act.c. */
#ifndef TQ_Q8LANES_H
#define TQ_Q8LANES_H

#include "qblocks.h"

#ifdef TQ_AVX2
/* Exact sums of 4 byte products (u unsigned, s signed) per int32 lane. AVX2: maddubs gives int16
 * pair sums (never saturating here: the bounds above), added up in int16 (step16) and widened
 * once (widen16), or widened per step (step32). VNNI builds (AVX-512 VNNI's 256-bit form, or
 * AVX-VNNI): vpdpbusd adds the 4 products straight into int32, so widening is nothing. The
 * integers, and so every output, are the same in every build. */
#if defined(TQ_VNNI) || defined(__AVXVNNI__)
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#ifdef TQ_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
static inline __m256i step16(__m256i p, __m256i u, __m256i s) { return dpbusd(p, u, s); }
static inline __m256i widen16(__m256i p) { return p; }
static inline __m256i join16(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
static inline __m256i step32(__m256i p, __m256i u, __m256i s) { return dpbusd(p, u, s); }
#else
static inline __m256i step16(__m256i p, __m256i u, __m256i s) { return _mm256_add_epi16(p, _mm256_maddubs_epi16(u, s)); }
static inline __m256i join16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
static inline __m256i widen16(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
static inline __m256i step32(__m256i p, __m256i u, __m256i s) { return _mm256_add_epi32(p, widen16(_mm256_maddubs_epi16(u, s))); }
#endif

/* d of block b of 8 Q8_0 rows, one conversion */
static inline __m256 q8_0_scales(const uint8_t *w, int64_t rbytes, int64_t b) {
    uint16_t h[GR];
    for (int j = 0; j < GR; j++) memcpy(h + j, w + j * rbytes + b * unit_bytes(TQ_Q8_0), 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* 8 rows of 8 dwords -> 8 vectors, vector s = dword s of every row (lane j = row j) */
static inline __attribute__((always_inline)) void transpose8(const __m256i r[GR], __m256i out[GR]) {
    __m256i u[GR];
    for (int j = 0; j < GR; j += 4) { /* 4 rows: dwords s, s + 4 of rows j .. j+3 in each half */
        const __m256i t0 = _mm256_unpacklo_epi32(r[j], r[j + 1]), t1 = _mm256_unpackhi_epi32(r[j], r[j + 1]);
        const __m256i t2 = _mm256_unpacklo_epi32(r[j + 2], r[j + 3]), t3 = _mm256_unpackhi_epi32(r[j + 2], r[j + 3]);
        u[j] = _mm256_unpacklo_epi64(t0, t2), u[j + 1] = _mm256_unpackhi_epi64(t0, t2);
        u[j + 2] = _mm256_unpacklo_epi64(t1, t3), u[j + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int s = 0; s < 4; s++) {
        out[s] = _mm256_permute2x128_si256(u[s], u[s + 4], 0x20);
        out[s + 4] = _mm256_permute2x128_si256(u[s], u[s + 4], 0x31);
    }
}
#endif

#ifdef TQ_AVX2
/* Q4_K / Q5_K scales of 8 rows in lanes (lane j = row j): a[0] = d | dmin, a[1..3] = the 12 scale
 * bytes, decoded to block b's d sc_b (k4_d) and -dmin mn_b (k4_m), k4_scale_vectors' values. */
typedef struct {
    __m256 dv, nmv;
    __m256i v[4]; /* byte b % 4 of v[b / 4]: sc_b; of v[2 + b / 4]: mn_b */
} k4_lanes;

static inline __attribute__((always_inline)) k4_lanes k4_decode(const __m256i a[4]) {
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(a[0], _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                                   8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
        0xd8); /* d0..d7 | dmin0..dmin7 */
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x30303030);
    const k4_lanes k = {
        _mm256_cvtph_ps(_mm256_castsi256_si128(halves)),
        _mm256_xor_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), _mm256_set1_ps(-0.0f)),
        {_mm256_and_si256(a[1], m6),
         _mm256_or_si256(_mm256_and_si256(a[3], m4), _mm256_and_si256(_mm256_srli_epi32(a[1], 2), m2)),
         _mm256_and_si256(a[2], m6),
         _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a[3], 4), m4), _mm256_and_si256(_mm256_srli_epi32(a[2], 2), m2))}};
    return k;
}
static inline __attribute__((always_inline)) __m256 k4_d(const k4_lanes k, int b) {
    return _mm256_mul_ps(k.dv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(k.v[b / 4], 8 * (b % 4)), _mm256_set1_epi32(0xff))));
}
static inline __attribute__((always_inline)) __m256 k4_m(const k4_lanes k, int b) {
    return _mm256_mul_ps(k.nmv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(k.v[2 + b / 4], 8 * (b % 4)), _mm256_set1_epi32(0xff))));
}

/* Packed Q6_K scale dword vector v (lane j = row j's int8 scales 4i .. 4i+3) -> block 2i + hi's two
 * half scales, sign-extended in int32 lanes (q6_scales), or as the panel's pair sc0 | sc1 << 16
 * (q6_scale_pair: unpack_kgroup's transposed cvtepi8_epi16 values). */
static inline __attribute__((always_inline)) void q6_scales(__m256i v, int hi, __m256i *sc0, __m256i *sc1) {
    *sc0 = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 16 * hi), 24);
    *sc1 = _mm256_srai_epi32(_mm256_slli_epi32(v, 16 - 16 * hi), 24);
}
static inline __attribute__((always_inline)) __m256i q6_scale_pair(__m256i v, int hi) {
    __m256i sc0, sc1;
    q6_scales(v, hi, &sc0, &sc1);
    return _mm256_or_si256(_mm256_and_si256(sc0, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(sc1, 16));
}

/* Q6_K's exact block integers of 8 weight rows in lanes (q6_fold's): the halves' dots of q + 32
 * and x, the int8 half scales, the activation block's two half sums xh. */
static inline __attribute__((always_inline)) __m256i q6_fold_lanes(__m256i dot0, __m256i dot1, __m256i sc0, __m256i sc1,
                                                                   const int32_t *xh) {
    const __m256i e0 = _mm256_sub_epi32(dot0, _mm256_set1_epi32(32 * xh[0]));
    const __m256i e1 = _mm256_sub_epi32(dot1, _mm256_set1_epi32(32 * xh[1]));
    return _mm256_add_epi32(_mm256_mullo_epi32(e0, sc0), _mm256_mullo_epi32(e1, sc1));
}
#endif

#endif
