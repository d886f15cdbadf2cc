/* The 8-bit activation path of tq_matmul (qmatmul.c) for the legacy block types Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K: the layout's act_bits == 8 (tq.h).
 *
 * Each activation row is quantized once per matmul to int8 per block of 32 (xd = max|x| / 127,
 * xq = round(x / xd)) with its block sum (xs = xd * sum(xq), the minimum term's factor) and its
 * two half-block integer sums (xh, Q6_K's). The weights stay 8-bit: unsigned q for the 4/5-bit
 * types (the types that store q - 8 / q - 16 read as q with the minimum m = -8 d / -16 d), signed
 * q for Q8_0:
 *
 *   y[m, n] = sum_b  d_b xd_b (q_b . xq_b)  +  sum_b m_b xs_b  (+ bias)
 *
 * A Q4_K / Q5_K super-block is 8 such blocks of 32, each Q4_1 / Q5_1-like: q unsigned (0..15 /
 * 0..31), d_b = d sc_b and m_b = -dmin mn_b (fp16 times a 6-bit integer: exact in float32, the
 * values the 16-bit path's unit_scales makes). Q6_K's 32-blocks have two int8 scales (one per 16)
 * and q stored with bias 32: the panel holds q + 32 (0..63, unsigned), d = the super-block's d,
 * and both scales; the two halves' dots (steps 0-3, 4-7) are kept apart and folded in int32,
 *
 *   isum = sc0 (dot0 - 32 xh0) + sc1 (dot1 - 32 xh1)       (|isum| < 2^24: exact, also as a float)
 *
 * then acc = fma(float(isum), d xd, acc) with no minimum term. Block b of a K-quant row is
 * sub-block b % 8 of its super-block b / 8, so the K-quants share the panel, tiles and tail loop
 * of the legacy types below (only unpack_kgroup differs); q8batch.c takes their whole groups from
 * BATCH_MIN_K activation rows in the AVX-512 builds, with the same values, integers and float order.
 *
 * Eight weight rows side by side (a "group"), one output row per vector lane: a vector's 8 int32
 * lanes are 8 weight rows (columns of y) rather than 8 pieces of one dot product.
 *
 *   panel step s of block b (s < 8): lane j = the 4 q of weight row j at k = 4s .. 4s+3 (bytes)
 *   xb = x row's 4 bytes at k = 4s .. 4s+3, broadcast to every lane
 *   Q4: p16 += maddubs(step, xb)  over the 8 steps (u4 x s8 pairs: at most 8 * 2 * 15 * 127 < 32767),
 *       isum = madd(p16, ones)    one 16 -> 32-bit widening per block of 8 rows
 *   Q5: the same, widened after steps 3 and 7 (4 * 2 * 31 * 127 < 32767)
 *   Q8_0: isum += madd(maddubs(|step|, xb with step's sign), ones)   per step (pairs up to 2 * 128 * 127)
 *
 * isum is each row's exact integer block dot, with no horizontal sums at all. Each pair of groups
 * is unpacked (transposed) once per call into a per-thread panel that every tile of 2 activation
 * rows x 16 weight rows reads (each 4-byte activation broadcast feeds both groups; a lone last
 * group takes tiles of 4 rows x 8); the next group's bytes are prefetched meanwhile. A tile's
 * sums stay in registers: each step's add is pinned in its chain (an empty asm), because GCC
 * otherwise reassociates the 8 steps into a tree whose 8 live products spill to the stack (the
 * measured cost: 1.13x). Each output then takes, per block in order,
 *
 *   acc = fma(float(isum), d_w * xd, acc);   acc = fma(m_w, xs, acc)   (Q8_0: no minimum)
 *
 * and y = acc (+ bias). The plain-C build (TQ_PLAIN_C) computes exactly these operations, and
 * rows of N past the last whole group (N % 8) take a plain-C loop in the SIMD builds too, so every
 * output has one value whatever the build, tile, thread or batch. Up to 3 activation rows, the file's Q8_0
 * rows skip the panel in the AVX2 / AVX-VNNI builds (packed Q8_0, as a load with 8-bit activations
 * leaves the lm_head: up to 4 rows, packed_direct) (the AVX-512 builds take q8batch.c's
 * zmm q8_0_strip_direct up to 8 rows, the same integers and float order): q8_0_direct takes each row's block dot along k and reduces 8 rows'
 * partial sums to the same exact integers (1.25x the panel at 1 row, 1.13x at 2 and 3; at 4 its
 * sums spill). The VNNI builds take each step's 4-byte dot
 * products with vpdpbusd straight into int32 (step16 / step32 below: the same integers; not run on
 * the AVX2 machine this was written on, so not measured). Threads split the groups.
 *
 * Q6_K's steps widen per step in the AVX2 build (2 * 63 * 127 per pair).
 *
 * Packed Q4_0 / Q4_1 (types TQ_PACKED + t, made once at load by tq_q8_pack, same bytes): a group's
 * block is its 8 d, 8 m and 4 vectors of nibbles already in step order, so the panel is filled
 * with masks and shifts, and up to 4 activation rows skip the panel (packed_direct: the steps go
 * straight into registers). Same integers, same float order, so the same bits as the file's rows.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qblocks.h"

int tq_q8_type(int t) {
    return t == TQ_Q4_0 || t == TQ_Q4_1 || t == TQ_Q5_0 || t == TQ_Q5_1 || t == TQ_Q8_0 || q8_kquant(t) || packed_type(t) ||
           packed_q8_0(t);
}

tq_q8acts tq_q8_quantize(const float *x, int64_t M, int64_t K) {
    const int64_t nb = K / QK;
    float *f = (float *)malloc((size_t)(2 * M * nb) * sizeof(float));
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    int32_t *h = (int32_t *)malloc((size_t)(2 * M * nb) * sizeof(int32_t));
    if (f == NULL || q == NULL || h == NULL) abort();
    const tq_q8acts a = {q, f, f + M * nb, h};
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t row = i / nb, b = i % nb;
        const float *xb = x + row * K + b * QK;
#ifdef TQ_AVX2 /* the same values as the loop below (tq.h) */
        __m256 xv[4];
        const float amax = block_absmax(xb, xv);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i v[4], vs = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            v[j] = round_clamp(xv[j], id, 127);
            vs = _mm256_add_epi32(vs, v[j]);
        }
        /* packs interleave the 128-bit halves: 0 1 | 2 3 -> dwords in order 0 2 4 6 1 3 5 7 */
        const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i * QK), _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const int sum = hsum_epi32(vs), half0 = hsum_epi32(_mm256_add_epi32(v[0], v[1]));
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0, half0 = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[i * QK + j] = (int8_t)v;
            sum += v;
            if (j < QK / 2) half0 += v;
        }
#endif
        f[i] = d;
        f[M * nb + i] = d * (float)sum;
        h[2 * i] = half0;
        h[2 * i + 1] = sum - half0;
    }
    return a;
}

void tq_q8_free(tq_q8acts a) {
    free((void *)a.q);
    free((void *)a.d);
    free((void *)a.h);
}

#define GR 8 /* weight rows per group */
#define MRG 4 /* activation rows per pass over a group's panel */
#define Q8_0_DIRECT 3 /* Q8_0 up to this many activation rows skips the panel (4: 0.99x, its sums spill); AVX2 / AVX-VNNI builds only */
#define MR2 2 /* activation rows per pass over two groups' panels (3 spilled: 0.98x) */
#define Q6K_DIRECT 2 /* packed Q6_K up to this many activation rows skips the panel (its 4 blocks' sums in registers) */

typedef struct { /* one block of a group, unpacked */
    uint8_t q[8 * 32]; /* step s at 32 s: lane j's 4 bytes at 4 j */
    float d[GR];
    union {
        float m[GR]; /* the minimum (0 for Q8_0) */
        int32_t sc[GR]; /* Q6_K: the two halves' int8 scales, sc0 | sc1 << 16 (int16 each) */
    };
} gblock;

static inline int five_bit(int t) { return t == TQ_Q5_0 || t == TQ_Q5_1 || t == TQ_Q5_K; }
static inline int has_min(int t) { return t != TQ_Q8_0 && t != TQ_Q6_K; }
static inline int q_bias(int t) { return t == TQ_Q4_0 ? 8 : t == TQ_Q5_0 ? 16 : 0; } /* stored q - bias */

/* The block's 16 nibble bytes (byte i: q[i] low, q[i + 16] high), and its minimum. */
static inline const uint8_t *nibbles(int t, const uint8_t *u) {
    return u + (t == TQ_Q4_0 ? 2 : t == TQ_Q4_1 ? 4 : t == TQ_Q5_0 ? 6 : 8);
}
static inline float block_min(int t, const uint8_t *u) {
    return t == TQ_Q4_1 || t == TQ_Q5_1 ? half_to_float(u + 2) : -(float)q_bias(t) * half_to_float(u);
}

/* Packed rows (TQ_PACKED + Q4_0 / Q4_1, made by tq_q8_pack): a group's block b is one run of
 * 8 * unit_bytes at group + 8 b * unit_bytes, so the unpacking below is loads and masks, no
 * transposes or gathers:
 *
 *   d of rows 0..7 (8 halves) | m of rows 0..7 (8 halves, Q4_1 only) | nib[4][32]
 *   nib[s] dword j = row j's nibble bytes 4s .. 4s+3 (low nibbles: k = 4s..; high: k = 16 + 4s..)
 *
 * Same bytes per row as the file; a weight's rows are packed only when they fill whole groups.
 *
 * Packed Q8_0 (TQ_PACKED + Q8_0): a group's block b is likewise one run of 8 * 34 bytes,
 *
 *   d of rows 0..7 (8 halves) | q[8][32]: q[s] dword j = row j's signed bytes 4s .. 4s+3
 *
 * which is the panel's step order (gblock.q) as it is: the unpacking is a copy, and up to MRG
 * activation rows read the steps straight from the weight (packed_direct); q8batch.c's zmm
 * strips read two groups' steps as the two halves of a register, with no transposes at any batch. */
static inline int scale_bytes(int t) { return base_type(t) == TQ_Q4_1 ? 4 * GR : 2 * GR; }

/* Packed Q4_K / Q6_K (TQ_PACKED + t): a group's super-block su is one run of 8 * unit_bytes at
 * group + 8 su * unit_bytes, its 8 units transposed by dwords:
 *
 *   dword c (c < unit_bytes / 4) of row j at 32 c + 4 j        (Q6_K: then the 8 rows' d, 2 bytes each)
 *
 * so a 32-byte load is lane j = row j's dword c: Q4_K's d | dmin, its scale bytes 0-3, 4-7, 8-11
 * (c = 0..3), then qs run p's step s (c = 4 + 8 p + s); Q6_K's ql run c's step s (8 c + s), qh
 * run h's (32 + 8 h + s), its int8 scales 4i .. 4i+3 (48 + i). What unpack_kgroup builds with
 * transposes on every call is then a load (kwords: qblocks.h). */

static void pack_kgroup(int t, uint8_t *rows, const uint8_t *copy, int64_t rbytes, int64_t nsu) {
    const int ub = unit_bytes(t), c4 = kwords(t), tail = ub % 4;
    for (int64_t su = 0; su < nsu; su++) {
        uint8_t *p = rows + su * GR * ub;
        for (int j = 0; j < GR; j++) {
            const uint8_t *u = copy + j * rbytes + su * ub;
            for (int c = 0; c < c4; c++) memcpy(p + 32 * c + 4 * j, u + 4 * c, 4);
            memcpy(p + 32 * c4 + tail * j, u + 4 * c4, (size_t)tail);
        }
    }
}

static void unpack_kunit(int t, const uint8_t *p, int j, uint8_t *u) { /* row j's unit of packed super-block p */
    const int c4 = kwords(t), tail = unit_bytes(t) % 4;
    for (int c = 0; c < c4; c++) memcpy(u + 4 * c, p + 32 * c + 4 * j, 4);
    memcpy(u + 4 * c4, p + 32 * c4 + tail * j, (size_t)tail);
}

void tq_q8_pack(int t, uint8_t *w, int64_t N, int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K);
    const int ub = unit_bytes(t), sb = scale_bytes(t);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / GR; g++) {
        uint8_t *rows = w + g * GR * rbytes, *copy = (uint8_t *)malloc((size_t)(GR * rbytes));
        if (copy == NULL) abort();
        memcpy(copy, rows, (size_t)(GR * rbytes));
        if (is_k_quant(t)) {
            pack_kgroup(t, rows, copy, rbytes, nb / 8);
            free(copy);
            continue;
        }
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < GR; j++) {
                const uint8_t *u = copy + j * rbytes + b * ub;
                uint8_t *p = rows + b * GR * ub;
                memcpy(p + 2 * j, u, 2);
                if (t == TQ_Q8_0) {
                    for (int s = 0; s < 8; s++) memcpy(p + sb + 32 * s + 4 * j, u + 2 + 4 * s, 4);
                    continue;
                }
                if (t == TQ_Q4_1) memcpy(p + 2 * GR + 2 * j, u + 2, 2);
                for (int s = 0; s < 4; s++) memcpy(p + sb + 32 * s + 4 * j, nibbles(t, u) + 4 * s, 4);
            }
        free(copy);
    }
}

/* Row n of packed rows back as the file has it: out[row_bytes] (embedding lookups, dequantizing). */
void tq_q8_unpack_row(int pt, const uint8_t *w, int64_t n, int64_t K, uint8_t *out) {
    const int t = base_type(pt), ub = unit_bytes(t), sb = scale_bytes(t), j = (int)(n % GR);
    const int64_t rbytes = row_bytes(t, K);
    const uint8_t *rows = w + n / GR * GR * rbytes;
    if (packed_k(pt)) {
        for (int64_t su = 0; su < K / (8 * QK); su++) unpack_kunit(t, rows + su * GR * ub, j, out + su * ub);
        return;
    }
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *p = rows + b * GR * ub;
        uint8_t *u = out + b * ub;
        memcpy(u, p + 2 * j, 2);
        if (t == TQ_Q8_0) {
            for (int s = 0; s < 8; s++) memcpy(u + 2 + 4 * s, p + sb + 32 * s + 4 * j, 4);
            continue;
        }
        if (t == TQ_Q4_1) memcpy(u + 2, p + 2 * GR + 2 * j, 2);
        for (int s = 0; s < 4; s++) memcpy((uint8_t *)nibbles(t, u) + 4 * s, p + sb + 32 * s + 4 * j, 4);
    }
}

/* Block sub (0..7) of K-quant unit u as the panel holds it: its 32 unsigned q (Q6_K: the stored
 * q + 32, 0..63) and d with m (Q4_K / Q5_K: d sc_b and -dmin mn_b, products exact in float32) or
 * d with the halves' scales (Q6_K: the unit's d, sc[2 sub] | sc[2 sub + 1] << 16). */
static void kquant_block(int t, const uint8_t *u, int sub, uint8_t q[QK], float *d, float *m, int32_t *sc) {
    int v[QK];
    block_ints(t, u, sub, v);
    for (int k = 0; k < QK; k++) q[k] = (uint8_t)(v[k] + (t == TQ_Q6_K ? 32 : 0));
    *m = 0.0f, *sc = 0;
    if (t == TQ_Q6_K) {
        *d = half_to_float(u + 208);
        const int8_t *s8 = (const int8_t *)(u + 192 + 2 * sub);
        *sc = (int32_t)((uint32_t)(uint16_t)(int16_t)s8[0] | (uint32_t)(uint16_t)(int16_t)s8[1] << 16);
    } else {
        unit_scales_t s;
        unit_scales(t, u, &s);
        *d = s.d[sub];
        *m = s.m[sub];
    }
}

/* Q6_K's exact block integer from the two halves' dots of unsigned q (q + 32) and x: the int8
 * scales folded in int32, sc0 (dot0 - 32 xh0) + sc1 (dot1 - 32 xh1); |each half| <= 16 * 32 * 127
 * and |sc| <= 128, so |isum| < 2^24: exact in int32 and as a float. */
static inline int q6_fold(int32_t sc, int dot0, int dot1, const int32_t *xh) {
    const int sc0 = (int16_t)(uint16_t)((uint32_t)sc & 0xffffu), sc1 = (int16_t)(uint16_t)((uint32_t)sc >> 16);
    return sc0 * (dot0 - 32 * xh[0]) + sc1 * (dot1 - 32 * xh[1]);
}

#ifdef TQ_AVX2
/* Exact sums of 4 byte products (u unsigned, s signed) per int32 lane. AVX2: maddubs gives int16
 * pair sums (never saturating here: the bounds above), added up in int16 (step16) and widened
 * once (widen16), or widened per step (step32). VNNI builds (AVX-512 VNNI's 256-bit form, or
 * AVX-VNNI): vpdpbusd adds the 4 products straight into int32, so widening is nothing. The
 * integers, and so every output, are the same in every build. */
#if defined(TQ_VNNI) || defined(__AVXVNNI__)
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#ifdef TQ_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
static inline __m256i step16(__m256i p, __m256i u, __m256i s) { return dpbusd(p, u, s); }
static inline __m256i widen16(__m256i p) { return p; }
static inline __m256i join16(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
static inline __m256i step32(__m256i p, __m256i u, __m256i s) { return dpbusd(p, u, s); }
#else
static inline __m256i step16(__m256i p, __m256i u, __m256i s) { return _mm256_add_epi16(p, _mm256_maddubs_epi16(u, s)); }
static inline __m256i join16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
static inline __m256i widen16(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
static inline __m256i step32(__m256i p, __m256i u, __m256i s) { return _mm256_add_epi32(p, widen16(_mm256_maddubs_epi16(u, s))); }
#endif

/* d of block b of 8 Q8_0 rows, one conversion */
static inline __m256 q8_0_scales(const uint8_t *w, int64_t rbytes, int64_t b) {
    uint16_t h[GR];
    for (int j = 0; j < GR; j++) memcpy(h + j, w + j * rbytes + b * unit_bytes(TQ_Q8_0), 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* 8 rows of 8 dwords -> 8 vectors, vector s = dword s of every row (lane j = row j) */
static inline __attribute__((always_inline)) void transpose8(const __m256i r[GR], __m256i out[GR]) {
    __m256i u[GR];
    for (int j = 0; j < GR; j += 4) { /* 4 rows: dwords s, s + 4 of rows j .. j+3 in each half */
        const __m256i t0 = _mm256_unpacklo_epi32(r[j], r[j + 1]), t1 = _mm256_unpackhi_epi32(r[j], r[j + 1]);
        const __m256i t2 = _mm256_unpacklo_epi32(r[j + 2], r[j + 3]), t3 = _mm256_unpackhi_epi32(r[j + 2], r[j + 3]);
        u[j] = _mm256_unpacklo_epi64(t0, t2), u[j + 1] = _mm256_unpackhi_epi64(t0, t2);
        u[j + 2] = _mm256_unpacklo_epi64(t1, t3), u[j + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int s = 0; s < 4; s++) {
        out[s] = _mm256_permute2x128_si256(u[s], u[s + 4], 0x20);
        out[s + 4] = _mm256_permute2x128_si256(u[s], u[s + 4], 0x31);
    }
}
#endif

#ifdef TQ_AVX2
/* Q4_K / Q5_K scales of 8 rows in lanes (lane j = row j): a[0] = d | dmin, a[1..3] = the 12 scale
 * bytes, decoded to block b's d sc_b (k4_d) and -dmin mn_b (k4_m), k4_scale_vectors' values. */
typedef struct {
    __m256 dv, nmv;
    __m256i v[4]; /* byte b % 4 of v[b / 4]: sc_b; of v[2 + b / 4]: mn_b */
} k4_lanes;

static inline __attribute__((always_inline)) k4_lanes k4_decode(const __m256i a[4]) {
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(a[0], _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                                   8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
        0xd8); /* d0..d7 | dmin0..dmin7 */
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x30303030);
    const k4_lanes k = {
        _mm256_cvtph_ps(_mm256_castsi256_si128(halves)),
        _mm256_xor_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), _mm256_set1_ps(-0.0f)),
        {_mm256_and_si256(a[1], m6),
         _mm256_or_si256(_mm256_and_si256(a[3], m4), _mm256_and_si256(_mm256_srli_epi32(a[1], 2), m2)),
         _mm256_and_si256(a[2], m6),
         _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a[3], 4), m4), _mm256_and_si256(_mm256_srli_epi32(a[2], 2), m2))}};
    return k;
}
static inline __attribute__((always_inline)) __m256 k4_d(const k4_lanes k, int b) {
    return _mm256_mul_ps(k.dv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(k.v[b / 4], 8 * (b % 4)), _mm256_set1_epi32(0xff))));
}
static inline __attribute__((always_inline)) __m256 k4_m(const k4_lanes k, int b) {
    return _mm256_mul_ps(k.nmv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(k.v[2 + b / 4], 8 * (b % 4)), _mm256_set1_epi32(0xff))));
}

/* Packed Q6_K scale dword vector v (lane j = row j's int8 scales 4i .. 4i+3) -> block 2i + hi's two
 * half scales, sign-extended in int32 lanes (q6_scales), or as the panel's pair sc0 | sc1 << 16
 * (q6_scale_pair: unpack_kgroup's transposed cvtepi8_epi16 values). */
static inline __attribute__((always_inline)) void q6_scales(__m256i v, int hi, __m256i *sc0, __m256i *sc1) {
    *sc0 = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 16 * hi), 24);
    *sc1 = _mm256_srai_epi32(_mm256_slli_epi32(v, 16 - 16 * hi), 24);
}
static inline __attribute__((always_inline)) __m256i q6_scale_pair(__m256i v, int hi) {
    __m256i sc0, sc1;
    q6_scales(v, hi, &sc0, &sc1);
    return _mm256_or_si256(_mm256_and_si256(sc0, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(sc1, 16));
}

/* Q6_K's exact block integers of 8 weight rows in lanes (q6_fold's): the halves' dots of q + 32
 * and x, the int8 half scales, the activation block's two half sums xh. */
static inline __attribute__((always_inline)) __m256i q6_fold_lanes(__m256i dot0, __m256i dot1, __m256i sc0, __m256i sc1,
                                                                   const int32_t *xh) {
    const __m256i e0 = _mm256_sub_epi32(dot0, _mm256_set1_epi32(32 * xh[0]));
    const __m256i e1 = _mm256_sub_epi32(dot1, _mm256_set1_epi32(32 * xh[1]));
    return _mm256_add_epi32(_mm256_mullo_epi32(e0, sc0), _mm256_mullo_epi32(e1, sc1));
}
#endif

/* K-quant rows n0 .. n0 + 7 unpacked into panel[nb], a super-block (8 blocks) at a time: block
 * b's step s at panel[b].q + 32 s (KQ), its d[8] (KD), m[8] / Q6_K's sc[8] (KM). AVX2: each
 * 32-byte run of the 8 rows (qs, qh, ql) is transposed once (transpose8: vector s = the rows'
 * bytes 4s .. 4s+3, lane j = row j), which is a panel step for every block that run feeds; Q4_K /
 * Q5_K scales are decoded in lanes, Q6_K's 8 scale pairs per row transposed. (q8batch.c's
 * unpack_k4_strip / unpack_q6k_strip make the same values for 16 rows at a time.) */
#define KQ(b, s) ((uint8_t *)(o + (b))->q + 32 * (s))
#define KD(b) ((uint8_t *)(o + (b))->d)
#define KM(b) ((uint8_t *)(o + (b))->m)
static void unpack_kgroup(int t, const uint8_t *w, int64_t rbytes, int64_t nb, gblock *panel) {
    const int pk = packed_k(t), bt = base_type(t), ub = unit_bytes(t);
    const uint8_t *next = w + GR * rbytes;
    for (int64_t su = 0; su < nb / 8; su++) {
        gblock *o = panel + 8 * su;
        for (int64_t off = su * GR * ub; off < (su + 1) * GR * ub; off += 64) __builtin_prefetch(next + off);
#ifdef TQ_AVX2
        const uint8_t *u[GR], *pw = w + su * GR * ub; /* pw: the packed super-block */
        for (int j = 0; j < GR; j++) u[j] = w + j * rbytes + su * ub;
        __m256i r[GR], tr[GR];
        const __m256i mask = _mm256_set1_epi8(15);
        if (bt == TQ_Q6_K) {
            uint16_t hd[GR];
            if (pk) {
                memcpy(hd, pw + 32 * kwords(bt), sizeof(hd));
                for (int i = 0; i < 4; i++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(pw + 32 * (48 + i)));
                    tr[2 * i] = q6_scale_pair(v, 0), tr[2 * i + 1] = q6_scale_pair(v, 1);
                }
            } else {
                for (int j = 0; j < GR; j++) {
                    memcpy(hd + j, u[j] + 208, 2);
                    r[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u[j] + 192))); /* dword b: sc 2b, 2b+1 */
                }
                transpose8(r, tr);
            }
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
            for (int b = 0; b < 8; b++) {
                _mm256_store_ps((float *)KD(b), dv);
                _mm256_store_si256((__m256i *)KM(b), tr[b]);
            }
            __m256i qh[2][GR];
            for (int h = 0; h < 2; h++) {
                if (pk) {
                    for (int s = 0; s < 8; s++) qh[h][s] = _mm256_loadu_si256((const __m256i *)(pw + 32 * (32 + 8 * h + s)));
                } else {
                    for (int j = 0; j < GR; j++) r[j] = _mm256_loadu_si256((const __m256i *)(u[j] + 128 + 32 * h));
                    transpose8(r, qh[h]);
                }
            }
            const __m256i three = _mm256_set1_epi8(3);
            for (int c = 0; c < 4; c++) { /* ql run c: low nibbles block 4h + c % 2, high block 4h + 2 + c % 2 */
                const int h = c / 2, b0 = 4 * h + c % 2, r0 = c % 2;
                if (pk) {
                    for (int s = 0; s < 8; s++) tr[s] = _mm256_loadu_si256((const __m256i *)(pw + 32 * (8 * c + s)));
                } else {
                    for (int j = 0; j < GR; j++) r[j] = _mm256_loadu_si256((const __m256i *)(u[j] + 32 * c));
                    transpose8(r, tr);
                }
                for (int s = 0; s < 8; s++) {
                    const __m256i hi0 = _mm256_and_si256(_mm256_srl_epi16(qh[h][s], _mm_cvtsi32_si128(2 * r0)), three);
                    const __m256i hi1 = _mm256_and_si256(_mm256_srl_epi16(qh[h][s], _mm_cvtsi32_si128(2 * r0 + 4)), three);
                    const __m256i lo = _mm256_and_si256(tr[s], mask), hn = _mm256_and_si256(_mm256_srli_epi16(tr[s], 4), mask);
                    _mm256_store_si256((__m256i *)KQ(b0, s), _mm256_or_si256(lo, _mm256_slli_epi16(hi0, 4)));
                    _mm256_store_si256((__m256i *)KQ(b0 + 2, s), _mm256_or_si256(hn, _mm256_slli_epi16(hi1, 4)));
                }
            }
            continue;
        }
        { /* the rows' first 16 bytes (d | dmin, then the 12 scale bytes a0 a1 a2) as 4 dword vectors, lane
             j = row j (packed: 4 loads; else a 4 x 4 dword transpose per 128-bit half), then decoded in lanes */
            __m256i a[4];
            if (pk) {
                for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_si256((const __m256i *)(pw + 32 * i));
            } else {
                __m256i h[4];
                for (int i = 0; i < 4; i++)
                    h[i] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)u[i + 4]), _mm_loadu_si128((const __m128i *)u[i]));
                const __m256i t0 = _mm256_unpacklo_epi32(h[0], h[1]), t1 = _mm256_unpackhi_epi32(h[0], h[1]);
                const __m256i t2 = _mm256_unpacklo_epi32(h[2], h[3]), t3 = _mm256_unpackhi_epi32(h[2], h[3]);
                a[0] = _mm256_unpacklo_epi64(t0, t2), a[1] = _mm256_unpackhi_epi64(t0, t2);
                a[2] = _mm256_unpacklo_epi64(t1, t3), a[3] = _mm256_unpackhi_epi64(t1, t3);
            }
            const k4_lanes kl = k4_decode(a);
            for (int b = 0; b < 8; b++) {
                _mm256_store_ps((float *)KD(b), k4_d(kl, b));
                _mm256_store_ps((float *)KM(b), k4_m(kl, b));
            }
        }
        __m256i qh[GR];
        if (t == TQ_Q5_K) {
            for (int j = 0; j < GR; j++) r[j] = _mm256_loadu_si256((const __m256i *)(u[j] + 16));
            transpose8(r, qh);
        }
        const int qoff = t == TQ_Q4_K ? 16 : 48;
        for (int p = 0; p < 4; p++) { /* qs run p: low nibbles block 2p, high block 2p + 1 */
            if (pk) {
                for (int s = 0; s < 8; s++) tr[s] = _mm256_loadu_si256((const __m256i *)(pw + 32 * (4 + 8 * p + s)));
            } else {
                for (int j = 0; j < GR; j++) r[j] = _mm256_loadu_si256((const __m256i *)(u[j] + qoff + 32 * p));
                transpose8(r, tr);
            }
            for (int s = 0; s < 8; s++) {
                __m256i lo = _mm256_and_si256(tr[s], mask), hn = _mm256_and_si256(_mm256_srli_epi16(tr[s], 4), mask);
                if (t == TQ_Q5_K) { /* bit b of qh[l] is bit 4 of block b's element l */
                    const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * p))), b1 = _mm256_set1_epi8((char)(2 << (2 * p)));
                    const __m256i sixteen = _mm256_set1_epi8(16);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh[s], b0), b0), sixteen));
                    hn = _mm256_or_si256(hn, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh[s], b1), b1), sixteen));
                }
                _mm256_store_si256((__m256i *)KQ(2 * p, s), lo);
                _mm256_store_si256((__m256i *)KQ(2 * p + 1, s), hn);
            }
        }
#else
        for (int j = 0; j < GR; j++) {
            uint8_t unit[256];
            if (pk) unpack_kunit(bt, w + su * GR * ub, j, unit);
            for (int b = 0; b < 8; b++) {
                uint8_t q[QK];
                float d, m;
                int32_t sc;
                kquant_block(bt, pk ? unit : w + j * rbytes + su * ub, b, q, &d, &m, &sc);
                for (int k = 0; k < QK; k++) KQ(b, k / 4)[4 * j + k % 4] = q[k];
                memcpy(KD(b) + 4 * j, &d, 4);
                if (bt == TQ_Q6_K)
                    memcpy(KM(b) + 4 * j, &sc, 4);
                else
                    memcpy(KM(b) + 4 * j, &m, 4);
            }
        }
#endif
    }
}
#undef KQ
#undef KD
#undef KM

/* Block b of the group at next (GR units of ub bytes, a run in packed rows; in the file's rows the
 * same bytes of the next group's first rows) into the cache, while this group's block is used. */
static inline void prefetch_block(const uint8_t *next, int64_t b, int ub) {
    for (int64_t off = b * GR * ub; off < (b + 1) * GR * ub; off += 64) __builtin_prefetch(next + off);
}

/* Rows n0 .. n0 + 7 of w unpacked into panel[nb]: q unsigned (the stored q plus q_bias) for the
 * 4/5-bit types, int8 for Q8_0. */
static void unpack_group(int t, const uint8_t *w, int64_t rbytes, int64_t nb, gblock *panel) {
    const int ub = unit_bytes(t);
    if (is_k_quant(t)) {
        unpack_kgroup(t, w, rbytes, nb, panel);
        return;
    }
    const uint8_t *next = w + GR * rbytes; /* the next group's rows, fetched while this one is unpacked */
    for (int64_t b = 0; b < nb; b++) {
        gblock *g = panel + b;
        prefetch_block(next, b, ub);
#ifdef TQ_AVX2
        __m256i step[GR];
        if (packed_type(t)) {
            const uint8_t *p = w + b * GR * ub;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
            _mm256_store_ps(g->d, dv);
            _mm256_store_ps(g->m, base_type(t) == TQ_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * GR)))
                                                          : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f)));
            const __m256i mask = _mm256_set1_epi8(15);
            for (int s = 0; s < 4; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + scale_bytes(t) + 32 * s));
                step[s] = _mm256_and_si256(v, mask);
                step[s + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
        } else if (packed_q8_0(t)) { /* the steps as they are stored */
            const uint8_t *p = w + b * GR * ub;
            _mm256_store_ps(g->d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
            for (int s = 0; s < GR; s++) step[s] = _mm256_loadu_si256((const __m256i *)(p + 2 * GR + 32 * s));
        } else if (t == TQ_Q8_0) { /* signed q, no minimum: the rows' 8 dwords transposed, d per row */
            __m256i r[GR];
            for (int j = 0; j < GR; j++) r[j] = _mm256_loadu_si256((const __m256i *)(w + j * rbytes + b * ub + 2));
            _mm256_store_ps(g->d, q8_0_scales(w, rbytes, b));
            transpose8(r, step);
        } else {
            /* the rows' first 4 bytes (d, and m for Q4_1 / Q5_1) -> d[8], m[8], one conversion each */
            int32_t dm[GR];
            for (int j = 0; j < GR; j++) memcpy(dm + j, w + j * rbytes + b * ub, 4);
            const __m256i halves = _mm256_permute4x64_epi64(
                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)dm),
                                    _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                                     8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
                0xd8); /* d0..d7 | m0..m7 */
            const __m256 dv = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
            _mm256_store_ps(g->d, dv);
            _mm256_store_ps(g->m, t == TQ_Q4_1 || t == TQ_Q5_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))
                                                               : _mm256_mul_ps(dv, _mm256_set1_ps(-(float)q_bias(t))));
            /* rows' nibble dwords t (bytes 4t .. 4t+3) gathered into vector t, lane j = row j: a 4 x 4
             * dword transpose in each 128-bit half (rows 0-3 low, 4-7 high); low nibbles are steps
             * 0-3 (elements 0-15), high nibbles steps 4-7 */
            __m256i a[4];
            for (int r = 0; r < 4; r++)
                a[r] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)nibbles(t, w + (r + 4) * rbytes + b * ub)),
                                        _mm_loadu_si128((const __m128i *)nibbles(t, w + r * rbytes + b * ub)));
            const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
            const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
            const __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                                  _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
            const __m256i mask = _mm256_set1_epi8(15);
            for (int s = 0; s < 4; s++) {
                step[s] = _mm256_and_si256(v[s], mask);
                step[s + 4] = _mm256_and_si256(_mm256_srli_epi16(v[s], 4), mask);
            }
            if (five_bit(t)) { /* bit 4 of element k is bit k of qh: 16 or 0 per byte, transposed alike */
                __m256i hb[GR], ht[GR];
                for (int j = 0; j < GR; j++) {
                    uint32_t qh;
                    memcpy(&qh, nibbles(t, w + j * rbytes + b * ub) - 4, 4);
                    hb[j] = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16));
                }
                transpose8(hb, ht);
                for (int s = 0; s < GR; s++) step[s] = _mm256_or_si256(step[s], ht[s]);
            }
        }
        for (int s = 0; s < GR; s++) _mm256_store_si256((__m256i *)(g->q + 32 * s), step[s]);
#else
        if (packed_q8_0(t)) {
            const uint8_t *p = w + b * GR * ub;
            memcpy(g->q, p + 2 * GR, sizeof g->q);
            for (int j = 0; j < GR; j++) g->d[j] = half_to_float(p + 2 * j), g->m[j] = 0.0f;
            continue;
        }
        if (packed_type(t)) {
            const uint8_t *p = w + b * GR * ub, *nib = p + scale_bytes(t);
            for (int j = 0; j < GR; j++) {
                for (int k = 0; k < QK; k++) {
                    const uint8_t byte = nib[32 * (k % 16 / 4) + 4 * j + k % 4];
                    g->q[32 * (k / 4) + 4 * j + k % 4] = k < 16 ? byte & 15 : byte >> 4;
                }
                g->d[j] = half_to_float(p + 2 * j);
                g->m[j] = base_type(t) == TQ_Q4_1 ? half_to_float(p + 2 * GR + 2 * j) : -8.0f * g->d[j];
            }
            continue;
        }
        for (int j = 0; j < GR; j++) {
            const uint8_t *u = w + j * rbytes + b * ub;
            int v[QK];
            block_ints(t, u, 0, v);
            for (int k = 0; k < QK; k++) g->q[32 * (k / 4) + 4 * j + k % 4] = (uint8_t)(v[k] + q_bias(t));
            g->d[j] = half_to_float(u);
            g->m[j] = t == TQ_Q8_0 ? 0.0f : block_min(t, u);
        }
#endif
    }
}

/* NX (<= MRG) activation rows times NG (1 or 2) groups, group h's panel at panel + h nb:
 * out[i * ostride + 8 h + j], j < 8. Two groups share each activation broadcast (NX <= MR2). */
static inline __attribute__((always_inline)) void group_tile(const int t, const gblock *panel, int64_t nb,
                                                             tq_q8acts x, int64_t K, const int NG, const int NX,
                                                             const float *bias, float *out, int64_t ostride) {
#ifdef TQ_AVX2 /* every array below indexed by unrolled constants only, so all of it stays in registers */
    __m256 acc[2][MRG];
#pragma GCC unroll 2
    for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
        for (int i = 0; i < NX; i++) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = x.q + b * QK;
        __m256i p[2][MRG], w5[2][MRG];
#pragma GCC unroll 2
        for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) p[h][i] = w5[h][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            __m256i q[2], aq[2];
#pragma GCC unroll 2
            for (int h = 0; h < NG; h++) {
                q[h] = _mm256_load_si256((const __m256i *)(panel[h * nb + b].q + 32 * s));
                if (t == TQ_Q8_0) aq[h] = _mm256_sign_epi8(q[h], q[h]);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) {
                int32_t v;
                memcpy(&v, xb + i * K + 4 * s, 4);
                const __m256i xv = _mm256_set1_epi32(v);
#pragma GCC unroll 2
                for (int h = 0; h < NG; h++) {
                    if (t == TQ_Q8_0) /* |q| times x with q's sign (at most 2 * 128 * 127 per pair), widened per step */
                        p[h][i] = step32(p[h][i], aq[h], _mm256_sign_epi8(xv, q[h]));
                    else if (t == TQ_Q6_K) /* 6-bit q: 2 * 63 * 127 per pair, widened per step */
                        p[h][i] = step32(p[h][i], q[h], xv);
                    else
                        p[h][i] = step16(p[h][i], q[h], xv);
                    __asm__("" : "+x"(p[h][i])); /* keep the chain: reassociated into a tree, it spills */
                }
            }
            if ((five_bit(t) || t == TQ_Q6_K) && s == 3) { /* 5-bit q: 4 steps fill int16 (4 * 2 * 31 * 127 < 32767);
                                                             Q6_K: the first half's dot, kept apart */
#pragma GCC unroll 2
                for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
                    for (int i = 0; i < NX; i++)
                        w5[h][i] = t == TQ_Q6_K ? p[h][i] : widen16(p[h][i]), p[h][i] = _mm256_setzero_si256();
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < NG; h++) {
            const gblock *g = panel + h * nb + b;
            const __m256 dw = _mm256_load_ps(g->d);
            __m256i sc0 = _mm256_setzero_si256(), sc1 = sc0;
            if (t == TQ_Q6_K) { /* the halves' int8 scales, sign-extended from their int16 halves */
                const __m256i sc = _mm256_load_si256((const __m256i *)g->sc);
                sc0 = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16), 16);
                sc1 = _mm256_srai_epi32(sc, 16);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) {
                __m256 isum;
                if (t == TQ_Q6_K) {
                    isum = _mm256_cvtepi32_ps(q6_fold_lanes(w5[h][i], p[h][i], sc0, sc1, x.h + 2 * (i * nb + b)));
                } else {
                    const __m256i wide = t == TQ_Q8_0 ? p[h][i] : widen16(p[h][i]);
                    isum = _mm256_cvtepi32_ps(five_bit(t) ? _mm256_add_epi32(w5[h][i], wide) : wide);
                }
                acc[h][i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + i * nb + b)), acc[h][i]);
                if (has_min(t))
                    acc[h][i] = _mm256_fmadd_ps(_mm256_load_ps(g->m), _mm256_broadcast_ss(x.s + i * nb + b), acc[h][i]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NG; h++)
#pragma GCC unroll 4
        for (int i = 0; i < NX; i++) {
            __m256 o = acc[h][i];
            if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias + GR * h));
            _mm256_storeu_ps(out + i * ostride + GR * h, o);
        }
#else
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < GR * NG; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const gblock *g = panel + (j / GR) * nb + b;
                const int8_t *xq = x.q + i * K + b * QK;
                int dot[2] = {0, 0};
                for (int k = 0; k < QK; k++) {
                    const uint8_t q = g->q[32 * (k / 4) + 4 * (j % GR) + k % 4];
                    dot[k / 16] += (t == TQ_Q8_0 ? (int)(int8_t)q : (int)q) * xq[k];
                }
                const int isum = t == TQ_Q6_K ? q6_fold(g->sc[j % GR], dot[0], dot[1], x.h + 2 * (i * nb + b))
                                              : dot[0] + dot[1];
                acc = fmaf((float)isum, g->d[j % GR] * x.d[i * nb + b], acc);
                if (has_min(t)) acc = fmaf(g->m[j % GR], x.s[i * nb + b], acc);
            }
            out[i * ostride + j] = bias ? acc + bias[j] : acc;
        }
#endif
}

/* One weight row (a group's leftover, N % 8) times every activation row, the same operations
 * per output as group_tile: plain C in every build. */
static void single_row(int t, const uint8_t *row, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t K) {
    const int64_t nb = K / QK;
    const int ub = unit_bytes(t);
    for (int64_t i = 0; i < M; i++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *xq = x.q + i * K + b * QK;
            if (is_k_quant(t)) { /* the panel's values (kquant_block) and operations */
                uint8_t q[QK];
                float d, m;
                int32_t sc;
                int dot[2] = {0, 0};
                kquant_block(t, row + b / 8 * ub, (int)(b % 8), q, &d, &m, &sc);
                for (int k = 0; k < QK; k++) dot[k / 16] += (int)q[k] * xq[k];
                const int isum = t == TQ_Q6_K ? q6_fold(sc, dot[0], dot[1], x.h + 2 * (i * nb + b)) : dot[0] + dot[1];
                acc = fmaf((float)isum, d * x.d[i * nb + b], acc);
                if (has_min(t)) acc = fmaf(m, x.s[i * nb + b], acc);
                continue;
            }
            const uint8_t *u = row + b * ub;
            int v[QK], isum = 0;
            block_ints(t, u, 0, v);
            for (int k = 0; k < QK; k++) isum += (v[k] + q_bias(t)) * xq[k];
            acc = fmaf((float)isum, half_to_float(u) * x.d[i * nb + b], acc);
            if (t != TQ_Q8_0) acc = fmaf(block_min(t, u), x.s[i * nb + b], acc);
        }
        y[i * ldy] = bias ? acc + bias[0] : acc;
    }
}

#ifdef TQ_AVX2
/* Q8_0 up to Q8_0_DIRECT activation rows: one group straight from the file's rows, no panel. Each row's
 * block dot is taken along k (|q| times x with q's sign, pairs widened) and the 8 rows' partial
 * sums reduced to one vector of exact block dots, lane j = row j -- the same integers as the
 * panel path, then the same float operations, so the result is the same bits. Two weight rows'
 * partial sums are folded (hadd) as soon as they are made, so NX rows fit in registers. */
static inline __attribute__((always_inline)) void q8_0_direct(const uint8_t *w, int64_t rbytes, int64_t nb,
                                                              tq_q8acts x, int64_t K, const int NX,
                                                              const float *bias, float *out, int64_t ostride) {
    const int ub = unit_bytes(TQ_Q8_0);
    const uint8_t *next = w + GR * rbytes;
    __m256 acc[MRG];
    for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_block(next, b, ub);
        __m256i pair[4][MRG], xv[MRG]; /* pair[r][i]: hadd of rows 2r, 2r + 1 for activation row i */
        for (int i = 0; i < NX; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(x.q + i * K + b * QK));
        for (int r = 0; r < 4; r++) {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + 2 * r * rbytes + b * ub + 2));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w + (2 * r + 1) * rbytes + b * ub + 2));
            const __m256i a0 = _mm256_sign_epi8(q0, q0), a1 = _mm256_sign_epi8(q1, q1);
            for (int i = 0; i < NX; i++)
                pair[r][i] = _mm256_hadd_epi32(step32(_mm256_setzero_si256(), a0, _mm256_sign_epi8(xv[i], q0)),
                                               step32(_mm256_setzero_si256(), a1, _mm256_sign_epi8(xv[i], q1)));
        }
        const __m256 dw = q8_0_scales(w, rbytes, b);
        for (int i = 0; i < NX; i++) {
            /* per 128-bit half: g0 = rows 0-3 (low half: elements 0-3, high: 4-7), g1 rows 4-7 */
            const __m256i g0 = _mm256_hadd_epi32(pair[0][i], pair[1][i]);
            const __m256i g1 = _mm256_hadd_epi32(pair[2][i], pair[3][i]);
            const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                                                  _mm256_permute2x128_si256(g0, g1, 0x31));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + i * nb + b)),
                                     acc[i]);
        }
    }
    for (int i = 0; i < NX; i++) {
        __m256 o = acc[i];
        if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(out + i * ostride, o);
    }
}

/* Packed Q4_0 / Q4_1 / Q8_0, NX (<= MRG) activation rows: a group's steps straight from the packed
 * block into registers, no panel; the same integers and float operations as group_tile, so the
 * same bits (Q8_0: its 8 steps as stored, |q| times x with q's sign, widened per step). */
static inline __attribute__((always_inline)) void packed_direct(const int t, const uint8_t *w, int64_t nb,
                                                                tq_q8acts x, int64_t K, const int NX,
                                                                const float *bias, float *out, int64_t ostride) {
    const __m256i mask = _mm256_set1_epi8(15);
    const int q8 = packed_q8_0(t), ub = unit_bytes(t), sb = scale_bytes(t);
    const uint8_t *next = w + GR * nb * ub;
    __m256 acc[MRG];
    for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * GR * ub;
        prefetch_block(next, b, ub);
        __m256i p16[MRG]; /* Q8_0: int32 sums */
        for (int i = 0; i < NX; i++) p16[i] = _mm256_setzero_si256();
        for (int s = 0; s < 8 * q8; s++) { /* Q8_0's steps; the loop below is Q4's (t is a constant: one of them runs) */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(p + sb + 32 * s)), aq = _mm256_sign_epi8(q, q);
            for (int i = 0; i < NX; i++) {
                int32_t v;
                memcpy(&v, x.q + i * K + b * QK + 4 * s, 4);
                p16[i] = step32(p16[i], aq, _mm256_sign_epi8(_mm256_set1_epi32(v), q));
                __asm__("" : "+x"(p16[i]));
            }
        }
        __m256i ph[MRG]; /* the high nibbles' sums, a second chain per row, joined after the block: the same
                            integer (both halves < 16384 in int16), 1.04-1.07x at 1-4 rows in the VNNI
                            builds (Zen 4, 3072 x 576), no change in AVX2 */
        for (int i = 0; i < NX; i++) ph[i] = _mm256_setzero_si256();
        for (int s = 0; s < 4 * !q8; s++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + sb + 32 * s));
            const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int i = 0; i < NX; i++) {
                const int8_t *xb = x.q + i * K + b * QK;
                int32_t xl, xh;
                memcpy(&xl, xb + 4 * s, 4);
                memcpy(&xh, xb + 16 + 4 * s, 4);
                p16[i] = step16(p16[i], lo, _mm256_set1_epi32(xl));
                ph[i] = step16(ph[i], hi, _mm256_set1_epi32(xh));
            }
        }
        if (!q8)
            for (int i = 0; i < NX; i++) p16[i] = join16(p16[i], ph[i]);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mv = base_type(t) == TQ_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * GR)))
                                                  : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
        for (int i = 0; i < NX; i++) {
            const __m256 isum = _mm256_cvtepi32_ps(q8 ? p16[i] : widen16(p16[i]));
            acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_broadcast_ss(x.d + i * nb + b)), acc[i]);
            if (!q8) acc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(x.s + i * nb + b), acc[i]);
        }
    }
    for (int i = 0; i < NX; i++) {
        __m256 o = acc[i];
        if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(out + i * ostride, o);
    }
}

/* Packed Q4_K / Q6_K, NX (<= MRG) activation rows: a group's super-block straight from its packed
 * dwords into registers, no panel: the panel's values (k4_decode, q6_scale_pair), the same exact
 * block integers and the same float operations per block in order as group_tile, so the same bits.
 * Q4_K takes a qs run's two blocks (low and high nibbles) together, and so does Q6_K (up to
 * Q6K_DIRECT rows: its sums for 4 blocks stay live; more rows take the panel). */
static inline __attribute__((always_inline)) void packed_k_direct(const int t, const uint8_t *w, int64_t nb,
                                                                  tq_q8acts x, int64_t K, const int NX,
                                                                  const float *bias, float *out, int64_t ostride) {
    const __m256i mask = _mm256_set1_epi8(15);
    const int ub = unit_bytes(t);
    const uint8_t *next = w + GR * nb / 8 * ub;
    __m256 acc[MRG];
    for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t su = 0; su < nb / 8; su++) {
        const uint8_t *p = w + su * GR * ub;
        for (int off = 0; off < GR * ub; off += 64) __builtin_prefetch(next + su * GR * ub + off);
        if (base_type(t) == TQ_Q4_K) {
            __m256i a[4];
            for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_si256((const __m256i *)(p + 32 * i));
            const k4_lanes kl = k4_decode(a);
            for (int r = 0; r < 4; r++) { /* qs run r: blocks 2r (low nibbles), 2r + 1 (high) */
                const int64_t b = 8 * su + 2 * r;
                __m256i lo16[MRG], hi16[MRG];
                for (int i = 0; i < NX; i++) lo16[i] = hi16[i] = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * (4 + 8 * r + s)));
                    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    for (int i = 0; i < NX; i++) {
                        const int8_t *xb = x.q + i * K + b * QK;
                        int32_t xl, xh;
                        memcpy(&xl, xb + 4 * s, 4);
                        memcpy(&xh, xb + QK + 4 * s, 4);
                        lo16[i] = step16(lo16[i], lo, _mm256_set1_epi32(xl));
                        hi16[i] = step16(hi16[i], hi, _mm256_set1_epi32(xh));
                    }
                }
                for (int h = 0; h < 2; h++) {
                    const __m256 dw = k4_d(kl, 2 * r + h), mw = k4_m(kl, 2 * r + h);
                    for (int i = 0; i < NX; i++) {
                        const __m256 isum = _mm256_cvtepi32_ps(widen16(h ? hi16[i] : lo16[i]));
                        acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + i * nb + b + h)), acc[i]);
                        acc[i] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(x.s + i * nb + b + h), acc[i]);
                    }
                }
            }
        } else { /* Q6_K (1-2 rows: Q6K_DIRECT): ql run c = 2h + r gives blocks 4h + r (low nibbles) and 4h + 2 + r
                                 (high), both from one load of ql and of qh; each block's exact
                                 integer is kept until its turn (blocks 4h .. 4h+3 in order) */
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 * kwords(t))));
            const __m256i three = _mm256_set1_epi8(3);
            for (int h = 0; h < 2; h++) {
                __m256i isum[4][MRG]; /* [block 4h + i][row] */
#pragma GCC unroll 2
                for (int r = 0; r < 2; r++) {
                    __m256i dot[2][2][MRG]; /* [low / high nibble block][half][row] */
                    for (int e = 0; e < 2; e++)
                        for (int i = 0; i < NX; i++) dot[e][0][i] = dot[e][1][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int s = 0; s < 8; s++) {
                        const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 32 * (8 * (2 * h + r) + s)));
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 32 * (32 + 8 * h + s)));
                        const __m256i q0 = _mm256_or_si256(_mm256_and_si256(ql, mask),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), three), 4));
                        const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), mask),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * r + 4), three), 4));
                        for (int i = 0; i < NX; i++) {
                            const int8_t *xb = x.q + i * K + (8 * su + 4 * h + r) * QK + 4 * s;
                            int32_t x0, x1;
                            memcpy(&x0, xb, 4);
                            memcpy(&x1, xb + 2 * QK, 4);
                            dot[0][s / 4][i] = step32(dot[0][s / 4][i], q0, _mm256_set1_epi32(x0));
                            dot[1][s / 4][i] = step32(dot[1][s / 4][i], q1, _mm256_set1_epi32(x1));
                        }
                    }
                    for (int e = 0; e < 2; e++) { /* block 4h + r + 2e: q6_fold in lanes */
                        const int sb = 4 * h + r + 2 * e;
                        __m256i sc0, sc1;
                        q6_scales(_mm256_loadu_si256((const __m256i *)(p + 32 * (48 + sb / 2))), sb % 2, &sc0, &sc1);
                        for (int i = 0; i < NX; i++)
                            isum[r + 2 * e][i] = q6_fold_lanes(dot[e][0][i], dot[e][1][i], sc0, sc1, x.h + 2 * (i * nb + 8 * su + sb));
                    }
                }
                for (int sb = 0; sb < 4; sb++)
                    for (int i = 0; i < NX; i++)
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[sb][i]),
                                                 _mm256_mul_ps(dv, _mm256_broadcast_ss(x.d + i * nb + 8 * su + 4 * h + sb)), acc[i]);
            }
        }
    }
    for (int i = 0; i < NX; i++) {
        __m256 o = acc[i];
        if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(out + i * ostride, o);
    }
}

#endif

/* 1 when group_work reads M activation rows of type t straight into registers (the SIMD builds),
 * no panel. */
static int takes_registers(int t, int64_t M) {
#ifdef TQ_AVX2
    return (t == TQ_Q8_0 && M <= Q8_0_DIRECT) || (is_packed(t) && M <= (base_type(t) == TQ_Q6_K ? Q6K_DIRECT : MRG));
#else
    (void)t, (void)M;
    return 0;
#endif
}

#define GTILE(NG, NX) group_tile(base_type(t), panel, nb, xm, K, NG, NX, bn, out, ldy)

/* Groups g and, when pair, g + 1 (weight rows 8g .. 8g+15) times every activation row; t a
 * constant after inlining. */
static inline __attribute__((always_inline)) void group_work(const int t, const uint8_t *w, tq_q8acts x, float *y,
                                                             int64_t ldy, const float *bias, int64_t M, int64_t K,
                                                             int64_t g, int pair, gblock *panel) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K);
    const float *bn = bias ? bias + g * GR : NULL;
#ifdef TQ_AVX2
    /* few rows: registers beat the panel (packed Q4: 1.5x at M = 1, ~1.05x at 4; Q8_0: 1.25x at 1,
     * 1.13x at 2 and 3; the same along k for unpacked Q4 measured 0.91-0.94x the panel: not taken).
     * Packed Q8_0 takes them at every batch, 4 rows at a time over the group's bytes (in L1 after the
     * first tile): the panel's tiles of 2 rows re-take |q| per step for fewer rows (lm_head
     * 49152 x 576, forced avx2 build on AMD Zen 4, one thread: 1.9x at 5 rows, 1.4x at 16 and 32). */
    if (takes_registers(t, M) || packed_q8_0(t)) {
        for (int h = 0; h <= pair; h++) {
            const uint8_t *wg = w + (g + h) * GR * rbytes;
            const float *bh = bn ? bn + GR * h : NULL;
            float *yh = y + (g + h) * GR;
            if (t == TQ_Q8_0) {
                switch (M) {
                    case 1: q8_0_direct(wg, rbytes, nb, x, K, 1, bh, yh, ldy); break;
                    case 2: q8_0_direct(wg, rbytes, nb, x, K, 2, bh, yh, ldy); break;
                    default: q8_0_direct(wg, rbytes, nb, x, K, 3, bh, yh, ldy); break;
                }
            } else if (packed_k(t)) {
                switch (M) {
                    case 1: packed_k_direct(t, wg, nb, x, K, 1, bh, yh, ldy); break;
                    case 2: packed_k_direct(t, wg, nb, x, K, 2, bh, yh, ldy); break;
                    case 3: packed_k_direct(t, wg, nb, x, K, 3, bh, yh, ldy); break;
                    default: packed_k_direct(t, wg, nb, x, K, MRG, bh, yh, ldy); break;
                }
            } else {
                for (int64_t m0 = 0; m0 < M; m0 += MRG) {
                    const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
                    float *ym = yh + m0 * ldy;
                    switch (M - m0 < MRG ? M - m0 : MRG) {
                        case 1: packed_direct(t, wg, nb, xm, K, 1, bh, ym, ldy); break;
                        case 2: packed_direct(t, wg, nb, xm, K, 2, bh, ym, ldy); break;
                        case 3: packed_direct(t, wg, nb, xm, K, 3, bh, ym, ldy); break;
                        default: packed_direct(t, wg, nb, xm, K, MRG, bh, ym, ldy); break;
                    }
                }
            }
        }
        return;
    }
#endif
    for (int h = 0; h <= pair; h++) unpack_group(t, w + (g + h) * GR * rbytes, rbytes, nb, panel + h * nb);
    const int mr = pair ? MR2 : MRG;
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
        const tq_q8acts xm = tq_q8_rows_from(x, m0, K);
        float *out = y + m0 * ldy + g * GR;
        const int nx = M - m0 < mr ? (int)(M - m0) : mr;
        if (pair) {
            if (nx == 1)
                GTILE(2, 1);
            else
                GTILE(2, MR2);
        } else {
            switch (nx) {
                case 1: GTILE(1, 1); break;
                case 2: GTILE(1, 2); break;
                case 3: GTILE(1, 3); break;
                default: GTILE(1, MRG); break;
            }
        }
    }
}

/* The groups split over the threads; the type switch inside the parallel loop, so that each
 * type's copy of the loop is compiled with its type a constant (OpenMP outlines the region
 * before inlining could specialize it). */
static void group_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t N, int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K), groups = N / GR;
#pragma omp parallel
    {
        gblock *panel = (gblock *)aligned_alloc(32, (size_t)(2 * nb) * sizeof(gblock));
        if (panel == NULL) abort();
#pragma omp for schedule(static)
        for (int64_t g2 = 0; g2 < (groups + 1) / 2; g2++) {
            const int64_t g = 2 * g2;
            const int pair = g + 1 < groups;
            switch (t) {
                case TQ_Q4_0: group_work(TQ_Q4_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q4_1: group_work(TQ_Q4_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q5_0: group_work(TQ_Q5_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q5_1: group_work(TQ_Q5_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q4_0: group_work(TQ_PACKED + TQ_Q4_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q4_1: group_work(TQ_PACKED + TQ_Q4_1, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q4_K: group_work(TQ_Q4_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q5_K: group_work(TQ_Q5_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_Q6_K: group_work(TQ_Q6_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q4_K: group_work(TQ_PACKED + TQ_Q4_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q6_K: group_work(TQ_PACKED + TQ_Q6_K, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                case TQ_PACKED + TQ_Q8_0: group_work(TQ_PACKED + TQ_Q8_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
                default: group_work(TQ_Q8_0, w, x, y, ldy, bias, M, K, g, pair, panel); break;
            }
        }
        free(panel);
    }
    for (int64_t n = groups * GR; n < N; n++)
        single_row(t, w + n * rbytes, x, y + n, ldy, bias ? bias + n : NULL, M, K);
}

/* small_256 (tq_layout): batches that group_work reads straight into 256-bit registers skip q8batch.c,
 * whose zmm strips read two groups' bytes at once (AMD Zen 4, decode steps of SmolLM2 Q4_1 at 2
 * threads: batch 1 1.35x, batch 4 1.16x faster this way; from 6 rows the strips win, 1.4x). */
void tq_q8_rows(int qtype, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                int64_t N, int64_t K, int small_256) {
    const int64_t done = small_256 && takes_registers(qtype, M)
                             ? 0
                             : tq_q8_batch_rows(qtype, w, x, y, ldy, bias, M, N, K); /* q8batch.c: batches on AVX-512 */
    if (done < N) group_rows(qtype, w + done * row_bytes(qtype, K), x, y + done, ldy, bias ? bias + done : NULL, M, N - done, K);
}
