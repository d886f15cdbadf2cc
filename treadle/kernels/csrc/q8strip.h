/* Strips of 16 weight rows unpacked for the AVX-512 builds' batched 8-bit path (q8batch.c's vpdpbusd
 * tiles), in a header so that q8amx.c's tiles can read the same panels (the K-quants' AMX tiles take
 * them as B tiles). A panel is one sblock per block of 32 inputs:
 *
 *   q[s] (s < 8): lane j = weight row j's 4 bytes at k = 4s .. 4s+3 (unsigned q; Q8_0: byte + 128;
 *                 Q6_K: q + 32, or q itself, signed, where asked) -- 512 bytes in AMX's B layout
 *                 (8 rows of 64 bytes: row s = k 4s .. 4s+3 of the 16 weight rows)
 *   d[16], m[16] (Q6_K: sc[16], the halves' int8 scales sc0 | sc1 << 16)
 *
 * Every function makes q8panel.h's unpack_kgroup / unpack_group values for 16 rows at a time; a lone
 * last group of 8 rows leaves lanes 8..15 zero. */
#ifndef TQ_Q8STRIP_H
#define TQ_Q8STRIP_H

#include <string.h>

#include "qblocks.h"

#define SGR 16 /* weight rows per strip */

#ifdef TQ_ZMM
typedef struct { /* one block of a strip, unpacked */
    __m512i q[8];
    float d[SGR];
    union {
        float m[SGR];
        int32_t sc[SGR]; /* Q6_K: the halves' int8 scales, sc0 | sc1 << 16 (q8act.c's gblock) */
    };
} sblock;


/* 8 halves at p and 8 at p1 (NULL: zeros) -> 16 floats */
static inline __m512 halves16(const uint8_t *p, const uint8_t *p1) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)p);
    const __m128i hi = p1 ? _mm_loadu_si128((const __m128i *)p1) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_set_m128i(hi, lo));
}

/* Packed Q5_0 / Q5_1 groups' fifth bits for step s, half h (fifth_mask): group g's (block p) in
 * bytes 0..31, group g + 1's (p1, NULL for a lone group) in 32..63 */
static inline __mmask64 fifth_bits(int t, const uint8_t *p, const uint8_t *p1, int s, int h) {
    return (__mmask64)fifth_mask(t, p, s, h) | (__mmask64)(p1 ? fifth_mask(t, p1, s, h) : 0) << 32;
}

/* packed Q4 / Q5 groups' 16 minimum terms: stored (Q4_1 / Q5_1), or -q_bias d (dv: their d) */
static inline __m512 packed_mins16(int t, const uint8_t *p, const uint8_t *p1, __m512 dv) {
    return stores_min(t) ? halves16(p + 2 * GR, p1 ? p1 + 2 * GR : NULL) : _mm512_mul_ps(dv, _mm512_set1_ps(-(float)q_bias(t)));
}

/* The 32 bytes at off of the packed groups' blocks at p (lanes 0..7) and p1 (8..15; NULL: zeros) */
static inline __m512i packed_bytes16(const uint8_t *p, const uint8_t *p1, int off) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(p + off));
    const __m256i hi = p1 ? _mm256_loadu_si256((const __m256i *)(p1 + off)) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Step s of packed Q4 / Q5 groups' blocks at p, p1: the low nibbles (k = 4s..) in *lo, the high
 * ones (k = 16 + 4s..) in *hi, unsigned bytes, Q5's fifth bits added from the step's masks */
static inline __attribute__((always_inline)) void packed_nibbles16(int t, const uint8_t *p, const uint8_t *p1, int s,
                                                                   __m512i *lo, __m512i *hi) {
    const __m512i mask = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const __m512i v = packed_bytes16(p, p1, step_offset(t) + 32 * s);
    *lo = _mm512_and_si512(v, mask);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    if (packed_five(t)) {
        *lo = _mm512_mask_add_epi8(*lo, fifth_bits(t, p, p1, s, 0), *lo, sixteen);
        *hi = _mm512_mask_add_epi8(*hi, fifth_bits(t, p, p1, s, 1), *hi, sixteen);
    }
}

/* Packed Q4 / Q5 groups g (rows at w) and g + 1 (at w1, NULL for a lone group), every block. */
static inline void unpack_packed(int t, const uint8_t *w, const uint8_t *w1, int64_t nb, sblock *panel) {
    const int ub = unit_bytes(t);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 8 * ub, *p1 = w1 ? w1 + b * 8 * ub : NULL;
        sblock *g = panel + b;
        const __m512 dv = halves16(p, p1);
        _mm512_store_ps(g->d, dv);
        _mm512_store_ps(g->m, packed_mins16(t, p, p1, dv));
        for (int s = 0; s < 4; s++) packed_nibbles16(t, p, p1, s, g->q + s, g->q + s + 4);
    }
}

/* Q8_0 rows (nrows 16, or 8 for a lone group: rows 8..15 zero; rbytes apart), every block: bytes
 * + 128. Rows j and j + 8 share a register (halves), and an 8 x 8 dword transpose in each half
 * (the AVX2 one, its 128-bit lane moves as 2-source permutes) puts step s in vector s. */
static inline void unpack_q8_0(const uint8_t *w, int64_t rbytes, int nrows, int64_t nb, sblock *panel) {
    const int ub = unit_bytes(TQ_Q8_0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lanes_lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), lanes_hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)rbytes));
    for (int64_t b = 0; b < nb; b++) {
        sblock *g = panel + b;
        if (nrows == SGR && rbytes <= INT32_MAX / SGR) { /* the 16 rows' d, one gather (4 bytes each: d and the first q byte) */
            const __m512i h = _mm512_i32gather_epi32(rows, (const void *)(w + b * ub), 1);
            _mm512_store_ps(g->d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
        } else {
            uint16_t h[SGR] = {0};
            for (int j = 0; j < nrows; j++) memcpy(h + j, w + j * rbytes + b * ub, 2);
            _mm512_store_ps(g->d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)));
        }
        _mm512_store_ps(g->m, _mm512_setzero_ps());
        __m512i r[8], u[8];
        for (int j = 0; j < 8; j++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + j * rbytes + b * ub + 2));
            const __m256i hi = nrows == SGR ? _mm256_loadu_si256((const __m256i *)(w + (j + 8) * rbytes + b * ub + 2))
                                            : _mm256_setzero_si256();
            r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        for (int j = 0; j < 8; j += 4) { /* 4 rows: dwords s, s + 4 of rows j .. j+3 in each 128-bit lane */
            const __m512i t0 = _mm512_unpacklo_epi32(r[j], r[j + 1]), t1 = _mm512_unpackhi_epi32(r[j], r[j + 1]);
            const __m512i t2 = _mm512_unpacklo_epi32(r[j + 2], r[j + 3]), t3 = _mm512_unpackhi_epi32(r[j + 2], r[j + 3]);
            u[j] = _mm512_unpacklo_epi64(t0, t2), u[j + 1] = _mm512_unpackhi_epi64(t0, t2);
            u[j + 2] = _mm512_unpacklo_epi64(t1, t3), u[j + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
        for (int s = 0; s < 4; s++) {
            g->q[s] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[s], lanes_lo, u[s + 4]), flip);
            g->q[s + 4] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[s], lanes_hi, u[s + 4]), flip);
        }
    }
}

/* 8 registers of two rows' 8 dwords each (row j low, row j + 8 high) -> out[s] = dword s of the 16
 * rows, lane j = row j: unpack_q8_0's transpose. */
static inline __attribute__((always_inline)) void transpose16(const __m512i r[8], __m512i out[8]) {
    const __m512i lanes_lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), lanes_hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    __m512i u[8];
    for (int j = 0; j < 8; j += 4) {
        const __m512i t0 = _mm512_unpacklo_epi32(r[j], r[j + 1]), t1 = _mm512_unpackhi_epi32(r[j], r[j + 1]);
        const __m512i t2 = _mm512_unpacklo_epi32(r[j + 2], r[j + 3]), t3 = _mm512_unpackhi_epi32(r[j + 2], r[j + 3]);
        u[j] = _mm512_unpacklo_epi64(t0, t2), u[j + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[j + 2] = _mm512_unpacklo_epi64(t1, t3), u[j + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int s = 0; s < 4; s++) {
        out[s] = _mm512_permutex2var_epi64(u[s], lanes_lo, u[s + 4]);
        out[s + 4] = _mm512_permutex2var_epi64(u[s], lanes_hi, u[s + 4]);
    }
}

/* 32 bytes at p + off of rows j and j + 8 (zero when lone) in one register */
static inline __m512i two_rows(const uint8_t *w, int64_t rbytes, int j, int64_t off, int lone) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + j * rbytes + off));
    const __m256i hi = lone ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(w + (j + 8) * rbytes + off));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Packed K-quant rows (q8pack.c tq_q8_pack): dword c of the two groups' super-block at p (rows 0..7)
 * and p + 8 rbytes (rows 8..15, zero when lone) in one register, lane j = row j. */
static inline __m512i packed_dwords(const uint8_t *p, int64_t rbytes, int c, int lone) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 32 * c));
    const __m256i hi = lone ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(p + 8 * rbytes + 32 * c));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Q4_K / Q5_K strips (16 rows, or 8 when lone: rows 8..15 zero) straight into 16-lane blocks, the
 * same values as q8panel.h's unpack_kgroup (d sc_b, -dmin mn_b exact; the same q bytes) with half
 * the shuffles: the 16 rows' scale bytes decoded in lanes, each 32-byte qs run of 16 rows
 * transposed once (packed Q4_K: loaded, no transposes). */
static inline void unpack_k4_strip(int t, const uint8_t *w, int64_t rbytes, int lone, int64_t nb, sblock *panel) {
    const int pk = packed_k(t), ub = unit_bytes(t), qoff = base_type(t) == TQ_Q4_K ? 16 : 48;
    const __m512i mask = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16), ff = _mm512_set1_epi32(0xff);
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4 = _mm512_set1_epi32(0x0f0f0f0f), m2 = _mm512_set1_epi32(0x30303030);
    const uint8_t *next = w + SGR * rbytes;
    for (int64_t su = 0; su < nb / 8; su++) {
        const uint8_t *u = w + su * ub;
        sblock *g = panel + 8 * su;
        for (int64_t off = su * SGR * ub; off < (su + 1) * SGR * ub; off += 64) __builtin_prefetch(next + off);
        const uint8_t *pw = w + su * 8 * ub; /* packed: the first group's super-block */
        __m512i dd, a0, a1, a2;
        if (pk) {
            dd = packed_dwords(pw, rbytes, 0, lone), a0 = packed_dwords(pw, rbytes, 1, lone);
            a1 = packed_dwords(pw, rbytes, 2, lone), a2 = packed_dwords(pw, rbytes, 3, lone);
        } else { /* h[i]: 128-bit lane L = row i + 4 L's first 16 bytes; a 4 x 4 dword transpose per lane -> lane j = row j */
            __m512i h[4];
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(u + i * rbytes)));
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(u + (i + 4) * rbytes)), 1);
                if (!lone) {
                    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(u + (i + 8) * rbytes)), 2);
                    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(u + (i + 12) * rbytes)), 3);
                } else {
                    v = _mm512_maskz_mov_epi64(0x0f, v);
                }
                h[i] = v;
            }
            const __m512i t0 = _mm512_unpacklo_epi32(h[0], h[1]), t1 = _mm512_unpackhi_epi32(h[0], h[1]);
            const __m512i t2 = _mm512_unpacklo_epi32(h[2], h[3]), t3 = _mm512_unpackhi_epi32(h[2], h[3]);
            dd = _mm512_unpacklo_epi64(t0, t2), a0 = _mm512_unpackhi_epi64(t0, t2);
            a1 = _mm512_unpacklo_epi64(t1, t3), a2 = _mm512_unpackhi_epi64(t1, t3);
        }
        const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
        const __m512 nmv = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)))),
                                                                _mm512_set1_epi32((int)0x80000000u)));
        const __m512i v[4] = {_mm512_and_si512(a0, m6),
                              _mm512_or_si512(_mm512_and_si512(a2, m4), _mm512_and_si512(_mm512_srli_epi32(a0, 2), m2)),
                              _mm512_and_si512(a1, m6),
                              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a2, 4), m4), _mm512_and_si512(_mm512_srli_epi32(a1, 2), m2))};
        for (int b = 0; b < 8; b++) {
            const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(v[b / 4], 8 * (b % 4)), ff);
            const __m512i mn = _mm512_and_si512(_mm512_srli_epi32(v[2 + b / 4], 8 * (b % 4)), ff);
            _mm512_store_ps(g[b].d, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sc)));
            _mm512_store_ps(g[b].m, _mm512_mul_ps(nmv, _mm512_cvtepi32_ps(mn)));
        }
        __m512i r[8], tr[8], qh[8];
        if (t == TQ_Q5_K) {
            for (int j = 0; j < 8; j++) r[j] = two_rows(u, rbytes, j, 16, lone);
            transpose16(r, qh);
        }
        for (int p = 0; p < 4; p++) { /* qs run p: low nibbles block 2p, high block 2p + 1 */
            if (pk) {
                for (int s = 0; s < 8; s++) tr[s] = packed_dwords(pw, rbytes, 4 + 8 * p + s, lone);
            } else {
                for (int j = 0; j < 8; j++) r[j] = two_rows(u, rbytes, j, qoff + 32 * p, lone);
                transpose16(r, tr);
            }
            for (int s = 0; s < 8; s++) {
                __m512i lo = _mm512_and_si512(tr[s], mask), hn = _mm512_and_si512(_mm512_srli_epi16(tr[s], 4), mask);
                if (t == TQ_Q5_K) {
                    const __m512i b0 = _mm512_set1_epi8((char)(1 << (2 * p))), b1 = _mm512_set1_epi8((char)(2 << (2 * p)));
                    lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh[s], b0), sixteen));
                    hn = _mm512_or_si512(hn, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh[s], b1), sixteen));
                }
                _mm512_store_si512(g[2 * p].q + s, lo);
                _mm512_store_si512(g[2 * p + 1].q + s, hn);
            }
        }
    }
}

/* Q6_K strips likewise: unpack_kgroup's values (q + 32, the super-block's d, the halves' scales
 * sc0 | sc1 << 16) for 16 rows at a time, each 32-byte ql / qh run transposed once. is_signed: q
 * itself (q + 32 - 32, int8 -32..31; q8amx.c's tdpbssd) in place of q + 32. */
static inline void unpack_q6k_strip(int t, const uint8_t *w, int64_t rbytes, int lone, int64_t nb, sblock *panel,
                                    int is_signed) {
    const int pk = packed_k(t), ub = unit_bytes(TQ_Q6_K);
    const __m512i mask = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    const __m512i bias = _mm512_set1_epi8(is_signed ? 32 : 0);
    const uint8_t *next = w + SGR * rbytes;
    for (int64_t su = 0; su < nb / 8; su++) {
        const uint8_t *u = w + su * ub;
        sblock *g = panel + 8 * su;
        for (int64_t off = su * SGR * ub; off < (su + 1) * SGR * ub; off += 64) __builtin_prefetch(next + off);
        const uint8_t *pw = w + su * 8 * ub; /* packed: the first group's super-block */
        uint16_t hd[SGR] = {0};
        __m512i r[8], tr[8], qh[2][8];
        if (pk) { /* scale dword i, lane j = row j's int8 scales 4i .. 4i+3 -> blocks 2i, 2i + 1's pairs */
            memcpy(hd, pw + 32 * kwords(TQ_Q6_K), 16);
            if (!lone) memcpy(hd + 8, pw + 8 * rbytes + 32 * kwords(TQ_Q6_K), 16);
            for (int i = 0; i < 4; i++) {
                const __m512i v = packed_dwords(pw, rbytes, 48 + i, lone);
                for (int hi = 0; hi < 2; hi++) {
                    const __m512i s0 = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 16 * hi), 24);
                    const __m512i s1 = _mm512_srai_epi32(_mm512_slli_epi32(v, 16 - 16 * hi), 24);
                    tr[2 * i + hi] = _mm512_or_si512(_mm512_and_si512(s0, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(s1, 16));
                }
            }
        } else {
            for (int j = 0; j < 8; j++) { /* dword b of row j: its scales 2b, 2b + 1 as int16 */
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u + j * rbytes + 192)));
                const __m256i hi = lone ? _mm256_setzero_si256()
                                        : _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u + (j + 8) * rbytes + 192)));
                r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            }
            for (int j = 0; j < (lone ? 8 : SGR); j++) memcpy(hd + j, u + j * rbytes + 208, 2);
            transpose16(r, tr);
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd));
        for (int b = 0; b < 8; b++) {
            _mm512_store_ps(g[b].d, dv);
            _mm512_store_si512(g[b].sc, tr[b]);
        }
        for (int h = 0; h < 2; h++) {
            if (pk) {
                for (int s = 0; s < 8; s++) qh[h][s] = packed_dwords(pw, rbytes, 32 + 8 * h + s, lone);
            } else {
                for (int j = 0; j < 8; j++) r[j] = two_rows(u, rbytes, j, 128 + 32 * h, lone);
                transpose16(r, qh[h]);
            }
        }
        for (int c = 0; c < 4; c++) { /* ql run c: low nibbles block 4h + c % 2, high block 4h + 2 + c % 2 */
            const int h = c / 2, b0 = 4 * h + c % 2, r0 = c % 2;
            if (pk) {
                for (int s = 0; s < 8; s++) tr[s] = packed_dwords(pw, rbytes, 8 * c + s, lone);
            } else {
                for (int j = 0; j < 8; j++) r[j] = two_rows(u, rbytes, j, 32 * c, lone);
                transpose16(r, tr);
            }
            for (int s = 0; s < 8; s++) {
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(qh[h][s], 2 * r0), three);
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(qh[h][s], 2 * r0 + 4), three);
                const __m512i lo = _mm512_and_si512(tr[s], mask), hn = _mm512_and_si512(_mm512_srli_epi16(tr[s], 4), mask);
                _mm512_store_si512(g[b0].q + s, _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi0, 4)), bias));
                _mm512_store_si512(g[b0 + 2].q + s, _mm512_sub_epi8(_mm512_or_si512(hn, _mm512_slli_epi16(hi1, 4)), bias));
            }
        }
    }
}
#endif

#endif
