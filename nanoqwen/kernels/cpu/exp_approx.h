// A vectorizable float32 exp for the package's C sources.
#pragma once

#include <math.h>
#include <stdint.h>

// exp(x) within ~2 float32 ulps, in plain arithmetic so that loops over it vectorize (libm's
// expf does not without -ffast-math): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
// polynomial to r^7, times 2^(n-1) built in the exponent bits, times 2 (2^n itself would
// overflow at n = 128, where e^x still fits). 0 below -87 (e^-87 is about float32's least
// normal), inf above float32's largest.
static inline float exp_approx(float x) {
    float xc = x < -87.0f ? -87.0f : (x > 88.72f ? 88.72f : x);
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
    float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;    // ln2 split in two
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)n + 126) << 23;
    float e = p * c.f * 2.0f;
    return x <= -87.0f ? 0.0f : (x > 88.72f ? INFINITY : e);
}
