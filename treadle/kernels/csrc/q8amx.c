/* The batched 8-bit activation path on AMX (the amx build) times a batch of activation rows, one
 * tile multiply (two for Q6_K) per block of 32 inputs: Q4_K / Q5_K from AMX_MIN_K activation rows,
 * packed Q4_0 / Q4_1 and (unpacked) Q8_0 from AMX_MIN_PACKED, Q6_K from AMX_MIN_Q6K (strip_amx_rows:
 * activations as A, q8strip.h's panels as B, Q6_K in bfloat16). q8batch.c calls it first and
 * falls back to its own vpdpbusd tiles where it returns 0 (another build, the kernel refusing AMX
 * to this process, a type it does not take -- packed Q8_0 rows go to q8batch.c's direct strips, which
 * need no panel --, fewer rows). Linux lends AMX state to a process only
 * after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once here; a refusal leaves
 * the vpdpbusd path.
 */
#include <stdlib.h>
#include <string.h>

#include "q8strip.h"

#if defined(TQ_ZMM) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* 1: this process may use AMX (asked once; the answer does not change) */
static int amx_allowed(void) {
    static int state; /* 0 unknown, 1 yes, -1 no */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* The tile shapes: C 0-3 16 x 16 (int32 or float); CFG_INT8, A 4-5 16 rows x 32 bytes, B 6-7 8 x 64
 * (one block of 32 int8 per multiply); CFG_BF16 (Q6_K), A and B 16 x 64 bytes (32 bfloat16). */
enum { CFG_INT8, CFG_BF16 };

/* Loaded by each thread at each call (~0.2 us): the tile configuration is per thread, and anything
 * else in the process that uses AMX on that thread (oneDNN through torch, another build of these
 * kernels) may have loaded its own since; a configuration kept from an earlier call (as this file
 * once did) then multiplies with the wrong shapes. (Releasing the tiles after each call cost ~0.1 ms
 * a call here: the next call's first tile instruction took the state from init again; not done.) */
static void configure_tiles(int kind) {
    const int k = kind == CFG_BF16 ? 64 : 32; /* bytes of k per multiply */
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int c = 0; c < 4; c++) cfg.rows[c] = 16, cfg.colsb[c] = 64; /* C: 4 multiplies in flight */
    for (int a = 4; a < 6; a++) cfg.rows[a] = 16, cfg.colsb[a] = (uint16_t)k; /* A */
    for (int b = 6; b < 8; b++) cfg.rows[b] = (uint8_t)(k / 4), cfg.colsb[b] = 64; /* B */
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* GCC 12 dropped the stores above as dead once this was inlined */
    _tile_loadconfig(&cfg);
}

/* ---- Activations as A, strip panels as B ----
 *
 * A (tile 4): 16 activation rows of block b, from a per-call copy of the activations in tile
 *             order ([tile][block][16 rows][32 k]: one contiguous 512 bytes, 1 KiB for Q6_K's
 *             bfloat16; 1.02-1.1x at 512 rows over loading them from the rows with stride K,
 *             whose 16 lines a block came from L2)
 * B (tiles 6, 7): a strip's block, in B's layout (16 weight rows, k in VNNI order)
 * C (tiles 0..3): C[i][j] = block b's integer dot of activation row i and weight row j
 *
 * One activation tile (16 rows) times KS strips (64 weight rows) per pass: A is loaded once per
 * block for the KS multiplies, the C tiles go to a ring of two blocks, and the float work of block
 * b - 1 (lanes = the 16 weight rows, so y's rows are stored as they are) follows block b's
 * multiplies. Each output takes q8act.c's operations in its order, per block acc = fma(float(isum),
 * d_w * xd, acc), acc = fma(m_w, xs, acc) (Q6_K: no minimum term), then y = acc (+ bias).
 *
 * Q4_K / Q5_K, packed Q4_0 / Q4_1 (CFG_INT8): B is q8strip.h's panel (unsigned q, Q4_0's with the
 * minimum -8 d), A the int8 bytes (tdpbsud): C = isum exactly. Q8_0: B is the vpdpbusd panel too
 * (the signed bytes + 128), so C = isum + 128 (the block's activation sum), taken off in int32
 * before the conversion, and no minimum term. (Q8_0 had its own AMX kernel, weights as A straight
 * from the rows, activations as B: this one is 1.1-1.4x faster at 64-128 rows.)
 *
 * Q6_K (CFG_BF16): isum = sc0 (dot0 - 32 xh0) + sc1 (dot1 - 32 xh1) = sum_k w_k x_k with
 * w_k = sc (q_k - 32), the half's int8 scale folded into each weight (|w| <= 128 * 32 = 4096). Each
 * w is split as w = 64 h + l, h = trunc(w / 64) (|h| <= 64: 7 bits) and l = w - 64 h (|l| < 64, w's
 * sign); B holds h and l / 64 (kb16, two tiles) and A holds 64 x, all exact in bfloat16 (at most
 * 7 significant bits), so one C accumulates (64 x) h + (64 x)(l / 64) = x (64 h) + x l over the 32 k
 * with tdpbf16ps in float32. Every product is an integer, and so is every partial sum, of magnitude
 * <= sum_k (|64 h_k| + |l_k|) |x_k| = sum_k |w_k| |x_k| <= 32 * 4096 * 127 < 2^24: each float
 * operation is exact, in any order, and C = float(isum), the value the reference converts, with no
 * fold or conversion left to the vector units (an int8 pair of half-block multiplies left both, and
 * a second C per block: 1.25x slower per tile here).
 *
 * An activation tile past M reads zero-padded rows (their outputs are never stored); a lone last
 * group of 8 weight rows is a strip with lanes 8..15 zero (stored masked). */
#ifndef AMX_MIN_K
#define AMX_MIN_K 16 /* Q4_K / Q5_K from one whole activation tile (1.2-1.3x the vpdpbusd strips at 16 rows) */
#endif
#ifndef AMX_MIN_Q6K
#define AMX_MIN_Q6K 128 /* Q6_K: its bfloat16 panels cost a fixed ~0.7 ms per 2048 x 2048 call (0.5-1.0x below 96 rows) */
#endif
#ifndef AMX_MIN_PACKED
#define AMX_MIN_PACKED 32 /* packed Q4 and Q8_0 (2 threads: 1.0-1.3x the vpdpbusd strips at 32 and 48 rows; 16 about even,
                             17-31 slower: the second tile is mostly padding) */
#endif
#define KS 4 /* strips per pass, at most */
#define PASS_BYTES (768 * 1024) /* and at most this much panel per pass (the L2 keeps it while the activation tiles stream):
                                   Q6_K down 2048 x 5632 at 512 rows, 2 strips per pass 1.2x faster than 4 */

enum { KMIN, KQ6, KQ8_0 }; /* ktile's weights: Q4_K / Q5_K / packed Q4 (a minimum term), Q6_K (bfloat16), Q8_0 (bytes + 128) */

typedef struct { /* Q6_K's block of a strip for tdpbf16ps: B rows r = k 2r, 2r + 1 of the 16 weight rows */
    uint16_t hi[16 * 32], lo[16 * 32]; /* h and l / 64; row r, lane j: bfloat16 of k = 2r (low half), 2r + 1 */
    float d[SGR];
} kb16;

/* One B row of bfloat16 pairs from exactly representable floats: lane j = e0's top half (k = 2r) |
 * e1's (k = 2r + 1) << 16. */
static inline __m512i bf16_pair(__m512 e0, __m512 e1) {
    return _mm512_mask_mov_epi16(_mm512_srli_epi32(_mm512_castps_si512(e0), 16), 0xaaaaaaaau, _mm512_castps_si512(e1));
}

/* A Q6_K strip panel (q8strip.h's, q signed) as kb16 blocks: with v = w / 64 = q sc / 64, hi =
 * trunc(v) and lo = v - hi (exact float operations on multiples of 2^-6 below 2^7). */
static void q6k_bf16_panel(const sblock *g, int64_t nb, kb16 *out) {
    const __m512 by64 = _mm512_set1_ps(1.0f / 64.0f);
    for (int64_t b = 0; b < nb; b++) {
        const __m512i sc = _mm512_load_si512(g[b].sc);
        const __m512 scf[2] = {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 16)), by64),
                               _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(sc, 16)), by64)};
        _mm512_store_ps(out[b].d, _mm512_load_ps(g[b].d));
        for (int s = 0; s < 8; s++) { /* step s: k 4s .. 4s+3, B rows 2s, 2s + 1 */
            const __m512i v = _mm512_load_si512(g[b].q + s);
            __m512 hi[4], lo[4];
            for (int c = 0; c < 4; c++) {
                const __m512i q = _mm512_srai_epi32(c == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * c), 24);
                const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scf[s / 4]);
                hi[c] = _mm512_roundscale_ps(w, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                lo[c] = _mm512_sub_ps(w, hi[c]);
            }
            _mm512_store_si512(out[b].hi + 64 * s, bf16_pair(hi[0], hi[1]));
            _mm512_store_si512(out[b].hi + 64 * s + 32, bf16_pair(hi[2], hi[3]));
            _mm512_store_si512(out[b].lo + 64 * s, bf16_pair(lo[0], lo[1]));
            _mm512_store_si512(out[b].lo + 64 * s + 32, bf16_pair(lo[2], lo[3]));
        }
    }
}

typedef struct { /* 16 activation rows in tile order (int8 q or bfloat16 b, [block][16 rows][32 k]); row i's scales at
                   d / s + i * nb, Q8_0's half-block sums at h + 2 (i * nb) */
    const int8_t *q;
    const uint16_t *b;
    const float *d, *s;
    const int32_t *h;
} ktile_x;

/* Strip h's multiplies of block b into C tile C (zeroed first): Q4_K / Q5_K, its B in tile BT,
 * A (tile 4) the int8 bytes; Q6_K, its hi and lo B tiles in 6 and 7, A the bfloat16 x. */
#define INT8_STRIP(h, BT, C)                                                                 \
    do {                                                                                     \
        _tile_loadd(BT, ((const sblock *)panel)[(h) * nb + b].q, 64);                        \
        _tile_zero(C);                                                                       \
        _tile_dpbsud(C, 4, BT);                                                              \
    } while (0)
#define BF16_STRIP(h, C)                                                                     \
    do {                                                                                     \
        _tile_loadd(6, ((const kb16 *)panel)[(h) * nb + b].hi, 64);                          \
        _tile_zero(C);                                                                       \
        _tile_dpbf16ps(C, 4, 6);                                                             \
        _tile_loadd(7, ((const kb16 *)panel)[(h) * nb + b].lo, 64);                          \
        _tile_dpbf16ps(C, 4, 7);                                                             \
    } while (0)

/* 16 activation rows (x) times NS strips, every block: acc[16 h + i] = row i times strip h's 16
 * weight rows. q6: Q6_K (kb16 panels, float C, no minimum term), else Q4_K / Q5_K (sblock panels,
 * int32 C). */
static inline __attribute__((always_inline)) void ktile(const int kind, const int NS, const void *panel, int64_t nb,
                                                        ktile_x x, void *ring, __m512 *acc) {
    for (int k = 0; k < NS * 16; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) {
            void *c = (int32_t *)ring + (b & 1) * KS * 256;
            if (kind == KQ6) {
                _tile_loadd(4, x.b + b * 16 * QK, 2 * QK);
                BF16_STRIP(0, 0);
                if (NS > 1) BF16_STRIP(1, 1);
                if (NS > 2) BF16_STRIP(2, 2);
                if (NS > 3) BF16_STRIP(3, 3);
            } else {
                _tile_loadd(4, x.q + b * 16 * QK, QK);
                INT8_STRIP(0, 6, 0);
                if (NS > 1) INT8_STRIP(1, 7, 1);
                if (NS > 2) INT8_STRIP(2, 6, 2);
                if (NS > 3) INT8_STRIP(3, 7, 3);
            }
            _tile_stored(0, c, 64);
            if (NS > 1) _tile_stored(1, (int32_t *)c + 256, 64);
            if (NS > 2) _tile_stored(2, (int32_t *)c + 512, 64);
            if (NS > 3) _tile_stored(3, (int32_t *)c + 768, 64);
        }
        if (b == 0) continue;
        const int64_t pb = b - 1;
        const int32_t *ci = (const int32_t *)ring + (pb & 1) * KS * 256;
        const float *cf = (const float *)ci;
        __m512 dw[KS], mw[KS];
#pragma GCC unroll 4
        for (int h = 0; h < NS; h++) {
            if (kind == KQ6) {
                dw[h] = _mm512_load_ps(((const kb16 *)panel)[h * nb + pb].d);
            } else {
                dw[h] = _mm512_load_ps(((const sblock *)panel)[h * nb + pb].d);
                if (kind == KMIN) mw[h] = _mm512_load_ps(((const sblock *)panel)[h * nb + pb].m);
            }
        }
#pragma GCC unroll 2
        for (int i = 0; i < 16; i++) {
            const __m512 xd = _mm512_set1_ps(x.d[i * nb + pb]);
            const __m512 xs = kind == KMIN ? _mm512_set1_ps(x.s[i * nb + pb]) : xd;
            const __m512i off = kind == KQ8_0 ? _mm512_set1_epi32(128 * (x.h[2 * (i * nb + pb)] + x.h[2 * (i * nb + pb) + 1])) : _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int h = 0; h < NS; h++) {
                __m512 *a = acc + 16 * h + i;
                if (kind == KQ6) {
                    *a = _mm512_fmadd_ps(_mm512_load_ps(cf + 256 * h + 16 * i), _mm512_mul_ps(dw[h], xd), *a);
                } else if (kind == KQ8_0) { /* C = isum + 128 (the block's activation sum): the panel's bytes are w + 128 */
                    const __m512i isum = _mm512_sub_epi32(_mm512_load_si512(ci + 256 * h + 16 * i), off);
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw[h], xd), *a);
                } else {
                    const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(ci + 256 * h + 16 * i));
                    *a = _mm512_fmadd_ps(mw[h], xs, _mm512_fmadd_ps(isum, _mm512_mul_ps(dw[h], xd), *a));
                }
            }
        }
    }
}

#define KTILE(NS) (kind == KQ6 ? ktile(KQ6, NS, pn, nb, x, ring, acc) : kind == KQ8_0 ? ktile(KQ8_0, NS, pn, nb, x, ring, acc) \
                                                                  : ktile(KMIN, NS, pn, nb, x, ring, acc))

/* 16 activation rows (x, the first nx real) times ns strips' panels (pn, nb blocks each): row i to
 * y[i * ldy + j], j < 16 (ns - 1) + last. */
static void ktile_rows(int kind, const void *pn, int ns, int64_t nb, ktile_x x, int nx, const float *bias,
                       float *y, int64_t ldy, int last, void *ring, __m512 *acc) {
    switch (ns) {
        case 1: KTILE(1); break;
        case 2: KTILE(2); break;
        case 3: KTILE(3); break;
        default: KTILE(4); break;
    }
    for (int h = 0; h < ns; h++) {
        const __mmask16 store = h == ns - 1 && last == 8 ? (__mmask16)0x00ff : (__mmask16)0xffff;
        for (int i = 0; i < nx; i++) {
            __m512 o = acc[16 * h + i];
            if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(store, bias + 16 * h));
            _mm512_mask_storeu_ps(y + i * ldy + 16 * h, store, o);
        }
    }
}

static int64_t strip_amx_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                           int64_t N, int64_t K) {
    const int64_t nb = K / QK, rbytes = row_bytes(t, K), groups = N / 8, strips = (groups + 1) / 2;
    const int q6 = base_type(t) == TQ_Q6_K, kind = q6 ? KQ6 : t == TQ_Q8_0 ? KQ8_0 : KMIN;
    const int64_t fit = PASS_BYTES / (nb * (int64_t)(q6 ? sizeof(kb16) : sizeof(sblock)));
    const int ks = fit < 1 ? 1 : fit > KS ? KS : (int)fit; /* strips per pass */
    const int64_t passes = (strips + ks - 1) / ks, tiles = (M + 15) / 16, rem = M % 16;
    /* The activations in tile order, [tile][block][16 rows][32 k]: each A tile is one contiguous
     * 512 (int8) or 1024 (Q6_K: bfloat16, exact) bytes; rows past M zero. Q4_K / Q5_K's last,
     * partial tile's scales zero-padded to 16 rows (Q6_K: every tile's, padded alike). */
    const int64_t es = q6 ? 2 : 1;
    uint8_t *xa = (uint8_t *)aligned_alloc(64, (size_t)(tiles * nb * 16 * QK * es));
    float *tf = NULL;
    if (xa == NULL) abort();
    memset(xa + (M / 16) * nb * 16 * QK * es, 0, (size_t)((tiles - M / 16) * nb * 16 * QK * es));
#pragma omp parallel for schedule(static) if (M >= 64)
    for (int64_t m = 0; m < M; m++) {
        uint8_t *dst = xa + ((m / 16) * nb * 16 + m % 16) * QK * es;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *src = x.q + m * K + b * QK;
            if (q6) { /* 64 x as bfloat16, exact: the float's top half */
                for (int hh = 0; hh < 2; hh++) {
                    const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * hh))), 6);
                    const __m512i f = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(v)), 16);
                    _mm256_store_si256((__m256i *)(dst + b * 16 * QK * es + 32 * hh), _mm512_cvtepi32_epi16(f));
                }
            } else {
                _mm256_store_si256((__m256i *)(dst + b * 16 * QK), _mm256_loadu_si256((const __m256i *)src));
            }
        }
    }
    if (q6) {
        tf = (float *)calloc((size_t)(tiles * 16 * nb), sizeof(float));
        if (tf == NULL) abort();
        memcpy(tf, x.d, (size_t)(M * nb) * sizeof(float));
    } else if (rem) { /* d, s, then (Q8_0) h of the last tile's rows, zero past M */
        tf = (float *)calloc((size_t)(64 * nb), sizeof(float));
        if (tf == NULL) abort();
        memcpy(tf, x.d + (M - rem) * nb, (size_t)(rem * nb) * sizeof(float));
        memcpy(tf + 16 * nb, x.s + (M - rem) * nb, (size_t)(rem * nb) * sizeof(float));
        if (kind == KQ8_0) memcpy(tf + 32 * nb, x.h + 2 * (M - rem) * nb, (size_t)(2 * rem * nb) * sizeof(int32_t));
    }
#pragma omp parallel
    {
        const size_t pbytes = q6 ? sizeof(kb16) : sizeof(sblock);
        void *pn = aligned_alloc(64, (size_t)(KS * nb) * pbytes);
        sblock *tmp = q6 ? (sblock *)aligned_alloc(64, (size_t)nb * sizeof(sblock)) : NULL;
        void *ring = aligned_alloc(64, 2 * KS * 256 * sizeof(int32_t));
        __m512 *acc = (__m512 *)aligned_alloc(64, KS * 16 * sizeof(__m512));
        if (pn == NULL || ring == NULL || acc == NULL || (q6 && tmp == NULL)) abort();
        configure_tiles(q6 ? CFG_BF16 : CFG_INT8);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < passes; p++) {
            const int64_t s0 = p * ks;
            const int ns = strips - s0 < ks ? (int)(strips - s0) : ks;
            int last = 16;
            for (int h = 0; h < ns; h++) {
                const int64_t g = 2 * (s0 + h);
                const int lone = g + 1 >= groups;
                if (lone) last = 8;
                if (q6) {
                    unpack_q6k_strip(t, w + g * 8 * rbytes, rbytes, lone, nb, tmp, 1);
                    q6k_bf16_panel(tmp, nb, (kb16 *)pn + h * nb);
                } else if (kind == KQ8_0) {
                    unpack_q8_0(w + g * 8 * rbytes, rbytes, lone ? 8 : SGR, nb, (sblock *)pn + h * nb);
                } else if (packed_type(t)) {
                    unpack_packed(t, w + g * 8 * rbytes, lone ? NULL : w + (g + 1) * 8 * rbytes, nb, (sblock *)pn + h * nb);
                } else {
                    unpack_k4_strip(t, w + g * 8 * rbytes, rbytes, lone, nb, (sblock *)pn + h * nb);
                }
            }
            for (int64_t tt = 0; tt < tiles; tt++) {
                const int partial = rem && tt == tiles - 1;
                const uint8_t *xat = xa + tt * nb * 16 * QK * es;
                ktile_x xt = {(const int8_t *)xat, NULL, x.d + tt * 16 * nb, x.s + tt * 16 * nb, x.h ? x.h + 2 * tt * 16 * nb : NULL};
                if (q6)
                    xt = (ktile_x){NULL, (const uint16_t *)xat, tf + tt * 16 * nb, NULL, NULL};
                else if (partial)
                    xt = (ktile_x){(const int8_t *)xat, NULL, tf, tf + 16 * nb, (const int32_t *)(tf + 32 * nb)};
                ktile_rows(kind, pn, ns, nb, xt, partial ? (int)rem : 16, bias ? bias + s0 * 16 : NULL,
                           y + tt * 16 * ldy + s0 * 16, ldy, last, ring, acc);
            }
        }
        free(pn), free(tmp), free(ring), free(acc);
    }
    free(xa), free(tf);
    return groups * 8;
}

int64_t tq_q8_amx_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t N, int64_t K) {
    const int kq = q8_kquant(t);
    if (!(kq || packed_type(t) || t == TQ_Q8_0)) return 0;
    const int64_t from = base_type(t) == TQ_Q6_K ? AMX_MIN_Q6K : kq ? AMX_MIN_K : AMX_MIN_PACKED;
    return M >= from && amx_allowed() ? strip_amx_rows(t, w, x, y, ldy, bias, M, N, K) : 0;
}
#else
int64_t tq_q8_amx_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t N, int64_t K) {
    (void)t, (void)w, (void)x, (void)y, (void)ldy, (void)bias, (void)M, (void)N, (void)K;
    return 0;
}
#endif
