// Few-row matmuls over GGUF Q5_0, Q4_0, Q5_1, Q4_1 and Q8_0 blocks (AVX512-VNNI), built at
// first use by nanoqwen/kernels/cpu/gguf.py and called through ctypes; gguf_kquants.c has the
// K-quants'.
//
// A weight row is K/32 blocks of 32 unsigned codes c and a float16 scale d[n][b]:
//   Q5_0 (q5_gemv): five-bit codes, w = d * (c - 16), stored as the file has them:
//     qs[n][b][16]: byte j = low nibble of c[j] | low nibble of c[j + 16] << 4
//     qh[n][b]:     bit j = bit 4 of c[j]
//   Q4_0 (q4_gemv): four-bit codes, w = d * (c - 8), qs as Q5_0's (the file's), no qh.
//   Q5_1 (q51_gemv), Q4_1 (q41_gemv): Q5_0's and Q4_0's codes with w = d * c + m, a float16
//     min m[n][b] a block (its term: m * d_x * sum(x_q)).
//   Q8_0 (q8_gemv): qs[n][b][32] = c = the file's int8 code + 128, w = d * (c - 128).
// The activations are quantized per block of 32 to int8 (scale max|x| / 127), as llama.cpp
// does for its Q5_0/Q8_0 x Q8_0 dot products, so each block is one unsigned x signed byte dot
// product (vpdpbusd) and the codes' offset one term per block: zero * d_x * sum(x_q).
// For the nibble layouts (all but Q8_0) the activations are reordered once a call
// (nibble_order) so that four blocks' low nibbles, then their high ones, meet their x values
// as one 64-byte load each. A min (Q5_1, Q4_1) takes the offset term with zero 1 and -m for d.

#include "gguf_common.h"

// Codes of blocks b and b + 1 as 64 unsigned bytes in x's order: [lo_b | hi_b | lo_b1 | hi_b1],
// the high bits added from the two 32-bit masks (Q5_0; none for Q4_0, qh NULL).
static inline __attribute__((always_inline)) __m512i two_blocks(const uint8_t* qs,
                                                                const uint32_t* qh) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i packed = _mm256_loadu_si256((const __m256i*)qs);
    __m256i lo = _mm256_and_si256(packed, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo_b lo_b1 hi_b hi_b1
    c = _mm512_shuffle_i64x2(c, c, _MM_SHUFFLE(3, 1, 2, 0));
    if (!qh) return c;
    uint64_t high;
    memcpy(&high, qh, 8);
    return _mm512_mask_add_epi8(c, (__mmask64)high, c, _mm512_set1_epi8(16));
}

static inline __attribute__((always_inline)) __m256i one_block(const uint8_t* qs,
                                                               const uint32_t* qh) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i packed = _mm_loadu_si128((const __m128i*)qs);
    __m128i lo = _mm_and_si128(packed, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    __m256i c = _mm256_set_m128i(hi, lo);
    if (!qh) return c;
    return _mm256_mask_add_epi8(c, (__mmask32)*qh, c, _mm256_set1_epi8(16));
}

// Row n of the output for M activation rows; M and bits (5, 4 or 8) are compile-time constants
// at each call site so that the accumulators stay in registers.
static inline __attribute__((always_inline)) void dot_row(
    const int M, const int bits, int64_t n, int64_t N, int64_t K, const uint8_t* qs,
    const uint32_t* qh, const uint16_t* d, const uint16_t* mins, const int8_t* xq, const float* dx,
    const float* off, void* y, int out_bf16, const uint16_t* bias) {
    const int64_t nb = K / 32;
    const int64_t block_bytes = bits == 8 ? 32 : 16;
    qs += n * nb * block_bytes, d += n * nb;
    if (bits == 5) qh += n * nb;
    if (mins) mins += n * nb;
    // The rows PREFETCH_BYTES of weight ahead (this thread's, under the static schedule)
    // into the cache while this one computes: without it a core stalls on a row's loads, then
    // computes, and Q5_0's unpacking did not overlap memory at all (gate_up streamed at 17
    // GB/s against 34 when cache-resident; 23 with the prefetch).
    const int64_t row_bytes = nb * block_bytes;
    const int64_t ahead = row_bytes >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / row_bytes;
    if (n + ahead < N) {
        const char* next = (const char*)(qs + ahead * row_bytes);
        for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
        const char* next_d = (const char*)(d + ahead * nb);
        for (int64_t at = 0; at < nb * 2; at += 64) _mm_prefetch(next_d + at, _MM_HINT_T0);
        if (bits == 5) {
            const char* next_h = (const char*)(qh + ahead * nb);
            for (int64_t at = 0; at < nb * 4; at += 64) _mm_prefetch(next_h + at, _MM_HINT_T0);
        }
        if (mins) {
            const char* next_m = (const char*)(mins + ahead * nb);
            for (int64_t at = 0; at < nb * 2; at += 64) _mm_prefetch(next_m + at, _MM_HINT_T0);
        }
    }
    float scale[M][nb + 16];  // room for the masked stores past nb
    __m512 corr16[M];
    for (int m = 0; m < M; m++) corr16[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        __mmask16 live = nb - b >= 16 ? 0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + b));
        // The offset term's factor: d for the codes' offset zero, -m for a min (zero 1).
        __m512 cw = mins ? _mm512_sub_ps(_mm512_setzero_ps(),
                                         _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + b)))
                         : dw;
        for (int m = 0; m < M; m++) {
            __m512 dxm = _mm512_maskz_loadu_ps(live, dx + m * nb + b);
            _mm512_storeu_ps(&scale[m][b], _mm512_mul_ps(dw, dxm));
            corr16[m] = _mm512_fmadd_ps(cw, _mm512_maskz_loadu_ps(live, off + m * nb + b), corr16[m]);
        }
    }
    float corr[M];
    for (int m = 0; m < M; m++) corr[m] = _mm512_reduce_add_ps(corr16[m]);
    __m512 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    int64_t b = 0;
    if (bits != 8) {
        // Four blocks a step, x in nibble_order: lane i of both dot products sums values of
        // block b + i / 4 (of its low nibbles, then of its high ones).
        const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
        const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (; b + 4 <= nb; b += 4) {
            const __m512i q = _mm512_loadu_si512((const void*)(qs + 16 * b));
            __m512i lo = _mm512_and_si512(q, low4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            if (bits == 5) {  // bit j of qh[b]: value j, in lo for j < 16, else in hi
                uint64_t mlo = 0, mhi = 0;
                for (int i = 0; i < 4; i++) {
                    mlo |= (uint64_t)(qh[b + i] & 0xFFFF) << (16 * i);
                    mhi |= (uint64_t)(qh[b + i] >> 16) << (16 * i);
                }
                lo = _mm512_mask_add_epi8(lo, (__mmask64)mlo, lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, (__mmask64)mhi, hi, sixteen);
            }
            for (int m = 0; m < M; m++) {
                const int8_t* x = xq + m * K + 32 * b;
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                  _mm512_loadu_si512((const void*)x));
                dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512((const void*)(x + 64)));
                __m512 s = _mm512_permutexvar_ps(
                    quad, _mm512_castps128_ps512(_mm_loadu_ps(&scale[m][b])));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
            }
        }
    }
    for (; b + 2 <= nb; b += 2) {
        __m512i c = bits == 8 ? _mm512_loadu_si512((const void*)(qs + 32 * b))
                              : two_blocks(qs + 16 * b, bits == 5 ? qh + b : NULL);
        for (int m = 0; m < M; m++) {
            __m512i xv = _mm512_loadu_si512((const void*)(xq + m * K + 32 * b));
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, xv);
            __m512 s = _mm512_permutexvar_ps(
                pick, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double*)&scale[m][b]))));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
        }
    }
    float tail[M];
    for (int m = 0; m < M; m++) tail[m] = 0.0f;
    if (b < nb) {
        __m256i c = bits == 8 ? _mm256_loadu_si256((const __m256i*)(qs + 32 * b))
                              : one_block(qs + 16 * b, bits == 5 ? qh + b : NULL);
        for (int m = 0; m < M; m++) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * K + 32 * b));
            __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xv);
            tail[m] = hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[m][b])));
        }
    }
    for (int m = 0; m < M; m++)
        store(y, out_bf16, bias, m, n, N, _mm512_reduce_add_ps(acc[m]) + tail[m] - corr[m]);
}

// Each row's int8 activations, in place, in the order dot_row's four-block steps read them:
// per 128 values (four blocks), the first 16 of each block, then the last 16 of each (a
// trailing one to three blocks stay as they are).
static void nibble_order(int8_t* xq, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t at = 0; at + 128 <= K; at += 128) {
            int8_t* v = xq + m * K + at;
            int8_t t[128];
            for (int j = 0; j < 4; j++) {
                memcpy(t + 16 * j, v + 32 * j, 16);
                memcpy(t + 64 + 16 * j, v + 32 * j + 16, 16);
            }
            memcpy(v, t, 128);
        }
}

#define ROWS_CASE(R, BITS)                                                          \
    case R:                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")           \
        for (int64_t n = 0; n < N; n++)                                             \
            dot_row(R, BITS, n, N, K, qs, qh, d, mins, xq, dx, off, y, out_bf16, bias); \
        break;

// y[m][n] = sum_k x[m][k] * w[n][k] for m < M <= MAX_ROWS; x is bfloat16 when is_bf16, else
// float32; y is float32 [M][N], or bfloat16 plus bias (NULL: none) when out_bf16. Returns 0,
// or nonzero for arguments it does not take.
static int gemv(int bits, const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
                const uint32_t* qh, const uint16_t* d, const uint16_t* mins, int64_t N, void* y,
                int out_bf16, const uint16_t* bias, int threads) {
    if (M < 1 || M > MAX_ROWS || K % 32) return 1;
    Activations a;
    const float zero = mins ? 1.0f : bits == 5 ? 16.0f : bits == 4 ? 8.0f : 128.0f;
    if (quantize_activations(x, is_bf16, M, K, zero, &a)) return 2;
    if (bits != 8) nibble_order(a.xq, M, K);
    const int8_t* xq = a.xq;
    const float *dx = a.dx, *off = a.off;
    if (bits == 5) {
        switch (M) {
            ROWS_CASE(1, 5) ROWS_CASE(2, 5) ROWS_CASE(3, 5) ROWS_CASE(4, 5)
            ROWS_CASE(5, 5) ROWS_CASE(6, 5) ROWS_CASE(7, 5) ROWS_CASE(8, 5)
        }
    } else if (bits == 4) {
        switch (M) {
            ROWS_CASE(1, 4) ROWS_CASE(2, 4) ROWS_CASE(3, 4) ROWS_CASE(4, 4)
            ROWS_CASE(5, 4) ROWS_CASE(6, 4) ROWS_CASE(7, 4) ROWS_CASE(8, 4)
        }
    } else {
        switch (M) {
            ROWS_CASE(1, 8) ROWS_CASE(2, 8) ROWS_CASE(3, 8) ROWS_CASE(4, 8)
            ROWS_CASE(5, 8) ROWS_CASE(6, 8) ROWS_CASE(7, 8) ROWS_CASE(8, 8)
        }
    }
    free_activations(&a);
    return 0;
}

int q5_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint32_t* qh, const uint16_t* d, int64_t N, void* y, int out_bf16,
            const uint16_t* bias, int threads) {
    return gemv(5, x, is_bf16, M, K, qs, qh, d, NULL, N, y, out_bf16, bias, threads);
}

int q51_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint32_t* qh, const uint16_t* d, const uint16_t* m, int64_t N, void* y,
             int out_bf16, const uint16_t* bias, int threads) {
    return gemv(5, x, is_bf16, M, K, qs, qh, d, m, N, y, out_bf16, bias, threads);
}

int q41_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint16_t* d, const uint16_t* m, int64_t N, void* y, int out_bf16,
             const uint16_t* bias, int threads) {
    return gemv(4, x, is_bf16, M, K, qs, NULL, d, m, N, y, out_bf16, bias, threads);
}

int q4_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint16_t* d, int64_t N, void* y, int out_bf16, const uint16_t* bias,
            int threads) {
    return gemv(4, x, is_bf16, M, K, qs, NULL, d, NULL, N, y, out_bf16, bias, threads);
}

int q8_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint16_t* d, int64_t N, void* y, int out_bf16, const uint16_t* bias,
            int threads) {
    return gemv(8, x, is_bf16, M, K, qs, NULL, d, NULL, N, y, out_bf16, bias, threads);
}

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
