// Few-row matmuls over GGUF Q5_0, Q4_0, Q5_1, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights
// (AVX512-VNNI, or AVX2: simd16.h), built at first use by nanoqwen/kernels/cpu/gguf.py and
// called through ctypes; gguf_kquants.c has Q3_K's and Q2_K's, gguf_requantize.h and
// gguf_kquants.c the per-channel int8 copies for prefill.
//
// A weight row is K/32 blocks of 32 codes c and a float16 scale d[n][b]:
//   Q5_0 (q5_gemv): five-bit codes, w = d * (c - 16);  Q4_0 (q4_gemv): four-bit, w = d * (c - 8);
//   Q5_1 (q51_gemv), Q4_1 (q41_gemv): those codes with w = d * c + m, a float16 min m[n][b];
//   Q8_0 (q8_gemv): c = the file's int8 code + 128, w = d * (c - 128);
//   Q4_K, Q5_K (q4k_lanes_gemv, q5k_lanes_gemv): Q4_1's and Q5_1's codes with a six-bit scale
//     and min a block, w = d * sc * c - dmin * m, d and dmin a superblock of 8 blocks.
// Q6_K (q6k_lanes_gemv) has groups of 16 values instead: w = d * sc * (c - 32), six-bit c.
// The activations are quantized per block of 32 to int8 (scale dx = max|x| / 127), as llama.cpp
// does for its Q5_0/Q8_0 x Q8_0 dot products, so a block's dot product is an exact integer,
// sum(c * x_q) - zero * sum(x_q) (zero: the codes' offset), and y = sum over blocks of
// d * dx * that integer (+ m * dx * sum(x_q) for a min).
//
// The layout ("lanes", gguf_lanes.py packs it at load): one block (Q6_K: group) per 32-bit
// lane of a vector. A row's blocks go in groups of 16 (the last one of nb % 16 if that is not
// 0); in a group of w blocks, vector v holds, in lane j, bytes 4v..4v+3 of block j's codes:
// Q8_0's 32 bytes c give 8 vectors, the nibble formats' 16 (Q4_0's qs: byte i = c[i] | c[i +
// 16] << 4) 4, whose low nibbles are codes 4v..4v+3 and high ones codes 16 + 4v... Vector v
// starts at byte 4w * v of its group. hm[n][g][8] (Q5_0, Q5_1, Q5_K): the fifth bits as 64-bit
// byte masks, bit 4j + i of mask s set for block j's code 4s + i; in an AVX2 build the same
// bits as bit planes, 64 bytes a group, bit s of byte 4j + i. The activations are
// reordered to match once per call, so eight vpdpbusd sum each block's 32 products in its own
// lane with no shuffle, and a row's float work is one convert and two multiplies a 16 blocks
// (against three shuffles, converts and multiplies a 4 blocks for one block per 128 bits):
// what a speculative verify step's 16 rows cost, where this CPU is bound by arithmetic, not
// reads. Every row is computed alike whatever M is, so a verify row equals a decode step's.

#include "gguf_common.h"
#include "gguf_lanes.h"
#include "gguf_requantize.h"

#define LANE_MAX_ROWS 16
#ifdef SIMD16_AVX512
#define PREFETCH_ONE_ROW 0
#else
#define PREFETCH_ONE_ROW 1
#endif

// A weight's arrays (those of its format; the others NULL).
typedef struct {
    const uint8_t* qs;    // codes in lanes
    const uint64_t* hm;   // fifth bits: Q5_0, Q5_1, Q5_K
    const uint16_t* d;    // float16 scale a block, or (Q4_K, Q5_K) a superblock of 8
    const uint16_t* mn;   // float16 min a block (Q5_1, Q4_1), or dmin a superblock (K)
    const uint8_t *sc, *m;  // Q4_K, Q5_K: six-bit scale and min a block; Q6_K: int8 scale
} Weight;

// A code vector of a group of w blocks: masked only in a short last group (a masked load
// streamed the lm_head from memory 10-20% slower).
static inline vi group_load(const uint8_t* p, int64_t w) {
    return w == 16 ? vi_load(p) : vi_load_n32(p, (int)w);
}

// Adds group g of output row n (its lanes 16g..16g+15: blocks of 32, or Q6_K's groups of 16
// values) to the 16 partial sums of the M activation rows, sums[16m]. M, bits (5, 4, 8, or 6
// for Q6_K), mins and kq (the scales are Q4_K's: d * sc[b], dmin * m[b]) are compile-time
// constants at each call site, so the group's code vectors stay in registers while every
// row meets them. nb: lanes a row.
static inline __attribute__((always_inline)) void lane_group(
    const int M, const int bits, const int mins, const int kq, int64_t n, int64_t g, int64_t N,
    int64_t nb, const Weight* wt, const Lanes* a, vf* sums, int64_t ahead) {
    const int q6 = bits == 6, V = q6 ? 4 : 8;  // code vectors a group
    const int64_t G = (nb + 15) / 16, block_bytes = bits == 8 ? 32 : q6 ? 12 : 16;
    const int64_t row_bytes = nb * block_bytes, nd = kq ? nb / 8 : q6 ? G : nb;  // scales a row
    const int64_t w = nb - 16 * g < 16 ? nb - 16 * g : 16, at_d = kq ? 2 * g : q6 ? g : 16 * g;
    const uint8_t* q = wt->qs + n * row_bytes + 16 * g * block_bytes;
    const uint64_t* hm = bits == 5 ? wt->hm + (n * G + g) * 8 : NULL;
    const uint16_t *d = wt->d + n * nd + at_d, *mn = mins ? wt->mn + n * nd + at_d : NULL;
    const uint8_t *sc = kq || q6 ? wt->sc + n * nb + 16 * g : NULL;
    const uint8_t *mb = kq ? wt->m + n * nb + 16 * g : NULL;
    // The same group of the row `ahead` on (this thread's, under the static schedule) into
    // the cache while this one computes: without it a core stalls on a row's loads, then
    // computes.
    if (n + ahead < N) {
        const char* next[6] = {(const char*)(q + ahead * row_bytes), (const char*)(d + ahead * nd),
                               hm ? (const char*)(hm + ahead * G * 8) : NULL,
                               mins ? (const char*)(mn + ahead * nd) : NULL,
                               sc ? (const char*)(sc + ahead * nb) : NULL,
                               kq ? (const char*)(mb + ahead * nb) : NULL};
        for (int64_t at = 0; at < w * block_bytes; at += 64)
            _mm_prefetch(next[0] + at, _MM_HINT_T0);
        for (int p = 1; p < 6; p++)
            if (next[p]) _mm_prefetch(next[p], _MM_HINT_T0);
    }
    const vi low4 = vi_set1_i8(0x0F);
    vi c[8];  // c[s]: codes 4s..4s+3 of each block, lanes past w zero
    if (q6) {
        // Q6_K (K a multiple of 256, so w = 16): two vectors of low nibbles (codes 0-3 and 8-11,
        // 4-7 and 12-15 of each lane) and one of the 2-bit highs (bits 2v, 2v + 1: vector v's).
        // A 16-bit shift carries bits across bytes only where the masks drop them.
        const vi n0 = vi_load(q), n1 = vi_load(q + 64), h = vi_load(q + 128);
        const vi top = vi_set1_i8(0x30);
        const vi hv[4] = {vi_slli_i16(h, 4), vi_slli_i16(h, 2), h, vi_srli_i16(h, 2)};
        const vi lo[4] = {n0, n1, vi_srli_i16(n0, 4), vi_srli_i16(n1, 4)};
        for (int v = 0; v < 4; v++) c[v] = vi_or(vi_and(lo[v], low4), vi_and(hv[v], top));
    } else if (bits == 8) {
        for (int s = 0; s < 8; s++) c[s] = group_load(q + 4 * w * s, w);
    } else {
        for (int t = 0; t < 4; t++) {
            const vi p = group_load(q + 4 * w * t, w);
            c[t] = vi_and(p, low4);
            c[t + 4] = vi_and(vi_srli_i16(p, 4), low4);
        }
        if (bits == 5) {
#if SIMD16_FIFTH_BIT_PLANES
            const vi planes = vi_load(hm);
            for (int s = 0; s < 8; s++) c[s] = vi_or_plane_bit(c[s], planes, s);
#else
            const vi sixteen = vi_set1_i8(16);
            for (int s = 0; s < 8; s++) c[s] = vi_mask_add_i8(c[s], hm[s], sixteen);
#endif
        }
    }
    vf dw, mw = vf_zero();  // per block: the codes' scale, the min's
    if (q6) {
        const vi s32 = vi_from_i8(_mm_loadu_si128((const __m128i*)sc));
        dw = vf_mul(vf_set1(_cvtsh_ss(*d)), vf_from_i32(s32));
    } else if (kq) {  // lanes 0-7 are superblock 2g's blocks, 8-15 superblock 2g + 1's
        const vf dd = vf_halves(_cvtsh_ss(d[0]), w > 8 ? _cvtsh_ss(d[1]) : 0.0f);
        const vf dm = vf_halves(_cvtsh_ss(mn[0]), w > 8 ? _cvtsh_ss(mn[1]) : 0.0f);
        const vi scb = vi_from_u8(load_u8_n(sc, (int)w)), mb32 = vi_from_u8(load_u8_n(mb, (int)w));
        dw = vf_mul(dd, vf_from_i32(scb));
        mw = vf_sub(mw, vf_mul(dm, vf_from_i32(mb32)));
    } else {
        dw = vf_from_f16(load_u16_n(d, (int)w));
        if (mins) mw = vf_from_f16(load_u16_n(mn, (int)w));
    }
    for (int m = 0; m < M; m++) {
        const int8_t* x = a->xq + (m * G + g) * 64 * V;
        const int64_t at = (m * G + g) * 16;
        vi dot;
        if (bits == 8) {
            dot = vi_dot128(a->init + at, c, V, x);
        } else {
            dot = vi_dot_codes(a->init + at, c, V, x, bits);
        }
        const vf scale = vf_mul(dw, vf_load(a->dx + at));
        vf acc = vf_fmadd(vf_from_i32(dot), scale, sums[16 * m]);
        if (mins) acc = vf_fmadd(mw, vf_load(a->sx + at), acc);
        sums[16 * m] = acc;
    }
}

// Outputs n0..n0+15 of the M rows: each one's lane sums, then the 16 outputs summed at once.
// Row by row, each read whole, as a stream from memory wants it; but where the M rows'
// activations outgrow L1 (78 KB at 16 rows of K = 4864, which every output row read again
// from L2) a group of 16 blocks at a time for all 16 outputs (8 KB of activations). Each
// output's sums add the groups in the same order either way, so the results are the same.
static inline __attribute__((always_inline)) void lane_rows16(
    const int M, const int bits, const int mins, const int kq, int64_t n0, int64_t N,
    int64_t nb, const Weight* wt, const Lanes* a, void* y, int out_bf16, const uint16_t* bias) {
    const int64_t count = N - n0 < 16 ? N - n0 : 16, G = (nb + 15) / 16;
    const int64_t row_bytes = nb * (bits == 8 ? 32 : bits == 6 ? 12 : 16);
    vf sums[M * 16];
    for (int i = 0; i < M * 16; i++) sums[i] = vf_zero();
    if (M * G * (bits == 6 ? 256 : 512) > 16384) {
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < count; j++)
                lane_group(M, bits, mins, kq, n0 + j, g, N, nb, wt, a, sums + j, 16);
    } else {
        // More rows compute long enough for our prefetch to pay; one row (decode) streamed
        // faster on the hardware's alone on the AVX-512 machine (the lm_head 3.9 ms, 4.1 with
        // ours), where the AVX2 one (an AMD EPYC) streams it at 2.2x with ours.
        const int64_t ahead = M == 1 && !PREFETCH_ONE_ROW ? N
                              : row_bytes >= PREFETCH_BYTES ? 1
                                                            : PREFETCH_BYTES / row_bytes;
        for (int64_t j = 0; j < count; j++)
            for (int64_t g = 0; g < G; g++)
                lane_group(M, bits, mins, kq, n0 + j, g, N, nb, wt, a, sums + j, ahead);
    }
    for (int m = 0; m < M; m++)
        store16(y, out_bf16, bias, m, n0, N, (int)count, vf_sum16(sums + 16 * m));
}

#define ROWS_CASE(R, BITS, MINS, KQ)                                                    \
    case R:                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")               \
        for (int64_t n0 = 0; n0 < N; n0 += 16)                                          \
            lane_rows16(R, BITS, MINS, KQ, n0, N, nb, wt, &a, y, out_bf16, bias);       \
        break;
#define ALL_ROWS(B, I, Q)                                                               \
    switch (M) {                                                                        \
        ROWS_CASE(1, B, I, Q) ROWS_CASE(2, B, I, Q) ROWS_CASE(3, B, I, Q)               \
        ROWS_CASE(4, B, I, Q) ROWS_CASE(5, B, I, Q) ROWS_CASE(6, B, I, Q)               \
        ROWS_CASE(7, B, I, Q) ROWS_CASE(8, B, I, Q) ROWS_CASE(9, B, I, Q)               \
        ROWS_CASE(10, B, I, Q) ROWS_CASE(11, B, I, Q) ROWS_CASE(12, B, I, Q)            \
        ROWS_CASE(13, B, I, Q) ROWS_CASE(14, B, I, Q) ROWS_CASE(15, B, I, Q)            \
        ROWS_CASE(16, B, I, Q)                                                          \
    }

// y[m][n] = sum_k x[m][k] * w[n][k] for m < M <= LANE_MAX_ROWS; x is bfloat16 when is_bf16,
// else float32; y is float32 [M][N], or bfloat16 plus bias (NULL: none) when out_bf16. Returns
// 0, or nonzero for arguments it does not take.
static int gemv(int bits, int kq, const void* x, int is_bf16, int64_t M, int64_t K,
                const Weight* wt, int64_t N, void* y, int out_bf16, const uint16_t* bias,
                int threads) {
    if (M < 1 || M > LANE_MAX_ROWS || K % (kq || bits == 6 ? 256 : 32)) return 1;
    const int lv = bits == 6 ? 16 : 32;  // values a lane
    const int64_t nb = K / lv;
    const int zero = wt->mn ? 0 : bits == 5 ? 16 : bits == 4 ? 8 : bits == 6 ? 32 : 128;
    Lanes a;
    if (lane_activations(x, is_bf16, M, K, lv, zero, &a)) return 2;
    if (bits == 6) ALL_ROWS(6, 0, 0)
    else if (kq && bits == 5) ALL_ROWS(5, 1, 1)
    else if (kq) ALL_ROWS(4, 1, 1)
    else if (bits == 5 && wt->mn) ALL_ROWS(5, 1, 0)
    else if (bits == 5) ALL_ROWS(5, 0, 0)
    else if (bits == 4 && wt->mn) ALL_ROWS(4, 1, 0)
    else if (bits == 4) ALL_ROWS(4, 0, 0)
    else ALL_ROWS(8, 0, 0)
    free_lanes(&a);
    return 0;
}

// Whether the five-bit formats' fifth bits are bit planes (1) or masks (0): gguf_lanes.py
// packs them as the build reads them.
int gguf_fifth_bit_planes(void) { return SIMD16_FIFTH_BIT_PLANES; }

#define GEMV(BITS, KQ, ...)                                                             \
    const Weight wt = {__VA_ARGS__};                                                    \
    return gemv(BITS, KQ, x, is_bf16, M, K, &wt, N, y, out_bf16, bias, threads)

int q5_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint64_t* hm, const uint16_t* d, int64_t N, void* y, int out_bf16,
            const uint16_t* bias, int threads) {
    GEMV(5, 0, .qs = qs, .hm = hm, .d = d);
}

int q51_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint64_t* hm, const uint16_t* d, const uint16_t* m, int64_t N, void* y,
             int out_bf16, const uint16_t* bias, int threads) {
    GEMV(5, 0, .qs = qs, .hm = hm, .d = d, .mn = m);
}

int q41_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
             const uint16_t* d, const uint16_t* m, int64_t N, void* y, int out_bf16,
             const uint16_t* bias, int threads) {
    GEMV(4, 0, .qs = qs, .d = d, .mn = m);
}

int q4_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint16_t* d, int64_t N, void* y, int out_bf16, const uint16_t* bias,
            int threads) {
    GEMV(4, 0, .qs = qs, .d = d);
}

int q8_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
            const uint16_t* d, int64_t N, void* y, int out_bf16, const uint16_t* bias,
            int threads) {
    GEMV(8, 0, .qs = qs, .d = d);
}

// Q4_K and Q5_K (K a multiple of 256) as Q4_1 and Q5_1 with a block's scale d * sc and min
// -dmin * m: their blocks of 32 repacked at load to Q4_0's nibble order (gguf_lanes.py).
int q4k_lanes_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
                   const uint8_t* sc, const uint8_t* m, const uint16_t* d, const uint16_t* dmin,
                   int64_t N, void* y, int out_bf16, const uint16_t* bias, int threads) {
    GEMV(4, 1, .qs = qs, .d = d, .mn = dmin, .sc = sc, .m = m);
}

int q5k_lanes_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
                   const uint64_t* hm, const uint8_t* sc, const uint8_t* m, const uint16_t* d,
                   const uint16_t* dmin, int64_t N, void* y, int out_bf16, const uint16_t* bias,
                   int threads) {
    GEMV(5, 1, .qs = qs, .hm = hm, .d = d, .mn = dmin, .sc = sc, .m = m);
}

// Q6_K (K a multiple of 256): a lane is one of its groups of 16 values (one int8 scale), a
// group of 16 lanes one superblock; per superblock (gguf_lanes.py packs it) two vectors of low
// nibbles and one of the high bits, 192 bytes as the file's ql and qh, then the file's 16
// scales sc[n][s][16] and d[n][s]. w = d * sc * (c - 32).
int q6k_lanes_gemv(const void* x, int is_bf16, int64_t M, int64_t K, const uint8_t* qs,
                   const int8_t* sc, const uint16_t* d, int64_t N, void* y, int out_bf16,
                   const uint16_t* bias, int threads) {
    GEMV(6, 0, .qs = qs, .d = d, .sc = (const uint8_t*)sc);
}
