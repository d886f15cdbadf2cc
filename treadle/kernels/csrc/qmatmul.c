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
 * the libgomp and thread count torch uses). Tiles of 2 weight rows x up to 4 activation rows
 * (8 outputs, lane 2i + r) share each expanded weight block and each loaded activation block:
 *
 *   per block:  unit scales of rows r0, r1 -> msum[8] += m[r] * xs[i]   one vector fma (min_terms;
 *               unpack w[r0], w[r1] (16-bit)                           xs laid out per lane once
 *               for i < 4, r < 2: acc[i][r] += (cvt(w[r] . xq[i]) * d[r]) * xd[i]   per call: xlanes)
 *
 * The minimum terms (Q4_1, Q5_1, K-quants) cost one fma per block and tile instead of one scalar
 * fma per output, and free the registers those held: gcc 12 spills 2 of the 8 accumulators of a
 * Q4_1 tile instead of 6 (Q4_1 at M >= 4 ~1.1x faster; Q8_0 unchanged: docs/benchmarks-archive.md, #16).
 * With the layout's act_bits 8 (TREADLE_ACTIVATION_BITS=8; the default is 16), segments of Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K take q8act.c's 8-bit activations instead (faster;
 * llama.cpp's rounding); Q2_K and Q3_K keep 16-bit ones.
 * Built once per variant (native.py VARIANTS, chosen at load by CPU features): AVX2/FMA/F16C
 * paths, plus vpdpwssd in the avx512-vnni build, or plain C (-DTQ_PLAIN_C, the reference build the
 * tests compare against). ktile.h holds the AVX-512 builds' K-quant tiles; qdequant.c turns rows
 * back into floats (embedding lookups, whole weights).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "qblocks.h"

#define MR 4 /* activation rows per pass over a weight row */
#define LANES (2 * MR) /* a tile's outputs, lane 2i + r: activation row i, weight row r */
#define STREAM_AHEAD 8192 /* bytes: how far ahead batch-1 tiles prefetch the weight rows they stream */

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

typedef struct { /* a block's activation scales for a group of MR rows, each twice: lane 2i + r */
    float s[LANES], h0[LANES], h1[LANES];
} xlanes;

typedef struct { /* one quantized activation matrix */
    const int16_t *q;
    const float *d, *s, *h; /* [M, K/32]; h: [M, K/32, 2] */
    const xlanes *lanes; /* [ceil(M / MR), K/32]: the same scales, laid out for a tile's lanes */
} qacts;

/* Activation rows -> 16-bit blocks: xq [M, K] int16; xd, xs [M, K/32]; xh [M, K/32, 2] float,
 * and the same scales again in lanes (rows past M zero). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs, float *xh,
                          xlanes *lanes) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + (i / nb) * K + (i % nb) * QK;
#ifdef TQ_AVX2 /* the same values as the loop below (tq.h) */
        __m256 xv[4];
        const float amax = block_absmax(xb, xv);
        const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i v[4];
        for (int j = 0; j < 4; j++) v[j] = round_clamp(xv[j], id, 32767);
        int sum[2];
        for (int h = 0; h < 2; h++) {
            /* packs interleave the 128-bit halves: 0 1 | 2 3 -> qwords in order 0 2 1 3 */
            const __m256i p = _mm256_packs_epi32(v[2 * h], v[2 * h + 1]);
            _mm256_storeu_si256((__m256i *)(xq + i * QK + 16 * h), _mm256_permute4x64_epi64(p, 0xd8));
            sum[h] = hsum_epi32(_mm256_add_epi32(v[2 * h], v[2 * h + 1]));
        }
#else
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
#endif
        xd[i] = d;
        xs[i] = d * (float)(sum[0] + sum[1]);
        xh[2 * i] = d * (float)sum[0];
        xh[2 * i + 1] = d * (float)sum[1];
        xlanes *l = lanes + (i / nb / MR) * nb + i % nb;
        for (int r = 0, lane = 2 * (int)(i / nb % MR); r < 2; r++) {
            l->s[lane + r] = xs[i];
            l->h0[lane + r] = xh[2 * i];
            l->h1[lane + r] = xh[2 * i + 1];
        }
    }
}

/* The minimum terms of a block for a tile, added to msum lane 2i + r (activation row i, weight
 * row r): m_r xs_i (or mh xh per half), each one fused multiply-add. Every lane takes the same
 * float operations whether computed alone (NX = 1, plain C) or 8 at once, so a row's result does
 * not depend on the tile it falls in. */
typedef struct {
    float d0[2], d1[2], m[2], mh0[2], mh1[2]; /* per weight row */
} wscales;

static inline __attribute__((always_inline)) void min_terms(int qtype, const wscales *w, qacts x, int64_t nb,
                                                            int64_t b, const int NW, const int NX, float *msum) {
    if (!min_per_block(qtype) && !min_per_half(qtype)) return;
#ifdef TQ_AVX2
    if (NX > 1) { /* 8 lanes at once */
        const int r1 = NW - 1; /* NW = 1: lane 2i + 1 repeats row 0 (unused) */
        const xlanes *l = x.lanes + b;
#define PAIRS(v) _mm256_setr_ps(v[0], v[r1], v[0], v[r1], v[0], v[r1], v[0], v[r1])
        __m256 ms = _mm256_load_ps(msum);
        if (min_per_block(qtype)) ms = _mm256_fmadd_ps(PAIRS(w->m), _mm256_load_ps(l->s), ms);
        if (min_per_half(qtype))
            ms = _mm256_fmadd_ps(PAIRS(w->mh1), _mm256_load_ps(l->h1),
                                 _mm256_fmadd_ps(PAIRS(w->mh0), _mm256_load_ps(l->h0), ms));
#undef PAIRS
        _mm256_store_ps(msum, ms);
        return;
    }
#endif
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) {
            const int64_t xb = i * nb + b;
            float *ms = msum + 2 * i + r;
            if (min_per_block(qtype)) *ms = fmaf(w->m[r], x.s[xb], *ms);
            if (min_per_half(qtype)) *ms = fmaf(w->mh1[r], x.h[2 * xb + 1], fmaf(w->mh0[r], x.h[2 * xb], *ms));
        }
}

/* acc + (w . xq) * xd for one block: the exact integer dot, converted once and scaled by the
 * block's d (d0, d1 per half of 16 for split_scales types); AVX2: in 8 lanes of partial sums. */
#ifdef TQ_AVX2
static inline __attribute__((always_inline)) __m256 block_dot(int qtype, const __m256i w[2], const int16_t *xq,
                                                              float d0, float d1, const float *xd, __m256 acc) {
    /* activations loaded per use: madd's memory operand, no registers held */
    const __m256i lo = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)xq));
    const __m256 flo = _mm256_cvtepi32_ps(split_scales(qtype) ? lo : block_sum(lo, w[1], xq));
    __m256 t = _mm256_mul_ps(flo, _mm256_set1_ps(d0));
    if (split_scales(qtype)) {
        const __m256i hi = _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(xq + 16)));
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(d1), t);
    }
    return _mm256_fmadd_ps(t, _mm256_broadcast_ss(xd), acc);
}
#else
static inline __attribute__((always_inline)) float block_dot(int qtype, const int q[QK], const int16_t *xq, float d0,
                                                             float d1, const float *xd, float acc) {
    int lo = 0, hi = 0;
    for (int j = 0; j < 16; j++) {
        lo += q[j] * xq[j];
        hi += q[j + 16] * xq[j + 16];
    }
    const float t = split_scales(qtype) ? (float)lo * d0 + (float)hi * d1 : (float)(lo + hi) * d0;
    return acc + t * *xd;
}
#endif

/* block s's scales of the unit's rows (sc[r]), as min_terms and block_dot take them */
static inline __attribute__((always_inline)) wscales block_scales(int qtype, const unit_scales_t sc[2], int s,
                                                                  const int NW) {
    wscales ws;
    for (int r = 0; r < NW; r++) {
        ws.d0[r] = sc[r].d[scale_index(qtype, s, 0)];
        ws.d1[r] = sc[r].d[scale_index(qtype, s, 1)];
        ws.m[r] = min_per_block(qtype) ? sc[r].m[s] : 0.0f;
        ws.mh0[r] = min_per_half(qtype) ? sc[r].mh[2 * s] : 0.0f;
        ws.mh1[r] = min_per_half(qtype) ? sc[r].mh[2 * s + 1] : 0.0f;
    }
    return ws;
}

#include "ktile.h"

/* A tile of NW weight rows (at most 2) times NX activation rows (at most MR):
 * out[i * ostride + r] = row r . (x row i) + bias[r]. Every output is accumulated the same way
 * whatever the tile's shape (block_dot per block; the minimum terms apart, min_terms), so results
 * do not depend on M or on where a row falls in a tile. */
static inline __attribute__((always_inline)) void tile(int qtype, const uint8_t *row, int64_t rbytes, int64_t nb,
                                                        qacts x, const int NW, const int NX, const float *bias,
                                                        float *out, int64_t ostride) {
#ifdef TQ_K512
    if (is_k_quant(qtype)) {
        ktile(qtype, row, rbytes, nb, x, NW, NX, bias, out, ostride);
        return;
    }
#endif
    const int G = unit_blocks(qtype), ub = unit_bytes(qtype);
    float msum[LANES] __attribute__((aligned(32))) = {0.0f};
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
            /* batch 1 streams weights: a line once per cache line, STREAM_AHEAD bytes ahead (the
             * 32-element types; one row pair ahead, 0.9-1.4 KB, is less than memory's latency at
             * one thread's rate: Q8_0 262144 x 640 at M = 1 1.17-1.26x faster, kernels.md) */
            if (NX == 1 && (u * ub) % 64 < ub)
                __builtin_prefetch(unit[r] + (is_k_quant(qtype) ? 2 * rbytes : STREAM_AHEAD));
        }
        for (int s = 0; s < G; s++) {
            const int64_t b = u * G + s;
            const wscales ws = block_scales(qtype, sc, s, NW);
            min_terms(qtype, &ws, x, nb, b, NW, NX, msum);
#ifdef TQ_AVX2
            __m256i w[2][2];
            for (int r = 0; r < NW; r++) block_weights(qtype, unit[r], s, w[r]);
#else
            int w[2][QK];
            for (int r = 0; r < NW; r++) block_ints(qtype, unit[r], s, w[r]);
#endif
            for (int i = 0; i < NX; i++)
                for (int r = 0; r < NW; r++)
                    acc[i][r] = block_dot(qtype, w[r], x.q + (i * nb + b) * QK, ws.d0[r], ws.d1[r], x.d + i * nb + b,
                                          acc[i][r]);
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) {
#ifdef TQ_AVX2
            const float a = hsum(acc[i][r]);
#else
            const float a = acc[i][r];
#endif
            out[i * ostride + r] = a + msum[2 * i + r] + (bias ? bias[r] : 0.0f);
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
        const qacts xm = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * nb, x.h + 2 * m0 * nb, x.lanes + m0 / MR * nb};
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
                const qacts xi = {xm.q + i * K, xm.d + i * nb, xm.s + i * nb, xm.h + 2 * i * nb, NULL};
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
    int use8[TQ_MAX_SEGMENTS] = {0}, split[TQ_MAX_SEGMENTS] = {0}, any16 = 0, any8 = 0, anysplit = 0;
    for (int s = 0; s < layout->count; s++) {
        const int t = layout->qtype[s];
        if (t == TQ_W_BF16) continue; /* takes x as it is */
        /* packed legacy and Q4_K rows at 16 bits: the same 16-bit values, split in two bytes for q8act.c */
        split[s] = layout->act_bits == 16 && packed_split16(t);
        use8[s] = !split[s] && tq_q8_type(t) && (layout->act_bits == 8 || is_packed(t));
        any8 |= use8[s];
        anysplit |= split[s];
        any16 |= !use8[s] && !split[s];
    }
    int16_t *xq = NULL;
    float *xf = NULL;
    xlanes *lanes = NULL;
    qacts xa = {0};
    if (any16) {
        xq = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
        xf = (float *)malloc((size_t)(4 * M * nb) * sizeof(float)); /* xd | xs | xh (2 per block) */
        lanes = (xlanes *)aligned_alloc(32, (size_t)((M + MR - 1) / MR * nb) * sizeof(xlanes));
        memset(lanes, 0, (size_t)((M + MR - 1) / MR * nb) * sizeof(xlanes));
        quantize_rows(x, M, K, xq, xf, xf + M * nb, xf + 2 * M * nb, lanes);
        xa = (qacts){xq, xf, xf + M * nb, xf + 2 * M * nb, lanes};
    }
    const tq_q8acts x8 = any8 ? tq_q8_quantize(x, M, K) : (tq_q8acts){0};
    const tq_q8acts xs = anysplit ? tq_q16_split(x, M, K) : (tq_q8acts){0};
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
        if (use8[s] || split[s])
            tq_q8_rows(qtype, w, split[s] ? xs : x8, y + n0, N, bias ? bias + n0 : NULL, M, rows, K, layout->small_256);
        else
            weight_rows(qtype, w, xa, y + n0, N, bias ? bias + n0 : NULL, M, rows, K);
        w += rows * row_bytes(qtype, K);
        n0 += rows;
    }
    if (any8) tq_q8_free(x8);
    if (anysplit) tq_q8_free(xs);
    free(xq);
    free(xf);
    free(lanes);
}
