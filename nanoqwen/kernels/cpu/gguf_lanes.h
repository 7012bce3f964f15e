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

// Lane i of the result: the sum of v[i]'s 16 lanes (a tree of adds that halves 16 vectors to
// 8, 4, 2 and 1, 45 instructions for the 16 sums where one at a time takes 8 each).
static inline __m512 sum16(const __m512* v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  // lanes 4l + {0, 2} and {1, 3}: v[2i]'s, v[2i + 1]'s
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // lane 4l + k: v[4i + k]'s
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  // 128-bit lanes 0, 1: u[2i]'s; 2, 3: u[2i + 1]'s
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// float_to_bf16 (bf16.h) of 16 values.
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                      _mm512_and_si512(high, one)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

// Outputs n0..n0+15 (those of live) of row m, as store() writes one.
static inline void store16(void* y, int out_bf16, const uint16_t* bias, int64_t m, int64_t n0,
                           int64_t N, __mmask16 live, __m512 v) {
    if (!out_bf16) {
        _mm512_mask_storeu_ps((float*)y + m * N + n0, live, v);
        return;
    }
    __m256i r = bf16x16(v);
    if (bias) {
        const __m512 b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + n0)), 16));
        const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
        r = bf16x16(_mm512_add_ps(f, b));
    }
    _mm256_mask_storeu_epi16((uint16_t*)y + m * N + n0, live, r);
}

