/* GGUF rows back to floats: embedding lookups (tq_gather_rows) and whole weights (tq_dequantize),
 * exactly the gguf package's values; packed rows (q8pack.c) are first put back as the file has them. */
#include <stdlib.h>

#include "qblocks.h"

/* One row of K inputs -> K floats (exactly the gguf package's values). */
static void dequant_row(int qtype, const uint8_t *row, float *out, int64_t K) {
    const int G = unit_blocks(qtype), ub = unit_bytes(qtype);
    for (int64_t u = 0; u < K / (QK * G); u++, row += ub) {
        unit_scales_t sc;
        unit_scales(qtype, row, &sc);
        for (int b = 0; b < G; b++, out += QK) {
            int q[QK];
            block_ints(qtype, row, b, q);
            for (int j = 0; j < QK; j++) {
                const float m = min_per_block(qtype) ? sc.m[b] : min_per_half(qtype) ? sc.mh[2 * b + j / 16] : 0.0f;
                out[j] = sc.d[scale_index(qtype, b, j / 16)] * (float)q[j] + m;
            }
        }
    }
}

/* Row n of W dequantized; packed rows (q8pack.c) are first put back as the file has them. */
static void file_row(int qtype, const uint8_t *w, int64_t n, int64_t K, float *out) {
    const int64_t rbytes = row_bytes(qtype, K);
    if (!is_packed(qtype)) {
        dequant_row(qtype, w + n * rbytes, out, K);
        return;
    }
    uint8_t *row = (uint8_t *)malloc((size_t)rbytes);
    if (row == NULL) abort();
    tq_q8_unpack_row(qtype, w, n, K, row);
    dequant_row(base_type(qtype), row, out, K);
    free(row);
}

/* out [n, K] = the rows ids[0..n) of W, dequantized (an embedding lookup). */
void tq_gather_rows(int qtype, const uint8_t *w, const int64_t *ids, int64_t n, int64_t K, float *out) {
#pragma omp parallel for schedule(static) if (n > 16)
    for (int64_t i = 0; i < n; i++) file_row(qtype, w, ids[i], K, out + i * K);
}

/* out [N, K] = W dequantized. */
void tq_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) file_row(qtype, w, r, K, out + r * K);
}
