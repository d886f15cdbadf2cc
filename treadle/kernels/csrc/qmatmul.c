/* GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) times float32 activations, on the CPU.
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])      W stored as GGUF rows of 32-input blocks
 *
 * Each activation row is first quantized to 16 bits per block of 32 (xd = max|x| / 32767,
 * xq = round(x / xd): a relative rounding of at most 2^-16 of the block's largest value,
 * 256 times finer than the 8 bits llama.cpp uses, so greedy outputs match the float
 * model's), and a block's dot product becomes integer arithmetic (AVX2: weights widened
 * to 16 bits, two madd for 32 multiply-adds), scaled once per block:
 *
 *   y[m, n] = sum_b  d_b xd_b (q_b . xq_b)  +  m_b xs_b       xs_b = xd_b * sum(xq_b)
 *
 * with m_b = -8 d_b for Q4_0 and 0 for Q8_0. That is exactly the dequantized weight
 * times the 16-bit-rounded activation, summed in float32 in block order. Every output is computed by the same
 * code whatever M is and whichever thread takes it, so a row's result does not depend
 * on the batch it is in. Threads split the weight rows (OpenMP, the libgomp and thread
 * count torch uses); tiles of 2 weight rows x up to 4 activation rows share each expanded
 * weight block and each loaded activation block.
 * Built with -march=native: AVX2/FMA/F16C paths where the CPU has them, plain C otherwise.
 *
 * Block layouts (little-endian, d and m float16):
 *   Q4_0 (18 B): d | qs[16]        w[j] = d * ((qs[j] & 15) - 8),  w[j+16] = d * ((qs[j] >> 4) - 8)
 *   Q4_1 (20 B): d | m | qs[16]    w[j] = d * (qs[j] & 15) + m,    w[j+16] = d * (qs[j] >> 4) + m
 *   Q8_0 (34 B): d | qs[32] int8   w[j] = d * qs[j]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "tq.h"

enum { TQ_Q4_0 = 0, TQ_Q4_1 = 1, TQ_Q8_0 = 2 };
#define QK 32
#define MR 4 /* activation rows per pass over a weight row */

static inline int block_bytes(int qtype) { return qtype == TQ_Q4_0 ? 18 : qtype == TQ_Q4_1 ? 20 : 34; }

static inline float half_to_float(const uint8_t *p) {
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

/* One row of K inputs (K / 32 blocks) -> K floats. */
static void dequant_row(int qtype, const uint8_t *row, float *out, int64_t K) {
    const int bb = block_bytes(qtype);
    for (int64_t b = 0; b < K / QK; b++, row += bb, out += QK) {
        const float d = half_to_float(row);
        if (qtype == TQ_Q8_0) {
            const int8_t *q = (const int8_t *)(row + 2);
#ifdef TQ_AVX2
            const __m256 vd = _mm256_set1_ps(d);
            for (int j = 0; j < QK; j += 8) {
                __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
                _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(v), vd));
            }
#else
            for (int j = 0; j < QK; j++) out[j] = d * (float)q[j];
#endif
            continue;
        }
        const uint8_t *qs = row + (qtype == TQ_Q4_0 ? 2 : 4);
        const float m = qtype == TQ_Q4_0 ? -8.0f * d : half_to_float(row + 2);
#ifdef TQ_AVX2
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        _mm256_storeu_ps(out + 0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm));
        _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm));
        _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm));
#else
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(qs[j] & 15) + m;
            out[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
#endif
    }
}

/* Activation rows -> 16-bit blocks: xq [M, K] int16, xd and xs [M, K/32] float. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + (i / nb) * K + (i % nb) * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(xb[j] * id);
            q = q > 32767 ? 32767 : q < -32767 ? -32767 : q;
            xq[i * QK + j] = (int16_t)q;
            sum += q;
        }
        xd[i] = d;
        xs[i] = d * (float)sum;
    }
}

#ifdef TQ_AVX2
/* A weight block's 32 integers widened to 16 bits: w[0] = elements 0..15, w[1] = 16..31. */
static inline void block_weights(int qtype, const uint8_t *blk, __m256i w[2]) {
    if (qtype == TQ_Q8_0) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (qtype == TQ_Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(15);
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
}

static inline __m256i dot_i32(const __m256i w[2], const int16_t *xq) { /* 8 partial sums */
    const __m256i a = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)xq));
    const __m256i b = _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(xq + 16)));
    return _mm256_add_epi32(a, b);
}

#else
static inline int dot_scalar(int qtype, const uint8_t *blk, const int16_t *xq) {
    int s = 0;
    if (qtype == TQ_Q8_0) {
        for (int j = 0; j < QK; j++) s += (int)((const int8_t *)(blk + 2))[j] * xq[j];
        return s;
    }
    const uint8_t *qs = blk + (qtype == TQ_Q4_0 ? 2 : 4);
    for (int j = 0; j < 16; j++) s += (qs[j] & 15) * xq[j] + (qs[j] >> 4) * xq[j + 16];
    return s;
}
#endif

/* A tile of NW weight rows (at most 2) times NX activation rows (at most MR):
 * out[i * ostride + r] = row r . (x row i) + bias[r]. Every output is accumulated the same
 * way whatever the tile's shape (per block: t = float(q . xq) * d, acc += t * xd; m xs summed
 * apart), so results do not depend on M or on where a row falls in a tile. */
static inline __attribute__((always_inline)) void tile(int qtype, const uint8_t *row, int64_t row_bytes,
                                                        int64_t nb, const int16_t *xq, const float *xd,
                                                        const float *xs, const int NW, const int NX,
                                                        const float *bias, float *out, int64_t ostride) {
    const int bb = block_bytes(qtype);
    float msum[MR][2] = {{0.0f}};
#ifdef TQ_AVX2
    __m256 acc[MR][2];
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < NW; r++) acc[i][r] = _mm256_setzero_ps();
#else
    float acc[MR][2] = {{0.0f}};
#endif
    for (int64_t b = 0; b < nb; b++) {
        float d[2], m[2];
#ifdef TQ_AVX2
        __m256i w[2][2];
        __m256 vd[2];
#endif
        for (int r = 0; r < NW; r++) {
            const uint8_t *blk = row + r * row_bytes + b * bb;
            d[r] = half_to_float(blk);
            m[r] = qtype == TQ_Q4_0 ? -8.0f * d[r] : qtype == TQ_Q4_1 ? half_to_float(blk + 2) : 0.0f;
#ifdef TQ_AVX2
            block_weights(qtype, blk, w[r]);
            vd[r] = _mm256_set1_ps(d[r]);
#endif
        }
        for (int i = 0; i < NX; i++) {
            const int64_t xb = i * nb + b;
#ifdef TQ_AVX2
            const __m256 vx = _mm256_broadcast_ss(xd + xb);
#endif
            for (int r = 0; r < NW; r++) {
#ifdef TQ_AVX2
                const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_i32(w[r], xq + xb * QK)), vd[r]);
                acc[i][r] = _mm256_fmadd_ps(t, vx, acc[i][r]);
#else
                const float t = (float)dot_scalar(qtype, row + r * row_bytes + b * bb, xq + xb * QK) * d[r];
                acc[i][r] += t * xd[xb];
#endif
                msum[i][r] += m[r] * xs[xb];
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

#define TILE_CASE(NW, NX) tile(qtype, row, row_bytes, nb, q, d, s, NW, NX, bn, out, N)

/* y for every weight row, pairs of rows at a time; qtype is a constant after inlining. */
static inline __attribute__((always_inline)) void weight_rows(const int qtype, const uint8_t *w, const int16_t *xq,
                                                               const float *xd, const float *xs, float *y,
                                                               const float *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(qtype);
#pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < (N + 1) / 2; pair++) {
        const int64_t n = 2 * pair;
        const uint8_t *row = w + n * row_bytes;
        const float *bn = bias ? bias + n : NULL;
        const int nw = N - n < 2 ? 1 : 2;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int16_t *q = xq + m0 * K;
            const float *d = xd + m0 * nb, *s = xs + m0 * nb;
            float *out = y + m0 * N + n;
            const int nx = M - m0 < MR ? (int)(M - m0) : MR;
            if (nw == 2) { /* constant tile shapes: unrolled, in registers */
                switch (nx) {
                    case 1: TILE_CASE(2, 1); break;
                    case 2: TILE_CASE(2, 2); break;
                    case 3: TILE_CASE(2, 3); break;
                    default: TILE_CASE(2, MR); break;
                }
            } else {
                switch (nx) {
                    case 1: TILE_CASE(1, 1); break;
                    case 2: TILE_CASE(1, 2); break;
                    case 3: TILE_CASE(1, 3); break;
                    default: TILE_CASE(1, MR); break;
                }
            }
        }
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias). K must be a multiple of 32. */
void tq_matmul(int qtype, const uint8_t *w, const float *x, float *y, const float *bias, int64_t M, int64_t N,
               int64_t K) {
    const int64_t nb = K / QK;
    int16_t *xq = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float *xd = (float *)malloc((size_t)(M * nb) * sizeof(float)), *xs = (float *)malloc((size_t)(M * nb) * sizeof(float));
    quantize_rows(x, M, K, xq, xd, xs);
    if (qtype == TQ_Q4_0) weight_rows(TQ_Q4_0, w, xq, xd, xs, y, bias, M, N, K);
    else if (qtype == TQ_Q4_1) weight_rows(TQ_Q4_1, w, xq, xd, xs, y, bias, M, N, K);
    else weight_rows(TQ_Q8_0, w, xq, xd, xs, y, bias, M, N, K);
    free(xq);
    free(xd);
    free(xs);
}

/* out [n, K] = the rows ids[0..n) of W, dequantized (an embedding lookup). */
void tq_gather_rows(int qtype, const uint8_t *w, const int64_t *ids, int64_t n, int64_t K, float *out) {
    const int64_t row_bytes = K / QK * block_bytes(qtype);
#pragma omp parallel for schedule(static) if (n > 16)
    for (int64_t i = 0; i < n; i++) dequant_row(qtype, w + ids[i] * row_bytes, out + i * K, K);
}

/* out [N, K] = W dequantized. */
void tq_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t row_bytes = K / QK * block_bytes(qtype);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) dequant_row(qtype, w + r * row_bytes, out + r * K, K);
}
