/* Row-invariant matmul over a GGUF file's quantized blocks, for CPUs:
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), W's rows GGUF blocks, repacked once.
 *
 * Layout (understudy_qpack): the columns go in panels of 16 (the last one padded with
 * zero columns); a panel holds, block after block, the 16 columns' block b side by side,
 * so one 512-bit register holds 4 consecutive values of each of the 16 columns and one
 * int8 dot-product instruction advances 16 columns at once against 4 activations
 * broadcast. The bytes are the same blocks rearranged (about the same count: unpacked
 * sub-block scales add up to 64 bytes a panel-block; qgemm_blocks.h has every layout); the
 * weights are read once per call, at memory speed, for 1 row as for several.
 *
 * How: each row of x is quantized on its own to int8, one float scale per block of the
 * weight's block size (256 for the k-quants and IQ4_XS, 32 for Q8_0, Q5_0, Q5_1, Q4_0,
 * Q4_1 and IQ4_NL), with the sums of each 16 quantized values (the offsets and mins need
 * them). A block's contribution to y[m, n] is an exact integer (its quants' products with
 * the row's int8 values summed in int32, times the integer sub-block scales) converted to
 * float once and multiplied by the float product s * d of the row's and the column's block
 * scales; where the type has mins, their integer sum likewise, times s * dmin; one float
 * accumulator per (row, column) takes the blocks in order, with fused multiply-adds; then
 * the bias. F16 and BF16 weights are not quantized blocks: qgemm_float.h multiplies them
 * in float32, one chain of fused multiply-adds per (row, column), as kernels/rowgemm.c does.
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

#include "qgemm_blocks.h"

#define MAX_PARTS 4 /* weights in one understudy_qgemm_parts call */
#define ROW_TILE 32 /* rows whose activations one pass over the panels serves (L2-sized) */
/* multiply-adds: smaller calls run on one thread (no fork/join). A one-row call of the 0.5B
 * draft's output projection (896 x 896, 0.8M) reads its 0.45 MB at ~12.5 GB/s on one thread
 * of the 2-core Zen 3 and ~19 on two, where the fork costs a few microseconds */
#define SERIAL_BELOW 1e5
/* A call of one tile of rows gives each thread a run of panels, which it takes in order
 * from the front; a thread done with its own run takes the others' next panels: two threads
 * do not finish equal shares together (their streams from memory are not served alike),
 * and the first had waited at the join. A thread's panels stay contiguous while it works
 * alone, which the hardware prefetchers need (every panel handed out from one shared
 * counter measured 1.14-1.19x slower) */
#define MAX_RANGES 64 /* threads with a run of their own; more take the others' runs */
typedef struct {
    long next, end;
    char pad[48]; /* a run a cache line: its owner's counter is not another's */
} __attribute__((aligned(64))) range_t;

static int is_float(int type) { return type == T_F16 || type == T_BF16; }

/* values a block (F16, BF16: 1, a panel-block one value of each column); 0: not a type the
 * kernel takes */
static long block_size(int type) {
    const layout_t *L = layout_of(type);
    return is_float(type) ? 1 : L ? L->values : 0;
}

/* bytes of one GGUF block */
static long block_bytes(int type) {
    const layout_t *L = layout_of(type);
    return is_float(type) ? 2 : L ? L->gguf_bytes : 0;
}

/* bytes of one panel-block: 16 columns' block b (qgemm_blocks.h; F16, BF16: 16 values) */
static long panel_bytes(int type) {
    const layout_t *L = layout_of(type);
    return is_float(type) ? 2 * PANEL : L ? L->bytes : 0;
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
    for (long p = 0; p < panels; ++p) {
        if (is_float(type)) { /* [K][16] values, padding columns zero */
            uint16_t *o = (uint16_t *)(out + p * nb * pb);
            for (long k = 0; k < K; ++k)
                for (int c = 0; c < PANEL; ++c) {
                    long n = p * PANEL + c;
                    o[k * PANEL + c] = n < N ? read_u16(w + n * row_bytes + 2 * k) : 0;
                }
            continue;
        }
        for (long b = 0; b < nb; ++b) {
            const uint8_t *blk[PANEL];
            for (int c = 0; c < PANEL; ++c) {
                long n = p * PANEL + c;
                blk[c] = n < N ? w + n * row_bytes + b * bbytes : NULL;
            }
            pack_block(type, blk, out + (p * nb + b) * pb);
        }
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
 * Rows m0..m0+rows-1 (at most ROW_TILE) of one panel, each panel-block decoded once for all
 * of them (panel_decode): for row m and column c, I = sum_j sc_j * (sum over sub-block j of
 * v_e a_e) and J = sum_j mn_j * (sum over sub-block j of a_e), exact integers; then
 * f = fma(I, s * d, f) and, where the type has mins, f = fma(-J, s * dm, f). The SIMD paths
 * form the same I and J their own ways (offsets of stored codes taken off through the
 * rows' sums per 16 or 32 values) and take the same float steps.
 * y[r * ldy + c] = f + bias[c], columns < cols. */
QG_UNUSED_IN_SIMD static void panel_rows_portable(int type, const uint8_t *pk, const acts_t *A, long m0,
                                                  long rows, const float *bias, float *y, long ldy,
                                                  long cols) {
    const layout_t *L = layout_of(type);
    const int subs = L->values / L->width, mins = L->mn_form != MN_NONE;
    float f[ROW_TILE][PANEL] = {{0}};
    panel_block_t P;
    for (long b = 0; b < A->nb; ++b) {
        panel_decode(type, pk + b * L->bytes, &P);
        for (long r = 0; r < rows; ++r) {
            const int8_t *a = A->q + (m0 + r) * A->K + b * L->values;
            const float s = A->s[(m0 + r) * A->nb + b];
            int32_t isum[PANEL] = {0}, jsum[PANEL] = {0};
            for (int j = 0; j < subs; ++j) {
                int32_t dot[PANEL] = {0}, asum = 0;
                for (int e = L->width * j; e < L->width * (j + 1); ++e) {
                    asum += a[e];
                    for (int c = 0; c < PANEL; ++c) dot[c] += P.v[e][c] * a[e];
                }
                for (int c = 0; c < PANEL; ++c) {
                    isum[c] += dot[c] * P.sc[j][c];
                    jsum[c] += P.mn[j][c] * asum;
                }
            }
            for (int c = 0; c < PANEL; ++c) {
                f[r][c] = fmaf((float)isum[c], s * P.d[c], f[r][c]);
                if (mins) f[r][c] = fmaf(-(float)jsum[c], s * P.dm[c], f[r][c]);
            }
        }
    }
    for (long r = 0; r < rows; ++r)
        for (long c = 0; c < cols; ++c) y[r * ldy + c] = bias ? f[r][c] + bias[c] : f[r][c];
}

#if QG_AVX512
#include "qgemm_avx512.h"
#include "qgemm_avx2.h" /* the bodies of the types qgemm_avx512.h has none for */
#elif QG_AVX2
#include "qgemm_avx2.h"
#endif
#include "qgemm_float.h"

/* Rows m0..m0+rows-1 of one panel of a type with blocks, by this build's body for it; `next`:
 * the part's next panel (NULL after its last), which the AVX2 bodies ask memory for */
static void panel_rows(int type, const uint8_t *pk, const uint8_t *next, const acts_t *A, long m0,
                       long rows, const float *bias, float *y, long ldy, long cols) {
#if QG_AVX512
    switch (type) { /* the types qgemm_avx512.h has a body for (Q5_0's panels are this build's
                     * own); the others run the AVX2 one, the same bits from the same panels */
    case T_Q4_K:
    case T_Q5_K:
    case T_Q6_K:
    case T_Q8_0:
    case T_Q5_0:
    case T_Q4_0:
    case T_IQ4_XS:
    case T_Q3_K:
    case T_Q2_K:
    case T_Q4_1:
    case T_Q5_1:
    case T_IQ4_NL: panel_rows512(type, pk, A, m0, rows, bias, y, ldy, cols); break;
    default: panel_rows_avx2(type, pk, next, A, m0, rows, bias, y, ldy, cols); break;
    }
#elif QG_AVX2 /* a body for every type */
    panel_rows_avx2(type, pk, next, A, m0, rows, bias, y, ldy, cols);
#else
    (void)next;
    panel_rows_portable(type, pk, A, m0, rows, bias, y, ldy, cols);
#endif
}

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

/* One understudy_qgemm_parts call, as its panel jobs read it */
typedef struct {
    const int *types;
    const uint8_t *const *packed;
    const float *const *bias;
    const long *first, *N, *panels_before; /* per part; panels_before[parts]: all panels */
    const float *x;
    float *y;
    long ldy, K;
    const acts_t *A; /* the activations in blocks of 32 and of 256 */
} call_t;

/* Panel i of the call (its parts' panels in order), rows m0 .. m0 + rows - 1 */
static void panel_job(const call_t *c, long i, long m0, long rows) {
    long p = 0;
    while (i >= c->panels_before[p + 1]) ++p;
    const int type = c->types[p];
    const acts_t *Ap = &c->A[block_size(type) == 256];
    const long panel = i - c->panels_before[p], pb = panel_bytes(type);
    const long blocks = c->K / block_size(type); /* a panel's panel-blocks */
    const uint8_t *pk = c->packed[p] + panel * blocks * pb;
    /* the part's next panel, for the AVX2 path's prefetch (NULL after its last) */
    const uint8_t *next = i + 1 < c->panels_before[p + 1] ? pk + blocks * pb : NULL;
    const float *b = c->bias[p] ? c->bias[p] + panel * PANEL : NULL;
    float *out = c->y + m0 * c->ldy + c->first[p] + panel * PANEL;
    long cols = c->N[p] - panel * PANEL < PANEL ? c->N[p] - panel * PANEL : PANEL;
    if (is_float(type))
        float_rows(type, pk, c->x + m0 * c->K, c->K, rows, b, out, c->ldy, cols);
    else
        panel_rows(type, pk, next, Ap, m0, rows, b, out, c->ldy, cols);
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
    int needs[2] = {0, 0}; /* activations quantized in blocks of 32, 256 */
    if (parts < 1 || parts > MAX_PARTS || K <= 0) return -1;
    for (long p = 0; p < parts; ++p) {
        long bsize = block_size(types[p]);
        if (panel_bytes(types[p]) == 0 || K % bsize != 0 || N[p] < 0 || first[p] < 0 ||
            first[p] + N[p] > ldy)
            return -1;
        if (!is_float(types[p])) needs[bsize == 256] = 1;
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
    const call_t c = {types, packed, bias, first, N, panels_before, x, y, ldy, K, A};
    range_t ranges[MAX_RANGES]; /* thread t's run of panels, taken from its front */
    const long nr = threads < MAX_RANGES ? threads : MAX_RANGES;
    for (long t = 0; t < nr; ++t) ranges[t] = (range_t){total * t / nr, total * (t + 1) / nr};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        for (int g = 0; g < 2; ++g) {
            if (!needs[g]) continue;
#pragma omp for schedule(static)
            for (long m = 0; m < M; ++m) acts_quantize(x, m, &A[g]);
        }
        if (M <= ROW_TILE) {
            /* one tile of rows (decoding, verifying): each thread its own run of panels, in
             * order, then the rest of the others' runs, one panel at a time */
            long t = 0;
#ifdef _OPENMP
            t = omp_get_thread_num();
#endif
            for (long k = 0; k < nr; ++k) {
                range_t *r = &ranges[(t + k) % nr];
                for (;;) {
                    long i;
#pragma omp atomic capture
                    i = r->next++;
                    if (i >= r->end) break;
                    panel_job(&c, i, 0, M);
                }
            }
        } else {
            for (long m0 = 0; m0 < M; m0 += ROW_TILE) {
#pragma omp for schedule(static)
                for (long i = 0; i < total; ++i)
                    panel_job(&c, i, m0, M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
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
 * lookups, exports): gguf's own formulas, in its order of float operations (the header of
 * qgemm_blocks.h), so its bits. */
int understudy_qdequant_rows(int type, const uint8_t *w, long row_bytes, const long *index,
                             long R, long K, float *out) {
    long bsize = block_size(type), bbytes = block_bytes(type);
    if (bbytes == 0 || K % bsize != 0) return -1;
    const layout_t *L = layout_of(type);
    for (long r = 0; r < R; ++r) {
        const uint8_t *row = w + index[r] * row_bytes;
        float *o = out + r * K;
        if (is_float(type)) {
            for (long k = 0; k < K; ++k)
                o[k] = type == T_F16 ? half_to_float(read_u16(row + 2 * k)) : bf16_to_float(read_u16(row + 2 * k));
            continue;
        }
        for (long b = 0; b < K / bsize; ++b) {
            block_t u;
            unpack_gguf(type, row + b * bbytes, &u);
            const float fd = half_to_float(u.d), fdm = half_to_float(u.dm);
            for (int e = 0; e < L->values; ++e) {
                const int j = e / L->width, v = L->table ? KVALUES[u.code[e]] : u.code[e] - L->offset;
                o[b * bsize + e] = fd * (float)u.sc[j] * (float)v - fdm * (float)u.mn[j];
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
    if ((type != T_Q5_0 && type != T_Q8_0) || K % 32 != 0) return -1;
    const long nb = K / 32, bbytes = block_bytes(type), offset = layout_of(type)->offset;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (long n = 0; n < N; ++n)
        for (long b = 0; b < nb; ++b) {
            block_t u;
            unpack_gguf(type, w + n * row_bytes + b * bbytes, &u);
            const float fd = half_to_float(u.d);
            float x[32];
            for (int i = 0; i < 32; ++i) x[i] = fd * (float)(u.code[i] - offset);
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
