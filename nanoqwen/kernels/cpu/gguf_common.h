// What the GGUF few-row matmuls share (gguf_gemv.c: the formats in lanes; gguf_kquants.c:
// Q3_K and Q2_K): the activations quantized to int8 per block of 32 (scale max|x| / 127), as
// llama.cpp does for its dot products with Q8_0 activations, the output's rounding and bias,
// and the per-channel int8 copy of a weight row for the prefill matmul.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "simd16.h"

#define MAX_ROWS 8
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Output n of row m: float32, or bfloat16 with the bias (bfloat16, or NULL) added after the
// rounding, as torch's .to(bfloat16) and then + bias round twice.
static inline void store(void* y, int out_bf16, const uint16_t* bias, int64_t m, int64_t n,
                         int64_t N, float v) {
    if (!out_bf16) {
        ((float*)y)[m * N + n] = v;
        return;
    }
    uint16_t r = float_to_bf16(v);
    if (bias) r = float_to_bf16(bf16_to_float(r) + bf16_to_float(bias[n]));
    ((uint16_t*)y)[m * N + n] = r;
}

// One activation row of K values (bfloat16 or float32) to int8 blocks: xq, per-block scale
// dx and zero * dx * sum(xq) (the term that the codes' offset `zero` contributes).
static void quantize_row(const void* x, int is_bf16, int64_t K, float zero, int8_t* xq,
                         float* dx, float* offset_term) {
    for (int64_t b = 0; b < K / 32; b++) {
        float v[32];
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            v[j] = is_bf16 ? bf16_to_float(((const uint16_t*)x)[32 * b + j])
                           : ((const float*)x)[32 * b + j];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)nearbyintf(v[j] * id);
            xq[32 * b + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        offset_term[b] = zero * d * (float)sum;
    }
}

// The M activation rows as int8 blocks of 32 (quantize_row with `zero`): xq [M][K], dx and
// the offset terms [M][K/32]. Returns 0, or 2 (nothing allocated) when memory runs out.
typedef struct {
    int8_t* xq;
    float* dx;
    float* off;
} Activations;

static void free_activations(Activations* a) { free(a->xq), free(a->dx), free(a->off); }

static int quantize_activations(const void* x, int is_bf16, int64_t M, int64_t K, float zero,
                                Activations* a) {
    const int64_t nb = K / 32;
    a->xq = malloc((size_t)(M * K));
    a->dx = malloc(sizeof(float) * M * nb);
    a->off = malloc(sizeof(float) * M * nb);
    if (!a->xq || !a->dx || !a->off) {
        free_activations(a);
        return 2;
    }
    const size_t x_row = (size_t)K * (is_bf16 ? 2 : 4);
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char*)x + m * x_row, is_bf16, K, zero, a->xq + m * K, a->dx + m * nb,
                     a->off + m * nb);
    return 0;
}

// Per-channel int8 of one row of a symmetric int8 weight in groups of g (codes q [K], float32
// scales s [K/g]): row scale r = max |q * s| / 127 and codes round(q * s / r) (ties to even),
// what the int8 x int8 prefill matmul takes.
static inline void requantize_row(const int8_t* qn, const float* sn, int64_t K, int64_t g,
                                  int8_t* out, float* r) {
    const int64_t ng = K / g;
    float amax = 0.0f;
    for (int64_t b = 0; b < ng; b++) {
        int m = 0;
        for (int64_t j = 0; j < g; j++) m = abs(qn[b * g + j]) > m ? abs(qn[b * g + j]) : m;
        amax = fmaxf(amax, (float)m * fabsf(sn[b]));  // GGUF scales may be negative
    }
    float row = amax / 127.0f;
    *r = row;
    // 16 codes at a time, the scalar loop's arithmetic: the same float32 product, rounded to
    // nearest even (nearbyintf's default mode), max then min as fmaxf/fminf order them (a
    // NaN product gives -127 in both).
    const vf lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (int64_t b = 0; b < ng; b++) {
        float f = row > 0.0f ? sn[b] / row : 0.0f;
        const vf fv = vf_set1(f);
        int64_t j = 0;
        for (; j + 16 <= g; j += 16) {
            __m128i c = _mm_loadu_si128((const __m128i*)(qn + b * g + j));
            vf v = vf_round(vf_mul(vf_from_i32(vi_from_i8(c)), fv));
            v = vf_min(vf_max(v, lo), hi);
            // exact: integral, in range
            _mm_storeu_si128((__m128i*)(out + b * g + j), vi_to_i8(v));
        }
        for (; j < g; j++) {
            float v = nearbyintf((float)qn[b * g + j] * f);
            out[b * g + j] = (int8_t)fminf(fmaxf(v, -127.0f), 127.0f);
        }
    }
}

// A dequantized row w [K] (float32, max |w| amax) as per-channel int8: r = amax / 127 and
// codes round(w / r) to nearest even, clamped, 16 at a time (format.quantize_int8's
// arithmetic).
static inline void per_channel_row(const float* w, int64_t K, float amax, int8_t* o, float* r) {
    const float row = amax / 127.0f, safe = row > 0.0f ? row : 1.0f;
    *r = row;
    const vf sv = vf_set1(safe), lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (int64_t j = 0; j < K; j += 16) {
        const vf v = vf_min(vf_max(vf_round(vf_div(vf_load(w + j), sv)), lo), hi);
        _mm_storeu_si128((__m128i*)(o + j), vi_to_i8(v));
    }
}
