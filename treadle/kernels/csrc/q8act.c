/* The 8-bit activation path of tq_matmul (qmatmul.c) for the legacy block types Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0: the layout's act_bits == 8 (tq.h). Q4_0, Q4_1 and Q8_0 take the group loop
 * at the end of this file; Q5_0 and Q5_1 the tile described here.
 *
 * Each activation row is quantized once per matmul to int8 per block of 32 (xd = max|x| / 127,
 * xq = round(x / xd)) with its block sum (xs = xd * sum(xq), the minimum term's factor). The
 * weights stay 8-bit: unsigned q for Q5 (nibble plus bit 4), so a block's 32 products need one
 * multiply-add of bytes (AVX2 vpmaddubsw, u8 x s8 -> pairs summed in int16: at most 31 * 127 * 2
 * < 32767, never saturating) and one of 16-bit pairs into int32 -- against two 16-bit
 * multiply-adds and an add per block on the 16-bit path, whose activation blocks are also twice
 * as large (the avx512-vnni build: one 256-bit vpdpbusd, the same integers in the same lanes).
 * Q5_0, which stores q - 16, is read as unsigned q with the minimum m = -16 d:
 *
 *   y[m, n] = sum_b  d_b xd_b (q_b . xq_b)  +  sum_b m_b xs_b  (+ bias)
 *
 * Summation order, fixed whatever the tile or the batch: for each (weight row, activation row),
 * 8 float lanes, lane k taking the integer sum of elements 4k .. 4k+3 of each block times
 * (d_b * xd_b), one fused multiply-add per block; then, in the same lanes, the minimum terms
 * m_b * xs_b, block b in lane b % 8 (zero-padded to a multiple of 8 blocks); the lanes summed as
 * tq.h's hsum does; then the bias. The plain-C build (TQ_PLAIN_C) computes
 * exactly these operations, so it and the SIMD builds agree bit for bit, and a row's result does
 * not depend on the batch it is in. Tiles: 2 weight rows x up to 4 activation rows share each
 * loaded weight block and activation block (8 accumulators); threads split the weight rows.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qblocks.h"

#define MR8 4 /* activation rows per pass over a pair of weight rows */
#define MAX_NB (TQ_Q8_MAX_K / QK) /* blocks of 32 per row the stack buffers hold */

int tq_q8_type(int t) { return t == TQ_Q4_0 || t == TQ_Q4_1 || t == TQ_Q5_0 || t == TQ_Q5_1 || t == TQ_Q8_0; }

static inline int64_t padded(int64_t nb) { return (nb + 7) / 8 * 8; }

tq_q8acts tq_q8_quantize(const float *x, int64_t M, int64_t K) {
    const int64_t nb = K / QK, nbp = padded(nb);
    float *f = (float *)calloc((size_t)(M * (nb + nbp)), sizeof(float));
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    const tq_q8acts a = {q, f, f + M * nb, nbp};
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t row = i / nb, b = i % nb;
        const float *xb = x + row * K + b * QK;
#ifdef TQ_AVX2 /* the same values as the loop below (tq.h) */
        __m256 xv[4];
        const float amax = block_absmax(xb, xv);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i v[4], vs = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            v[j] = round_clamp(xv[j], id, 127);
            vs = _mm256_add_epi32(vs, v[j]);
        }
        /* packs interleave the 128-bit halves: 0 1 | 2 3 -> dwords in order 0 2 4 6 1 3 5 7 */
        const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i * QK), _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const int sum = hsum_epi32(vs);
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[i * QK + j] = (int8_t)v;
            sum += v;
        }
#endif
        f[i] = d;
        f[M * nb + row * nbp + b] = d * (float)sum;
    }
    return a;
}

void tq_q8_free(tq_q8acts a) {
    free((void *)a.q);
    free((void *)a.d);
}

/* the sum of 8 lanes in tq.h hsum's order */
static inline float hsum8(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#ifdef TQ_AVX2
/* The 32 q of a Q5 block as unsigned bytes (no bias), in element order. */
static inline __attribute__((always_inline)) __m256i block_bytes(int t, const uint8_t *u) {
    const uint8_t *qs = u + (t == TQ_Q5_0 ? 6 : 8);
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    uint32_t qh;
    memcpy(&qh, qs - 4, 4);
    return _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16)));
}
#endif

/* A Q5 row unpacked once for all its activation rows: q[nb * 32] the blocks' q as unsigned
 * bytes (without the Q5_0 bias), d[nb] the scales, m[nbp] the minimums (-16 d for Q5_0; zero
 * past nb). */
static inline __attribute__((always_inline)) void unpack_row(int t, const uint8_t *row, int64_t nb, int64_t nbp,
                                                              uint8_t *q, float *d, float *m) {
    const int ub = unit_bytes(t);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *u = row + b * ub;
#ifdef TQ_AVX2
        _mm256_storeu_si256((__m256i *)(q + b * QK), block_bytes(t, u));
#else
        int v[QK];
        block_ints(t, u, 0, v);
        const int bias = t == TQ_Q5_0 ? 16 : 0;
        for (int j = 0; j < QK; j++) q[b * QK + j] = (uint8_t)(v[j] + bias);
#endif
        d[b] = half_to_float(u);
        m[b] = t == TQ_Q5_1 ? half_to_float(u + 2) : -16.0f * d[b];
    }
    for (int64_t b = nb; b < nbp; b++) m[b] = 0.0f;
}

/* NW (<= 2) weight rows x NX (<= MR8) activation rows: out[i * ostride + r]. q, d, m: the rows
 * unpacked (unpack_row; row r at r * K, r * nb, r * nbp). */
static inline __attribute__((always_inline)) void tile8(const uint8_t *q, int64_t nb, const float *d,
                                                         const float *m, tq_q8acts x, int64_t K, const int NW,
                                                         const int NX, const float *bias, float *out, int64_t ostride) {
#ifdef TQ_AVX2
#ifndef TQ_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[MR8][2];
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w[2];
        __m256 dw[2];
        for (int r = 0; r < NW; r++) {
            w[r] = _mm256_loadu_si256((const __m256i *)(q + r * K + b * QK));
            dw[r] = _mm256_broadcast_ss(d + r * nb + b);
        }
        for (int i = 0; i < NX; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x.q + i * K + b * QK));
            const __m256 vx = _mm256_broadcast_ss(x.d + i * nb + b);
            for (int r = 0; r < NW; r++) {
#ifdef TQ_VNNI /* vpdpbusd: the 4 products of each lane summed in one instruction, the same integers */
                const __m256 s = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w[r], xv));
#else
                const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xv), ones));
#endif
                acc[i][r] = _mm256_fmadd_ps(s, _mm256_mul_ps(dw[r], vx), acc[i][r]);
            }
        }
    }
#else
    float acc[MR8][2][8] = {{{0.0f}}};
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < NX; i++) {
            const int8_t *xq = x.q + i * K + b * QK;
            for (int r = 0; r < NW; r++) {
                const float sc = d[r * nb + b] * x.d[i * nb + b];
                for (int k = 0; k < 8; k++) {
                    int s = 0;
                    for (int j = 4 * k; j < 4 * k + 4; j++) s += q[r * K + b * QK + j] * xq[j];
                    acc[i][r][k] = fmaf((float)s, sc, acc[i][r][k]);
                }
            }
        }
    }
#endif
    for (int i = 0; i < NX; i++) /* then the minimum terms, block b in lane b % 8, then the lanes' sum */
        for (int r = 0; r < NW; r++) {
            const float *mr = m + r * x.nbp, *xs = x.s + i * x.nbp;
#ifdef TQ_AVX2
            for (int64_t b = 0; b < x.nbp; b += 8)
                acc[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(mr + b), _mm256_loadu_ps(xs + b), acc[i][r]);
            const float o = hsum(acc[i][r]);
#else
            for (int64_t b = 0; b < x.nbp; b++) acc[i][r][b % 8] = fmaf(mr[b], xs[b], acc[i][r][b % 8]);
            const float o = hsum8(acc[i][r]);
#endif
            out[i * ostride + r] = bias ? o + bias[r] : o;
        }
}

#define TILE8(NW, NX) tile8(q, nb, d, m, xm, K, NW, NX, bias, out, ldy)

/* Weight rows n, n + 1 (nw of them) times every activation row; t a constant after inlining. */
static inline __attribute__((always_inline)) void row_pair8(const int t, const uint8_t *row, tq_q8acts x, float *y,
                                                             int64_t ldy, const float *bias, int nw, int64_t M,
                                                             int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K);
    uint8_t q[2 * TQ_Q8_MAX_K];
    float d[2 * MAX_NB], m[2 * MAX_NB];
    for (int r = 0; r < nw; r++) unpack_row(t, row + r * rbytes, nb, x.nbp, q + r * K, d + r * nb, m + r * x.nbp);
    for (int64_t m0 = 0; m0 < M; m0 += MR8) {
        const tq_q8acts xm = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * x.nbp, x.nbp};
        float *out = y + m0 * ldy;
        const int nx = M - m0 < MR8 ? (int)(M - m0) : MR8;
        if (nw == 2) {
            switch (nx) {
                case 1: TILE8(2, 1); break;
                case 2: TILE8(2, 2); break;
                case 3: TILE8(2, 3); break;
                default: TILE8(2, MR8); break;
            }
        } else {
            switch (nx) {
                case 1: TILE8(1, 1); break;
                case 2: TILE8(1, 2); break;
                case 3: TILE8(1, 3); break;
                default: TILE8(1, MR8); break;
            }
        }
    }
}

/* ---- Q4_0, Q4_1, Q8_0: eight weight rows side by side (a "group"), one output row per vector lane ----
 *
 * These types carry most of a GGUF model's multiply-adds (SmolLM2: Q4_1 layers, Q8_0 lm_head), so
 * they get their own loop, in which a vector's 8 int32 lanes are 8 weight rows (columns of y)
 * rather than 8 pieces of one dot product:
 *
 *   panel step s of block b (s < 8): lane j = the 4 q of weight row j at k = 4s .. 4s+3 (bytes)
 *   xb = x row's 4 bytes at k = 4s .. 4s+3, broadcast to every lane
 *   Q4: p16 += maddubs(step, xb)  over the 8 steps (u4 x s8 pairs: at most 8 * 2 * 15 * 127 < 32767),
 *       isum = madd(p16, ones)    one 16 -> 32-bit widening per block of 8 rows
 *   Q8_0: isum += madd(maddubs(|step|, xb with step's sign), ones)   per step (pairs up to 2 * 128 * 127)
 *
 * isum is each row's exact integer block dot, with no horizontal sums at all (the 2 x 4 tile above
 * widens every block of every pair and sums lanes at the end). A group's weights are unpacked
 * (transposed) once per group and call into a per-thread panel that every tile of 4 activation rows
 * reads; the next group's bytes are prefetched meanwhile. Each output then takes, per block in order,
 *
 *   acc = fma(float(isum), d_w * xd, acc);   acc = fma(m_w, xs, acc)   (Q4_0: q unsigned, m = -8 d; Q8_0: none)
 *
 * and y = acc (+ bias). The plain-C build computes exactly these operations, and rows of N past the
 * last whole group (N % 8) take a plain-C loop in the SIMD builds too, so every output has one
 * value whatever the build, tile, thread or batch. At batch 1, Q8_0 (the lm_head) skips the panel:
 * q8_0_direct takes each row's block dot along k and reduces 8 rows' partial sums to the same
 * exact integers (1.25x the panel there). (The avx512-vnni build runs this loop as AVX2:
 * vpdpbusd would fold maddubs and madd, but nothing here can measure it.) */
#define GR 8 /* weight rows per group */
#define MRG 4 /* activation rows per pass over a group's panel */

typedef struct { /* one block of a group, unpacked */
    uint8_t q[8 * 32]; /* step s at 32 s: lane j's 4 bytes at 4 j */
    float d[GR], m[GR];
} gblock;

static inline int group_type(int t) { return t == TQ_Q4_0 || t == TQ_Q4_1 || t == TQ_Q8_0; }

/* The block's 16 nibble bytes of row r (byte i: q[i] low, q[i + 16] high), its d and m. */
static inline const uint8_t *nibbles(int t, const uint8_t *u) { return u + (t == TQ_Q4_0 ? 2 : 4); }
static inline float block_min(int t, const uint8_t *u) {
    return t == TQ_Q4_1 ? half_to_float(u + 2) : -8.0f * half_to_float(u);
}

/* Rows n0 .. n0 + 7 of w unpacked into panel[nb]. */
static void unpack_group(int t, const uint8_t *w, int64_t rbytes, int64_t nb, gblock *panel) {
    const int ub = unit_bytes(t);
    const uint8_t *next = w + GR * rbytes; /* the next group's rows, fetched while this one is unpacked */
    for (int64_t b = 0; b < nb; b++) {
        gblock *g = panel + b;
        for (int64_t off = b * GR * ub; off < (b + 1) * GR * ub; off += 64) __builtin_prefetch(next + off);
        if (t == TQ_Q8_0) { /* signed q, no minimum: the rows' 8 dwords transposed, d per row */
#ifdef TQ_AVX2
            uint16_t h[GR];
            __m256i r[GR], u[GR];
            for (int j = 0; j < GR; j++) {
                memcpy(h + j, w + j * rbytes + b * ub, 2);
                r[j] = _mm256_loadu_si256((const __m256i *)(w + j * rbytes + b * ub + 2));
            }
            _mm256_store_ps(g->d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
            for (int j = 0; j < GR; j += 4) { /* 4 rows: dwords s, s + 4 of rows j .. j+3 in each half */
                const __m256i t0 = _mm256_unpacklo_epi32(r[j], r[j + 1]), t1 = _mm256_unpackhi_epi32(r[j], r[j + 1]);
                const __m256i t2 = _mm256_unpacklo_epi32(r[j + 2], r[j + 3]);
                const __m256i t3 = _mm256_unpackhi_epi32(r[j + 2], r[j + 3]);
                u[j] = _mm256_unpacklo_epi64(t0, t2), u[j + 1] = _mm256_unpackhi_epi64(t0, t2);
                u[j + 2] = _mm256_unpacklo_epi64(t1, t3), u[j + 3] = _mm256_unpackhi_epi64(t1, t3);
            }
            for (int s = 0; s < 4; s++) {
                _mm256_store_si256((__m256i *)(g->q + 32 * s), _mm256_permute2x128_si256(u[s], u[s + 4], 0x20));
                _mm256_store_si256((__m256i *)(g->q + 32 * (s + 4)), _mm256_permute2x128_si256(u[s], u[s + 4], 0x31));
            }
#else
            for (int j = 0; j < GR; j++) {
                const uint8_t *u = w + j * rbytes + b * ub;
                g->d[j] = half_to_float(u);
                for (int k = 0; k < QK; k++) g->q[32 * (k / 4) + 4 * j + k % 4] = u[2 + k];
            }
#endif
            continue;
        }
#ifdef TQ_AVX2
        /* the rows' first 4 bytes (d, and m for Q4_1) -> d[8], m[8] through one half -> float conversion each */
        int32_t dm[GR];
        for (int j = 0; j < GR; j++) memcpy(dm + j, w + j * rbytes + b * ub, 4);
        const __m256i halves = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)dm),
                                _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9,
                                                 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
            0xd8); /* d0..d7 | m0..m7 */
        const __m256 dv = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
        _mm256_store_ps(g->d, dv);
        _mm256_store_ps(g->m, t == TQ_Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))
                                           : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f)));
#else
        for (int j = 0; j < GR; j++) {
            const uint8_t *u = w + j * rbytes + b * ub;
            g->d[j] = half_to_float(u);
            g->m[j] = block_min(t, u);
        }
#endif
#ifdef TQ_AVX2
        /* rows' dwords t (bytes 4t .. 4t+3) gathered into vector t, lane j = row j: a 4 x 4 dword
         * transpose in each 128-bit half (rows 0-3 low, 4-7 high) */
        __m256i a[4];
        for (int r = 0; r < 4; r++)
            a[r] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)nibbles(t, w + (r + 4) * rbytes + b * ub)),
                                    _mm_loadu_si128((const __m128i *)nibbles(t, w + r * rbytes + b * ub)));
        const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
        const __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
        const __m256i mask = _mm256_set1_epi8(15);
        for (int s = 0; s < 4; s++) {
            _mm256_storeu_si256((__m256i *)(g->q + 32 * s), _mm256_and_si256(v[s], mask));
            _mm256_storeu_si256((__m256i *)(g->q + 32 * (s + 4)), _mm256_and_si256(_mm256_srli_epi16(v[s], 4), mask));
        }
#else
        for (int j = 0; j < GR; j++) {
            const uint8_t *qs = nibbles(t, w + j * rbytes + b * ub);
            for (int i = 0; i < 16; i++) {
                g->q[32 * (i / 4) + 4 * j + i % 4] = qs[i] & 15;
                g->q[32 * (i / 4 + 4) + 4 * j + i % 4] = qs[i] >> 4;
            }
        }
#endif
    }
}

/* NX (<= MRG) activation rows times one group: out[i * ostride + j], j < 8. */
static inline __attribute__((always_inline)) void group_tile(const int t, const gblock *panel, int64_t nb,
                                                             tq_q8acts x, int64_t K, const int NX, const float *bias,
                                                             float *out, int64_t ostride) {
#ifdef TQ_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MRG];
    for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const gblock *g = panel + b;
        const __m256 dw = _mm256_load_ps(g->d), mw = t == TQ_Q8_0 ? dw : _mm256_load_ps(g->m);
        for (int i = 0; i < NX; i += 2) { /* rows in pairs: each step loaded once per pair, one chain each */
            const int two = i + 1 < NX;
            const int8_t *x0 = x.q + i * K + b * QK, *x1 = x0 + (two ? K : 0);
            __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
            if (t == TQ_Q8_0) { /* |q| times x with q's sign (at most 2 * 128 * 127 per pair), widened per step */
                for (int s = 0; s < 8; s++) {
                    const __m256i q = _mm256_load_si256((const __m256i *)(g->q + 32 * s)), aq = _mm256_sign_epi8(q, q);
                    int32_t v0, v1;
                    memcpy(&v0, x0 + 4 * s, 4);
                    p0 = _mm256_add_epi32(
                        p0, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(_mm256_set1_epi32(v0), q)), ones));
                    if (two) {
                        memcpy(&v1, x1 + 4 * s, 4);
                        p1 = _mm256_add_epi32(
                            p1,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(_mm256_set1_epi32(v1), q)), ones));
                    }
                }
                for (int r = 0; r < 1 + two; r++)
                    acc[i + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r ? p1 : p0),
                                                 _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + (i + r) * nb + b)), acc[i + r]);
                continue;
            }
            for (int s = 0; s < 8; s++) {
                const __m256i q = _mm256_load_si256((const __m256i *)(g->q + 32 * s));
                int32_t v0, v1;
                memcpy(&v0, x0 + 4 * s, 4);
                p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(q, _mm256_set1_epi32(v0)));
                if (two) {
                    memcpy(&v1, x1 + 4 * s, 4);
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(q, _mm256_set1_epi32(v1)));
                }
            }
            for (int r = 0; r < 1 + two; r++) {
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(r ? p1 : p0, ones));
                acc[i + r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + (i + r) * nb + b)),
                                             acc[i + r]);
                acc[i + r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(x.s + (i + r) * x.nbp + b), acc[i + r]);
            }
        }
    }
    for (int i = 0; i < NX; i++) {
        __m256 o = acc[i];
        if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(out + i * ostride, o);
    }
#else
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < GR; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const gblock *g = panel + b;
                const int8_t *xq = x.q + i * K + b * QK;
                int isum = 0;
                for (int k = 0; k < QK; k++) {
                    const uint8_t q = g->q[32 * (k / 4) + 4 * j + k % 4];
                    isum += (t == TQ_Q8_0 ? (int)(int8_t)q : (int)q) * xq[k];
                }
                acc = fmaf((float)isum, g->d[j] * x.d[i * nb + b], acc);
                if (t != TQ_Q8_0) acc = fmaf(g->m[j], x.s[i * x.nbp + b], acc);
            }
            out[i * ostride + j] = bias ? acc + bias[j] : acc;
        }
#endif
}

/* One weight row (a group's leftover, N % 8) times every activation row, the same operations
 * per output as group_tile: plain C in every build. */
static void single_row(int t, const uint8_t *row, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t K) {
    const int64_t nb = K / QK;
    const int ub = unit_bytes(t);
    for (int64_t i = 0; i < M; i++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *u = row + b * ub;
            const int8_t *xq = x.q + i * K + b * QK;
            int isum = 0;
            if (t == TQ_Q8_0) {
                for (int k = 0; k < QK; k++) isum += (int8_t)u[2 + k] * xq[k];
                acc = fmaf((float)isum, half_to_float(u) * x.d[i * nb + b], acc);
                continue;
            }
            const uint8_t *qs = nibbles(t, u);
            for (int k = 0; k < 16; k++) isum += (qs[k] & 15) * xq[k] + (qs[k] >> 4) * xq[k + 16];
            acc = fmaf((float)isum, half_to_float(u) * x.d[i * nb + b], acc);
            acc = fmaf(block_min(t, u), x.s[i * x.nbp + b], acc);
        }
        y[i * ldy] = bias ? acc + bias[0] : acc;
    }
}

#ifdef TQ_AVX2
/* Q8_0 at batch 1: one group straight from the file's rows, no panel. Each row's block dot is
 * taken along k (|q| times x with q's sign, pairs widened) and the 8 rows' partial sums reduced
 * to one vector of exact block dots, lane j = row j -- the same integers as the panel path, then
 * the same float operations, so the result is the same bits. */
static inline __attribute__((always_inline)) void q8_0_direct(const uint8_t *w, int64_t rbytes, int64_t nb,
                                                              tq_q8acts x, const float *bias, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int ub = unit_bytes(TQ_Q8_0);
    const uint8_t *next = w + GR * rbytes;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t off = b * GR * ub; off < (b + 1) * GR * ub; off += 64) __builtin_prefetch(next + off);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x.q + b * QK));
        __m256i v[GR];
        uint16_t h[GR];
        for (int j = 0; j < GR; j++) {
            const uint8_t *u = w + j * rbytes + b * ub;
            memcpy(h + j, u, 2);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(u + 2));
            v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q)), ones);
        }
        /* hadd pairs per 128-bit half: g0 = rows 0-3 (low half: elements 0-3, high: 4-7), g1 rows 4-7 */
        const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                                              _mm256_permute2x128_si256(g0, g1, 0x31));
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + b)), acc);
    }
    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(out, acc);
}

#endif

#define GTILE(NX) group_tile(t, panel, nb, xm, K, NX, bn, out, ldy)

/* One group (weight rows 8g .. 8g+7) times every activation row; t a constant after inlining. */
static inline __attribute__((always_inline)) void group_work(const int t, const uint8_t *w, tq_q8acts x, float *y,
                                                             int64_t ldy, const float *bias, int64_t M, int64_t K,
                                                             int64_t g, gblock *panel) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K);
    const float *bn = bias ? bias + g * GR : NULL;
#ifdef TQ_AVX2
    if (t == TQ_Q8_0 && M == 1) { /* (the same along k for Q4 measured 0.91-0.94x the panel: not taken) */
        q8_0_direct(w + g * GR * rbytes, rbytes, nb, x, bn, y + g * GR);
        return;
    }
#endif
    unpack_group(t, w + g * GR * rbytes, rbytes, nb, panel);
    for (int64_t m0 = 0; m0 < M; m0 += MRG) {
        const tq_q8acts xm = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * x.nbp, x.nbp};
        float *out = y + m0 * ldy + g * GR;
        switch (M - m0 < MRG ? (int)(M - m0) : MRG) {
            case 1: GTILE(1); break;
            case 2: GTILE(2); break;
            case 3: GTILE(3); break;
            default: GTILE(MRG); break;
        }
    }
}

/* The groups split over the threads; the type switch inside the parallel loop, so that each
 * type's copy of the loop is compiled with its type a constant (OpenMP outlines the region
 * before inlining could specialize it). */
static void group_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t N, int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K), groups = N / GR;
#pragma omp parallel
    {
        gblock *panel = (gblock *)aligned_alloc(32, (size_t)nb * sizeof(gblock));
        if (panel == NULL) abort();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            switch (t) {
                case TQ_Q4_0: group_work(TQ_Q4_0, w, x, y, ldy, bias, M, K, g, panel); break;
                case TQ_Q4_1: group_work(TQ_Q4_1, w, x, y, ldy, bias, M, K, g, panel); break;
                default: group_work(TQ_Q8_0, w, x, y, ldy, bias, M, K, g, panel); break;
            }
        }
        free(panel);
    }
    for (int64_t n = groups * GR; n < N; n++)
        single_row(t, w + n * rbytes, x, y + n, ldy, bias ? bias + n : NULL, M, K);
}

#define TYPE8(T) case T: row_pair8(T, row, x, out, ldy, bn, nw, M, K); break

void tq_q8_rows(int qtype, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                int64_t N, int64_t K) {
    if (group_type(qtype)) {
        group_rows(qtype, w, x, y, ldy, bias, M, N, K);
        return;
    }
    const int64_t rbytes = row_bytes(qtype, K);
#pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < (N + 1) / 2; pair++) {
        const int64_t n = 2 * pair;
        const uint8_t *row = w + n * rbytes;
        const float *bn = bias ? bias + n : NULL;
        float *out = y + n;
        const int nw = N - n < 2 ? 1 : 2;
        switch (qtype) {
            TYPE8(TQ_Q5_0); TYPE8(TQ_Q5_1);
            default: break;
        }
    }
}
