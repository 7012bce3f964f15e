// The per-channel int8 copies of Q5_0, Q4_0, Q5_1, Q4_1 and Q8_0 weights that the int8 x int8
// prefill matmul reads, made from the file's blocks (not from gguf_gemv.c's lanes): part of
// gguf_gemv.c's library, apart to keep that file about the few-row kernel.
#pragma once

#include "gguf_common.h"

// requantize_row over N rows of codes q [N][K] and scales s [N][K/g].
void requantize_rows(const int8_t* q, const float* s, int64_t N, int64_t K, int64_t g,
                     int8_t* out, float* r, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        requantize_row(q + n * K, s + n * (K / g), K, g, out + n * K, r + n);
}

// requantize_rows of a weight in q5_gemv's (bits 5), q4_gemv's (4) or q8_gemv's (8) layout:
// each row's codes and scales are decoded to what gguf_blocks.py reads from the file (int8
// code, float32 d), so the result is requantize_rows's on that canonical weight, bit for bit.
static void requantize_blocks(int bits, const uint8_t* qs, const uint32_t* qh, const uint16_t* d,
                              int64_t N, int64_t K, int8_t* out, float* r, int threads) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        int8_t q[K];
        float s[nb];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = n * nb + b;
            s[b] = _cvtsh_ss(d[i]);
            int8_t* c = q + 32 * b;
            if (bits == 5) {
                const uint8_t* p = qs + 16 * i;
                const uint32_t h = qh[i];
                for (int j = 0; j < 16; j++) {
                    c[j] = (int8_t)(((p[j] & 15) | ((h >> j) & 1) << 4) - 16);
                    c[j + 16] = (int8_t)(((p[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - 16);
                }
            } else if (bits == 4) {
                const uint8_t* p = qs + 16 * i;
                for (int j = 0; j < 16; j++) {
                    c[j] = (int8_t)((p[j] & 15) - 8);
                    c[j + 16] = (int8_t)((p[j] >> 4) - 8);
                }
            } else {
                const uint8_t* p = qs + 32 * i;
                for (int j = 0; j < 32; j++) c[j] = (int8_t)(p[j] ^ 0x80);  // code + 128
            }
        }
        requantize_row(q, s, K, 32, out + n * K, r + n);
    }
}

void requantize_q5_rows(const uint8_t* qs, const uint32_t* qh, const uint16_t* d, int64_t N,
                        int64_t K, int8_t* out, float* r, int threads) {
    requantize_blocks(5, qs, qh, d, N, K, out, r, threads);
}

void requantize_q4_rows(const uint8_t* qs, const uint16_t* d, int64_t N, int64_t K, int8_t* out,
                        float* r, int threads) {
    requantize_blocks(4, qs, NULL, d, N, K, out, r, threads);
}

void requantize_q8_rows(const uint8_t* qs, const uint16_t* d, int64_t N, int64_t K, int8_t* out,
                        float* r, int threads) {
    requantize_blocks(8, qs, NULL, d, N, K, out, r, threads);
}

// Q5_1 and Q4_1: the canonical weight is asymmetric (codes c, scale d, offset m a block of 32),
// requantized as format.quantize_int8(format.dequantize(w)): w = c * d + m in float32 (c * d is
// exact, so only the add rounds), then per_channel_row.
static void requantize_min_blocks(int bits, const uint8_t* qs, const uint32_t* qh,
                                  const uint16_t* d, const uint16_t* mins, int64_t N, int64_t K,
                                  int8_t* out, float* r, int threads) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        float w[K];
        float amax = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = n * nb + b;
            const float dd = _cvtsh_ss(d[i]), mm = _cvtsh_ss(mins[i]);
            const uint8_t* p = qs + 16 * i;
            const uint32_t h = bits == 5 ? qh[i] : 0;
            for (int j = 0; j < 32; j++) {
                const int low = j < 16 ? p[j] & 15 : p[j - 16] >> 4;
                const int c = low | (int)((h >> j) & 1) << 4;
                w[32 * b + j] = (float)c * dd + mm;
                amax = fmaxf(amax, fabsf(w[32 * b + j]));
            }
        }
        per_channel_row(w, K, amax, out + n * K, r + n);
    }
}

void requantize_q51_rows(const uint8_t* qs, const uint32_t* qh, const uint16_t* d,
                         const uint16_t* m, int64_t N, int64_t K, int8_t* out, float* r,
                         int threads) {
    requantize_min_blocks(5, qs, qh, d, m, N, K, out, r, threads);
}

void requantize_q41_rows(const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t N,
                         int64_t K, int8_t* out, float* r, int threads) {
    requantize_min_blocks(4, qs, NULL, d, m, N, K, out, r, threads);
}
