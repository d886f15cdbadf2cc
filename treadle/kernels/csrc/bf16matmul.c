/* bfloat16 weights times float32 activations, on the CPU (float checkpoints run with --dtype bfloat16).
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])      W bfloat16: the top 16 bits of a float32
 *
 * A bfloat16 widens to float32 exactly (a 16-bit shift), so every product w * x is the float
 * model's; each output accumulates them with fused multiply-adds in 8 lanes (lane j takes the
 * k = j mod 8) and sums the lanes in hsum's order (tq.h). The plain-C build (-DTQ_PLAIN_C) does
 * the same operations in the same order, so the builds agree bit for bit, and an output does not
 * depend on M, on the tile it falls in or on the thread that computes it. K % 8 == 0.
 *
 *   threads: tiles of NW = 4 weight rows (omp static)
 *   tile:    for every pair of activation rows (NX = 2): 8 accumulators in registers, each
 *            weight vector loaded once per pair (batch 1: the next tile's rows prefetched one
 *            tile ahead); with M >= UNPACK_M the tile is first widened to float32 (4 K floats,
 *            in L1/L2) so the shift is paid once, then each half of it (2 rows) passes over the
 *            activation rows 6 at a time (12 accumulators), the last M % 6 rows against all 4
 *
 * Also tq_matmul's "BF16" layout segments (tq.h TQ_W_BF16: tq_bf16_rows, float32 in and out), so
 * the one-call decoder layer (layer.c) runs a float checkpoint's bfloat16 weights.
 *
 * avx512-bf16 build (TQ_BF16): vdpbf16ps, two products per lane and instruction, on x rounded
 * to bfloat16 (exact when x came from a bfloat16 model) in 16 lanes over K % 32 == 0 --
 * another summation order, so it agrees with the reference to a tolerance, not bit for bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "tq.h"

#define NW 4        /* weight rows per tile */
#define NX 2        /* activation rows per pass over a tile */
#define NX_WIDE 6   /* activation rows per pass over 2 widened weight rows (12 accumulators) */
#define UNPACK_M 4  /* from this many activation rows, widen a weight tile once */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* out[i] = v, as float32 or rounded to bfloat16 (nearest even, as torch rounds; finite v) */
static inline void store(void *out, int64_t i, float v, int bf16) {
    if (!bf16) {
        ((float *)out)[i] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    ((uint16_t *)out)[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef TQ_AVX2
static inline __attribute__((always_inline)) __m256 load_w(const void *w, int wide, int64_t k) {
    if (wide) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
static inline float lane_sum(const float a[8]) { /* hsum's order: halves, then pairs, then the two */
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}
#endif

/* out[i * N + r] = W row r . x row i (+ bias[r]) (float32, or bfloat16 when ob) for nw weight rows (at w, row stride K elements,
 * bfloat16 or, when wide, float32) and nx activation rows; constant shapes after inlining. */
static inline __attribute__((always_inline)) void tile(const void *w, const int wide, const float *x, const int nw,
                                                        const int nx, int64_t K, const float *bias, void *out,
                                                        int64_t o, int ob, int64_t N) {
#ifdef TQ_AVX2
    __m256 acc[NX_WIDE][NW];
    for (int i = 0; i < nx; i++)
        for (int r = 0; r < nw; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        /* batch 1 streams the weights: the next tile's line, once per cache line, one tile ahead */
        if (nx == 1 && !wide && k % 32 == 0)
            for (int r = 0; r < nw; r++) __builtin_prefetch((const uint16_t *)w + (r + NW) * K + k);
        __m256 wv[NW];
        for (int r = 0; r < nw; r++)
            wv[r] = load_w(wide ? (const void *)((const float *)w + r * K) : (const void *)((const uint16_t *)w + r * K), wide, k);
        for (int i = 0; i < nx; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int r = 0; r < nw; r++) acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
        }
    }
    for (int i = 0; i < nx; i++)
        for (int r = 0; r < nw; r++) store(out, o + i * N + r, hsum(acc[i][r]) + (bias ? bias[r] : 0.0f), ob);
#else
    for (int i = 0; i < nx; i++)
        for (int r = 0; r < nw; r++) {
            float a[8] = {0.0f};
            for (int64_t k = 0; k < K; k += 8)
                for (int j = 0; j < 8; j++) {
                    const float wk = wide ? ((const float *)w)[r * K + k + j] : bf16_to_f32(((const uint16_t *)w)[r * K + k + j]);
                    a[j] = fmaf(wk, x[i * K + k + j], a[j]);
                }
            store(out, o + i * N + r, lane_sum(a) + (bias ? bias[r] : 0.0f), ob);
        }
#endif
}

/* nw (NW, or fewer at the end) weight rows times all M activation rows, pairs at a time */
static inline __attribute__((always_inline)) void rows(const void *w, const int wide, const float *x, const int nw,
                                                        int64_t M, int64_t K, const float *bias, void *y, int64_t o,
                                                        int ob, int64_t N) {
    int64_t m = 0;
    for (; m + NX <= M; m += NX) tile(w, wide, x + m * K, nw, NX, K, bias, y, o + m * N, ob, N);
    for (; m < M; m++) tile(w, wide, x + m * K, nw, 1, K, bias, y, o + m * N, ob, N);
}

/* NW widened weight rows times all M activation rows (the same sums as rows): NX_WIDE rows at a
 * time against each half of the tile, then the last M % NX_WIDE against all NW rows at once (8
 * accumulators: enough independent FMAs to hide their latency, where 2 x 2 would not) */
static void rows_wide(const float *w, const float *x, int64_t M, int64_t K, const float *bias, void *y, int64_t o,
                      int ob, int64_t N) {
    int64_t m = 0;
    for (; m + NX_WIDE <= M; m += NX_WIDE)
        for (int h = 0; h < NW; h += 2)
            tile(w + h * K, 1, x + m * K, 2, NX_WIDE, K, bias ? bias + h : NULL, y, o + m * N + h, ob, N);
    rows(w, 1, x + m * K, NW, M - m, K, bias, y, o + m * N, ob, N);
}

#ifdef TQ_BF16
/* x [M, K] float32 -> bfloat16 (round to nearest even), the operand vdpbf16ps reads */
static void round_rows(const float *x, int64_t n, uint16_t *xb) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)h);
    }
}

static void rows_dpbf16(const uint16_t *w, const uint16_t *xb, int nw, int64_t M, int64_t K, const float *bias,
                        void *y, int64_t o, int ob, int64_t N) {
    for (int64_t m = 0; m < M; m++) {
        __m512 acc[NW];
        for (int r = 0; r < nw; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + k);
            for (int r = 0; r < nw; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
        }
        for (int r = 0; r < nw; r++) store(y, o + m * N + r, _mm512_reduce_add_ps(acc[r]) + (bias ? bias[r] : 0.0f), ob);
    }
}
#endif

/* x: float32, or bfloat16 when x_bf16; y: float32, or bfloat16 when y_bf16, rows ldy elements apart */
void tq_bf16_rows(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t ldy, const float *bias,
                  int64_t M, int64_t N, int64_t K) {
    const int64_t tiles = (N + NW - 1) / NW;
#ifdef TQ_BF16
    if (K % 32 == 0) {
        uint16_t *xb = (uint16_t *)x;
        if (!x_bf16) {
            xb = (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t));
            round_rows((const float *)x, M * K, xb);
        }
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n = t * NW;
            const int nw = N - n < NW ? (int)(N - n) : NW;
            rows_dpbf16(w + n * K, xb, nw, M, K, bias ? bias + n : NULL, y, n, y_bf16, ldy);
        }
        if (!x_bf16) free(xb);
        return;
    }
#endif
    float *xw = NULL;
    if (x_bf16) { /* widened once: every weight tile reads all of x */
        xw = (float *)malloc((size_t)(M * K) * sizeof(float));
        for (int64_t i = 0; i < M * K; i++) xw[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const float *xf = x_bf16 ? xw : (const float *)x;
#pragma omp parallel
    {
        float *wide = M >= UNPACK_M ? (float *)malloc((size_t)(NW * K) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n = t * NW;
            const uint16_t *wt = w + n * K;
            const float *bn = bias ? bias + n : NULL;
            if (N - n < NW) { /* the last, short tile: one row at a time (same sums) */
                for (int64_t r = 0; r < N - n; r++)
                    rows(wt + r * K, 0, xf, 1, M, K, bn ? bn + r : NULL, y, n + r, y_bf16, ldy);
            } else if (wide) {
                for (int64_t i = 0; i < NW * K; i++) wide[i] = bf16_to_f32(wt[i]);
                rows_wide(wide, xf, M, K, bn, y, n, y_bf16, ldy);
            } else {
                rows(wt, 0, xf, NW, M, K, bn, y, n, y_bf16, ldy);
            }
        }
        free(wide);
    }
    free(xw);
}

void tq_bf16_matmul(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, const float *bias, int64_t M,
                    int64_t N, int64_t K) {
    tq_bf16_rows(w, x, x_bf16, y, y_bf16, N, bias, M, N, K);
}
