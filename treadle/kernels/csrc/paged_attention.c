/* Decode attention over the paged KV cache on the CPU (one new query token per sequence).
 * One translation unit with kv_formats.h (the cache's int8 / fp8 / bfloat16 rows) and attention16.h
 * (the AVX-512 builds' 16-key scoring and chunk16).
 *
 * One call per layer and decode step:
 *   1. each sequence's new k/v row is written into the cache at slots[i] (slots < 0 skipped);
 *   2. out[i, h] = softmax(scale * q[i, h] . K^T) V over the keys lo_i .. seq_lens[i] - 1 of
 *      sequence i, where lo_i = max(0, seq_len - window) with a sliding window, else 0.
 *
 * The cache is [num_blocks, block_size, num_kv_heads, head_dim]; position p of sequence i is
 * row p % block_size of block block_tables[i][p / block_size]. GQA: query head h reads KV head
 * h / G (G = num_heads / num_kv_heads), with no copy of K/V.
 *
 * FlashDecoding: work items are (sequence, chunk) and cover every head, so each cache row (all
 * KV heads, contiguous) is read from memory once, whole; items per (sequence, KV head) would
 * each read 1 / num_kv_heads of every row and leave the prefetchers fetching the rest for
 * nothing. Blocks are scattered, so every line of a chunk's first blocks and of the block AHEAD
 * blocks on is prefetched into L2 (float32 and bfloat16 caches; the quantized ones' plain-C path
 * touches the next block's pages).
 * Every context is cut into chunks of SPLIT keys from its first key, whatever else is in the
 * call, so a row's bits depend on its own context alone (not on the batch or the thread count:
 * a prompt's rows computed in one call, in chunks, or after a prefix-cache hit come out the
 * same). With fewer rows than WORK_PER_THREAD per thread each chunk is a work item, so one long
 * sequence still keeps every core busy; otherwise a row is one, its chunks one after another
 * (the same chunks and merge, so the same bits), and in the AVX-512 builds up to ROWS_TOGETHER
 * neighbouring rows of a thread's run that read the same blocks (a prompt's rows, a verify's, rows
 * of a shared prefix) take each chunk together: every tile is read once for all of them while it
 * is in L1, each row with its own keys and exactly its own operations (0.64-0.94x the time of a
 * 512-token prompt's rows). An item runs an online softmax per query head over tiles of up to TILE keys (one
 * block's rows, then read from L1 by the G heads of each KV head):
 *
 *   s_j = scale q.k_j    m' = max(m, max_j s_j)    c = e^(m - m')
 *   l' = c l + sum_j e^(s_j - m')                  acc' = c acc + sum_j e^(s_j - m') v_j
 *
 * and the chunks of one (sequence, head) are merged by their maxima, in chunk order:
 *   M = max_c m_c,   out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
 * With one chunk the row's output is acc / l. Work is spread with OpenMP (torch's libgomp
 * and thread count), each thread taking a contiguous run of items balanced by keys (thread_units). AVX2/FMA for the dot products, e^x and the V sums where the CPU has
 * them, plain C otherwise; any head_dim (a scalar tail past multiples of 8). The AVX-512 builds
 * take head_dims that are multiples of 16 sixteen keys at a time (scores16: one vector of
 * scores), and a float32 or bfloat16 cache's chunk as one softmax step (chunk16: every head's
 * scores over the chunk's <= SPLIT keys first, then one maximum, e^(s - m) and sum per head, then
 * the V sums; the maximum's horizontal reduction and the rescaling of acc happen once per chunk,
 * not once per 16 keys: 1.3x faster at a 512-token prompt's rows, 1.1-1.2x at decode rows); their
 * bits differ from the AVX2 builds' in the last place (another summation order), and are still
 * one function of the row's own context.
 *
 * Quantized caches (kv_format TQ_KV_INT8 / TQ_KV_FP8, layers/attention/kv_quant.py): each
 * (token, KV head) row is head_dim bytes (int8, or float8 e4m3fn) followed by its float32 scale,
 * so a cache row is num_kv_heads * (head_dim + 4) bytes. The new rows are quantized as they are
 * written (the same arithmetic as kv_quant.quantize: scale = amax / 127 or / 448, x / scale
 * rounded half to even), and each tile is dequantized once per KV head into a float buffer that
 * the G query heads of that KV head then read through the float code above (in the AVX-512 builds
 * chunk16's, once for the scores and once for the V sums).
 * A bfloat16 cache (TQ_KV_BF16: a bfloat16 model's, or a float32 model's with kv_cache_dtype
 * bfloat16) holds rows of head_dim bfloat16 values, no scale, written rounded to nearest even
 * (torch's float -> bfloat16). Every build reads it in place, each load widened in the register
 * (chunk16's 16 lanes in the AVX-512 builds, 8 in the AVX2 ones, one value in plain C), so the bytes
 * read are half a float32 cache's and a bfloat16 cache gives the bits of a float32 cache holding
 * the same values (AVX2 forced on AMD Zen 4, batch 16 x 200 keys: 1.45-1.7x the widened copy per tile
 * the AVX2 builds made before).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "tq.h"

#define TILE 64             /* keys scored at a time (their scores live on the stack) */
#define SPLIT 64            /* keys per chunk of a context (a multiple of TILE) */
#define WORK_PER_THREAD 4   /* fewer rows than this per thread: chunks are the work items */
#define ROWS_TOGETHER 4     /* rows reading the same blocks (a prompt's) attended together, a tile read once for all */
#define PARALLEL_MIN 1024   /* fewer (keys x query heads) than this (~10 us): one thread */
#define AHEAD 2             /* float32 caches: every line of the block this many ahead is prefetched */
#define PAGE_FLOATS 1024    /* 4 KiB: blocks are scattered, so the next one's pages (TLB entries,
                               and where the hardware prefetchers start) are requested ahead */

#include "kv_formats.h"

#ifdef TQ_AVX2

/* e^r's Taylor series up to r^7, highest power first (Horner) */
static const float EXP_COEF[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

/* e^x for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r from its Taylor series up to r^7
 * (truncation error < 1e-8 relative), 2^n built in the exponent bits. x is clamped at -87 so
 * 2^n stays a normal float (e^-87 ~ 1.6e-38, nothing next to the row maximum's e^0 = 1). */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 = hi + lo */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(EXP_COEF[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_COEF[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* Element i of cache rows at p: float32, or (bf16) bfloat16 widened to float32 exactly (its 16 bits
 * on top), so a bfloat16 cache is read in place, at half the bytes, with a float32 cache's
 * arithmetic on the same values. The functions below take `rows` in elements of either kind. */
static inline __attribute__((always_inline)) float elem(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

#ifdef TQ_AVX2
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

/* q . row (elements r .. r + n - 1 of rows) */
static inline __attribute__((always_inline)) float dot(const float *a, const void *rows, int64_t r, int64_t n,
                                                       const int bf16) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef TQ_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(rows, r + i, bf16), acc);
    s = hsum(acc);
#endif
    for (; i < n; i++) s += a[i] * elem(rows, r + i, bf16);
    return s;
}

/* s[j] = scale * q . rows[j * stride : j * stride + D] for j < n. With AVX2, 8 rows at a time:
 * 8 independent accumulators share each load of q and are reduced together (hadd tree), so
 * no row waits on a horizontal sum of its own. */
static inline __attribute__((always_inline)) void scores(const float *q, const void *rows, int64_t stride, int64_t n,
                                                         int64_t D, float scale, float *s, const int bf16) {
    int64_t j = 0;
#ifdef TQ_AVX2
    const int64_t D8 = D & ~(int64_t)7;
    for (; j + 8 <= n; j += 8) {
        const int64_t r = j * stride;
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D8; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv, load8(rows, r + u * stride + d, bf16), a[u]);
        }
        /* u = [sums of a0..a3 over their low 128 bits | over their high 128 bits], w the same for
         * a4..a7; adding the matching halves gives the 8 dot products in order */
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u, w, 0x20), _mm256_permute2f128_ps(u, w, 0x31));
        _mm256_storeu_ps(s + j, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
        for (int64_t d = D8; d < D; d++) /* the tail of an odd head_dim */
            for (int u = 0; u < 8; u++) s[j + u] += scale * q[d] * elem(rows, r + u * stride + d, bf16);
    }
#endif
    for (; j < n; j++) s[j] = scale * dot(q, rows, j * stride, D, bf16);
}

/* p[j] = e^(p[j] - mx) for j < n (every p[j] <= mx); returns their sum. */
static inline float exp_sum(float *p, int n, float mx) {
    int j = 0;
    float sum = 0.0f;
#ifdef TQ_AVX2
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
        _mm256_storeu_ps(p + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum(vs);
#endif
    for (; j < n; j++) sum += (p[j] = expf(p[j] - mx));
    return sum;
}

#ifdef TQ_AVX2
/* acc[0:8W] = c acc + sum_{j<n} p[j] rows[j * stride : j * stride + 8W], W accumulators in
 * registers over all n rows (W = 8: enough independent FMA chains to fill both FMA units). */
static inline __attribute__((always_inline)) void accumulate_strip(float *acc, __m256 c, const float *p,
                                                                   const void *rows, int64_t r, int64_t stride, int n,
                                                                   const int W, const int bf16) {
    __m256 a[8];
    for (int u = 0; u < W; u++) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * u), c);
    for (int j = 0; j < n; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int u = 0; u < W; u++) a[u] = _mm256_fmadd_ps(pj, load8(rows, r + j * stride + 8 * u, bf16), a[u]);
    }
    for (int u = 0; u < W; u++) _mm256_storeu_ps(acc + 8 * u, a[u]);
}
#endif

/* acc[0:D] = c acc + sum_{j<n} p[j] rows[j * stride : j * stride + D]: 64, 32, then 8 columns
 * at a time, then a scalar tail. */
static void scale_accumulate(float *acc, float c, const float *p, const void *rows, int64_t stride, int n, int64_t D,
                             const int bf16) {
    int64_t d = 0;
#ifdef TQ_AVX2
    const __m256 vc = _mm256_set1_ps(c);
    for (; d + 64 <= D; d += 64) accumulate_strip(acc + d, vc, p, rows, d, stride, n, 8, bf16);
    if (d + 32 <= D) accumulate_strip(acc + d, vc, p, rows, d, stride, n, 4, bf16), d += 32;
    for (; d + 8 <= D; d += 8) accumulate_strip(acc + d, vc, p, rows, d, stride, n, 1, bf16);
#endif
    for (; d < D; d++) {
        float a = c * acc[d];
        for (int j = 0; j < n; j++) a += p[j] * elem(rows, j * stride + d, bf16);
        acc[d] = a;
    }
}


/* One online-softmax step of one query head q over the n <= TILE keys/values kr, vr (rows
 * `stride` elements apart, float32 or bf16): m, l, acc (D floats) updated as the header says; s is
 * scratch. */
static inline __attribute__((always_inline)) void head_tile(const float *q, const void *kr, const void *vr,
                                                            int64_t stride, int n, int64_t D, float scale, float *m,
                                                            float *l, float *acc, float *s, const int bf16) {
    scores(q, kr, stride, n, D, scale, s, bf16);
    float mx = *m;
    for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const float c = expf(*m - mx); /* 0 on the first tile (m = -inf) */
    *l = c * *l + exp_sum(s, n, mx);
    *m = mx;
    scale_accumulate(acc, c, s, vr, stride, n, D, bf16);
}

/* The tile at key pos of a range ending at end: up to TILE keys of one block, returned, and the
 * element offset of its first row in the cache (rows `stride` elements apart) in *base. */
static inline int64_t tile_at(const int32_t *table, int64_t pos, int64_t end, int64_t block_size, int64_t stride,
                              int64_t *base) {
    const int64_t off = pos % block_size;
    int64_t n = block_size - off < end - pos ? block_size - off : end - pos;
    if (n > TILE) n = TILE;
    *base = ((int64_t)table[pos / block_size] * block_size + off) * stride;
    return n;
}

/* Bytes [from, to) of the K and V block at byte `at` into L2: blocks are scattered, so the
 * hardware prefetchers, which stop at page edges, fetch little of one ahead of its use (1.04x at
 * batch 1 x 512 keys, 1.1x from 2,048 keys or 4 sequences on, AMD Zen 1). */
static inline void prefetch_block(const void *k_cache, const void *v_cache, int64_t at, int64_t from, int64_t to) {
    for (int64_t b = from; b < to; b += 64) {
        __builtin_prefetch((const char *)k_cache + at + b, 0, 2);
        __builtin_prefetch((const char *)v_cache + at + b, 0, 2);
    }
}

/* Head h's share of the block at byte `ahead` (-1: none) into L2: a share before each head, as all
 * of it at once would stall on the fill buffers. */
static inline void prefetch_share(const void *k_cache, const void *v_cache, int64_t ahead, int64_t h, int64_t share,
                                  int64_t block_bytes) {
    if (ahead >= 0)
        prefetch_block(k_cache, v_cache, ahead, h * share, (h + 1) * share < block_bytes ? (h + 1) * share : block_bytes);
}

/* The first AHEAD blocks of a range into L2 (its row's keys end at limit). */
static inline void prefetch_first(const void *k_cache, const void *v_cache, const int32_t *table, int64_t start,
                                  int64_t limit, int64_t block_size, int64_t block_bytes) {
    for (int64_t b = 0; b < AHEAD && (start / block_size + b) * block_size < limit; b++)
        prefetch_block(k_cache, v_cache, (int64_t)table[start / block_size + b] * block_bytes, 0, block_bytes);
}

/* The byte offset of the block AHEAD blocks after the one holding key pos, or -1 past limit. */
static inline int64_t block_ahead(const int32_t *table, int64_t pos, int64_t limit, int64_t block_size,
                                  int64_t block_bytes) {
    return (pos / block_size + AHEAD) * block_size < limit ? (int64_t)table[pos / block_size + AHEAD] * block_bytes : -1;
}


#include "attention16.h"

/* Online softmax of every query head of one sequence (q: H heads, D floats apart) over its keys
 * [start, end) of a float32 or (bf16) bfloat16 cache, read in place, tile by tile (the builds and
 * head sizes chunk16 does not take), into m[H], l[H], acc[H * D]; query head h reads KV head h / G.
 * The blocks AHEAD on are prefetched up to the row's last key `limit`, past the range's end: a row's
 * chunks run one after another (1.25x at 16 rows x 160 keys, AMD Zen 5, cold caches). A tile is up
 * to TILE keys of one block: whole cache rows (all KV heads, `stride` elements apart), contiguous in
 * memory, read from DRAM once and then from L1 by the G heads of each KV head. An empty range leaves
 * m = -inf, l = 0, acc = 0. */
static inline __attribute__((always_inline)) void attend_rows(const float *q, const void *k_cache, const void *v_cache,
                                                              const int32_t *table, int64_t start, int64_t end,
                                                              int64_t limit, int64_t block_size, int64_t stride,
                                                              int64_t H, int64_t G, int64_t D, float scale, float *m,
                                                              float *l, float *acc, const int bf16) {
    float s[TILE];
    const int64_t es = bf16 ? 2 : 4, block_bytes = block_size * stride * es;
    const int64_t share = (block_bytes / 64 + H - 1) / H * 64;
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    prefetch_first(k_cache, v_cache, table, start, limit, block_size, block_bytes);
    for (int64_t pos = start, n; pos < end; pos += n) {
        int64_t base;
        n = tile_at(table, pos, end, block_size, stride, &base);
        const int64_t ahead = block_ahead(table, pos, limit, block_size, block_bytes);
        for (int64_t h = 0; h < H; h++) {
            prefetch_share(k_cache, v_cache, ahead, h, share, block_bytes);
            const int64_t at = (base + h / G * D) * es;
            head_tile(q + h * D, (const char *)k_cache + at, (const char *)v_cache + at, stride, (int)n, D, scale, m + h,
                      l + h, acc + h * D, s, bf16);
        }
    }
}

/* attend_rows for each kind of cache, one function each: both inlined into one caller, the
 * float32 path spilled more and ran 5-7 % slower than the float32-only function before it (AVX2
 * build, AMD Zen 4); as two functions, 1-5 % (attention_floor_cpu.py --ref 51e7cf2) */
__attribute__((noinline)) static void attend_rows_f32(const float *q, const void *k_cache, const void *v_cache,
                                                      const int32_t *table, int64_t start, int64_t end, int64_t limit,
                                                      int64_t block_size, int64_t stride, int64_t H, int64_t G,
                                                      int64_t D, float scale, float *m, float *l, float *acc) {
    attend_rows(q, k_cache, v_cache, table, start, end, limit, block_size, stride, H, G, D, scale, m, l, acc, 0);
}
__attribute__((noinline)) static void attend_rows_bf16(const float *q, const void *k_cache, const void *v_cache,
                                                       const int32_t *table, int64_t start, int64_t end, int64_t limit,
                                                       int64_t block_size, int64_t stride, int64_t H, int64_t G,
                                                       int64_t D, float scale, float *m, float *l, float *acc) {
    attend_rows(q, k_cache, v_cache, table, start, end, limit, block_size, stride, H, G, D, scale, m, l, acc, 1);
}

/* attend_rows over an int8 / fp8 cache (rows of `stride` bytes, head_bytes per KV head):
 * each tile is dequantized per KV head into kbuf / vbuf (TILE * D floats each), which the G query
 * heads of that KV head read. */
static void attend_range_quant(const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table,
                               int64_t start, int64_t end, int64_t block_size, int64_t stride, int64_t head_bytes,
                               int64_t H, int64_t G, int64_t D, float scale, int kv_format, const float *lut,
                               float *kbuf, float *vbuf, float *m, float *l, float *acc) {
    float s[TILE];
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t pos = start, n; pos < end; pos += n) {
        int64_t base;
        n = tile_at(table, pos, end, block_size, stride, &base);
        if ((pos / block_size + 1) * block_size < end) { /* touch the next block's pages early */
            const int64_t next = (int64_t)table[pos / block_size + 1] * block_size * stride;
            for (int64_t b = 0; b < block_size * stride; b += 4 * PAGE_FLOATS) {
                __builtin_prefetch(k_cache + next + b);
                __builtin_prefetch(v_cache + next + b);
            }
        }
        for (int64_t kh = 0; kh < H / G; kh++) {
            dequantize_rows(k_cache + base + kh * head_bytes, stride, n, D, kv_format, lut, kbuf);
            dequantize_rows(v_cache + base + kh * head_bytes, stride, n, D, kv_format, lut, vbuf);
            for (int64_t h = kh * G; h < (kh + 1) * G; h++)
                head_tile(q + h * D, kbuf, vbuf, D, (int)n, D, scale, m + h, l + h, acc + h * D, s, 0);
        }
    }
}

/* A row's keys are cut at every SPLIT keys from its first one, whatever else is in the call: how a
 * row is computed, and so its bits, depends on its own context alone (not on the batch, the
 * thread count, or whether its query came as a decode token or in a prompt chunk). */
static int64_t row_span(int64_t len, int64_t window) { return (window > 0 && len > window) ? window : len; }
static int64_t row_chunks(int64_t len, int64_t window) {
    const int64_t span = row_span(len, window);
    return span > SPLIT ? (span + SPLIT - 1) / SPLIT : 1;
}

typedef struct { /* what every work item reads */
    const float *q;
    int64_t q_stride;
    const void *k_cache, *v_cache;
    const int32_t *block_tables;
    const int32_t *seq_lens;
    int64_t max_blocks, block_size, row, qrow, head_bytes, H, G, D, window;
    float scale;
    int kv_format;
    const float *lut;
} paged_args;

#if defined(TQ_AVX2) && defined(__AVX512F__)
/* chunk16 for each kind of cache, one function each, and one row (a decode row) apart, its row
 * loops gone (decode rows ran slower with chunk16 inlined for every case into attend_chunks). */
#define CHUNK16_FN(NAME, NR, BF16, QUANT)                                                                              \
    __attribute__((noinline)) static void NAME(const chunk_row *rows, int R, const void *k_cache, const void *v_cache,   \
                                               const int32_t *table, int64_t start, int64_t block_size, int64_t stride, \
                                               int64_t H, int64_t G, int64_t D, float scale, quant_src src) {           \
        (void)R;                                                                                                        \
        chunk16(rows, NR, k_cache, v_cache, table, start, block_size, stride, H, G, D, scale, BF16, QUANT, src);        \
    }
CHUNK16_FN(chunk_f32_1, 1, 0, 0)
CHUNK16_FN(chunk_bf16_1, 1, 1, 0)
CHUNK16_FN(chunk_quant_1, 1, 0, 1)
CHUNK16_FN(chunk_f32, R, 0, 0)
CHUNK16_FN(chunk_bf16, R, 1, 0)
CHUNK16_FN(chunk_quant, R, 0, 1)
#undef CHUNK16_FN
#endif

/* Row i's chunk c: its first key (returned) and *end, past its last. */
static int64_t chunk_keys(const paged_args *a, int64_t i, int64_t c, int64_t *end) {
    const int64_t len = a->seq_lens[i], lo = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int64_t start = lo + c * SPLIT;
    *end = start + SPLIT < len ? start + SPLIT : len;
    return start;
}

/* Chunk c of rows idx[0 .. R) into parts[r] (m[H], l[H], acc[H * D]); rows taken together read
 * the same blocks with their chunks starting at the same key (rows_together). */
static void attend_chunks(const paged_args *a, const int64_t *idx, int R, int64_t c, float *kbuf, float *const *parts) {
    const int bf16 = a->kv_format == TQ_KV_BF16, inplace = a->kv_format == TQ_KV_FLOAT32 || bf16;
#if defined(TQ_AVX2) && defined(__AVX512F__)
    if (a->D % 16 == 0) { /* chunk16, every kind of cache */
        chunk_row rows[ROWS_TOGETHER];
        int64_t start = 0, longest = idx[0];
        for (int r = 0; r < R; r++) {
            const int64_t i = idx[r];
            int64_t end;
            start = chunk_keys(a, i, c, &end); /* the same for every row taken together */
            rows[r] = (chunk_row){a->q + i * a->q_stride, end, a->seq_lens[i], parts[r], parts[r] + a->H,
                                  parts[r] + 2 * a->H};
            if (a->seq_lens[i] > a->seq_lens[longest]) longest = i;
        }
        const int32_t *table = a->block_tables + longest * a->max_blocks; /* the others' blocks are its first ones */
        const quant_src src = {a->kv_format, a->lut, kbuf, kbuf + TILE * a->D, a->head_bytes};
        const int64_t stride = inplace ? a->row : a->qrow;
        (R == 1 ? (bf16 ? chunk_bf16_1 : inplace ? chunk_f32_1 : chunk_quant_1)
                : (bf16 ? chunk_bf16 : inplace ? chunk_f32 : chunk_quant))(rows, R, a->k_cache, a->v_cache, table, start,
                                                                          a->block_size, stride, a->H, a->G, a->D,
                                                                          a->scale, src);
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        const int64_t i = idx[r], len = a->seq_lens[i];
        int64_t end;
        const int64_t start = chunk_keys(a, i, c, &end);
        float *m = parts[r], *l = m + a->H, *acc = l + a->H;
        const int32_t *table = a->block_tables + i * a->max_blocks;
        if (inplace)
            (bf16 ? attend_rows_bf16 : attend_rows_f32)(a->q + i * a->q_stride, a->k_cache, a->v_cache, table, start, end,
                                                        len, a->block_size, a->row, a->H, a->G, a->D, a->scale, m, l, acc);
        else
            attend_range_quant(a->q + i * a->q_stride, a->k_cache, a->v_cache, table, start, end, a->block_size,
                               a->qrow, a->head_bytes, a->H, a->G, a->D, a->scale, a->kv_format, a->lut, kbuf,
                               kbuf + TILE * a->D, m, l, acc);
    }
}

/* Whether rows i and j can take their chunks together: both start at key 0 (no window cuts
 * them) and read the same blocks up to the shorter one's last key (a prompt's rows, or a verify's). */
static int rows_together(const paged_args *a, int64_t i, int64_t j) {
    const int64_t li = a->seq_lens[i], lj = a->seq_lens[j], shorter = li < lj ? li : lj;
    if (a->window > 0 && (li > a->window || lj > a->window)) return 0;
    return memcmp(a->block_tables + i * a->max_blocks, a->block_tables + j * a->max_blocks,
                  (size_t)((shorter + a->block_size - 1) / a->block_size) * sizeof(int32_t)) == 0;
}

/* Thread tid's work items [*lo, *hi) of n, keys[u] the keys before item u: a contiguous run, each
 * item going to the thread whose equal share of the keys holds the item's middle key. So a row's
 * chunks run on one thread, where the blocks prefetched AHEAD past a chunk's end are the next
 * chunk's (items handed out one at a time sent them to the other core's L2). */
static int unit_owner(const int64_t *keys, int64_t u, int64_t n, int team) {
    if (keys[n] <= 0) return (int)(u * team / n);
    const int64_t t = (keys[u] + keys[u + 1]) * team / (2 * keys[n]);
    return t < team - 1 ? (int)t : team - 1;
}
static void thread_units(const int64_t *keys, int64_t n, int tid, int team, int64_t *lo, int64_t *hi) {
    int64_t u = 0;
    while (u < n && unit_owner(keys, u, n, team) < tid) u++;
    *lo = u;
    while (u < n && unit_owner(keys, u, n, team) <= tid) u++;
    *hi = u;
}

/* A row's output from its chunks' parts, merged by their maxima in chunk order. */
static void finish_row(const float *parts, int64_t chunks, int64_t H, int64_t D, float *out) {
    const int64_t part_len = H * (D + 2);
    for (int64_t h = 0; h < H; h++) {
        float *o = out + h * D;
        if (chunks == 1) {
            const float inv = parts[H + h] > 0.0f ? 1.0f / parts[H + h] : 0.0f;
            for (int64_t d = 0; d < D; d++) o[d] = parts[2 * H + h * D + d] * inv;
            continue;
        }
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *pc = parts + c * part_len;
            if (pc[H + h] > 0.0f && pc[h] > mx) mx = pc[h];
        }
        memset(o, 0, (size_t)D * sizeof(float));
        for (int64_t c = 0; c < chunks; c++) {
            const float *pc = parts + c * part_len;
            if (!(pc[H + h] > 0.0f)) continue; /* an empty chunk */
            const float w = expf(pc[h] - mx);
            sum += w * pc[H + h];
            const float *acc = pc + 2 * H + h * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * acc[d];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

void tq_paged_decode(const float *q, const float *k, const float *v, int64_t q_stride, int64_t k_stride,
                     int64_t v_stride, void *k_cache, void *v_cache, const int64_t *slots,
                     const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs, int64_t max_blocks,
                     int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                     float scale, int kv_format, float *out) {
    const int64_t H = num_heads, D = head_dim, G = num_heads / num_kv_heads, row = num_kv_heads * D;
    const int64_t head_bytes = kv_format == TQ_KV_BF16 ? 2 * D : D + 4; /* a KV head's row, not float32 */
    const int64_t qrow = num_kv_heads * head_bytes; /* bytes of one token's row in such a cache */
    for (int64_t i = 0; i < num_seqs; i++) {
        if (slots[i] < 0) continue;
        if (kv_format == TQ_KV_FLOAT32) {
            memcpy((float *)k_cache + slots[i] * row, k + i * k_stride, (size_t)row * sizeof(float));
            memcpy((float *)v_cache + slots[i] * row, v + i * v_stride, (size_t)row * sizeof(float));
            continue;
        }
        if (kv_format == TQ_KV_BF16) {
            bf16_encode_row(k + i * k_stride, (uint16_t *)k_cache + slots[i] * row, row);
            bf16_encode_row(v + i * v_stride, (uint16_t *)v_cache + slots[i] * row, row);
            continue;
        }
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            quantize_row(k + i * k_stride + kh * D, (uint8_t *)k_cache + slots[i] * qrow + kh * head_bytes, D, kv_format);
            quantize_row(v + i * v_stride + kh * D, (uint8_t *)v_cache + slots[i] * qrow + kh * head_bytes, D, kv_format);
        }
    }
    float lut[256];
    if (kv_format == TQ_KV_FP8) fp8_e4m3_table(lut);
    int64_t most = 1, items = 0; /* most chunks of one row; (row, chunk) pairs */
    int64_t *first = malloc((size_t)(num_seqs + 1) * sizeof(int64_t)); /* row i's chunks: first[i] .. first[i + 1] */
    if (first == NULL) abort();
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t c = row_chunks(seq_lens[i], window);
        first[i] = items;
        items += c;
        if (c > most) most = c;
    }
    first[num_seqs] = items;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const int64_t part_len = H * (D + 2); /* m[H], l[H], acc[H * D] */
    const paged_args a = {q, q_stride, k_cache, v_cache, block_tables, seq_lens, max_blocks, block_size, row, qrow,
                          head_bytes, H, G, D, window, scale, kv_format, lut};
    /* few rows: each chunk is a work item (one long context keeps every core busy); many rows: each
     * row is one, its chunks attended one after another; the same chunks and merge either way */
    const int by_chunk = num_seqs < WORK_PER_THREAD * threads && items > num_seqs;
    const int64_t units = by_chunk ? items : num_seqs;
    int64_t *keys = malloc((size_t)(units + 1) * sizeof(int64_t)); /* the keys before each work item */
    int together = 1; /* rows taken together at most (ROWS_TOGETHER when some neighbours read the same blocks) */
    for (int64_t i = 0; !by_chunk && together == 1 && i + 1 < num_seqs; i++)
        if (rows_together(&a, i, i + 1)) together = ROWS_TOGETHER;
    float *part = malloc((size_t)((by_chunk ? items : threads * together * most) * part_len) * sizeof(float));
    if (part == NULL || keys == NULL) abort();
    keys[0] = 0;
    for (int64_t i = 0, u = 0; i < num_seqs; i++) {
        const int64_t span = row_span(seq_lens[i], window);
        for (int64_t c = 0; c < (by_chunk ? first[i + 1] - first[i] : 1); c++, u++)
            keys[u + 1] = keys[u] + (by_chunk ? (span - c * SPLIT < SPLIT ? span - c * SPLIT : SPLIT) : span);
    }
    /* keys[units]: every key of the call */
#pragma omp parallel if (keys[units] * H >= PARALLEL_MIN)
    {
        const int widened = kv_format == TQ_KV_INT8 || kv_format == TQ_KV_FP8; /* tiles dequantized into kbuf */
        float *kbuf = widened ? malloc((size_t)(2 * TILE * D) * sizeof(float)) : NULL;
        if (widened && kbuf == NULL) abort();
        int tid = 0, team = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num(), team = omp_get_num_threads();
#endif
        int64_t lo, hi;
        thread_units(keys, units, tid, team, &lo, &hi);
        if (by_chunk) {
            int64_t i = 0;
            for (int64_t it = lo; it < hi; it++) {
                while (first[i + 1] <= it) i++;
                float *pp = part + it * part_len;
                attend_chunks(&a, &i, 1, it - first[i], kbuf, &pp);
            }
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_seqs; r++)
                finish_row(part + first[r] * part_len, first[r + 1] - first[r], H, D, out + r * H * D);
        } else {
            float *mine = part + tid * together * most * part_len; /* row r of a group: its chunks at r * most */
            for (int64_t i = lo, R; i < hi; i += R) {
                int64_t most_here = 0;
                R = 0; /* the next rows of this thread's run that read the same blocks, up to ROWS_TOGETHER */
                for (int ok = 1; ok && R < together && i + R < hi; R += ok)
                    for (int64_t r = 0; r < R && ok; r++) ok = rows_together(&a, i + r, i + R);
                for (int64_t r = 0; r < R; r++) {
                    const int64_t chunks = first[i + r + 1] - first[i + r];
                    most_here = chunks > most_here ? chunks : most_here;
                }
                for (int64_t c = 0; c < most_here; c++) { /* chunk c of the rows that have one */
                    int64_t idx[ROWS_TOGETHER];
                    float *parts[ROWS_TOGETHER];
                    int n = 0;
                    for (int64_t r = 0; r < R; r++)
                        if (c < first[i + r + 1] - first[i + r])
                            idx[n] = i + r, parts[n++] = mine + (r * most + c) * part_len;
                    attend_chunks(&a, idx, n, c, kbuf, parts);
                }
                for (int64_t r = 0; r < R; r++)
                    finish_row(mine + r * most * part_len, first[i + r + 1] - first[i + r], H, D, out + (i + r) * H * D);
            }
        }
        free(kbuf);
    }
    free(keys);
    free(part);
    free(first);
}
