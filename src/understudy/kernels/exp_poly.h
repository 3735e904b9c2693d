/* exp(x) for x <= 0 (a softmax's or a sigmoid's argument), shared by span_attention.c and
   fused_layer.c: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-7 Taylor polynomial
   (relative error < 2e-7, about 2 ulp); exp(-87) below -87. Branch-free plain arithmetic
   (n by adding and subtracting 1.5 * 2^23, which rounds to an integer), so a loop of it
   vectorises, and under -ffp-contract=off a vector and a scalar evaluation give the same
   bits: a libm call's vector and scalar forms may not. */
#ifndef UNDERSTUDY_EXP_POLY_H
#define UNDERSTUDY_EXP_POLY_H

#include <string.h>

static inline float exp_nonpositive(float x) {
    const float log2e = 1.4426950408889634f, round = 12582912.0f;
    const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
    x = x < -87.0f ? -87.0f : x;
    float n = (x * log2e + round) - round;
    float r = (x - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int bits = ((int)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* tanh(x) in the same plain arithmetic (a soft cap's, a tanh-approximated GELU's): the odd
   series x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 where |x| < 1/4 (its next term is
   below 1e-8 of x there), else (1 - e) / (1 + e) with e = exp(-2|x|), the sign restored.
   Both are computed and one selected, so a loop of it vectorises and gives a scalar
   evaluation's bits. */
static inline float tanh_poly(float x) {
    const float a = x < 0.0f ? -x : x, x2 = x * x;
    float series = 62.0f / 2835.0f;
    series = series * x2 - 17.0f / 315.0f;
    series = series * x2 + 2.0f / 15.0f;
    series = series * x2 - 1.0f / 3.0f;
    series = (series * x2 + 1.0f) * x;
    const float e = exp_nonpositive(-2.0f * a);
    const float t = (1.0f - e) / (1.0f + e);
    return a < 0.25f ? series : (x < 0.0f ? -t : t);
}

#endif
