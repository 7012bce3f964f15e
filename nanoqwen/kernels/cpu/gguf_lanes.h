// The activations of gguf_gemv.c's kernel in lanes, and its outputs' sums and stores.
#pragma once

#include "gguf_common.h"

// The M activation rows as int8 in lanes of lv values (32, or 16 for Q6_K), 16 lanes a group,
// G groups a row: xq [M][G * 16 * lv] (byte 16 lv g + 64s + 4j + i: value 4s + i of lane
// 16g + j; 0 past the last lane), and per lane, padded to G * 16: dx (its block of 32's), the
// integer offset -zero * sum(x_q) that starts a lane's dot product, and dx * sum(x_q) (a
// min's factor).
typedef struct {
    int8_t* xq;
    int32_t* init;
    float *dx, *sx;
} Lanes;

static void free_lanes(Lanes* a) { free(a->xq), free(a->init), free(a->dx), free(a->sx); }

static int lane_activations(const void* x, int is_bf16, int64_t M, int64_t K, int lv, int zero,
                            Lanes* a) {
    const int64_t nl = K / lv, G = (nl + 15) / 16;
    a->xq = calloc((size_t)(M * G * 16 * lv), 1);
    a->init = calloc((size_t)(M * G * 16), sizeof(int32_t));
    a->dx = calloc((size_t)(M * G * 16), sizeof(float));
    a->sx = calloc((size_t)(M * G * 16), sizeof(float));
    int8_t* row = malloc((size_t)K);
    float* dx = malloc(sizeof(float) * (K / 32));
    float* unused = malloc(sizeof(float) * (K / 32));
    if (!a->xq || !a->init || !a->dx || !a->sx || !row || !dx || !unused) {
        free_lanes(a), free(row), free(dx), free(unused);
        return 2;
    }
    const size_t x_row = (size_t)K * (is_bf16 ? 2 : 4);
    for (int64_t m = 0; m < M; m++) {
        quantize_row((const char*)x + m * x_row, is_bf16, K, 0.0f, row, dx, unused);
        for (int64_t l = 0; l < nl; l++) {
            const int8_t* v = row + lv * l;
            int sum = 0;
            for (int i = 0; i < lv; i++) sum += v[i];
            const int64_t at = m * G * 16 + l;
            a->init[at] = -zero * sum;
            a->dx[at] = dx[lv * l / 32];
            a->sx[at] = a->dx[at] * (float)sum;
            int8_t* to = a->xq + (m * G + l / 16) * 16 * lv + 4 * (l % 16);
            for (int s = 0; s < lv / 4; s++) memcpy(to + 64 * s, v + 4 * s, 4);
        }
    }
    free(row), free(dx), free(unused);
    return 0;
}

// Outputs n0..n0+count-1 of row m, as store() writes one.
static inline void store16(void* y, int out_bf16, const uint16_t* bias, int64_t m, int64_t n0,
                           int64_t N, int count, vf v) {
    if (!out_bf16) {
        vf_store_n((float*)y + m * N + n0, v, count);
        return;
    }
    __m256i r = vf_to_bf16(v);
    if (bias) {
        const vf b = vf_from_bf16(load_u16_n(bias + n0, count));
        r = vf_to_bf16(vf_add(vf_from_bf16(r), b));
    }
    store_u16_n((uint16_t*)y + m * N + n0, r, count);
}
