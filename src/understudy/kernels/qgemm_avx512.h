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
 * across the whole weight row; each 512-bit multiply covers two 32-value chunks.
 */
#include <immintrin.h>

#define GROUP_ROWS 8 /* rows whose accumulators live in registers at once */

/* A k-quant block in registers: w[p] its values 64p..64p+63 in order (unsigned: Q4_K 0..15,
 * Q6_K 0..63); sc[p] the int16 multiplier of each maddubs pair of those values; mn the 16
 * int16 weights of the activation sums per 16 values (Q4_K: its mins, Q6_K: 32 x scales). */
typedef struct {
    __m512i w[4], sc[4];
    __m256i mn;
    float d, dmin;
} kregs;

/* int16 index vectors for _mm512_permutexvar_epi16: pair q of register p takes scale
 * Q4_K: 2p + (q >= 16)           (one scale per 32 values)
 * Q6_K: 4p + q / 8               (one scale per 16 values) */
static inline __m512i pair_index(int per16, int p) {
    int16_t idx[32];
    for (int q = 0; q < 32; ++q) idx[q] = (int16_t)(per16 ? 4 * p + q / 8 : 2 * p + (q >= 16));
    return _mm512_loadu_si512((const void *)idx);
}

static inline __attribute__((always_inline)) void load_q4_k_regs(const uint8_t *blk, kregs *u,
                                                                 const __m512i *index) {
    u->d = half_to_float(read_u16(blk));
    u->dmin = half_to_float(read_u16(blk + 2));
    /* 12 bytes of 6-bit scales and mins (q4_k_scales, four bytes at a time) */
    uint32_t a[3];
    memcpy(a, blk + 4, 12);
    uint32_t sc_lo = a[0] & 0x3f3f3f3fu, mn_lo = a[1] & 0x3f3f3f3fu;
    uint32_t sc_hi = (a[2] & 0x0f0f0f0fu) | (((a[0] >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((a[2] >> 4) & 0x0f0f0f0fu) | (((a[1] >> 6) & 0x03030303u) << 4);
    __m512i sc16 = _mm512_castsi128_si512(
        _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
    for (int p = 0; p < 4; ++p) u->sc[p] = _mm512_permutexvar_epi16(index[p], sc16);
    __m128i mn8 = _mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo);
    u->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
    /* 128 bytes: byte i of chunk c holds value 64c + i (low nibble) and 64c + 32 + i (high) */
    const uint8_t *qs = blk + 16;
    const __m512i low = _mm512_set1_epi8(0xf);
    for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * h));
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        u->w[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);     /* values 128h + 0..63 */
        u->w[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xee); /* values 128h + 64..127 */
    }
}

static inline __attribute__((always_inline)) void load_q6_k_regs(const uint8_t *blk, kregs *u,
                                                                 const __m512i *index) {
    const uint8_t *ql = blk, *qh = blk + 128;
    u->d = half_to_float(read_u16(blk + 208));
    u->dmin = 0.0f;
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    __m512i s512 = _mm512_castsi256_si512(s16);
    for (int p = 0; p < 4; ++p) u->sc[p] = _mm512_permutexvar_epi16(index[p], s512);
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

/* Rows 0..R-1 (R <= GROUP_ROWS, a constant after inlining) of one column over its nb k-quant
 * blocks: out[r] = the lanes summed in qgemm.c's fixed tree. */
static inline __attribute__((always_inline)) void kquant_group(
    int q4k, const uint8_t *row, long nb, const int8_t *aq, const float *as,
    const int16_t *ab, long K, const int R, const __m512i *index, float *out) {
    __m256 acc[GROUP_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    kregs u;
    for (long b = 0; b < nb; ++b) {
        if (q4k)
            load_q4_k_regs(row + b * 144, &u, index);
        else
            load_q6_k_regs(row + b * 210, &u, index);
        for (int r = 0; r < R; ++r) {
            const int8_t *a = aq + r * K + b * 256;
            __m512i isum = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) {
                __m512i x = _mm512_loadu_si512((const void *)(a + 64 * p));
                isum = _mm512_add_epi32(
                    isum, _mm512_madd_epi16(_mm512_maddubs_epi16(u.w[p], x), u.sc[p]));
            }
            __m256i i8 = _mm256_add_epi32(_mm512_castsi512_si256(isum),
                                          _mm512_extracti64x4_epi64(isum, 1));
            __m256i j8 = _mm256_madd_epi16(
                _mm256_loadu_si256((const __m256i *)(ab + r * (K / 16) + b * 16)), u.mn);
            float s = as[r * nb + b];
            if (q4k) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i8), _mm256_set1_ps(s * u.d), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(j8), _mm256_set1_ps(s * u.dmin),
                                          acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i8, j8)),
                                         _mm256_set1_ps(s * u.d), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r]);
        out[r] = lanes_sum(lanes);
    }
}

#define KQUANT_CASE(R)                                                                     \
    case R:                                                                                \
        if (q4k)                                                                           \
            kquant_group(1, row, nb, aq, as, ab, K, R, index, out);                        \
        else                                                                               \
            kquant_group(0, row, nb, aq, as, ab, K, R, index, out);                        \
        break;

/* kquant_group for a run-time R: one specialised copy per R, so the accumulators stay in
 * registers. */
static void kquant_rows512(int q4k, const uint8_t *row, long nb, const int8_t *aq,
                           const float *as, const int16_t *ab, long K, long R, float *out) {
    __m512i index[4];
    for (int p = 0; p < 4; ++p) index[p] = pair_index(!q4k, p);
    switch (R) {
        KQUANT_CASE(1)
        KQUANT_CASE(2)
        KQUANT_CASE(3)
        KQUANT_CASE(4)
        KQUANT_CASE(5)
        KQUANT_CASE(6)
        KQUANT_CASE(7)
        KQUANT_CASE(8)
    default: break;
    }
}

/* Blocks b and b + 1 of a Q8_0 / Q5_0 row, signed, in one register; their scales in d0, d1. */
static inline __attribute__((always_inline)) __m512i decode_pair(int q8, const uint8_t *blk,
                                                                 float *d0, float *d1) {
    long bytes = q8 ? 34 : 22;
    *d0 = half_to_float(read_u16(blk));
    *d1 = half_to_float(read_u16(blk + bytes));
    __m256i lo = q8 ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : decode_q5_0(blk);
    __m256i hi = q8 ? _mm256_loadu_si256((const __m256i *)(blk + bytes + 2))
                    : decode_q5_0(blk + bytes);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Rows 0..R-1 (R <= GROUP_ROWS, a constant after inlining) of one column over its nb
 * 32-value blocks: out[r] = the lanes summed in qgemm.c's fixed tree. The float steps run
 * one block at a time, in block order, as block32_rows does. */
static inline __attribute__((always_inline)) void block32_group(int q8, const uint8_t *row,
                                                                long nb, const int8_t *aq,
                                                                const float *as, long K,
                                                                const int R, float *out) {
    __m256 acc[GROUP_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    long bytes = q8 ? 34 : 22, b = 0;
    for (; b + 2 <= nb; b += 2) {
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
    if (b < nb) { /* an odd last block alone */
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
    for (int r = 0; r < R; ++r) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r]);
        out[r] = lanes_sum(lanes);
    }
}

#define BLOCK32_CASE(R)                                                                    \
    case R:                                                                                \
        if (q8)                                                                            \
            block32_group(1, row, nb, aq, as, K, R, out);                                  \
        else                                                                               \
            block32_group(0, row, nb, aq, as, K, R, out);                                  \
        break;

/* block32_group for a run-time R (one specialised copy per R). */
static void block32_rows512(int q8, const uint8_t *row, long nb, const int8_t *aq,
                            const float *as, long K, long R, float *out) {
    switch (R) {
        BLOCK32_CASE(1)
        BLOCK32_CASE(2)
        BLOCK32_CASE(3)
        BLOCK32_CASE(4)
        BLOCK32_CASE(5)
        BLOCK32_CASE(6)
        BLOCK32_CASE(7)
        BLOCK32_CASE(8)
    default: break;
    }
}
