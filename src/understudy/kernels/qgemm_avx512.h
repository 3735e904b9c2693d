/* qgemm.c's AVX-512 path (AVX512F + BW + VL + VNNI), included by qgemm.c.
 *
 * Same numbers, fewer instructions: for each row, column and block it forms the SAME exact
 * integers as qgemm.c's portable path (panel_row) and applies the same float steps in the
 * same order, so the two paths give one answer, and a row's answer depends on that row
 * alone.
 *
 * What makes it fast: a panel holds 16 columns side by side, so a 512-bit register is
 * 4 values of each of the 16 columns, and one vpdpbusd against 4 activations broadcast from
 * memory adds 16 columns' 4-product sums. A sub-block's integer sums are scaled once per
 * 16 columns (vpmulld), the mins and offsets come from the rows' sums per 16 or 32 values
 * (vpdpwssd), and the float step is one FMA per 16 columns. Up to GROUP rows share each
 * decoded register, their accumulators in registers for the whole panel.
 */
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

#define GROUP 4 /* rows that share a decoded panel-block, accumulators in registers (6 or
                   * 8 measured slower: they spill) */

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
 * order, left one thread at half the memory's bandwidth (fetching further ahead measured
 * slower) */
AI void fetch_block(const uint8_t *blk, const long bytes) {
    for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(blk + o), _MM_HINT_T0);
}

/* 4 int8 activations at p, in every dword (vpdpbusd's broadcast operand) */
AI __m512i four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* sum_e w[e] . a[4e..4e+3]: 16 dwords, exact (one chain: with GROUP rows in flight, more
 * chains a row measured no faster and need registers the rows use) */
AI __m512i dot(const __m512i *w, const int8_t *a, const int n) {
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], four(a));
    for (int e = 1; e < n; ++e) acc = _mm512_dpbusd_epi32(acc, w[e], four(a + 4 * e));
    return acc;
}

/* Q4_K: rows' accumulators f[r] += the panel-block's float step, for each block */
AI void q4_k_rows(const uint8_t *pk, long nb, const acts_t *A, long m0, const int R,
                  __m512 *f) {
    const __m512i low = _mm512_set1_epi8(0xf);
    for (long b = 0; b < nb; ++b) {
        const uint8_t *blk = pk + b * 2368;
        fetch_block(blk, 2368);
        __m512i isum[GROUP], jsum[GROUP];
        for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
            __m512i w[8];
            for (int l = 0; l < 4; ++l) {
                __m512i v = _mm512_loadu_si512((const void *)(blk + 320 + 64 * (4 * j + l)));
                w[2 * l] = _mm512_and_si512(v, low);
                w[2 * l + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + 16 * j)));
            for (int r = 0; r < R; ++r) {
                const int8_t *a = A->q + (m0 + r) * A->K + 256 * b + 32 * j;
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot(w, a, 8), sc));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        for (int p = 0; p < 4; ++p) {
            __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 192 + 32 * p)));
            for (int r = 0; r < R; ++r) {
                const int16_t *s32 = A->s32 + (m0 + r) * (A->K / 32) + 8 * b + 2 * p;
                jsum[r] = _mm512_dpwssd_epi32(jsum[r], mn, four((const int8_t *)s32));
            }
        }
        for (int r = 0; r < R; ++r) {
            __m512 s = _mm512_set1_ps(A->s[(m0 + r) * nb + b]);
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, d), f[r]);
            f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(jsum[r]), _mm512_mul_ps(s, dmin), f[r]);
        }
    }
}

/* each byte: bits 0-3 of lo, bits 4-7 of hi (one vpternlogd: c ? a : b with c = 0x0f) */
AI __m512i select_low(__m512i lo, __m512i hi) {
    return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0xf), 0xe4);
}

/* Q6_K: as q4_k_rows; 16 sub-blocks of 16 values, signed scales, values q - 32 */
AI void q6_k_rows(const uint8_t *pk, long nb, const acts_t *A, long m0, const int R,
                  __m512 *f) {
    const __m512i m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8((char)0xcc);
    for (long b = 0; b < nb; ++b) {
        const uint8_t *blk = pk + b * 3360;
        fetch_block(blk, 3360);
        __m512i isum[GROUP], jsum[GROUP];
        for (int r = 0; r < R; ++r) isum[r] = jsum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; ++p) {
            /* dword c: the scales of sub-blocks 2p (low word) and 2p + 1 (high word) */
            __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * p)));
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * p + h;
                __m512i sc = h ? _mm512_srai_epi32(pair, 16)
                               : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
                __m512i v0 = _mm512_loadu_si512((const void *)(blk + 288 + 128 * j));
                __m512i v1 = _mm512_loadu_si512((const void *)(blk + 288 + 128 * j + 64));
                __m512i hb = _mm512_loadu_si512((const void *)(blk + 2336 + 64 * j));
                /* each byte: bits 0-3 from the low nibbles, 4-5 from the top bits, 6-7 zero;
                 * hb's bits 0-1, 4-5 and 2-3, 6-7 apart, so every shift below brings only
                 * zeros or bits that the select drops (bits 0-3) next to the wanted two */
                __m512i h_lo = _mm512_and_si512(hb, m33), h_hi = _mm512_and_si512(hb, mcc);
                __m512i w[4] = {select_low(v0, _mm512_slli_epi16(h_lo, 4)),
                                select_low(_mm512_srli_epi16(v0, 4), _mm512_slli_epi16(h_hi, 2)),
                                select_low(v1, h_lo),
                                select_low(_mm512_srli_epi16(v1, 4), _mm512_srli_epi16(h_hi, 2))};
                for (int r = 0; r < R; ++r) {
                    const int8_t *a = A->q + (m0 + r) * A->K + 256 * b + 16 * j;
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot(w, a, 4), sc));
                }
            }
            for (int r = 0; r < R; ++r) {
                const int16_t *s16 = A->s16 + (m0 + r) * (A->K / 16) + 16 * b + 2 * p;
                jsum[r] = _mm512_dpwssd_epi32(jsum[r], pair, four((const int8_t *)s16));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        for (int r = 0; r < R; ++r) {
            __m512 s = _mm512_set1_ps(A->s[(m0 + r) * nb + b]);
            __m512i t = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(jsum[r], 5));
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, d), f[r]);
        }
    }
}

/* Q8_0 (values stored + 128), Q5_0 (q, 0..31) and Q4_0 (q, 0..15): 32-value blocks, the
 * offset times the rows' sums per block taken off the integer sum */
AI void b32_rows(const int type, const uint8_t *pk, long nb, const acts_t *A, long m0,
                 const int R, __m512 *f) {
    const __m512i low = _mm512_set1_epi8(0xf), fifth = _mm512_set1_epi8(0x10);
    const int q8 = type == T_Q8_0;
    const long pb = panel_bytes(type);
    for (long b = 0; b < nb; ++b) {
        const uint8_t *blk = pk + b * pb;
        fetch_block(blk, pb);
        __m512i w[8];
        if (q8) {
            for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512((const void *)(blk + 32 + 64 * g));
        } else if (type == T_Q4_0) {
            for (int t = 0; t < 4; ++t) {
                __m512i v = _mm512_loadu_si512((const void *)(blk + 32 + 64 * t));
                w[2 * t] = _mm512_and_si512(v, low);
                w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
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
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        for (int r = 0; r < R; ++r) {
            const int8_t *a = A->q + (m0 + r) * A->K + 32 * b;
            __m512i sum = dot(w, a, 8);
            const int32_t offset = (q8 ? 128 : type == T_Q5_0 ? 16 : 8) * (int32_t)A->s32[(m0 + r) * (A->K / 32) + b];
            __m512i t = _mm512_sub_epi32(sum, _mm512_set1_epi32(offset));
            __m512 s = _mm512_set1_ps(A->s[(m0 + r) * nb + b]);
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, d), f[r]);
        }
    }
}

/* One group of R rows (from m0) of one panel: y[r * ldy + c] = f + bias, columns < cols */
AI void group_rows(int type, const uint8_t *pk, const acts_t *A, long m0, const int R,
                   const float *bias, float *y, long ldy, long cols) {
    __m512 f[GROUP];
    for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
    if (type == T_Q4_K)
        q4_k_rows(pk, A->nb, A, m0, R, f);
    else if (type == T_Q6_K)
        q6_k_rows(pk, A->nb, A, m0, R, f);
    else
        b32_rows(type, pk, A->nb, A, m0, R, f);
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        __m512 v = bias ? _mm512_add_ps(f[r], add) : f[r];
        _mm512_mask_storeu_ps(y + r * ldy, keep, v);
    }
}

/* Rows m0..m0+rows-1 of one panel, GROUP at a time (one specialised copy per group size) */
static void panel_rows512(int type, const uint8_t *pk, const acts_t *A, long m0, long rows,
                          const float *bias, float *y, long ldy, long cols) {
    long r = 0;
    for (; r + GROUP <= rows; r += GROUP)
        group_rows(type, pk, A, m0 + r, GROUP, bias, y + r * ldy, ldy, cols);
    switch (rows - r) {
    case 1: group_rows(type, pk, A, m0 + r, 1, bias, y + r * ldy, ldy, cols); break;
    case 2: group_rows(type, pk, A, m0 + r, 2, bias, y + r * ldy, ldy, cols); break;
    case 3: group_rows(type, pk, A, m0 + r, 3, bias, y + r * ldy, ldy, cols); break;
    default: break;
    }
}
