/* GGUF block-quantized weights times float32 activations, on the CPU.
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])      W stored as GGUF rows (qblocks.h: Q4_0, Q4_1,
 *                                                  Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K)
 *
 * Each activation row is first quantized to 16 bits per block of 32 (xd = max|x| / 32767,
 * xq = round(x / xd): a relative rounding of at most 2^-16 of the block's largest value,
 * 256 times finer than the 8 bits llama.cpp uses, so greedy outputs match the float
 * model's), and a block's dot product becomes integer arithmetic (AVX2: weights widened
 * to 16 bits, two madd for 32 multiply-adds), scaled once per block of 32 -- or once per
 * half of 16 for the K-quants whose sub-scales cover 16 elements (Q2_K, Q3_K, Q6_K):
 *
 *   y[m, n] = sum_b  xd_b (d_b0 (q . xq)[0:16] + d_b1 (q . xq)[16:32])  +  m_b xs_b  (+ mh xh)
 *
 *   xs_b = xd_b * sum(xq_b), xh_b = xd_b * (sum of each half): the minimum terms (qblocks.h).
 *
 * That is exactly the dequantized weight times the 16-bit-rounded activation, summed in
 * float32 in block order. The K-quants' 256-element super-blocks change only where the scales
 * come from (decoded once per super-block and row), not the activation blocks, so every type
 * shares one quantized copy of x and a fused layer may mix types (tq_layout segments).
 * Every output is computed by the same code whatever M is and whichever thread takes it, so a
 * row's result does not depend on the batch it is in. Threads split the weight rows (OpenMP,
 * the libgomp and thread count torch uses); tiles of 2 weight rows x up to 4 activation rows
 * share each expanded weight block and each loaded activation block.
 * With the layout's act_bits 8 (TREADLE_ACTIVATION_BITS, the default), segments of Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0 take q8act.c's 8-bit activations instead (faster; llama.cpp's rounding).
 * Built once per variant (native.py VARIANTS, chosen at load by CPU features): AVX2/FMA/F16C
 * paths, plus vpdpwssd in the avx512-vnni build, or plain C (-DTQ_PLAIN_C, the reference build the
 * tests compare against).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "qblocks.h"

#define MR 4 /* activation rows per pass over a weight row */

#ifdef TQ_AVX2
/* lo + (the second half's 16-bit products, pairs summed): one vpdpwssd in the avx512-vnni build,
 * a multiply-add and an add otherwise; the same exact integers either way */
static inline __attribute__((always_inline)) __m256i block_sum(__m256i lo, __m256i w1, const int16_t *xq) {
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
#ifdef TQ_VNNI
    return _mm256_dpwssd_epi32(lo, w1, x1);
#else
    return _mm256_add_epi32(lo, _mm256_madd_epi16(w1, x1));
#endif
}
#endif

/* Activation rows -> 16-bit blocks: xq [M, K] int16; xd, xs [M, K/32]; xh [M, K/32, 2] float. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs, float *xh) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + (i / nb) * K + (i % nb) * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum[2] = {0, 0};
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(xb[j] * id);
            q = q > 32767 ? 32767 : q < -32767 ? -32767 : q;
            xq[i * QK + j] = (int16_t)q;
            sum[j / 16] += q;
        }
        xd[i] = d;
        xs[i] = d * (float)(sum[0] + sum[1]);
        xh[2 * i] = d * (float)sum[0];
        xh[2 * i + 1] = d * (float)sum[1];
    }
}

typedef struct { /* one quantized activation matrix */
    const int16_t *q;
    const float *d, *s, *h;
} qacts;

/* A tile of NW weight rows (at most 2) times NX activation rows (at most MR):
 * out[i * ostride + r] = row r . (x row i) + bias[r]. Every output is accumulated the same
 * way whatever the tile's shape (per block: t = float(q . xq) * d, acc += t * xd; the
 * minimum terms summed apart), so results do not depend on M or on where a row falls in a tile. */
static inline __attribute__((always_inline)) void tile(int qtype, const uint8_t *row, int64_t rbytes, int64_t nb,
                                                        qacts x, const int NW, const int NX, const float *bias,
                                                        float *out, int64_t ostride) {
    const int G = unit_blocks(qtype), ub = unit_bytes(qtype);
    float msum[MR][2] = {{0.0f}};
#ifdef TQ_AVX2
    __m256 acc[MR][2];
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) acc[i][r] = _mm256_setzero_ps();
#else
    float acc[MR][2] = {{0.0f}};
#endif
    for (int64_t u = 0; u < nb / G; u++) {
        unit_scales_t sc[2];
        const uint8_t *unit[2];
        for (int r = 0; r < NW; r++) {
            unit[r] = row + r * rbytes + u * ub;
            unit_scales(qtype, unit[r], &sc[r]);
            /* batch 1 streams weights: the next row pair's line, once per cache line, one pair ahead */
            if (NX == 1 && (u * ub) % 64 < ub) __builtin_prefetch(unit[r] + 2 * rbytes);
        }
        for (int s = 0; s < G; s++) {
            const int64_t b = u * G + s;
#ifdef TQ_AVX2
            __m256i w[2][2];
            __m256 d0[2], d1[2];
            for (int r = 0; r < NW; r++) {
                block_weights(qtype, unit[r], s, w[r]);
                d0[r] = _mm256_set1_ps(sc[r].d[scale_index(qtype, s, 0)]);
                d1[r] = _mm256_set1_ps(sc[r].d[scale_index(qtype, s, 1)]);
            }
#else
            int q[2][QK];
            for (int r = 0; r < NW; r++) block_ints(qtype, unit[r], s, q[r]);
#endif
            for (int i = 0; i < NX; i++) {
                const int64_t xb = i * nb + b;
                const int16_t *xq = x.q + xb * QK;
#ifdef TQ_AVX2
                const __m256 vx = _mm256_broadcast_ss(x.d + xb);
#endif
                for (int r = 0; r < NW; r++) {
#ifdef TQ_AVX2
                    /* activations loaded per use: madd's memory operand, no registers held (8 accumulators) */
                    const __m256i lo = _mm256_madd_epi16(w[r][0], _mm256_loadu_si256((const __m256i *)xq));
                    const __m256i hi = split_scales(qtype)
                        ? _mm256_madd_epi16(w[r][1], _mm256_loadu_si256((const __m256i *)(xq + 16)))
                        : lo;
                    const __m256 t = split_scales(qtype)
                        ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), d1[r], _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d0[r]))
                        : _mm256_mul_ps(_mm256_cvtepi32_ps(block_sum(lo, w[r][1], xq)), d0[r]);
                    acc[i][r] = _mm256_fmadd_ps(t, vx, acc[i][r]);
#else
                    int lo = 0, hi = 0;
                    for (int j = 0; j < 16; j++) {
                        lo += q[r][j] * xq[j];
                        hi += q[r][j + 16] * xq[j + 16];
                    }
                    const float d0 = sc[r].d[scale_index(qtype, s, 0)], d1 = sc[r].d[scale_index(qtype, s, 1)];
                    const float t = split_scales(qtype) ? (float)lo * d0 + (float)hi * d1 : (float)(lo + hi) * d0;
                    acc[i][r] += t * x.d[xb];
#endif
                    if (min_per_block(qtype)) msum[i][r] += sc[r].m[s] * x.s[xb];
                    if (min_per_half(qtype))
                        msum[i][r] += sc[r].mh[2 * s] * x.h[2 * xb] + sc[r].mh[2 * s + 1] * x.h[2 * xb + 1];
                }
            }
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) {
#ifdef TQ_AVX2
            const float a = hsum(acc[i][r]);
#else
            const float a = acc[i][r];
#endif
            out[i * ostride + r] = a + msum[i][r] + (bias ? bias[r] : 0.0f);
        }
}

#define TILE_CASE(NW, NX) tile(qtype, row, rbytes, nb, xm, NW, NX, bias, out, ldy)

/* Weight rows n, n + 1 (nw of them) times every activation row; qtype is a constant after
 * inlining, so each type gets its own unrolled tiles. */
static inline __attribute__((always_inline)) void row_pair(const int qtype, const uint8_t *row, qacts x, float *y,
                                                            int64_t ldy, const float *bias, int nw, int64_t M,
                                                            int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(qtype, K);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const qacts xm = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * nb, x.h + 2 * m0 * nb};
        float *out = y + m0 * ldy;
        const int nx = M - m0 < MR ? (int)(M - m0) : MR;
        if (nw == 2) { /* constant tile shapes: unrolled, in registers */
            switch (nx) {
                case 1: TILE_CASE(2, 1); break;
                case 2: TILE_CASE(2, 2); break;
                case 3: TILE_CASE(2, 3); break;
                default: TILE_CASE(2, MR); break;
            }
        } else { /* a segment's odd last row: one activation row at a time (same sums, less code) */
            for (int i = 0; i < nx; i++) {
                const qacts xi = {xm.q + i * K, xm.d + i * nb, xm.s + i * nb, xm.h + 2 * i * nb};
                tile(qtype, row, rbytes, nb, xi, 1, 1, bias, out + i * ldy, ldy);
            }
        }
    }
}

#define TYPE_CASE(T) case T: row_pair(T, row, x, out, ldy, bn, nw, M, K); break

/* y[:, 0:N) (row stride ldy) for the N weight rows of one block type, pairs of rows split
 * over the threads; the type switch sits outside the tiles' loops. */
static void weight_rows(int qtype, const uint8_t *w, qacts x, float *y, int64_t ldy, const float *bias, int64_t M,
                        int64_t N, int64_t K) {
    const int64_t rbytes = row_bytes(qtype, K);
#pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < (N + 1) / 2; pair++) {
        const int64_t n = 2 * pair;
        const uint8_t *row = w + n * rbytes;
        const float *bn = bias ? bias + n : NULL;
        float *out = y + n;
        const int nw = N - n < 2 ? 1 : 2;
        switch (qtype) {
            TYPE_CASE(TQ_Q4_0); TYPE_CASE(TQ_Q4_1); TYPE_CASE(TQ_Q5_0); TYPE_CASE(TQ_Q5_1); TYPE_CASE(TQ_Q8_0);
            TYPE_CASE(TQ_Q2_K); TYPE_CASE(TQ_Q3_K); TYPE_CASE(TQ_Q4_K); TYPE_CASE(TQ_Q5_K); TYPE_CASE(TQ_Q6_K);
            default: break;
        }
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias), W's N rows in the layout's segments. K must be a multiple
 * of each segment type's block (32, or 256 for the K-quants; 8 for bfloat16 rows, which take x
 * unrounded, float32 products summed in bf16matmul.c's order). With act_bits 8, the segments of
 * the types q8act.c reads take 8-bit activations, the others 16-bit ones (each quantized once). */
void tq_matmul(const tq_layout *layout, const uint8_t *w, const float *x, float *y, const float *bias, int64_t M,
               int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    int use8[TQ_MAX_SEGMENTS] = {0}, any16 = 0, any8 = 0;
    for (int s = 0; s < layout->count; s++) {
        if (layout->qtype[s] == TQ_W_BF16) continue; /* takes x as it is */
        use8[s] = layout->act_bits == 8 && K <= TQ_Q8_MAX_K && tq_q8_type(layout->qtype[s]);
        any8 |= use8[s];
        any16 |= !use8[s];
    }
    int16_t *xq = NULL;
    float *xf = NULL;
    qacts xa = {0};
    if (any16) {
        xq = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
        xf = (float *)malloc((size_t)(4 * M * nb) * sizeof(float)); /* xd | xs | xh (2 per block) */
        quantize_rows(x, M, K, xq, xf, xf + M * nb, xf + 2 * M * nb);
        xa = (qacts){xq, xf, xf + M * nb, xf + 2 * M * nb};
    }
    const tq_q8acts x8 = any8 ? tq_q8_quantize(x, M, K) : (tq_q8acts){0};
    int64_t n0 = 0;
    for (int s = 0; s < layout->count; s++) {
        const int qtype = layout->qtype[s];
        const int64_t rows = layout->rows[s];
        if (qtype == TQ_W_BF16) {
            tq_bf16_rows((const uint16_t *)w, x, 0, y + n0, 0, N, bias ? bias + n0 : NULL, M, rows, K);
            w += rows * K * 2;
            n0 += rows;
            continue;
        }
        if (use8[s])
            tq_q8_rows(qtype, w, x8, y + n0, N, bias ? bias + n0 : NULL, M, rows, K);
        else
            weight_rows(qtype, w, xa, y + n0, N, bias ? bias + n0 : NULL, M, rows, K);
        w += rows * row_bytes(qtype, K);
        n0 += rows;
    }
    if (any8) tq_q8_free(x8);
    free(xq);
    free(xf);
}

/* One row of K inputs -> K floats (exactly the gguf package's values). */
static void dequant_row(int qtype, const uint8_t *row, float *out, int64_t K) {
    const int G = unit_blocks(qtype), ub = unit_bytes(qtype);
    for (int64_t u = 0; u < K / (QK * G); u++, row += ub) {
        unit_scales_t sc;
        unit_scales(qtype, row, &sc);
        for (int b = 0; b < G; b++, out += QK) {
            int q[QK];
            block_ints(qtype, row, b, q);
            for (int j = 0; j < QK; j++) {
                const float m = min_per_block(qtype) ? sc.m[b] : min_per_half(qtype) ? sc.mh[2 * b + j / 16] : 0.0f;
                out[j] = sc.d[scale_index(qtype, b, j / 16)] * (float)q[j] + m;
            }
        }
    }
}

/* out [n, K] = the rows ids[0..n) of W, dequantized (an embedding lookup). */
void tq_gather_rows(int qtype, const uint8_t *w, const int64_t *ids, int64_t n, int64_t K, float *out) {
    const int64_t rbytes = row_bytes(qtype, K);
#pragma omp parallel for schedule(static) if (n > 16)
    for (int64_t i = 0; i < n; i++) dequant_row(qtype, w + ids[i] * rbytes, out + i * K, K);
}

/* out [N, K] = W dequantized. */
void tq_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t rbytes = row_bytes(qtype, K);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) dequant_row(qtype, w + r * rbytes, out + r * K, K);
}
