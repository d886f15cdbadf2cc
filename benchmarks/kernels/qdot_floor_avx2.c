/* The floor of the 16-bit integer dot product the GGUF matmul (treadle/kernels/csrc/qmatmul.c)
 * runs per weight block of 32 and activation row, on this CPU: the tile's exact instruction mix
 * (2 x vpmaddwd + vpaddd + vcvtdq2ps + vmulps + vfmadd, 2 weight rows x 4 activation rows, all
 * in L1 and registers, no unpacking, no minimum terms), and the integer and float halves alone;
 * then the 8-bit activation path's mix (csrc/q8act.c: vpmaddubsw + vpmaddwd with ones + vcvtdq2ps +
 * vmulps + vfmadd, same tile) and its integer half.
 *
 *   gcc -O3 -mavx2 -mfma benchmarks/kernels/qdot_floor_avx2.c -o /tmp/qdot && /tmp/qdot
 *
 * Thread CPU time, best of 5. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NB 18 /* blocks of 32 in a row of 576 (SmolLM2's hidden size) */
#define ITERS 100000

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int16_t x[4 * NB * 32] __attribute__((aligned(64))), w[2 * NB * 32] __attribute__((aligned(64)));
static float xd[4 * NB], wd[2 * NB];

/* mode 0: the whole mix; 1: the integer half (madds and adds); 2: the float half */
static double run(int mode) {
    __m256 acc[4][2];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 2; r++) acc[i][r] = _mm256_setzero_ps();
    const double t = now();
    for (long it = 0; it < ITERS; it++) {
        for (int b = 0; b < NB; b++) {
            __m256i w0[2], w1[2];
            __m256 d[2];
            for (int r = 0; r < 2; r++) {
                w0[r] = _mm256_load_si256((const __m256i *)(w + (r * NB + b) * 32));
                w1[r] = _mm256_load_si256((const __m256i *)(w + (r * NB + b) * 32 + 16));
                d[r] = _mm256_broadcast_ss(wd + r * NB + b);
            }
            for (int i = 0; i < 4; i++) {
                const __m256 vx = _mm256_broadcast_ss(xd + i * NB + b);
                const __m256i *xq = (const __m256i *)(x + (i * NB + b) * 32);
                for (int r = 0; r < 2; r++) {
                    if (mode == 2) {
                        const __m256i s = _mm256_add_epi32(_mm256_load_si256(xq), _mm256_load_si256(xq + 1));
                        acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), d[r]), vx, acc[i][r]);
                        continue;
                    }
                    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0[r], _mm256_load_si256(xq)),
                                                       _mm256_madd_epi16(w1[r], _mm256_load_si256(xq + 1)));
                    acc[i][r] = mode == 1
                        ? _mm256_castsi256_ps(_mm256_add_epi32(s, _mm256_castps_si256(acc[i][r])))
                        : _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), d[r]), vx, acc[i][r]);
                }
            }
        }
        __asm__ volatile("" ::: "memory");
    }
    const double dt = now() - t;
    float sink = 0.0f, o[8];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 2; r++) {
            _mm256_storeu_ps(o, acc[i][r]);
            sink += o[0];
        }
    if (sink == 12345.0f) puts("");
    return dt / (ITERS * NB * 8.0) * 1e9;
}

static int8_t x8[4 * NB * 32] __attribute__((aligned(64)));
static uint8_t w8[2 * NB * 32] __attribute__((aligned(64)));

/* the 8-bit path; int_only: the integer half (maddubs, madd, add); a constant in each caller */
static inline __attribute__((always_inline)) double run8_(const int int_only) {
    __m256 acc[4][2];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 2; r++) acc[i][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const double t = now();
    for (long it = 0; it < ITERS; it++) {
        for (int b = 0; b < NB; b++) {
            __m256i wv[2];
            __m256 d[2];
            for (int r = 0; r < 2; r++) {
                wv[r] = _mm256_load_si256((const __m256i *)(w8 + (r * NB + b) * 32));
                d[r] = _mm256_broadcast_ss(wd + r * NB + b);
            }
            for (int i = 0; i < 4; i++) {
                const __m256 vx = _mm256_broadcast_ss(xd + i * NB + b);
                const __m256i xv = _mm256_load_si256((const __m256i *)(x8 + (i * NB + b) * 32));
                for (int r = 0; r < 2; r++) {
                    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], xv), ones);
                    acc[i][r] = int_only ? _mm256_castsi256_ps(_mm256_add_epi32(s, _mm256_castps_si256(acc[i][r])))
                                         : _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d[r], vx), acc[i][r]);
                }
            }
        }
        __asm__ volatile("" ::: "memory");
    }
    const double dt = now() - t;
    float sink = 0.0f, o[8];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 2; r++) {
            _mm256_storeu_ps(o, acc[i][r]);
            sink += o[0];
        }
    if (sink == 12345.0f) puts("");
    return dt / (ITERS * NB * 8.0) * 1e9;
}

static __attribute__((noinline)) double run8(int int_only) { return int_only ? run8_(1) : run8_(0); }

int main(void) {
    for (int i = 0; i < 4 * NB * 32; i++) x[i] = (int16_t)(i % 7);
    for (int i = 0; i < 2 * NB * 32; i++) w[i] = (int16_t)(i % 5);
    for (int i = 0; i < 4 * NB * 32; i++) x8[i] = (int8_t)(i % 7 - 3);
    for (int i = 0; i < 2 * NB * 32; i++) w8[i] = (uint8_t)(i % 15);
    for (int i = 0; i < 4 * NB; i++) xd[i] = 1.0f;
    for (int i = 0; i < 2 * NB; i++) wd[i] = 1.0f;
    const char *names[3] = {"whole block dot", "integer half (2 vpmaddwd + 2 vpaddd)", "float half (vpaddd, cvt, mul, fma)"};
    for (int mode = 0; mode < 3; mode++) {
        double best = 1e9;
        for (int k = 0; k < 5; k++) {
            const double ns = run(mode);
            best = ns < best ? ns : best;
        }
        printf("%-40s %.3f ns per block of 32 and activation row\n", names[mode], best);
    }
    const char *names8[2] = {"8-bit: whole block dot", "8-bit: integer half (maddubs, madd, add)"};
    for (int mode = 0; mode < 2; mode++) {
        double best = 1e9;
        for (int k = 0; k < 5; k++) {
            const double ns = run8(mode);
            best = ns < best ? ns : best;
        }
        printf("%-40s %.3f ns per block of 32 and activation row\n", names8[mode], best);
    }
    return 0;
}
