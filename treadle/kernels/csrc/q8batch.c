/* The batched 8-bit activation path on AVX-512 VNNI (the avx512-vnni and avx512-bf16 builds):
 * packed Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows (q8pack.c tq_q8_pack) and the file's Q8_0 rows at every batch (packed
 * Q8_0: strip_direct's loads at every batch, no panel), Q4_K / Q5_K / Q6_K rows times M >= BATCH_MIN_K (unpack_k4_strip,
 * unpack_q6k_strip: q8panel.h's unpack_kgroup values for 16 rows at a time; Q6_K's two half-block
 * dots start at -32 xh and are folded with its int8 scales in int32 as q8act.c's q6_fold). Up to DIRECT_MAX_Q4 rows, a packed strip's nibbles go from the
 * packed bytes straight into zmm registers, each block unpacked once per tile of TQ_NX rows and
 * fed to all of them (strip_direct, the next strip prefetched); likewise up to DIRECT_MAX_Q8_0
 * rows a Q8_0 strip's blocks are loaded from the rows, transposed in registers and fed to every
 * row of a tile (q8_0_strip_direct); more rows unpack each weight block once per call into an L1
 * panel reused by every activation row. tq_q8_rows (q8act.c) hands the whole groups here first;
 * the other builds keep q8act.c's paths (Q8_0 up to 3 rows: its 256-bit q8_0_direct).
 *
 * A "strip" is two groups of 8 weight rows (16 rows, one int32 lane each of a zmm register):
 *
 *   panel block b of a strip:  q[s] (s < 8) lane j = weight row j's 4 unsigned bytes at
 *                              k = 4s .. 4s+3 (Q8_0: the signed byte + 128); d[16], m[16]
 *   tile: NX (<= TQ_NX) activation rows x 16 weight rows; per block, step s:
 *         p[i] = vpdpbusd(p[i], q[s], broadcast(x row i's 4 bytes at 4s))
 *
 * p[i] lane j is then the exact integer block dot of activation row i and weight row j (Q8_0:
 * minus 128 times the block's activation sum, the offset the unsigned bytes added), and each
 * output takes, per block in order, exactly q8act.c's float operations:
 *
 *   acc = fma(float(isum), d_w * xd, acc);   acc = fma(m_w, xs, acc)   (Q8_0, Q6_K: no minimum)
 *
 * then y = acc (+ bias). So every output has the bits of the plain-C reference (q8act.c's
 * group_tile without TQ_AVX2), whatever the batch, the tile or the thread: a row's result never
 * depends on the rows beside it. Threads split the strips; a lone last group takes a strip with
 * its upper 8 lanes zero and stores 8 outputs.
 */
#include <stdlib.h>
#include <string.h>

#include "q8strip.h"

#define TQ_NX 8 /* activation rows per tile */
/* Q8_0 takes every batch here: up to DIRECT_MAX_Q8_0 rows without a panel (q8_0_strip_direct;
 * lm_head 49152 x 576 on AMD EPYC Zen 5, one thread, against q8act.c's 256-bit q8_0_direct below 4
 * rows and the panel above: about 1.0x at 1 row, 1.3-1.55x at 2-4, 1.2x at 8; 9 rows, one tile of 8
 * and one of 1 each transposing the strip again, 0.9x, 12 and 16: 0.85-0.88x, so those keep the panel).
 * Packed Q4 and Q5 take every batch: up to DIRECT_MAX_Q4 rows without a panel (strip_direct), more
 * through the panel (Q5: the fifth bits added from the step's masks, one masked byte add per register). */
#define BATCH_MIN_Q8_0 1
#define DIRECT_MAX_Q8_0 8
#define DIRECT_MAX_Q4 16
/* K-quants: fewer rows take q8act.c's 8-lane panel (the strips measured 1.13-1.22x the panel at 2
 * rows, 0.97-1.06x at 1) */
#define BATCH_MIN_K 2
enum { MODE_MIN, MODE_Q8_0, MODE_Q6_K }; /* strip_tile: q - minimum terms; Q8_0's offset; Q6_K's two halves */

#ifdef TQ_ZMM
/* Block b's share (chunk bytes) of the pf bytes (the next strip's rows, or none), prefetched while the
 * block is used, so the memory reads run beside the arithmetic rather than in a burst */
static inline void prefetch_share(const uint8_t *pf, int64_t pfbytes, int64_t chunk, int64_t b) {
    if (pf)
        for (int64_t off = b * chunk; off < (b + 1) * chunk && off < pfbytes; off += 64) __builtin_prefetch(pf + off);
}

/* split_step (q8direct.h) on 16 lanes: *ph += u times the 4 high bytes at hq (the signed operand),
 * *pl += the 4 low bytes at lq (the unsigned operand) times s */
static inline __attribute__((always_inline)) void split_step16(__m512i *ph, __m512i *pl, __m512i u, __m512i s,
                                                               const int8_t *hq, const uint8_t *lq) {
    int32_t h, l;
    memcpy(&h, hq, 4), memcpy(&l, lq, 4);
    *ph = _mm512_dpbusd_epi32(*ph, u, _mm512_set1_epi32(h));
    *pl = _mm512_dpbusd_epi32(*pl, _mm512_set1_epi32(l), s);
}

/* The end of a block of a split tile (strip_split, strip_tile_split): the 4-row tiles' second chains
 * joined, isum = 256 hi + lo (the exact block dot of the 16-bit values), then strip_direct's float
 * operations with the block's d (and, with_min, its minimum term). */
static inline __attribute__((always_inline)) void split_block_end(__m512 *acc, __m512i *ph, __m512i *pl,
                                                                  const __m512i *ph2, const __m512i *pl2,
                                                                  const int chains4, const int NX, __m512 dw,
                                                                  __m512 mw, const int with_min, tq_q8acts x,
                                                                  int64_t nb, int64_t b) {
    if (chains4)
#pragma GCC unroll 4
        for (int i = 0; i < NX; i++)
            ph[i] = _mm512_add_epi32(ph[i], ph2[i % (TQ_NX / 2)]), pl[i] = _mm512_add_epi32(pl[i], pl2[i % (TQ_NX / 2)]);
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(ph[i], 8), pl[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i * nb + b])), acc[i]);
        if (with_min) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[i * nb + b]), acc[i]);
    }
}

/* strip_tile for split 16-bit activations (x.l) on a panel of unsigned q with minimum terms (packed
 * Q4_K at 16 bits): per step the panel's q times the high bytes and, as the unsigned operand, the
 * low bytes times q (q <= 31: a valid int8), isum = 256 hi + lo, then strip_tile's float operations;
 * the even and odd steps in chains of their own up to 4 rows (vpdpbusd's latency). */
static inline __attribute__((always_inline)) void strip_tile_split(const sblock *panel, int64_t nb, tq_q8acts x,
                                                                   int64_t K, const int NX, const float *bias,
                                                                   float *out, int64_t ostride, __mmask16 store,
                                                                   const uint8_t *pf, int64_t pfbytes) {
    __m512 acc[TQ_NX];
    const int64_t chunk = (pfbytes / nb + 127) / 64 * 64;
    const int chains4 = NX <= TQ_NX / 2;
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const sblock *g = panel + b;
        prefetch_share(pf, pfbytes, chunk, b);
        const int64_t e0 = b * QK;
        __m512i ph[TQ_NX], pl[TQ_NX], ph2[TQ_NX / 2], pl2[TQ_NX / 2];
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) ph[i] = pl[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < TQ_NX / 2; i++) ph2[i] = pl2[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m512i q = _mm512_load_si512(g->q + s);
#pragma GCC unroll 8
            for (int i = 0; i < NX; i++) {
                const int odd = chains4 && s % 2, j = i % (TQ_NX / 2);
                split_step16(odd ? &ph2[j] : &ph[i], odd ? &pl2[j] : &pl[i], q, q, x.q + i * K + e0 + 4 * s,
                             x.l + i * K + e0 + 4 * s);
                __asm__("" : "+v"(ph[i]), "+v"(pl[i]));
            }
        }
        split_block_end(acc, ph, pl, ph2, pl2, chains4, NX, _mm512_load_ps(g->d), _mm512_load_ps(g->m), 1, x, nb, b);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        __m512 o = acc[i];
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(store, bias));
        _mm512_mask_storeu_ps(out + i * ostride, store, o);
    }
}

/* NX activation rows times one strip: out[i * ostride + j], j < 16 (8 when lone). The pf bytes (the
 * next strip's rows, or none) are prefetched a share per block, so the memory reads run beside
 * the arithmetic rather than in a burst while the panel is filled. */
static inline __attribute__((always_inline)) void strip_tile(const int mode, const sblock *panel, int64_t nb,
                                                             tq_q8acts x, int64_t K, const int NX,
                                                             const float *bias, float *out, int64_t ostride,
                                                             __mmask16 store, const uint8_t *pf, int64_t pfbytes) {
    if (x.l) { /* split 16-bit activations: a minimum-term panel's (packed Q4_K at 16 bits) */
        strip_tile_split(panel, nb, x, K, NX, bias, out, ostride, store, pf, pfbytes);
        return;
    }
    const int q8_0 = mode == MODE_Q8_0, q6 = mode == MODE_Q6_K;
    __m512 acc[TQ_NX];
    const int64_t chunk = (pfbytes / nb + 127) / 64 * 64;
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const sblock *g = panel + b;
        prefetch_share(pf, pfbytes, chunk, b);
        const int8_t *xb = x.q + b * QK;
        __m512i p[TQ_NX], p0[TQ_NX];
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) /* Q6_K: each half starts at -32 times its activation sum (q8act.c's q6_fold) */
            p[i] = q8_0 ? _mm512_set1_epi32(-128 * q8_block_sum(x, i * nb + b))
                 : q6   ? _mm512_set1_epi32(-32 * x.h[2 * (i * nb + b)])
                        : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m512i q = _mm512_load_si512(g->q + s);
#pragma GCC unroll 8
            for (int i = 0; i < NX; i++) {
                int32_t v;
                memcpy(&v, xb + i * K + 4 * s, 4);
                p[i] = _mm512_dpbusd_epi32(p[i], q, _mm512_set1_epi32(v));
                __asm__("" : "+v"(p[i])); /* keep each row's chain in its register */
            }
            if (q6 && s == 3)
#pragma GCC unroll 8
                for (int i = 0; i < NX; i++) p0[i] = p[i], p[i] = _mm512_set1_epi32(-32 * x.h[2 * (i * nb + b) + 1]);
        }
        const __m512 dw = _mm512_load_ps(g->d), mw = _mm512_load_ps(g->m);
        __m512i sc0 = _mm512_setzero_si512(), sc1 = sc0;
        if (q6) {
            const __m512i sc = _mm512_load_si512(g->sc);
            sc0 = _mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 16);
            sc1 = _mm512_srai_epi32(sc, 16);
        }
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) {
            const __m512i isum = q6 ? _mm512_add_epi32(_mm512_mullo_epi32(p0[i], sc0), _mm512_mullo_epi32(p[i], sc1)) : p[i];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i * nb + b])),
                                     acc[i]);
            if (mode == MODE_MIN) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[i * nb + b]), acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        __m512 o = acc[i];
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(store, bias));
        _mm512_mask_storeu_ps(out + i * ostride, store, o);
    }
}

/* Block b of both groups of the packed strip at next (NULL: none) into the cache, while this strip's
 * block is used. */
static inline void prefetch_strip_block(const uint8_t *next, int64_t nb, int64_t b, int ub) {
    if (next)
        for (int off = 0; off < 8 * ub; off += 64) {
            __builtin_prefetch(next + b * 8 * ub + off);
            __builtin_prefetch(next + nb * 8 * ub + b * 8 * ub + off);
        }
}

/* strip_direct for split 16-bit activations (x.l): each step's weights times the high bytes as there
 * (Q8_0 from -128 times their block sum) and, as the unsigned operand, the low bytes times the
 * weights (nibbles, or Q8_0's int8); isum = 256 hi + lo, the exact block dot of the 16-bit values,
 * then strip_direct's float operations: packed_split's bits (q8direct.h). */
static inline __attribute__((always_inline)) void strip_split(const int t, const uint8_t *w, const uint8_t *w1,
                                                              const uint8_t *next, int64_t nb, tq_q8acts x, int64_t K,
                                                              const int NX, const float *bias, float *out,
                                                              int64_t ostride, __mmask16 store) {
    const int q8 = packed_q8_0(t), ub = unit_bytes(t), sb = step_offset(t);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TQ_NX];
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 8 * ub, *p1 = w1 ? w1 + b * 8 * ub : NULL;
        prefetch_strip_block(next, nb, b, ub);
        /* up to 4 rows, the high nibbles' sums (Q8_0: the odd steps') in chains of their own (ph2, pl2: dpbusd's
         * latency), joined per block */
        __m512i ph[TQ_NX], pl[TQ_NX], ph2[TQ_NX / 2], pl2[TQ_NX / 2];
        const int chains4 = NX <= TQ_NX / 2;
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++)
            ph[i] = q8 ? _mm512_set1_epi32(-128 * q8_block_sum(x, i * nb + b)) : _mm512_setzero_si512(), pl[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < TQ_NX / 2; i++) ph2[i] = pl2[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 4 * (1 + q8); s++) { /* Q8_0: 8 steps of 4 bytes; Q4 / Q5: 4 of 4 + 4 (the two nibbles) */
            __m512i qa, qb = _mm512_setzero_si512(); /* Q8_0: the step's signed bytes; Q4 / Q5: the two nibbles */
            if (q8)
                qa = packed_bytes16(p, p1, sb + 32 * s);
            else
                packed_nibbles16(t, p, p1, s, &qa, &qb);
            const __m512i qu = q8 ? _mm512_xor_si512(qa, flip) : qa; /* the unsigned form: Q8_0's byte + 128 */
#pragma GCC unroll 8
            for (int i = 0; i < NX; i++) {
                const int64_t e = i * K + b * QK + 4 * s;
                const int odd = chains4 && q8 && s % 2, j = i % (TQ_NX / 2); /* Q8_0's odd steps */
                split_step16(odd ? &ph2[j] : &ph[i], odd ? &pl2[j] : &pl[i], qu, qa, x.q + e, x.l + e);
                if (!q8) /* the high nibbles */
                    split_step16(chains4 ? &ph2[j] : &ph[i], chains4 ? &pl2[j] : &pl[i], qb, qb, x.q + e + 16, x.l + e + 16);
                __asm__("" : "+v"(ph[i]), "+v"(pl[i]));
            }
        }
        const __m512 dw = halves16(p, p1);
        split_block_end(acc, ph, pl, ph2, pl2, chains4, NX, dw, packed_mins16(t, p, p1, dw), !q8, x, nb, b);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        __m512 o = acc[i];
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(store, bias));
        _mm512_mask_storeu_ps(out + i * ostride, store, o);
    }
}

/* Packed Q4 or Q8_0 groups at w and w1 (NULL: a lone group, its lanes zero), NX activation rows, no
 * panel: each block's nibbles (Q8_0: its 8 steps, two 32-byte loads each -- q8pack.c's packed layout:
 * group g's step s in lanes 0..7, group g + 1's in 8..15 -- offset to unsigned) go from the packed
 * bytes straight into registers and feed every row (the same integers and float operations as
 * strip_tile, so the same bits; for Q8_0 with no transposes or gathers at any batch). The bytes of
 * the strip at next (Q4: the next one; Q8_0: the one after it) are prefetched meanwhile. */
static inline __attribute__((always_inline)) void strip_direct(const int t, const uint8_t *w, const uint8_t *w1,
                                                               const uint8_t *next, int64_t nb, tq_q8acts x, int64_t K,
                                                               const int NX, const float *bias, float *out,
                                                               int64_t ostride, __mmask16 store) {
    if (x.l) {
        strip_split(t, w, w1, next, nb, x, K, NX, bias, out, ostride, store);
        return;
    }
    const int q8 = packed_q8_0(t), ub = unit_bytes(t), sb = step_offset(t);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TQ_NX];
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 8 * ub, *p1 = w1 ? w1 + b * 8 * ub : NULL;
        prefetch_strip_block(next, nb, b, ub);
        __m512i acc_i[TQ_NX];
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++)
            acc_i[i] = q8 ? _mm512_set1_epi32(-128 * q8_block_sum(x, i * nb + b)) : _mm512_setzero_si512();
        if (q8) {
            __m512i q[8];
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) q[s] = _mm512_xor_si512(packed_bytes16(p, p1, sb + 32 * s), flip);
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++)
#pragma GCC unroll 8
                for (int i = 0; i < NX; i++) {
                    int32_t v;
                    memcpy(&v, x.q + i * K + b * QK + 4 * s, 4);
                    acc_i[i] = _mm512_dpbusd_epi32(acc_i[i], q[s], _mm512_set1_epi32(v));
                }
        } else { /* Q4's steps (t is a constant: one branch is compiled) */
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                __m512i ql, qh;
                packed_nibbles16(t, p, p1, s, &ql, &qh);
#pragma GCC unroll 8
                for (int i = 0; i < NX; i++) {
                    int32_t xl, xh;
                    memcpy(&xl, x.q + i * K + b * QK + 4 * s, 4);
                    memcpy(&xh, x.q + i * K + b * QK + 16 + 4 * s, 4);
                    acc_i[i] = _mm512_dpbusd_epi32(acc_i[i], ql, _mm512_set1_epi32(xl));
                    acc_i[i] = _mm512_dpbusd_epi32(acc_i[i], qh, _mm512_set1_epi32(xh));
                    __asm__("" : "+v"(acc_i[i]));
                }
            }
        }
        const __m512 dw = halves16(p, p1);
        const __m512 mw = packed_mins16(t, p, p1, dw);
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_i[i]), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i * nb + b])),
                                     acc[i]);
            if (!q8) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[i * nb + b]), acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        __m512 o = acc[i];
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(store, bias));
        _mm512_mask_storeu_ps(out + i * ostride, store, o);
    }
}

/* Q8_0 strips (16 rows, or 8 when lone: rows 8..15 zero) straight from the file's rows, NX
 * activation rows, no panel: each block of the 16 rows is loaded (rows j, j + 8 in one register),
 * transposed in registers (transpose16: vector s = bytes 4s .. 4s+3 of every row) and offset to
 * unsigned (+ 128, one xor per step), then fed to every row of the tile with 512-bit vpdpbusd from
 * -128 x the activation block sum: the exact block dots, the same integers as the panel's
 * strip_tile and the plain-C reference; then the same float operations, so the same bits. The pf
 * bytes (the next strip's rows, or none) are prefetched a share per block. */
static inline __attribute__((always_inline)) void q8_0_strip_direct(const uint8_t *w, int64_t rbytes, int lone,
                                                                    int64_t nb, tq_q8acts x, int64_t K, const int NX, const float *bias,
                                                                    float *out, int64_t ostride, __mmask16 store,
                                                                    const uint8_t *pf, int64_t pfbytes) {
    const int ub = unit_bytes(TQ_Q8_0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)rbytes));
    const int gather = !lone && rbytes <= INT32_MAX / SGR;
    const int64_t chunk = (pfbytes / nb + 127) / 64 * 64;
    __m512 acc[TQ_NX];
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_share(pf, pfbytes, chunk, b);
        __m512i r[8], q[8], p[TQ_NX];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) r[j] = two_rows(w, rbytes, j, b * ub + 2, lone);
        transpose16(r, q);
        __m512 dw;
        if (gather) { /* the 16 rows' d, one gather (4 bytes each: d and the first q byte) */
            dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(rows, (const void *)(w + b * ub), 1)));
        } else {
            uint16_t h[SGR] = {0};
            for (int j = 0; j < (lone ? 8 : SGR); j++) memcpy(h + j, w + j * rbytes + b * ub, 2);
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        }
        const int8_t *xb = x.q + b * QK;
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++) p[i] = _mm512_set1_epi32(-128 * q8_block_sum(x, i * nb + b));
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m512i qs = _mm512_xor_si512(q[s], flip);
#pragma GCC unroll 8
            for (int i = 0; i < NX; i++) {
                int32_t v;
                memcpy(&v, xb + i * K + 4 * s, 4);
                p[i] = _mm512_dpbusd_epi32(p[i], qs, _mm512_set1_epi32(v));
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < NX; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[i]), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i * nb + b])), acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NX; i++) {
        __m512 o = acc[i];
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(store, bias));
        _mm512_mask_storeu_ps(out + i * ostride, store, o);
    }
}

/* CALL(NX) on the activation rows m0.. of M, NX = min(M - m0, TQ_NX) a constant in each copy */
#define BY_TILE(CALL)                                                                                  \
    switch (M - m0 < TQ_NX ? (int)(M - m0) : TQ_NX) {                                                  \
        case 1: CALL(1); break;                                                                        \
        case 2: CALL(2); break;                                                                        \
        case 3: CALL(3); break;                                                                        \
        case 4: CALL(4); break;                                                                        \
        case 5: CALL(5); break;                                                                        \
        case 6: CALL(6); break;                                                                        \
        case 7: CALL(7); break;                                                                        \
        default: CALL(TQ_NX); break;                                                                   \
    }

#define QDIRECT(NX) q8_0_strip_direct(w, rbytes, lone, nb, xm, K, NX, bias, out, ldy, store, m0 ? NULL : pf, pfbytes)

/* Every activation row times the Q8_0 strip at w, in direct tiles of TQ_NX rows. */
static void q8_0_direct_rows(const uint8_t *w, int64_t rbytes, int lone, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M, int64_t K, __mmask16 store, const uint8_t *pf,
                             int64_t pfbytes) {
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += TQ_NX) {
        const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
        float *out = y + m0 * ldy;
        BY_TILE(QDIRECT);
    }
}

#define SDIRECT(NX) strip_direct(t, w, w1, m0 ? NULL : next, nb, xm, K, NX, bias, out, ldy, store)

/* Every activation row times the strip of packed groups at w, w1, in direct tiles of TQ_NX rows;
 * t a constant after inlining. */
static inline __attribute__((always_inline)) void direct_rows(const int t, const uint8_t *w, const uint8_t *w1,
                                                              const uint8_t *next, tq_q8acts x, float *y, int64_t ldy, const float *bias,
                                                              int64_t M, int64_t K, __mmask16 store) {
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += TQ_NX) {
        const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
        float *out = y + m0 * ldy;
        BY_TILE(SDIRECT);
    }
}

#define STILE(NX) strip_tile(mode, panel, nb, xm, K, NX, bn, out, ldy, store, m0 ? NULL : pf, pfbytes)

/* Every activation row times the strip's panel, in tiles of TQ_NX rows; mode a constant after inlining. */
static inline __attribute__((always_inline)) void strip_rows_mode(const int mode, const sblock *panel, tq_q8acts x,
                                                                  float *y, int64_t ldy,
                                                                  const float *bn, int64_t M, int64_t K, __mmask16 store,
                                                                  const uint8_t *pf, int64_t pfbytes) {
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += TQ_NX) {
        const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
        float *out = y + m0 * ldy;
        BY_TILE(STILE);
    }
}

static void strip_rows(int mode, const sblock *panel, tq_q8acts x, float *y, int64_t ldy,
                       const float *bn, int64_t M, int64_t K, __mmask16 store, const uint8_t *pf, int64_t pfbytes) {
    switch (mode) {
        case MODE_Q8_0: strip_rows_mode(MODE_Q8_0, panel, x, y, ldy, bn, M, K, store, pf, pfbytes); break;
        case MODE_Q6_K: strip_rows_mode(MODE_Q6_K, panel, x, y, ldy, bn, M, K, store, pf, pfbytes); break;
        default: strip_rows_mode(MODE_MIN, panel, x, y, ldy, bn, M, K, store, pf, pfbytes); break;
    }
}

#endif

int64_t tq_q8_batch_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                         int64_t N, int64_t K) {
#ifdef TQ_ZMM
    const int q8_0 = t == TQ_Q8_0, kq = q8_kquant(t), pq8 = packed_q8_0(t);
    const int pq4 = packed_type(t) || packed_five(t); /* packed Q4_0 / Q4_1 / Q5_0 / Q5_1 */
    /* split 16-bit activations (packed legacy rows: strip_split at every batch; packed Q4_K: its panel)
     * skip AMX */
    const int64_t amx = x.l ? 0 : tq_q8_amx_rows(t, w, x, y, ldy, bias, M, N, K); /* q8amx.c, the amx build */
    if (amx) return amx;
    if (!(pq4 || q8_0 || kq || pq8) || (q8_0 && M < BATCH_MIN_Q8_0) || (kq && M < BATCH_MIN_K)) return 0;
    const int64_t nb = K / QK, rbytes = row_bytes(t, K), groups = N / 8, strips = (groups + 1) / 2;
    const int direct = (pq4 && (M <= DIRECT_MAX_Q4 || x.l)) || (q8_0 && M <= DIRECT_MAX_Q8_0) || pq8;
    const int mode = q8_0 ? MODE_Q8_0 : base_type(t) == TQ_Q6_K ? MODE_Q6_K : MODE_MIN;
#pragma omp parallel
    {
        sblock *panel = direct ? NULL : (sblock *)aligned_alloc(64, (size_t)nb * sizeof(sblock));
        if (panel == NULL && !direct) abort();
#pragma omp for schedule(static)
        for (int64_t st = 0; st < strips; st++) {
            const int64_t g = 2 * st;
            const int lone = g + 1 >= groups;
            const uint8_t *wg = w + g * 8 * rbytes;
            const __mmask16 store = lone ? (__mmask16)0x00ff : (__mmask16)0xffff;
            const float *bs = bias ? bias + g * 8 : NULL;
            if (direct && q8_0) {
                q8_0_direct_rows(wg, rbytes, lone, x, y + g * 8, ldy, bs, M, K, store,
                                 g + 3 < groups ? wg + SGR * rbytes : NULL, SGR * rbytes);
                continue;
            }
            if (direct) { /* packed Q4 / Q8_0: the next strip prefetched (Q8_0: the one after it) */
                const int ahead = pq8 ? 2 : 1;
                const uint8_t *nextw = g + 2 * ahead + 1 < groups ? wg + ahead * SGR * rbytes : NULL;
                if (pq8)
                    direct_rows(TQ_PACKED + TQ_Q8_0, wg, lone ? NULL : wg + 8 * rbytes, nextw, x, y + g * 8, ldy, bs, M, K, store);
                else if (t == TQ_PACKED + TQ_Q4_1)
                    direct_rows(TQ_PACKED + TQ_Q4_1, wg, lone ? NULL : wg + 8 * rbytes, nextw, x, y + g * 8, ldy, bs, M, K, store);
                else if (t == TQ_PACKED + TQ_Q5_0)
                    direct_rows(TQ_PACKED + TQ_Q5_0, wg, lone ? NULL : wg + 8 * rbytes, nextw, x, y + g * 8, ldy, bs, M, K, store);
                else if (t == TQ_PACKED + TQ_Q5_1)
                    direct_rows(TQ_PACKED + TQ_Q5_1, wg, lone ? NULL : wg + 8 * rbytes, nextw, x, y + g * 8, ldy, bs, M, K, store);
                else
                    direct_rows(TQ_PACKED + TQ_Q4_0, wg, lone ? NULL : wg + 8 * rbytes, nextw, x, y + g * 8, ldy, bs, M, K, store);
                continue;
            }
            if (q8_0)
                unpack_q8_0(wg, rbytes, lone ? 8 : SGR, nb, panel);
            else if (base_type(t) == TQ_Q4_K || t == TQ_Q5_K)
                unpack_k4_strip(t, wg, rbytes, lone, nb, panel);
            else if (base_type(t) == TQ_Q6_K)
                unpack_q6k_strip(t, wg, rbytes, lone, nb, panel, 0);
            else
                unpack_packed(t, wg, lone ? NULL : wg + 8 * rbytes, nb, panel);
            strip_rows(mode, panel, x, y + g * 8, ldy, bs, M, K, store, g + 3 < groups ? wg + SGR * rbytes : NULL,
                       SGR * rbytes);
        }
        free(panel);
    }
    return groups * 8;
#else
    (void)t, (void)w, (void)x, (void)y, (void)ldy, (void)bias, (void)M, (void)N, (void)K;
    return 0;
#endif
}
