/* qgemm.c's AVX-512 path (AVX512F + BW + VL + VNNI), included by qgemm.c.
 *
 * Same numbers, fewer instructions: for each row, column and block it forms the SAME exact
 * integers as qgemm.c's portable path (panel_row) and applies the same float steps in the
 * same order, so the two paths give one answer, and a row's answer depends on that row
 * alone, whatever rows share its call and however they are grouped below.
 *
 * What makes it fast: a panel holds 16 columns side by side, so a 512-bit register is
 * 4 values of each of the 16 columns, and one vpdpbusd against 4 activations broadcast from
 * memory adds 16 columns' 4-product sums. A sub-block's integer sums are scaled once per
 * 16 columns (vpmulld), the mins and offsets come from the rows' sums per 16 or 32 values
 * (vpdpwssd), and the float step is one FMA per 16 columns.
 *
 * Rows: a verification pass's rows should cost their products and no more. A call's rows go
 * in groups of up to GROUP that share each decoded sub-block, the group's product chains
 * interleaved and its integer sums in registers for a block. Up to 4 rows are one group
 * walking the panel, their float accumulators in registers (plain decoding's one-row call).
 * From 5 rows of 256-value blocks the panel is walked once, block by block: every group runs
 * against a block while the next block is asked of memory a slice per sub-block, and a later
 * group decodes the block again from L1. (A walk of the whole panel per group had each group
 * past the first wait on memory again.) Rows of 32-value blocks go in groups of up to 4, each
 * walking the panel (panel_walks).
 *
 * How a block type plugs in: a function
 *     AI void <type>_block(blk, next, b, A, m0, const int R, __m512 *f)
 * that adds block b (the panel-block at blk) of rows m0 .. m0 + R - 1 (R <= GROUP, a
 * constant where inlined) to their float accumulators f[0 .. R-1], asking for `next` (unless
 * NULL) a slice per sub-block (fetch_part); a line in block_rows and in panel_rows512; its
 * panel_bytes and block_size in qgemm.c. In it, for each sub-block:
 *  - decode: its values as unsigned int8 lanes, w[e] = values 4e .. 4e + 3 of the 16 columns
 *    (byte 4c + i: column c's), from the panel-block in L1;
 *  - the integer scale step: dots(w, ..., R, &scales, isum) adds each row's dot product times
 *    the sub-block's integer scales (one vpmulld) to the row's int32 sum; offsets or mins
 *    times the rows' sums (A->s16, A->s32) go into the same or another integer sum
 *    (vpdpwssd): integers are exact, so their grouping is free;
 * then, per row, the float step exactly as panel_row takes it: float(the integer sum) times
 * the row's block scale s times the column's d (and dmin), fused multiply-adds in panel_row's
 * order. */
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

#define CHAINS 2 /* a lone row's product chains (n, 4 or 8, a multiple) */
#define GROUP 8 /* rows whose integer sums stay in registers over a decoded sub-block */

/* quantize_row, 16 values a step: the same float operations on each value (|x|, the block's
 * max, x * inv rounded in the current mode, clamped to +-127, truncated to int8), so the same
 * ints, scales and sums. max_ps and min_ps return their second operand when either is NaN:
 * a NaN x is skipped by the max as fmaxf skips it, and stays NaN through the clamp. */
static void quantize_row512(const float *x, long K, int block, int8_t *q, float *scale,
                            int16_t *bsum) {
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (long b = 0; b < K / block; ++b) {
        const float *xb = x + b * block;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < block; i += 16)
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), m);
        float amax = _mm512_reduce_max_ps(m);
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scale[b] = amax / 127.0f;
        __m512 vinv = _mm512_set1_ps(inv);
        for (int i = 0; i < block; i += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv),
                                            _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
            v = _mm512_max_ps(lo, _mm512_min_ps(hi, v));
            __m512i n = _mm512_cvttps_epi32(v);
            _mm_storeu_si128((__m128i *)(q + b * block + i), _mm512_cvtepi32_epi8(n));
            bsum[(b * block + i) / 16] = (int16_t)_mm512_reduce_add_epi32(n);
        }
    }
}


/* Ask for every cache line of the panel-block about to be read, before any of its loads:
 * its three or four streams' misses then overlap, where the loads alone, in program
 * order, left one thread at half the memory's bandwidth (for one row, fetching further
 * ahead measured slower) */
AI void fetch_block(const uint8_t *blk, const long bytes) {
    for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(blk + o), _MM_HINT_T0);
}

/* Ask for lines [part, part + 1) * lines / parts of a panel-block (the next one, a slice per
 * sub-block) */
AI void fetch_part(const uint8_t *blk, const long bytes, const int part, const int parts) {
    const long lines = (bytes + 63) / 64;
    for (long l = lines * part / parts; l < lines * (part + 1) / parts; ++l)
        _mm_prefetch((const char *)(blk + 64 * l), _MM_HINT_T0);
}

/* 4 int8 activations at p, in every dword (vpdpbusd's broadcast operand) */
AI __m512i four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* For R rows r: into[r] += (sum_e w[e] . a[r * stride + 4e .. 4e + 3]) * scale (none when
 * NULL), 16 dwords, exact. The rows' product chains are interleaved instruction by
 * instruction, so R of them are in flight whatever the reorder window holds. */
AI void dots(const __m512i *w, const int n, const int8_t *a, const long stride, const int R,
             const __m512i *scale, __m512i *into) {
    if (R == 1) { /* one row: CHAINS chains (e mod CHAINS), or it waits on vpdpbusd's latency */
        __m512i part[CHAINS];
        for (int c = 0; c < CHAINS; ++c)
            part[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], four(a + 4 * c));
        for (int e = CHAINS; e < n; ++e)
            part[e % CHAINS] = _mm512_dpbusd_epi32(part[e % CHAINS], w[e], four(a + 4 * e));
        __m512i acc = part[0];
        for (int c = 1; c < CHAINS; ++c) acc = _mm512_add_epi32(acc, part[c]);
        into[0] = _mm512_add_epi32(into[0], scale ? _mm512_mullo_epi32(acc, *scale) : acc);
        return;
    }
    __m512i acc[GROUP];
    for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], four(a + r * stride));
    for (int e = 1; e < n; ++e)
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_dpbusd_epi32(acc[r], w[e], four(a + r * stride + 4 * e));
    for (int r = 0; r < R; ++r)
        into[r] = _mm512_add_epi32(into[r], scale ? _mm512_mullo_epi32(acc[r], *scale) : acc[r]);
}

/* bit e of each byte of hb, at bit 4 (Q5_K's fifth bit of the e-th register's values) */
AI __m512i fifth_bit(__m512i hb, const int e) {
    const __m512i at4 = _mm512_set1_epi8(0x10);
    __m512i moved = e < 4 ? _mm512_slli_epi16(hb, 4 - e) : _mm512_srli_epi16(hb, e - 4);
    return _mm512_and_si512(moved, at4); /* a 16-bit shift: bit 4 of each byte is its own */
}

/* Q4_K's and Q5_K's scales and mins (K6) of sub-blocks 2p and 2p + 1, as the 16-bit pairs of
 * each column's dword (low word: sub-block 2p), from their low nibbles at L->sc and their
 * top bits at L->top */
AI void k6_pairs(const layout_t *L, const uint8_t *blk, const int p, __m512i *sc, __m512i *mn) {
    const __m512i nib = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + L->sc + 32 * p)));
    __m512i top = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + L->top + 32 * (p / 2))));
    top = _mm512_srli_epi16(top, 4 * (p % 2)); /* this pair's nibble: sc's top at 0, mn's at 2 */
    *sc = _mm512_or_si512(_mm512_and_si512(nib, _mm512_set1_epi16(0xf)),
                          _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi16(0x3)), 4));
    *mn = _mm512_or_si512(_mm512_srli_epi16(nib, 4),
                          _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi16(0xc)), 2));
}

/* Q3_K's and IQ4_XS's signed 6-bit scales (S6) of sub-blocks 2p and 2p + 1, as the signed
 * 16-bit pairs of each column's dword (low word: sub-block 2p) */
AI __m512i s6_pair(const layout_t *L, const uint8_t *blk, const int p) {
    __m512i low = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + L->sc + 32 * (p / 2))));
    __m512i top = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + L->top + 32 * (p / 4))));
    low = _mm512_and_si512(_mm512_srli_epi16(low, 4 * (p % 2)), _mm512_set1_epi16(0xf));
    top = _mm512_and_si512(_mm512_srli_epi16(top, 2 * (p % 4)), _mm512_set1_epi16(0x3));
    return _mm512_sub_epi16(_mm512_or_si512(low, _mm512_slli_epi16(top, 4)), _mm512_set1_epi16(32));
}

/* Q4_K and Q5_K (five = 0, 1): 8 sub-blocks of 32 values, unsigned 6-bit scales and mins
 * (jsum: the mins times the rows' sums per 32 values); Q5_K's fifth bits join the nibbles */
AI void q4_k_block(const int five, const uint8_t *blk, const uint8_t *next, long b,
                   const acts_t *A, long m0, const int R, __m512 *f) {
    const layout_t *L = &LAYOUTS[five ? T_Q5_K : T_Q4_K];
    const __m512i low = _mm512_set1_epi8(0xf);
    __m512i isum[GROUP], mn[4], pair = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
        if (next) fetch_part(next, L->bytes, j, 8);
        __m512i w[8];
        for (int l = 0; l < 4; ++l) {
            __m512i v = _mm512_loadu_si512((const void *)(blk + L->lo + 64 * (4 * j + l)));
            w[2 * l] = _mm512_and_si512(v, low);
            w[2 * l + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if (five) { /* value 32j + 4e + i's fifth bit: bit e of its column's byte */
            const __m512i hb = _mm512_loadu_si512((const void *)(blk + L->hi + 64 * j));
            for (int e = 0; e < 8; ++e) w[e] = _mm512_or_si512(w[e], fifth_bit(hb, e));
        }
        if (j % 2 == 0) k6_pairs(L, blk, j / 2, &pair, &mn[j / 2]);
        __m512i sc = j % 2 ? _mm512_srli_epi32(pair, 16) : _mm512_and_si512(pair, _mm512_set1_epi32(0xffff));
        dots(w, 8, A->q + m0 * A->K + 256 * b + 32 * j, A->K, R, &sc, isum);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + L->dm)));
    for (int r = 0; r < R; ++r) {
        const int16_t *s32 = A->s32 + (m0 + r) * (A->K / 32) + 8 * b;
        __m512i jsum = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) /* dword c: the mins of sub-blocks 2p and 2p + 1 */
            jsum = _mm512_dpwssd_epi32(jsum, mn[p], four((const int8_t *)(s32 + 2 * p)));
        const __m512 s = _mm512_set1_ps(A->s[(m0 + r) * A->nb + b]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);
        f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum), _mm512_mul_ps(s, dmin), f[r]);
    }
}

/* each byte: bits 0-3 of lo, bits 4-7 of hi (one vpternlogd: c ? a : b with c = 0x0f) */
AI __m512i select_low(__m512i lo, __m512i hi) {
    return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0xf), 0xe4);
}

/* bit e of each byte of hb, at bit 2 (Q3_K's third bit); the byte's other bits zero */
AI __m512i third_bit(__m512i hb, const int e) {
    __m512i moved = e < 2 ? _mm512_slli_epi16(hb, 2 - e) : _mm512_srli_epi16(hb, e - 2);
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x4)); /* bit 2 of each byte: its own */
}

/* Q6_K and Q3_K (three = 0, 1): 16 sub-blocks of 16 values, signed scales, values q - 32
 * (q - 4): the integer sum is isum - 32 * jsum (4 * jsum; jsum: the scales times the rows'
 * sums per 16 values), formed as one sum, its -32 (-4) * scale * sum terms added by
 * vpdpwssd (for one row, jsum apart) */
AI void k16_block(const int three, const uint8_t *blk, const uint8_t *next, long b,
                  const acts_t *A, long m0, const int R, __m512 *f) {
    const layout_t *L = &LAYOUTS[three ? T_Q3_K : T_Q6_K];
    const __m512i m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8((char)0xcc);
    const int shift = three ? 2 : 5; /* the offset, 4 or 32, as a shift */
    __m512i isum[GROUP], jsum = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
        /* dword c: the scales of sub-blocks 2p (low word) and 2p + 1 (high word) */
        __m512i pair = three ? s6_pair(L, blk, p)
                             : _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + L->sc + 32 * p)));
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * p + h;
            if (next) fetch_part(next, L->bytes, j, 16);
            __m512i sc = h ? _mm512_srai_epi32(pair, 16)
                           : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
            if (three) { /* the low 2 bits at 2e; the third bits: group j / 2, bit 4h + e */
                __m512i v = _mm512_loadu_si512((const void *)(blk + L->lo + 64 * j));
                __m512i hb = _mm512_loadu_si512((const void *)(blk + L->hi + 64 * p));
                __m512i w[4];
                for (int e = 0; e < 4; ++e)
                    w[e] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 2 * e),
                                                            _mm512_set1_epi8(3)),
                                           third_bit(hb, 4 * h + e));
                dots(w, 4, A->q + m0 * A->K + 256 * b + 16 * j, A->K, R, &sc, isum);
                continue;
            }
            __m512i v0 = _mm512_loadu_si512((const void *)(blk + L->lo + 128 * j));
            __m512i v1 = _mm512_loadu_si512((const void *)(blk + L->lo + 128 * j + 64));
            __m512i hb = _mm512_loadu_si512((const void *)(blk + L->hi + 64 * j));
            /* each byte: bits 0-3 from the low nibbles, 4-5 from the top bits, 6-7 zero; hb's
             * bits 0-1, 4-5 and 2-3, 6-7 apart, so every shift below brings only zeros or
             * bits that the select drops (bits 0-3) next to the wanted two */
            __m512i h_lo = _mm512_and_si512(hb, m33), h_hi = _mm512_and_si512(hb, mcc);
            __m512i w[4] = {select_low(v0, _mm512_slli_epi16(h_lo, 4)),
                            select_low(_mm512_srli_epi16(v0, 4), _mm512_slli_epi16(h_hi, 2)),
                            select_low(v1, h_lo),
                            select_low(_mm512_srli_epi16(v1, 4), _mm512_srli_epi16(h_hi, 2))};
            dots(w, 4, A->q + m0 * A->K + 256 * b + 16 * j, A->K, R, &sc, isum);
        }
        const int16_t *s16 = A->s16 + m0 * (A->K / 16) + 16 * b + 2 * p;
        if (R == 1) { /* a sum of its own, off the row's chain: one row measured faster so */
            jsum = _mm512_dpwssd_epi32(jsum, pair, four((const int8_t *)s16));
            continue;
        }
        /* -32 (-4) x the scales: |value| <= 4096, an int16 */
        const __m512i minus =
            _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(pair, shift));
        for (int r = 0; r < R; ++r)
            isum[r] = _mm512_dpwssd_epi32(isum[r], minus,
                                          four((const int8_t *)(s16 + r * (A->K / 16))));
    }
    if (R == 1) isum[0] = _mm512_sub_epi32(isum[0], _mm512_slli_epi32(jsum, shift));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(A->s[(m0 + r) * A->nb + b]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);
    }
}

/* Q2_K: 16 sub-blocks of 16 values, 2-bit codes, 4-bit scales and mins (a pair of
 * sub-blocks' in one 16-bit word, scale low nibble, min high): isum the scales times the
 * rows' sub-block products, jsum the mins times the rows' sums per 16 values */
AI void q2_k_block(const uint8_t *blk, const uint8_t *next, long b, const acts_t *A, long m0,
                   const int R, __m512 *f) {
    const __m512i two = _mm512_set1_epi8(3), nibble = _mm512_set1_epi16(0xf);
    __m512i isum[GROUP], jsum[GROUP];
    for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
        /* dword c: sub-blocks 2p (low word) and 2p + 1 (high word) of column c */
        const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * p)));
        const __m512i pair = _mm512_and_si512(both, nibble), mins = _mm512_srli_epi16(both, 4);
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * p + h;
            if (next) fetch_part(next, 1344, j, 16);
            __m512i sc = h ? _mm512_srli_epi32(pair, 16) : _mm512_and_si512(pair, _mm512_set1_epi32(0xf));
            __m512i v = _mm512_loadu_si512((const void *)(blk + 320 + 64 * j)), w[4];
            for (int e = 0; e < 4; ++e) w[e] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * e), two);
            dots(w, 4, A->q + m0 * A->K + 256 * b + 16 * j, A->K, R, &sc, isum);
        }
        const int16_t *s16 = A->s16 + m0 * (A->K / 16) + 16 * b + 2 * p;
        for (int r = 0; r < R; ++r)
            jsum[r] = _mm512_dpwssd_epi32(jsum[r], mins, four((const int8_t *)(s16 + r * (A->K / 16))));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(A->s[(m0 + r) * A->nb + b]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);
        f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum[r]), _mm512_mul_ps(s, dmin), f[r]);
    }
}

/* IQ4's 16 values + 128 (unsigned for vpdpbusd; KVALUES with the sign bit flipped), in
 * every 128-bit lane: vpshufb's table */
AI __m512i iq4_table(void) {
    __m128i kv = _mm_loadu_si128((const __m128i *)KVALUES);
    return _mm512_broadcast_i32x4(_mm_xor_si128(kv, _mm_set1_epi8((char)0x80)));
}

/* the codes of 64-byte group g of a panel-block's 4-bit pairs at lo, as IQ4's table values
 * + 128: into[0] the low nibbles', into[1] the high ones' */
AI void iq4_pair(const uint8_t *lo, const int g, const __m512i table, __m512i *into) {
    const __m512i low = _mm512_set1_epi8(0xf);
    __m512i v = _mm512_loadu_si512((const void *)(lo + 64 * g));
    into[0] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
    into[1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
}

/* IQ4_XS: 8 sub-blocks of 32 values, signed scales, no mins; the values are taken + 128, so
 * the integer sum is formed as isum - 128 * jsum (jsum: the scales times the rows' sums per
 * 32 values), its -128 * scale * sum terms added by vpdpwssd */
AI void iq4_xs_block(const uint8_t *blk, const uint8_t *next, long b, const acts_t *A, long m0,
                     const int R, __m512 *f) {
    const layout_t *L = &LAYOUTS[T_IQ4_XS];
    const __m512i table = iq4_table();
    __m512i isum[GROUP];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
        /* dword c: the scales of sub-blocks 2p (low word) and 2p + 1 (high word) */
        __m512i pair = s6_pair(L, blk, p);
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * p + h;
            if (next) fetch_part(next, L->bytes, j, 8);
            __m512i sc = h ? _mm512_srai_epi32(pair, 16)
                           : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
            __m512i w[8];
            for (int l = 0; l < 4; ++l) iq4_pair(blk + L->lo, 4 * j + l, table, w + 2 * l);
            dots(w, 8, A->q + m0 * A->K + 256 * b + 32 * j, A->K, R, &sc, isum);
        }
        /* -128 x the scales (|scale| <= 32): |value| <= 4096, an int16 */
        const __m512i minus128 =
            _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(pair, 7));
        const int16_t *s32 = A->s32 + m0 * (A->K / 32) + 8 * b + 2 * p;
        for (int r = 0; r < R; ++r)
            isum[r] = _mm512_dpwssd_epi32(isum[r], minus128,
                                          four((const int8_t *)(s32 + r * (A->K / 32))));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(A->s[(m0 + r) * A->nb + b]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);
    }
}

/* Q8_0 (values stored + 128), IQ4_NL (its table's values + 128), Q5_0 and Q5_1 (q, 0..31),
 * Q4_0 and Q4_1 (q, 0..15): 32-value blocks, the offset times the rows' sums per block taken
 * off the integer sum; Q4_1's and Q5_1's min m times the rows' sum a second float step */
AI void b32_block(const int type, const uint8_t *blk, const uint8_t *next, long b,
                  const acts_t *A, long m0, const int R, __m512 *f) {
    if (next) fetch_block(next, panel_bytes(type));
    const __m512i low = _mm512_set1_epi8(0xf), fifth = _mm512_set1_epi8(0x10);
    const int q8 = type == T_Q8_0;
    __m512i w[8];
    if (q8) {
        for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512((const void *)(blk + 32 + 64 * g));
    } else if (type == T_IQ4_NL) {
        const __m512i table = iq4_table();
        for (int t = 0; t < 4; ++t) iq4_pair(blk + 32, t, table, w + 2 * t);
    } else if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_1) {
        const uint8_t *lo = blk + LAYOUTS[type].lo;
        for (int t = 0; t < 4; ++t) {
            __m512i v = _mm512_loadu_si512((const void *)(lo + 64 * t));
            w[2 * t] = _mm512_and_si512(v, low);
            w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if (type == T_Q5_1) { /* value 4e + i's fifth bit: bit e of its column's byte */
            const __m512i hb = _mm512_loadu_si512((const void *)(blk + LAYOUTS[type].hi));
            for (int e = 0; e < 8; ++e) w[e] = _mm512_or_si512(w[e], fifth_bit(hb, e));
        }
    } else {
        for (int t = 0; t < 4; ++t) {
            __m512i v = _mm512_loadu_si512((const void *)(blk + 32 + 64 * t));
            __mmask64 k0, k1;
            memcpy(&k0, blk + 288 + 16 * t, 8);
            memcpy(&k1, blk + 288 + 16 * t + 8, 8);
            w[2 * t] = _mm512_mask_mov_epi8(_mm512_and_si512(v, low), k0,
                                            _mm512_or_si512(_mm512_and_si512(v, low), fifth));
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            w[2 * t + 1] = _mm512_mask_mov_epi8(hi, k1, _mm512_or_si512(hi, fifth));
        }
    }
    __m512i isum[GROUP];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    dots(w, 8, A->q + m0 * A->K + 32 * b, A->K, R, NULL, isum);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const int32_t unit = q8 || type == T_IQ4_NL ? 128 : LAYOUTS[type].offset;
    const int with_min = type == T_Q4_1 || type == T_Q5_1;
    const __m512 m = with_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + LAYOUTS[type].dm)))
                              : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        const int32_t sum = A->s32[(m0 + r) * (A->K / 32) + b];
        __m512i t = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(unit * sum));
        __m512 s = _mm512_set1_ps(A->s[(m0 + r) * A->nb + b]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, d), f[r]);
        if (with_min) f[r] = _mm512_fmadd_ps(_mm512_set1_ps((float)sum), _mm512_mul_ps(s, m), f[r]);
    }
}

/* Block b (a panel-block at blk) of rows m0 .. m0 + R - 1, R <= GROUP, into f[0 .. R-1];
 * next: the panel-block to ask of memory meanwhile, a slice per sub-block (or NULL) */
AI void block_rows(const int type, const uint8_t *blk, const uint8_t *next, long b,
                   const acts_t *A, long m0, const int R, __m512 *f) {
    if (type == T_Q4_K || type == T_Q5_K)
        q4_k_block(type == T_Q5_K, blk, next, b, A, m0, R, f);
    else if (type == T_Q6_K || type == T_Q3_K)
        k16_block(type == T_Q3_K, blk, next, b, A, m0, R, f);
    else if (type == T_IQ4_XS)
        iq4_xs_block(blk, next, b, A, m0, R, f);
    else if (type == T_Q2_K)
        q2_k_block(blk, next, b, A, m0, R, f);
    else
        b32_block(type, blk, next, b, A, m0, R, f);
}

/* y[r * ldy + c] = f[r] + bias[c] for R rows, columns < cols */
AI void store_rows(const __m512 *f, const long R, const float *bias, float *y, long ldy,
                   long cols) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (long r = 0; r < R; ++r) {
        __m512 v = bias ? _mm512_add_ps(f[r], add) : f[r];
        _mm512_mask_storeu_ps(y + r * ldy, keep, v);
    }
}

/* R <= GROUP rows of one panel, block after block, their float accumulators in registers */
AI void panel_group(const int type, const uint8_t *pk, const acts_t *A, long m0, const int R,
                    const float *bias, float *y, long ldy, long cols) {
    const long pb = panel_bytes(type);
    __m512 f[GROUP];
    for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
    /* the next panel-block is asked for while this one is worked on where the rows' work on
     * a block outlasts its fetch (4 rows of Q6_K; Q4_K from 5, in panel_groups); fewer rows
     * wait on memory either way, and asking ahead measured slower for them */
    const int ahead = type == T_Q6_K && R >= 4;
    for (long b = 0; b < A->nb; ++b) {
        const uint8_t *blk = pk + b * pb;
        if (!ahead || b == 0) fetch_block(blk, pb);
        block_rows(type, blk, ahead ? blk + pb : NULL, b, A, m0, R, f);
    }
    store_rows(f, R, bias, y, ldy, cols);
}

/* 5 .. ROW_TILE rows of one panel of 256-value blocks: each block once, its rows in
 * ceil(rows / GROUP) groups of nearly equal sizes (4 .. GROUP, so each group keeps 4 or more
 * product chains in flight), their float accumulators in L1; the first group asks for the
 * next panel-block meanwhile */
AI void panel_groups(const int type, const uint8_t *pk, const acts_t *A, long m0, long rows,
                     const float *bias, float *y, long ldy, long cols) {
    const long pb = panel_bytes(type), groups = (rows + GROUP - 1) / GROUP;
    __m512 f[ROW_TILE];
    for (long r = 0; r < rows; ++r) f[r] = _mm512_setzero_ps();
    for (long b = 0; b < A->nb; ++b) {
        const uint8_t *blk = pk + b * pb, *next = blk + pb;
        if (b == 0) fetch_block(blk, pb);
        for (long g = 0, r = 0; g < groups; r += rows / groups + (g < rows % groups), ++g) {
            switch (rows / groups + (g < rows % groups)) {
            case 4: block_rows(type, blk, next, b, A, m0 + r, 4, f + r); break;
            case 5: block_rows(type, blk, next, b, A, m0 + r, 5, f + r); break;
            case 6: block_rows(type, blk, next, b, A, m0 + r, 6, f + r); break;
            case 7: block_rows(type, blk, next, b, A, m0 + r, 7, f + r); break;
            default: block_rows(type, blk, next, b, A, m0 + r, GROUP, f + r); break;
            }
            next = NULL;
        }
    }
    store_rows(f, rows, bias, y, ldy, cols);
}

/* 5 .. ROW_TILE rows of one panel of 32-value blocks: groups of 2 .. 4 rows, each walking
 * the panel with its accumulators in registers (the later ones from cache). A 32-value
 * block's float step is a large share of its rows' work: kept in registers, measured faster
 * than panel_groups' one walk. Not Q5_1: its fifth bits make decoding the larger share, and
 * panel_groups, decoding a block once for up to GROUP rows, measured faster (8 rows: 0.92x
 * the AVX2 body's time, where walks took 1.21x) */
AI void panel_walks(const int type, const uint8_t *pk, const acts_t *A, long m0, long rows,
                    const float *bias, float *y, long ldy, long cols) {
    const long groups = (rows + 3) / 4;
    for (long g = 0, r = 0; g < groups; r += rows / groups + (g < rows % groups), ++g) {
        switch (rows / groups + (g < rows % groups)) {
        case 2: panel_group(type, pk, A, m0 + r, 2, bias, y + r * ldy, ldy, cols); break;
        case 3: panel_group(type, pk, A, m0 + r, 3, bias, y + r * ldy, ldy, cols); break;
        default: panel_group(type, pk, A, m0 + r, 4, bias, y + r * ldy, ldy, cols); break;
        }
    }
}

/* One panel of `type` (a constant where inlined) */
AI void panel_of(const int type, const uint8_t *pk, const acts_t *A, long m0, long rows,
                 const float *bias, float *y, long ldy, long cols) {
    switch (rows) {
    case 1: panel_group(type, pk, A, m0, 1, bias, y, ldy, cols); break;
    case 2: panel_group(type, pk, A, m0, 2, bias, y, ldy, cols); break;
    case 3: panel_group(type, pk, A, m0, 3, bias, y, ldy, cols); break;
    case 4: panel_group(type, pk, A, m0, 4, bias, y, ldy, cols); break;
    default:
        if (block_size(type) == 256 || type == T_Q5_1)
            panel_groups(type, pk, A, m0, rows, bias, y, ldy, cols);
        else
            panel_walks(type, pk, A, m0, rows, bias, y, ldy, cols);
    }
}

/* Rows m0..m0+rows-1 (1 .. ROW_TILE) of one panel: y[r * ldy + c] = the rows' sums + bias,
 * columns < cols (one specialised copy per type and group size) */
static void panel_rows512(int type, const uint8_t *pk, const acts_t *A, long m0, long rows,
                          const float *bias, float *y, long ldy, long cols) {
    switch (type) {
    case T_Q4_K: panel_of(T_Q4_K, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q5_K: panel_of(T_Q5_K, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q6_K: panel_of(T_Q6_K, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q8_0: panel_of(T_Q8_0, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q5_0: panel_of(T_Q5_0, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q4_0: panel_of(T_Q4_0, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_IQ4_XS: panel_of(T_IQ4_XS, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q3_K: panel_of(T_Q3_K, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q2_K: panel_of(T_Q2_K, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_IQ4_NL: panel_of(T_IQ4_NL, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q4_1: panel_of(T_Q4_1, pk, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q5_1: panel_of(T_Q5_1, pk, A, m0, rows, bias, y, ldy, cols); break;
    default: break; /* understudy_qgemm_parts takes no other type */
    }
}
