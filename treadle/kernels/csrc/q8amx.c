/* The batched 8-bit activation path on AMX (the amx build) times a batch of activation rows, one
 * tile multiply (two for Q6_K) per block of 32 inputs: Q8_0 rows from AMX_MIN_ROWS activation rows
 * (this part), packed Q4_0 / Q4_1 from AMX_MIN_ROWS, Q4_K / Q5_K from AMX_MIN_K and Q6_K from
 * AMX_MIN_Q6K (strip_amx_rows, further down: activations as A, q8strip.h's panels as B, Q6_K in
 * bfloat16). q8batch.c calls it first and falls back to its own vpdpbusd tiles where it returns 0
 * (another build, the kernel refusing AMX to this process, a type it does not take, fewer rows).
 *
 * Q8_0:
 *   A (tile 1): 16 weight rows x 32 bytes, block b of a strip (two groups of 8), k in order:
 *               the signed bytes (tdpbssd, loaded straight from the rows with their stride)
 *   B (tile 2): 8 rows x 64 bytes, 16 activation rows in VNNI order: B[r][4i + c] = x[i][4r + c]
 *   C (tile 0): 16 x 16 int32, C[j][i] = the exact integer block dot of weight row j, activation i
 *
 * Per block, C goes to a 1 KiB buffer and each output takes exactly q8act.c's float operations,
 *
 *   acc = fma(float(isum), d_w * xd, acc)   (Q8_0: no minimum term)
 *
 * (the 16 outputs of weight row j in one register, lane i = activation row i), then y = acc
 * (+ bias). Same integers, same float order: the bits of the plain-C reference, whatever the
 * batch; rows past the batch are zeros in B and never stored. Linux lends AMX state to a
 * process only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once here; a
 * refusal leaves the vpdpbusd path.
 */
#include <stdlib.h>
#include <string.h>

#include "q8strip.h"

#if defined(TQ_ZMM) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 64 /* below, q8batch.c's vpdpbusd tiles were faster on the machine this was written on */
#endif

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

typedef struct { /* per-call activations in tile order, [tiles][nb] */
    uint8_t *b; /* 512 bytes per (tile, block) */
    float *d; /* 16 per (tile, block); zeros past the batch */
} amx_acts;

static amx_acts prepare_acts(tq_q8acts x, int64_t M, int64_t K) {
    const int64_t nb = K / QK, tiles = (M + 15) / 16;
    amx_acts a = {(uint8_t *)aligned_alloc(64, (size_t)(tiles * nb * 512)),
                  (float *)aligned_alloc(64, (size_t)(tiles * nb * 16) * sizeof(float))};
    if (a.b == NULL || a.d == NULL) abort();
    memset(a.b, 0, (size_t)(tiles * nb * 512));
    memset(a.d, 0, (size_t)(tiles * nb * 16) * sizeof(float));
    for (int64_t m = 0; m < M; m++) {
        const int64_t t = m / 16, i = m % 16;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *tb = a.b + (t * nb + b) * 512;
            for (int r = 0; r < 8; r++) memcpy(tb + 64 * r + 4 * i, x.q + m * K + b * QK + 4 * r, 4);
            a.d[(t * nb + b) * 16 + i] = x.d[m * nb + b];
        }
    }
    return a;
}

typedef struct { /* one strip's weights in A order: [nb] */
    uint8_t *q; /* 512 bytes per block */
    float *d; /* 16 per block */
    const uint8_t *w; /* Q8_0: A read from the rows themselves (NULL: from q) */
    int64_t stride; /* their row bytes */
} amx_panel;

/* Q8_0 rows (16, or 8 for a lone group; rbytes apart), every block. A whole strip's A tiles are
 * loaded straight from its rows (p.w: row j's block b at p.w + j * rbytes + 34 b), so only its
 * scales are gathered here, one vector per block; a lone group is copied, rows 8..15 zero. */
static void panel_q8_0(const uint8_t *w, int64_t rbytes, int nrows, int64_t nb, amx_panel *pp) {
    const int ub = unit_bytes(TQ_Q8_0);
    amx_panel p = *pp;
    if (nrows == 16 && rbytes <= INT32_MAX / 16) {
        const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32((int)rbytes));
        for (int64_t b = 0; b < nb; b++) {
            const __m512i h = _mm512_i32gather_epi32(rows, (const void *)(w + b * ub), 1);
            _mm512_store_ps(p.d + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
        }
        pp->w = w + 2, pp->stride = rbytes;
        return;
    }
    pp->w = NULL;
    for (int64_t b = 0; b < nb; b++) {
        for (int j = 0; j < 16; j++) {
            uint8_t *out = p.q + b * 512 + 32 * j;
            if (j < nrows) {
                memcpy(out, w + j * rbytes + b * ub + 2, 32);
                p.d[16 * b + j] = half_to_float(w + j * rbytes + b * ub);
            } else {
                memset(out, 0, 32);
                p.d[16 * b + j] = 0.0f;
            }
        }
    }
}

#define ISSUE(C, A, B, blk)                                                    \
    do {                                                                       \
        if (p.w)                                                               \
            _tile_loadd(A, p.w + (blk) * 34, p.stride);                        \
        else                                                                   \
            _tile_loadd(A, p.q + (blk) * 512, 32);                             \
        _tile_loadd(B, a.b + (t * nb + (blk)) * 512, 64);                      \
        _tile_zero(C);                                                         \
        _tile_dpbssd(C, A, B);                                                 \
    } while (0)

/* Blocks b .. b + n - 1 (n <= 4) into C tiles 0 .. n - 1. */
static inline void issue_blocks(amx_panel p, amx_acts a, int64_t t, int64_t nb, int64_t b, int n) {
    ISSUE(0, 4, 6, b);
    if (n > 1) ISSUE(1, 5, 7, b + 1);
    if (n > 2) ISSUE(2, 4, 6, b + 2);
    if (n > 3) ISSUE(3, 5, 7, b + 3);
}

/* C tiles 0 .. n - 1 to buf (256 int32 each). */
static inline void store_blocks(int n, int32_t *buf) {
    _tile_stored(0, buf, 64);
    if (n > 1) _tile_stored(1, buf + 256, 64);
    if (n > 2) _tile_stored(2, buf + 512, 64);
    if (n > 3) _tile_stored(3, buf + 768, 64);
}

/* 16 activation rows (tile t) times one strip: out[i * ldy + j] for i < nx, j < nj. The tile
 * multiplies of the next 4 blocks are issued before the float work on the last 4 reads their
 * sums, and stored after it (two buffers), so the AMX unit and the vector units overlap. */
static void amx_tile(amx_panel p, amx_acts a, int64_t t, int64_t nb, const float *bias, float *out,
                     int64_t ldy, int nx, int nj, int32_t *cbuf) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    int n = nb < 4 ? (int)nb : 4, cur = 0;
    issue_blocks(p, a, t, nb, 0, n);
    store_blocks(n, cbuf);
    for (int64_t b0 = 0; b0 < nb;) {
        const int64_t next = b0 + n;
        const int nn = nb - next < 4 ? (int)(nb - next) : 4;
        if (nn > 0) issue_blocks(p, a, t, nb, next, nn); /* runs while the float work below does */
        for (int k = 0; k < n; k++) {
            const int64_t b = b0 + k;
            const int32_t *c = cbuf + 1024 * cur + 256 * k;
            const __m512 xd = _mm512_load_ps(a.d + (t * nb + b) * 16);
            const float *d = p.d + 16 * b;
            for (int j = 0; j < 16; j++) {
                const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * j));
                acc[j] = _mm512_fmadd_ps(isum, _mm512_mul_ps(_mm512_set1_ps(d[j]), xd), acc[j]);
            }
        }
        if (nn > 0) store_blocks(nn, cbuf + 1024 * (cur ^ 1));
        b0 = next, n = nn, cur ^= 1;
    }
    float tmp[16][16] __attribute__((aligned(64)));
    for (int j = 0; j < 16; j++) _mm512_store_ps(tmp[j], acc[j]);
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nj; j++) out[i * ldy + j] = bias ? tmp[j][i] + bias[j] : tmp[j][i];
}

/* ---- Q4_K, Q5_K, Q6_K and packed Q4_0 / Q4_1: activations as A, strip panels as B ----
 *
 * A (tile 4): 16 activation rows of block b, straight from the rows (row stride K)
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
 * minimum -8 d), A the int8 bytes (tdpbsud): C = isum exactly. (Packed Q4 took the Q8_0 kernel
 * above until this one: 1.2-1.6x faster at 64-512 rows, where that one was ~1.0x the vpdpbusd tiles.)
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
#define KS 4 /* strips per pass, at most */
#define PASS_BYTES (768 * 1024) /* and at most this much panel per pass (the L2 keeps it while the activation tiles stream):
                                   Q6_K down 2048 x 5632 at 512 rows, 2 strips per pass 1.2x faster than 4 */

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

typedef struct { /* 16 activation rows: row i's k at q + i * K (int8) or b + i * K (bfloat16), its scales at d / s + i * nb */
    const int8_t *q;
    const uint16_t *b;
    const float *d, *s;
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
static inline __attribute__((always_inline)) void ktile(const int q6, const int NS, const void *panel, int64_t nb,
                                                        ktile_x x, int64_t K, void *ring, __m512 *acc) {
    for (int k = 0; k < NS * 16; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) {
            void *c = (int32_t *)ring + (b & 1) * KS * 256;
            if (q6) {
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
            if (q6) {
                dw[h] = _mm512_load_ps(((const kb16 *)panel)[h * nb + pb].d);
            } else {
                dw[h] = _mm512_load_ps(((const sblock *)panel)[h * nb + pb].d);
                mw[h] = _mm512_load_ps(((const sblock *)panel)[h * nb + pb].m);
            }
        }
#pragma GCC unroll 2
        for (int i = 0; i < 16; i++) {
            const __m512 xd = _mm512_set1_ps(x.d[i * nb + pb]);
            const __m512 xs = q6 ? xd : _mm512_set1_ps(x.s[i * nb + pb]);
#pragma GCC unroll 4
            for (int h = 0; h < NS; h++) {
                __m512 *a = acc + 16 * h + i;
                if (q6) {
                    *a = _mm512_fmadd_ps(_mm512_load_ps(cf + 256 * h + 16 * i), _mm512_mul_ps(dw[h], xd), *a);
                } else {
                    const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(ci + 256 * h + 16 * i));
                    *a = _mm512_fmadd_ps(mw[h], xs, _mm512_fmadd_ps(isum, _mm512_mul_ps(dw[h], xd), *a));
                }
            }
        }
    }
}

#define KTILE(NS) (q6 ? ktile(1, NS, pn, nb, x, K, ring, acc) : ktile(0, NS, pn, nb, x, K, ring, acc))

/* 16 activation rows (x, the first nx real) times ns strips' panels (pn, nb blocks each): row i to
 * y[i * ldy + j], j < 16 (ns - 1) + last. */
static void ktile_rows(int q6, const void *pn, int ns, int64_t nb, ktile_x x, int nx, int64_t K, const float *bias,
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
    const int q6 = base_type(t) == TQ_Q6_K;
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
    } else if (rem) {
        tf = (float *)calloc((size_t)(32 * nb), sizeof(float));
        if (tf == NULL) abort();
        memcpy(tf, x.d + (M - rem) * nb, (size_t)(rem * nb) * sizeof(float));
        memcpy(tf + 16 * nb, x.s + (M - rem) * nb, (size_t)(rem * nb) * sizeof(float));
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
                } else if (packed_type(t)) {
                    unpack_packed(t, w + g * 8 * rbytes, lone ? NULL : w + (g + 1) * 8 * rbytes, nb, (sblock *)pn + h * nb);
                } else {
                    unpack_k4_strip(t, w + g * 8 * rbytes, rbytes, lone, nb, (sblock *)pn + h * nb);
                }
            }
            for (int64_t tt = 0; tt < tiles; tt++) {
                const int partial = rem && tt == tiles - 1;
                const uint8_t *xat = xa + tt * nb * 16 * QK * es;
                ktile_x xt = {(const int8_t *)xat, NULL, x.d + tt * 16 * nb, x.s + tt * 16 * nb};
                if (q6)
                    xt = (ktile_x){NULL, (const uint16_t *)xat, tf + tt * 16 * nb, NULL};
                else if (partial)
                    xt = (ktile_x){(const int8_t *)xat, NULL, tf, tf + 16 * nb};
                ktile_rows(q6, pn, ns, nb, xt, partial ? (int)rem : 16, K, bias ? bias + s0 * 16 : NULL,
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
    const int q8_0 = t == TQ_Q8_0, kq = q8_kquant(t);
    if (kq || packed_type(t)) {
        const int64_t from = base_type(t) == TQ_Q6_K ? AMX_MIN_Q6K : kq ? AMX_MIN_K : AMX_MIN_ROWS;
        return M >= from && amx_allowed() ? strip_amx_rows(t, w, x, y, ldy, bias, M, N, K) : 0;
    }
    if (!q8_0 || M < AMX_MIN_ROWS || !amx_allowed()) return 0;
    const int64_t nb = K / QK, rbytes = row_bytes(t, K), groups = N / 8, strips = (groups + 1) / 2;
    const amx_acts a = prepare_acts(x, M, K);
#pragma omp parallel
    {
        amx_panel p = {(uint8_t *)aligned_alloc(64, (size_t)(nb * 512)),
                       (float *)aligned_alloc(64, (size_t)(nb * 16) * sizeof(float)), NULL, 0};
        int32_t *cbuf = (int32_t *)aligned_alloc(64, 2 * 1024 * sizeof(int32_t));
        if (p.q == NULL || p.d == NULL || cbuf == NULL) abort();
        configure_tiles(CFG_INT8);
#pragma omp for schedule(static)
        for (int64_t st = 0; st < strips; st++) {
            const int64_t g = 2 * st;
            const int lone = g + 1 >= groups;
            const uint8_t *wg = w + g * 8 * rbytes;
            panel_q8_0(wg, rbytes, lone ? 8 : 16, nb, &p);
            for (int64_t tt = 0; tt * 16 < M; tt++)
                amx_tile(p, a, tt, nb, bias ? bias + g * 8 : NULL, y + tt * 16 * ldy + g * 8, ldy,
                         M - tt * 16 < 16 ? (int)(M - tt * 16) : 16, lone ? 8 : 16, cbuf);
        }
        free(p.q), free(p.d), free(cbuf);
    }
    free(a.b), free(a.d);
    return groups * 8;
}
#else
int64_t tq_q8_amx_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t N, int64_t K) {
    (void)t, (void)w, (void)x, (void)y, (void)ldy, (void)bias, (void)M, (void)N, (void)K;
    return 0;
}
#endif
