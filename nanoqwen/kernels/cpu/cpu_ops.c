// The elementwise and small operations of a bfloat16 step on the CPU, each one pass in C where
// torch takes several ops: at batch 1 of the 0.5B model they were ~6 of a 34 ms decode step,
// and the int8 activations of the quantized layers ~40% of a 512-token prefill (2 threads).
// Plain C, vectorized by the compiler (-O3 -march=native, OpenMP simd): it builds on any CPU.
// Roundings follow HF's bfloat16 forward where it has one (residual add, RMSNorm's cast
// before the weight, RoPE's products and sum, SiLU and its product) and the torch ops they
// replace elsewhere (the int8 activations); attention accumulates in float32 and rounds once.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exp_approx.h"

// out = weight * bf16(h * rsqrt(mean(h^2) + eps)), h = x + residual rounded to bf16 (or x
// where residual is NULL); h is written to residual in place. Rows [rows, n].
void add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight,
                       uint16_t* out, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(rows >= 8 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * n;
        uint16_t* hr = residual ? residual + r * n : (uint16_t*)xr;
        uint16_t* o = out + r * n;
        float ss = 0.0f;
        if (residual) {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                uint16_t h = float_to_bf16(bf16_to_float(xr[i]) + bf16_to_float(hr[i]));
                hr[i] = h;
                ss += bf16_to_float(h) * bf16_to_float(h);
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += bf16_to_float(xr[i]) * bf16_to_float(xr[i]);
        }
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(hr[i]) * inv));
    }
}

// out [rows, n] = bf16(bf16(silu(gate)) * up) for gate_up [rows, 2n] = [gate | up].
void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n,
                   int threads) {
#pragma omp parallel for num_threads(rows * n >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* g = gate_up + r * 2 * n;
        const uint16_t* u = g + n;
        uint16_t* o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float x = bf16_to_float(g[i]);
            o[i] = float_to_bf16(round_bf16(x / (1.0f + exp_approx(-x))) * bf16_to_float(u[i]));
        }
    }
}

// HF's rotate_half RoPE of one head in bfloat16: bf16(bf16(x * cos) + bf16(rot(x) * sin)),
// cos and sin the float32 tables' values rounded to bf16 (half: [dim / 2] of one position).
static void rope_head(const uint16_t* x, const float* cos_half, const float* sin_half,
                      int64_t dim, uint16_t* out) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = round_bf16(cos_half[i]), s = round_bf16(sin_half[i]);
        float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
        out[i] = float_to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s));
        out[i + half] = float_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
    }
}

// Attention of the q heads of sequence s that share KV head h (one task of the step's
// parallel loop). Inlined with dim a constant for the usual head sizes, so that the dot and
// axpy loops over it unroll into registers.
static inline __attribute__((always_inline)) int attend(
    const uint16_t* q_rot, const int32_t* table, int64_t len, const uint16_t* k_cache,
    const uint16_t* v_cache, int64_t block_size, int64_t s, int64_t h, int64_t heads,
    int64_t kv_heads, const int64_t dim, float scale, uint16_t* out) {
    int64_t group = heads / kv_heads;
    // scores [group, len], then one block of keys in float32 [block_size, dim], converted
    // once for all the group's q heads, each of which streams it with its q in registers.
    float* scores = malloc(sizeof(float) * (group * len + block_size * dim));
    if (!scores) return 1;
    float* restrict keys = scores + group * len;
    float q[dim], acc[dim];
    // Block by block: a 64-bit division per key would cost as much as its dots.
    for (int64_t b = 0, start = 0; start < len; b++, start += block_size) {
        int64_t n = len - start < block_size ? len - start : block_size;
        const uint16_t* k = k_cache + ((int64_t)table[b] * block_size * kv_heads + h) * dim;
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = 0; d < dim; d++) keys[i * dim + d] = bf16_to_float(k[i * kv_heads * dim + d]);
        for (int64_t g = 0; g < group; g++) {
            const uint16_t* qg = q_rot + (s * heads + h * group + g) * dim;
            for (int64_t d = 0; d < dim; d++) q[d] = bf16_to_float(qg[d]);
            float* sg = scores + g * len + start;
            for (int64_t i = 0; i < n; i++) {
                const float* restrict key = keys + i * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += q[d] * key[d];
                sg[i] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, sum = 0.0f, *sg = scores + g * len;
        for (int64_t j = 0; j < len; j++) top = sg[j] > top ? sg[j] : top;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) {
            sg[j] = exp_approx(sg[j] - top);
            sum += sg[j];
        }
        // Each head's output row stays in registers over every value of the context.
        for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
        for (int64_t b = 0, start = 0; start < len; b++, start += block_size) {
            int64_t n = len - start < block_size ? len - start : block_size;
            const uint16_t* v = v_cache + ((int64_t)table[b] * block_size * kv_heads + h) * dim;
            for (int64_t i = 0; i < n; i++, v += kv_heads * dim) {
                float p = sg[start + i];
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) acc[d] += p * bf16_to_float(v[d]);
            }
        }
        uint16_t* o = out + (s * heads + h * group + g) * dim;
        float inv = 1.0f / sum;
        for (int64_t d = 0; d < dim; d++) o[d] = float_to_bf16(acc[d] * inv);
    }
    free(scores);
    return 0;
}

// RoPE of every token's q and k heads, k and v written to the paged cache at the token's
// slot (none where it is negative), the rotated q to q_out [tokens, heads, dim]: what a
// prefill's attention needs before it reads the cache. qkv [tokens, qkv_stride] holds q
// (heads * dim), k and v (kv_heads * dim each); caches [blocks, block_size, kv_heads, dim].
void rope_store_bf16(const uint16_t* qkv, int64_t qkv_stride, int64_t tokens,
                     const int64_t* positions, const int64_t* slots, const float* cos_half,
                     const float* sin_half, uint16_t* k_cache, uint16_t* v_cache, int64_t heads,
                     int64_t kv_heads, int64_t dim, uint16_t* q_out, int threads) {
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(tokens >= 64 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t* row = qkv + t * qkv_stride;
        const float* c = cos_half + positions[t] * half;
        const float* sn = sin_half + positions[t] * half;
        for (int64_t h = 0; h < heads; h++)
            rope_head(row + h * dim, c, sn, dim, q_out + (t * heads + h) * dim);
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = (slots[t] * kv_heads + h) * dim;
            rope_head(row + (heads + h) * dim, c, sn, dim, k_cache + at);
            const uint16_t* v = row + (heads + kv_heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) v_cache[at + d] = v[d];
        }
    }
}

// One decode token per sequence: RoPE on its q and k heads, k and v written to the paged
// cache at its slot, then attention of each q head over the sequence's context (every key of
// the cache up to and including this token's). qkv [seqs, qkv_stride] holds q (heads * dim),
// k and v (kv_heads * dim each); caches [blocks, block_size, kv_heads, dim]; block_tables
// [seqs, table_width]; out [seqs, heads, dim]. Returns 0, or 1 where memory ran out.
int decode_attention_bf16(const uint16_t* qkv, int64_t qkv_stride, int64_t seqs,
                          const int64_t* positions, const int64_t* slots,
                          const int32_t* context_lens, const int32_t* block_tables,
                          int64_t table_width, const float* cos_half, const float* sin_half,
                          uint16_t* k_cache, uint16_t* v_cache, int64_t block_size,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          uint16_t* out, int threads) {
    uint16_t* q_rot = malloc(sizeof(uint16_t) * seqs * heads * dim);
    if (!q_rot) return 1;
    rope_store_bf16(qkv, qkv_stride, seqs, positions, slots, cos_half, sin_half, k_cache,
                    v_cache, heads, kv_heads, dim, q_rot, 1);
    int failed = 0;
    int64_t tasks = seqs * kv_heads;
#pragma omp parallel for num_threads(tasks < threads ? (int)tasks : threads) schedule(dynamic)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t s = t / kv_heads, h = t % kv_heads;
        const int32_t* table = block_tables + s * table_width;
        int bad;
        if (dim == 64)
            bad = attend(q_rot, table, context_lens[s], k_cache, v_cache, block_size, s, h, heads, kv_heads, 64, scale, out);
        else if (dim == 128)
            bad = attend(q_rot, table, context_lens[s], k_cache, v_cache, block_size, s, h, heads, kv_heads, 128, scale, out);
        else
            bad = attend(q_rot, table, context_lens[s], k_cache, v_cache, block_size, s, h, heads, kv_heads, dim, scale, out);
        if (bad) failed = 1;
    }
    free(q_rot);
    return failed;
}

// The int8 x int8 prefill matmul's activations (nanoqwen/quant/linear.py): per row of x (bf16)
// scale = max(max|x|, 1e-30) / 127 and codes round(x / scale), ties to even, as torch's ops
// compute them.
void quantize_rows_int8(const uint16_t* x, int8_t* xq, float* scale, int64_t rows, int64_t k,
                        int threads) {
#pragma omp parallel for num_threads(rows >= 4 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * k;
        float top = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            float a = fabsf(bf16_to_float(xr[i]));
            top = a > top ? a : top;
        }
        float s = (top > 1e-30f ? top : 1e-30f) / 127.0f;
        scale[r] = s;
        int8_t* q = xq + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; i++) q[i] = (int8_t)nearbyintf(bf16_to_float(xr[i]) / s);
    }
}

// out [rows, n] = bf16(y * x_scale[row] * w_scale[col]) for the int32 sums y, then + bias
// (bf16, or NULL) rounded again, as torch's float32 ops, .to(bfloat16) and the bias add do.
void dequantize_rows_bf16(const int32_t* y, const float* x_scale, const float* w_scale,
                          const uint16_t* bias, uint16_t* out, int64_t rows, int64_t n,
                          int threads) {
#pragma omp parallel for num_threads(rows >= 4 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int32_t* yr = y + r * n;
        uint16_t* o = out + r * n;
        float xs = x_scale[r];
        if (bias) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++)
                o[i] = float_to_bf16(round_bf16((float)yr[i] * xs * w_scale[i]) + bf16_to_float(bias[i]));
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) o[i] = float_to_bf16((float)yr[i] * xs * w_scale[i]);
        }
    }
}
