// Few-row matmuls over GGUF Q5_0 and Q8_0 blocks (AVX512-VNNI), built at first use by
// nanoqwen/quant/native.py and called through ctypes.
//
// A weight row is K/32 blocks of 32 unsigned codes c and a float16 scale d[n][b]:
//   Q5_0 (q5_gemv): five-bit codes, w = d * (c - 16), stored as the file has them:
//     qs[n][b][16]: byte j = low nibble of c[j] | low nibble of c[j + 16] << 4
//     qh[n][b]:     bit j = bit 4 of c[j]
//   Q8_0 (q8_gemv): qs[n][b][32] = c = the file's int8 code + 128, w = d * (c - 128).
// The activations are quantized per block of 32 to int8 (scale max|x| / 127), as llama.cpp
// does for its Q5_0/Q8_0 x Q8_0 dot products, so each block is one unsigned x signed byte dot
// product (vpdpbusd) and the codes' offset one term per block: zero * d_x * sum(x_q).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../native/bf16.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512VNNI__) || !defined(__F16C__)
#error "gguf_gemv.c needs AVX512 F/BW/VL/VNNI and F16C"
#endif

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

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Codes of blocks b and b + 1 as 64 unsigned bytes in x's order: [lo_b | hi_b | lo_b1 | hi_b1],
// the high bits added from the two 32-bit masks.
static inline __m512i two_blocks(const uint8_t* qs, const uint32_t* qh) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i packed = _mm256_loadu_si256((const __m256i*)qs);
    __m256i lo = _mm256_and_si256(packed, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo_b lo_b1 hi_b hi_b1
    c = _mm512_shuffle_i64x2(c, c, _MM_SHUFFLE(3, 1, 2, 0));
    uint64_t high;
    memcpy(&high, qh, 8);
    return _mm512_mask_add_epi8(c, (__mmask64)high, c, _mm512_set1_epi8(16));
}

static inline __m256i one_block(const uint8_t* qs, uint32_t qh) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i packed = _mm_loadu_si128((const __m128i*)qs);
    __m128i lo = _mm_and_si128(packed, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    __m256i c = _mm256_set_m128i(hi, lo);
    return _mm256_mask_add_epi8(c, (__mmask32)qh, c, _mm256_set1_epi8(16));
}

// Row n of the output for M activation rows; M and bits (5 or 8) are compile-time constants
// at each call site so that the accumulators stay in registers.
static inline __attribute__((always_inline)) void dot_row(
    const int M, const int bits, int64_t n, int64_t N, int64_t K, const uint8_t* qs,
    const uint32_t* qh, const uint16_t* d, const int8_t* xq, const float* dx, const float* off,
    void* y, int out_bf16, const uint16_t* bias) {
    const int64_t nb = K / 32;
    const int64_t block_bytes = bits == 5 ? 16 : 32;
    qs += n * nb * block_bytes, d += n * nb;
    if (bits == 5) qh += n * nb;
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
    }
    float scale[M][nb + 16];  // room for the masked stores past nb
    __m512 corr16[M];
    for (int m = 0; m < M; m++) corr16[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        __mmask16 live = nb - b >= 16 ? 0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + b));
        for (int m = 0; m < M; m++) {
            __m512 dxm = _mm512_maskz_loadu_ps(live, dx + m * nb + b);
            _mm512_storeu_ps(&scale[m][b], _mm512_mul_ps(dw, dxm));
            corr16[m] = _mm512_fmadd_ps(dw, _mm512_maskz_loadu_ps(live, off + m * nb + b), corr16[m]);
        }
    }
    float corr[M];
    for (int m = 0; m < M; m++) corr[m] = _mm512_reduce_add_ps(corr16[m]);
    __m512 acc[M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i c = bits == 5 ? two_blocks(qs + 16 * b, qh + b)
                              : _mm512_loadu_si512((const void*)(qs + 32 * b));
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
        __m256i c = bits == 5 ? one_block(qs + 16 * b, qh[b])
                              : _mm256_loadu_si256((const __m256i*)(qs + 32 * b));
        for (int m = 0; m < M; m++) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * K + 32 * b));
            __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xv);
            tail[m] = hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[m][b])));
        }
    }
    for (int m = 0; m < M; m++)
        store(y, out_bf16, bias, m, n, N, _mm512_reduce_add_ps(acc[m]) + tail[m] - corr[m]);
}

#define ROWS_CASE(R, BITS)                                                          \
    case R:                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")           \
        for (int64_t n = 0; n < N; n++)                                             \
            dot_row(R, BITS, n, N, K, qs, qh, d, xq, dx, off, y, out_bf16, bias);   \
        break;

// y[m][n] = sum_k x[m][k] * w[n][k] for m < M <= MAX_ROWS; x is bfloat16 when is_bf16, else
// float32; y is float32 [M][N], or bfloat16 plus bias (NULL: none) when out_bf16. Returns 0,
// or nonzero for arguments it does not take.
static int gemv(int bits, const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
                const uint32_t* qh, const uint16_t* d, int64_t N, void* y, int out_bf16,
                const uint16_t* bias, int threads) {
    if (M < 1 || M > MAX_ROWS || K % 32) return 1;
    Activations a;
    if (quantize_activations(x, is_bf16, M, K, bits == 5 ? 16.0f : 128.0f, &a)) return 2;
    const int8_t* xq = a.xq;
    const float *dx = a.dx, *off = a.off;
    if (bits == 5) {
        switch (M) {
            ROWS_CASE(1, 5) ROWS_CASE(2, 5) ROWS_CASE(3, 5) ROWS_CASE(4, 5)
            ROWS_CASE(5, 5) ROWS_CASE(6, 5) ROWS_CASE(7, 5) ROWS_CASE(8, 5)
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
    return gemv(5, x, is_bf16, M, K, qs, qh, d, N, y, out_bf16, bias, threads);
}

int q8_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint16_t* d, int64_t N, void* y, int out_bf16, const uint16_t* bias,
            int threads) {
    return gemv(8, x, is_bf16, M, K, qs, NULL, d, N, y, out_bf16, bias, threads);
}

// Q6_K (q6k_gemv): superblocks of 256 values as the file stores them, in four arrays:
//   ql[n][s][128]: low 4 bits. In half h (values 128h..128h+127), byte 64h + l holds value
//                  128h + l in its low nibble and value 128h + 64 + l in its high one (l < 64).
//   qh[n][s][64]:  high 2 bits. Byte 32h + l holds values 128h + l, +32, +64, +96 in bits
//                  0-1, 2-3, 4-5, 6-7 (l < 32).
//   sc[n][s][16]:  an int8 scale a 16 values; d[n][s]: float16.
// w = d * sc[j / 16] * (c - 32) for the 6-bit code c. The activations are int8 blocks of 32
// as for Q5_0 (scale dx); the offset 32 contributes d * sc * dx * 32 * (the 16 codes' sum),
// so each 16 values' sum of x's codes is kept too.

// Row n of the output for M activation rows: per superblock, the 16 group scales d * sc (exact
// in float32: an 11-bit by 7-bit product), then 4 x 64 codes (values 64c..64c+63 are groups
// 4c..4c+3: lane i of a 64-byte dot product sums values 4i..4i+3, group 4c + i / 4).
static inline __attribute__((always_inline)) void dot_row_q6(
    const int M, int64_t n, int64_t N, int64_t K, const uint8_t* ql, const uint8_t* qh,
    const int8_t* sc, const uint16_t* d, const int8_t* xq, const float* dxg, const float* off,
    void* y, int out_bf16, const uint16_t* bias) {
    const int64_t ns = K / 256;
    ql += n * ns * 128, qh += n * ns * 64, sc += n * ns * 16, d += n * ns;
    // The next rows' bytes PREFETCH_BYTES ahead, as dot_row does.
    const int64_t row_bytes = ns * 210;
    const int64_t ahead = row_bytes >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / row_bytes;
    if (n + ahead < N) {
        const char* parts[4] = {(const char*)(ql + ahead * ns * 128),
                                (const char*)(qh + ahead * ns * 64),
                                (const char*)(sc + ahead * ns * 16), (const char*)(d + ahead * ns)};
        const int64_t sizes[4] = {ns * 128, ns * 64, ns * 16, ns * 2};
        for (int p = 0; p < 4; p++)
            for (int64_t at = 0; at < sizes[p]; at += 64) _mm_prefetch(parts[p] + at, _MM_HINT_T0);
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m256i two = _mm256_set1_epi8(0x03);
    __m512i lane_group[4];
    for (int c = 0; c < 4; c++)
        lane_group[c] = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2,
                                         4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 1, 4 * c + 1,
                                         4 * c + 1, 4 * c + 1, 4 * c, 4 * c, 4 * c, 4 * c);
    __m512 acc[M], corr16[M];
    for (int m = 0; m < M; m++) acc[m] = corr16[m] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d[s])),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                       _mm_loadu_si128((const __m128i*)(sc + 16 * s)))));
        __m512 w[M];
        for (int m = 0; m < M; m++) {
            const int64_t g = m * (K / 16) + 16 * s;
            w[m] = _mm512_mul_ps(dsc, _mm512_loadu_ps(dxg + g));
            corr16[m] = _mm512_fmadd_ps(dsc, _mm512_loadu_ps(off + g), corr16[m]);
        }
        for (int h = 0; h < 2; h++) {
            __m512i q = _mm512_loadu_si512((const void*)(ql + 128 * s + 64 * h));
            __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 64 * s + 32 * h));
            __m512i lo = _mm512_and_si512(q, low4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            __m256i b0 = _mm256_and_si256(hb, two);
            __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), two);
            __m256i b2 = _mm256_and_si256(_mm256_srli_epi16(hb, 4), two);
            __m256i b3 = _mm256_and_si256(_mm256_srli_epi16(hb, 6), two);
            __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1);
            __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(b2), b3, 1);
            // Bits 4-5 from the high parts: values up to 3, so a 16-bit shift moves no bit
            // across a byte.
            __m512i c0 = _mm512_or_si512(lo, _mm512_slli_epi16(h01, 4));
            __m512i c1 = _mm512_or_si512(hi, _mm512_slli_epi16(h23, 4));
            for (int m = 0; m < M; m++) {
                const int8_t* x = xq + m * K + 256 * s + 128 * h;
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0,
                                                 _mm512_loadu_si512((const void*)x));
                __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c1,
                                                 _mm512_loadu_si512((const void*)(x + 64)));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0),
                                         _mm512_permutexvar_ps(lane_group[2 * h], w[m]), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1),
                                         _mm512_permutexvar_ps(lane_group[2 * h + 1], w[m]),
                                         acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        store(y, out_bf16, bias, m, n, N,
              _mm512_reduce_add_ps(acc[m]) - _mm512_reduce_add_ps(corr16[m]));
}

#define Q6_ROWS_CASE(R)                                                                 \
    case R:                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")               \
        for (int64_t n = 0; n < N; n++)                                                 \
            dot_row_q6(R, n, N, K, ql, qh, sc, d, xq, dxg, off, y, out_bf16, bias);     \
        break;

// q5_gemv's contract for Q6_K weights (K a multiple of 256).
int q6k_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* ql,
             const uint8_t* qh, const int8_t* sc, const uint16_t* d, int64_t N, void* y,
             int out_bf16, const uint16_t* bias, int threads) {
    if (M < 1 || M > MAX_ROWS || K % 256) return 1;
    const int64_t nb = K / 32, ng = K / 16;
    Activations a;
    if (quantize_activations(x, is_bf16, M, K, 0.0f, &a)) return 2;
    const int8_t* xq = a.xq;
    // Per 16 values: the block's scale, and the offset term of the codes' 32.
    float* dxg = malloc(sizeof(float) * M * ng);
    float* off = malloc(sizeof(float) * M * ng);
    if (!dxg || !off) {
        free(dxg), free(off), free_activations(&a);
        return 2;
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < ng; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += xq[m * K + 16 * g + j];
            dxg[m * ng + g] = a.dx[m * nb + g / 2];
            off[m * ng + g] = 32.0f * a.dx[m * nb + g / 2] * (float)sum;
        }
    }
    switch (M) {
        Q6_ROWS_CASE(1) Q6_ROWS_CASE(2) Q6_ROWS_CASE(3) Q6_ROWS_CASE(4)
        Q6_ROWS_CASE(5) Q6_ROWS_CASE(6) Q6_ROWS_CASE(7) Q6_ROWS_CASE(8)
    }
    free(dxg), free(off), free_activations(&a);
    return 0;
}

// Q4_K (q4k_gemv): superblocks of 256 values in five arrays:
//   qs[n][s][128]: 4-bit codes; byte 32c + l holds value 64c + l in its low nibble and value
//                  64c + 32 + l in its high one (c < 4, l < 32)
//   sc[n][s][8], m[n][s][8]: the six-bit scale and min of each 32 values (the file's 12
//                  bytes unpacked at load); d[n][s], dmin[n][s]: float16
// w = d * sc[j] * c - dmin * m[j] for the code c of value 32j + i. With x's int8 blocks of 32
// (scale dx, code sum S), block j adds d * sc[j] * dx * (codes . x) - dmin * m[j] * dx * S.

static inline __attribute__((always_inline)) void dot_row_q4(
    const int M, int64_t n, int64_t N, int64_t K, const uint8_t* qs, const uint8_t* sc,
    const uint8_t* mn, const uint16_t* d, const uint16_t* dmin, const int8_t* xq,
    const float* dx, const float* off, void* y, int out_bf16, const uint16_t* bias) {
    const int64_t ns = K / 256;
    qs += n * ns * 128, sc += n * ns * 8, mn += n * ns * 8, d += n * ns, dmin += n * ns;
    const int64_t row_bytes = ns * 148;
    const int64_t ahead = row_bytes >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / row_bytes;
    if (n + ahead < N) {
        const char* parts[3] = {(const char*)(qs + ahead * ns * 128),
                                (const char*)(sc + ahead * ns * 8), (const char*)(mn + ahead * ns * 8)};
        const int64_t sizes[3] = {ns * 128, ns * 8, ns * 8};
        for (int p = 0; p < 3; p++)
            for (int64_t at = 0; at < sizes[p]; at += 64) _mm_prefetch(parts[p] + at, _MM_HINT_T0);
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    // Lanes 0-7 sum sub-block a's values, lanes 8-15 sub-block b's: their scales' lanes.
    __m512i pair[4];
    for (int c = 0; c < 4; c += 2)
        for (int half = 0; half < 2; half++) {
            const int a = 2 * c + half, b = 2 * c + 2 + half;
            pair[c + half] = _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
        }
    __m512 acc[M];
    __m256 corr8[M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps(), corr8[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; s++) {
        __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 8 * s))));
        __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mn + 8 * s))));
        __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d[s])), scf);
        __m256 dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dmin[s])), mf);
        __m512 w[M];
        for (int m = 0; m < M; m++) {
            const int64_t b = m * (K / 32) + 8 * s;
            w[m] = _mm512_castps256_ps512(_mm256_mul_ps(dsc, _mm256_loadu_ps(dx + b)));
            corr8[m] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(off + b), corr8[m]);
        }
        for (int c = 0; c < 4; c += 2) {
            __m512i q = _mm512_loadu_si512((const void*)(qs + 128 * s + 32 * c));
            __m512i codes[2] = {_mm512_and_si512(q, low4),
                                _mm512_and_si512(_mm512_srli_epi16(q, 4), low4)};
            for (int m = 0; m < M; m++) {
                const int8_t* x = xq + m * K + 256 * s + 64 * c;
                for (int half = 0; half < 2; half++) {
                    // Values 64c + 32 half + l and 64(c + 1) + 32 half + l.
                    __m512i xv = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(x + 32 * half))),
                        _mm256_loadu_si256((const __m256i*)(x + 64 + 32 * half)), 1);
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[half], xv);
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                             _mm512_permutexvar_ps(pair[c + half], w[m]), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        store(y, out_bf16, bias, m, n, N, _mm512_reduce_add_ps(acc[m]) - hsum(corr8[m]));
}

#define Q4_ROWS_CASE(R)                                                                 \
    case R:                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")               \
        for (int64_t n = 0; n < N; n++)                                                 \
            dot_row_q4(R, n, N, K, qs, sc, mn, d, dmin, xq, dx, off, y, out_bf16, bias); \
        break;

// q5_gemv's contract for Q4_K weights (K a multiple of 256).
int q4k_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint8_t* sc, const uint8_t* mn, const uint16_t* d, const uint16_t* dmin,
             int64_t N, void* y, int out_bf16, const uint16_t* bias, int threads) {
    if (M < 1 || M > MAX_ROWS || K % 256) return 1;
    Activations a;  // offset terms with zero 1: dx times the block's code sum
    if (quantize_activations(x, is_bf16, M, K, 1.0f, &a)) return 2;
    const int8_t* xq = a.xq;
    const float *dx = a.dx, *off = a.off;
    switch (M) {
        Q4_ROWS_CASE(1) Q4_ROWS_CASE(2) Q4_ROWS_CASE(3) Q4_ROWS_CASE(4)
        Q4_ROWS_CASE(5) Q4_ROWS_CASE(6) Q4_ROWS_CASE(7) Q4_ROWS_CASE(8)
    }
    free_activations(&a);
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
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t b = 0; b < ng; b++) {
        float f = row > 0.0f ? sn[b] / row : 0.0f;
        const __m512 fv = _mm512_set1_ps(f);
        int64_t j = 0;
        for (; j + 16 <= g; j += 16) {
            __m128i c = _mm_loadu_si128((const __m128i*)(qn + b * g + j));
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), fv);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            __m128i q8 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));  // exact: integral, in range
            _mm_storeu_si128((__m128i*)(out + b * g + j), q8);
        }
        for (; j < g; j++) {
            float v = nearbyintf((float)qn[b * g + j] * f);
            out[b * g + j] = (int8_t)fminf(fmaxf(v, -127.0f), 127.0f);
        }
    }
}

// requantize_row over N rows of codes q [N][K] and scales s [N][K/g].
void requantize_rows(const int8_t* q, const float* s, int64_t N, int64_t K, int64_t g,
                     int8_t* out, float* r, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        requantize_row(q + n * K, s + n * (K / g), K, g, out + n * K, r + n);
}

// requantize_rows of a weight in q5_gemv's (bits 5) or q8_gemv's (bits 8) layout: each row's
// codes and scales are decoded to what gguf_blocks.py reads from the file (int8 code, float32
// d), so the result is requantize_rows's on that canonical weight, bit for bit.
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

void requantize_q8_rows(const uint8_t* qs, const uint16_t* d, int64_t N, int64_t K, int8_t* out,
                        float* r, int threads) {
    requantize_blocks(8, qs, NULL, d, N, K, out, r, threads);
}
