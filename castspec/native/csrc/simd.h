/* The instruction set every csrc/ file is written in (AVX-512 F/BW/VL/BF16 intrinsics), and the one float ->
 * bfloat16 conversion they all use.
 *
 * Built normally (castspec/native/build.py), the intrinsics are the compiler's and need an AVX-512 BF16 CPU.
 * Built with -DCASTSPEC_EMULATE (CASTSPEC_NATIVE=emulate: for tests on machines without AVX-512), the same
 * names come from SIMD Everywhere's portable implementations (simde, header-only), and the few that simde
 * 0.7.4 lacks are defined below from Intel's documented semantics, lane by lane. The emulated library
 * computes what the real one does, slowly; it exists so that tests exercise the C code everywhere.
 */
#ifndef CASTSPEC_SIMD_H
#define CASTSPEC_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(CASTSPEC_AVX2)
#include "avx2.h"
#elif !defined(CASTSPEC_EMULATE)
#include <immintrin.h>
#define CASTSPEC_AVX512 /* the CPU's own AVX-512 instructions (and AMX tiles where it has them) */
#else
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

typedef simde__mmask16 __mmask16; /* simde's aliases leave out the mask types */
typedef simde__mmask32 __mmask32;

/* Masked loads read only the lanes their mask selects (as the instructions, which suppress faults on the
 * others: a row's last partial vector may end at the end of its allocation) and zero the rest; masked stores
 * write only those lanes. Both copy the selected lanes of `n`, each `size` bytes, through a plain array. */
static inline void cs_copy_lanes(void *dst, const void *src, uint32_t k, int n, size_t size) {
    for (int i = 0; i < n; ++i)
        if (k >> i & 1) memcpy((char *)dst + i * size, (const char *)src + i * size, size);
}

static inline __m512 cs_maskz_loadu_ps(__mmask16 k, const void *p) {
    float lane[16] = {0};
    cs_copy_lanes(lane, p, k, 16, sizeof(float));
    return simde_mm512_loadu_ps(lane);
}

static inline void cs_mask_storeu_ps(void *p, __mmask16 k, __m512 v) {
    float lane[16];
    simde_mm512_storeu_ps(lane, v);
    cs_copy_lanes(p, lane, k, 16, sizeof(float));
}

static inline __m256i cs_256_maskz_loadu_epi16(__mmask16 k, const void *p) {
    uint16_t lane[16] = {0};
    cs_copy_lanes(lane, p, k, 16, sizeof(uint16_t));
    return simde_mm256_loadu_si256(lane);
}

static inline void cs_256_mask_storeu_epi16(void *p, __mmask16 k, __m256i v) {
    uint16_t lane[16];
    simde_mm256_storeu_si256(lane, v);
    cs_copy_lanes(p, lane, k, 16, sizeof(uint16_t));
}

static inline __m512i cs_512_maskz_loadu_epi16(__mmask32 k, const void *p) {
    uint16_t lane[32] = {0};
    cs_copy_lanes(lane, p, k, 32, sizeof(uint16_t));
    return simde_mm512_loadu_si512(lane);
}

static inline __m128i cs_maskz_loadu_epi8(__mmask16 k, const void *p) {
    uint8_t lane[16] = {0};
    cs_copy_lanes(lane, p, k, 16, sizeof(uint8_t));
    return simde_mm_loadu_si128(lane);
}

/* VPTESTMB: bit i set where a and b share a set bit in byte i. */
static inline __mmask16 cs_test_epi8_mask(__m128i a, __m128i b) {
    uint8_t x[16], y[16];
    simde_mm_storeu_si128(x, a);
    simde_mm_storeu_si128(y, b);
    __mmask16 k = 0;
    for (int i = 0; i < 16; ++i)
        if (x[i] & y[i]) k |= (__mmask16)(1u << i);
    return k;
}

/* VPMOVZXWD: sixteen unsigned 16-bit lanes zero-extended to 32 bits. */
static inline __m512i cs_cvtepu16_epi32(__m256i a) {
    uint16_t in[16];
    uint32_t out[16];
    simde_mm256_storeu_si256(in, a);
    for (int i = 0; i < 16; ++i) out[i] = in[i];
    return simde_mm512_loadu_si512(out);
}

/* VCVTNEPS2BF16 as the SDM defines it: zeros and denormals become a zero of the same sign (no MXCSR:
 * denormals are always flushed), infinities are truncated, NaNs truncated and made quiet (bit 6 of the
 * result), everything else rounded to nearest even by adding 0x7fff plus the lowest kept bit. */
static inline __m256bh cs_cvtneps_pbh(__m512 a) {
    float in[16];
    uint16_t out[16];
    simde_mm512_storeu_ps(in, a);
    for (int i = 0; i < 16; ++i) {
        uint32_t u;
        memcpy(&u, &in[i], sizeof(u));
        const uint32_t exponent = u & 0x7f800000u, mantissa = u & 0x007fffffu;
        if (exponent == 0) out[i] = (uint16_t)((u >> 16) & 0x8000u);
        else if (exponent == 0x7f800000u) out[i] = (uint16_t)((u >> 16) | (mantissa ? 0x40u : 0u));
        else out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    __m256bh r;
    memcpy(&r, out, sizeof(r));
    return r;
}

/* The horizontal reductions in the order GCC's immintrin.h performs them (halves, then quarters, ...), so that
 * emulated sums round as the real ones. */
static inline float cs_reduce_add_ps(__m512 a) {
    float t[16];
    simde_mm512_storeu_ps(t, a);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) t[i] = t[i + w] + t[i];
    return t[0];
}

static inline float cs_max(float a, float b) { return a > b ? a : b; } /* MAXPS: b when either is NaN */

static inline float cs_reduce_max_ps(__m512 a) {
    float t[16];
    simde_mm512_storeu_ps(t, a);
    for (int w = 8; w >= 4; w /= 2) /* the upper half is the first operand, then the lower lanes */
        for (int i = 0; i < w; ++i) t[i] = cs_max(t[i + w], t[i]);
    for (int w = 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) t[i] = cs_max(t[i], t[i + w]);
    return t[0];
}

/* simde implements these but gives them no native alias */
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
#ifndef _MM_FROUND_NO_EXC /* with SSE4.1 enabled, the compiler's header defines it (and simde uses that) */
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

#define _mm512_maskz_loadu_ps cs_maskz_loadu_ps
#define _mm512_mask_storeu_ps cs_mask_storeu_ps
#define _mm256_maskz_loadu_epi16 cs_256_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 cs_256_mask_storeu_epi16
#define _mm512_maskz_loadu_epi16 cs_512_maskz_loadu_epi16
#define _mm_maskz_loadu_epi8 cs_maskz_loadu_epi8
#define _mm_test_epi8_mask cs_test_epi8_mask
#define _mm512_cvtepu16_epi32 cs_cvtepu16_epi32
#define _mm512_cvtneps_pbh cs_cvtneps_pbh
#define _mm512_reduce_add_ps cs_reduce_add_ps
#define _mm512_reduce_max_ps cs_reduce_max_ps
#endif

/* A 512-bit integer vector seen as 32 bf16 lanes: a vector cast, except in the AVX2 build, whose vectors are
 * structs of two halves with one type for both. */
#ifdef CASTSPEC_AVX2
#define AS_BH(x) (x)
#else
#define AS_BH(x) ((__m512bh)(x))
#endif

/* The kernels unroll their loops over rows so that the accumulators stay in registers. Emulated vectors live
 * in memory anyway, and unrolling them only makes the build many times slower; it never changes the order of
 * operations, so the results are the same either way. */
#define CS_PRAGMA(x) _Pragma(#x)
#ifdef CASTSPEC_EMULATE
#define UNROLL_LOOP(n)
#else
#define UNROLL_LOOP(n) CS_PRAGMA(GCC unroll n)
#endif

/* The mask of the lanes [i, min(i + 16, n)) of a vector starting at element i of n. */
static inline __mmask16 lanes(int64_t n, int64_t i) {
    return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
}

/* bfloat16 <-> fp32 on sixteen lanes. f32 -> bf16 is VCVTNEPS2BF16: round to nearest even, as torch, except
 * that it flushes denormals (below ~1e-38) to zero. The only float -> bf16 conversion in csrc/. */
static inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

static inline __m256i narrow(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

#endif
