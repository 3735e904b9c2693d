/* qgemm_avx2.h's block bodies, included by it: half h (columns 8h..8h+7) of a panel's block
 * b for R rows, f[r] += the block's float step. `type` is a constant in every caller
 * (panel_rows_avx2 specialises the loops per type), so each type's branches fold away.
 *
 * Each forms the integers of qgemm.c's portable path its own way: the stored codes are
 * unsigned (vpmaddubsw's unsigned operand), and a code's offset (Q6_K 32, Q3_K 4, Q5_0 16,
 * Q4_0 8) comes off through the rows' sums per 16 or 32 values; IQ4's codes become their
 * signed table values through vpshufb, and Q8_0's are signed, so those multiply as |w|
 * against a with w's sign (exact: |w| <= 128, |a| <= 127, a pair's sum fits in int16).
 * Partial sums stay in int16 only while they provably fit (sum16's caller's count).
 */

/* bit n (0..7) of every byte of hb at bit `to` (2 or 4), the rest zero: a 16-bit shift moves
 * bit n of each byte to bit `to` of the same byte (n < to: left by to - n; else right), and
 * the mask drops whatever comes in from the other byte */
#define BIT_AT(hb, n, to)                                                                      \
    _mm256_and_si256((n) < (to) ? _mm256_slli_epi16(hb, (to) - (n)) : _mm256_srli_epi16(hb, (n) - (to)), \
                     _mm256_set1_epi8(1 << (to)))

/* IQ4's 16 values (signed), in both lanes: vpshufb's table */
AI2 __m256i kvalues_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
}

/* sub-block k's scale of each dword's pair (words: sub-blocks 2p, 2p + 1) in both its words */
AI2 __m256i pair_scale(__m256i pair, int k) {
    return k ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pair, 0xf5), 0xf5)
             : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pair, 0xa0), 0xa0);
}

/* Q4_K's and Q5_K's scales and mins (K6) of sub-blocks 2p and 2p + 1 in columns
 * 8h..8h+7, as the 16-bit pairs of each column's dword (low word: sub-block 2p), from their
 * low nibbles at L->sc and their top bits at L->top */
AI2 void k6_pairs2(const layout_t *L, const uint8_t *blk, const int p, const int h, __m256i *sc,
                   __m256i *mn) {
    const __m256i nib = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + L->sc + 32 * p + 16 * h)));
    __m256i top = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + L->top + 32 * (p / 2) + 16 * h)));
    top = _mm256_srli_epi16(top, 4 * (p % 2)); /* this pair's nibble: sc's top at 0, mn's at 2 */
    *sc = _mm256_or_si256(_mm256_and_si256(nib, _mm256_set1_epi16(0xf)),
                          _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi16(0x3)), 4));
    *mn = _mm256_or_si256(_mm256_srli_epi16(nib, 4),
                          _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi16(0xc)), 2));
}

/* Q3_K's and IQ4_XS's signed 6-bit scales (S6) of sub-blocks 2p and 2p + 1 in columns
 * 8h..8h+7, as the signed 16-bit pairs of each column's dword (low word: sub-block 2p) */
AI2 __m256i s6_pair2(const layout_t *L, const uint8_t *blk, const int p, const int h) {
    __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + L->sc + 32 * (p / 2) + 16 * h)));
    __m256i top = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + L->top + 32 * (p / 4) + 16 * h)));
    low = _mm256_and_si256(_mm256_srli_epi16(low, 4 * (p % 2)), _mm256_set1_epi16(0xf));
    top = _mm256_and_si256(_mm256_srli_epi16(top, 2 * (p % 4)), _mm256_set1_epi16(0x3));
    return _mm256_sub_epi16(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi16(32));
}

/* sum_e sc * (w[e] . a[4e..4e+3]) over n signed w (|w| in u, w's sign given to a) */
AI2 __m256i signed_dot(const __m256i *u, const __m256i *w, const int8_t *a, __m256i sc, int n) {
    __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(u[0], _mm256_sign_epi8(four2(a), w[0])), sc);
    for (int e = 1; e < n; ++e)
        t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(u[e], _mm256_sign_epi8(four2(a + 4 * e), w[e])), sc));
    return t;
}

/* Q4_K, Q5_K and IQ4_XS: 8 sub-blocks of 32 values. Q4_K, Q5_K: unsigned scales, mins
 * times the rows' sums per 32 (Q5_K's fifth bits added to the nibbles); IQ4_XS: signed
 * scales, no mins */
AI2 void k32_half(const int type, const uint8_t *pk, const uint8_t *next, long nb, long b,
                  const acts_t *A, long m0, const int R, int h, __m256 *f) {
    const layout_t *L = &LAYOUTS[type];
    const __m256i low = _mm256_set1_epi8(0xf);
    const uint8_t *blk = pk + b * L->bytes;
    __m256i isum[GROUP2], jsum[GROUP2], mn[4], pair = _mm256_setzero_si256();
    for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        fetch_next_part(next, L->bytes, h * nb + b, j, 8);
        __m256i w[8], u[8], sc;
        for (int l = 0; l < 4; ++l) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + L->lo + 64 * (4 * j + l) + 32 * h));
            w[2 * l] = _mm256_and_si256(v, low);
            w[2 * l + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        if (type == T_Q5_K) {
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + L->hi + 64 * j + 32 * h));
            for (int e = 0; e < 8; ++e) w[e] = _mm256_or_si256(w[e], BIT_AT(hb, e, 4));
        }
        if (type == T_IQ4_XS) {
            const __m256i table = kvalues_table();
            for (int e = 0; e < 8; ++e) {
                w[e] = _mm256_shuffle_epi8(table, w[e]);
                u[e] = _mm256_abs_epi8(w[e]);
            }
            sc = pair_scale(s6_pair2(L, blk, j / 2, h), j % 2);
        } else {
            if (j % 2 == 0) k6_pairs2(L, blk, j / 2, h, &pair, &mn[j / 2]);
            sc = pair_scale(pair, j % 2); /* in both words of a dword */
        }
        for (int r = 0; r < R; ++r) {
            const int8_t *a = A->q + (m0 + r) * A->K + 256 * b + 32 * j;
            __m256i t;
            if (type == T_Q4_K) /* 16 products of 15 x 127 fit in int16 */
                t = R > 2 ? q4_k_row(w, sc, a) : _mm256_madd_epi16(sum16(w, a, 8), sc);
            else if (type == T_Q5_K) /* 8 of 31 x 127 */
                t = R > 2 ? q5_k_row(w, sc, a)
                          : _mm256_add_epi32(_mm256_madd_epi16(sum16(w, a, 4), sc),
                                             _mm256_madd_epi16(sum16(w + 4, a + 16, 4), sc));
            else
                t = signed_dot(u, w, a, sc, 8);
            isum[r] = _mm256_add_epi32(isum[r], t);
        }
    }
    const __m256 d = halfs8(blk + 16 * h);
    if (type == T_IQ4_XS) {
        for (int r = 0; r < R; ++r) {
            __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(s, d), f[r]);
        }
        return;
    }
    const __m256 dmin = halfs8(blk + L->dm + 16 * h);
    for (int p = 0; p < 4; ++p) { /* dword c: the mins of sub-blocks 2p and 2p + 1 */
        for (int r = 0; r < R; ++r) {
            const int16_t *s32 = A->s32 + (m0 + r) * (A->K / 32) + 8 * b + 2 * p;
            jsum[r] = _mm256_add_epi32(jsum[r], _mm256_madd_epi16(mn[p], four2(s32)));
        }
    }
    for (int r = 0; r < R; ++r) {
        __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(s, d), f[r]);
        f[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(jsum[r]), _mm256_mul_ps(s, dmin), f[r]);
    }
}

/* the 4 registers of Q6_K, Q3_K or Q2_K's sub-block j (16 values: 4 of each column a
 * register), unsigned codes */
AI2 void k16_codes(const int type, const layout_t *L, const uint8_t *blk, int h, int j, __m256i *w) {
    const __m256i low = _mm256_set1_epi8(0xf), top = _mm256_set1_epi8(0x30), two = _mm256_set1_epi8(3);
    if (type == T_Q6_K) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + L->lo + 128 * j + 32 * h));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + L->lo + 128 * j + 64 + 32 * h));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + L->hi + 64 * j + 32 * h));
        w[0] = _mm256_or_si256(_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
        w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                               _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
        w[2] = _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_and_si256(hb, top));
        w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
        return;
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + L->lo + 64 * j + 32 * h));
    w[0] = _mm256_and_si256(v, two);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), two);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), two);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), two);
    if (type == T_Q3_K) { /* the third bits: group j / 2, bits 4 (j % 2) + e */
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + L->hi + 64 * (j / 2) + 32 * h));
        const int k = 4 * (j % 2);
        w[0] = _mm256_or_si256(w[0], k ? BIT_AT(hb, 4, 2) : BIT_AT(hb, 0, 2));
        w[1] = _mm256_or_si256(w[1], k ? BIT_AT(hb, 5, 2) : BIT_AT(hb, 1, 2));
        w[2] = _mm256_or_si256(w[2], k ? BIT_AT(hb, 6, 2) : BIT_AT(hb, 2, 2));
        w[3] = _mm256_or_si256(w[3], k ? BIT_AT(hb, 7, 2) : BIT_AT(hb, 3, 2));
    }
}

/* Q6_K, Q3_K and Q2_K: 16 sub-blocks of 16 values. Q6_K, Q3_K: signed scales, values
 * code - 32 (- 4), the offset times the scales times the rows' sums per 16 taken off; Q2_K:
 * 4-bit scales and mins, the mins times the rows' sums per 16 */
AI2 void k16_half(const int type, const uint8_t *pk, const uint8_t *next, long nb, long b,
                  const acts_t *A, long m0, const int R, int h, __m256 *f) {
    const layout_t *L = &LAYOUTS[type];
    const uint8_t *blk = pk + b * L->bytes;
    __m256i isum[GROUP2], jsum[GROUP2];
    for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
        fetch_next_part(next, L->bytes, h * nb + b, p, 8);
        /* dword c: the scales of sub-blocks 2p (low word) and 2p + 1 (high word), and the
         * weights of the rows' sums per 16 (Q6_K, Q3_K: the scales; Q2_K: the mins) */
        const __m128i *raw = (const __m128i *)(blk + L->sc + 32 * p + 16 * h); /* Q2_K, Q6_K */
        __m256i pair, mins;
        if (type == T_Q2_K) {
            const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128(raw));
            pair = _mm256_and_si256(both, _mm256_set1_epi16(0xf));
            mins = _mm256_srli_epi16(both, 4);
        } else if (type == T_Q3_K) {
            pair = mins = s6_pair2(L, blk, p, h);
        } else {
            pair = mins = _mm256_cvtepi8_epi16(_mm_loadu_si128(raw));
        }
        for (int k = 0; k < 2; ++k) {
            const int j = 2 * p + k;
            const __m256i sc = pair_scale(pair, k);
            __m256i w[4];
            k16_codes(type, L, blk, h, j, w);
            for (int r = 0; r < R; ++r) {
                const int8_t *a = A->q + (m0 + r) * A->K + 256 * b + 16 * j;
                __m256i t;
                if (type == T_Q6_K) /* 4 products of 63 x 127 fit in int16 */
                    t = R > 2 ? q6_k_row(w, sc, a)
                              : _mm256_add_epi32(_mm256_madd_epi16(sum16(w, a, 2), sc),
                                                 _mm256_madd_epi16(sum16(w + 2, a + 8, 2), sc));
                else /* 8 of 7 x 127 */
                    t = R > 2 ? k16_row(w, sc, a) : _mm256_madd_epi16(sum16(w, a, 4), sc);
                isum[r] = _mm256_add_epi32(isum[r], t);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int16_t *s16 = A->s16 + (m0 + r) * (A->K / 16) + 16 * b + 2 * p;
            jsum[r] = _mm256_add_epi32(jsum[r], _mm256_madd_epi16(mins, four2(s16)));
        }
    }
    const __m256 d = halfs8(blk + 16 * h);
    for (int r = 0; r < R; ++r) {
        __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
        if (type == T_Q2_K) {
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(s, d), f[r]);
            f[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(jsum[r]), _mm256_mul_ps(s, halfs8(blk + L->dm + 16 * h)), f[r]);
        } else { /* less offset x sum_j sc_j (sum of a over j): 32 = 1 << 5, 4 = 1 << 2 */
            __m256i t = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(jsum[r], type == T_Q6_K ? 5 : 2));
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, d), f[r]);
        }
    }
}

/* 32-value blocks: Q8_0 (signed, stored + 128), IQ4_NL (table values): |w| against a with
 * w's sign; Q5_0, Q4_0: sum of q a less 16 (8) sum a; Q5_1, Q4_1: sum of q a, and their min
 * m times sum a in a second step (the portable path's -J with J = -sum a) */
AI2 void b32_half(const int type, const uint8_t *pk, const uint8_t *next, long nb, long b,
                  const acts_t *A, long m0, const int R, int h, __m256 *f) {
    const layout_t *L = &LAYOUTS[type];
    const __m256i low = _mm256_set1_epi8(0xf), flip = _mm256_set1_epi8((char)0x80);
    const int signed_w = type == T_Q8_0 || type == T_IQ4_NL;
    const uint8_t *blk = pk + b * L->bytes;
    fetch_next(next, L->bytes, h * nb + b);
    __m256i w[8], u[8];
    if (type == T_Q8_0) {
        for (int g = 0; g < 8; ++g)
            w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + L->lo + 64 * g + 32 * h)), flip);
    } else {
        for (int t = 0; t < 4; ++t) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + L->lo + 64 * t + 32 * h));
            w[2 * t] = _mm256_and_si256(v, low);
            w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    }
    if (type == T_Q5_0 || type == T_Q5_1) { /* the fifth bits: bit e / 4 of byte 4c + e % 4 */
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + L->hi + 32 * h));
        for (int e = 0; e < 8; ++e) w[e] = _mm256_or_si256(w[e], BIT_AT(hb, e, 4));
    }
    if (type == T_IQ4_NL)
        for (int e = 0; e < 8; ++e) w[e] = _mm256_shuffle_epi8(kvalues_table(), w[e]);
    if (signed_w)
        for (int e = 0; e < 8; ++e) u[e] = _mm256_abs_epi8(w[e]); /* -128 -> 128, unsigned */
    const __m256 d = halfs8(blk + 16 * h);
    for (int r = 0; r < R; ++r) {
        const int8_t *a = A->q + (m0 + r) * A->K + 32 * b;
        const int32_t sum = A->s32[(m0 + r) * (A->K / 32) + b];
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i t;
        if (signed_w) {
            t = signed_dot(u, w, a, ones, 8);
        } else {
            t = _mm256_add_epi32(_mm256_madd_epi16(sum16(w, a, 4), ones),
                                 _mm256_madd_epi16(sum16(w + 4, a + 16, 4), ones));
            t = _mm256_sub_epi32(t, _mm256_set1_epi32(L->offset * sum));
        }
        __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, d), f[r]);
        if (type == T_Q4_1 || type == T_Q5_1)
            f[r] = _mm256_fmadd_ps(_mm256_set1_ps((float)sum), _mm256_mul_ps(s, halfs8(blk + L->dm + 16 * h)), f[r]);
    }
}

#undef BIT_AT
