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

/* Row r's integer dot with a decoded k-quant block: 16 int32 lanes, lanes 0-7 from the even
 * 32-value chunks and 8-15 from the odd ones (their sum is the AVX2 path's 8 lanes). */
static inline __attribute__((always_inline)) __m512i kquant_dot(const kregs *u, const int8_t *a) {
    __m512i isum = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
        __m512i pairs = _mm512_maddubs_epi16(u->w[p], _mm512_loadu_si512((const void *)(a + 64 * p)));
#if defined(__AVX512VNNI__)
        isum = _mm512_dpwssd_epi32(isum, pairs, u->sc[p]); /* = add(isum, madd(pairs, sc)) */
#else
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(pairs, u->sc[p]));
#endif
    }
    return isum;
}

/* Blocks b0..b1-1 of one column for rows 0..R-1 (R <= GROUP_ROWS, a constant after inlining):
 * acc[r] (8 float lanes, in memory between calls) += their lanes, block by block. Rows go two
 * to a 512-bit float register (lanes 0-7 the even row, 8-15 the odd): each lane still sees
 * exactly the AVX2 path's float steps, in its order. */
static inline __attribute__((always_inline)) void kquant_group(
    int q4k, const uint8_t *row, long b0, long b1, long nb, const int8_t *aq, const float *as,
    const int16_t *ab, long K, const int R, const __m512i *index, float (*accm)[8]) {
    __m512 acc[GROUP_ROWS / 2];
    __m256 last = _mm256_setzero_ps(); /* row R - 1 when R is odd */
    for (int i = 0; i < R / 2; ++i) acc[i] = _mm512_loadu_ps(accm[2 * i]);
    if (R & 1) last = _mm256_loadu_ps(accm[R - 1]);
    kregs u;
    for (long b = b0; b < b1; ++b) {
        if (q4k)
            load_q4_k_regs(row + b * 144, &u, index);
        else
            load_q6_k_regs(row + b * 210, &u, index);
        __m512 d = _mm512_set1_ps(u.d), dmin = _mm512_set1_ps(u.dmin);
        __m512i mn = _mm512_broadcast_i64x4(u.mn);
        for (int i = 0; i < R / 2; ++i) {
            long r = 2 * i;
            __m512i e = kquant_dot(&u, aq + r * K + b * 256);
            __m512i o = kquant_dot(&u, aq + (r + 1) * K + b * 256);
            __m512i isum = _mm512_add_epi32(_mm512_shuffle_i64x2(e, o, 0x44),
                                            _mm512_shuffle_i64x2(e, o, 0xee));
            __m512i bs = _mm512_inserti64x4(
                _mm512_castsi256_si512(
                    _mm256_loadu_si256((const __m256i *)(ab + r * (K / 16) + b * 16))),
                _mm256_loadu_si256((const __m256i *)(ab + (r + 1) * (K / 16) + b * 16)), 1);
            __m512i jsum = _mm512_madd_epi16(bs, mn);
            __m512 s = _mm512_insertf32x8(_mm512_set1_ps(as[r * nb + b]),
                                          _mm256_set1_ps(as[(r + 1) * nb + b]), 1);
            if (q4k) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, d), acc[i]);
                acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum), _mm512_mul_ps(s, dmin), acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum, jsum)),
                                         _mm512_mul_ps(s, d), acc[i]);
            }
        }
        if (R & 1) {
            long r = R - 1;
            __m512i e = kquant_dot(&u, aq + r * K + b * 256);
            __m256i i8 = _mm256_add_epi32(_mm512_castsi512_si256(e), _mm512_extracti64x4_epi64(e, 1));
            __m256i j8 = _mm256_madd_epi16(
                _mm256_loadu_si256((const __m256i *)(ab + r * (K / 16) + b * 16)), u.mn);
            float sr = as[r * nb + b];
            if (q4k) {
                last = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i8), _mm256_set1_ps(sr * u.d), last);
                last = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(j8), _mm256_set1_ps(sr * u.dmin), last);
            } else {
                last = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i8, j8)),
                                       _mm256_set1_ps(sr * u.d), last);
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

#define GROUP_CASE(R)                                                                      \
    case R:                                                                                \
        if (type == T_Q4_K)                                                                \
            kquant_group(1, row, b0, b1, nb, aq, as, ab, K, R, index, acc);                \
        else if (type == T_Q6_K)                                                           \
            kquant_group(0, row, b0, b1, nb, aq, as, ab, K, R, index, acc);                \
        else if (type == T_Q8_0)                                                           \
            block32_group(1, row, b0, b1, nb, aq, as, K, R, acc);                          \
        else                                                                               \
            block32_group(0, row, b0, b1, nb, aq, as, K, R, acc);                          \
        break;

/* The group functions for a run-time type and R: one specialised copy each, so that the
 * accumulators stay in registers. */
static void group_rows512(int type, const uint8_t *row, long b0, long b1, long nb,
                          const int8_t *aq, const float *as, const int16_t *ab, long K, long R,
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
#define L1_ROWS_BYTES 16384 /* a group's activations up to this size stay in L1 unchunked */
#define CHUNK_VALUES 2048   /* else K goes in chunks of this many values */

/* Columns n0..n1-1 for rows 0..rows-1: y[r * ldy + n] (+ bias[n]). Columns go NTILE at a
 * time and K in chunks, so the activations a tile reads stay in L1 for all of its columns;
 * each lane's float steps still run in block order. */
static void columns512(int type, const uint8_t *w, long row_bytes, const int8_t *aq,
                       const float *as, const int16_t *ab, const float *bias, float *y, long ldy,
                       long rows, long K, long n0, long n1) {
    long bsize = block_size(type), nb = K / bsize, bbytes = block_bytes(type);
    __m512i index[4];
    for (int p = 0; p < 4; ++p) index[p] = pair_index(type == T_Q6_K, p);
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
                     * hardware does not foresee the jumps: fetch the piece two columns ahead
                     * (or the next chunk's first two) ourselves */
                    long pj = j + 2 < nt ? j + 2 : j + 2 - nt, pb0 = j + 2 < nt ? b0 : b1;
                    if (chunk < nb && pb0 < nb) {
                        long pb1 = nb - pb0 < chunk ? nb : pb0 + chunk;
                        const uint8_t *p = w + (n + pj) * row_bytes;
                        for (long o = pb0 * bbytes; o < pb1 * bbytes; o += 64)
                            _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
                    }
                    group_rows512(type, w + (n + j) * row_bytes, b0, b1, nb, aq + g * K,
                                  as + g * nb, ab + g * (K / 16), K, R, index, acc[j]);
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
