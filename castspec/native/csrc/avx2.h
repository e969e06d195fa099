/* The AVX-512 intrinsics csrc/ is written in, for CPUs with AVX2 and FMA but no AVX-512 (CASTSPEC_AVX2, the
 * `avx2` build of castspec/native/build.py): each 512-bit vector is a pair of 256-bit halves, each operation
 * the same operation on both halves (or, for the few that cross halves, the shuffles that give the AVX-512
 * result), each mask a plain bit mask turned into a vector mask where an instruction needs one.
 *
 * Only what csrc/ uses is here, with the AVX-512 semantics csrc/ relies on. A bf16 pair product (VDPBF16PS)
 * is two fused multiply-adds of the widened values, the odd element first as in Intel's pseudo-code for the
 * instruction: a product of two bf16 values is exact in fp32, so each addition rounds once, as there (the
 * instruction also flushes denormal inputs and results to zero, which this build does not).
 *
 * The names are macros over cs_-prefixed functions, as simde's aliases are: the compiler's own _mm512_*
 * functions need AVX-512 and cannot be called here.
 */
#ifndef CASTSPEC_AVX2_H
#define CASTSPEC_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define CS_INLINE static inline __attribute__((always_inline))

typedef struct { __m256 lo, hi; } cs_ps;    /* sixteen fp32 lanes */
typedef struct { __m256d lo, hi; } cs_pd;   /* the same bits seen as eight doubles (unpacks only) */
typedef struct { __m256i lo, hi; } cs_si;   /* 512 bits of integers, bf16 pairs included */
typedef uint16_t cs_mask16;
typedef uint32_t cs_mask32;

#define __m512 cs_ps
#define __m512d cs_pd
#define __m512i cs_si
#define __m512bh cs_si
#define __m256bh __m256i
#define __mmask16 cs_mask16
#define __mmask32 cs_mask32

/* Lanes [0, 8) of an 8-bit mask as a vector mask (all ones where the bit is set). */
CS_INLINE __m256i cs_vmask(unsigned k8) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)k8), bits), bits);
}

/* Elementwise operations on both halves. */
#define CS_PS2(name, op) \
    CS_INLINE cs_ps name(cs_ps a, cs_ps b) { return (cs_ps){op(a.lo, b.lo), op(a.hi, b.hi)}; }
CS_PS2(cs_add_ps, _mm256_add_ps)
CS_PS2(cs_sub_ps, _mm256_sub_ps)
CS_PS2(cs_mul_ps, _mm256_mul_ps)
CS_PS2(cs_div_ps, _mm256_div_ps)
CS_PS2(cs_max_ps, _mm256_max_ps)
CS_PS2(cs_unpacklo_ps, _mm256_unpacklo_ps)
CS_PS2(cs_unpackhi_ps, _mm256_unpackhi_ps)
#undef CS_PS2

CS_INLINE cs_ps cs_set1_ps(float x) { return (cs_ps){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
CS_INLINE cs_ps cs_setzero_ps(void) { return (cs_ps){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
CS_INLINE cs_ps cs_loadu_ps(const void *p) {
    return (cs_ps){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)};
}
CS_INLINE void cs_storeu_ps(void *p, cs_ps v) {
    _mm256_storeu_ps((float *)p, v.lo);
    _mm256_storeu_ps((float *)p + 8, v.hi);
}
CS_INLINE cs_ps cs_fmadd_ps(cs_ps a, cs_ps b, cs_ps c) {
    return (cs_ps){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
CS_INLINE cs_ps cs_fnmadd_ps(cs_ps a, cs_ps b, cs_ps c) {
    return (cs_ps){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}

/* Masked fp32 loads read only the selected lanes (VMASKMOVPS suppresses faults on the others: a row's last
 * partial vector may end at the end of its allocation) and zero the rest; masked stores write only those. */
CS_INLINE cs_ps cs_maskz_loadu_ps(cs_mask16 k, const void *p) {
    if (k == 0xffff) return cs_loadu_ps(p);
    const float *f = (const float *)p;
    return (cs_ps){_mm256_maskload_ps(f, cs_vmask(k & 0xff)), _mm256_maskload_ps(f + 8, cs_vmask(k >> 8))};
}
CS_INLINE void cs_mask_storeu_ps(void *p, cs_mask16 k, cs_ps v) {
    if (k == 0xffff) {
        cs_storeu_ps(p, v);
        return;
    }
    float *f = (float *)p;
    _mm256_maskstore_ps(f, cs_vmask(k & 0xff), v.lo);
    _mm256_maskstore_ps(f + 8, cs_vmask(k >> 8), v.hi);
}
CS_INLINE cs_ps cs_mask_blend_ps(cs_mask16 k, cs_ps a, cs_ps b) { /* b where k is set, a elsewhere */
    return (cs_ps){_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(cs_vmask(k & 0xff))),
                   _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(cs_vmask(k >> 8)))};
}
CS_INLINE cs_ps cs_maskz_mov_ps(cs_mask16 k, cs_ps a) {
    return (cs_ps){_mm256_and_ps(a.lo, _mm256_castsi256_ps(cs_vmask(k & 0xff))),
                   _mm256_and_ps(a.hi, _mm256_castsi256_ps(cs_vmask(k >> 8)))};
}

/* 16-bit lanes: whole vectors load and store directly; a partial one (a row's tail) lane by lane. */
CS_INLINE __m256i cs_256_maskz_loadu_epi16(cs_mask16 k, const void *p) {
    if (k == 0xffff) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t lane[16] = {0};
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) lane[i] = ((const uint16_t *)p)[i];
    return _mm256_loadu_si256((const __m256i *)lane);
}
CS_INLINE void cs_256_mask_storeu_epi16(void *p, cs_mask16 k, __m256i v) {
    if (k == 0xffff) {
        _mm256_storeu_si256((__m256i *)p, v);
        return;
    }
    uint16_t lane[16];
    _mm256_storeu_si256((__m256i *)lane, v);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) ((uint16_t *)p)[i] = lane[i];
}
CS_INLINE cs_si cs_512_maskz_loadu_epi16(cs_mask32 k, const void *p) {
    const uint16_t *h = (const uint16_t *)p;
    return (cs_si){cs_256_maskz_loadu_epi16((cs_mask16)(k & 0xffff), h),
                   cs_256_maskz_loadu_epi16((cs_mask16)(k >> 16), h + 16)};
}

CS_INLINE cs_si cs_loadu_si512(const void *p) {
    return (cs_si){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
/* VPUNPCKLWD / VPUNPCKHWD: 16-bit elements interleaved within each 128-bit lane, as AVX2's on each half. */
CS_INLINE cs_si cs_unpacklo_epi16(cs_si a, cs_si b) {
    return (cs_si){_mm256_unpacklo_epi16(a.lo, b.lo), _mm256_unpacklo_epi16(a.hi, b.hi)};
}
CS_INLINE cs_si cs_unpackhi_epi16(cs_si a, cs_si b) {
    return (cs_si){_mm256_unpackhi_epi16(a.lo, b.lo), _mm256_unpackhi_epi16(a.hi, b.hi)};
}
CS_INLINE cs_si cs_set1_epi32(int x) { return (cs_si){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
CS_INLINE cs_si cs_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int b0, int b1,
                              int b2, int b3, int b4, int b5, int b6, int b7) {
    return (cs_si){_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(b0, b1, b2, b3, b4, b5, b6, b7)};
}
#define cs_slli_epi32(a, n) ((cs_si){_mm256_slli_epi32((a).lo, n), _mm256_slli_epi32((a).hi, n)})
CS_INLINE cs_si cs_cvtepu16_epi32(__m256i h) {
    return (cs_si){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1))};
}
CS_INLINE cs_ps cs_castsi512_ps(cs_si a) { return (cs_ps){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
CS_INLINE cs_pd cs_castps_pd(cs_ps a) { return (cs_pd){_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
CS_INLINE cs_ps cs_castpd_ps(cs_pd a) { return (cs_ps){_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
CS_INLINE cs_pd cs_unpacklo_pd(cs_pd a, cs_pd b) {
    return (cs_pd){_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)};
}
CS_INLINE cs_pd cs_unpackhi_pd(cs_pd a, cs_pd b) {
    return (cs_pd){_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)};
}

/* VSHUFF32X4: 128-bit lanes 0-1 of the result from a, 2-3 from b, each chosen by two bits of imm. Lanes 0-1 of
 * a vector are its low half, 2-3 its high one, the numbering VPERM2F128 selects by. */
#define cs_shuffle_f32x4(a, b, imm)                                                    \
    ((cs_ps){_mm256_permute2f128_ps((a).lo, (a).hi, ((imm) & 3) | (((imm) >> 2 & 3) << 4)), \
             _mm256_permute2f128_ps((b).lo, (b).hi, ((imm) >> 4 & 3) | (((imm) >> 6 & 3) << 4))})

/* VPERMPS over sixteen lanes: out[i] = a[idx[i] mod 16], from both halves, blended by bit 3 of the index. */
CS_INLINE cs_ps cs_permutexvar_ps(cs_si idx, cs_ps a) {
    const __m256 lo_lo = _mm256_permutevar8x32_ps(a.lo, idx.lo), lo_hi = _mm256_permutevar8x32_ps(a.hi, idx.lo);
    const __m256 hi_lo = _mm256_permutevar8x32_ps(a.lo, idx.hi), hi_hi = _mm256_permutevar8x32_ps(a.hi, idx.hi);
    return (cs_ps){_mm256_blendv_ps(lo_lo, lo_hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx.lo, 28))),
                   _mm256_blendv_ps(hi_lo, hi_hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx.hi, 28)))};
}

/* VRNDSCALEPS with scale 0 is VROUNDPS with the same rounding bits. */
#define cs_roundscale_ps(a, imm) ((cs_ps){_mm256_round_ps((a).lo, imm), _mm256_round_ps((a).hi, imm)})

/* VSCALEFPS for the integral n that exp16 passes: a * 2^n as two exact power-of-two factors (each of 2^[-126,
 * 127], a normal float), so that the result is rounded once, as the instruction rounds it, where a * 2^n leaves
 * the normal range. n beyond +-252 gives the same infinity or zero as the instruction (|a| is at most 2). */
CS_INLINE __m256 cs_scalef8(__m256 a, __m256 n) {
    __m256i e = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(n, _mm256_set1_ps(252.f)), _mm256_set1_ps(-252.f)));
    const __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, f1), f2);
}
CS_INLINE cs_ps cs_scalef_ps(cs_ps a, cs_ps n) { return (cs_ps){cs_scalef8(a.lo, n.lo), cs_scalef8(a.hi, n.hi)}; }

/* VDPBF16PS: each fp32 lane adds the products of its two bf16 pairs, the odd (high) element first. A bf16 value
 * is the high half of an fp32: the odd element masked, the even one shifted up. */
CS_INLINE __m256 cs_dpbf16_8(__m256 acc, __m256i a, __m256i b) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    const __m256 ao = _mm256_castsi256_ps(_mm256_and_si256(a, high)), bo = _mm256_castsi256_ps(_mm256_and_si256(b, high));
    return _mm256_fmadd_ps(ae, be, _mm256_fmadd_ps(ao, bo, acc));
}
CS_INLINE cs_ps cs_dpbf16_ps(cs_ps acc, cs_si a, cs_si b) {
    return (cs_ps){cs_dpbf16_8(acc.lo, a.lo, b.lo), cs_dpbf16_8(acc.hi, a.hi, b.hi)};
}

/* VCVTNEPS2BF16 as simd.h defines it for the emulated build: zeros and denormals become a zero of the same
 * sign, infinities are truncated, NaNs truncated and made quiet, everything else rounded to nearest even. */
CS_INLINE __m256i cs_cvtneps_bf16_8(__m256 v) { /* eight results in the low 16 bits of each 32-bit lane */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i exponent = _mm256_and_si256(u, _mm256_set1_epi32(0x7f800000));
    const __m256i mantissa = _mm256_and_si256(u, _mm256_set1_epi32(0x007fffff));
    const __m256i top = _mm256_srli_epi32(u, 16);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
    const __m256i zero = _mm256_and_si256(top, _mm256_set1_epi32(0x8000));
    const __m256i quiet = _mm256_andnot_si256(_mm256_cmpeq_epi32(mantissa, _mm256_setzero_si256()), _mm256_set1_epi32(0x40));
    const __m256i special = _mm256_or_si256(top, quiet);
    const __m256i is_zero = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
    const __m256i is_special = _mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_blendv_epi8(_mm256_blendv_epi8(rounded, zero, is_zero), special, is_special);
    return _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
}
CS_INLINE __m256i cs_cvtneps_pbh(cs_ps v) {
    /* VPACKUSDW packs within 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7]; the permute restores the order */
    const __m256i packed = _mm256_packus_epi32(cs_cvtneps_bf16_8(v.lo), cs_cvtneps_bf16_8(v.hi));
    return _mm256_permute4x64_epi64(packed, 0xD8);
}

/* The horizontal reductions in simd.h's order for the emulated build (halves, then quarters, ...). */
CS_INLINE float cs_reduce_add_ps(cs_ps a) {
    const __m256 h = _mm256_add_ps(a.hi, a.lo);
    __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    q = _mm_add_ps(_mm_movehl_ps(q, q), q);
    q = _mm_add_ss(_mm_movehdup_ps(q), q);
    return _mm_cvtss_f32(q);
}
CS_INLINE float cs_reduce_max_ps(cs_ps a) { /* MAXPS(x, y): y when either is NaN */
    const __m256 h = _mm256_max_ps(a.hi, a.lo);
    __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    q = _mm_max_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

#define _mm512_add_ps cs_add_ps
#define _mm512_sub_ps cs_sub_ps
#define _mm512_mul_ps cs_mul_ps
#define _mm512_div_ps cs_div_ps
#define _mm512_max_ps cs_max_ps
#define _mm512_unpacklo_ps cs_unpacklo_ps
#define _mm512_unpackhi_ps cs_unpackhi_ps
#define _mm512_set1_ps cs_set1_ps
#define _mm512_setzero_ps cs_setzero_ps
#define _mm512_loadu_ps cs_loadu_ps
#define _mm512_storeu_ps cs_storeu_ps
#define _mm512_fmadd_ps cs_fmadd_ps
#define _mm512_fnmadd_ps cs_fnmadd_ps
#define _mm512_maskz_loadu_ps cs_maskz_loadu_ps
#define _mm512_mask_storeu_ps cs_mask_storeu_ps
#define _mm512_mask_blend_ps cs_mask_blend_ps
#define _mm512_maskz_mov_ps cs_maskz_mov_ps
#define _mm256_maskz_loadu_epi16 cs_256_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 cs_256_mask_storeu_epi16
#define _mm512_maskz_loadu_epi16 cs_512_maskz_loadu_epi16
#define _mm512_loadu_si512 cs_loadu_si512
#define _mm512_set1_epi32 cs_set1_epi32
#define _mm512_unpacklo_epi16 cs_unpacklo_epi16
#define _mm512_unpackhi_epi16 cs_unpackhi_epi16
#undef _mm512_setr_epi32 /* a macro in GCC's header */
#define _mm512_setr_epi32 cs_setr_epi32
#define _mm512_slli_epi32 cs_slli_epi32
#define _mm512_cvtepu16_epi32 cs_cvtepu16_epi32
#define _mm512_castsi512_ps cs_castsi512_ps
#define _mm512_castps_pd cs_castps_pd
#define _mm512_castpd_ps cs_castpd_ps
#define _mm512_unpacklo_pd cs_unpacklo_pd
#define _mm512_unpackhi_pd cs_unpackhi_pd
#define _mm512_shuffle_f32x4 cs_shuffle_f32x4
#define _mm512_permutexvar_ps cs_permutexvar_ps
#define _mm512_roundscale_ps cs_roundscale_ps
#define _mm512_scalef_ps cs_scalef_ps
#define _mm512_dpbf16_ps cs_dpbf16_ps
#define _mm512_cvtneps_pbh cs_cvtneps_pbh
#define _mm512_reduce_add_ps cs_reduce_add_ps
#define _mm512_reduce_max_ps cs_reduce_max_ps
/* a compare's 16 lanes as bits (a macro: the predicate must reach VCMPPS as an immediate) */
#define _mm512_cmp_ps_mask(a, b, p)                                                                         \
    ((cs_mask16)(_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, (p)))                                     \
                 | (_mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, (p))) << 8)))

#endif
