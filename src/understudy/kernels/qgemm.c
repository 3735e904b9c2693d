/* Row-invariant matmul over a GGUF file's own quantized blocks, for CPUs:
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), W[n] one row of GGUF blocks.
 *
 * How: each row of x is quantized on its own to int8, one float scale per block of the
 * weight's block size (256 for the k-quants Q4_K and Q6_K, 32 for Q8_0 and Q5_0), plus the
 * sums of each 16 quantized values (the k-quants' mins and offsets need them). A block's
 * contribution to y[m, n] is an exact integer dot product of weight and activation ints,
 * computed in 8 int32 lanes, times float scales; the float partial sums accumulate in 8
 * lanes in block order (block 0, 1, ... of the row), then the 8 lanes are added in one
 * fixed tree, then the bias.
 *
 * Invariant: every step above depends only on row m of x and row n of W. Integer sums are
 * exact whatever their order, and the float steps run in one fixed order. So y[m, n] is
 * bitwise the same whether row m is computed alone or among M-1 others, whatever they
 * hold, however the columns are split across threads. The scalar fallback computes the
 * same integers in the same lanes and the same float steps (fmaf rounds once, as the
 * vector FMA does), so it gives the AVX2 path's bits.
 *
 * Speed: the weights are read in their GGUF layout (row-major, blocks contiguous), each
 * block is unpacked once per call into a small buffer and then serves every row of a tile
 * of up to TILE rows, so a call of a few rows reads the weights from memory once, as a
 * 1-row call does. Calls of more rows take TILE rows at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QG_AVX2 1
#else
#define QG_AVX2 0
#endif
#if QG_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QG_AVX512 1
#define QG_UNUSED_IN_AVX512 __attribute__((unused)) /* the AVX-512 path replaces it */
#else
#define QG_AVX512 0
#define QG_UNUSED_IN_AVX512
#endif

/* ggml's type ids */
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q6_K 14

#define TILE 32 /* rows per pass over the weights */
#define SERIAL_BELOW 1e6 /* multiply-adds: smaller calls run on one thread (no fork/join) */

static float half_to_float(uint16_t h) {
#if QG_AVX2 && defined(__F16C__)
    return _cvtsh_ss(h); /* the same value, one instruction */
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do {
                man <<= 1;
                ++e;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---- activations ----------------------------------------------------------------------- */

/* Row m of x [M, K] -> q [K] int8 (|q| <= 127), one scale per `block` values, and the sum of
 * each 16 quantized values (bsum [K / 16]). Each row alone decides its own scales. */
QG_UNUSED_IN_AVX512 static void quantize_row(const float *x, long K, int block, int8_t *q,
                                             float *scale, int16_t *bsum) {
    for (long b = 0; b < K / block; ++b) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scale[b] = amax / 127.0f;
        for (int i = 0; i < block; ++i) {
            float v = nearbyintf(xb[i] * inv);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[b * block + i] = (int8_t)v;
        }
    }
    for (long g = 0; g < K / 16; ++g) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += q[g * 16 + i];
        bsum[g] = (int16_t)s;
    }
}

/* ---- k-quants (256 values a block) -------------------------------------------------------
 * Unpacked block: q[256] unsigned (Q4_K 0..15, Q6_K 0..63); sc[t] the 16 int16 multipliers
 * of chunk t's 16 pair sums (the sub-block scales); mn[16] the int16 weights of the 16
 * activation sums per 16 values (Q4_K: its mins; Q6_K: 32 x its scales, the offset).
 *   Q4_K: block = s * (d * I - dmin * J);  Q6_K: block = s * d * (I - J)
 * with I = sum_t sc[t] . (q . a)_t and J = mn . bsum, both exact int32 (in 8 lanes). */
typedef struct {
    uint8_t q[256];
    int16_t sc[8][16];
    int16_t mn[16];
    float d, dmin;
} kblock;

static void q4_k_scales(const uint8_t *s, int sc[8], int m[8]) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            m[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
            m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

static void unpack_q4_k(const uint8_t *blk, kblock *u) {
    int sc[8], m[8];
    u->d = half_to_float(read_u16(blk));
    u->dmin = half_to_float(read_u16(blk + 2));
    q4_k_scales(blk + 4, sc, m);
    const uint8_t *qs = blk + 16;
#if QG_AVX2
    const __m256i low = _mm256_set1_epi8(0xf);
    for (int c = 0; c < 4; ++c) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        _mm256_storeu_si256((__m256i *)(u->q + 64 * c), _mm256_and_si256(v, low));
        _mm256_storeu_si256((__m256i *)(u->q + 64 * c + 32),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
    for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256((__m256i *)u->sc[j], _mm256_set1_epi16((short)sc[j]));
#else
    for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
            u->q[64 * c + i] = qs[32 * c + i] & 0xf;
            u->q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
    for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 16; ++l) u->sc[j][l] = (int16_t)sc[j];
#endif
    for (int j = 0; j < 8; ++j) u->mn[2 * j] = u->mn[2 * j + 1] = (int16_t)m[j];
}

static void unpack_q6_k(const uint8_t *blk, kblock *u) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    u->d = half_to_float(read_u16(blk + 208));
    u->dmin = 0.0f;
#if QG_AVX2
    const __m256i low = _mm256_set1_epi8(0xf), two = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i lo[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                         _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                         _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
        for (int c = 0; c < 4; ++c) {
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), two);
            _mm256_storeu_si256((__m256i *)(u->q + 128 * h + 32 * c),
                                _mm256_or_si256(lo[c], _mm256_slli_epi16(hi, 4)));
        }
    }
    for (int t = 0; t < 8; ++t)
        _mm256_storeu_si256((__m256i *)u->sc[t],
                            _mm256_set_m128i(_mm_set1_epi16(scales[2 * t + 1]),
                                             _mm_set1_epi16(scales[2 * t])));
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
    _mm256_storeu_si256((__m256i *)u->mn, _mm256_slli_epi16(s16, 5));
#else
    for (int h = 0; h < 2; ++h)
        for (int f = 0; f < 128; ++f) {
            uint8_t lo = ql[64 * h + (f & 63)];
            lo = f < 64 ? (lo & 0xf) : (lo >> 4);
            uint8_t hi = (qh[32 * h + (f & 31)] >> (2 * (f / 32))) & 3;
            u->q[128 * h + f] = (uint8_t)(lo | (hi << 4));
        }
    for (int t = 0; t < 8; ++t)
        for (int l = 0; l < 16; ++l) u->sc[t][l] = scales[2 * t + (l >= 8)];
    for (int g = 0; g < 16; ++g) u->mn[g] = (int16_t)(32 * scales[g]);
#endif
}

#if QG_AVX2
/* acc += the block's float lanes for one row, from its integer sums */
static inline void kblock_finish(const kblock *u, int with_min, __m256i isum, const int16_t *bs,
                                 float s, float *acc) {
    __m256i jsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bs),
                                     _mm256_loadu_si256((const __m256i *)u->mn));
    __m256 v = _mm256_loadu_ps(acc);
    if (with_min) {
        v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s * u->d), v);
        v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(jsum), _mm256_set1_ps(s * u->dmin), v);
    } else {
        v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, jsum)),
                            _mm256_set1_ps(s * u->d), v);
    }
    _mm256_storeu_ps(acc, v);
}

/* sum_t sc[t] . maddubs(q_t, a_t): exact (|pair| <= 2*63*127, lanes << 2^31) */
#define KDOT(isum, a, t, w, sc) \
    isum = _mm256_add_epi32(       \
        isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)((a) + 32 * (t)))), sc))
#endif

/* One block of column n for rows 0..rows-1 of a tile: acc[r] += the block's 8 lanes. */
static void kblock_rows(const kblock *u, int with_min, const int8_t *aq, const float *as,
                        const int16_t *ab, long K, long b, long rows, float (*acc)[8]) {
    long nb = K / 256, r = 0;
#if QG_AVX2
    for (; r + 4 <= rows; r += 4) { /* 4 rows share each load of the weights */
        const int8_t *a0 = aq + r * K + b * 256, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
        __m256i i0 = _mm256_setzero_si256(), i1 = i0, i2 = i0, i3 = i0;
        for (int t = 0; t < 8; ++t) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(u->q + 32 * t));
            __m256i sc = _mm256_loadu_si256((const __m256i *)u->sc[t]);
            KDOT(i0, a0, t, w, sc);
            KDOT(i1, a1, t, w, sc);
            KDOT(i2, a2, t, w, sc);
            KDOT(i3, a3, t, w, sc);
        }
        __m256i sums[4] = {i0, i1, i2, i3};
        for (int j = 0; j < 4; ++j)
            kblock_finish(u, with_min, sums[j], ab + (r + j) * (K / 16) + b * 16,
                          as[(r + j) * nb + b], acc[r + j]);
    }
#endif
    for (; r < rows; ++r) {
        const int8_t *a = aq + r * K + b * 256;
        const int16_t *bs = ab + r * (K / 16) + b * 16;
        float s = as[r * nb + b];
#if QG_AVX2
        __m256i isum = _mm256_setzero_si256();
        for (int t = 0; t < 8; ++t) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(u->q + 32 * t));
            KDOT(isum, a, t, w, _mm256_loadu_si256((const __m256i *)u->sc[t]));
        }
        kblock_finish(u, with_min, isum, bs, s, acc[r]);
#else
        float sd = s * u->d, sm = s * u->dmin;
        for (int l = 0; l < 8; ++l) { /* lane l: values 4l..4l+3 of each 32-value chunk */
            int32_t isum = 0, jsum = bs[2 * l] * u->mn[2 * l] + bs[2 * l + 1] * u->mn[2 * l + 1];
            for (int t = 0; t < 8; ++t)
                for (int e = 4 * l; e < 4 * l + 4; ++e)
                    isum += u->q[32 * t + e] * a[32 * t + e] * u->sc[t][e / 2];
            if (with_min) {
                acc[r][l] = fmaf((float)isum, sd, acc[r][l]);
                acc[r][l] = fmaf(-(float)jsum, sm, acc[r][l]);
            } else {
                acc[r][l] = fmaf((float)(isum - jsum), sd, acc[r][l]);
            }
        }
#endif
    }
}

#define GROUP32 8 /* 32-value blocks decoded together: each row's lanes stay in registers */

/* ---- 32-value blocks: Q8_0, Q5_0 -------------------------------------------------------
 * Decoded block: w[32] signed (Q8_0 as stored, Q5_0 q - 16), and d.
 * block = s * d * (w . a), exact int32 in 8 lanes. */
static void unpack_q8_0(const uint8_t *blk, int8_t *w, float *d) {
    *d = half_to_float(read_u16(blk));
    memcpy(w, blk + 2, 32);
}

#if QG_AVX2
/* A Q5_0 block's 32 values (q - 16, signed) in one register. */
static inline __m256i decode_q5_0(const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    __m128i v = _mm_loadu_si128((const __m128i *)(blk + 6)), low = _mm_set1_epi8(0xf);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    /* bit i of qh -> byte i: spread each byte of qh over 8 bytes, test one bit each */
    __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}
#endif

static void unpack_q5_0(const uint8_t *blk, int8_t *w, float *d) {
    *d = half_to_float(read_u16(blk));
#if QG_AVX2
    _mm256_storeu_si256((__m256i *)w, decode_q5_0(blk));
#else
    uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) |
                  ((uint32_t)blk[5] << 24);
    const uint8_t *qs = blk + 6;
    for (int i = 0; i < 32; ++i) {
        int lo = i < 16 ? (qs[i] & 0xf) : (qs[i - 16] >> 4);
        w[i] = (int8_t)((lo | (((qh >> i) & 1) << 4)) - 16);
    }
#endif
}

static void block32_rows(const int8_t *w, const float *d, long g, const int8_t *aq,
                         const float *as, long K, long b, long rows, float (*acc)[8]) {
    long nb = K / 32;
    for (long r = 0; r < rows; ++r) {
        const int8_t *a = aq + r * K + b * 32;
        const float *s = as + r * nb + b;
#if QG_AVX2
        __m256 v = _mm256_loadu_ps(acc[r]);
        for (long j = 0; j < g; ++j) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
            __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a + 32 * j)), wv);
            /* |w| read unsigned (-128 -> 128); exact: |pair| <= 2*128*127 */
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), x);
            __m256i isum = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
            v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s[j] * d[j]), v);
        }
        _mm256_storeu_ps(acc[r], v);
#else
        for (long j = 0; j < g; ++j)
            for (int l = 0; l < 8; ++l) {
                int32_t isum = 0;
                for (int e = 4 * l; e < 4 * l + 4; ++e) isum += w[32 * j + e] * a[32 * j + e];
                acc[r][l] = fmaf((float)isum, s[j] * d[j], acc[r][l]);
            }
#endif
    }
}

/* ---- the call ------------------------------------------------------------------------- */

/* The 8 lanes in one fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7)), as the AVX2 path adds them. */
static float lanes_sum(const float v[8]) {
    float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
    return (s0 + s2) + (s1 + s3);
}

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

static long block_size(int type) { return type == T_Q4_K || type == T_Q6_K ? 256 : 32; }

static long block_bytes(int type) {
    switch (type) {
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    case T_Q8_0: return 34;
    case T_Q5_0: return 22;
    default: return 0;
    }
}

#if QG_AVX512
#include "qgemm_avx512.h"
#endif

/* Columns n0..n1-1 for rows m0..m0+rows-1 (rows <= TILE). */
QG_UNUSED_IN_AVX512 static void columns(int type, const uint8_t *w, long row_bytes, const int8_t *aq,
                    const float *as, const int16_t *ab, const float *bias, float *y, long ldy,
                    long m0, long rows, long K, long n0, long n1) {
    long bsize = block_size(type), nb = K / bsize;
    long bbytes = block_bytes(type);
    float acc[TILE][8];
    const int8_t *a = aq + m0 * K;
    const float *s = as + m0 * nb;
    const int16_t *bs = ab + m0 * (K / 16);
    for (long n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        float out[TILE];
        if (type == T_Q4_K || type == T_Q6_K) {
            kblock ku;
            memset(acc, 0, sizeof(float) * 8 * rows);
            for (long b = 0; b < nb; ++b) {
                if (type == T_Q4_K)
                    unpack_q4_k(row + b * bbytes, &ku);
                else
                    unpack_q6_k(row + b * bbytes, &ku);
                kblock_rows(&ku, type == T_Q4_K, a, s, bs, K, b, rows, acc);
            }
            for (long r = 0; r < rows; ++r) out[r] = lanes_sum(acc[r]);
        } else {
            int8_t bw[GROUP32 * 32];
            float bd[GROUP32];
            memset(acc, 0, sizeof(float) * 8 * rows);
            for (long b = 0; b < nb; b += GROUP32) {
                long g = nb - b < GROUP32 ? nb - b : GROUP32;
                for (long j = 0; j < g; ++j) {
                    if (type == T_Q8_0)
                        unpack_q8_0(row + (b + j) * bbytes, bw + 32 * j, bd + j);
                    else
                        unpack_q5_0(row + (b + j) * bbytes, bw + 32 * j, bd + j);
                }
                block32_rows(bw, bd, g, a, s, K, b, rows, acc);
            }
            for (long r = 0; r < rows; ++r) out[r] = lanes_sum(acc[r]);
        }
        for (long r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = bias ? out[r] + bias[n] : out[r];
    }
}

/* x [M, K] float32; w: N rows of row_bytes bytes, each K / block_size GGUF blocks of `type`;
 * bias [N] or NULL; y [M, ldy] float32, columns 0..N-1 written. Returns 0, or -1 for a
 * type or shape it does not take (K not a multiple of the block size, row_bytes too small),
 * or -2 when out of memory. Threads: OpenMP, contiguous column ranges. */
int understudy_qgemm(int type, const float *x, const uint8_t *w, long row_bytes,
                     const float *bias, float *y, long ldy, long M, long K, long N,
                     int threads) {
    long bsize = block_size(type), bbytes = block_bytes(type);
    if (bbytes == 0 || K % bsize != 0 || row_bytes < (K / bsize) * bbytes || ldy < N)
        return -1;
    if (M <= 0 || N <= 0) return 0;
    if (threads < 1 || (double)M * K * N < SERIAL_BELOW) threads = 1;
    long nb = K / bsize;
    /* 64-byte aligned: a row's 512-bit loads never straddle two cache lines */
    int8_t *aq = aligned_alloc(64, round_up((size_t)(M * K), 64));
    float *as = aligned_alloc(64, round_up(sizeof(float) * (size_t)(M * nb), 64));
    int16_t *ab = aligned_alloc(64, round_up(sizeof(int16_t) * (size_t)(M * (K / 16)), 64));
    uint8_t *recs = NULL; /* AVX-512: the activations regrouped (pack_group512, pack_group32) */
    int need_recs = 0;
#if QG_AVX512
    long groups = (M + GROUP_ROWS - 1) / GROUP_ROWS;
    long rec = bsize == 256 ? krec(GROUP_ROWS) : rec32(GROUP_ROWS);
    need_recs = 1;
    recs = aligned_alloc(64, (size_t)(groups * nb * rec));
#endif
    if (!aq || !as || !ab || (need_recs && !recs)) {
        free(aq);
        free(as);
        free(ab);
        free(recs);
        return -2;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (long m = 0; m < M; ++m)
#if QG_AVX512
            quantize_row512(x + m * K, K, (int)bsize, aq + m * K, as + m * nb, ab + m * (K / 16));
#else
            quantize_row(x + m * K, K, (int)bsize, aq + m * K, as + m * nb, ab + m * (K / 16));
#endif
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        long n0 = N * t / nt, n1 = N * (t + 1) / nt;
#if QG_AVX512
#pragma omp for schedule(static)
        for (long g = 0; g < groups; ++g) {
            long R = M - g * GROUP_ROWS < GROUP_ROWS ? M - g * GROUP_ROWS : GROUP_ROWS;
            if (bsize == 256)
                pack_group512(type == T_Q4_K, aq + g * GROUP_ROWS * K, as + g * GROUP_ROWS * nb,
                              ab + g * GROUP_ROWS * (K / 16), K, R, recs + g * nb * rec);
            else
                pack_group32(aq + g * GROUP_ROWS * K, as + g * GROUP_ROWS * nb, K, R,
                             recs + g * nb * rec);
        }
        columns512(type, w, row_bytes, aq, as, recs, bias, y, ldy, M, K, n0, n1);
#else
        for (long m0 = 0; m0 < M; m0 += TILE) {
            long rows = M - m0 < TILE ? M - m0 : TILE;
            columns(type, w, row_bytes, aq, as, ab, bias, y, ldy, m0, rows, K, n0, n1);
        }
#endif
    }
    free(aq);
    free(as);
    free(ab);
    free(recs);
    return 0;
}

/* Rows `index` [R] of W, dequantized to float32 out [R, K] (embedding lookups, exports). */
int understudy_qdequant_rows(int type, const uint8_t *w, long row_bytes, const long *index,
                             long R, long K, float *out) {
    long bsize = block_size(type), bbytes = block_bytes(type);
    if (bbytes == 0 || K % bsize != 0) return -1;
    kblock ku;
    int8_t bw[32];
    float bd;
    for (long r = 0; r < R; ++r) {
        const uint8_t *row = w + index[r] * row_bytes;
        float *o = out + r * K;
        for (long b = 0; b < K / bsize; ++b) {
            const uint8_t *blk = row + b * bbytes;
            float *ob = o + b * bsize;
            if (type == T_Q4_K) {
                unpack_q4_k(blk, &ku);
                for (int e = 0; e < 256; ++e)
                    ob[e] = ku.d * (float)ku.sc[e / 32][0] * (float)ku.q[e] -
                            ku.dmin * (float)ku.mn[e / 16];
            } else if (type == T_Q6_K) {
                unpack_q6_k(blk, &ku);
                for (int e = 0; e < 256; ++e)
                    ob[e] = ku.d * (float)(ku.mn[e / 16] / 32) * (float)(ku.q[e] - 32);
            } else {
                if (type == T_Q8_0)
                    unpack_q8_0(blk, bw, &bd);
                else
                    unpack_q5_0(blk, bw, &bd);
                for (int e = 0; e < 32; ++e) ob[e] = bd * (float)bw[e];
            }
        }
    }
    return 0;
}

/* 0: portable C, 1: AVX2, 2: AVX-512 */
int understudy_qgemm_simd(void) { return QG_AVX512 ? 2 : QG_AVX2; }
