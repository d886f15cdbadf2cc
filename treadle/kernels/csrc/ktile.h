/* qmatmul.c's K-quant tiles in the AVX-512 builds (ktile). Included once, by qmatmul.c, after its
 * activation and scale types. */
#ifndef TQ_KTILE_H
#define TQ_KTILE_H

#if defined(TQ_AVX2) && defined(__AVX512BW__)
#define TQ_K512 1
/* The K-quants in the AVX-512 builds. Per super-block (unit) and (activation row i, weight row r),
 * the scales times the activation scales, dx = d * xd (8 floats, or 16 for the types scaled per
 * half of 16), and the minimum terms in lanes, macc += m * xs (mh * xh per half for Q2_K). Per
 * block, its 32 products in one 512-bit multiply-add (16 int32 lanes, pairs summed: lanes 0..7 the
 * first half of 16, 8..15 the second), converted and fused into a 16-lane accumulator:
 *
 *   acc[l] = fma(float(lane l), dx(block, half of l), acc[l])     y = reduce(acc) + reduce(macc) (+ bias)
 *
 * Three vector instructions per block and pair of rows besides unpacking the weights, against
 * about a dozen with the scalar scale and minimum handling of the 8-lane form. The same
 * operations for every (i, r) of every tile shape, so a row's result does not depend on the batch;
 * a sum of the same exact block products as the plain-C reference's, scaled in another order
 * (its 1e-5 contract). */
static inline __attribute__((always_inline)) void ktile(int qtype, const uint8_t *row, int64_t rbytes, int64_t nb,
                                                         qacts x, const int NW, const int NX, const float *bias,
                                                         float *out, int64_t ostride) {
    const int ub = unit_bytes(qtype), split = split_scales(qtype);
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc[MR][2], macc[MR][2], dx[MR][2];
    float dxs[MR][2][8] __attribute__((aligned(32))); /* dx in memory where one scale covers a block: a
                                                         broadcast load each, off the shuffle port */
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) acc[i][r] = macc[i][r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < nb / 8; u++) {
        unit_scales_t sc[2];
        __m256 d8[2], m8[2]; /* sc's d and m where they are 8 */
        const uint8_t *unit[2];
        for (int r = 0; r < NW; r++) {
            unit[r] = row + r * rbytes + u * ub;
            /* batch 1 streams: every line of the unit two row pairs ahead (a unit spans 2 to 4 lines;
             * 1.1-1.3x over the next pair's first line alone, 345 MB of Q4_K at 1 thread) */
            if (NX == 1)
                for (int off = 0; off < ub; off += 64) __builtin_prefetch(unit[r] + 4 * rbytes + off);
            if (qtype == TQ_Q4_K || qtype == TQ_Q5_K) {
                k4_scale_vectors(unit[r], &d8[r], &m8[r]);
                continue;
            }
            unit_scales(qtype, unit[r], &sc[r]);
            d8[r] = _mm256_loadu_ps(sc[r].d);
            m8[r] = _mm256_setzero_ps();
        }
        for (int i = 0; i < NX; i++) {
            const int64_t b0 = i * nb + u * 8;
            const __m256 xd = _mm256_loadu_ps(x.d + b0);
            for (int r = 0; r < NW; r++) {
                if (split) /* dx per half: d[2s + h] * xd[s] */
                    dx[i][r] = _mm512_mul_ps(_mm512_loadu_ps(sc[r].d), _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(xd)));
                else
                    _mm256_store_ps(dxs[i][r], _mm256_mul_ps(d8[r], xd));
                if (min_per_block(qtype))
                    macc[i][r] = _mm512_fmadd_ps(_mm512_zextps256_ps512(m8[r]),
                                                 _mm512_zextps256_ps512(_mm256_loadu_ps(x.s + b0)), macc[i][r]);
                if (min_per_half(qtype))
                    macc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(sc[r].mh), _mm512_loadu_ps(x.h + 2 * b0), macc[i][r]);
            }
        }
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            __m512i w[2];
            for (int r = 0; r < NW; r++) w[r] = kblock_words(qtype, unit[r], s);
            /* split: block s's two halves' scales in lanes 0..7 and 8..15 */
            const __m512i pick = _mm512_setr_epi32(2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s + 1,
                                                   2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1,
                                                   2 * s + 1);
            for (int i = 0; i < NX; i++) {
                const __m512i xq = _mm512_loadu_si512((const void *)(x.q + (i * nb + u * 8 + s) * QK));
                for (int r = 0; r < NW; r++) {
                    const __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w[r], xq));
                    const __m512 scale = split ? _mm512_permutexvar_ps(pick, dx[i][r]) : _mm512_set1_ps(dxs[i][r][s]);
                    acc[i][r] = _mm512_fmadd_ps(p, scale, acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) {
            float y = _mm512_reduce_add_ps(acc[i][r]);
            if (min_per_block(qtype) || min_per_half(qtype)) y += _mm512_reduce_add_ps(macc[i][r]);
            out[i * ostride + r] = y + (bias ? bias[r] : 0.0f);
        }
}
#endif

#endif
