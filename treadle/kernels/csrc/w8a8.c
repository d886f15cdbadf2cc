/* W8A8: int8 weights times int8 activations quantized per token, exact integer dot products.
 *
 *   tq_w8a8_quantize:  xs[m] = max_k |x[m, k]| / 127.5   (FLT_EPSILON when 0)
 *                      xq[m, k] = round_half_even(clamp(x[m, k] / xs[m], -128, 127))
 *     -- compressed-tensors' dynamic per-token symmetric int8 rule, operation for operation,
 *        so a checkpoint made by llm-compressor sees the activations it was calibrated with.
 *   tq_w8a8_matmul:    acc[m, n] = sum_k xq[m, k] * w[n, k]            (int32, exact:
 *                                  |acc| <= 128 * 128 * K < 2^31 for K < 131072)
 *                      y[m, n] = ((float)acc * xs[m]) * ws[n] (+ bias[n])
 *
 * The AVX2 path widens 16 int8 of each operand to int16 and uses madd (pairs of int16
 * products summed into int32: at most 2 * 128 * 128, no saturation, unlike maddubs which
 * would need an operand in 0..255 and saturates its int16 pair sums), four activation rows
 * per pass over a weight row.
 *
 * The AVX-512 VNNI path (the avx512-vnni build) multiplies 64 bytes at a time with vpdpbusd,
 * which takes one operand unsigned: the activations are offset to u8 = xq + 128 (an xor with
 * 0x80) and the offset is taken back out with the weight row's sum, precomputed at load:
 *
 *     sum_k xq[k] * w[k] = sum_k (xq[k] + 128) * w[k] - 128 * wsum,   wsum = sum_k w[k]
 *
 * vpdpbusd adds each group of four u8 x s8 products (each |p| <= 255 * 128, exact in 16
 * bits) to an int32 lane with a plain wrapping add -- no saturation (that is vpdpbusds) --
 * and the identity holds modulo 2^32, so the result is exact for every int8 value, -128
 * included, whenever the true sum fits in int32 (the bound above). The K tail is a masked
 * load: masked lanes read w = 0 and add nothing.
 *
 * The AVX-VNNI path (the avx-vnni build: VEX-encoded vpdpbusd on 256 bits, Intel CPUs without
 * AVX-512) is the same identity 32 bytes at a time, the K tail added in scalar u8 form.
 *
 * The plain-C path (also built with -DTQ_PLAIN_C for the tests) is the same sum in int32.
 * All give identical bits, as does the plain torch reference in treadle/quantization/methods/w8a8.py.
 * Threads split the weight rows, so a row's result does not depend on the batch it is in.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include "tq.h"

#if defined(TQ_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define TQ_W8A8_VNNI 1
#elif defined(TQ_AVX2) && defined(__AVXVNNI__)
#define TQ_W8A8_AVXVNNI 1
#endif

void tq_w8a8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs) {
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
        float s = amax / 127.5f;
        if (s == 0.0f) s = FLT_EPSILON;
        for (int64_t k = 0; k < K; k++) {
            float v = row[k] / s;
            v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
            xq[m * K + k] = (int8_t)nearbyintf(v);
        }
        xs[m] = s;
    }
}

static int32_t dot_plain(const int8_t *a, const int8_t *b, int64_t K) {
    int32_t acc = 0;
    for (int64_t k = 0; k < K; k++) acc += (int32_t)a[k] * (int32_t)b[k];
    return acc;
}

#ifdef TQ_W8A8_VNNI
/* acc[r] = dot(x rows r of `rows` (<= 4), w) over K, w's row sum being wsum */
static void dot_rows_vnni(const int8_t *x, int64_t K, int rows, const int8_t *w, int32_t wsum, int32_t *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80); /* s8 ^ 0x80 == s8 + 128 as u8 */
    __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 live = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        const __m512i wv = _mm512_maskz_loadu_epi8(live, w + k);
        for (int r = 0; r < rows; r++) {
            const __m512i xu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, x + r * K + k), flip);
            s[r] = _mm512_dpbusd_epi32(s[r], xu, wv);
        }
    }
    for (int r = 0; r < rows; r++) /* wrapping int32 arithmetic, as the lanes do */
        acc[r] = (int32_t)((uint32_t)_mm512_reduce_add_epi32(s[r]) - 128u * (uint32_t)wsum);
}
#endif

#ifdef TQ_W8A8_AVXVNNI
/* as dot_rows_vnni, 32 bytes a step with the VEX form; the tail in the same offset form */
static void dot_rows_avxvnni(const int8_t *x, int64_t K, int rows, const int8_t *w, int32_t wsum, int32_t *acc) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t k = 0; k < K32; k += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
        for (int r = 0; r < rows; r++) {
            const __m256i xu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + r * K + k)), flip);
            s[r] = _mm256_dpbusd_avx_epi32(s[r], xu, wv);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s[r]), _mm256_extracti128_si256(s[r], 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        uint32_t total = (uint32_t)_mm_cvtsi128_si32(h);
        for (int64_t k = K32; k < K; k++) total += (uint32_t)((int32_t)x[r * K + k] + 128) * (uint32_t)(int32_t)w[k];
        acc[r] = (int32_t)(total - 128u * (uint32_t)wsum); /* wrapping, as the lanes do */
    }
}
#endif

#ifdef TQ_AVX2
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i widen16(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* acc[r] = dot(x rows r of `rows` (<= 4), w) over K */
static void dot_rows_avx2(const int8_t *x, int64_t K, int rows, const int8_t *w, int32_t *acc) {
    __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    const int64_t K16 = K & ~(int64_t)15;
    for (int64_t k = 0; k < K16; k += 16) {
        const __m256i wv = widen16(w + k);
        for (int r = 0; r < rows; r++) s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(widen16(x + r * K + k), wv));
    }
    for (int r = 0; r < rows; r++) acc[r] = hsum_i32(s[r]) + dot_plain(x + r * K + K16, w + K16, K - K16);
}
#endif

/* wsum[n] = sum_k w[n, k] (read only by the VNNI paths) */
void tq_w8a8_matmul(const int8_t *xq, const float *xs, const int8_t *w, const float *ws, const int32_t *wsum,
                    const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static) if (N * M >= 256)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int rows = M - m0 < 4 ? (int)(M - m0) : 4;
            int32_t acc[4];
#if defined(TQ_W8A8_VNNI)
            dot_rows_vnni(xq + m0 * K, K, rows, wr, wsum[n], acc);
#elif defined(TQ_W8A8_AVXVNNI)
            dot_rows_avxvnni(xq + m0 * K, K, rows, wr, wsum[n], acc);
#elif defined(TQ_AVX2)
            dot_rows_avx2(xq + m0 * K, K, rows, wr, acc);
#else
            for (int r = 0; r < rows; r++) acc[r] = dot_plain(xq + (m0 + r) * K, wr, K);
#endif
            for (int r = 0; r < rows; r++) {
                float v = (float)acc[r] * xs[m0 + r];
                v = v * ws[n];
                if (bias) v = v + bias[n];
                y[(m0 + r) * N + n] = v;
            }
        }
    }
}
