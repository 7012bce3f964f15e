// Few-row matmuls over GGUF Q3_K and Q2_K superblocks (AVX512-VNNI, or AVX2: simd16.h): the
// file's own bytes, the activations int8 per block of 32; and the per-channel int8 copies of
// those and of Q6_K, Q4_K and Q5_K, whose few-row kernel is gguf_gemv.c's (in lanes).

#include "gguf_common.h"

// Q6_K's file arrays (its per-channel copy below reads them):
//   ql[n][s][128]: low 4 bits. In half h (values 128h..128h+127), byte 64h + l holds value
//                  128h + l in its low nibble and value 128h + 64 + l in its high one (l < 64).
//   qh[n][s][64]:  high 2 bits. Byte 32h + l holds values 128h + l, +32, +64, +96 in bits
//                  0-1, 2-3, 4-5, 6-7 (l < 32).
//   sc[n][s][16]:  an int8 scale a 16 values; d[n][s]: float16.
// w = d * sc[j / 16] * (c - 32) for the 6-bit code c.
// Q3_K (q3k_gemv) has that form with 3-bit codes c and offset 4, in the file's arrays:
//   qs[n][s][64]:  low 2 bits. Byte 32h + l holds values 128h + 32t + l at bits 2t, 2t + 1.
//   hm[n][s][32]:  third bits. Bit 4h + t of byte l is value 128h + 32t + l's (code c - 4
//                  with the bit clear, as the file's "subtract 4 where unset", is c = low + 4
//                  * bit minus the offset 4).
//   sc[n][s][16]:  the file's 6-bit scales minus 32, unpacked at load; d[n][s]: float16.
// Q2_K (q2k_gemv): 2-bit codes c (0..3) in Q3_K's qs layout, and per 16 values a scale and a
// min, w = d * sc * c - dmin * m, in the file's arrays:
//   sc[n][s][16]:  scale in the low nibble, min in the high one; d[n][s], dmin[n][s]: float16.
// The activations are int8 blocks of 32 as for Q5_0 (scale dx); Q3_K's offset 4 contributes
// d * sc * dx * 4 * (the 16 codes' sum), Q2_K's min dmin * m * dx * (that sum).

// Rows n of the output for M activation rows: per superblock, the 16 group scales d * sc (exact
// in float32: an 11-bit by 7-bit product), then 4 x 64 codes (values 64c..64c+63 are groups
// 4c..4c+3: lane i of a 64-byte dot product sums values 4i..4i+3, group 4c + i / 4).
// kind: G16_Q3 (lo, hi: qs and hm) or G16_Q2 (qs; hi NULL, dmin set).
enum { G16_Q3, G16_Q2 };
static inline __attribute__((always_inline)) void dot_row_g16(
    const int M, const int kind, int64_t n, int64_t N, int64_t K, const uint8_t* lo,
    const uint8_t* hi, const int8_t* sc, const uint16_t* d, const uint16_t* dmin,
    const int8_t* xq, const float* dxg, const float* off, void* y, int out_bf16,
    const uint16_t* bias) {
    const int64_t ns = K / 256;
    const int q3 = kind == G16_Q3, q2 = kind == G16_Q2;
    const int64_t lo_bytes = 64, hi_bytes = q2 ? 0 : 32;
    lo += n * ns * lo_bytes, sc += n * ns * 16, d += n * ns;
    if (q2) dmin += n * ns;
    else hi += n * ns * hi_bytes;
    // The next rows' bytes PREFETCH_BYTES ahead, as dot_row does.
    const int64_t row_bytes = ns * (lo_bytes + hi_bytes + (q2 ? 20 : 18));
    const int64_t ahead = row_bytes >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / row_bytes;
    if (n + ahead < N) {
        const char* parts[5] = {(const char*)(lo + ahead * ns * lo_bytes),
                                q2 ? NULL : (const char*)(hi + ahead * ns * hi_bytes),
                                (const char*)(sc + ahead * ns * 16), (const char*)(d + ahead * ns),
                                q2 ? (const char*)(dmin + ahead * ns) : NULL};
        const int64_t sizes[5] = {ns * lo_bytes, hi_bytes ? ns * hi_bytes : 0, ns * 16, ns * 2,
                                  q2 ? ns * 2 : 0};
        for (int p = 0; p < 5; p++)
            for (int64_t at = 0; at < sizes[p]; at += 64) _mm_prefetch(parts[p] + at, _MM_HINT_T0);
    }
    const vi three = vi_set1_i8(0x03), four = vi_set1_i8(4);
    vf acc[M], corr16[M];
    for (int m = 0; m < M; m++) acc[m] = corr16[m] = vf_zero();
    for (int64_t s = 0; s < ns; s++) {
        const __m128i scb = _mm_loadu_si128((const __m128i*)(sc + 16 * s));
        vf dsc, corr_scale;  // per 16 values: the codes' scale, the offset term's
        if (q2) {
            const vi both = vi_from_u8(scb);
            const vi low = vi_and(both, vi_set1_i32(15));
            dsc = vf_mul(vf_set1(_cvtsh_ss(d[s])), vf_from_i32(low));
            corr_scale = vf_mul(vf_set1(_cvtsh_ss(dmin[s])), vf_from_i32(vi_srli_i32(both, 4)));
        } else {
            dsc = vf_mul(vf_set1(_cvtsh_ss(d[s])), vf_from_i32(vi_from_i8(scb)));
            corr_scale = dsc;
        }
        vf w[M];
        for (int m = 0; m < M; m++) {
            const int64_t g = m * (K / 16) + 16 * s;
            w[m] = vf_mul(dsc, vf_load(dxg + g));
            corr16[m] = vf_fmadd(corr_scale, vf_load(off + g), corr16[m]);
        }
        const __m256i hm =
            q3 ? _mm256_loadu_si256((const __m256i*)(hi + 32 * s)) : _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            // values 128h + 0..63 and 128h + 64..127, unsigned codes: fields 0 and 1 (2 and 3)
            // of each qs byte in the low and high 256 bits (a 16-bit shift moves no field up
            // to bit 7 across bytes)
            const __m256i q = _mm256_loadu_si256((const __m256i*)(lo + 64 * s + 32 * h));
            vi c0 = vi_and(vi_dup_srli_i16(q, 0, 2), three);
            vi c1 = vi_and(vi_dup_srli_i16(q, 4, 6), three);
            if (q3) {
                uint64_t k[4];  // bit l: byte l of hm has bit 4h + t
                for (int t = 0; t < 4; t++) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + t)));
                    k[t] = (uint32_t)_mm256_movemask_epi8(
                        _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit));
                }
                c0 = vi_mask_add_i8(c0, k[0] | k[1] << 32, four);
                c1 = vi_mask_add_i8(c1, k[2] | k[3] << 32, four);
            }
            for (int m = 0; m < M; m++) {
                const int8_t* x = xq + m * K + 256 * s + 128 * h;
                const vi d0 = vi_dpbusd7(vi_zero(), c0, vi_load(x));
                const vi d1 = vi_dpbusd7(vi_zero(), c1, vi_load(x + 64));
                acc[m] = vf_fmadd(vf_from_i32(d0), vf_spread4(w[m], 2 * h), acc[m]);
                acc[m] = vf_fmadd(vf_from_i32(d1), vf_spread4(w[m], 2 * h + 1), acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        store(y, out_bf16, bias, m, n, N, vf_reduce_add(acc[m]) - vf_reduce_add(corr16[m]));
}

#define G16_ROWS_CASE(R)                                                                    \
    case R:                                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                   \
        for (int64_t n = 0; n < N; n++)                                                     \
            dot_row_g16(R, kind, n, N, K, lo, hi, sc, d, dmin, xq, dxg, off, y, out_bf16, bias); \
        break;

// q5_gemv's contract for Q3_K and Q2_K weights (K a multiple of 256). Inlined into
// each, so each copy has only its own code unpacking.
static inline __attribute__((always_inline)) int g16_gemv(
    const int kind, const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* lo,
    const uint8_t* hi, const int8_t* sc, const uint16_t* d, const uint16_t* dmin, int64_t N,
    void* y, int out_bf16, const uint16_t* bias, int threads) {
    if (M < 1 || M > MAX_ROWS || K % 256) return 1;
    const int64_t nb = K / 32, ng = K / 16;
    // What multiplies the codes' sum in the offset term: Q3_K's code offset, Q2_K's min (its
    // scale and dmin applied in the kernel).
    const float offset = kind == G16_Q3 ? 4.0f : 1.0f;
    Activations a;
    if (quantize_activations(x, is_bf16, M, K, 0.0f, &a)) return 2;
    const int8_t* xq = a.xq;
    // Per 16 values: the block's scale, and the offset term of the codes' offset.
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
            off[m * ng + g] = offset * a.dx[m * nb + g / 2] * (float)sum;
        }
    }
    switch (M) {
        G16_ROWS_CASE(1) G16_ROWS_CASE(2) G16_ROWS_CASE(3) G16_ROWS_CASE(4)
        G16_ROWS_CASE(5) G16_ROWS_CASE(6) G16_ROWS_CASE(7) G16_ROWS_CASE(8)
    }
    free(dxg), free(off), free_activations(&a);
    return 0;
}

int q3k_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint8_t* hm, const int8_t* sc, const uint16_t* d, int64_t N, void* y,
             int out_bf16, const uint16_t* bias, int threads) {
    return g16_gemv(G16_Q3, x, is_bf16, M, K, qs, hm, sc, d, NULL, N, y, out_bf16, bias, threads);
}

int q2k_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint8_t* sc, const uint16_t* d, const uint16_t* dmin, int64_t N, void* y,
             int out_bf16, const uint16_t* bias, int threads) {
    return g16_gemv(G16_Q2, x, is_bf16, M, K, qs, NULL, (const int8_t*)sc, d, dmin, N, y,
                    out_bf16, bias, threads);
}

// Q4_K and Q5_K: gguf_gemv.c's kernel, in lanes (their blocks of 32 are Q4_1's and Q5_1's
// with a scale d * sc and min dmin * m); their per-channel copies below read the file's:
//   qs[n][s][128]: 4-bit codes; byte 32c + l holds value 64c + l in its low nibble and value
//                  64c + 32 + l in its high one (c < 4, l < 32)
//   sc[n][s][8], m[n][s][8]: the six-bit scale and min of each 32 values (the file's 12
//                  bytes unpacked at load); d[n][s], dmin[n][s]: float16
//   hb[n][s][8] (Q5_K): bit l of word j is value 32j + l's fifth bit.
// w = d * sc[j] * c - dmin * m[j] for the code c of value 32j + i.

// The per-channel int8 copies for the int8 x int8 prefill matmul, computed from the
// superblocks: bit for bit what linear.py made of the canonical weights before (gguf_blocks.py's
// decoding, then format.py's arithmetic), in one pass where those took seconds at load.

// Q6_K and Q3_K: the canonical weight is symmetric int8 in groups of 16 (Q6_K: code c - 32,
// scale d * sc; Q3_K: code low - 4 where the third bit is clear, scale d * (sc - 32); exact
// in float32), so requantize_row's result. lo, hi: ql and qh, or qs and hm (q3 set).
static inline __attribute__((always_inline)) void requantize_g16(
    const int q3, const uint8_t* lo, const uint8_t* hi, const int8_t* sc, const uint16_t* d,
    int64_t N, int64_t K, int8_t* out, float* r, int threads) {
    const int64_t ns = K / 256;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        int8_t q[K];
        float s[K / 16];
        for (int64_t b = 0; b < ns; b++) {
            const int64_t i = n * ns + b;
            int8_t* c = q + 256 * b;
            if (q3) {
                for (int h = 0; h < 2; h++)
                    for (int t = 0; t < 4; t++)
                        for (int l = 0; l < 32; l++) {
                            const int low = (lo[64 * i + 32 * h + l] >> (2 * t)) & 3;
                            const int bit = (hi[32 * i + l] >> (4 * h + t)) & 1;
                            c[128 * h + 32 * t + l] = (int8_t)(low - (bit ? 0 : 4));
                        }
            } else {
                const uint8_t *ql = lo + 128 * i, *qh = hi + 64 * i;
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 64; l++) {
                        const int byte = ql[64 * h + l], l2 = l & 31, t = l >> 5;
                        // values 128h + l and 128h + 64 + l: qh byte 32h + (l % 32), 2-bit
                        // field 32-value group (l / 32) and (l / 32) + 2
                        const int b0 = (qh[32 * h + l2] >> (2 * t)) & 3;
                        const int b1 = (qh[32 * h + l2] >> (2 * (t + 2))) & 3;
                        c[128 * h + l] = (int8_t)(((byte & 15) | b0 << 4) - 32);
                        c[128 * h + 64 + l] = (int8_t)(((byte >> 4) | b1 << 4) - 32);
                    }
            }
            const float dd = _cvtsh_ss(d[i]);
            for (int j = 0; j < 16; j++) s[16 * b + j] = dd * (float)sc[16 * i + j];
        }
        requantize_row(q, s, K, 16, out + n * K, r + n);
    }
}

void requantize_q6k_rows(const uint8_t* ql, const uint8_t* qh, const int8_t* sc,
                         const uint16_t* d, int64_t N, int64_t K, int8_t* out, float* r,
                         int threads) {
    requantize_g16(0, ql, qh, sc, d, N, K, out, r, threads);
}

void requantize_q3k_rows(const uint8_t* qs, const uint8_t* hm, const int8_t* sc,
                         const uint16_t* d, int64_t N, int64_t K, int8_t* out, float* r,
                         int threads) {
    requantize_g16(1, qs, hm, sc, d, N, K, out, r, threads);
}

// Q4_K: the canonical weight is asymmetric int4 in groups of 32, w = c * d * sc - dmin * m
// (Q5_K: int8 codes 0..31, the same w). format.quantize_int8(format.dequantize(w)): the
// values in float32 (c * scale is exact, so only the offset's add rounds, FMA or not),
// r = max |w| / 127, codes round(w / r).
static void requantize_k4(const uint8_t* qs, const uint32_t* hb, const uint8_t* sc,
                          const uint8_t* mn, const uint16_t* d, const uint16_t* dmin, int64_t N,
                          int64_t K, int8_t* out, float* r, int threads) {
    const int64_t ns = K / 256;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        float w[K];
        vf amax = vf_zero();
        const vi low4 = vi_set1_i32(15), sixteen = vi_set1_i32(16);
        for (int64_t b = 0; b < ns; b++) {
            const int64_t i = n * ns + b;
            const float dd = _cvtsh_ss(d[i]), dm = _cvtsh_ss(dmin[i]);
            for (int g = 0; g < 8; g++) {
                // group g: chunk g / 2 of 32 bytes, low nibbles for even g, high for odd
                const uint8_t* p = qs + 128 * i + 32 * (g >> 1);
                const uint32_t high = hb ? hb[8 * i + g] : 0;
                const vf scale = vf_set1(dd * (float)sc[8 * i + g]);
                const vf offset = vf_set1(-(dm * (float)mn[8 * i + g]));
                for (int j = 0; j < 32; j += 16) {
                    vi c = vi_from_u8(_mm_loadu_si128((const __m128i*)(p + j)));
                    c = vi_and(g & 1 ? vi_srli_i32(c, 4) : c, low4);
                    c = vi_mask_add_i32(c, (uint16_t)(high >> j), sixteen);
                    // c * scale is exact (a 5-bit code times an 11-bit by 6-bit product), so
                    // the fused add rounds once, as the separate add does
                    const vf v = vf_fmadd(vf_from_i32(c), scale, offset);
                    vf_store(w + 256 * b + 32 * g + j, v);
                    amax = vf_max(amax, vf_abs(v));
                }
            }
        }
        per_channel_row(w, K, vf_reduce_max(amax), out + n * K, r + n);
    }
}

// Q2_K: the canonical weight is asymmetric int8 in groups of 16, w = c * d * sc - dmin * m
// (codes 0..3, 4-bit sc and m), requantized as Q4_K's.
void requantize_q2k_rows(const uint8_t* qs, const uint8_t* sc, const uint16_t* d,
                         const uint16_t* dmin, int64_t N, int64_t K, int8_t* out, float* r,
                         int threads) {
    const int64_t ns = K / 256;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        float w[K];
        float amax = 0.0f;
        for (int64_t b = 0; b < ns; b++) {
            const int64_t i = n * ns + b;
            const float dd = _cvtsh_ss(d[i]), dm = _cvtsh_ss(dmin[i]);
            for (int v = 0; v < 256; v++) {
                const int h = v >> 7, t = (v >> 5) & 3, l = v & 31, g = v >> 4;
                const int c = (qs[64 * i + 32 * h + l] >> (2 * t)) & 3;
                const float scale = dd * (float)(sc[16 * i + g] & 15);
                const float offset = -(dm * (float)(sc[16 * i + g] >> 4));
                // c * scale is exact (a 2-bit code times an 11-bit by 4-bit product): one
                // rounding, in the add, as format.dequantize's
                w[256 * b + v] = (float)c * scale + offset;
                amax = fmaxf(amax, fabsf(w[256 * b + v]));
            }
        }
        per_channel_row(w, K, amax, out + n * K, r + n);
    }
}

void requantize_q4k_rows(const uint8_t* qs, const uint8_t* sc, const uint8_t* mn,
                         const uint16_t* d, const uint16_t* dmin, int64_t N, int64_t K,
                         int8_t* out, float* r, int threads) {
    requantize_k4(qs, NULL, sc, mn, d, dmin, N, K, out, r, threads);
}

void requantize_q5k_rows(const uint8_t* qs, const uint32_t* hb, const uint8_t* sc,
                         const uint8_t* mn, const uint16_t* d, const uint16_t* dmin, int64_t N,
                         int64_t K, int8_t* out, float* r, int threads) {
    requantize_k4(qs, hb, sc, mn, d, dmin, N, K, out, r, threads);
}
