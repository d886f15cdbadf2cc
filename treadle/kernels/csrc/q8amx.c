/* The batched 8-bit activation path on AMX-INT8 (the amx build): packed Q4_0 / Q4_1 and Q8_0
 * rows times a batch of activation rows, one tile multiply per block of 32 inputs. q8batch.c
 * calls it first and falls back to its own vpdpbusd tiles where it returns 0 (another build, the
 * kernel refusing AMX to this process, a type it does not take).
 *
 *   A (tile 1): 16 weight rows x 32 bytes, block b of a strip (two groups of 8), k in order;
 *               the unsigned q of Q4 (tdpbusd, unpacked once per strip), the signed bytes of
 *               Q8_0 (tdpbssd, loaded straight from the rows with their stride)
 *   B (tile 2): 8 rows x 64 bytes, 16 activation rows in VNNI order: B[r][4i + c] = x[i][4r + c]
 *   C (tile 0): 16 x 16 int32, C[j][i] = the exact integer block dot of weight row j, activation i
 *
 * Per block, C goes to a 1 KiB buffer and each output takes exactly q8act.c's float operations,
 *
 *   acc = fma(float(isum), d_w * xd, acc);   acc = fma(m_w, xs, acc)   (Q8_0: no minimum)
 *
 * (the 16 outputs of weight row j in one register, lane i = activation row i), then y = acc
 * (+ bias). Same integers, same float order: the bits of the plain-C reference, whatever the
 * batch; rows past the batch are zeros in B and never stored. Linux lends AMX state to a
 * process only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once here; a
 * refusal leaves the vpdpbusd path.
 */
#include <stdlib.h>
#include <string.h>

#include "qblocks.h"

#if defined(TQ_AVX2) && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AMX_INT8__) && \
    defined(__AMX_TILE__)
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

/* Loaded by each thread at each call (~0.2 us): the tile configuration is per thread, and anything
 * else in the process that uses AMX on that thread (oneDNN through torch, another build of these
 * kernels) may have loaded its own since; a configuration kept from an earlier call (as this file
 * once did) then multiplies with the wrong shapes. (Releasing the tiles after each call cost ~0.1 ms
 * a call here: the next call's first tile instruction took the state from init again; not done.) */
static void configure_tiles(void) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int c = 0; c < 4; c++) cfg.rows[c] = 16, cfg.colsb[c] = 64; /* C: 4 blocks in flight */
    for (int a = 4; a < 6; a++) cfg.rows[a] = 16, cfg.colsb[a] = 32; /* A */
    for (int b = 6; b < 8; b++) cfg.rows[b] = 8, cfg.colsb[b] = 64; /* B */
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* GCC 12 dropped the stores above as dead once this was inlined */
    _tile_loadconfig(&cfg);
}

typedef struct { /* per-call activations in tile order, [tiles][nb] */
    uint8_t *b; /* 512 bytes per (tile, block) */
    float *d, *s; /* 16 per (tile, block); zeros past the batch */
} amx_acts;

static amx_acts prepare_acts(tq_q8acts x, int64_t M, int64_t K) {
    const int64_t nb = K / QK, tiles = (M + 15) / 16;
    amx_acts a = {(uint8_t *)aligned_alloc(64, (size_t)(tiles * nb * 512)),
                  (float *)aligned_alloc(64, (size_t)(2 * tiles * nb * 16) * sizeof(float)), NULL};
    if (a.b == NULL || a.d == NULL) abort();
    a.s = a.d + tiles * nb * 16;
    memset(a.b, 0, (size_t)(tiles * nb * 512));
    memset(a.d, 0, (size_t)(2 * tiles * nb * 16) * sizeof(float));
    for (int64_t m = 0; m < M; m++) {
        const int64_t t = m / 16, i = m % 16;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *tb = a.b + (t * nb + b) * 512;
            for (int r = 0; r < 8; r++) memcpy(tb + 64 * r + 4 * i, x.q + m * K + b * QK + 4 * r, 4);
            a.d[(t * nb + b) * 16 + i] = x.d[m * nb + b];
            a.s[(t * nb + b) * 16 + i] = x.s[m * nb + b];
        }
    }
    return a;
}

typedef struct { /* one strip's weights in A order: [nb] */
    uint8_t *q; /* 512 bytes per block */
    float *d, *m; /* 16 per block */
    const uint8_t *w; /* Q8_0: A read from the rows themselves (NULL: from q) */
    int64_t stride; /* their row bytes */
} amx_panel;

/* Packed Q4 groups at w and w1 (NULL: a lone group, rows 8..15 zero), every block. */
static void panel_packed(int t, const uint8_t *w, const uint8_t *w1, int64_t nb, amx_panel p) {
    const int ub = unit_bytes(t), sb = base_type(t) == TQ_Q4_1 ? 32 : 16;
    const __m512i mask = _mm512_set1_epi8(15);
    /* dword j*4 + s <- dword s*8 + j: each row's 4 nibble dwords side by side */
    const __m512i rows03 = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i rows47 = _mm512_add_epi32(rows03, _mm512_set1_epi32(4));
    const __m512i pair0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), pair1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *g = h ? w1 : w;
            uint8_t *out = p.q + b * 512 + 256 * h;
            if (g == NULL) {
                memset(out, 0, 256);
                memset(p.d + 16 * b + 8, 0, 8 * sizeof(float));
                memset(p.m + 16 * b + 8, 0, 8 * sizeof(float));
                continue;
            }
            const uint8_t *blk = g + b * 8 * ub;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            _mm256_storeu_ps(p.d + 16 * b + 8 * h, dv);
            _mm256_storeu_ps(p.m + 16 * b + 8 * h, base_type(t) == TQ_Q4_1
                                                       ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                                       : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f)));
            const __m512i n01 = _mm512_loadu_si512(blk + sb), n23 = _mm512_loadu_si512(blk + sb + 64);
            for (int r = 0; r < 2; r++) { /* rows 0-3, then 4-7: 16 nibble bytes each */
                const __m512i v = _mm512_permutex2var_epi32(n01, r ? rows47 : rows03, n23);
                const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                _mm512_storeu_si512(out + 128 * r, _mm512_permutex2var_epi64(lo, pair0, hi));
                _mm512_storeu_si512(out + 128 * r + 64, _mm512_permutex2var_epi64(lo, pair1, hi));
            }
        }
    }
}

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
            p.m[16 * b + j] = 0.0f;
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
        if (q8_0)                                                              \
            _tile_dpbssd(C, A, B);                                             \
        else                                                                   \
            _tile_dpbusd(C, A, B);                                             \
    } while (0)

/* Blocks b .. b + n - 1 (n <= 4) into C tiles 0 .. n - 1. */
static inline void issue_blocks(int q8_0, amx_panel p, amx_acts a, int64_t t, int64_t nb, int64_t b, int n) {
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
static void amx_tile(int q8_0, amx_panel p, amx_acts a, int64_t t, int64_t nb, const float *bias, float *out,
                     int64_t ldy, int nx, int nj, int32_t *cbuf) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    int n = nb < 4 ? (int)nb : 4, cur = 0;
    issue_blocks(q8_0, p, a, t, nb, 0, n);
    store_blocks(n, cbuf);
    for (int64_t b0 = 0; b0 < nb;) {
        const int64_t next = b0 + n;
        const int nn = nb - next < 4 ? (int)(nb - next) : 4;
        if (nn > 0) issue_blocks(q8_0, p, a, t, nb, next, nn); /* runs while the float work below does */
        for (int k = 0; k < n; k++) {
            const int64_t b = b0 + k;
            const int32_t *c = cbuf + 1024 * cur + 256 * k;
            const __m512 xd = _mm512_load_ps(a.d + (t * nb + b) * 16), xs = _mm512_load_ps(a.s + (t * nb + b) * 16);
            const float *d = p.d + 16 * b, *m = p.m + 16 * b;
            for (int j = 0; j < 16; j++) {
                const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * j));
                acc[j] = _mm512_fmadd_ps(isum, _mm512_mul_ps(_mm512_set1_ps(d[j]), xd), acc[j]);
                if (!q8_0) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(m[j]), xs, acc[j]);
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

int64_t tq_q8_amx_rows(int t, const uint8_t *w, tq_q8acts x, float *y, int64_t ldy, const float *bias, int64_t M,
                       int64_t N, int64_t K) {
    const int q8_0 = t == TQ_Q8_0;
    if (!(packed_type(t) || q8_0) || M < AMX_MIN_ROWS || !amx_allowed()) return 0;
    const int64_t nb = K / QK, rbytes = row_bytes(t, K), groups = N / 8, strips = (groups + 1) / 2;
    const amx_acts a = prepare_acts(x, M, K);
#pragma omp parallel
    {
        amx_panel p = {(uint8_t *)aligned_alloc(64, (size_t)(nb * 512)),
                       (float *)aligned_alloc(64, (size_t)(nb * 32) * sizeof(float)), NULL, NULL, 0};
        int32_t *cbuf = (int32_t *)aligned_alloc(64, 2 * 1024 * sizeof(int32_t));
        if (p.q == NULL || p.d == NULL || cbuf == NULL) abort();
        p.m = p.d + nb * 16;
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t st = 0; st < strips; st++) {
            const int64_t g = 2 * st;
            const int lone = g + 1 >= groups;
            const uint8_t *wg = w + g * 8 * rbytes;
            if (q8_0)
                panel_q8_0(wg, rbytes, lone ? 8 : 16, nb, &p);
            else
                panel_packed(t, wg, lone ? NULL : wg + 8 * rbytes, nb, p);
            for (int64_t tt = 0; tt * 16 < M; tt++)
                amx_tile(q8_0, p, a, tt, nb, bias ? bias + g * 8 : NULL, y + tt * 16 * ldy + g * 8, ldy,
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
