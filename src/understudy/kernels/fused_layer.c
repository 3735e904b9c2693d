/* A decoder layer's work around its attention, in two calls, for models on GGUF blocks.

   understudy_layer_input:   h = rmsnorm(x) * w1;  q,k,v = h W_qkv^T + b;  each head of q and
                             k normed by its own RMSNorm (when given: Qwen3, Gemma 3); their
                             first rotary_dim features rotated; k and v written into the
                             cache at each row's slot;  q out
   understudy_layer_output:  a = attn W_o^T, normed again when post_attn is given;  x += a;
                             h = rmsnorm(x) * w2;  m = (act(h W_gate^T) * (h W_up^T)) W_down^T,
                             normed again when post_mlp is given (Gemma's sandwich norms);
                             x += m.  act: SiLU, or GELU's tanh form (Gemma)
   understudy_layer_mlp_input: its first half, for a mixture's layer, whose experts the caller
                             runs:  x += a;  h out
   understudy_layer_mlp:     m of rows h, for a layer_t that holds only an MLP (an expert's)

   The attention itself (which keys each row sees) stays in Python (models/attention.py),
   except in understudy_layers: every layer of a pass in one call, for the common pass whose
   rows all see one run of keys from slot 0, attended by span_attention.c's kernel. The
   products are kernels/qgemm.c's and the attention span_attention.c's, reached through
   pointers the caller hands over, so this file never needs their sources.

   Invariant: every step is row-wise, each row computed by the same sequence of float
   operations whatever the number of rows, and qgemm is row-invariant: a row's results are
   bitwise the same in a pass of one row or of many. The norms sum squares in 16 lanes
   and one fixed tree; the exp of silu and the tanh of GELU are polynomials in plain
   arithmetic (exp_poly.h), so a vectorised and a scalar evaluation agree (compiled with
   -ffp-contract=off). Why at all: a one-row pass of the 1.5B target made ~40 small torch
   calls and Python steps a layer; with these two calls a one-row pass took 43 ms instead of
   56 (one thread, CPU time). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"

#define LANES 16
#define MAX_PARTS 4
#define ACT_SILU 0
#define ACT_GELU_TANH 1

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
    linear_t qkv, o, gate_up, down;    /* gate_up.parts == 0: no MLP of its own (a mixture) */
    const float *norm1, *norm2;        /* RMSNorm weights [hidden]: before attention, the MLP */
    const float *post_attn, *post_mlp; /* after them [hidden]; NULL: none */
    const float *q_norm, *k_norm;      /* each head's RMSNorm of q and k [head_dim]; NULL: none */
    float eps;
    long hidden, heads, kv_heads, head_dim, rotary_dim, intermediate;
    int activation;                    /* ACT_SILU or ACT_GELU_TANH */
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

/* out[i] = act(gate[i]) * up[i]: silu(g) = g * sigmoid(g), sigmoid from exp(-|g|); or
   gelu(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))) */
static void act_times(int activation, const float *restrict gate, const float *restrict up,
                      long n, float *restrict out) {
    if (activation == ACT_GELU_TANH) {
        for (long i = 0; i < n; i++) {
            float g = gate[i];
            float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
            out[i] = (0.5f * g * (1.0f + tanh_poly(inner))) * up[i];
        }
        return;
    }
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

/* one head of q or k: normed by `norm` when given (through `scratch`, dim floats), its first
   `rot` features rotated by c, s, the rest copied */
static void head_out(const float *x, const float *norm, float eps, const float *c,
                     const float *s, long dim, long rot, float *scratch, float *out) {
    if (norm != NULL) {
        rms_norm(x, norm, eps, dim, scratch);
        x = scratch;
    }
    rotate(x, c, s, rot, out);
    memcpy(out + rot, x + rot, sizeof(float) * (dim - rot));
}

int understudy_layer_input(const layer_t *L, const float *x, long rows,
                           const float *cos_, const float *sin_,  /* [rows, rotary_dim] */
                           const long *slots, float *k_cache, float *v_cache,
                           long cache_slots,                      /* S of [Hkv, S, D] */
                           float *q_out, int threads)             /* [rows, heads, D] */
{
    const long D = L->head_dim, H = L->heads, G = L->kv_heads, rot = L->rotary_dim;
    const long width = L->qkv.out_features;
    if (width != (H + 2 * G) * D || rot <= 0 || rot > D || rot % 2) return -20;
    float *normed = malloc(sizeof(float) * rows * L->hidden);
    float *qkv = malloc(sizeof(float) * rows * width);
    float *scratch = malloc(sizeof(float) * D);
    int code = (normed && qkv && scratch) ? 0 : -21;
    for (long r = 0; code == 0 && r < rows; r++)
        rms_norm(x + r * L->hidden, L->norm1, L->eps, L->hidden, normed + r * L->hidden);
    if (code == 0) code = apply(L, &L->qkv, normed, qkv, rows, threads);
    for (long r = 0; code == 0 && r < rows; r++) {
        const float *row = qkv + r * width, *c = cos_ + r * rot, *s = sin_ + r * rot;
        for (long h = 0; h < H; h++)
            head_out(row + h * D, L->q_norm, L->eps, c, s, D, rot, scratch,
                     q_out + (r * H + h) * D);
        for (long g = 0; g < G; g++) {
            head_out(row + (H + g) * D, L->k_norm, L->eps, c, s, D, rot, scratch,
                     k_cache + (g * cache_slots + slots[r]) * D);
            memcpy(v_cache + (g * cache_slots + slots[r]) * D, row + (H + G + g) * D,
                   sizeof(float) * D);
        }
    }
    free(normed);
    free(qkv);
    free(scratch);
    return code;
}

/* x += b for rows [rows, hidden], b normed by `post` first when given (into scratch) */
static void add_branch(const float *post, float eps, long hidden, long rows, const float *b,
                       float *scratch, float *x) {
    if (post != NULL) {
        for (long r = 0; r < rows; r++)
            rms_norm(b + r * hidden, post, eps, hidden, scratch + r * hidden);
        b = scratch;
    }
    for (long i = 0; i < rows * hidden; i++) x[i] += b[i];
}

/* x += attn W_o^T (post-normed), then normed = rmsnorm(x) * norm2; tmp: rows * hidden */
static int attention_residual(const layer_t *L, float *x, const float *attn, long rows,
                              float *tmp, float *normed, int threads) {
    const long hidden = L->hidden;
    int code = apply(L, &L->o, attn, tmp, rows, threads);
    if (code != 0) return code;
    add_branch(L->post_attn, L->eps, hidden, rows, tmp, normed, x);
    for (long r = 0; r < rows; r++)
        rms_norm(x + r * hidden, L->norm2, L->eps, hidden, normed + r * hidden);
    return 0;
}

/* out = (act(h W_gate^T) * (h W_up^T)) W_down^T for rows h [rows, hidden] */
static int mlp(const layer_t *L, const float *h, long rows, float *out, int threads) {
    const long inter = L->intermediate;
    if (L->gate_up.parts < 1 || L->gate_up.out_features != 2 * inter) return -24;
    float *gate_up = malloc(sizeof(float) * rows * 2 * inter);
    float *act = malloc(sizeof(float) * rows * inter);
    int code = (gate_up && act) ? 0 : -21;
    if (code == 0) code = apply(L, &L->gate_up, h, gate_up, rows, threads);
    for (long r = 0; code == 0 && r < rows; r++)
        act_times(L->activation, gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter,
                  act + r * inter);
    if (code == 0) code = apply(L, &L->down, act, out, rows, threads);
    free(gate_up);
    free(act);
    return code;
}

int understudy_layer_output(const layer_t *L, float *x, const float *attn, long rows,
                            int threads)                       /* x [rows, hidden] in place */
{
    const long hidden = L->hidden;
    float *tmp = malloc(sizeof(float) * rows * hidden);
    float *normed = malloc(sizeof(float) * rows * hidden);
    int code = (tmp && normed) ? 0 : -21;
    if (code == 0) code = attention_residual(L, x, attn, rows, tmp, normed, threads);
    if (code == 0) code = mlp(L, normed, rows, tmp, threads);
    if (code == 0) add_branch(L->post_mlp, L->eps, hidden, rows, tmp, normed, x);
    free(tmp);
    free(normed);
    return code;
}

int understudy_layer_mlp_input(const layer_t *L, float *x, const float *attn, long rows,
                               float *normed, int threads)  /* x in place; normed [rows, hidden] */
{
    float *tmp = malloc(sizeof(float) * rows * L->hidden);
    int code = tmp ? attention_residual(L, x, attn, rows, tmp, normed, threads) : -21;
    free(tmp);
    return code;
}

int understudy_layer_mlp(const layer_t *L, const float *h, long rows, float *out, int threads) {
    return mlp(L, h, rows, out, threads);
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
