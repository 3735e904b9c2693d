/* A decoder layer's work around its attention, in two calls, for models on GGUF blocks.

   understudy_layer_input:   h = rmsnorm(x) * w1;  q,k,v = h W_qkv^T + b;  rotate q and k;
                             write k and v into the cache at each row's slot;  q out
   understudy_layer_output:  x += attn W_o^T;  h = rmsnorm(x) * w2;
                             x += (silu(h W_gate^T) * (h W_up^T)) W_down^T

   The attention itself (which keys each row sees) stays in Python (models/attention.py),
   except in understudy_layers: every layer of a pass in one call, for the common pass whose
   rows all see one run of keys from slot 0, attended by span_attention.c's kernel. The
   products are kernels/qgemm.c's and the attention span_attention.c's, reached through
   pointers the caller hands over, so this file never needs their sources.

   Invariant: every step is row-wise, each row computed by the same sequence of float
   operations whatever the number of rows, and qgemm is row-invariant: a row's results are
   bitwise the same in a pass of one row or of many. The norm sums squares in 16 lanes
   and one fixed tree; the exp of silu is one polynomial in plain arithmetic, so a
   vectorised and a scalar evaluation agree (compiled with -ffp-contract=off). Why at all:
   a one-row pass of the 1.5B target made ~40 small torch calls and Python steps a layer;
   with these two calls a one-row pass took 43 ms instead of 56 (one thread, CPU time). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"

#define LANES 16
#define MAX_PARTS 4

/* qgemm.c's understudy_qgemm_parts: y's columns first[p] .. first[p] + N[p] - 1 = x W_p^T */
typedef int (*qgemm_fn)(long parts, const int *types, const void *const *packed,
                        const float *const *bias, const long *first, const long *N,
                        const float *x, float *y, long ldy, long M, long K, int threads);

/* y = x W^T + b with W the concatenation (along out) of up to MAX_PARTS block tensors. */
typedef struct {
    long parts, in_features, out_features;
    int kinds[MAX_PARTS];
    const void *weights[MAX_PARTS];  /* in qgemm's panel layout */
    const float *biases[MAX_PARTS];  /* NULL: none */
    long first[MAX_PARTS];           /* the part's first output column */
    long rows[MAX_PARTS];            /* its output columns */
} linear_t;

typedef struct {
    qgemm_fn qgemm;
    linear_t qkv, o, gate_up, down;
    const float *norm1, *norm2;  /* RMSNorm weights [hidden] */
    float eps;
    long hidden, heads, kv_heads, head_dim, intermediate;
} layer_t;

/* all of a linear's parts in one qgemm call (one quantization of x, one parallel region) */
static int apply(const layer_t *L, const linear_t *lin, const float *x, float *y, long rows,
                 int threads) {
    return L->qgemm(lin->parts, lin->kinds, lin->weights, lin->biases, lin->first, lin->rows, x,
                    y, lin->out_features, rows, lin->in_features, threads);
}

/* out = x / sqrt(mean(x^2) + eps) * w, for one row */
static void rms_norm(const float *restrict x, const float *restrict w, float eps, long dim,
                     float *restrict out) {
    float acc[LANES] = {0};
    long d = 0;
    for (; d + LANES <= dim; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[d + l] * x[d + l];
    for (int l = 0; d + l < dim; l++) acc[l] += x[d + l] * x[d + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    const float inv = 1.0f / sqrtf(acc[0] / (float)dim + eps);
    for (long i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

/* out[i] = silu(gate[i]) * up[i], silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) */
static void silu_times(const float *restrict gate, const float *restrict up, long n,
                       float *restrict out) {
    for (long i = 0; i < n; i++) {
        float g = gate[i];
        float e = exp_nonpositive(g < 0.0f ? g : -g);
        float sigmoid = g < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
        out[i] = (g * sigmoid) * up[i];
    }
}

/* x [D] rotated (the rotate-half convention): first half x1 c - x2 s, second x2 c + x1 s */
static void rotate(const float *restrict x, const float *restrict cos_, const float *restrict sin_,
                   long dim, float *restrict out) {
    const long half = dim / 2;
    for (long d = 0; d < half; d++) {
        out[d] = x[d] * cos_[d] - x[d + half] * sin_[d];
        out[d + half] = x[d + half] * cos_[d + half] + x[d] * sin_[d + half];
    }
}

int understudy_layer_input(const layer_t *L, const float *x, long rows,
                           const float *cos_, const float *sin_,  /* [rows, head_dim] */
                           const long *slots, float *k_cache, float *v_cache,
                           long cache_slots,                      /* S of [Hkv, S, D] */
                           float *q_out, int threads)             /* [rows, heads, D] */
{
    const long D = L->head_dim, H = L->heads, G = L->kv_heads, width = L->qkv.out_features;
    if (width != (H + 2 * G) * D || D % 2) return -20;
    float *normed = malloc(sizeof(float) * rows * L->hidden);
    float *qkv = malloc(sizeof(float) * rows * width);
    int code = (normed && qkv) ? 0 : -21;
    for (long r = 0; code == 0 && r < rows; r++)
        rms_norm(x + r * L->hidden, L->norm1, L->eps, L->hidden, normed + r * L->hidden);
    if (code == 0) code = apply(L, &L->qkv, normed, qkv, rows, threads);
    for (long r = 0; code == 0 && r < rows; r++) {
        const float *row = qkv + r * width, *c = cos_ + r * D, *s = sin_ + r * D;
        for (long h = 0; h < H; h++) rotate(row + h * D, c, s, D, q_out + (r * H + h) * D);
        for (long g = 0; g < G; g++) {
            float *k_slot = k_cache + (g * cache_slots + slots[r]) * D;
            rotate(row + (H + g) * D, c, s, D, k_slot);
            memcpy(v_cache + (g * cache_slots + slots[r]) * D, row + (H + G + g) * D,
                   sizeof(float) * D);
        }
    }
    free(normed);
    free(qkv);
    return code;
}

int understudy_layer_output(const layer_t *L, float *x, const float *attn, long rows,
                            int threads)                       /* x [rows, hidden] in place */
{
    const long hidden = L->hidden, inter = L->intermediate;
    float *tmp = malloc(sizeof(float) * rows * hidden);
    float *normed = malloc(sizeof(float) * rows * hidden);
    float *gate_up = malloc(sizeof(float) * rows * 2 * inter);
    float *act = malloc(sizeof(float) * rows * inter);
    int code = (tmp && normed && gate_up && act) ? 0 : -21;
    if (code == 0) code = apply(L, &L->o, attn, tmp, rows, threads);
    for (long i = 0; code == 0 && i < rows * hidden; i++) x[i] += tmp[i];
    for (long r = 0; code == 0 && r < rows; r++)
        rms_norm(x + r * hidden, L->norm2, L->eps, hidden, normed + r * hidden);
    if (code == 0) code = apply(L, &L->gate_up, normed, gate_up, rows, threads);
    for (long r = 0; code == 0 && r < rows; r++)
        silu_times(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter,
                   act + r * inter);
    if (code == 0) code = apply(L, &L->down, act, tmp, rows, threads);
    for (long i = 0; code == 0 && i < rows * hidden; i++) x[i] += tmp[i];
    free(tmp);
    free(normed);
    free(gate_up);
    free(act);
    return code;
}

/* span_attention.c's understudy_span_attention */
typedef int (*span_fn)(const float *q, long q_row_stride, long q_head_stride, const float *k,
                       const float *v, long kv_row_stride, long kv_head_stride,
                       long key_stride, int per_row, const unsigned char *mask,
                       long mask_row_stride, long length, long rows, long heads,
                       long kv_heads, long dim, float scale, float softcap, float *out,
                       int threads);

#define NOT_ONE_RUN 4 /* span_attention's answer when a row's visible keys are not one run */

/* Every layer of a pass: x [rows, hidden] in place, as the per-layer calls with
   span_attention between them would leave it (the same calls in the same order, so the same
   bits). Layer l's keys and values: k_caches[l], v_caches[l] [Hkv, cache_slots, D]; row r
   sees keys j with mask[r * length + j] (slots 0 .. length - 1). Why: a one-row pass made
   ~8 Python steps and 3 ctypes calls a layer, ~60 us of a 0.5B draft layer's ~600.
   Returns 0; NOT_ONE_RUN, having changed nothing but layer 0's cache slots (which the
   caller's own path writes again alike), when some row's keys are not one run; or the
   failing call's code. */
int understudy_layers(const layer_t *const *layers, long n_layers, span_fn attend, float *x,
                      long rows, const float *cos_, const float *sin_, const long *slots,
                      float *const *k_caches, float *const *v_caches, long cache_slots,
                      const unsigned char *mask, long length, float scale, float softcap,
                      int threads) {
    if (n_layers < 1) return 0;
    const long H = layers[0]->heads, G = layers[0]->kv_heads, D = layers[0]->head_dim;
    float *q = malloc(sizeof(float) * rows * H * D);
    float *out = malloc(sizeof(float) * rows * H * D);
    int code = (q && out) ? 0 : -21;
    for (long l = 0; code == 0 && l < n_layers; l++) {
        const layer_t *L = layers[l];
        if (L->heads != H || L->kv_heads != G || L->head_dim != D) {
            code = -22;
            break;
        }
        code = understudy_layer_input(L, x, rows, cos_, sin_, slots, k_caches[l], v_caches[l],
                                      cache_slots, q, threads);
        if (code == 0)
            code = attend(q, H * D, D, k_caches[l], v_caches[l], 0, cache_slots * D, D, 0, mask,
                          length, length, rows, H, G, D, scale, softcap, out, threads);
        if (code == NOT_ONE_RUN && l > 0) code = -23; /* every layer sees the same mask */
        if (code == 0) code = understudy_layer_output(L, x, out, rows, threads);
    }
    free(q);
    free(out);
    return code;
}
