/* qgemm.c's AVX2 path (AVX2 + FMA + F16C, for CPUs without AVX-512 VNNI), included by qgemm.c.
 *
 * The same integers and the same float steps as the portable path (panel_row) and the AVX-512
 * one, so the same bits. A panel's 16 columns go as two halves of 8 (bytes 32h..32h+31 of
 * each 64-byte group are columns 8h..8h+7), one 256-bit register a half. Without VNNI,
 * vpmaddubsw makes pair sums in int16 (exact: no pair leaves int16, Q4_K 2 * 15 * 127, Q6_K
 * 2 * 63 * 127, Q5_0 2 * 31 * 127), several of which are added in int16 while they still fit
 * (sum16) before one vpmaddwd widens them, by the sub-block scale where there is one: half
 * the multiplies of widening each, so extra rows cost less. Q8_0's stored w + 128 would not
 * fit, so its w is recovered and multiplied as |w| against a with w's sign, 2 * 128 * 127,
 * which is the same integer as the portable path's sum of (w + 128) a less 128 sum a.
 */
#include <immintrin.h>

#define AI2 static inline __attribute__((always_inline))
/* rows that share a decoded half panel-block: the rows of a verification pass (2 to 8) in
 * one group. With groups of 4, a fifth row in a group of its own cost nearly what the four
 * did together (the 1.5B target at 5 rows: 78.6 ms with groups of 4, 67.9 with 8) */
#define GROUP2 8

/* the sum of 8 int32 lanes */
AI2 int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* qgemm.c's quantize_row in 8 lanes, the same bits: the max of |x| is order-free (max_ps
 * returns its second operand for a NaN, skipping it as fmaxf does), the scale and its
 * inverse are the same scalar steps, round_ps in the current mode is nearbyintf, and the
 * sums are of integers. A NaN product (0 times the infinite inverse of a subnormal maximum)
 * becomes 0, the byte the portable path's conversion leaves (saturating packs would make it
 * -128). 32 values a step (every block size is a multiple of 32). */
static void quantize_row_avx2(const float *x, long K, int block, int8_t *q, float *scale,
                              int16_t *bsum) {
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long b = 0; b < K / block; ++b) {
        const float *xb = x + b * block;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < block; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), m);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scale[b] = amax / 127.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int i = 0; i < block; i += 32) {
            __m256i n[4];
            for (int e = 0; e < 4; ++e) {
                __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * e), vinv),
                                           _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
                v = _mm256_max_ps(lo, _mm256_min_ps(hi, v));
                n[e] = _mm256_cvttps_epi32(_mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)));
            }
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
            _mm256_storeu_si256((__m256i *)(q + b * block + i), _mm256_permutevar8x32_epi32(bytes, order));
            bsum[(b * block + i) / 16] = (int16_t)hsum8(_mm256_add_epi32(n[0], n[1]));
            bsum[(b * block + i) / 16 + 1] = (int16_t)hsum8(_mm256_add_epi32(n[2], n[3]));
        }
    }
}

/* 4 int8 activations at p, in every dword */
AI2 __m256i four2(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The next panel's bytes, a slice a visit: each of a panel's 2 nb block visits (two halves)
 * asks for 1 / (2 nb) of the next panel, so the memory keeps streaming while this one
 * computes from cache. Without it a thread waited on memory at every block and read about
 * 60% of what a plain streaming sum reads on one core. NULL after the last panel. (Asking
 * for the current block's lines as well cost more instructions than it saved waits.) */
AI2 void fetch_next(const uint8_t *next, long pb, long visit) {
    if (next == NULL) return;
    const uint8_t *from = next + visit * (pb / 2);
    for (long o = 0; o < pb / 2; o += 64) _mm_prefetch((const char *)(from + o), _MM_HINT_T1);
}

/* fetch_next's lines for a visit in `parts` pieces, piece `part`, asked for between a
 * k-quant block's sub-blocks: requests in one burst at the block's start stalled it until
 * the memory took them; spread out, they wait beside the products */
AI2 void fetch_next_part(const uint8_t *next, long pb, long visit, int part, int parts) {
    if (next == NULL) return;
    const uint8_t *from = next + visit * (pb / 2);
    const long lines = (pb / 2 + 63) / 64;
    for (long i = part * lines / parts; i < (part + 1) * lines / parts; ++i)
        _mm_prefetch((const char *)(from + 64 * i), _MM_HINT_T1);
}

/* 8 dwords: each the sum of 4 products of unsigned w bytes and signed a bytes, exact */
AI2 __m256i dot4_avx2(__m256i w, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}

/* 16 words: each the sum of 2n products of unsigned w bytes and signed a bytes, in int16;
 * exact while 2n products fit (the caller's n: Q4_K 16 * 15 * 127, Q6_K 4 * 63 * 127, Q5_0
 * 8 * 31 * 127, all under 32767), so a vpmaddwd by the sub-block scale (or by ones) ends it
 * instead of one vpmaddwd each */
AI2 __m256i sum16(const __m256i *w, const int8_t *a, const int n) {
    __m256i acc = _mm256_maddubs_epi16(w[0], four2(a));
    for (int e = 1; e < n; ++e) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w[e], four2(a + 4 * e)));
    return acc;
}

/* One row of a verification group (3..8 rows), its steps written out: Q4_K's sum16(w, a, 8)
 * by the sub-block scale, Q6_K's two sum16(w, a, 2) by theirs, added; the same integers as
 * the C form. Why: in C the compiler interleaved the group's rows, ran out of the sixteen
 * registers and spilled weights and partial sums inside the row loop; here each row is one
 * block of instructions that keeps the weights in registers, and the core overlaps rows */
#define BMA(off, wi) "vpbroadcastd " off "(%[a]), %[t]\n\tvpmaddubsw %[t], %[" wi "], %[t]\n\t"
AI2 __m256i q4_k_row(const __m256i *w, __m256i sc, const int8_t *a) {
    __m256i s, t;
    __asm__("vpbroadcastd (%[a]), %[t]\n\tvpmaddubsw %[t], %[w0], %[s]\n\t"
            BMA("4", "w1") "vpaddw %[t], %[s], %[s]\n\t" BMA("8", "w2") "vpaddw %[t], %[s], %[s]\n\t"
            BMA("12", "w3") "vpaddw %[t], %[s], %[s]\n\t" BMA("16", "w4") "vpaddw %[t], %[s], %[s]\n\t"
            BMA("20", "w5") "vpaddw %[t], %[s], %[s]\n\t" BMA("24", "w6") "vpaddw %[t], %[s], %[s]\n\t"
            BMA("28", "w7") "vpaddw %[t], %[s], %[s]\n\tvpmaddwd %[sc], %[s], %[s]"
            : [s] "=&x"(s), [t] "=&x"(t)
            : [a] "r"(a), [w0] "x"(w[0]), [w1] "x"(w[1]), [w2] "x"(w[2]), [w3] "x"(w[3]),
              [w4] "x"(w[4]), [w5] "x"(w[5]), [w6] "x"(w[6]), [w7] "x"(w[7]), [sc] "x"(sc), "m"(*(const char(*)[32])a));
    return s;
}

AI2 __m256i q6_k_row(const __m256i *w, __m256i sc, const int8_t *a) {
    __m256i s, t, u;
    __asm__("vpbroadcastd (%[a]), %[t]\n\tvpmaddubsw %[t], %[w0], %[s]\n\t"
            BMA("4", "w1") "vpaddw %[t], %[s], %[s]\n\tvpmaddwd %[sc], %[s], %[s]\n\t"
            "vpbroadcastd 8(%[a]), %[t]\n\tvpmaddubsw %[t], %[w2], %[u]\n\t"
            BMA("12", "w3") "vpaddw %[t], %[u], %[u]\n\tvpmaddwd %[sc], %[u], %[u]\n\t"
            "vpaddd %[u], %[s], %[s]"
            : [s] "=&x"(s), [t] "=&x"(t), [u] "=&x"(u)
            : [a] "r"(a), [w0] "x"(w[0]), [w1] "x"(w[1]), [w2] "x"(w[2]), [w3] "x"(w[3]),
              [sc] "x"(sc), "m"(*(const char(*)[16])a));
    return s;
}
#undef BMA

/* the 8 float16 at p as float */
AI2 __m256 halfs8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Q4_K, half h of a panel's block b: f[r] (columns 8h..8h+7) += the block's float step */
AI2 void q4_k_half(const uint8_t *pk, const uint8_t *next, long nb, long b, const acts_t *A,
                   long m0, const int R, int h, __m256 *f) {
    const __m256i low = _mm256_set1_epi8(0xf);
    const uint8_t *blk = pk + b * 2368;
    __m256i isum[GROUP2], jsum[GROUP2];
    for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        fetch_next_part(next, 2368, h * nb + b, j, 8);
        __m256i w[8];
        for (int l = 0; l < 4; ++l) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 320 + 64 * (4 * j + l) + 32 * h));
            w[2 * l] = _mm256_and_si256(v, low);
            w[2 * l + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 + 16 * j + 8 * h)));
        sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)); /* in both words of a dword */
        for (int r = 0; r < R; ++r) {
            const int8_t *a = A->q + (m0 + r) * A->K + 256 * b + 32 * j;
            __m256i t = R > 2 ? q4_k_row(w, sc, a) : _mm256_madd_epi16(sum16(w, a, 8), sc);
            isum[r] = _mm256_add_epi32(isum[r], t);
        }
    }
    const __m256 d = halfs8(blk + 16 * h), dmin = halfs8(blk + 32 + 16 * h);
    for (int p = 0; p < 4; ++p) {
        __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192 + 32 * p + 16 * h)));
        for (int r = 0; r < R; ++r) {
            const int16_t *s32 = A->s32 + (m0 + r) * (A->K / 32) + 8 * b + 2 * p;
            jsum[r] = _mm256_add_epi32(jsum[r], _mm256_madd_epi16(mn, four2(s32)));
        }
    }
    for (int r = 0; r < R; ++r) {
        __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(s, d), f[r]);
        f[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(jsum[r]), _mm256_mul_ps(s, dmin), f[r]);
    }
}

/* Q6_K, half h of block b: as q4_k_half, 16 sub-blocks of 16 values, signed scales,
 * values q - 32 */
AI2 void q6_k_half(const uint8_t *pk, const uint8_t *next, long nb, long b, const acts_t *A,
                   long m0, const int R, int h, __m256 *f) {
    const __m256i low = _mm256_set1_epi8(0xf), top = _mm256_set1_epi8(0x30);
    const uint8_t *blk = pk + b * 3360;
    __m256i isum[GROUP2], jsum[GROUP2];
    for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
        fetch_next_part(next, 3360, h * nb + b, p, 8);
        /* dword c: the scales of sub-blocks 2p (low word) and 2p + 1 (high word) */
        __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 + 32 * p + 16 * h)));
        for (int k = 0; k < 2; ++k) {
            const int j = 2 * p + k;
            /* sub-block j's scale in both words of each dword */
            __m256i sc = k ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pair, 0xf5), 0xf5)
                           : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pair, 0xa0), 0xa0);
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + 288 + 128 * j + 32 * h));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + 288 + 128 * j + 64 + 32 * h));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 2336 + 64 * j + 32 * h));
            __m256i w[4] = {
                _mm256_or_si256(_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                                _mm256_and_si256(_mm256_slli_epi16(hb, 2), top)),
                _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_and_si256(hb, top)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), top))};
            for (int r = 0; r < R; ++r) {
                const int8_t *a = A->q + (m0 + r) * A->K + 256 * b + 16 * j;
                __m256i t = R > 2 ? q6_k_row(w, sc, a)
                                  : _mm256_add_epi32(_mm256_madd_epi16(sum16(w, a, 2), sc),
                                                     _mm256_madd_epi16(sum16(w + 2, a + 8, 2), sc));
                isum[r] = _mm256_add_epi32(isum[r], t);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int16_t *s16 = A->s16 + (m0 + r) * (A->K / 16) + 16 * b + 2 * p;
            jsum[r] = _mm256_add_epi32(jsum[r], _mm256_madd_epi16(pair, four2(s16)));
        }
    }
    const __m256 d = halfs8(blk + 16 * h);
    for (int r = 0; r < R; ++r) {
        __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
        __m256i t = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(jsum[r], 5));
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, d), f[r]);
    }
}

/* Q8_0, Q5_0 and Q4_0, half h: 32-value blocks. Q8_0: sum of w a directly (|w| and a's
 * sign: see the header); Q5_0: sum of q a less 16 sum a, q 0..31; Q4_0: less 8 sum a, q
 * 0..15 */
AI2 void b32_half(const int type, const uint8_t *pk, const uint8_t *next, long nb, long b,
                  const acts_t *A, long m0, const int R, int h, __m256 *f) {
    const __m256i low = _mm256_set1_epi8(0xf), flip = _mm256_set1_epi8((char)0x80);
    const int q8 = type == T_Q8_0;
    const long pb = panel_bytes(type);
    const uint8_t *blk = pk + b * pb;
    fetch_next(next, pb, h * nb + b);
    __m256i w[8];
    if (q8) {
        for (int g = 0; g < 8; ++g)
            w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * g + 32 * h)), flip);
    } else if (type == T_Q4_0) {
        for (int t = 0; t < 4; ++t) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * t + 32 * h));
            w[2 * t] = _mm256_and_si256(v, low);
            w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    } else {
        /* byte 4c + i of hb: at bit 2t + s the fifth bit of value 8t + 4s + i of column
         * 8h + c. A 16-bit shift by 4 - k (left) or k - 4 (right) brings bit k of every byte
         * to its bit 4; no bit that lands there comes from the other byte of the word. */
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 288 + 32 * h));
        const __m256i fifth = _mm256_set1_epi8(0x10);
#define FIFTH_BITS(k) \
    _mm256_and_si256((k) < 4 ? _mm256_slli_epi16(hb, 4 - (k)) : _mm256_srli_epi16(hb, (k) - 4), fifth)
        for (int t = 0; t < 4; ++t) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * t + 32 * h));
            w[2 * t] = _mm256_or_si256(_mm256_and_si256(v, low), FIFTH_BITS(2 * t));
            w[2 * t + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), FIFTH_BITS(2 * t + 1));
        }
#undef FIFTH_BITS
    }
    const __m256 d = halfs8(blk + 16 * h);
    for (int r = 0; r < R; ++r) {
        const int8_t *a = A->q + (m0 + r) * A->K + 32 * b;
        __m256i t;
        if (q8) { /* w signed: |w| (-128 -> 128, unsigned) against a with w's sign */
            t = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g)
                t = _mm256_add_epi32(t, dot4_avx2(_mm256_abs_epi8(w[g]), _mm256_sign_epi8(four2(a + 4 * g), w[g])));
        } else {
            const int32_t offset = (type == T_Q5_0 ? 16 : 8) * (int32_t)A->s32[(m0 + r) * (A->K / 32) + b];
            const __m256i ones = _mm256_set1_epi16(1);
            t = _mm256_add_epi32(_mm256_madd_epi16(sum16(w, a, 4), ones),
                                 _mm256_madd_epi16(sum16(w + 4, a + 16, 4), ones));
            t = _mm256_sub_epi32(t, _mm256_set1_epi32(offset));
        }
        __m256 s = _mm256_set1_ps(A->s[(m0 + r) * nb + b]);
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, d), f[r]);
    }
}

/* Block after block, both halves of each: a block is read from memory once and its second
 * half from the first level of cache (half after half over the whole panel read a panel
 * longer than that cache twice: 19% slower at K = 4864, one row, 2 threads) */
AI2 void block_half(int type, const uint8_t *pk, const uint8_t *next, const acts_t *A, long b,
                    long m0, const int R, int h, __m256 *f) {
    if (type == T_Q4_K)
        q4_k_half(pk, next, A->nb, b, A, m0, R, h, f);
    else if (type == T_Q6_K)
        q6_k_half(pk, next, A->nb, b, A, m0, R, h, f);
    else
        b32_half(type, pk, next, A->nb, b, A, m0, R, h, f);
}

AI2 void store_half(const __m256 *f, const int R, int h, const float *bias, float *y, long ldy,
                    long cols) {
    for (int r = 0; r < R; ++r) {
        float out[8];
        _mm256_storeu_ps(out, f[r]);
        for (long c = 0; c < 8 && 8 * h + c < cols; ++c)
            y[r * ldy + 8 * h + c] = bias ? out[c] + bias[8 * h + c] : out[c];
    }
}

AI2 void group_rows2(int type, const uint8_t *pk, const uint8_t *next, const acts_t *A,
                     long m0, const int R, const float *bias, float *y, long ldy, long cols) {
    const int halves = cols > 8 ? 2 : 1;
    if (R <= 2) { /* the halves' accumulators apart, so they stay in registers */
        __m256 f0[2], f1[2];
        for (int r = 0; r < R; ++r) f0[r] = f1[r] = _mm256_setzero_ps();
        if (halves == 2)
            for (long b = 0; b < A->nb; ++b) {
                block_half(type, pk, next, A, b, m0, R, 0, f0);
                block_half(type, pk, next, A, b, m0, R, 1, f1);
            }
        else
            for (long b = 0; b < A->nb; ++b) block_half(type, pk, next, A, b, m0, R, 0, f0);
        store_half(f0, R, 0, bias, y, ldy, cols);
        if (halves == 2) store_half(f1, R, 1, bias, y, ldy, cols);
        return;
    }
    /* more rows: the accumulators in memory (the first level of cache), leaving the
     * registers to the block's sums; in registers they spilled inside the block loop */
    __m256 f[2][GROUP2];
    for (int h = 0; h < halves; ++h)
        for (int r = 0; r < R; ++r) f[h][r] = _mm256_setzero_ps();
    for (long b = 0; b < A->nb; ++b)
        for (int h = 0; h < halves; ++h) block_half(type, pk, next, A, b, m0, R, h, f[h]);
    for (int h = 0; h < halves; ++h) store_half(f[h], R, h, bias, y, ldy, cols);
}

/* Rows m0..m0+rows-1 of one panel, GROUP2 at a time; `type` a constant in each of
 * panel_rows_avx2's calls, so every type gets its own loops (with the type a variable, the
 * one-row loop tested it in every block and spilled around the other types' paths) */
AI2 void panel_rows_typed(const int type, const uint8_t *pk, const uint8_t *next, const acts_t *A,
                          long m0, long rows, const float *bias, float *y, long ldy, long cols) {
    long r = 0;
    for (; r + GROUP2 <= rows; r += GROUP2)
        group_rows2(type, pk, next, A, m0 + r, GROUP2, bias, y + r * ldy, ldy, cols);
    switch (rows - r) {
    case 1: group_rows2(type, pk, next, A, m0 + r, 1, bias, y + r * ldy, ldy, cols); break;
    case 2: group_rows2(type, pk, next, A, m0 + r, 2, bias, y + r * ldy, ldy, cols); break;
    case 3: group_rows2(type, pk, next, A, m0 + r, 3, bias, y + r * ldy, ldy, cols); break;
    case 4: group_rows2(type, pk, next, A, m0 + r, 4, bias, y + r * ldy, ldy, cols); break;
    case 5: group_rows2(type, pk, next, A, m0 + r, 5, bias, y + r * ldy, ldy, cols); break;
    case 6: group_rows2(type, pk, next, A, m0 + r, 6, bias, y + r * ldy, ldy, cols); break;
    case 7: group_rows2(type, pk, next, A, m0 + r, 7, bias, y + r * ldy, ldy, cols); break;
    default: break;
    }
}

static void panel_rows_avx2(int type, const uint8_t *pk, const uint8_t *next, const acts_t *A,
                            long m0, long rows, const float *bias, float *y, long ldy, long cols) {
    switch (type) {
    case T_Q4_K: panel_rows_typed(T_Q4_K, pk, next, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q6_K: panel_rows_typed(T_Q6_K, pk, next, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q8_0: panel_rows_typed(T_Q8_0, pk, next, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q5_0: panel_rows_typed(T_Q5_0, pk, next, A, m0, rows, bias, y, ldy, cols); break;
    case T_Q4_0: panel_rows_typed(T_Q4_0, pk, next, A, m0, rows, bias, y, ldy, cols); break;
    default: break;
    }
}
