/* GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) times float32 activations, on the CPU.
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])      W stored as GGUF rows of 32-input blocks
 *
 * Weights are dequantized on the fly, four rows at a time, into a small float panel that
 * stays in L1; the panel is then multiplied with every activation row (two rows at a time:
 * 2 x 4 accumulators), each output computed whole. Activations are walked in blocks of MC rows so that a block stays in
 * L2 while every panel passes over it. Work is split over output rows with OpenMP, the same
 * runtime (libgomp) and thread count as torch's. Built with -march=native: AVX2/FMA/F16C
 * paths where the CPU has them, plain C otherwise.
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
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TQ_AVX2 1
#endif

enum { TQ_Q4_0 = 0, TQ_Q4_1 = 1, TQ_Q8_0 = 2 };
#define QK 32
#define MC 64
#ifndef SMALL_M
#define SMALL_M 4
#endif

static int block_bytes(int qtype) { return qtype == TQ_Q4_0 ? 18 : qtype == TQ_Q4_1 ? 20 : 34; }

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

#ifdef TQ_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* y[m, 0..nr) = x[m] . panel[r] (+ bias[r]) for the rows m in [m0, m1); panel is [nr][K]. */
static void panel_times_rows(const float *panel, int nr, const float *x, float *y, const float *bias, int64_t m0,
                             int64_t m1, int64_t N, int64_t K) {
    float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (bias) for (int r = 0; r < nr; r++) b[r] = bias[r];
    int64_t m = m0;
#ifdef TQ_AVX2
    if (nr == 4) {
        const float *p0 = panel, *p1 = panel + K, *p2 = panel + 2 * K, *p3 = panel + 3 * K;
        for (; m + 2 <= m1; m += 2) {
            const float *xa = x + m * K, *xb = xa + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
                __m256 w = _mm256_load_ps(p0 + k);
                a0 = _mm256_fmadd_ps(va, w, a0); b0 = _mm256_fmadd_ps(vb, w, b0);
                w = _mm256_load_ps(p1 + k);
                a1 = _mm256_fmadd_ps(va, w, a1); b1 = _mm256_fmadd_ps(vb, w, b1);
                w = _mm256_load_ps(p2 + k);
                a2 = _mm256_fmadd_ps(va, w, a2); b2 = _mm256_fmadd_ps(vb, w, b2);
                w = _mm256_load_ps(p3 + k);
                a3 = _mm256_fmadd_ps(va, w, a3); b3 = _mm256_fmadd_ps(vb, w, b3);
            }
            float *ya = y + m * N, *yb = ya + N;
            ya[0] = hsum(a0) + b[0]; ya[1] = hsum(a1) + b[1]; ya[2] = hsum(a2) + b[2]; ya[3] = hsum(a3) + b[3];
            yb[0] = hsum(b0) + b[0]; yb[1] = hsum(b1) + b[1]; yb[2] = hsum(b2) + b[2]; yb[3] = hsum(b3) + b[3];
        }
        for (; m < m1; m++) {
            const float *xa = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 va = _mm256_loadu_ps(xa + k);
                a0 = _mm256_fmadd_ps(va, _mm256_load_ps(p0 + k), a0);
                a1 = _mm256_fmadd_ps(va, _mm256_load_ps(p1 + k), a1);
                a2 = _mm256_fmadd_ps(va, _mm256_load_ps(p2 + k), a2);
                a3 = _mm256_fmadd_ps(va, _mm256_load_ps(p3 + k), a3);
            }
            float *ya = y + m * N;
            ya[0] = hsum(a0) + b[0]; ya[1] = hsum(a1) + b[1]; ya[2] = hsum(a2) + b[2]; ya[3] = hsum(a3) + b[3];
        }
        return;
    }
#endif
    for (; m < m1; m++) {
        for (int r = 0; r < nr; r++) {
            const float *xa = x + m * K, *p = panel + r * K;
            float s = b[r];
            for (int64_t k = 0; k < K; k++) s += xa[k] * p[k];
            y[m * N + r] = s;
        }
    }
}

#ifdef TQ_AVX2
/* The 32 integers of one block as four vectors of 8 floats (Q4: 0..15; Q8: -128..127). */
static inline void block_ints(int qtype, const uint8_t *blk, __m256 q[4]) {
    if (qtype == TQ_Q8_0) {
        const int8_t *p = (const int8_t *)(blk + 2);
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (qtype == TQ_Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* out[i] = x[i] . row (+ bias) for MR activation rows (stride K), without a panel:
 * sum_j (d q_j + m) x_j = d (q . x) + m sum(x), with sum(x) per block precomputed in xs. */
static inline __attribute__((always_inline)) void rows_dot(int qtype, const uint8_t *row, const float *x,
                                                             const float *xs, const int MR, int64_t K, float bias,
                                                             float *out, int64_t ostride) {
    const int bb = block_bytes(qtype);
    const int64_t nb = K / QK;
    __m256 acc[4];
    float msum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, row += bb) {
        __m256 q[4];
        block_ints(qtype, row, q);
        const float d = half_to_float(row);
        const float m = qtype == TQ_Q4_0 ? -8.0f * d : qtype == TQ_Q4_1 ? half_to_float(row + 2) : 0.0f;
        const __m256 vd = _mm256_set1_ps(d);
        for (int i = 0; i < MR; i++) {
            const float *xb = x + i * K + b * QK;
            __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
            acc[i] = _mm256_fmadd_ps(t, vd, acc[i]);
            if (qtype != TQ_Q8_0) msum[i] += m * xs[i * nb + b];
        }
    }
    for (int i = 0; i < MR; i++) out[i * ostride] = hsum(acc[i]) + msum[i] + bias;
}

/* y [M, N] for small M (at most 4 rows at a time): one pass over the weights per 4 rows. */
static void matmul_small(int qtype, const uint8_t *w, const float *x, float *y, const float *bias, int64_t M,
                         int64_t N, int64_t K) {
    const int64_t row_bytes = K / QK * block_bytes(qtype), nb = K / QK;
    float *xs = (float *)malloc((size_t)(M * nb) * sizeof(float)); /* block sums of x */
    for (int64_t i = 0; i < M * nb; i++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += x[i * QK + j];
        xs[i] = s;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
        const float *xm = x + m0 * K, *xsm = xs + m0 * nb;
        float *ym = y + m0 * N;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = w + n * row_bytes;
            const float b = bias ? bias[n] : 0.0f;
            switch (mr) {
                case 1: rows_dot(qtype, row, xm, xsm, 1, K, b, ym + n, N); break;
                case 2: rows_dot(qtype, row, xm, xsm, 2, K, b, ym + n, N); break;
                case 3: rows_dot(qtype, row, xm, xsm, 3, K, b, ym + n, N); break;
                default: rows_dot(qtype, row, xm, xsm, 4, K, b, ym + n, N); break;
            }
        }
    }
    free(xs);
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias). K must be a multiple of 32. */
void tq_matmul(int qtype, const uint8_t *w, const float *x, float *y, const float *bias, int64_t M, int64_t N,
               int64_t K) {
    const int64_t row_bytes = K / QK * block_bytes(qtype);
    const int64_t panels = (N + 3) / 4;
#ifdef TQ_AVX2
    if (M <= SMALL_M) {
        matmul_small(qtype, w, x, y, bias, M, N, K);
        return;
    }
#endif
#pragma omp parallel
    {
        float *panel = (float *)aligned_alloc(64, (size_t)(4 * K * sizeof(float) + 64));
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = 4 * p;
                const int nr = N - n0 < 4 ? (int)(N - n0) : 4;
                for (int r = 0; r < nr; r++) dequant_row(qtype, w + (n0 + r) * row_bytes, panel + r * K, K);
                panel_times_rows(panel, nr, x, y + n0, bias ? bias + n0 : NULL, m0, m1, N, K);
            }
        }
        free(panel);
    }
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
