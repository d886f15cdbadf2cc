/* paged_attention.c's AVX-512 path (head_dim a multiple of 16): 16 keys scored in one vector
 * (scores16; over a bfloat16 cache up to 3 query heads of one KV head at once, scores16g), the V
 * sums in registers (accumulate16, accumulate16x2, accumulate16x3), and a chunk of up to SPLIT keys
 * as one softmax step per head (chunk16). Included once, by paged_attention.c, after its tile and
 * prefetch helpers. */
#ifndef TQ_ATTENTION16_H
#define TQ_ATTENTION16_H

#if defined(TQ_AVX2) && defined(__AVX512F__)
/* The AVX-512 builds, head_dim a multiple of 16: 16 keys at a time, their scores in one vector.
 * Key j's q.k_j is summed in 16 lanes (D / 16 fmas in one chain), and the 16 keys' lane sums are
 * reduced together into one vector of 16 scores (a transpose-and-add tree: pairs of keys, pairs
 * of pairs, then the 128-bit quarters), so the row maximum, e^(s - m) and their sum are one
 * vector each, and V's rows are summed into D / 16 accumulators held in registers. */
static inline __m512 exp512_nonpositive(__m512 x) { /* exp_nonpositive's steps on 16 lanes */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(EXP_COEF[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_COEF[i]));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 pair_sums(__m512 a, __m512 b) { /* per 128-bit quarter: a0+a2, b0+b2, a1+a3, b1+b3 */
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 quad_sums(__m512 a, __m512 b) { /* per quarter: keys a0, a1, b0, b1's sums over it */
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

/* 16 values of a cache row from element i: float32, or (bf16) bfloat16 widened to float32 in
 * the register, exactly (its 16 bits on top): a bfloat16 cache is read at half the bytes, with
 * the float32 cache's arithmetic on the same values (so the same bits as a float32 cache holding
 * them). */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* scale * q.k_j for the n <= 16 rows k_j = rows + j * stride (elements; D a multiple of 16) in
 * lane j; lanes n.. are 0. Inlined with D a constant (64, 128, 256) so the 16 sums stay in
 * registers. */
static inline __attribute__((always_inline)) __m512 scores16(const float *q, const void *rows, int64_t stride, int n,
                                                           const int64_t D, float scale, const int bf16) {
    __m512 a[16];
    for (int j = 0; j < 16; j++) {
        const int64_t r = (j < n ? j : 0) * stride; /* rows past n: any row, zeroed below */
        a[j] = _mm512_mul_ps(_mm512_loadu_ps(q), load16(rows, r, bf16));
        for (int64_t d = 16; d < D; d += 16) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(rows, r + d, bf16), a[j]);
    }
    __m512 b[8], c[4];
    for (int j = 0; j < 8; j++) b[j] = pair_sums(a[2 * j], a[2 * j + 1]);
    for (int j = 0; j < 4; j++) c[j] = quad_sums(b[2 * j], b[2 * j + 1]); /* quarter t: keys 4j..4j+3 over t */
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xdd));
    return _mm512_maskz_mul_ps((__mmask16)((1u << n) - 1), sum, _mm512_set1_ps(scale));
}

/* scores16 for the NG <= 3 query heads q, q + D, q + 2D of one KV head, into s[0 .. NG - 1]: each
 * 16 values of a K row loaded (and widened) once for all of them. The same products, sums and
 * reduction tree as scores16, so the same bits: its a[0..7] and a[8..15] (the keys whose sums
 * become its e0 and e1) are taken one half at a time, NG x 8 sums in registers; past 8 keys the
 * second half is not needed (its lanes are zeroed). One head is scores16 itself (its 16 sums at
 * once). */
static inline __attribute__((always_inline)) void scores16g(const float *q, const int NG, const void *rows, int64_t stride,
                                                           int n, const int64_t D, float scale, const int bf16, __m512 *s) {
    if (NG == 1) {
        s[0] = scores16(q, rows, stride, n, D, scale, bf16);
        return;
    }
    __m512 e[2][3];
    for (int half = 0; half < (n > 8 ? 2 : 1); half++) {
        __m512 a[3][8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const int64_t r = (8 * half + j < n ? 8 * half + j : 0) * stride;
            const __m512 k = load16(rows, r, bf16);
            for (int g = 0; g < NG; g++) a[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k);
        }
        for (int64_t d = 16; d < D; d += 16) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int64_t r = (8 * half + j < n ? 8 * half + j : 0) * stride;
                const __m512 k = load16(rows, r + d, bf16);
                for (int g = 0; g < NG; g++) a[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), k, a[g][j]);
            }
        }
        for (int g = 0; g < NG; g++) {
            const __m512 b0 = pair_sums(a[g][0], a[g][1]), b1 = pair_sums(a[g][2], a[g][3]);
            const __m512 b2 = pair_sums(a[g][4], a[g][5]), b3 = pair_sums(a[g][6], a[g][7]);
            const __m512 c0 = quad_sums(b0, b1), c1 = quad_sums(b2, b3);
            e[half][g] = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
        }
    }
    if (n <= 8)
        for (int g = 0; g < NG; g++) e[1][g] = _mm512_setzero_ps();
    for (int g = 0; g < NG; g++) {
        const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(e[0][g], e[1][g], 0x88), _mm512_shuffle_f32x4(e[0][g], e[1][g], 0xdd));
        s[g] = _mm512_maskz_mul_ps((__mmask16)((1u << n) - 1), sum, _mm512_set1_ps(scale));
    }
}

/* acc[0:D] += sum_{j<n} p[j] rows[j * stride : j * stride + D] (n <= 16; D a multiple of 16). */
static inline __attribute__((always_inline)) void accumulate16(float *acc, const float *p, const void *vr, int64_t stride,
                                                              int n, const int64_t D, const int bf16) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
        __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
        for (int j = 0; j < n; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            const int64_t v = j * stride + d;
            a0 = _mm512_fmadd_ps(pj, load16(vr, v, bf16), a0);
            a1 = _mm512_fmadd_ps(pj, load16(vr, v + 16, bf16), a1);
            a2 = _mm512_fmadd_ps(pj, load16(vr, v + 32, bf16), a2);
            a3 = _mm512_fmadd_ps(pj, load16(vr, v + 48, bf16), a3);
        }
        _mm512_storeu_ps(acc + d, a0), _mm512_storeu_ps(acc + d + 16, a1);
        _mm512_storeu_ps(acc + d + 32, a2), _mm512_storeu_ps(acc + d + 48, a3);
    }
    for (; d < D; d += 16) {
        __m512 a0 = _mm512_loadu_ps(acc + d);
        for (int j = 0; j < n; j++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), load16(vr, j * stride + d, bf16), a0);
        _mm512_storeu_ps(acc + d, a0);
    }
}

/* accumulate16 for two query heads of one KV head (acc0 / p0, acc1 / p1; D a multiple of 64): each
 * V row loaded once for both, 8 accumulation chains; each head's sums in accumulate16's order. */
static inline __attribute__((always_inline)) void accumulate16x2(float *acc0, float *acc1, const float *p0,
                                                                const float *p1, const void *vr, int64_t stride, int n,
                                                                const int64_t D, const int bf16) {
    for (int64_t d = 0; d < D; d += 64) {
        __m512 a0 = _mm512_loadu_ps(acc0 + d), a1 = _mm512_loadu_ps(acc0 + d + 16);
        __m512 a2 = _mm512_loadu_ps(acc0 + d + 32), a3 = _mm512_loadu_ps(acc0 + d + 48);
        __m512 b0 = _mm512_loadu_ps(acc1 + d), b1 = _mm512_loadu_ps(acc1 + d + 16);
        __m512 b2 = _mm512_loadu_ps(acc1 + d + 32), b3 = _mm512_loadu_ps(acc1 + d + 48);
        for (int j = 0; j < n; j++) {
            const __m512 pj = _mm512_set1_ps(p0[j]), pk = _mm512_set1_ps(p1[j]);
            const int64_t v = j * stride + d;
            const __m512 v0 = load16(vr, v, bf16), v1 = load16(vr, v + 16, bf16);
            const __m512 v2 = load16(vr, v + 32, bf16), v3 = load16(vr, v + 48, bf16);
            a0 = _mm512_fmadd_ps(pj, v0, a0), b0 = _mm512_fmadd_ps(pk, v0, b0);
            a1 = _mm512_fmadd_ps(pj, v1, a1), b1 = _mm512_fmadd_ps(pk, v1, b1);
            a2 = _mm512_fmadd_ps(pj, v2, a2), b2 = _mm512_fmadd_ps(pk, v2, b2);
            a3 = _mm512_fmadd_ps(pj, v3, a3), b3 = _mm512_fmadd_ps(pk, v3, b3);
        }
        _mm512_storeu_ps(acc0 + d, a0), _mm512_storeu_ps(acc0 + d + 16, a1);
        _mm512_storeu_ps(acc0 + d + 32, a2), _mm512_storeu_ps(acc0 + d + 48, a3);
        _mm512_storeu_ps(acc1 + d, b0), _mm512_storeu_ps(acc1 + d + 16, b1);
        _mm512_storeu_ps(acc1 + d + 32, b2), _mm512_storeu_ps(acc1 + d + 48, b3);
    }
}

/* accumulate16x2 for three query heads of one KV head (acc0..2 / p0..2, D apart / SPLIT apart;
 * D a multiple of 64): each V row loaded once for the three, 12 chains; each head's sums in
 * accumulate16's order. */
static inline __attribute__((always_inline)) void accumulate16x3(float *acc, const float *p, const void *vr, int64_t stride,
                                                                int n, const int64_t D, const int bf16) {
    for (int64_t d = 0; d < D; d += 64) {
        __m512 a[3][4];
        for (int g = 0; g < 3; g++)
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(acc + g * D + d + 16 * c);
        for (int j = 0; j < n; j++) {
            const int64_t v = j * stride + d;
            const __m512 v0 = load16(vr, v, bf16), v1 = load16(vr, v + 16, bf16);
            const __m512 v2 = load16(vr, v + 32, bf16), v3 = load16(vr, v + 48, bf16);
            for (int g = 0; g < 3; g++) {
                const __m512 pj = _mm512_set1_ps(p[g * SPLIT + j]);
                a[g][0] = _mm512_fmadd_ps(pj, v0, a[g][0]), a[g][1] = _mm512_fmadd_ps(pj, v1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(pj, v2, a[g][2]), a[g][3] = _mm512_fmadd_ps(pj, v3, a[g][3]);
            }
        }
        for (int g = 0; g < 3; g++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * D + d + 16 * c, a[g][c]);
    }
}

#endif

#if defined(TQ_AVX2) && defined(__AVX512F__)
/* The AVX-512 builds' chunk (D a multiple of 16): a chunk's <= SPLIT keys are one softmax step
 * per query head, not one per tile. Every head's scores over the chunk first (tile by tile: a
 * tile's rows, read once from memory, serve every head; a bfloat16 row read in place is widened
 * once for up to 3 heads, scores16g: in cache 1.1-1.35x, cold 1.0-1.08x; a float32 cache's heads
 * stay one at a time, where scoring 3 together, their prefetch shares issued together, ran
 * 0.9x cold), then per head m = their maximum,
 * p_j = e^(s_j - m) and l = sum_j p_j (lanes summed over the chunk, then one horizontal sum), then
 * acc = sum_j p_j v_j tile by tile. So the maximum, the sum and the rescaling of acc by e^(m - m')
 * happen once per chunk and head; the chunks are merged as before. The cache: float32 or (bf16)
 * bfloat16 rows read in place (src.quant 0), or quantized rows (src.quant 1: int8 / fp8, the
 * format's bytes and scale) whose tile is dequantized per KV head into src.kbuf / src.vbuf. */
typedef struct {
    int kv_format;
    const float *lut;
    float *kbuf, *vbuf; /* TILE * D floats each */
    int64_t head_bytes;
} quant_src;

/* Query head h's K or V rows of the tile at `base`: in place (float32 / bfloat16, es bytes an
 * element), or (quant) dequantized into buf once per KV head, for its G query heads to read. */
static inline __attribute__((always_inline)) const char *head_rows(const void *cache, float *buf, int64_t base, int64_t h,
                                                                  int64_t n, const int quant, const int64_t es,
                                                                  int64_t stride, int64_t G, int64_t D, quant_src src) {
    if (!quant) return (const char *)cache + (base + h / G * D) * es;
    if (h % G == 0)
        dequantize_rows((const uint8_t *)cache + base + h / G * src.head_bytes, stride, n, D, src.kv_format, src.lut, buf);
    return (const char *)buf;
}

/* One query row of chunk16: its q (H heads, D apart), the end of its keys in the chunk, its row's
 * last key (for the prefetch), and where its m[H], l[H], acc[H * D] go. */
typedef struct {
    const float *q;
    int64_t end, limit;
    float *m, *l, *acc;
} chunk_row;

/* The chunk [start, rows[r].end) of R rows that read the same blocks (a prompt's rows: R = 1 for
 * any other row), each with exactly the operations it would take alone, so the same bits: a tile
 * is cut where the rows' furthest end cuts it and row r takes its first keys up to its own end
 * (a key's score does not depend on the keys beside it), its own maximum and sum over its own
 * keys, and its V sums over them in key order. Every row's scores and V sums run while the tile's
 * rows are in L1, so R rows read a tile once, not R times. */
static inline __attribute__((always_inline)) void chunk16(const chunk_row *rows, const int R, const void *k_cache,
                                                         const void *v_cache, const int32_t *table, int64_t start,
                                                         int64_t block_size, int64_t stride, int64_t H, int64_t G,
                                                         int64_t D, float scale, const int bf16, const int quant,
                                                         quant_src src) {
    /* es: bytes per element of a row in place; a quantized row's `stride` is already in bytes */
    const int64_t es = quant ? 1 : bf16 ? 2 : 4, block_bytes = block_size * stride * es;
    const int64_t share = (block_bytes / 64 + H - 1) / H * 64, rs = quant ? D : stride;
    const int b16 = bf16 && !quant; /* a bfloat16 cache read in place */
    int64_t end = start, limit = start; /* the rows' furthest end and last key */
    for (int r = 0; r < R; r++) {
        memset(rows[r].acc, 0, (size_t)(H * D) * sizeof(float));
        end = rows[r].end > end ? rows[r].end : end;
        limit = rows[r].limit > limit ? rows[r].limit : limit;
    }
    /* row r's head h's scores at (r * H + h) * SPLIT */
    float *sc = (float *)__builtin_alloca((size_t)(R * H * SPLIT) * sizeof(float));
    if (end > start) prefetch_first(k_cache, v_cache, table, start, limit, block_size, block_bytes);
    for (int64_t pos = start, n; pos < end; pos += n) { /* scores, tile by tile */
        int64_t base;
        n = tile_at(table, pos, end, block_size, stride, &base);
        const int64_t ahead = block_ahead(table, pos, limit, block_size, block_bytes);
        for (int64_t h = 0, ng; h < H; h += ng) { /* bfloat16 in place: up to 3 heads of one KV head at a time */
            const int64_t left = G - h % G;
            ng = !b16 ? 1 : left < 3 ? left : 3;
            for (int64_t g = 0; g < ng; g++) prefetch_share(k_cache, v_cache, ahead, h + g, share, block_bytes);
            const char *kr = head_rows(k_cache, src.kbuf, base, h, n, quant, es, stride, G, D, src);
            for (int r = 0; r < R; r++) {
                const float *q = rows[r].q;
                const int64_t nr = rows[r].end - pos < n ? rows[r].end - pos : n; /* row r's keys of the tile */
                for (int64_t j = 0; j < nr; j += 16) {
                    const int w = nr - j < 16 ? (int)(nr - j) : 16;
                    const void *k = kr + j * rs * (quant ? 4 : es);
                    __m512 s[3];
#define SCORES(NG)                                                                                   \
    switch (D) {                                                                                     \
        case 64: scores16g(q + h * D, NG, k, rs, w, 64, scale, bf16, s); break;                     \
        case 128: scores16g(q + h * D, NG, k, rs, w, 128, scale, bf16, s); break;                   \
        case 256: scores16g(q + h * D, NG, k, rs, w, 256, scale, bf16, s); break;                   \
        default: for (int g = 0; g < NG; g++) s[g] = scores16(q + (h + g) * D, k, rs, w, D, scale, bf16); \
    }
                    if (ng == 3) {
                        SCORES(3)
                    } else if (ng == 2) {
                        SCORES(2)
                    } else {
                        SCORES(1)
                    }
#undef SCORES
                    for (int64_t g = 0; g < ng; g++)
                        _mm512_mask_storeu_ps(sc + (r * H + h + g) * SPLIT + (pos - start) + j, (__mmask16)((1u << w) - 1), s[g]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) { /* m, p = e^(s - m) in place, l */
        const int64_t len = rows[r].end - start;
        for (int64_t h = 0; h < H; h++) {
            if (len <= 0) {
                rows[r].m[h] = -INFINITY, rows[r].l[h] = 0.0f;
                continue;
            }
            float *sh = sc + (r * H + h) * SPLIT;
            __m512 vm = _mm512_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 16 <= len; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sh + j));
            const __mmask16 tail = (__mmask16)((1u << (len - j)) - 1);
            if (j < len) vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_maskz_loadu_ps(tail, sh + j));
            const float mx = _mm512_reduce_max_ps(vm);
            const __m512 vmx = _mm512_set1_ps(mx);
            __m512 vs = _mm512_setzero_ps();
            for (j = 0; j + 16 <= len; j += 16) {
                const __m512 p = exp512_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sh + j), vmx));
                _mm512_storeu_ps(sh + j, p);
                vs = _mm512_add_ps(vs, p);
            }
            if (j < len) {
                const __m512 p = _mm512_maskz_mov_ps(tail, exp512_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sh + j), vmx)));
                _mm512_mask_storeu_ps(sh + j, tail, p);
                vs = _mm512_add_ps(vs, p);
            }
            rows[r].m[h] = mx;
            rows[r].l[h] = _mm512_reduce_add_ps(vs);
        }
    }
    for (int64_t pos = start, n; pos < end; pos += n) { /* acc = sum_j p_j v_j, tile by tile */
        int64_t base;
        n = tile_at(table, pos, end, block_size, stride, &base);
        for (int64_t h = 0; h < H; h++) {
            const char *vr = head_rows(v_cache, src.vbuf, base, h, n, quant, es, stride, G, D, src);
            const int pair = h % G + 1 < G && D % 64 == 0; /* heads h and h + 1 read the same KV head */
            const int triple = b16 && h % G + 2 < G && D % 64 == 0; /* bfloat16 in place: 3 heads a V row */
            for (int r = 0; r < R; r++) {
                float *acc = rows[r].acc;
                const int64_t nr = rows[r].end - pos < n ? rows[r].end - pos : n;
                for (int64_t j = 0; j < nr; j += 16) {
                    const int w = nr - j < 16 ? (int)(nr - j) : 16;
                    const float *p = sc + (r * H + h) * SPLIT + (pos - start) + j;
                    const void *v = vr + j * rs * (quant ? 4 : es);
                    if (triple) {
                        if (D == 64)
                            accumulate16x3(acc + h * D, p, v, rs, w, 64, bf16);
                        else
                            accumulate16x3(acc + h * D, p, v, rs, w, D, bf16);
                        continue;
                    }
                    if (pair) {
                        if (D == 64)
                            accumulate16x2(acc + h * D, acc + (h + 1) * D, p, p + SPLIT, v, rs, w, 64, bf16);
                        else
                            accumulate16x2(acc + h * D, acc + (h + 1) * D, p, p + SPLIT, v, rs, w, D, bf16);
                        continue;
                    }
                    switch (D) {
                        case 64: accumulate16(acc + h * D, p, v, rs, w, 64, bf16); break;
                        case 128: accumulate16(acc + h * D, p, v, rs, w, 128, bf16); break;
                        default: accumulate16(acc + h * D, p, v, rs, w, D, bf16);
                    }
                }
            }
            h += triple ? 2 : pair;
        }
    }
}
#endif

#endif
