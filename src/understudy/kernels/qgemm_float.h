/* qgemm.c's F16 and BF16 weights, included by qgemm.c. Not quantized blocks: each output is
 * one chain of fused multiply-adds over the inputs in order,
 *     acc = fma(x[m, k], w[n, k], acc), k = 0 .. K-1, from acc = 0, then + bias[n],
 * with w[n, k] the 2-byte weight converted to float32 (exactly: every float16 and bfloat16
 * value is a float32 value). Nothing else touches an output, so a row's result is the same
 * bits alone or among any others, on every path here (the portable one and the 256-bit one,
 * which the AVX2 and AVX-512 builds share), and the same as kernels/rowgemm.c's on the
 * weights converted to float32 (its chain, in its order), at half the bytes read.
 *
 * The panel: [K][16] 2-byte values, column c's value k at 2 (16 k + c) (understudy_qpack).
 */

#define FLOAT_GROUP 6 /* rows sharing each load of the weights: 12 accumulators of 16 ymm */

QG_UNUSED_IN_SIMD static float weight_to_float(int type, uint16_t w) {
    return type == T_F16 ? half_to_float(w) : bf16_to_float(w);
}

/* rows [rows] of x (row r at x + r K) against one panel: acc[r][c] */
QG_UNUSED_IN_SIMD static void float_rows_portable(int type, const uint16_t *w, const float *x, long K,
                                                  long rows, float acc[][PANEL]) {
    for (long r = 0; r < rows; ++r)
        for (int c = 0; c < PANEL; ++c) acc[r][c] = 0.0f;
    for (long k = 0; k < K; ++k)
        for (long r = 0; r < rows; ++r)
            for (int c = 0; c < PANEL; ++c)
                acc[r][c] = fmaf(x[r * K + k], weight_to_float(type, w[k * PANEL + c]), acc[r][c]);
}

#if QG_AVX2 || QG_AVX512
#define AIF static inline __attribute__((always_inline))
#define FLOAT_AHEAD 512 /* values of a column ahead (16 KiB) that a group asks memory for */

/* value k of the 16 columns: columns 0..7 in *lo, 8..15 in *hi */
AIF void float_load(const int type, const uint16_t *p, __m256 *lo, __m256 *hi) {
    const __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 8));
    if (type == T_F16) {
        *lo = _mm256_cvtph_ps(a);
        *hi = _mm256_cvtph_ps(b);
    } else { /* a bfloat16 is the top half of its float32 */
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
}

/* R rows (a constant in each caller) against one panel, two values a step (one line) */
AIF void float_group(const int type, const uint16_t *w, const float *x, long K, const int R,
                     float acc[][PANEL]) {
    __m256 lo[FLOAT_GROUP], hi[FLOAT_GROUP], wl, wh;
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    long k = 0;
    for (; k < K; ++k) {
        if (k % 2 == 0) _mm_prefetch((const char *)(w + (k + FLOAT_AHEAD) * PANEL), _MM_HINT_T0);
        float_load(type, w + k * PANEL, &wl, &wh);
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_set1_ps(x[r * K + k]);
            lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(acc[r], lo[r]);
        _mm256_storeu_ps(acc[r] + 8, hi[r]);
    }
}

/* every row, FLOAT_GROUP at a time; `type` a constant in each caller */
AIF void float_rows_typed(const int type, const uint16_t *w, const float *x, long K, long rows,
                          float acc[][PANEL]) {
    long r = 0;
    for (; r + FLOAT_GROUP <= rows; r += FLOAT_GROUP) float_group(type, w, x + r * K, K, FLOAT_GROUP, acc + r);
    switch (rows - r) {
    case 1: float_group(type, w, x + r * K, K, 1, acc + r); break;
    case 2: float_group(type, w, x + r * K, K, 2, acc + r); break;
    case 3: float_group(type, w, x + r * K, K, 3, acc + r); break;
    case 4: float_group(type, w, x + r * K, K, 4, acc + r); break;
    case 5: float_group(type, w, x + r * K, K, 5, acc + r); break;
    default: break;
    }
}
#endif

/* Rows [rows] (at most ROW_TILE) of x (row r at x + r K) against one panel at pk:
 * y[r * ldy + c] = the chain + bias[c], columns < cols */
static void float_rows(int type, const uint8_t *pk, const float *x, long K, long rows,
                       const float *bias, float *y, long ldy, long cols) {
    const uint16_t *w = (const uint16_t *)pk;
    float acc[ROW_TILE][PANEL];
#if QG_AVX2 || QG_AVX512
    if (type == T_F16)
        float_rows_typed(T_F16, w, x, K, rows, acc);
    else
        float_rows_typed(T_BF16, w, x, K, rows, acc);
#else
    float_rows_portable(type, w, x, K, rows, acc);
#endif
    for (long r = 0; r < rows; ++r)
        for (long c = 0; c < cols; ++c) y[r * ldy + c] = bias ? acc[r][c] + bias[c] : acc[r][c];
}
