/* Attention of decode rows, each over one contiguous run of its keys: row-invariant.

   For every query row r and head h (kv head g = h / (heads / kv_heads)):

       s_j = (q[r,h] . k[b(r), g, j]) * scale            for j in lo[r] .. hi[r]-1
       s_j = softcap * tanh(s_j / softcap)               when softcap > 0 (Gemma 2)
       out[r,h] = sum_j softmax(s)_j * v[b(r), g, j]

   Invariant: out[r,h] depends only on q[r,h], the keys and values lo[r]..hi[r]-1, scale and
   softcap; not on the other rows of the call, on their number, or on how (r,h) pairs are
   split over threads. Each pair is computed by one thread, start to end, by the same steps
   whatever the call (the query heads of one kv head go together, a block of keys at a time,
   each head's steps in its own order): dot products in 16 lanes over the feature dimension
   summed in one fixed tree, exp and tanh by polynomials written in plain arithmetic (no libm
   call whose vector and scalar forms may differ), sums in 16 lanes over the keys. Compiled with -ffp-contract=off, so a vectorised
   and a scalar evaluation of the same expression give the same bits. So a token's attention
   is bitwise the same in a one-row decode pass, in a verification pass of many rows and in
   a batch of several sequences, as models/attention.py requires.

   Keys and values: b(r) = r when `per_row` (each row its own gathered keys, a tree node's
   path), else 0 (all rows read the cache itself). Strides are in floats; the feature
   dimension is contiguous. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16

/* q . k_j for 4 keys at once (k + j * stride): each in LANES partial sums over the
   features (lane l sums features l, l + 16, ...), then the tree l += l + 8, l += l + 4,
   l += l + 2, l += l + 1. Four keys in flight hide the latency of each one's chain. */
#if defined(__AVX512F__)
static inline float tree_sum(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

static inline void dots4(const float *restrict q, const float *restrict k, long stride,
                         long dim, float *restrict out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long d = 0; d < dim; d += LANES) {
        __m512 x = _mm512_loadu_ps(q + d);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(x, _mm512_loadu_ps(k + d)));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(x, _mm512_loadu_ps(k + stride + d)));
        a2 = _mm512_add_ps(a2, _mm512_mul_ps(x, _mm512_loadu_ps(k + 2 * stride + d)));
        a3 = _mm512_add_ps(a3, _mm512_mul_ps(x, _mm512_loadu_ps(k + 3 * stride + d)));
    }
    out[0] = tree_sum(a0), out[1] = tree_sum(a1), out[2] = tree_sum(a2), out[3] = tree_sum(a3);
}
#elif defined(__AVX2__)
/* the 16 lanes as two registers: lo lanes 0..7, hi lanes 8..15; the same tree */
static inline float tree_sum(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

static inline void dots4(const float *restrict q, const float *restrict k, long stride,
                         long dim, float *restrict out) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (long d = 0; d < dim; d += LANES) {
        __m256 x0 = _mm256_loadu_ps(q + d), x1 = _mm256_loadu_ps(q + d + 8);
        for (int i = 0; i < 4; i++) {
            const float *ki = k + i * stride + d;
            lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(x0, _mm256_loadu_ps(ki)));
            hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(x1, _mm256_loadu_ps(ki + 8)));
        }
    }
    for (int i = 0; i < 4; i++) out[i] = tree_sum(lo[i], hi[i]);
}
#endif

static inline float dot(const float *restrict a, const float *restrict b, long dim) {
    float acc[LANES] = {0};
    for (long d = 0; d < dim; d += LANES)  /* dim is a multiple of LANES (checked) */
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
}

/* the PORTABLE path is the definition; the AVX-512 and AVX2 ones compute the same sums */
static void scores_of(const float *restrict q, const float *restrict k, long stride, long n,
                      long dim, float *restrict scores) {
    long j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; j + 4 <= n; j += 4) dots4(q, k + j * stride, stride, dim, scores + j);
#endif
    for (; j < n; j++) scores[j] = dot(q, k + j * stride, dim);
}

/* out[d] += sum_j p_j * v_j[d] for keys j = j0 .. j1-1 in order (out zeroed first when j0 is
   0): called block after block, each feature's sum is still one chain in key order (its
   running value stored and reloaded exactly between blocks), whatever the blocks. */
static void weighted_sum(const float *restrict p, const float *restrict v, long stride,
                         long j0, long j1, long dim, float *restrict out) {
    long d0 = 0;
#if defined(__AVX512F__)
    for (; d0 + 4 * LANES <= dim; d0 += 4 * LANES) {  /* 64 features in registers */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        if (j0 > 0) {
            a0 = _mm512_loadu_ps(out + d0), a1 = _mm512_loadu_ps(out + d0 + LANES);
            a2 = _mm512_loadu_ps(out + d0 + 2 * LANES), a3 = _mm512_loadu_ps(out + d0 + 3 * LANES);
        }
        for (long j = j0; j < j1; j++) {
            const float *vj = v + j * stride + d0;
            __m512 w = _mm512_set1_ps(p[j]);
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(w, _mm512_loadu_ps(vj)));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(w, _mm512_loadu_ps(vj + LANES)));
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(w, _mm512_loadu_ps(vj + 2 * LANES)));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(w, _mm512_loadu_ps(vj + 3 * LANES)));
        }
        _mm512_storeu_ps(out + d0, a0);
        _mm512_storeu_ps(out + d0 + LANES, a1);
        _mm512_storeu_ps(out + d0 + 2 * LANES, a2);
        _mm512_storeu_ps(out + d0 + 3 * LANES, a3);
    }
#elif defined(__AVX2__)
    for (; d0 + 64 <= dim; d0 += 64) {  /* 64 features in 8 registers */
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = j0 > 0 ? _mm256_loadu_ps(out + d0 + 8 * i) : _mm256_setzero_ps();
        for (long j = j0; j < j1; j++) {
            const float *vj = v + j * stride + d0;
            __m256 w = _mm256_set1_ps(p[j]);
            for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(w, _mm256_loadu_ps(vj + 8 * i)));
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + d0 + 8 * i, a[i]);
    }
#endif
    if (j0 == 0)
        for (long d = d0; d < dim; d++) out[d] = 0.0f;
    for (long j = j0; j < j1; j++) {
        const float *restrict vj = v + j * stride;
        for (long d = d0; d < dim; d++) out[d] += p[j] * vj[d];
    }
}

/* Keys a block: a block of keys and values (16 KB each at 128 features) stays in the first
   level of cache while every query head of its kv head reads it, where head after head over
   all keys read them from the second level once a head (which bounded the call). A multiple
   of 4, so scores_of's groups of 4 keys stay the same. */
#define KEY_BLOCK 32

/* scores[0..n-1] -> softmax(scores * scale), each scaled score first capped to
   softcap * tanh(s / softcap) when softcap > 0; in place */
static void softmax_scaled(float *restrict scores, long n, float scale, float softcap) {
    float top[LANES], part[LANES];
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY, part[l] = 0.0f;
    for (long j = 0; j < n; j++) scores[j] *= scale;
    if (softcap > 0.0f)
        for (long j = 0; j < n; j++) scores[j] = tanh_poly(scores[j] / softcap) * softcap;
    for (long j = 0; j < n; j++)  /* a max is exact in any order */
        top[j % LANES] = scores[j] > top[j % LANES] ? scores[j] : top[j % LANES];
    for (int l = 1; l < LANES; l++) top[0] = top[l] > top[0] ? top[l] : top[0];
    for (long j = 0; j < n; j++) scores[j] = exp_nonpositive(scores[j] - top[0]);
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) part[l] += scores[j + l];
    for (int l = 0; j + l < n; l++) part[l] += scores[j + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    for (long i = 0; i < n; i++) scores[i] = scores[i] / part[0];
}

/* The `heads` query heads q + i * q_head_stride of one row over the same n keys and values:
   for each head the same steps as alone (scores_of's groups of 4 keys, the softmax, one sum
   per feature in key order), taken a key block at a time for all heads. scores: heads * n
   floats; out + i * dim: head i's output. */
static void attend_heads(const float *restrict q, long q_head_stride, long heads,
                         const float *restrict k, const float *restrict v, long key_stride,
                         long n, long dim, float scale, float softcap,
                         float *restrict scores, float *restrict out) {
    for (long j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        long j1 = j0 + KEY_BLOCK < n ? j0 + KEY_BLOCK : n;
        for (long i = 0; i < heads; i++)
            scores_of(q + i * q_head_stride, k + j0 * key_stride, key_stride, j1 - j0, dim,
                      scores + i * n + j0);
    }
    for (long i = 0; i < heads; i++) softmax_scaled(scores + i * n, n, scale, softcap);
    for (long j0 = 0; j0 < n; j0 += KEY_BLOCK) {  /* n >= 1: one_run refuses an empty run */
        long j1 = j0 + KEY_BLOCK < n ? j0 + KEY_BLOCK : n;
        for (long i = 0; i < heads; i++)
            weighted_sum(scores + i * n, v, key_stride, j0, j1, dim, out + i * dim);
    }
}

/* Row r's keys from its mask row (bool bytes): the run lo..hi-1 of ones. 0 when the row's
   ones are one nonempty run, else 1 (a tree's ancestors without gathering, or nothing). */
static int one_run(const unsigned char *row, long length, long *lo, long *hi) {
    /* memchr skips the zeros many bytes a step: a batched pass's rows are masked over
       every seat's slots, most of them another sequence's */
    const unsigned char *first = memchr(row, 1, (size_t)length);
    if (first == NULL) return 1;
    long a = first - row, b = a;
    while (b < length && row[b]) b++;
    if (b < length && memchr(row + b, 1, (size_t)(length - b)) != NULL) return 1;
    *lo = a, *hi = b;
    return 0;
}

int understudy_span_attention(
    const float *q, long q_row_stride, long q_head_stride,     /* q[r,h,:] */
    const float *k, const float *v, long kv_row_stride,        /* b(r) stride (per_row) */
    long kv_head_stride, long key_stride, int per_row,         /* k[b,g,j,:] */
    const unsigned char *mask, long mask_row_stride, long length,  /* mask[r, j] */
    long rows, long heads, long kv_heads, long dim,
    float scale, float softcap, float *out, int threads)       /* out [rows, heads, dim] */
{
    if (rows < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads) return 1;
    if (dim <= 0 || dim % LANES) return 1;
    long *lo = malloc(sizeof(long) * (rows > 0 ? 2 * rows : 1));
    if (lo == NULL) return 3;
    long *hi = lo + rows, longest = 0, work = 0;
    for (long r = 0; r < rows; r++) {
        if (one_run(mask + r * mask_row_stride, length, lo + r, hi + r)) {
            free(lo);
            return 4;  /* not one run of keys: the caller's general path */
        }
        longest = hi[r] - lo[r] > longest ? hi[r] - lo[r] : longest;
        work += (hi[r] - lo[r]) * heads * dim;
    }
    const long group = heads / kv_heads;
    /* a kv head's query heads in `parts` shares, so that fewer (row, kv head) units than
       threads still give every thread work (each head's steps are its own either way) */
    const long units = rows * kv_heads, wanted = threads > units ? threads / units : 1;
    const long parts = units > 0 && wanted < group ? wanted : group;
    int failed = 0;
    #pragma omp parallel num_threads(work >= 200000 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * (group * longest + 4));
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long unit = 0; unit < rows * kv_heads * parts; unit++) {  /* (row, kv head, part) */
            if (scores == NULL) continue;
            long r = unit / (kv_heads * parts), g = unit / parts % kv_heads, c = unit % parts;
            long first = c * group / parts, n_heads = (c + 1) * group / parts - first;
            long h = g * group + first;
            long b = per_row ? r : 0;
            const float *kb = k + b * kv_row_stride + g * kv_head_stride + lo[r] * key_stride;
            const float *vb = v + b * kv_row_stride + g * kv_head_stride + lo[r] * key_stride;
            attend_heads(q + r * q_row_stride + h * q_head_stride, q_head_stride, n_heads, kb,
                         vb, key_stride, hi[r] - lo[r], dim, scale, softcap, scores,
                         out + (r * heads + h) * dim);
        }
        free(scores);
    }
    free(lo);
    return failed ? 3 : 0;
}
