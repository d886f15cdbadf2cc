/* q8act.c's register paths: up to a few activation rows read a group's weights straight into
 * 256-bit registers, no panel (the file's Q8_0 rows, packed Q4_0 / Q4_1 / Q8_0, packed Q4_K /
 * Q6_K). The same integers and float order as the panel's tiles, so the same bits. Included once,
 * by q8act.c. */
#ifndef TQ_Q8DIRECT_H
#define TQ_Q8DIRECT_H

#ifdef TQ_AVX2
/* y = acc (+ bias) for NX rows of 8 outputs, `ostride` floats apart: every register path's end */
static inline __attribute__((always_inline)) void store_rows(const __m256 *acc, const int NX, const float *bias,
                                                             float *out, int64_t ostride) {
    for (int i = 0; i < NX; i++) {
        __m256 o = acc[i];
        if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(out + i * ostride, o);
    }
}

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
    store_rows(acc, NX, bias, out, ostride);
}

/* v + 16 in the bytes whose bit is set in m (packed Q5_0 / Q5_1's fifth bits for one step) */
static inline __m256i add_fifth(__m256i v, uint32_t m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(v, (__mmask32)m, v, _mm256_set1_epi8(16));
#else
    return _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(m), _mm256_set1_epi8(16)));
#endif
}

/* Step s of a packed Q4 / Q5 group's block at p: the low nibbles (k = 4s..) in *lo, the high ones
 * (k = 16 + 4s..) in *hi, unsigned bytes, Q5's fifth bits added from the step's masks */
static inline __attribute__((always_inline)) void packed_nibbles(int t, const uint8_t *p, int s, __m256i *lo, __m256i *hi) {
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + step_offset(t) + 32 * s));
    *lo = _mm256_and_si256(v, mask), *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    if (packed_five(t)) *lo = add_fifth(*lo, fifth_mask(t, p, s, 0)), *hi = add_fifth(*hi, fifth_mask(t, p, s, 1));
}

#ifdef TQ_ZMM
/* One step of split 16-bit activations: *ph += u times the 4 high bytes at hq (int8, the signed
 * operand), *pl += the 4 low bytes at lq (0..255, the unsigned operand) times s */
static inline __attribute__((always_inline)) void split_step(__m256i *ph, __m256i *pl, __m256i u, __m256i s,
                                                             const int8_t *hq, const uint8_t *lq) {
    int32_t h, l;
    memcpy(&h, hq, 4), memcpy(&l, lq, 4);
    *ph = _mm256_dpbusd_epi32(*ph, u, _mm256_set1_epi32(h));
    *pl = _mm256_dpbusd_epi32(*pl, _mm256_set1_epi32(l), s);
}

/* packed_direct for split 16-bit activations (x.l; the zmm builds' VNNI): each step's weight bytes
 * times the high bytes (int8, as the 8-bit path; Q8_0's q + 128 from -128 times their sum, as the strips:
 * hi reaches -128, which the sign trick cannot flip) and, as the unsigned operand, the low bytes
 * times the weights (nibbles, or Q8_0's int8) -- isum = 256 hi + lo, the exact block dot of the 16-bit
 * values (|isum| < 2^28) -- then the 8-bit path's float operations, so strip_direct's bits. */
static inline __attribute__((always_inline)) void packed_split(const int t, const uint8_t *w, int64_t nb,
                                                               tq_q8acts x, int64_t K, const int NX,
                                                               const float *bias, float *out, int64_t ostride) {
    const int q8 = packed_q8_0(t), ub = unit_bytes(t), sb = step_offset(t);
    const uint8_t *next = w + GR * nb * ub;
    __m256 acc[MRG];
    for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * GR * ub;
        prefetch_block(next, b, ub);
        __m256i ph[MRG], pl[MRG], ph2[MRG], pl2[MRG]; /* the nibbles' sums in separate chains, joined per block */
        for (int i = 0; i < NX; i++) ph2[i] = pl2[i] = _mm256_setzero_si256();
        for (int i = 0; i < NX; i++) /* Q8_0: hi reaches -128, which q's sign cannot flip: q + 128 from -128 sum(hi) */
            ph[i] = q8 ? _mm256_set1_epi32(-128 * q8_block_sum(x, i * nb + b)) : _mm256_setzero_si256(), pl[i] = _mm256_setzero_si256();
        for (int s = 0; s < 8 * q8; s++) { /* Q8_0: (q + 128) times hi; lo times q */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(p + sb + 32 * s));
            const __m256i qu = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
            for (int i = 0; i < NX; i++) split_step(&ph[i], &pl[i], qu, q, x.q + i * K + b * QK + 4 * s, x.l + i * K + b * QK + 4 * s);
        }
        for (int s = 0; s < 4 * !q8; s++) {
            __m256i lo, hi;
            packed_nibbles(t, p, s, &lo, &hi);
            for (int i = 0; i < NX; i++) {
                const int64_t e = i * K + b * QK + 4 * s;
                split_step(&ph[i], &pl[i], lo, lo, x.q + e, x.l + e);
                split_step(&ph2[i], &pl2[i], hi, hi, x.q + e + 16, x.l + e + 16);
            }
        }
        for (int i = 0; i < NX; i++) ph[i] = _mm256_add_epi32(ph[i], ph2[i]), pl[i] = _mm256_add_epi32(pl[i], pl2[i]);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mv = packed_mins(t, p, dv);
        for (int i = 0; i < NX; i++) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ph[i], 8), pl[i]));
            acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_broadcast_ss(x.d + i * nb + b)), acc[i]);
            if (!q8) acc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(x.s + i * nb + b), acc[i]);
        }
    }
    store_rows(acc, NX, bias, out, ostride);
}
#endif

/* Packed Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, NX (<= MRG) activation rows: a group's steps straight
 * from the packed block into registers, no panel; the same integers and float operations as
 * group_tile, so the same bits (Q8_0: its 8 steps as stored, |q| times x with q's sign, widened per
 * step; Q5_0 / Q5_1: each step's fifth bits added from its mask, and the low and high halves'
 * int16 sums widened apart, as the panel's 5-bit steps are). */
static inline __attribute__((always_inline)) void packed_direct(const int t, const uint8_t *w, int64_t nb,
                                                                tq_q8acts x, int64_t K, const int NX,
                                                                const float *bias, float *out, int64_t ostride) {
#ifdef TQ_ZMM
    if (x.l) {
        packed_split(t, w, nb, x, K, NX, bias, out, ostride);
        return;
    }
#endif
    const int q8 = packed_q8_0(t), five = packed_five(t), ub = unit_bytes(t), sb = step_offset(t);
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
            __m256i lo, hi;
            packed_nibbles(t, p, s, &lo, &hi);
            for (int i = 0; i < NX; i++) {
                const int8_t *xb = x.q + i * K + b * QK;
                int32_t xl, xh;
                memcpy(&xl, xb + 4 * s, 4);
                memcpy(&xh, xb + 16 + 4 * s, 4);
                p16[i] = step16(p16[i], lo, _mm256_set1_epi32(xl));
                ph[i] = step16(ph[i], hi, _mm256_set1_epi32(xh));
            }
        }
        for (int i = 0; i < NX; i++) /* Q4: both halves < 16384 in int16; 5-bit halves reach 31496 */
            p16[i] = q8 ? p16[i] : five ? _mm256_add_epi32(widen16(p16[i]), widen16(ph[i])) : widen16(join16(p16[i], ph[i]));
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mv = packed_mins(t, p, dv);
        for (int i = 0; i < NX; i++) {
            const __m256 isum = _mm256_cvtepi32_ps(p16[i]);
            acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_broadcast_ss(x.d + i * nb + b)), acc[i]);
            if (!q8) acc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(x.s + i * nb + b), acc[i]);
        }
    }
    store_rows(acc, NX, bias, out, ostride);
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
#ifdef TQ_ZMM
                if (x.l) { /* split 16-bit activations: each block's hi and lo dots, isum = 256 hi + lo */
                    __m256i lol[MRG], hil[MRG];
                    for (int i = 0; i < NX; i++) lol[i] = hil[i] = _mm256_setzero_si256();
                    for (int s = 0; s < 8; s++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * (4 + 8 * r + s)));
                        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                        for (int i = 0; i < NX; i++) {
                            const int64_t e = i * K + b * QK + 4 * s;
                            split_step(&lo16[i], &lol[i], lo, lo, x.q + e, x.l + e);
                            split_step(&hi16[i], &hil[i], hi, hi, x.q + e + QK, x.l + e + QK);
                        }
                    }
                    for (int i = 0; i < NX; i++) {
                        lo16[i] = _mm256_add_epi32(_mm256_slli_epi32(lo16[i], 8), lol[i]);
                        hi16[i] = _mm256_add_epi32(_mm256_slli_epi32(hi16[i], 8), hil[i]);
                    }
                } else
#endif
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
    store_rows(acc, NX, bias, out, ostride);
}

#endif

#endif
