/* The 8-bit activations of tq_matmul's act_bits == 8 path (tq_q8_quantize: int8 per block of 32,
 * with the block sums q8act.c's minimum terms and Q6_K's halves need), the 16-bit ones of packed rows
 * at act_bits 16 split in two bytes (tq_q16_split), and the packed rows that
 * q8act.c, q8batch.c and q8amx.c read (tq_q8_pack, made once at load; tq_q8_unpack_row reads a row
 * back as the file has it). q8act.c's header describes the arithmetic. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qblocks.h"

int tq_q8_type(int t) {
    return t == TQ_Q4_0 || t == TQ_Q4_1 || t == TQ_Q5_0 || t == TQ_Q5_1 || t == TQ_Q8_0 || q8_kquant(t) || packed_type(t) ||
           packed_five(t) || packed_q8_0(t);
}

/* Activation rows per block of 32: xd = max|x| / lim, v = round(x / xd) clamped to +-lim, with
 * d = xd and s = xd * sum(v). lim 127 (tq_q8_quantize): q = v, h = its halves' sums (Q6_K's
 * q - 32 term; both: Q8_0's offset). lim 32767 (tq_q16_split: qmatmul.c's 16-bit values, those of
 * its quantize_rows, for the packed rows that take them): each v split in two bytes,
 * v = 256 hi + lo, q = hi (int8), l = lo (0..255), so the 8-bit kernels' vpdpbusd forms both
 * halves' exact integer dots (q8act.c); h = the halves' sums of hi (the packed Q8_0 offset's term). */
static tq_q8acts quantize_acts(const float *x, int64_t M, int64_t K, const int split) {
    const int64_t nb = K / QK;
    const int lim = split ? 32767 : 127;
    float *f = (float *)malloc((size_t)(2 * M * nb) * sizeof(float));
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    int32_t *h = (int32_t *)malloc((size_t)(2 * M * nb) * sizeof(int32_t));
    uint8_t *l = split ? (uint8_t *)malloc((size_t)(M * K)) : NULL;
    if (f == NULL || q == NULL || h == NULL || (split && l == NULL)) abort();
    const tq_q8acts a = {q, f, f + M * nb, h, l};
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + (i / nb) * K + (i % nb) * QK;
        int sum = 0, hsum[2] = {0, 0};
#ifdef TQ_AVX2 /* the same values as the loop below (tq.h) */
        __m256 xv[4];
        const float amax = block_absmax(xb, xv);
        const float d = amax / (float)lim, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i v[4], hv[4], vs = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            v[j] = round_clamp(xv[j], id, lim);
            vs = _mm256_add_epi32(vs, v[j]);
            hv[j] = split ? _mm256_srai_epi32(v[j], 8) : v[j];
        }
        /* packs interleave the 128-bit halves: 0 1 | 2 3 -> dwords in order 0 2 4 6 1 3 5 7 */
        const __m256i h8 = _mm256_packs_epi16(_mm256_packs_epi32(hv[0], hv[1]), _mm256_packs_epi32(hv[2], hv[3]));
        _mm256_storeu_si256((__m256i *)(q + i * QK), _mm256_permutevar8x32_epi32(h8, order));
        if (split) {
            const __m256i low = _mm256_set1_epi32(255);
            const __m256i l8 = _mm256_packus_epi16(_mm256_packs_epi32(_mm256_and_si256(v[0], low), _mm256_and_si256(v[1], low)),
                                                   _mm256_packs_epi32(_mm256_and_si256(v[2], low), _mm256_and_si256(v[3], low)));
            _mm256_storeu_si256((__m256i *)(l + i * QK), _mm256_permutevar8x32_epi32(l8, order));
        }
        sum = hsum_epi32(vs);
        hsum[0] = hsum_epi32(_mm256_add_epi32(hv[0], hv[1]));
        hsum[1] = hsum_epi32(_mm256_add_epi32(hv[2], hv[3]));
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / (float)lim, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            v = v > lim ? lim : v < -lim ? -lim : v;
            const int hi = split ? v >> 8 : v; /* arithmetic: floor(v / 256) */
            q[i * QK + j] = (int8_t)hi;
            if (split) l[i * QK + j] = (uint8_t)(v & 255);
            sum += v;
            hsum[j / 16] += hi;
        }
#endif
        f[i] = d;
        f[M * nb + i] = d * (float)sum;
        h[2 * i] = hsum[0];
        h[2 * i + 1] = hsum[1];
    }
    return a;
}

tq_q8acts tq_q8_quantize(const float *x, int64_t M, int64_t K) { return quantize_acts(x, M, K, 0); }

tq_q8acts tq_q16_split(const float *x, int64_t M, int64_t K) { return quantize_acts(x, M, K, 1); }

void tq_q8_free(tq_q8acts a) {
    free((void *)a.q);
    free((void *)a.d);
    free((void *)a.h);
    free((void *)a.l);
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
 * Packed Q5_0 / Q5_1 (TQ_PACKED + t, packed_five) add the rows' fifth bits between the scales and
 * the nibbles, one 32-bit mask per step and half, bit 4 j + c for byte 4 j + c of the step:
 *
 *   d (8 halves) | m (8 halves, Q5_1 only) | hb[4][2]: hb[s][0] bit 4j+c = row j's qh bit 4s+c,
 *   hb[s][1] bit 4j+c = row j's qh bit 16+4s+c (the high nibbles' elements) | nib[4][32]
 *
 * so a step's 32 bytes take their fifth bits from one mask (a masked add in the AVX-512 builds).
 *
 * Packed Q8_0 (TQ_PACKED + Q8_0): a group's block b is likewise one run of 8 * 34 bytes,
 *
 *   d of rows 0..7 (8 halves) | q[8][32]: q[s] dword j = row j's signed bytes 4s .. 4s+3
 *
 * which is the panel's step order (gblock.q) as it is: the unpacking is a copy, and up to MRG
 * activation rows read the steps straight from the weight (packed_direct); q8batch.c's zmm
 * strips read two groups' steps as the two halves of a register, with no transposes at any batch. */

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

void tq_q8_pack(int t, uint8_t *w, int64_t N, int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K);
    const int ub = unit_bytes(t), sb = scale_bytes(t), five = packed_five(TQ_PACKED + t), so = step_offset(TQ_PACKED + t);
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
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = rows + b * GR * ub;
            uint32_t hb[4][2] = {{0}};
            for (int j = 0; j < GR; j++) {
                const uint8_t *u = copy + j * rbytes + b * ub;
                memcpy(p + 2 * j, u, 2);
                if (t == TQ_Q8_0) {
                    for (int s = 0; s < 8; s++) memcpy(p + sb + 32 * s + 4 * j, u + 2 + 4 * s, 4);
                    continue;
                }
                if (stores_min(t)) memcpy(p + 2 * GR + 2 * j, u + 2, 2);
                for (int s = 0; s < 4; s++) memcpy(p + so + 32 * s + 4 * j, nibbles(t, u) + 4 * s, 4);
                if (five) {
                    uint32_t qh;
                    memcpy(&qh, nibbles(t, u) - 4, 4);
                    for (int s = 0; s < 4; s++)
                        for (int c = 0; c < 4; c++) {
                            hb[s][0] |= (qh >> (4 * s + c) & 1u) << (4 * j + c);
                            hb[s][1] |= (qh >> (16 + 4 * s + c) & 1u) << (4 * j + c);
                        }
                }
            }
            if (five) memcpy(p + sb, hb, sizeof hb);
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
        if (stores_min(t)) memcpy(u + 2, p + 2 * GR + 2 * j, 2);
        for (int s = 0; s < 4; s++) memcpy((uint8_t *)nibbles(t, u) + 4 * s, p + step_offset(pt) + 32 * s + 4 * j, 4);
        if (packed_five(pt)) {
            uint32_t qh = 0;
            for (int s = 0; s < 4; s++)
                for (int c = 0; c < 4; c++) {
                    qh |= (fifth_mask(pt, p, s, 0) >> (4 * j + c) & 1u) << (4 * s + c);
                    qh |= (fifth_mask(pt, p, s, 1) >> (4 * j + c) & 1u) << (16 + 4 * s + c);
                }
            memcpy((uint8_t *)nibbles(t, u) - 4, &qh, 4);
        }
    }
}
