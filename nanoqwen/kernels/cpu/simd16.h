// Vectors of 16 lanes of 32 bits for the GGUF kernels: AVX-512's registers where the CPU has
// AVX512 F/BW/VL/VNNI, else two AVX2 halves. Each operation has the AVX-512 intrinsic's
// result lane for lane (the sums in the same order), so both builds give the same outputs bit
// for bit; tests/quant/test_gguf_kernels_avx2.py builds both where the CPU can and compares
// them.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define SIMD16_AVX512 1
#elif !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the GGUF kernels need AVX2, FMA and F16C (or AVX512 F/BW/VL/VNNI)"
#endif

#ifdef SIMD16_AVX512

typedef __m512 vf;   // 16 float32
typedef __m512i vi;  // 16 int32, 32 int16 or 64 int8

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_round(vf a) {  // to nearest, ties to even
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline float reduce_add8(__m256 lo, __m256 hi);
// Written out (not _mm512_reduce_add_ps) so that the order is the AVX2 build's whatever the
// compiler.
static inline float vf_reduce_add(vf a) {
    return reduce_add8(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vf_from_i32(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_from_f16(__m256i h) { return _mm512_cvtph_ps(h); }
// Lanes 0-7 a, 8-15 b.
static inline vf vf_halves(float a, float b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)),
                                               _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}
// Lane i: a's lane 4c + i / 4.
static inline vf vf_spread4(vf a, int c) {
    return _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_add_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(16 * c)), 2), a);
}
// Lanes 0..count-1 stored.
static inline void vf_store_n(float* p, vf a, int count) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), a);
}

static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1_i8(char a) { return _mm512_set1_epi8(a); }
static inline vi vi_set1_i32(int a) { return _mm512_set1_epi32(a); }
static inline vi vi_load(const void* p) { return _mm512_loadu_si512(p); }
// Lanes 0..count-1 of 32 bits loaded, the rest 0 (nothing past them read).
static inline vi vi_load_n32(const void* p, int count) {
    return _mm512_maskz_loadu_epi32((__mmask16)((1u << count) - 1), p);
}
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
#define vi_srli_i16(a, n) _mm512_srli_epi16(a, n)
#define vi_slli_i16(a, n) _mm512_slli_epi16(a, n)
#define vi_srli_i32(a, n) _mm512_srli_epi32(a, n)
// The 16-bit lanes of [q, q] shifted right by a (low 256 bits) and b (high).
static inline vi vi_dup_srli_i16(__m256i q, int a, int b) {
    const vi qq = _mm512_inserti64x4(_mm512_castsi256_si512(q), q, 1);
    return _mm512_srlv_epi16(qq, _mm512_inserti64x4(_mm512_castsi256_si512(
        _mm256_set1_epi16((short)a)), _mm256_set1_epi16((short)b), 1));
}
// The fifth bits of gguf_gemv.c's five-bit formats come as 64-bit masks a code vector
// (vi_mask_add_i8, one instruction), or on AVX2 as bit planes (vi_or_plane_bit).
#define SIMD16_FIFTH_BIT_PLANES 0
// Byte i of a plus add where bit i of mask is set.
static inline vi vi_mask_add_i8(vi a, uint64_t mask, vi add) {
    return _mm512_mask_add_epi8(a, (__mmask64)mask, a, add);
}
// 32-bit lane i of a plus add where bit i of mask is set.
static inline vi vi_mask_add_i32(vi a, uint16_t mask, vi add) {
    return _mm512_mask_add_epi32(a, (__mmask16)mask, a, add);
}
// acc + the sums of 4 products of unsigned bytes of c (each below 128, which AVX2 needs) by
// signed bytes of x, a 32-bit lane each.
static inline vi vi_dpbusd7(vi acc, vi c, vi x) { return _mm512_dpbusd_epi32(acc, c, x); }
// init + vi_dpbusd7 over the V vectors c[s] of codes below 2^bits (x: 64 bytes each).
static inline vi vi_dot_codes(const int32_t* init, const vi* c, int V, const int8_t* x,
                              int bits) {
    (void)bits;
    vi dot = vi_load(init);
    for (int s = 0; s < V; s++) dot = _mm512_dpbusd_epi32(dot, c[s], vi_load(x + 64 * s));
    return dot;
}
// init + those sums over the V vectors c[s] (x: 64 bytes each) for bytes c up to 255, where
// init holds -128 times each lane's sum of x: the sums of (c - 128) x.
static inline vi vi_dot128(const int32_t* init, const vi* c, int V, const int8_t* x) {
    return vi_dot_codes(init, c, V, x, 8);  // vpdpbusd takes unsigned bytes of any size
}
static inline vi vi_from_i8(__m128i a) { return _mm512_cvtepi8_epi32(a); }
static inline vi vi_from_u8(__m128i a) { return _mm512_cvtepu8_epi32(a); }
static inline vi vi_from_u16(__m256i a) { return _mm512_cvtepu16_epi32(a); }
static inline vf vf_from_bf16(__m256i a) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
}
// Rounded to int32 by the current mode, then saturated to int8.
static inline __m128i vi_to_i8(vf a) { return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(a)); }

// Lane i: the sum of v[i]'s 16 lanes (a tree of adds that halves 16 vectors to 8, 4, 2 and 1,
// 45 instructions for the 16 sums where one at a time takes 8 each).
static inline vf vf_sum16(const vf* v) {
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
static inline __m256i vf_to_bf16(vf v) {
    const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

#else  // AVX2: lanes 0-7 in lo, 8-15 in hi

typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vi;

#define VF2(expr_lo, expr_hi) ((vf){expr_lo, expr_hi})
#define VI2(expr_lo, expr_hi) ((vi){expr_lo, expr_hi})
// op on each half of a and b.
#define VF2_OF(op, a, b) VF2(op((a).lo, (b).lo), op((a).hi, (b).hi))
#define VI2_OF(op, a, b) VI2(op((a).lo, (b).lo), op((a).hi, (b).hi))

static inline vf vf_zero(void) { return VF2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float a) { return VF2(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vf vf_load(const float* p) { return VF2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float* p, vf a) {
    _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi);
}
static inline vf vf_add(vf a, vf b) { return VF2_OF(_mm256_add_ps, a, b); }
static inline vf vf_sub(vf a, vf b) { return VF2_OF(_mm256_sub_ps, a, b); }
static inline vf vf_mul(vf a, vf b) { return VF2_OF(_mm256_mul_ps, a, b); }
static inline vf vf_div(vf a, vf b) { return VF2_OF(_mm256_div_ps, a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return VF2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
// max and min as AVX-512's: the second operand where either is NaN.
static inline vf vf_max(vf a, vf b) { return VF2_OF(_mm256_max_ps, a, b); }
static inline vf vf_min(vf a, vf b) { return VF2_OF(_mm256_min_ps, a, b); }
static inline vf vf_abs(vf a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return VF2(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
static inline vf vf_round(vf a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return VF2(_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode));
}
static inline float reduce_add8(__m256 lo, __m256 hi);
static inline float vf_reduce_add(vf a) { return reduce_add8(a.lo, a.hi); }
static inline float vf_reduce_max(vf a) {
    float v[16], m;
    vf_store(v, a);
    m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}
static inline vf vf_from_i32(vi a) {
    return VF2(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi));
}
static inline vf vf_from_f16(__m256i h) {
    return VF2(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
               _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
static inline vf vf_halves(float a, float b) { return VF2(_mm256_set1_ps(a), _mm256_set1_ps(b)); }
static inline vf vf_spread4(vf a, int c) {
    const __m256 h = c < 2 ? a.lo : a.hi;
    const __m128 x = c % 2 ? _mm256_extractf128_ps(h, 1) : _mm256_castps256_ps128(h);
    return VF2(_mm256_set_m128(_mm_shuffle_ps(x, x, 0x55), _mm_shuffle_ps(x, x, 0x00)),
               _mm256_set_m128(_mm_shuffle_ps(x, x, 0xFF), _mm_shuffle_ps(x, x, 0xAA)));
}
// Lane mask of the first n of 8 lanes (n clamped to 0..8).
static inline __m256i first_lanes(int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
static inline void vf_store_n(float* p, vf a, int count) {
    _mm256_maskstore_ps(p, first_lanes(count), a.lo);
    _mm256_maskstore_ps(p + 8, first_lanes(count - 8), a.hi);
}

static inline vi vi_zero(void) { return VI2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline vi vi_set1_i8(char a) { return VI2(_mm256_set1_epi8(a), _mm256_set1_epi8(a)); }
static inline vi vi_set1_i32(int a) { return VI2(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
static inline vi vi_load(const void* p) {
    return VI2(_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1));
}
static inline vi vi_load_n32(const void* p, int count) {
    return VI2(_mm256_maskload_epi32((const int*)p, first_lanes(count)),
               _mm256_maskload_epi32((const int*)p + 8, first_lanes(count - 8)));
}
static inline vi vi_and(vi a, vi b) { return VI2_OF(_mm256_and_si256, a, b); }
static inline vi vi_or(vi a, vi b) { return VI2_OF(_mm256_or_si256, a, b); }
#define vi_srli_i16(a, n) VI2(_mm256_srli_epi16((a).lo, n), _mm256_srli_epi16((a).hi, n))
#define vi_slli_i16(a, n) VI2(_mm256_slli_epi16((a).lo, n), _mm256_slli_epi16((a).hi, n))
#define vi_srli_i32(a, n) VI2(_mm256_srli_epi32((a).lo, n), _mm256_srli_epi32((a).hi, n))
static inline vi vi_dup_srli_i16(__m256i q, int a, int b) {
    return VI2(_mm256_srl_epi16(q, _mm_cvtsi32_si128(a)),
               _mm256_srl_epi16(q, _mm_cvtsi32_si128(b)));
}
#define SIMD16_FIFTH_BIT_PLANES 1
// a | 16 in each byte whose bit s is set in planes (the fifth bits as bit planes: byte b of
// planes holds code vector s's byte b in bit s), for bytes of a below 16. A 16-bit shift
// carries bits across bytes only below bit 4 (left, by at most 4) or above it (right, by at
// most 3). Three instructions a half, where a 64-bit mask takes six (vi_mask_add_i8).
static inline vi vi_or_plane_bit(vi a, vi planes, int s) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    __m256i lo, hi;
    if (s <= 4) {
        lo = _mm256_slli_epi16(planes.lo, 4 - s);
        hi = _mm256_slli_epi16(planes.hi, 4 - s);
    } else {
        lo = _mm256_srli_epi16(planes.lo, s - 4);
        hi = _mm256_srli_epi16(planes.hi, s - 4);
    }
    return VI2(_mm256_or_si256(a.lo, _mm256_and_si256(lo, bit4)),
               _mm256_or_si256(a.hi, _mm256_and_si256(hi, bit4)));
}
static inline vi vi_mask_add_i8(vi a, uint64_t mask, vi add) {
    // One broadcast of the whole mask feeds both halves' spreads.
    const __m256i m = _mm256_set1_epi64x((long long)mask);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i lo = _mm256_shuffle_epi8(
        m, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                            2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i hi = _mm256_shuffle_epi8(
        m, _mm256_setr_epi8(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6,
                            6, 7, 7, 7, 7, 7, 7, 7, 7));
    const __m256i on_lo = _mm256_cmpeq_epi8(_mm256_and_si256(lo, bit), bit);
    const __m256i on_hi = _mm256_cmpeq_epi8(_mm256_and_si256(hi, bit), bit);
    return VI2(_mm256_add_epi8(a.lo, _mm256_and_si256(on_lo, add.lo)),
               _mm256_add_epi8(a.hi, _mm256_and_si256(on_hi, add.hi)));
}
static inline vi vi_mask_add_i32(vi a, uint16_t mask, vi add) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i lo = _mm256_and_si256(_mm256_set1_epi32(mask & 0xFF), bit);
    const __m256i hi = _mm256_and_si256(_mm256_set1_epi32(mask >> 8), bit);
    return VI2(_mm256_add_epi32(a.lo, _mm256_and_si256(_mm256_cmpeq_epi32(lo, bit), add.lo)),
               _mm256_add_epi32(a.hi, _mm256_and_si256(_mm256_cmpeq_epi32(hi, bit), add.hi)));
}
// The byte products in 16 bits never saturate where c < 128 (x is an int8 activation code,
// |x| <= 127): a pair sums to at most 2 * 127 * 127.
static inline __m256i dot4_7(__m256i c, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), _mm256_set1_epi16(1));
}
static inline vi vi_dpbusd7(vi acc, vi c, vi x) {
    return VI2(_mm256_add_epi32(acc.lo, dot4_7(c.lo, x.lo)),
               _mm256_add_epi32(acc.hi, dot4_7(c.hi, x.hi)));
}
// vi_dot_codes: codes below 2^bits leave room in maddubs' 16-bit pair sums (|x| <= 127), so
// up to 32767 / (2 * 127 * (2^bits - 1)) vectors' pair sums add in 16 bits (8 at four bits,
// 4 at five, 2 at six) before one widening to 32: the same integers with fewer instructions.
static inline vi vi_dot_codes(const int32_t* init, const vi* c, int V, const int8_t* x,
                              int bits) {
    const int run = bits <= 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 2 : 1;
    const __m256i ones = _mm256_set1_epi16(1);
    vi dot = vi_load(init);
    for (int s0 = 0; s0 < V; s0 += run) {
        const vi x0 = vi_load(x + 64 * s0);
        __m256i lo = _mm256_maddubs_epi16(c[s0].lo, x0.lo);
        __m256i hi = _mm256_maddubs_epi16(c[s0].hi, x0.hi);
        for (int s = s0 + 1; s < s0 + run && s < V; s++) {
            const vi xs = vi_load(x + 64 * s);
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(c[s].lo, xs.lo));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(c[s].hi, xs.hi));
        }
        dot = VI2(_mm256_add_epi32(dot.lo, _mm256_madd_epi16(lo, ones)),
                  _mm256_add_epi32(dot.hi, _mm256_madd_epi16(hi, ones)));
    }
    return dot;
}
// The signed codes c - 128 by x as llama.cpp's AVX2 dot products take them: |c - 128| (at
// most 128) by x with c - 128's sign, a pair at most 2 * 128 * 127; init's -128 sum(x) is
// what those products leave out, so it is not read.
static inline __m256i dot4_128(__m256i c, __m256i x) {
    const __m256i cs = _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80));
    return dot4_7(_mm256_abs_epi8(cs), _mm256_sign_epi8(x, cs));
}
static inline vi vi_dot128(const int32_t* init, const vi* c, int V, const int8_t* x) {
    (void)init;
    vi dot = vi_zero();
    for (int s = 0; s < V; s++) {
        const vi xs = vi_load(x + 64 * s);
        dot = VI2(_mm256_add_epi32(dot.lo, dot4_128(c[s].lo, xs.lo)),
                  _mm256_add_epi32(dot.hi, dot4_128(c[s].hi, xs.hi)));
    }
    return dot;
}
static inline vi vi_from_i8(__m128i a) {
    return VI2(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
static inline vi vi_from_u8(__m128i a) {
    return VI2(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
static inline vi vi_from_u16(__m256i a) {
    return VI2(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
               _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
static inline vf vf_from_bf16(__m256i a) {
    const vi u = vi_from_u16(a);
    return VF2(_mm256_castsi256_ps(_mm256_slli_epi32(u.lo, 16)),
               _mm256_castsi256_ps(_mm256_slli_epi32(u.hi, 16)));
}
static inline __m128i vi_to_i8(vf a) {
    const __m256i lo = _mm256_cvtps_epi32(a.lo), hi = _mm256_cvtps_epi32(a.hi);
    const __m128i l16 =
        _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    const __m128i h16 =
        _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    return _mm_packs_epi16(l16, h16);
}

// The AVX-512 tree's adds (see that branch), a 256-bit half at a time: its 128-bit shuffles
// (0x88 takes 128-bit lanes 0 and 2 of a and of b, 0xDD lanes 1 and 3) pair the same lanes.
static inline __m256 lanes02(__m256 lo, __m256 hi) { return _mm256_permute2f128_ps(lo, hi, 0x20); }
static inline __m256 lanes13(__m256 lo, __m256 hi) { return _mm256_permute2f128_ps(lo, hi, 0x31); }
static inline vf vf_sum16(const vf* v) {
    vf t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) {
        const vf a = v[2 * i], b = v[2 * i + 1];
        t[i] = VF2(_mm256_add_ps(_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.lo, b.lo)),
                   _mm256_add_ps(_mm256_unpacklo_ps(a.hi, b.hi), _mm256_unpackhi_ps(a.hi, b.hi)));
    }
    for (int i = 0; i < 4; i++) {
        const vf a = t[2 * i], b = t[2 * i + 1];
        u[i] = VF2(_mm256_add_ps(_mm256_shuffle_ps(a.lo, b.lo, 0x44),
                                 _mm256_shuffle_ps(a.lo, b.lo, 0xEE)),
                   _mm256_add_ps(_mm256_shuffle_ps(a.hi, b.hi, 0x44),
                                 _mm256_shuffle_ps(a.hi, b.hi, 0xEE)));
    }
    for (int i = 0; i < 2; i++) {
        const vf a = u[2 * i], b = u[2 * i + 1];
        w[i] = VF2(_mm256_add_ps(lanes02(a.lo, a.hi), lanes13(a.lo, a.hi)),
                   _mm256_add_ps(lanes02(b.lo, b.hi), lanes13(b.lo, b.hi)));
    }
    return VF2(_mm256_add_ps(lanes02(w[0].lo, w[0].hi), lanes13(w[0].lo, w[0].hi)),
               _mm256_add_ps(lanes02(w[1].lo, w[1].hi), lanes13(w[1].lo, w[1].hi)));
}

static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline __m256i vf_to_bf16(vf v) { return _mm256_set_m128i(bf16x8(v.hi), bf16x8(v.lo)); }

#endif

// The sum of 16 lanes (lo: 0-7, hi: 8-15) in GCC's _mm512_reduce_add_ps order: the halves,
// then the 128-bit halves, then pairs.
static inline float reduce_add8(__m256 lo, __m256 hi) {
    const __m256 t = _mm256_add_ps(hi, lo);
    const __m128 q = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

// Count (<= 16) float16 or bfloat16 values of p, zeros past them (nothing past them read).
static inline __m256i load_u16_n(const uint16_t* p, int count) {
    if (count == 16) return _mm256_loadu_si256((const __m256i*)p);
    uint16_t v[16] = {0};
    memcpy(v, p, 2 * (size_t)count);
    return _mm256_loadu_si256((const __m256i*)v);
}
// Count (<= 16) bytes of p, zeros past them.
static inline __m128i load_u8_n(const uint8_t* p, int count) {
    if (count == 16) return _mm_loadu_si128((const __m128i*)p);
    uint8_t v[16] = {0};
    memcpy(v, p, (size_t)count);
    return _mm_loadu_si128((const __m128i*)v);
}
// The first count (<= 16) of 16 uint16 values stored at p.
static inline void store_u16_n(uint16_t* p, __m256i a, int count) {
    if (count == 16) {
        _mm256_storeu_si256((__m256i*)p, a);
        return;
    }
    uint16_t v[16];
    _mm256_storeu_si256((__m256i*)v, a);
    memcpy(p, v, 2 * (size_t)count);
}
