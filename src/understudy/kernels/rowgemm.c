/* Row-invariant matrix multiply for CPUs: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Invariant: every output y[m, n] is ONE sequential chain of fused multiply-adds,
 * acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ..., K-1 starting from acc = 0, then
 * + bias[n]. Nothing else touches it, so a row's result is bitwise the same whether it is
 * scored alone or among M-1 other rows, whatever M, whatever the other rows hold, on any
 * vector width (AVX-512, AVX2 and the scalar fallback all compute that same chain; fmaf
 * rounds once, like the vector FMA instructions).
 *
 * Layout: w is packed as [ceil(N / 16)][K][16] (16 output columns side by side per k), so
 * each thread streams one contiguous range of the weight; a whole group of rows shares each
 * load of w, and for M <= GROUP the weight is read from memory once, as a 1-row call reads it.
 * Software prefetch runs PREFETCH_AHEAD k-steps ahead (the hardware prefetcher alone left a
 * 6-row call ~1.5x slower than a 1-row one on a 2-core VM; with it, ~1.05x).
 */
#include <math.h>
#include <stddef.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define LANES 16
#define PREFETCH_AHEAD 256 /* k-steps of 64 bytes: 16 KiB ahead (measured best of 16..256) */

#if defined(__AVX512F__)
#define GROUP 16 /* 16 accumulators of the 32 zmm registers */
#define ROWS_KERNEL(R)                                                                  \
    static void rows_##R(const float *x, const float *wb, long K, float out[][LANES]) { \
        __m512 acc[R];                                                                  \
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();                       \
        for (long k = 0; k < K; ++k) {                                                  \
            _mm_prefetch((const char *)(wb + (k + PREFETCH_AHEAD) * LANES), _MM_HINT_T0); \
            __m512 wv = _mm512_loadu_ps(wb + k * LANES);                                \
            for (int r = 0; r < R; ++r)                                                 \
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wv, acc[r]);     \
        }                                                                               \
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);                   \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#define GROUP 6 /* 12 accumulators of the 16 ymm registers */
#define ROWS_KERNEL(R)                                                                  \
    static void rows_##R(const float *x, const float *wb, long K, float out[][LANES]) { \
        __m256 lo[R], hi[R];                                                            \
        for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();                \
        for (long k = 0; k < K; ++k) {                                                  \
            _mm_prefetch((const char *)(wb + (k + PREFETCH_AHEAD) * LANES), _MM_HINT_T0); \
            __m256 wl = _mm256_loadu_ps(wb + k * LANES);                                \
            __m256 wh = _mm256_loadu_ps(wb + k * LANES + 8);                            \
            for (int r = 0; r < R; ++r) {                                               \
                __m256 xv = _mm256_set1_ps(x[r * K + k]);                               \
                lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]);                                 \
                hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]);                                 \
            }                                                                           \
        }                                                                               \
        for (int r = 0; r < R; ++r) {                                                   \
            _mm256_storeu_ps(out[r], lo[r]);                                            \
            _mm256_storeu_ps(out[r] + 8, hi[r]);                                        \
        }                                                                               \
    }
#else
#define GROUP 4
#define ROWS_KERNEL(R)                                                                  \
    static void rows_##R(const float *x, const float *wb, long K, float out[][LANES]) { \
        float acc[R][LANES];                                                            \
        memset(acc, 0, sizeof acc);                                                     \
        for (long k = 0; k < K; ++k)                                                    \
            for (int r = 0; r < R; ++r)                                                 \
                for (int l = 0; l < LANES; ++l)                                         \
                    acc[r][l] = fmaf(x[r * K + k], wb[k * LANES + l], acc[r][l]);       \
        memcpy(out, acc, sizeof acc);                                                   \
    }
#endif

ROWS_KERNEL(1) ROWS_KERNEL(2) ROWS_KERNEL(3) ROWS_KERNEL(4)
#if GROUP > 4
ROWS_KERNEL(5) ROWS_KERNEL(6)
#endif
#if GROUP > 6
ROWS_KERNEL(7) ROWS_KERNEL(8) ROWS_KERNEL(9) ROWS_KERNEL(10) ROWS_KERNEL(11)
ROWS_KERNEL(12) ROWS_KERNEL(13) ROWS_KERNEL(14) ROWS_KERNEL(15) ROWS_KERNEL(16)
#endif

#if defined(__AVX512F__)
/* Prompts (many rows): two column blocks x WIDE rows at once, 24 accumulators, so each
 * broadcast of x feeds two FMAs. Every output is still the same FMA chain as above. */
#define WIDE 12
#define WIDE_FROM 32 /* calls of at least this many rows use it */
static void wide_rows(const float *x, const float *wa, const float *wb, long K,
                      float out_a[][LANES], float out_b[][LANES]) {
    __m512 a[WIDE], b[WIDE];
    for (int r = 0; r < WIDE; ++r) a[r] = b[r] = _mm512_setzero_ps();
    for (long k = 0; k < K; ++k) {
        __m512 va = _mm512_loadu_ps(wa + k * LANES), vb = _mm512_loadu_ps(wb + k * LANES);
        for (int r = 0; r < WIDE; ++r) {
            __m512 xv = _mm512_set1_ps(x[r * K + k]);
            a[r] = _mm512_fmadd_ps(xv, va, a[r]);
            b[r] = _mm512_fmadd_ps(xv, vb, b[r]);
        }
    }
    for (int r = 0; r < WIDE; ++r) {
        _mm512_storeu_ps(out_a[r], a[r]);
        _mm512_storeu_ps(out_b[r], b[r]);
    }
}
#endif

typedef void (*rows_fn)(const float *, const float *, long, float[][LANES]);
static const rows_fn KERNELS[] = {
    NULL, rows_1, rows_2, rows_3, rows_4,
#if GROUP > 4
    rows_5, rows_6,
#endif
#if GROUP > 6
    rows_7, rows_8, rows_9, rows_10, rows_11, rows_12, rows_13, rows_14, rows_15, rows_16,
#endif
};

static void store(const float out[][LANES], long rows, const float *bias, float *y, long m0,
                  long N, long b) {
    long n0 = b * LANES, width = N - n0 < LANES ? N - n0 : LANES;
    for (long r = 0; r < rows; ++r) {
        float *dst = y + (m0 + r) * N + n0;
        for (long l = 0; l < width; ++l) dst[l] = bias ? out[r][l] + bias[n0 + l] : out[r][l];
    }
}

/* rows m0.. of column block b, GROUP rows at a time */
static void column_block(const float *x, const float *w, const float *bias, float *y, long m0,
                         long M, long K, long N, long b) {
    float out[GROUP][LANES];
    for (; m0 < M; m0 += GROUP) {
        long rows = M - m0 < GROUP ? M - m0 : GROUP;
        KERNELS[rows](x + m0 * K, w + b * K * LANES, K, out);
        store(out, rows, bias, y, m0, N, b);
    }
}

/* column blocks b and b + 1 (b + 1 < blocks) of a many-row call */
static void column_pair(const float *x, const float *w, const float *bias, float *y, long M,
                        long K, long N, long b) {
    long m0 = 0;
#if defined(__AVX512F__)
    float out_a[WIDE][LANES], out_b[WIDE][LANES];
    for (; m0 + WIDE <= M; m0 += WIDE) {
        wide_rows(x + m0 * K, w + b * K * LANES, w + (b + 1) * K * LANES, K, out_a, out_b);
        store(out_a, WIDE, bias, y, m0, N, b);
        store(out_b, WIDE, bias, y, m0, N, b + 1);
    }
#endif
    column_block(x, w, bias, y, m0, M, K, N, b);
    column_block(x, w, bias, y, m0, M, K, N, b + 1);
}

/* x [M, K], w packed (see above), bias [N] or NULL, y [M, N]; all float32, contiguous.
 * Threads: OpenMP, static contiguous ranges of column blocks. Loaded into a process that
 * already holds PyTorch's libgomp, this shares PyTorch's own thread pool (same soname), so
 * no second set of threads competes with PyTorch's spinning workers for the cores. */
int understudy_rowgemm(const float *x, const float *w, const float *bias, float *y, long M,
                       long K, long N, int threads) {
    long blocks = (N + LANES - 1) / LANES;
    if (threads < 1) threads = 1;
#if defined(__AVX512F__)
    if (M >= WIDE_FROM) {
        long pairs = blocks / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long p = 0; p < pairs; ++p) column_pair(x, w, bias, y, M, K, N, 2 * p);
        if (blocks % 2) column_block(x, w, bias, y, 0, M, K, N, blocks - 1);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; ++b) column_block(x, w, bias, y, 0, M, K, N, b);
    return 0;
}

int understudy_rowgemm_group(void) { return GROUP; }
