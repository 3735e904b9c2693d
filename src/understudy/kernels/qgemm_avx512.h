/* qgemm.c's AVX-512 path (AVX512F + BW + VL; VNNI where the CPU has it), included by qgemm.c.
 *
 * Same numbers, fewer instructions: every function here computes, for each row and block,
 * the SAME 8 int32 lanes as the AVX2 and scalar paths (lane l of a block: its values at
 * positions 4l..4l+3 of each 32-value chunk, times their sub-block multipliers, summed) and
 * applies the same float steps in the same order. Integer sums are exact whatever their
 * grouping, so computing two chunks per 512-bit register and adding the halves at the end
 * changes no bit: the three paths give one answer, and a row's answer still depends on that
 * row alone.
 *
 * What makes it faster than the AVX2 path: a block is decoded once into registers (not into a
 * buffer in memory), with its sub-block scales built by 32-bit mask arithmetic instead of a
 * byte loop, and serves a group of up to 8 rows whose float accumulators stay in registers
 * across the whole weight row; each 512-bit multiply covers two 32-value chunks. For the
 * k-quants, with VNNI, one vpdpbusd makes 16 exact 4-product sums, two rows' sums are paired
 * as int16 words and one vpdpwssd applies two sub-block multipliers to both rows at once
 * (kquant_pair); the activations are regrouped once per call so that a group's block is one
 * pointer (pack_group512), and the float products s * d are formed for all rows in one
 * multiply.
 */
#include <immintrin.h>

#define GROUP_ROWS 8 /* rows whose accumulators live in registers at once */
#define PREFETCH_AHEAD 2048 /* bytes of weights ahead of the block being decoded */

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

/* k-quant activations, regrouped once per call: for each group of up to GROUP_ROWS rows and
 * each block b, one record of krec(R) bytes: the R rows' 256 ints (Q4_K: its 32-value chunks
 * in the order of krec_chunk, the order its decoded registers hold them), then their 16 sums
 * per 16 values (int16 [R][16]: a pair of rows is 64 contiguous bytes), then their scales
 * (float [R]). A group's block b is then one pointer and constant offsets. */
static inline long krec(long R) { return (R * (256 + 32) + 4 * R + 63) / 64 * 64; }
static const int krec_chunk[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* Q4_K: slot c holds chunk [c] */

static void pack_group512(int q4k, const int8_t *aq, const float *as, const int16_t *ab, long K,
                          long R, uint8_t *out) {
    long nb = K / 256, rec = krec(R);
    for (long b = 0; b < nb; ++b) {
        uint8_t *o = out + b * rec;
        for (long r = 0; r < R; ++r) {
            const int8_t *a = aq + r * K + b * 256;
            for (int c = 0; c < 8; ++c)
                memcpy(o + r * 256 + 32 * c, a + 32 * (q4k ? krec_chunk[c] : c), 32);
            memcpy(o + R * 256 + 32 * r, ab + r * (K / 16) + b * 16, 32);
            memcpy(o + R * 288 + 4 * r, as + r * nb + b, 4);
        }
    }
}

/* Q8_0 / Q5_0 activations for groups of 2..GROUP_ROWS rows, regrouped once per call: for each
 * block b one record of rec32(R) bytes: per pair of rows 64 bytes, the even row's 32 ints then
 * the odd row's (zeros past row R - 1), then the R rows' scales (float [8], zeros past R - 1).
 * One 512-bit multiply then covers a block for two rows, each in its own 8 lanes. */
static inline long rec32(long R) { return (R + 1) / 2 * 64 + 64; }

static void pack_group32(const int8_t *aq, const float *as, long K, long R, uint8_t *out) {
    long nb = K / 32, rec = rec32(R);
    if (R < 2) return; /* one row runs from aq itself (block32_group) */
    for (long b = 0; b < nb; ++b) {
        uint8_t *o = out + b * rec;
        float *s = (float *)(o + (R + 1) / 2 * 64);
        memset(o, 0, (size_t)rec);
        for (long r = 0; r < R; ++r) {
            memcpy(o + r * 32, aq + r * K + b * 32, 32);
            s[r] = as[r * nb + b];
        }
    }
}

/* A k-quant block in registers: w[p] 64 of its values (unsigned: Q4_K 0..15, Q6_K 0..63), two
 * 32-value chunks, reg_chunk(p, 0) then reg_chunk(p, 1), in the order the records hold the
 * activations; sc[k] the int16 multipliers of kquant_row's words (scale_words); mn the 16 int16
 * weights of the activation sums per 16 values (Q4_K: its mins, Q6_K: 32 x scales); sc2[p] the
 * int16 multipliers of kquant_pair's words for register p (scale_pairs). */
typedef struct {
    __m512i w[4], sc[2], sc2[4]; /* sc: for kquant_row (an odd row); sc2: for kquant_pair */
    __m256i mn;
    __m512 dd; /* d in lanes 0-7, dmin in 8-15 (Q6_K: 0) */
} kregs;

static inline int reg_chunk(int q4k, int p, int half) {
    return q4k ? krec_chunk[2 * p + half] : 2 * p + half;
}

/* Index vectors for _mm512_permutexvar_epi16 over the block's scales (Q4_K: 8, one per 32
 * values; Q6_K: 16, one per 16): word w of sc[k] multiplies, in kquant_row, the 4-product sum
 * of register 2k + (w & 1) at dword w / 2: chunk reg_chunk(2k + (w & 1), w / 2 >= 8), lane
 * w / 2 % 8, i.e. values 4 (w / 2 % 8) .. + 3 of that chunk. */
static inline __m512i scale_words(int q4k, int k) {
    int16_t idx[32];
    for (int w = 0; w < 32; ++w) {
        int i = w / 2, t = reg_chunk(q4k, 2 * k + (w & 1), i >= 8);
        idx[w] = (int16_t)(q4k ? t : 2 * t + (i % 8 >= 4));
    }
    return _mm512_loadu_si512((const void *)idx);
}

/* The two-row path (kquant_pair): dot4 gives, for a row and register p, dword i < 8 lane i of
 * chunk reg_chunk(p, 0) and dword 8 + i lane i of chunk reg_chunk(p, 1). pair_words sets two
 * rows' sums side by side as int16 words: word 2i, 2i + 1 = dwords i and 8 + i of row e
 * (i < 8), of row o (i >= 8, less 8); so vpdpwssd with scale_pairs(p) (word 2i: chunk
 * reg_chunk(p, 0)'s multiplier for lane i % 8, 2i + 1: chunk reg_chunk(p, 1)'s) adds both
 * chunks' scaled sums into lane i % 8 of row e (dwords 0-7) or row o (8-15). */
static inline __m512i pair_words(void) {
    int16_t idx[32];
    for (int w = 0; w < 32; ++w) {
        int i = w / 2, s = w & 1;
        idx[w] = (int16_t)(i < 8 ? 2 * (i + 8 * s) : 32 + 2 * (i - 8 + 8 * s));
    }
    return _mm512_loadu_si512((const void *)idx);
}

static inline __m512i scale_pairs(int q4k, int p) {
    int16_t idx[32];
    for (int w = 0; w < 32; ++w) {
        int l = (w / 2) % 8, t = reg_chunk(q4k, p, w & 1);
        idx[w] = (int16_t)(q4k ? t : 2 * t + (l >= 4));
    }
    return _mm512_loadu_si512((const void *)idx);
}

static inline __attribute__((always_inline)) void load_q4_k_regs(const uint8_t *blk, kregs *u,
                                                                 const __m512i *index, int odd,
                                                                 int pairs) {
    uint32_t dbits;
    memcpy(&dbits, blk, 4); /* d, dmin: two float16 */
    u->dd = _mm512_permutexvar_ps(
        _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1),
        _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dbits))));
    /* 12 bytes of 6-bit scales and mins (q4_k_scales, four bytes at a time) */
    uint32_t a[3];
    memcpy(a, blk + 4, 12);
    uint32_t sc_lo = a[0] & 0x3f3f3f3fu, mn_lo = a[1] & 0x3f3f3f3fu;
    uint32_t sc_hi = (a[2] & 0x0f0f0f0fu) | (((a[0] >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((a[2] >> 4) & 0x0f0f0f0fu) | (((a[1] >> 6) & 0x03030303u) << 4);
    __m512i sc16 = _mm512_castsi128_si512(
        _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
    for (int k = 0; k < 2 && odd; ++k) u->sc[k] = _mm512_permutexvar_epi16(index[k], sc16);
    for (int p = 0; p < 4 && pairs; ++p) u->sc2[p] = _mm512_permutexvar_epi16(index[3 + p], sc16);
    __m128i mn8 = _mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo);
    u->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
    /* 128 bytes: byte i of 32-byte piece c holds value 64c + i (low nibble) and 64c + 32 + i
     * (high): a 64-byte load's low nibbles are chunks 4h and 4h + 2, its high ones 4h + 1 and
     * 4h + 3, the order krec_chunk gives the activations */
    const uint8_t *qs = blk + 16;
    const __m512i low = _mm512_set1_epi8(0xf);
    for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * h));
        u->w[2 * h] = _mm512_and_si512(v, low);
        u->w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

static inline __attribute__((always_inline)) void load_q6_k_regs(const uint8_t *blk, kregs *u,
                                                                 const __m512i *index, int odd,
                                                                 int pairs) {
    const uint8_t *ql = blk, *qh = blk + 128;
    u->dd = _mm512_maskz_mov_ps(0x00ff, _mm512_set1_ps(half_to_float(read_u16(blk + 208))));
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    __m512i s512 = _mm512_castsi256_si512(s16);
    for (int k = 0; k < 2 && odd; ++k) u->sc[k] = _mm512_permutexvar_epi16(index[k], s512);
    for (int p = 0; p < 4 && pairs; ++p) u->sc2[p] = _mm512_permutexvar_epi16(index[3 + p], s512);
    u->mn = _mm256_slli_epi16(s16, 5);
    /* half h: ql bytes 64h..64h+63 hold values 128h + i (low nibble) and 128h + 64 + i (high
     * nibble); qh byte 32h + i holds the top two bits of values 128h + 32c + i at bits 2c. */
    const __m512i low = _mm512_set1_epi8(0xf), two = _mm512_set1_epi8(3);
    const __m512i shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift23 = _mm512_add_epi16(shift01, _mm512_set1_epi16(4));
    for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_loadu_si512((const void *)(ql + 64 * h));
        __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
        __m512i top01 = _mm512_and_si512(_mm512_srlv_epi16(hb, shift01), two);
        __m512i top23 = _mm512_and_si512(_mm512_srlv_epi16(hb, shift23), two);
        u->w[2 * h] = _mm512_or_si512(_mm512_and_si512(v, low), _mm512_slli_epi16(top01, 4));
        u->w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                          _mm512_slli_epi16(top23, 4));
    }
}

/* The 16 int32 sums of 4 products each of a row's activations (a record's 256 ints) with
 * register p of a decoded block: dword i < 8 lane i of chunk reg_chunk(p, 0), dword 8 + i lane
 * i of chunk reg_chunk(p, 1). */
static inline __attribute__((always_inline)) __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

static inline __attribute__((always_inline)) __m512i dot4(__m512i w, const uint8_t *a) {
    __m512i x = _mm512_loadu_si512((const void *)a);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)); /* exact pairs */
#endif
}

/* Row a's integer dot with a decoded k-quant block: 16 int32, dword i < 8 lane i of the chunks
 * in the registers' first halves, 8 + i lane i of the second halves; the two halves add up to
 * the AVX2 path's 8 lanes. Each 4-product sum fits int16 (|sum| <= 4 * 63 * 127 < 2^15), so
 * two registers' sums go side by side as the words of one (blend), and one multiply-add by
 * sc[k] applies both chunks' multipliers: exact int32 all along. */
static inline __attribute__((always_inline)) __m512i kquant_row(const kregs *u, const uint8_t *a) {
    __m512i x0 = dot4(u->w[0], a), x1 = dot4(u->w[1], a + 64);
    __m512i x2 = dot4(u->w[2], a + 128), x3 = dot4(u->w[3], a + 192);
    __m512i lo = _mm512_mask_blend_epi16(0xaaaaaaaau, x0, _mm512_slli_epi32(x1, 16));
    __m512i hi = _mm512_mask_blend_epi16(0xaaaaaaaau, x2, _mm512_slli_epi32(x3, 16));
    return dpwssd(_mm512_madd_epi16(lo, u->sc[0]), hi, u->sc[1]);
}

/* isum + the integer dots of rows a and a + 256 (a record's pair of rows) with a decoded block:
 * the first row's 8 lanes in dwords 0-7, the other's in 8-15 (pair_words). */
static inline __attribute__((always_inline)) __m512i kquant_pair(const kregs *u, const uint8_t *a,
                                                                __m512i isum, __m512i words) {
    for (int p = 0; p < 4; ++p) {
        __m512i e = dot4(u->w[p], a + 64 * p), o = dot4(u->w[p], a + 256 + 64 * p);
        isum = dpwssd(isum, _mm512_permutex2var_epi16(e, words, o), u->sc2[p]);
    }
    return isum;
}

/* Blocks b0..b1-1 of one column for rows 0..R-1 (R <= GROUP_ROWS, a constant after inlining)
 * from their records (pack_group512): acc[r] (8 float lanes, in memory between calls) += their
 * lanes, block by block. Rows go two to a 512-bit float register (lanes 0-7 the even row, 8-15
 * the odd): each lane still sees exactly the AVX2 path's float steps, in its order, with the
 * same products s * d and s * dmin (here computed for all R rows in one multiply). */
static inline __attribute__((always_inline)) void kquant_group(
    int q4k, const uint8_t *row, long b0, long b1, long nb, const uint8_t *recs, const int R,
    const __m512i *index, float (*accm)[8]) {
    const long rec = krec(R), bs_at = R * 256, s_at = R * 288;
    __m512 acc[GROUP_ROWS / 2];
    __m256 last = _mm256_setzero_ps(); /* row R - 1 when R is odd */
    for (int i = 0; i < R / 2; ++i) acc[i] = _mm512_loadu_ps(accm[2 * i]);
    if (R & 1) last = _mm256_loadu_ps(accm[R - 1]);
    kregs u;
    const long bytes = q4k ? 144 : 210;
    for (long b = b0; b < b1; ++b) {
        /* unchunked, a column's blocks follow the previous column's: fetch ahead of the
         * hardware's own prefetch, which falls behind when a block serves several rows */
        if (b1 - b0 == nb && R > 1)
            for (int o = 0; o < bytes; o += 64)
                _mm_prefetch((const char *)(row + b * bytes + PREFETCH_AHEAD + o), _MM_HINT_T0);
        if (q4k)
            load_q4_k_regs(row + b * bytes, &u, index, R & 1, R >= 2);
        else
            load_q6_k_regs(row + b * bytes, &u, index, R & 1, R >= 2);
        const uint8_t *a = recs + b * rec;
        const int16_t *bs = (const int16_t *)(a + bs_at);
        const float *sv = (const float *)(a + s_at);
        __m512i mn = _mm512_broadcast_i64x4(u.mn);
        /* lanes r < 8: s_r * d; lanes 8 + r: s_r * dmin (lanes of rows >= R unused): the
         * products the AVX2 path forms one row at a time */
        __m256 s8 = R >= 8 ? _mm256_loadu_ps(sv)
                           : _mm256_maskz_loadu_ps((__mmask8)((1u << R) - 1), sv);
        __m512 sdm = _mm512_mul_ps(_mm512_broadcast_f32x8(s8), u.dd);
        for (int i = 0; i < R / 2; ++i) {
            const int r = 2 * i;
            /* J (rows r, r + 1), and I (Q6_K: I - J, starting from -J) */
            __m512i jsum = _mm512_madd_epi16(_mm512_loadu_si512((const void *)(bs + 16 * r)), mn);
            __m512i isum = kquant_pair(
                &u, a + r * 256,
                q4k ? _mm512_setzero_si512() : _mm512_sub_epi32(_mm512_setzero_si512(), jsum),
                index[2]);
            __m512 sd = _mm512_permutexvar_ps(
                _mm512_inserti64x4(_mm512_set1_epi32(r), _mm256_set1_epi32(r + 1), 1), sdm);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[i]);
            if (q4k) {
                __m512 sdmin = _mm512_permutexvar_ps(
                    _mm512_inserti64x4(_mm512_set1_epi32(r + 8), _mm256_set1_epi32(r + 9), 1), sdm);
                acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum), sdmin, acc[i]);
            }
        }
        if (R & 1) {
            const int r = R - 1;
            __m512i e = kquant_row(&u, a + r * 256);
            __m256i i8 =
                _mm256_add_epi32(_mm512_castsi512_si256(e), _mm512_extracti64x4_epi64(e, 1));
            __m256i j8 =
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + 16 * r)), u.mn);
            __m256 sd = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_set1_epi32(r), sdm));
            if (q4k) {
                __m256 sdmin = _mm512_castps512_ps256(
                    _mm512_permutexvar_ps(_mm512_set1_epi32(r + 8), sdm));
                last = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i8), sd, last);
                last = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(j8), sdmin, last);
            } else {
                last = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i8, j8)), sd, last);
            }
        }
    }
    for (int i = 0; i < R / 2; ++i) _mm512_storeu_ps(accm[2 * i], acc[i]);
    if (R & 1) _mm256_storeu_ps(accm[R - 1], last);
}

/* Blocks b and b + 1 of a Q8_0 / Q5_0 row, signed, in one register; their scales in d0, d1. */
static inline __attribute__((always_inline)) __m512i decode_pair(int q8, const uint8_t *blk,
                                                                 float *d0, float *d1) {
    long bytes = q8 ? 34 : 22;
    *d0 = half_to_float(read_u16(blk));
    *d1 = half_to_float(read_u16(blk + bytes));
    if (q8)
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 2))),
            _mm256_loadu_si256((const __m256i *)(blk + bytes + 2)), 1);
    /* Q5_0: 16 bytes of nibbles (value i: low nibble of byte i, value 16 + i: high nibble)
     * and 32 fifth bits, bit i for value i: both blocks' 64 bits become a byte mask */
    __m128i x0 = _mm_loadu_si128((const __m128i *)(blk + 6));
    __m128i x1 = _mm_loadu_si128((const __m128i *)(blk + bytes + 6));
    __m512i z = _mm512_castsi128_si512(x0);
    z = _mm512_inserti32x4(z, _mm_srli_epi16(x0, 4), 1);
    z = _mm512_inserti32x4(z, x1, 2);
    z = _mm512_inserti32x4(z, _mm_srli_epi16(x1, 4), 3);
    uint32_t h0, h1;
    memcpy(&h0, blk + 2, 4);
    memcpy(&h1, blk + bytes + 2, 4);
    __m512i fifth = _mm512_maskz_mov_epi8((__mmask64)h0 | ((__mmask64)h1 << 32),
                                          _mm512_set1_epi8(0x10));
    z = _mm512_or_si512(_mm512_and_si512(z, _mm512_set1_epi8(0xf)), fifth);
    return _mm512_sub_epi8(z, _mm512_set1_epi8(16));
}

/* Blocks b0..b1-1 (b0 even) of one column for rows 0..R-1 of 32-value blocks: acc[r] += their
 * lanes, one block at a time in block order, as block32_rows does. */
static inline __attribute__((always_inline)) void block32_group(
    int q8, const uint8_t *row, long b0, long b1, long nb, const int8_t *aq, const float *as,
    long K, const int R, float (*accm)[8]) {
    __m256 acc[GROUP_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(accm[r]);
    const __m512i zero = _mm512_setzero_si512();
    long bytes = q8 ? 34 : 22, b = b0;
    for (; b + 2 <= b1; b += 2) {
        float d0, d1;
        __m512i w = decode_pair(q8, row + b * bytes, &d0, &d1);
        __m512i wabs = _mm512_abs_epi8(w); /* -128 -> 0x80, read unsigned: 128 */
        __mmask64 neg = _mm512_movepi8_mask(w);
        for (int r = 0; r < R; ++r) {
            __m512i x = _mm512_loadu_si512((const void *)(aq + r * K + b * 32));
            x = _mm512_mask_sub_epi8(x, neg, zero, x); /* x * sign(w); |x| <= 127 */
#if defined(__AVX512VNNI__)
            __m512i isum = _mm512_dpbusd_epi32(zero, wabs, x);
#else
            __m512i isum = _mm512_madd_epi16(_mm512_maddubs_epi16(wabs, x),
                                             _mm512_set1_epi16(1));
#endif
            __m512 f = _mm512_cvtepi32_ps(isum);
            const float *s = as + r * nb + b;
            acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm256_set1_ps(s[0] * d0), acc[r]);
            acc[r] = _mm256_fmadd_ps(
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)),
                _mm256_set1_ps(s[1] * d1), acc[r]);
        }
    }
    if (b < b1) { /* an odd last block alone */
        float d = half_to_float(read_u16(row + b * bytes));
        __m256i w = q8 ? _mm256_loadu_si256((const __m256i *)(row + b * bytes + 2))
                       : decode_q5_0(row + b * bytes);
        __m256i wabs = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(aq + r * K + b * 32));
            __m256i p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w));
            __m256i isum = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                     _mm256_set1_ps(as[r * nb + b] * d), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(accm[r], acc[r]);
}

/* A Q5_0 block's 32 values (q - 16, signed) in both halves of a register: the 16 bytes of
 * nibbles in each 128-bit lane, shifted by 0 or 4 (values 0-15, 16-31), and the 32 fifth bits
 * as a byte mask, twice. */
static inline __attribute__((always_inline)) __m512i decode_q5_0_twice(const uint8_t *blk) {
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + 6)));
    const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    __m512i q = _mm512_and_si512(_mm512_srlv_epi64(v, shift), _mm512_set1_epi8(0xf));
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    __m512i fifth = _mm512_maskz_mov_epi8((__mmask64)qh | ((__mmask64)qh << 32),
                                          _mm512_set1_epi8(0x10));
    return _mm512_sub_epi8(_mm512_or_si512(q, fifth), _mm512_set1_epi8(16));
}

/* Blocks b0..b1-1 of one column for rows 0..R-1 (2 <= R <= GROUP_ROWS) from their records
 * (pack_group32): rows go two to a 512-bit register (lanes 0-7 the even row, 8-15 the odd),
 * the block's 32 weights in both halves; each lane sees block32_rows's float step for its row,
 * in block order, with the same product s * d (formed for all rows in one multiply). */
static inline __attribute__((always_inline)) void block32_pairs(int q8, const uint8_t *row, long b0,
                                                                long b1, long nb,
                                                                const uint8_t *recs, const int R,
                                                                float (*accm)[8]) {
    const int P = (R + 1) / 2;
    const long rec = rec32(R), bytes = q8 ? 34 : 22;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[GROUP_ROWS / 2];
    for (int i = 0; i < P; ++i)
        acc[i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(accm[2 * i])),
                                    2 * i + 1 < R ? _mm256_loadu_ps(accm[2 * i + 1])
                                                  : _mm256_setzero_ps(),
                                    1);
    for (long b = b0; b < b1; ++b) {
        const uint8_t *blk = row + b * bytes;
        if (b1 - b0 == nb) /* as in kquant_group */
            _mm_prefetch((const char *)(blk + PREFETCH_AHEAD), _MM_HINT_T0);
        __m512i w = q8 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 2)))
                       : decode_q5_0_twice(blk);
        __m512i wabs = _mm512_abs_epi8(w); /* -128 -> 0x80, read unsigned: 128 */
        __mmask64 neg = _mm512_movepi8_mask(w);
        const uint8_t *a = recs + b * rec;
        /* lane r: s_r * d (rows >= R: 0) */
        __m256 sd8 = _mm256_mul_ps(_mm256_loadu_ps((const float *)(a + P * 64)),
                                   _mm256_set1_ps(half_to_float(read_u16(blk))));
        for (int i = 0; i < P; ++i) {
            __m512i x = _mm512_loadu_si512((const void *)(a + 64 * i));
            x = _mm512_mask_sub_epi8(x, neg, zero, x); /* x * sign(w); |x| <= 127 */
#if defined(__AVX512VNNI__)
            __m512i isum = _mm512_dpbusd_epi32(zero, wabs, x);
#else
            __m512i isum = _mm512_madd_epi16(_mm512_maddubs_epi16(wabs, x), _mm512_set1_epi16(1));
#endif
            __m512 sd = _mm512_permutexvar_ps(
                _mm512_inserti64x4(_mm512_set1_epi32(2 * i), _mm256_set1_epi32(2 * i + 1), 1),
                _mm512_castps256_ps512(sd8));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[i]);
        }
    }
    for (int i = 0; i < P; ++i) {
        _mm256_storeu_ps(accm[2 * i], _mm512_castps512_ps256(acc[i]));
        if (2 * i + 1 < R) _mm256_storeu_ps(accm[2 * i + 1], _mm512_extractf32x8_ps(acc[i], 1));
    }
}

#define GROUP_CASE(R)                                                                      \
    case R:                                                                                \
        if (type == T_Q4_K)                                                                \
            kquant_group(1, row, b0, b1, nb, recs, R, index, acc);                         \
        else if (type == T_Q6_K)                                                           \
            kquant_group(0, row, b0, b1, nb, recs, R, index, acc);                         \
        else if (R == 1)                                                                   \
            block32_group(type == T_Q8_0, row, b0, b1, nb, aq, as, K, 1, acc);             \
        else if (type == T_Q8_0)                                                           \
            block32_pairs(1, row, b0, b1, nb, recs, R, acc);                               \
        else                                                                               \
            block32_pairs(0, row, b0, b1, nb, recs, R, acc);                               \
        break;

/* The group functions for a run-time type and R: one specialised copy each, so that the
 * accumulators stay in registers. */
static void group_rows512(int type, const uint8_t *row, long b0, long b1, long nb,
                          const int8_t *aq, const float *as, const uint8_t *recs, long K, long R,
                          const __m512i *index, float (*acc)[8]) {
    switch (R) {
        GROUP_CASE(1)
        GROUP_CASE(2)
        GROUP_CASE(3)
        GROUP_CASE(4)
        GROUP_CASE(5)
        GROUP_CASE(6)
        GROUP_CASE(7)
        GROUP_CASE(8)
    default: break;
    }
}

#define NTILE 16 /* columns that share one pass over a chunk of the activations */
#define L1_ROWS_BYTES 24576 /* a group's activations up to this size stay in L1 unchunked */
#define CHUNK_VALUES 2048   /* else K goes in chunks of this many values */

/* Columns n0..n1-1 for rows 0..rows-1: y[r * ldy + n] (+ bias[n]). Columns go NTILE at a
 * time and K in chunks, so the activations a tile reads stay in L1 for all of its columns;
 * each lane's float steps still run in block order. */
static void columns512(int type, const uint8_t *w, long row_bytes, const int8_t *aq,
                       const float *as, const uint8_t *recs, const float *bias, float *y, long ldy,
                       long rows, long K, long n0, long n1) {
    long bsize = block_size(type), nb = K / bsize, bbytes = block_bytes(type);
    long rec = bsize == 256 ? krec(GROUP_ROWS) : rec32(GROUP_ROWS); /* a group's record */
    __m512i index[7]; /* scale_words for kquant_row, pair_words, scale_pairs for kquant_pair */
    for (int k = 0; k < 2; ++k) index[k] = scale_words(type == T_Q4_K, k);
    index[2] = pair_words();
    for (int p = 0; p < 4; ++p) index[3 + p] = scale_pairs(type == T_Q4_K, p);
    float acc[NTILE][GROUP_ROWS][8];
    for (long n = n0; n < n1; n += NTILE) {
        long nt = n1 - n < NTILE ? n1 - n : NTILE;
        for (long g = 0; g < rows; g += GROUP_ROWS) {
            long R = rows - g < GROUP_ROWS ? rows - g : GROUP_ROWS;
            long chunk = R * K <= L1_ROWS_BYTES ? nb : CHUNK_VALUES / bsize; /* b0 stays even */
            memset(acc, 0, sizeof(acc));
            for (long b0 = 0; b0 < nb; b0 += chunk) {
                long b1 = nb - b0 < chunk ? nb : b0 + chunk;
                for (long j = 0; j < nt; ++j) {
                    /* chunked, the weights are read a piece of a column at a time, and the
                     * hardware does not foresee the jumps: fetch the piece `ahead` columns on
                     * (or the next chunk's first ones) ourselves; further for fewer rows, whose
                     * pieces take less time */
                    long jj = j + (R <= 4 ? 4 : 2);
                    long pj = jj < nt ? jj : (jj - nt) % nt, pb0 = jj < nt ? b0 : b1;
                    if (chunk < nb && pb0 < nb) {
                        long pb1 = nb - pb0 < chunk ? nb : pb0 + chunk;
                        const uint8_t *p = w + (n + pj) * row_bytes;
                        for (long o = pb0 * bbytes; o < pb1 * bbytes; o += 64)
                            _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
                    }
                    group_rows512(type, w + (n + j) * row_bytes, b0, b1, nb, aq + g * K,
                                  as + g * nb, recs + g / GROUP_ROWS * nb * rec, K, R, index,
                                  acc[j]);
                }
            }
            for (long j = 0; j < nt; ++j)
                for (long r = 0; r < R; ++r) {
                    float v = lanes_sum(acc[j][r]);
                    y[(g + r) * ldy + n + j] = bias ? v + bias[n + j] : v;
                }
        }
    }
}
