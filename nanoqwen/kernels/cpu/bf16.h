// bfloat16 <-> float32 for the package's C sources (nanoqwen/kernels/cpu/build.py hashes it with
// each source that includes it, so an edit here rebuilds them all).
#pragma once

#include <stdint.h>

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c = {(uint32_t)v << 16};
    return c.f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);  // NaN
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

// f rounded to the nearest bfloat16, as a float: where HF's bfloat16 forward rounds.
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }
