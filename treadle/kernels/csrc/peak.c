/* This build's arithmetic peaks, for `treadle doctor`: every OpenMP thread runs NC independent
 * chains of the build's widest instruction on registers (no memory traffic) for n iterations;
 * the result is operations per second of wall time, all threads together (a multiply-add is 2
 * operations, as in GOP/s and GFLOP/s).
 *
 *   build         int8 instruction (ops / instruction)          float32 instruction (flops)
 *   avx512-vnni+  vpdpbusd zmm: 64 u8 x s8 products into int32 (128)  vfmadd zmm (32)
 *   avx-vnni      vpdpbusd ymm (64)                                   vfmadd ymm (16)
 *   avx2          vpmaddubsw ymm: 32 products, pair sums in int16 (64) vfmadd ymm (16)
 *   plain C       the compiler's code for a loop of int8 products into int32, and of float FMAs
 *
 * tq_peak_int8_name / tq_peak_f32_name say which one ran.
 */
#include <stdint.h>
#include <omp.h>
#include "tq.h"

#define NC 12 /* chains: latency 4-5 cycles x up to 2 ports, with room */

#if defined(TQ_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define TQ_PEAK_512 1
#endif

/* NC = 12 chains in named variables (an array would be kept in memory) */
#define DECL(T, V) T c0 = V, c1 = V, c2 = V, c3 = V, c4 = V, c5 = V, c6 = V, c7 = V, c8 = V, c9 = V, c10 = V, c11 = V
#define STEP(OP) c0 = OP(c0); c1 = OP(c1); c2 = OP(c2); c3 = OP(c3); c4 = OP(c4); c5 = OP(c5); \
                 c6 = OP(c6); c7 = OP(c7); c8 = OP(c8); c9 = OP(c9); c10 = OP(c10); c11 = OP(c11)
#define KEEP __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7), \
                              "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11))
#define CHAINS(T, V, OP) do { DECL(T, V); for (int64_t i = 0; i < n; i++) { STEP(OP); KEEP; } } while (0)

static double int8_chains(int64_t n) { /* operations done by this thread */
#if defined(TQ_PEAK_512) && defined(TQ_VNNI)
    const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
#define OP(c) _mm512_dpbusd_epi32(c, a, b)
    CHAINS(__m512i, _mm512_setzero_si512(), OP);
#undef OP
    return 128.0 * NC * n;
#elif defined(TQ_AVX2) && defined(__AVXVNNI__)
    const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(2);
#define OP(c) _mm256_dpbusd_avx_epi32(c, a, b)
    CHAINS(__m256i, _mm256_setzero_si256(), OP);
#undef OP
    return 64.0 * NC * n;
#elif defined(TQ_AVX2)
    const __m256i b = _mm256_set1_epi8(1);
#define OP(c) _mm256_maddubs_epi16(c, b)
    CHAINS(__m256i, _mm256_set1_epi8(1), OP);
#undef OP
    return 64.0 * NC * n;
#else
    int8_t a[64], b[64];
    int32_t acc[64] = {0};
    for (int j = 0; j < 64; j++) { a[j] = (int8_t)(j - 32); b[j] = (int8_t)(3 - j); }
    for (int64_t i = 0; i < n; i++) {
        for (int j = 0; j < 64; j++) acc[j] += (int32_t)a[j] * b[j];
        __asm__ volatile("" : : "r"(acc) : "memory");
    }
    return 128.0 * n;
#endif
}

static double f32_chains(int64_t n) {
#if defined(TQ_PEAK_512)
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
#define OP(c) _mm512_fmadd_ps(c, a, b)
    CHAINS(__m512, _mm512_set1_ps(1.0f), OP);
#undef OP
    return 32.0 * NC * n;
#elif defined(TQ_AVX2)
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
#define OP(c) _mm256_fmadd_ps(c, a, b)
    CHAINS(__m256, _mm256_set1_ps(1.0f), OP);
#undef OP
    return 16.0 * NC * n;
#else
    float acc[64];
    for (int j = 0; j < 64; j++) acc[j] = 1.0f;
    for (int64_t i = 0; i < n; i++) {
        for (int j = 0; j < 64; j++) acc[j] = acc[j] * 0.999f + 1e-7f;
        __asm__ volatile("" : : "r"(acc) : "memory");
    }
    return 128.0 * n;
#endif
}

static double run(double (*chains)(int64_t), int64_t n) {
    double ops = 0.0;
    const double t = omp_get_wtime();
#pragma omp parallel reduction(+ : ops)
    ops += chains(n);
    return ops / (omp_get_wtime() - t);
}

double tq_peak_int8(int64_t n) { return run(int8_chains, n); }
double tq_peak_f32(int64_t n) { return run(f32_chains, n); }

const char *tq_peak_int8_name(void) {
#if defined(TQ_PEAK_512) && defined(TQ_VNNI)
    return "vpdpbusd zmm";
#elif defined(TQ_AVX2) && defined(__AVXVNNI__)
    return "vpdpbusd ymm (VEX)";
#elif defined(TQ_AVX2)
    return "vpmaddubsw ymm";
#else
    return "C loop";
#endif
}

const char *tq_peak_f32_name(void) {
#if defined(TQ_PEAK_512)
    return "vfmadd231ps zmm";
#elif defined(TQ_AVX2)
    return "vfmadd231ps ymm";
#else
    return "C loop";
#endif
}
