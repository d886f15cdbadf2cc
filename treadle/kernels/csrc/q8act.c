/* The 8-bit activation path of tq_matmul (qmatmul.c) for the legacy block types Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K: the layout's act_bits == 8 (tq.h).
 * This file: the panel's tiles and the dispatch (tq_q8_rows); one translation unit with
 * q8lanes.h (256-bit lane helpers), q8panel.h (the panel's unpacking) and q8direct.h (the register
 * paths); q8pack.c quantizes the activations and packs the rows; q8batch.c takes AVX-512's batches.
 *
 * Each activation row is quantized once per matmul (q8pack.c) to int8 per block of 32 (xd = max|x| / 127,
 * xq = round(x / xd)) with its block sum (xs = xd * sum(xq), the minimum term's factor) and its
 * two half-block integer sums (xh, Q6_K's). The weights stay 8-bit: unsigned q for the 4/5-bit
 * types (the types that store q - 8 / q - 16 read as q with the minimum m = -8 d / -16 d), signed
 * q for Q8_0:
 *
 *   y[m, n] = sum_b  d_b xd_b (q_b . xq_b)  +  sum_b m_b xs_b  (+ bias)
 *
 * A Q4_K / Q5_K super-block is 8 such blocks of 32, each Q4_1 / Q5_1-like: q unsigned (0..15 /
 * 0..31), d_b = d sc_b and m_b = -dmin mn_b (fp16 times a 6-bit integer: exact in float32, the
 * values the 16-bit path's unit_scales makes). Q6_K's 32-blocks have two int8 scales (one per 16)
 * and q stored with bias 32: the panel holds q + 32 (0..63, unsigned), d = the super-block's d,
 * and both scales; the two halves' dots (steps 0-3, 4-7) are kept apart and folded in int32,
 *
 *   isum = sc0 (dot0 - 32 xh0) + sc1 (dot1 - 32 xh1)       (|isum| < 2^24: exact, also as a float)
 *
 * then acc = fma(float(isum), d xd, acc) with no minimum term. Block b of a K-quant row is
 * sub-block b % 8 of its super-block b / 8, so the K-quants share the panel, tiles and tail loop
 * of the legacy types below (only unpack_kgroup differs); q8batch.c takes their whole groups from
 * BATCH_MIN_K activation rows in the AVX-512 builds, with the same values, integers and float order.
 *
 * Eight weight rows side by side (a "group"), one output row per vector lane: a vector's 8 int32
 * lanes are 8 weight rows (columns of y) rather than 8 pieces of one dot product.
 *
 *   panel step s of block b (s < 8): lane j = the 4 q of weight row j at k = 4s .. 4s+3 (bytes)
 *   xb = x row's 4 bytes at k = 4s .. 4s+3, broadcast to every lane
 *   Q4: p16 += maddubs(step, xb)  over the 8 steps (u4 x s8 pairs: at most 8 * 2 * 15 * 127 < 32767),
 *       isum = madd(p16, ones)    one 16 -> 32-bit widening per block of 8 rows
 *   Q5: the same, widened after steps 3 and 7 (4 * 2 * 31 * 127 < 32767)
 *   Q8_0: isum += madd(maddubs(|step|, xb with step's sign), ones)   per step (pairs up to 2 * 128 * 127)
 *
 * isum is each row's exact integer block dot, with no horizontal sums at all. Each pair of groups
 * is unpacked (transposed) once per call into a per-thread panel that every tile of 2 activation
 * rows x 16 weight rows reads (each 4-byte activation broadcast feeds both groups; a lone last
 * group takes tiles of 4 rows x 8); the next group's bytes are prefetched meanwhile. A tile's
 * sums stay in registers: each step's add is pinned in its chain (an empty asm), because GCC
 * otherwise reassociates the 8 steps into a tree whose 8 live products spill to the stack (the
 * measured cost: 1.13x). Each output then takes, per block in order,
 *
 *   acc = fma(float(isum), d_w * xd, acc);   acc = fma(m_w, xs, acc)   (Q8_0: no minimum)
 *
 * and y = acc (+ bias). The plain-C build (TQ_PLAIN_C) computes exactly these operations, and
 * rows of N past the last whole group (N % 8) take a plain-C loop in the SIMD builds too, so every
 * output has one value whatever the build, tile, thread or batch. Up to 3 activation rows, the file's Q8_0
 * rows skip the panel in the AVX2 / AVX-VNNI builds (packed Q8_0, as a load with 8-bit activations
 * leaves the lm_head: up to 4 rows, packed_direct) (the AVX-512 builds take q8batch.c's
 * zmm q8_0_strip_direct up to 8 rows, the same integers and float order): q8_0_direct takes each row's block dot along k and reduces 8 rows'
 * partial sums to the same exact integers (1.25x the panel at 1 row, 1.13x at 2 and 3; at 4 its
 * sums spill). The VNNI builds take each step's 4-byte dot
 * products with vpdpbusd straight into int32 (step16 / step32 below: the same integers; not run on
 * the AVX2 machine this was written on, so not measured). Threads split the groups.
 *
 * Q6_K's steps widen per step in the AVX2 build (2 * 63 * 127 per pair).
 *
 * Split 16-bit activations (tq_q8acts.l set: q8pack.c tq_q16_split, a layout's act_bits 16 on packed
 * Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows): qmatmul.c's 16-bit values v (xd = max|x| / 32767) as
 * v = 256 hi + lo, hi int8 in q, lo 0..255 in l. The zmm builds take both halves with vpdpbusd
 * (packed_split here up to 4 rows, q8batch.c's strip_split at every batch): the weights times hi as
 * the 8-bit path does, and lo (the unsigned operand) times the weights, so isum = 256 hi-dot +
 * lo-dot is the exact block dot of the 16-bit values (|isum| < 2^28), then the float operations
 * above with xd and xs = xd * sum(v). Other builds take them in plain C (group_tile_c), with the
 * same bits; their loader leaves these rows unpacked at 16 bits (native.packs_at_16_bits).
 *
 * Packed Q4_0 / Q4_1 (types TQ_PACKED + t, made once at load by tq_q8_pack, same bytes): a group's
 * block is its 8 d, 8 m and 4 vectors of nibbles already in step order, so the panel is filled
 * with masks and shifts, and up to 4 activation rows skip the panel (packed_direct: the steps go
 * straight into registers). Same integers, same float order, so the same bits as the file's rows.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qblocks.h"

#define MRG 4 /* activation rows per pass over a group's panel */
#define Q8_0_DIRECT 3 /* Q8_0 up to this many activation rows skips the panel (4: 0.99x, its sums spill); AVX2 / AVX-VNNI builds only */
#define MR2 2 /* activation rows per pass over two groups' panels (3 spilled: 0.98x) */
#define Q6K_DIRECT 2 /* packed Q6_K up to this many activation rows skips the panel (its 4 blocks' sums in registers) */

typedef struct { /* one block of a group, unpacked */
    uint8_t q[8 * 32]; /* step s at 32 s: lane j's 4 bytes at 4 j */
    float d[GR];
    union {
        float m[GR]; /* the minimum (0 for Q8_0) */
        int32_t sc[GR]; /* Q6_K: the two halves' int8 scales, sc0 | sc1 << 16 (int16 each) */
    };
} gblock;

static inline int five_bit(int t) { return t == TQ_Q5_0 || t == TQ_Q5_1 || t == TQ_Q5_K; }
static inline int has_min(int t) { return t != TQ_Q8_0 && t != TQ_Q6_K; }

/* A legacy block's minimum: Q4_1 / Q5_1 store it; Q4_0 / Q5_0 read as unsigned q with -8 d / -16 d */
static inline float block_min(int t, const uint8_t *u) {
    return stores_min(t) ? half_to_float(u + 2) : -(float)q_bias(t) * half_to_float(u);
}

/* Block sub (0..7) of K-quant unit u as the panel holds it: its 32 unsigned q (Q6_K: the stored
 * q + 32, 0..63) and d with m (Q4_K / Q5_K: d sc_b and -dmin mn_b, products exact in float32) or
 * d with the halves' scales (Q6_K: the unit's d, sc[2 sub] | sc[2 sub + 1] << 16). */
static void kquant_block(int t, const uint8_t *u, int sub, uint8_t q[QK], float *d, float *m, int32_t *sc) {
    int v[QK];
    block_ints(t, u, sub, v);
    for (int k = 0; k < QK; k++) q[k] = (uint8_t)(v[k] + (t == TQ_Q6_K ? 32 : 0));
    *m = 0.0f, *sc = 0;
    if (t == TQ_Q6_K) {
        *d = half_to_float(u + 208);
        const int8_t *s8 = (const int8_t *)(u + 192 + 2 * sub);
        *sc = (int32_t)((uint32_t)(uint16_t)(int16_t)s8[0] | (uint32_t)(uint16_t)(int16_t)s8[1] << 16);
    } else {
        unit_scales_t s;
        unit_scales(t, u, &s);
        *d = s.d[sub];
        *m = s.m[sub];
    }
}

/* Q6_K's exact block integer from the two halves' dots of unsigned q (q + 32) and x: the int8
 * scales folded in int32, sc0 (dot0 - 32 xh0) + sc1 (dot1 - 32 xh1); |each half| <= 16 * 32 * 127
 * and |sc| <= 128, so |isum| < 2^24: exact in int32 and as a float. */
static inline int q6_fold(int32_t sc, int dot0, int dot1, const int32_t *xh) {
    const int sc0 = (int16_t)(uint16_t)((uint32_t)sc & 0xffffu), sc1 = (int16_t)(uint16_t)((uint32_t)sc >> 16);
    return sc0 * (dot0 - 32 * xh[0]) + sc1 * (dot1 - 32 * xh[1]);
}

#include "q8lanes.h"
#include "q8panel.h"

/* group_tile in plain C: every build's reference, and the non-zmm builds' path for split 16-bit
 * activations (x.l: q8_value, exact in int32 for the legacy types). Each output: the exact integer
 * block dot, then acc = fma(isum, d xd, acc) and acc = fma(m, xs, acc), block by block. */
static void group_tile_c(const int t, const gblock *panel, int64_t nb, tq_q8acts x, int64_t K, const int NG,
                         const int NX, const float *bias, float *out, int64_t ostride) {
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < GR * NG; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const gblock *g = panel + (j / GR) * nb + b;
                const int64_t xq = i * K + b * QK;
                int dot[2] = {0, 0};
                for (int k = 0; k < QK; k++) {
                    const uint8_t q = g->q[32 * (k / 4) + 4 * (j % GR) + k % 4];
                    dot[k / 16] += (t == TQ_Q8_0 ? (int)(int8_t)q : (int)q) * q8_value(x, xq + k);
                }
                const int isum = t == TQ_Q6_K ? q6_fold(g->sc[j % GR], dot[0], dot[1], x.h + 2 * (i * nb + b))
                                              : dot[0] + dot[1];
                acc = fmaf((float)isum, g->d[j % GR] * x.d[i * nb + b], acc);
                if (has_min(t)) acc = fmaf(g->m[j % GR], x.s[i * nb + b], acc);
            }
            out[i * ostride + j] = bias ? acc + bias[j] : acc;
        }
}

/* NX (<= MRG) activation rows times NG (1 or 2) groups, group h's panel at panel + h nb:
 * out[i * ostride + 8 h + j], j < 8. Two groups share each activation broadcast (NX <= MR2). */
static inline __attribute__((always_inline)) void group_tile(const int t, const gblock *panel, int64_t nb,
                                                             tq_q8acts x, int64_t K, const int NG, const int NX,
                                                             const float *bias, float *out, int64_t ostride) {
#ifdef TQ_AVX2 /* every array below indexed by unrolled constants only, so all of it stays in registers */
    __m256 acc[2][MRG];
#pragma GCC unroll 2
    for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
        for (int i = 0; i < NX; i++) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = x.q + b * QK;
        __m256i p[2][MRG], w5[2][MRG];
#pragma GCC unroll 2
        for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) p[h][i] = w5[h][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            __m256i q[2], aq[2];
#pragma GCC unroll 2
            for (int h = 0; h < NG; h++) {
                q[h] = _mm256_load_si256((const __m256i *)(panel[h * nb + b].q + 32 * s));
                if (t == TQ_Q8_0) aq[h] = _mm256_sign_epi8(q[h], q[h]);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) {
                int32_t v;
                memcpy(&v, xb + i * K + 4 * s, 4);
                const __m256i xv = _mm256_set1_epi32(v);
#pragma GCC unroll 2
                for (int h = 0; h < NG; h++) {
                    if (t == TQ_Q8_0) /* |q| times x with q's sign (at most 2 * 128 * 127 per pair), widened per step */
                        p[h][i] = step32(p[h][i], aq[h], _mm256_sign_epi8(xv, q[h]));
                    else if (t == TQ_Q6_K) /* 6-bit q: 2 * 63 * 127 per pair, widened per step */
                        p[h][i] = step32(p[h][i], q[h], xv);
                    else
                        p[h][i] = step16(p[h][i], q[h], xv);
                    __asm__("" : "+x"(p[h][i])); /* keep the chain: reassociated into a tree, it spills */
                }
            }
            if ((five_bit(t) || t == TQ_Q6_K) && s == 3) { /* 5-bit q: 4 steps fill int16 (4 * 2 * 31 * 127 < 32767);
                                                             Q6_K: the first half's dot, kept apart */
#pragma GCC unroll 2
                for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
                    for (int i = 0; i < NX; i++)
                        w5[h][i] = t == TQ_Q6_K ? p[h][i] : widen16(p[h][i]), p[h][i] = _mm256_setzero_si256();
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < NG; h++) {
            const gblock *g = panel + h * nb + b;
            const __m256 dw = _mm256_load_ps(g->d);
            __m256i sc0 = _mm256_setzero_si256(), sc1 = sc0;
            if (t == TQ_Q6_K) { /* the halves' int8 scales, sign-extended from their int16 halves */
                const __m256i sc = _mm256_load_si256((const __m256i *)g->sc);
                sc0 = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16), 16);
                sc1 = _mm256_srai_epi32(sc, 16);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) {
                __m256 isum;
                if (t == TQ_Q6_K) {
                    isum = _mm256_cvtepi32_ps(q6_fold_lanes(w5[h][i], p[h][i], sc0, sc1, x.h + 2 * (i * nb + b)));
                } else {
                    const __m256i wide = t == TQ_Q8_0 ? p[h][i] : widen16(p[h][i]);
                    isum = _mm256_cvtepi32_ps(five_bit(t) ? _mm256_add_epi32(w5[h][i], wide) : wide);
                }
                acc[h][i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + i * nb + b)), acc[h][i]);
                if (has_min(t))
                    acc[h][i] = _mm256_fmadd_ps(_mm256_load_ps(g->m), _mm256_broadcast_ss(x.s + i * nb + b), acc[h][i]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
        for (int i = 0; i < NX; i++) {
            __m256 o = acc[h][i];
            if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias + GR * h));
            _mm256_storeu_ps(out + i * ostride + GR * h, o);
        }
#else
    group_tile_c(t, panel, nb, x, K, NG, NX, bias, out, ostride);
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
            const int8_t *xq = x.q + i * K + b * QK;
            if (is_k_quant(t)) { /* the panel's values (kquant_block) and operations */
                uint8_t q[QK];
                float d, m;
                int32_t sc;
                int dot[2] = {0, 0};
                kquant_block(t, row + b / 8 * ub, (int)(b % 8), q, &d, &m, &sc);
                for (int k = 0; k < QK; k++) dot[k / 16] += (int)q[k] * xq[k];
                const int isum = t == TQ_Q6_K ? q6_fold(sc, dot[0], dot[1], x.h + 2 * (i * nb + b)) : dot[0] + dot[1];
                acc = fmaf((float)isum, d * x.d[i * nb + b], acc);
                if (has_min(t)) acc = fmaf(m, x.s[i * nb + b], acc);
                continue;
            }
            const uint8_t *u = row + b * ub;
            int v[QK], isum = 0;
            block_ints(t, u, 0, v);
            for (int k = 0; k < QK; k++) isum += (v[k] + q_bias(t)) * xq[k];
            acc = fmaf((float)isum, half_to_float(u) * x.d[i * nb + b], acc);
            if (t != TQ_Q8_0) acc = fmaf(block_min(t, u), x.s[i * nb + b], acc);
        }
        y[i * ldy] = bias ? acc + bias[0] : acc;
    }
}

#include "q8direct.h"


/* 1 when group_work reads M activation rows of type t straight into registers (the SIMD builds),
 * no panel: few rows, or packed Q8_0 at every batch, MRG rows at a time over the group's bytes (in
 * L1 after the first tile: the panel's tiles of 2 rows re-take |q| per step for fewer rows; lm_head
 * 49152 x 576, forced avx2 build on AMD Zen 4, one thread: 1.9x at 5 rows, 1.4x at 16 and 32). */
static int takes_registers(int t, int64_t M) {
#ifdef TQ_AVX2
    return (t == TQ_Q8_0 && M <= Q8_0_DIRECT) || packed_q8_0(t) ||
           (is_packed(t) && M <= (base_type(t) == TQ_Q6_K ? Q6K_DIRECT : MRG));
#else
    (void)t, (void)M;
    return 0;
#endif
}

#define GTILE(NG, NX) group_tile(base_type(t), panel, nb, xm, K, NG, NX, bn, out, ldy)
/* CALL(NX) for the activation rows m0.. of M, NX = min(M - m0, MAXR) a constant in each copy (MAXR 3 or 4) */
#define ROW_TILE(CALL, MAXR)                              \
    switch (M - m0 < (MAXR) ? (int)(M - m0) : (MAXR)) {   \
        case 1: CALL(1); break;                           \
        case 2: CALL(2); break;                           \
        case 3: CALL(3); break;                           \
        default: CALL(MAXR); break;                       \
    }
#define Q8D(NX) q8_0_direct(wg, rbytes, nb, xm, K, NX, bh, ym, ldy)
#define PKD(NX) packed_k_direct(t, wg, nb, xm, K, NX, bh, ym, ldy)
#define PD(NX) packed_direct(t, wg, nb, xm, K, NX, bh, ym, ldy)

/* Groups g and, when pair, g + 1 (weight rows 8g .. 8g+15) times every activation row; t a
 * constant after inlining. */
static inline __attribute__((always_inline)) void group_work(const int t, const uint8_t *w, tq_q8acts x, float *y,
                                                             int64_t ldy, const float *bias, int64_t M, int64_t K,
                                                             int64_t g, int pair, gblock *panel) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K);
    const float *bn = bias ? bias + g * GR : NULL;
#ifdef TQ_AVX2
    /* few rows: registers beat the panel (packed Q4: 1.5x at M = 1, ~1.05x at 4; Q8_0: 1.25x at 1,
     * 1.13x at 2 and 3; the same along k for unpacked Q4 measured 0.91-0.94x the panel: not taken).
     * Split 16-bit activations: packed_direct in the zmm builds, group_tile_c otherwise. */
#ifdef TQ_ZMM
    const int registers = takes_registers(t, M);
#else
    const int registers = takes_registers(t, M) && !x.l;
#endif
    if (registers) {
        const int64_t step = t == TQ_Q8_0 ? Q8_0_DIRECT : MRG; /* one tile, but for packed Q8_0 */
        for (int h = 0; h <= pair; h++) {
            const uint8_t *wg = w + (g + h) * GR * rbytes;
            const float *bh = bn ? bn + GR * h : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += step) {
                const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
                float *ym = y + m0 * ldy + (g + h) * GR;
                if (t == TQ_Q8_0) {
                    ROW_TILE(Q8D, Q8_0_DIRECT);
                } else if (packed_k(t)) {
                    ROW_TILE(PKD, MRG);
                } else {
                    ROW_TILE(PD, MRG);
                }
            }
        }
        return;
    }
#endif
    for (int h = 0; h <= pair; h++) unpack_group(t, w + (g + h) * GR * rbytes, rbytes, nb, panel + h * nb);
    if (x.l) { /* split 16-bit activations in plain C (the zmm builds take them in registers) */
        for (int64_t m0 = 0; m0 < M; m0++)
            group_tile_c(base_type(t), panel, nb, tq_q8_rows_from(x, m0, K), K, pair + 1, 1, bn, y + m0 * ldy + g * GR, ldy);
        return;
    }
    const int mr = pair ? MR2 : MRG;
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
        const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
        float *out = y + m0 * ldy + g * GR;
        const int nx = M - m0 < mr ? (int)(M - m0) : mr;
        if (pair) {
            if (nx == 1)
                GTILE(2, 1);
            else
                GTILE(2, MR2);
        } else {
            switch (nx) {
                case 1: GTILE(1, 1); break;
                case 2: GTILE(1, 2); break;
                case 3: GTILE(1, 3); break;
                default: GTILE(1, MRG); break;
            }
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
        gblock *panel = (gblock *)aligned_alloc(32, (size_t)(2 * nb) * sizeof(gblock));
        if (panel == NULL) abort();
#pragma omp for schedule(static)
        for (int64_t g2 = 0; g2 < (groups + 1) / 2; g2++) {
            const int64_t g = 2 * g2;
            const int pair = g + 1 < groups;
            switch (t) {
                case TQ_Q4_0: group_work(TQ_Q4_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q4_1: group_work(TQ_Q4_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q5_0: group_work(TQ_Q5_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q5_1: group_work(TQ_Q5_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q4_0: group_work(TQ_PACKED + TQ_Q4_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q4_1: group_work(TQ_PACKED + TQ_Q4_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q5_0: group_work(TQ_PACKED + TQ_Q5_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q5_1: group_work(TQ_PACKED + TQ_Q5_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q4_K: group_work(TQ_Q4_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q5_K: group_work(TQ_Q5_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q6_K: group_work(TQ_Q6_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q4_K: group_work(TQ_PACKED + TQ_Q4_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q6_K: group_work(TQ_PACKED + TQ_Q6_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q8_0: group_work(TQ_PACKED + TQ_Q8_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                default: group_work(TQ_Q8_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
            }
        }
        free(panel);
    }
    for (int64_t n = groups * GR; n < N; n++)
        single_row(t, w + n * rbytes, x, y + n, ldy, bias ? bias + n : NULL, M, K);
}

/* small_256 (tq_layout): batches of up to MRG rows that group_work reads straight into 256-bit registers skip q8batch.c,
 * whose zmm strips read two groups' bytes at once (AMD Zen 4, decode steps of SmolLM2 Q4_1 at 2
 * threads: batch 1 1.35x, batch 4 1.16x faster this way; from 6 rows the strips win, 1.4x). */
void tq_q8_rows(int qtype, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                int64_t N, int64_t K, int small_256) {
    const int64_t done = small_256 && M <= MRG && takes_registers(qtype, M)
                             ? 0
                             : tq_q8_batch_rows(qtype, w, x, y, ldy, bias, M, N, K); /* q8batch.c: batches on AVX-512 */
    if (done < N) group_rows(qtype, w + done * row_bytes(qtype, K), x, y + done, ldy, bias ? bias + done : NULL, M, N - done, K);
}
