/* Row-invariant matmul over a GGUF file's quantized blocks, for CPUs:
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), W's rows GGUF blocks, repacked once.
 *
 * Layout (understudy_qpack): the columns go in panels of 16 (the last one padded with
 * zero columns); a panel holds, block after block, the 16 columns' block b side by side,
 * so one 512-bit register holds 4 consecutive values of each of the 16 columns and one
 * int8 dot-product instruction advances 16 columns at once against 4 activations
 * broadcast. The bytes are the same blocks rearranged (the same count, plus 64 bytes of
 * unpacked scales per Q4_K panel-block); the weights are read once per call, at memory
 * speed, for 1 row as for several.
 *
 * How: each row of x is quantized on its own to int8, one float scale per block of the
 * weight's block size (256 for the k-quants Q4_K and Q6_K, 32 for Q8_0, Q5_0 and Q4_0), with the
 * sums of each 16 quantized values (the offsets and mins need them). A block's
 * contribution to y[m, n] is an exact integer (its 4-bit x 8-bit products summed in int32,
 * times the integer sub-block scales) converted to float once and multiplied by the float
 * product s * d of the row's and the column's block scales; one float accumulator per
 * (row, column) takes the blocks in order, with fused multiply-adds; then the bias.
 *
 * Invariant: every step depends only on row m of x and column n of W, in one fixed order.
 * Integer sums are exact whatever their grouping. So y[m, n] is bitwise the same whether
 * row m is computed alone or among M-1 others, whatever they hold, however the panels are
 * split across threads. The portable C path computes the same integers and the same float
 * steps as the AVX2 and AVX-512 ones (fmaf rounds once, as the vector FMA does): the same
 * bits on every instruction set.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX512 1
#define QG_AVX2 0
#define QG_UNUSED_IN_AVX512 __attribute__((unused)) /* the AVX-512 path replaces it */
#define QG_UNUSED_IN_SIMD QG_UNUSED_IN_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX512 0
#define QG_AVX2 1
#define QG_UNUSED_IN_AVX512
#define QG_UNUSED_IN_SIMD __attribute__((unused)) /* the AVX2 path replaces it */
#else
#define QG_AVX512 0
#define QG_AVX2 0
#define QG_UNUSED_IN_AVX512
#define QG_UNUSED_IN_SIMD
#endif

/* ggml's type ids */
#define T_Q4_0 2
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q6_K 14

#define PANEL 16 /* columns side by side */
#define MAX_PARTS 4 /* weights in one understudy_qgemm_parts call */
#define ROW_TILE 32 /* rows whose activations one pass over the panels serves (L2-sized) */
/* multiply-adds: smaller calls run on one thread (no fork/join). A one-row call of the 0.5B
 * draft's output projection (896 x 896, 0.8M) reads its 0.45 MB at ~12.5 GB/s on one thread
 * of the 2-core Zen 3 and ~19 on two, where the fork costs a few microseconds */
#define SERIAL_BELOW 1e5

static float half_to_float(uint16_t h) {
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

static long block_size(int type) { return type == T_Q4_K || type == T_Q6_K ? 256 : 32; }

/* bytes of one GGUF block */
static long block_bytes(int type) {
    switch (type) {
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    case T_Q8_0: return 34;
    case T_Q5_0: return 22;
    case T_Q4_0: return 18;
    default: return 0;
    }
}

/* bytes of one panel-block: 16 columns' block b (the layouts below) */
static long panel_bytes(int type) {
    switch (type) {
    case T_Q4_K: return 2368;
    case T_Q6_K: return 3360;
    case T_Q8_0: return 544;
    case T_Q5_0: return 352;
    case T_Q4_0: return 288;
    default: return 0;
    }
}

/* ---- GGUF blocks, unpacked (value order) ------------------------------------------------ */

/* Q4_K: value e = d * sc[e / 32] * q[e] - dmin * mn[e / 32], q 0..15 */
static void unpack_q4_k(const uint8_t *blk, uint8_t q[256], int sc[8], int mn[8], uint16_t *d,
                        uint16_t *dmin) {
    const uint8_t *s = blk + 4, *qs = blk + 16;
    *d = read_u16(blk);
    *dmin = read_u16(blk + 2);
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
    for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
            q[64 * c + i] = qs[32 * c + i] & 0xf;
            q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
}

/* Q6_K: value e = d * sc[e / 16] * (q[e] - 32), q 0..63 */
static void unpack_q6_k(const uint8_t *blk, uint8_t q[256], int8_t sc[16], uint16_t *d) {
    const uint8_t *ql = blk, *qh = blk + 128;
    memcpy(sc, blk + 192, 16);
    *d = read_u16(blk + 208);
    for (int h = 0; h < 2; ++h)
        for (int f = 0; f < 128; ++f) {
            uint8_t lo = ql[64 * h + (f & 63)];
            lo = f < 64 ? (lo & 0xf) : (lo >> 4);
            uint8_t hi = (qh[32 * h + (f & 31)] >> (2 * (f / 32))) & 3;
            q[128 * h + f] = (uint8_t)(lo | (hi << 4));
        }
}

/* Q8_0, Q5_0 and Q4_0: value e = d * w[e], w signed (Q5_0: its 5-bit q - 16; Q4_0: its
 * 4-bit q - 8) */
static void unpack_32(int type, const uint8_t *blk, int8_t w[32], uint16_t *d) {
    *d = read_u16(blk);
    if (type == T_Q8_0) {
        memcpy(w, blk + 2, 32);
        return;
    }
    if (type == T_Q4_0) {
        for (int i = 0; i < 32; ++i) w[i] = (int8_t)((i < 16 ? (blk[2 + i] & 0xf) : (blk[2 + i - 16] >> 4)) - 8);
        return;
    }
    uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) |
                  ((uint32_t)blk[5] << 24);
    const uint8_t *qs = blk + 6;
    for (int i = 0; i < 32; ++i) {
        int lo = i < 16 ? (qs[i] & 0xf) : (qs[i - 16] >> 4);
        w[i] = (int8_t)((lo | (((qh >> i) & 1) << 4)) - 16);
    }
}

/* ---- the panel layouts --------------------------------------------------------------------
 * Column c (0..15) of a panel; "pair t" is 64 bytes whose byte 4c + i holds, in its low
 * nibble, value 8t + i of column c and, in its high nibble, value 8t + 4 + i (i = 0..3), so
 * one load gives two registers of 4 values x 16 columns.
 *
 * Q4_K, 2368 bytes: d[16], dmin[16] (float16); sc[8][16] (u8, sub-block j's scale of column
 *   c); mn[4][16][2] (u8, the mins of sub-blocks 2p, 2p + 1 of column c); 32 pairs.
 * Q6_K, 3360 bytes: d[16] (float16); sc[8][16][2] (int8, the scales of 16-value sub-blocks
 *   2p, 2p + 1); 32 pairs of the low 4 bits; 16 quads of the top 2 bits: quad u's byte
 *   4c + i holds those of values 16u + i, + 4, + 8, + 12 of column c at bits 0, 2, 4, 6.
 * Q8_0, 544 bytes: d[16] (float16); 8 groups of 64 bytes, byte 4c + i = w(c, 4g + i) + 128.
 * Q5_0, 352 bytes: d[16] (float16); 4 pairs of its low 4 bits; 8 groups of 8 bytes of its
 *   fifth bits, bit 4c + i of group g that of value 4g + i of column c (the AVX2 build
 *   orders these 64 bytes as its kernel reads them: qgemm_avx2.h's b32_half).
 * Q4_0, 288 bytes: d[16] (float16); 4 pairs of its 4-bit q. */

static void pack_pairs(uint8_t *out, const uint8_t *q, long stride, int values) {
    /* q: column c's values at q + c * stride; low 4 bits of each */
    for (int t = 0; t < values / 8; ++t)
        for (int c = 0; c < PANEL; ++c)
            for (int i = 0; i < 4; ++i)
                out[64 * t + 4 * c + i] = (uint8_t)((q[c * stride + 8 * t + i] & 0xf) |
                                                    ((q[c * stride + 8 * t + 4 + i] & 0xf) << 4));
}

static void pack_block(int type, const uint8_t *const blk[PANEL], uint8_t *out) {
    long bytes = panel_bytes(type);
    uint8_t q[PANEL][256];
    memset(out, 0, (size_t)bytes);
    memset(q, 0, sizeof(q));
    for (int c = 0; c < PANEL; ++c) {
        if (!blk[c]) continue; /* a padding column: all zero */
        uint16_t d, dmin;
        if (type == T_Q4_K) {
            int sc[8], mn[8];
            unpack_q4_k(blk[c], q[c], sc, mn, &d, &dmin);
            memcpy(out + 2 * c, &d, 2);
            memcpy(out + 32 + 2 * c, &dmin, 2);
            for (int j = 0; j < 8; ++j) {
                out[64 + 16 * j + c] = (uint8_t)sc[j];
                out[192 + 32 * (j / 2) + 2 * c + j % 2] = (uint8_t)mn[j];
            }
        } else if (type == T_Q6_K) {
            int8_t sc[16];
            unpack_q6_k(blk[c], q[c], sc, &d);
            memcpy(out + 2 * c, &d, 2);
            for (int j = 0; j < 16; ++j) out[32 + 32 * (j / 2) + 2 * c + j % 2] = (uint8_t)sc[j];
            for (int u = 0; u < 16; ++u)
                for (int i = 0; i < 4; ++i) {
                    uint8_t h = 0;
                    for (int k = 0; k < 4; ++k) h |= (uint8_t)((q[c][16 * u + 4 * k + i] >> 4) << (2 * k));
                    out[2336 + 64 * u + 4 * c + i] = h;
                }
        } else {
            int8_t w[32];
            unpack_32(type, blk[c], w, &d);
            memcpy(out + 2 * c, &d, 2);
            for (int e = 0; e < 32; ++e) {
                if (type == T_Q8_0) {
                    out[32 + 64 * (e / 4) + 4 * c + e % 4] = (uint8_t)(w[e] + 128);
                } else if (type == T_Q4_0) {
                    q[c][e] = (uint8_t)(w[e] + 8); /* 0..15 */
                } else {
                    int v = w[e] + 16; /* 0..31 */
                    q[c][e] = (uint8_t)(v & 0xf);
#if QG_AVX2 /* the fifth bits as qgemm_avx2.h's b32_half reads them */
                    if (v & 0x10) out[288 + 32 * (c / 8) + 4 * (c % 8) + e % 4] |= (uint8_t)(1u << (e / 4));
#else
                    if (v & 0x10) out[288 + 8 * (e / 4) + (4 * c + e % 4) / 8] |= (uint8_t)(1u << ((4 * c + e % 4) % 8));
#endif
                }
            }
        }
    }
    if (type == T_Q4_K) pack_pairs(out + 320, &q[0][0], 256, 256);
    if (type == T_Q6_K) pack_pairs(out + 288, &q[0][0], 256, 256);
    if (type == T_Q5_0 || type == T_Q4_0) pack_pairs(out + 32, &q[0][0], 256, 32);
}

/* Bytes of W [N, K] of `type` packed (0: a type or K it does not take). */
long understudy_qpack_bytes(int type, long K, long N) {
    long bsize = block_size(type), pb = panel_bytes(type);
    if (pb == 0 || K <= 0 || N <= 0 || K % bsize) return 0;
    return (N + PANEL - 1) / PANEL * (K / bsize) * pb;
}

/* W: N rows of row_bytes bytes, each K / block_size GGUF blocks of `type`, into out
 * (understudy_qpack_bytes bytes, the panel layout). Returns 0, or -1 for what it does not
 * take. Panels on OpenMP threads. */
int understudy_qpack(int type, const uint8_t *w, long row_bytes, long K, long N, uint8_t *out,
                     int threads) {
    long bsize = block_size(type), bbytes = block_bytes(type), pb = panel_bytes(type);
    if (understudy_qpack_bytes(type, K, N) == 0 || row_bytes < K / bsize * bbytes) return -1;
    long nb = K / bsize, panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (long p = 0; p < panels; ++p)
        for (long b = 0; b < nb; ++b) {
            const uint8_t *blk[PANEL];
            for (int c = 0; c < PANEL; ++c) {
                long n = p * PANEL + c;
                blk[c] = n < N ? w + n * row_bytes + b * bbytes : NULL;
            }
            pack_block(type, blk, out + (p * nb + b) * pb);
        }
    return 0;
}

/* ---- activations ----------------------------------------------------------------------- */

/* Row x [K] -> q [K] int8 (|q| <= 127), one scale per `block` values, and the sum of each
 * 16 quantized values (bsum [K / 16]). Each row alone decides its own scales. */
QG_UNUSED_IN_SIMD static void quantize_row(const float *x, long K, int block, int8_t *q, float *scale,
                         int16_t *bsum) {
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

/* A call's quantized rows: row m's ints at q + m * K, its block scales at s + m * nb, its
 * sums per 16 values at s16 + m * (K / 16) and per 32 at s32 + m * (K / 32). */
typedef struct {
    const int8_t *q;
    const float *s;
    const int16_t *s16, *s32;
    long K, nb;
} acts_t;

/* ---- the portable path -------------------------------------------------------------------
 * One panel for one row: out[c] = the float accumulator of column c after every block. */
QG_UNUSED_IN_SIMD static void panel_row(int type, const uint8_t *pk, const acts_t *A, long m, float out[PANEL]) {
    const long K = A->K, nb = A->nb, pb = panel_bytes(type);
    const int8_t *a = A->q + m * K;
    const float *s = A->s + m * nb;
    const int16_t *s16 = A->s16 + m * (K / 16), *s32 = A->s32 + m * (K / 32);
    float f[PANEL] = {0};
    for (long b = 0; b < nb; ++b) {
        const uint8_t *blk = pk + b * pb;
        int32_t isum[PANEL] = {0}, jsum[PANEL] = {0};
        if (type == T_Q4_K || type == T_Q6_K) {
            const int q4 = type == T_Q4_K, subs = q4 ? 8 : 16, width = 256 / subs;
            const uint8_t *lo4 = blk + (q4 ? 320 : 288), *top = blk + 2336;
            const int8_t *ab = a + 256 * b;
            for (int j = 0; j < subs; ++j) {
                int32_t dot[PANEL] = {0};
                for (int e = width * j; e < width * (j + 1); ++e) {
                    const uint8_t *pair = lo4 + 64 * (e / 8);
                    const int i = e % 4, high = e % 8 >= 4;
                    for (int c = 0; c < PANEL; ++c) {
                        int v = high ? pair[4 * c + i] >> 4 : pair[4 * c + i] & 0xf;
                        if (!q4) v |= ((top[64 * (e / 16) + 4 * c + i] >> (2 * (e % 16 / 4))) & 3) << 4;
                        dot[c] += v * ab[e];
                    }
                }
                for (int c = 0; c < PANEL; ++c) {
                    int scale = q4 ? blk[64 + 16 * j + c]
                                   : (int8_t)blk[32 + 32 * (j / 2) + 2 * c + j % 2];
                    isum[c] += dot[c] * scale;
                }
            }
            for (int j = 0; j < subs; ++j) /* mins (Q4_K) or 32 x scales (Q6_K) x sums */
                for (int c = 0; c < PANEL; ++c)
                    jsum[c] += q4 ? blk[192 + 32 * (j / 2) + 2 * c + j % 2] * s32[8 * b + j]
                                  : (int8_t)blk[32 + 32 * (j / 2) + 2 * c + j % 2] * s16[16 * b + j];
            for (int c = 0; c < PANEL; ++c) {
                float sd = s[b] * half_to_float(read_u16(blk + 2 * c));
                if (q4) {
                    float sm = s[b] * half_to_float(read_u16(blk + 32 + 2 * c));
                    f[c] = fmaf((float)isum[c], sd, f[c]);
                    f[c] = fmaf(-(float)jsum[c], sm, f[c]);
                } else {
                    f[c] = fmaf((float)(isum[c] - 32 * jsum[c]), sd, f[c]);
                }
            }
        } else {
            const int q8 = type == T_Q8_0;
            const int8_t *ab = a + 32 * b;
            for (int e = 0; e < 32; ++e)
                for (int c = 0; c < PANEL; ++c) {
                    int v;
                    if (q8) {
                        v = blk[32 + 64 * (e / 4) + 4 * c + e % 4];
                    } else {
                        const uint8_t *pair = blk + 32 + 64 * (e / 8);
                        v = e % 8 >= 4 ? pair[4 * c + e % 4] >> 4 : pair[4 * c + e % 4] & 0xf;
                        int bit = 4 * c + e % 4;
                        if (type == T_Q5_0) v |= ((blk[288 + 8 * (e / 4) + bit / 8] >> (bit % 8)) & 1) << 4;
                    }
                    isum[c] += v * ab[e];
                }
            const int32_t offset = (q8 ? 128 : type == T_Q5_0 ? 16 : 8) * (int32_t)s32[b];
            for (int c = 0; c < PANEL; ++c) {
                float sd = s[b] * half_to_float(read_u16(blk + 2 * c));
                f[c] = fmaf((float)(isum[c] - offset), sd, f[c]);
            }
        }
    }
    memcpy(out, f, sizeof(f));
}

#if QG_AVX512
#include "qgemm_avx512.h"
#elif QG_AVX2
#include "qgemm_avx2.h"
#endif

/* ---- the call ------------------------------------------------------------------------- */

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* A call's activations quantized for one block size (32 or 256): acts_t and its buffers. */
static int acts_alloc(acts_t *A, long M, long K, long bsize) {
    /* 64-byte aligned: a row's 512-bit loads never straddle two cache lines */
    int8_t *q = aligned_alloc(64, round_up((size_t)(M * K), 64));
    float *s = aligned_alloc(64, round_up(sizeof(float) * (size_t)(M * (K / bsize)), 64));
    int16_t *s16 = aligned_alloc(64, round_up(sizeof(int16_t) * (size_t)(M * (K / 16)), 64));
    int16_t *s32 = aligned_alloc(64, round_up(sizeof(int16_t) * (size_t)(M * (K / 32)), 64));
    *A = (acts_t){q, s, s16, s32, K, K / bsize};
    return q && s && s16 && s32 ? 0 : -2;
}

static void acts_free(acts_t *A) {
    free((void *)A->q);
    free((void *)A->s);
    free((void *)A->s16);
    free((void *)A->s32);
}

/* row m of x [M, K] quantized into A (block size K / A->nb) */
static void acts_quantize(const float *x, long m, const acts_t *A) {
    const long K = A->K, bsize = K / A->nb;
    int8_t *q = (int8_t *)A->q + m * K;
    float *s = (float *)A->s + m * A->nb;
    int16_t *s16 = (int16_t *)A->s16 + m * (K / 16), *s32 = (int16_t *)A->s32 + m * (K / 32);
#if QG_AVX512
    quantize_row512(x + m * K, K, (int)bsize, q, s, s16);
#elif QG_AVX2
    quantize_row_avx2(x + m * K, K, (int)bsize, q, s, s16);
#else
    quantize_row(x + m * K, K, (int)bsize, q, s, s16);
#endif
    for (long g = 0; g < K / 32; ++g) s32[g] = (int16_t)(s16[2 * g] + s16[2 * g + 1]);
}

/* Several weights against one x, in one call: part p writes y's columns first[p] ..
 * first[p] + N[p] - 1, x W_p^T (+ bias[p]); W_p [N[p], K] of types[p] in the panel layout
 * (understudy_qpack), bias[p] [N[p]] or NULL; x [M, K] float32; y [M, ldy] float32.
 * x is quantized once for each block size among the parts, and the panels of all the parts
 * are shared over the threads in one parallel region: a layer's q, k and v (or gate and
 * up) cost one fork and one quantization, and small ones run on every thread together.
 * Each (row, column) is computed exactly as a call of its part alone computes it (the
 * header's invariant): the same bits. Returns 0, or -1 for a type or shape it does not
 * take, or -2 when out of memory. */
int understudy_qgemm_parts(long parts, const int *types, const uint8_t *const *packed,
                           const float *const *bias, const long *first, const long *N,
                           const float *x, float *y, long ldy, long M, long K, int threads) {
    long panels_before[MAX_PARTS + 1] = {0}, columns = 0;
    int needs[2] = {0, 0}; /* block size 32, 256 */
    if (parts < 1 || parts > MAX_PARTS || K <= 0) return -1;
    for (long p = 0; p < parts; ++p) {
        long bsize = block_size(types[p]);
        if (panel_bytes(types[p]) == 0 || K % bsize != 0 || N[p] < 0 || first[p] < 0 ||
            first[p] + N[p] > ldy)
            return -1;
        needs[bsize == 256] = 1;
        panels_before[p + 1] = panels_before[p] + (N[p] + PANEL - 1) / PANEL;
        columns += N[p];
    }
    if (M <= 0 || columns == 0) return 0;
    if (threads < 1 || (double)M * K * columns < SERIAL_BELOW) threads = 1;
    acts_t A[2] = {{0}, {0}};
    int code = 0;
    for (int g = 0; g < 2; ++g)
        if (needs[g] && acts_alloc(&A[g], M, K, g ? 256 : 32)) code = -2;
    if (code) {
        for (int g = 0; g < 2; ++g) acts_free(&A[g]);
        return code;
    }
    const long total = panels_before[parts];
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        for (int g = 0; g < 2; ++g) {
            if (!needs[g]) continue;
#pragma omp for schedule(static)
            for (long m = 0; m < M; ++m) acts_quantize(x, m, &A[g]);
        }
        for (long m0 = 0; m0 < M; m0 += ROW_TILE) {
            long rows = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
#pragma omp for schedule(static)
            for (long i = 0; i < total; ++i) {
                long p = 0;
                while (i >= panels_before[p + 1]) ++p;
                const int type = types[p];
                const acts_t *Ap = &A[block_size(type) == 256];
                const long panel = i - panels_before[p], pb = panel_bytes(type);
                const uint8_t *pk = packed[p] + panel * Ap->nb * pb;
                const float *b = bias[p] ? bias[p] + panel * PANEL : NULL;
                float *out = y + m0 * ldy + first[p] + panel * PANEL;
                long cols = N[p] - panel * PANEL < PANEL ? N[p] - panel * PANEL : PANEL;
#if QG_AVX512
                panel_rows512(type, pk, Ap, m0, rows, b, out, ldy, cols);
#elif QG_AVX2
                /* the part's next panel, for the prefetch (NULL after its last) */
                const uint8_t *next = i + 1 < panels_before[p + 1] ? pk + Ap->nb * pb : NULL;
                panel_rows_avx2(type, pk, next, Ap, m0, rows, b, out, ldy, cols);
#else
                for (long m = m0; m < m0 + rows; ++m) {
                    float acc[PANEL];
                    panel_row(type, pk, Ap, m, acc);
                    for (long c = 0; c < cols; ++c)
                        out[(m - m0) * ldy + c] = b ? acc[c] + b[c] : acc[c];
                }
#endif
            }
        }
    }
    for (int g = 0; g < 2; ++g) acts_free(&A[g]);
    return 0;
}

/* x [M, K] float32; packed: W [N, K] of `type` in the panel layout (understudy_qpack);
 * bias [N] or NULL; y [M, ldy] float32, columns 0..N-1 written: understudy_qgemm_parts
 * with one part. Returns 0, or -1 for a type or shape it does not take, or -2 when out of
 * memory. Threads: OpenMP, panels. */
int understudy_qgemm(int type, const float *x, const uint8_t *packed, const float *bias,
                     float *y, long ldy, long M, long K, long N, int threads) {
    const long first = 0;
    if (ldy < N) return -1;
    return understudy_qgemm_parts(1, &type, &packed, &bias, &first, &N, x, y, ldy, M, K, threads);
}

/* Rows `index` [R] of W (its GGUF layout), dequantized to float32 out [R, K] (embedding
 * lookups, exports): gguf's own formulas. */
int understudy_qdequant_rows(int type, const uint8_t *w, long row_bytes, const long *index,
                             long R, long K, float *out) {
    long bsize = block_size(type), bbytes = block_bytes(type);
    if (bbytes == 0 || K % bsize != 0) return -1;
    for (long r = 0; r < R; ++r) {
        const uint8_t *row = w + index[r] * row_bytes;
        float *o = out + r * K;
        for (long b = 0; b < K / bsize; ++b) {
            const uint8_t *blk = row + b * bbytes;
            float *ob = o + b * bsize;
            uint8_t q[256];
            uint16_t d, dmin;
            if (type == T_Q4_K) {
                int sc[8], mn[8];
                unpack_q4_k(blk, q, sc, mn, &d, &dmin);
                float fd = half_to_float(d), fm = half_to_float(dmin);
                for (int e = 0; e < 256; ++e)
                    ob[e] = fd * (float)sc[e / 32] * (float)q[e] - fm * (float)mn[e / 32];
            } else if (type == T_Q6_K) {
                int8_t sc[16];
                unpack_q6_k(blk, q, sc, &d);
                float fd = half_to_float(d);
                for (int e = 0; e < 256; ++e) ob[e] = fd * (float)sc[e / 16] * (float)(q[e] - 32);
            } else {
                int8_t w8[32];
                unpack_32(type, blk, w8, &d);
                float fd = half_to_float(d);
                for (int e = 0; e < 32; ++e) ob[e] = fd * (float)w8[e];
            }
        }
    }
    return 0;
}

/* 0: portable C, 1: AVX2, 2: AVX-512 with VNNI */
int understudy_qgemm_simd(void) { return QG_AVX512 ? 2 : QG_AVX2; }

/* float -> float16, rounding to nearest even (as numpy's astype(float16) does): subnormal
 * halves and overflow to infinity included */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, man = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    const int e = (int)exp - 127 + 15; /* the half's biased exponent */
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    uint32_t half, rest, mid;
    if (e <= 0) { /* a subnormal half (or zero): the 24-bit mantissa shifted into its 10 bits */
        if (e < -10) return (uint16_t)sign;
        const int shift = 14 - e;
        const uint32_t full = man | 0x800000;
        half = full >> shift;
        rest = full & ((1u << shift) - 1);
        mid = 1u << (shift - 1);
    } else {
        half = ((uint32_t)e << 10) | (man >> 13);
        rest = man & 0x1fff;
        mid = 0x1000;
    }
    if (rest > mid || (rest == mid && (half & 1))) ++half; /* a carry into the exponent is right */
    return (uint16_t)(sign | half);
}

/* W [N, K] of `type` (a 32-value block type: Q5_0, Q8_0) requantized to Q4_0 blocks in out
 * [N, K / 32 * 18], bitwise what gguf's reference quantizer (gguf.quants) makes of the
 * values gguf dequantizes: per block, d = the value of largest magnitude (the first such)
 * / -8, q = trunc(x / d + 8.5) in float32, at most 15, d stored as float16. Rows on OpenMP
 * threads. Returns 0, or -1 for a type or K it does not take. */
int understudy_requant_q4_0(int type, const uint8_t *w, long row_bytes, long K, long N,
                            uint8_t *out, int threads) {
    if (block_size(type) != 32 || block_bytes(type) == 0 || type == T_Q4_0 || K % 32 != 0)
        return -1;
    const long nb = K / 32, bbytes = block_bytes(type);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (long n = 0; n < N; ++n)
        for (long b = 0; b < nb; ++b) {
            int8_t w8[32];
            uint16_t dh;
            unpack_32(type, w + n * row_bytes + b * bbytes, w8, &dh);
            const float fd = half_to_float(dh);
            float x[32];
            for (int i = 0; i < 32; ++i) x[i] = fd * (float)w8[i];
            float amax = fabsf(x[0]), max = x[0]; /* the first of the largest, as argmax */
            for (int i = 1; i < 32; ++i) {
                if (fabsf(x[i]) > amax) {
                    amax = fabsf(x[i]);
                    max = x[i];
                }
            }
            const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            uint8_t *o = out + (n * nb + b) * 18, q[32];
            for (int i = 0; i < 32; ++i) {
                const float v = x[i] * id + 8.5f;
                q[i] = (uint8_t)(v >= 15.0f ? 15 : (int)v);
            }
            const uint16_t dq = float_to_half(d);
            memcpy(o, &dq, 2);
            for (int i = 0; i < 16; ++i) o[2 + i] = (uint8_t)(q[i] | (q[i + 16] << 4));
        }
    return 0;
}
