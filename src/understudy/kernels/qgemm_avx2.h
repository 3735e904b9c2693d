/* qgemm.c's AVX2 path (AVX2 + FMA + F16C, for CPUs without AVX-512 VNNI; in the AVX-512 build,
 * for the types qgemm_avx512.h has no body for), included by qgemm.c.
 *
 * The same integers and the same float steps as the portable path (panel_rows_portable) and
 * the AVX-512 one, so the same bits, for every block type (qgemm_avx2_blocks.h). A panel's
 * 16 columns go as two halves of 8 (bytes 32h..32h+31 of each 64-byte group are columns
 * 8h..8h+7), one 256-bit register a half. Without VNNI, vpmaddubsw makes pair sums in int16
 * (exact: no pair leaves int16, Q4_K 2 * 15 * 127, Q6_K 2 * 63 * 127, Q5_0 2 * 31 * 127),
 * several of which are added in int16 while they still fit (sum16) before one vpmaddwd
 * widens them, by the sub-block scale where there is one: half the multiplies of widening
 * each, so extra rows cost less. Q8_0's stored w + 128 would not fit, nor would IQ4's table
 * values + 128, so their signed w is multiplied as |w| against a with w's sign,
 * 2 * 128 * 127 at most, the same integer as the portable path's sum of w a.
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
QG_UNUSED_IN_AVX512 static void quantize_row_avx2(const float *x, long K, int block, int8_t *q, float *scale,
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

/* Q5_K's: two sum16(w, a, 4) by the scale, added */
AI2 __m256i q5_k_row(const __m256i *w, __m256i sc, const int8_t *a) {
    __m256i s, t, u;
    __asm__("vpbroadcastd (%[a]), %[t]\n\tvpmaddubsw %[t], %[w0], %[s]\n\t"
            BMA("4", "w1") "vpaddw %[t], %[s], %[s]\n\t" BMA("8", "w2") "vpaddw %[t], %[s], %[s]\n\t"
            BMA("12", "w3") "vpaddw %[t], %[s], %[s]\n\tvpmaddwd %[sc], %[s], %[s]\n\t"
            "vpbroadcastd 16(%[a]), %[t]\n\tvpmaddubsw %[t], %[w4], %[u]\n\t"
            BMA("20", "w5") "vpaddw %[t], %[u], %[u]\n\t" BMA("24", "w6") "vpaddw %[t], %[u], %[u]\n\t"
            BMA("28", "w7") "vpaddw %[t], %[u], %[u]\n\tvpmaddwd %[sc], %[u], %[u]\n\t"
            "vpaddd %[u], %[s], %[s]"
            : [s] "=&x"(s), [t] "=&x"(t), [u] "=&x"(u)
            : [a] "r"(a), [w0] "x"(w[0]), [w1] "x"(w[1]), [w2] "x"(w[2]), [w3] "x"(w[3]),
              [w4] "x"(w[4]), [w5] "x"(w[5]), [w6] "x"(w[6]), [w7] "x"(w[7]), [sc] "x"(sc), "m"(*(const char(*)[32])a));
    return s;
}

/* Q3_K's and Q2_K's: sum16(w, a, 4) by the scale */
AI2 __m256i k16_row(const __m256i *w, __m256i sc, const int8_t *a) {
    __m256i s, t;
    __asm__("vpbroadcastd (%[a]), %[t]\n\tvpmaddubsw %[t], %[w0], %[s]\n\t"
            BMA("4", "w1") "vpaddw %[t], %[s], %[s]\n\t" BMA("8", "w2") "vpaddw %[t], %[s], %[s]\n\t"
            BMA("12", "w3") "vpaddw %[t], %[s], %[s]\n\tvpmaddwd %[sc], %[s], %[s]"
            : [s] "=&x"(s), [t] "=&x"(t)
            : [a] "r"(a), [w0] "x"(w[0]), [w1] "x"(w[1]), [w2] "x"(w[2]), [w3] "x"(w[3]),
              [sc] "x"(sc), "m"(*(const char(*)[16])a));
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

#include "qgemm_avx2_blocks.h"

/* Block after block, both halves of each: a block is read from memory once and its second
 * half from the first level of cache (half after half over the whole panel read a panel
 * longer than that cache twice: 19% slower at K = 4864, one row, 2 threads) */
AI2 void block_half(int type, const uint8_t *pk, const uint8_t *next, const acts_t *A, long b,
                    long m0, const int R, int h, __m256 *f) {
    if (type == T_Q4_K || type == T_Q5_K || type == T_IQ4_XS)
        k32_half(type, pk, next, A->nb, b, A, m0, R, h, f);
    else if (type == T_Q6_K || type == T_Q3_K || type == T_Q2_K)
        k16_half(type, pk, next, A->nb, b, A, m0, R, h, f);
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

/* each type's loops a function of its own: inlined all into one, the compiler's budget for
 * the whole left the four- and eight-row groups of Q4_K and Q6_K some 10% slower */
#define TYPED_ROWS(T)                                                                          \
    static __attribute__((noinline)) void rows_##T(const uint8_t *pk, const uint8_t *next,      \
                                                   const acts_t *A, long m0, long rows,          \
                                                   const float *bias, float *y, long ldy, long cols) { \
        panel_rows_typed(T_##T, pk, next, A, m0, rows, bias, y, ldy, cols);                     \
    }
TYPED_ROWS(Q4_K) TYPED_ROWS(Q5_K) TYPED_ROWS(Q6_K) TYPED_ROWS(Q3_K) TYPED_ROWS(Q2_K)
TYPED_ROWS(IQ4_XS) TYPED_ROWS(Q8_0) TYPED_ROWS(Q5_0) TYPED_ROWS(Q5_1) TYPED_ROWS(Q4_0)
TYPED_ROWS(Q4_1) TYPED_ROWS(IQ4_NL)
#undef TYPED_ROWS

static void panel_rows_avx2(int type, const uint8_t *pk, const uint8_t *next, const acts_t *A,
                            long m0, long rows, const float *bias, float *y, long ldy, long cols) {
#define CASE(T) \
    case T_##T: rows_##T(pk, next, A, m0, rows, bias, y, ldy, cols); break;
    switch (type) {
        CASE(Q4_K) CASE(Q5_K) CASE(Q6_K) CASE(Q3_K) CASE(Q2_K) CASE(IQ4_XS)
        CASE(Q8_0) CASE(Q5_0) CASE(Q5_1) CASE(Q4_0) CASE(Q4_1) CASE(IQ4_NL)
    default: break;
    }
#undef CASE
}
