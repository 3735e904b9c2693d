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

#endif
