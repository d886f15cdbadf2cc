/* Fused elementwise operators for one decode/prefill step, float32, in one call each:
 *
 *   tq_rms_norm   residual += x (in place, when given); out = residual * rsqrt(mean(residual^2) + eps) * weight
 *   tq_rope       rotate-half RoPE in place on rows of heads, cos/sin looked up by position
 *   tq_silu_mul   out = silu(gate) * up over [gate | up] rows
 *   tq_gelu_tanh_mul  out = gelu_tanh(gate) * up (GeGLU, Gemma), as gate * sigmoid(2 u) with
 *                 u = sqrt(2/pi) (gate + 0.044715 gate^3): 0.5 (1 + tanh u) = sigmoid(2 u) exactly
 *
 * Same arithmetic as the plain torch versions in treadle/layers (float32 throughout), up to
 * summation order in the mean and the exp approximation below (relative error < 2e-7).
 * Rows are split over OpenMP threads only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include "tq.h"

#define PAR_ROWS 8 /* fewer rows than this run on one thread */

void tq_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t hidden,
                 int64_t x_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *src = (float *)xr;
        if (residual) { /* residual += x; normalize the sum */
            src = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) src[i] += xr[i];
        }
        float ss = 0.0f;
#ifdef TQ_AVX2
        int64_t i = 0;
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= hidden; i += 8) {
            __m256 v = _mm256_loadu_ps(src + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum(acc);
        for (; i < hidden; i++) ss += src[i] * src[i];
#else
        for (int64_t i = 0; i < hidden; i++) ss += src[i] * src[i];
#endif
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t j = 0; j < hidden; j++) o[j] = src[j] * inv * weight[j];
    }
}

/* x [tokens, heads, head_dim] with rows `row_stride` floats apart (heads contiguous in a
 * row); cos_sin [max_pos, head_dim] = cos of the head_dim/2 frequencies, then their sin. */
void tq_rope(float *x, const float *cos_sin, const int64_t *positions, int64_t tokens, int64_t heads,
             int64_t head_dim, int64_t row_stride) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens >= PAR_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * head_dim, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

#ifdef TQ_AVX2
/* exp(x) for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* gate_up [rows, 2 d] (rows `in_stride` floats apart) -> out [rows, d] */
void tq_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t d, int64_t in_stride) {
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_stride, *u = g + d;
        float *o = out + r * d;
        int64_t i = 0;
#ifdef TQ_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < d; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* gate_up [rows, 2 d] (rows `in_stride` floats apart) -> out [rows, d]: GeGLU with tanh GELU */
void tq_gelu_tanh_mul(const float *gate_up, float *out, int64_t rows, int64_t d, int64_t in_stride) {
    const float k2 = 1.5957691216057308f, c = 0.044715f; /* 2 sqrt(2/pi) */
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_stride, *u = g + d;
        float *o = out + r * d;
        int64_t i = 0;
#ifdef TQ_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), kv = _mm256_set1_ps(-k2), cv = _mm256_set1_ps(c);
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 inner = _mm256_add_ps(gv, _mm256_mul_ps(cv, _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv)));
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_mul_ps(kv, inner))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < d; i++) o[i] = g[i] / (1.0f + expf(-k2 * (g[i] + c * (g[i] * g[i] * g[i])))) * u[i];
    }
}
