/* q8act.c's panel: a group of 8 weight rows unpacked once per call into per-thread gblocks that
 * every tile of activation rows reads (unpack_group; the K-quants' unpack_kgroup). Included once,
 * by q8act.c, after its gblock and lane helpers. */
#ifndef TQ_Q8PANEL_H
#define TQ_Q8PANEL_H

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

#ifdef TQ_AVX2
/* packed Q4 / Q5 group block p's 8 minimum terms: stored (Q4_1 / Q5_1), or -q_bias d (dv: its d) */
static inline __m256 packed_mins(int t, const uint8_t *p, __m256 dv) {
    return stores_min(t) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * GR)))
                         : _mm256_mul_ps(dv, _mm256_set1_ps(-(float)q_bias(t)));
}
#endif

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
        if (packed_type(t) || packed_five(t)) {
            const uint8_t *p = w + b * GR * ub;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
            _mm256_store_ps(g->d, dv);
            _mm256_store_ps(g->m, packed_mins(t, p, dv));
            const __m256i mask = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
            for (int s = 0; s < 4; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + step_offset(t) + 32 * s));
                step[s] = _mm256_and_si256(v, mask);
                step[s + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                if (packed_five(t)) { /* the step's fifth bits (tq_q8_pack's masks) */
                    step[s] = _mm256_or_si256(step[s], _mm256_and_si256(bits_to_bytes(fifth_mask(t, p, s, 0)), sixteen));
                    step[s + 4] = _mm256_or_si256(step[s + 4], _mm256_and_si256(bits_to_bytes(fifth_mask(t, p, s, 1)), sixteen));
                }
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
        if (packed_type(t) || packed_five(t)) {
            const uint8_t *p = w + b * GR * ub, *nib = p + step_offset(t);
            for (int j = 0; j < GR; j++) {
                for (int k = 0; k < QK; k++) {
                    const int s = k % 16 / 4, c = 4 * j + k % 4; /* step s, byte c; k >= 16: the high nibbles */
                    const uint8_t byte = nib[32 * s + c];
                    const uint32_t hb = packed_five(t) ? fifth_mask(t, p, s, k >= 16) : 0;
                    g->q[32 * (k / 4) + c] = (uint8_t)((k < 16 ? byte & 15 : byte >> 4) | (hb >> c & 1u) << 4);
                }
                g->d[j] = half_to_float(p + 2 * j);
                g->m[j] = stores_min(t) ? half_to_float(p + 2 * GR + 2 * j) : -(float)q_bias(t) * g->d[j];
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

#endif
