/* Skinny matrix products for decoding on AVX-512 CPUs: Y[M,O] = X[M,I] . W[O,I]^T for a few rows M.
 *
 * Decode steps, tree verification and drafting multiply 1-16 rows by every weight matrix, so they are bound
 * by how fast the weights stream from memory. Each weight row is read once and dotted with the input rows
 * (which stay in cache) in register-resident groups of 8, 4, 2 and 1; output rows are split across OpenMP
 * threads. Every output is a dot product accumulated in the same order whatever M is, so a row's result does
 * not depend on how many rows share the call.
 *
 * Built at first use by castspec/native.py; OpenMP resolves to the libgomp torch already loaded (same
 * soname), so this shares torch's thread pool and its thread count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Two accumulators per input row (even and odd vectors): enough independent chains to keep the loads
 * streaming, and the same for every group size, so the summation order never depends on M. */
#define UNROLL 2

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch's float -> bfloat16 */
    return (uint16_t)(u >> 16);
}

/* R rows of X (stride ldx) dotted with one weight row w of length I; R is a constant at every call site, so
 * the loops over rows unroll (the pragmas insist) and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dots_bf16(const uint16_t *w, const uint16_t *X, int64_t ldx,
                                                            int I, int R, float *out) {
    __m512 acc[8][UNROLL];
    _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
        _Pragma("GCC unroll 2") for (int u = 0; u < UNROLL; ++u) acc[m][u] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 * UNROLL <= I; i += 32 * UNROLL)
        _Pragma("GCC unroll 2") for (int u = 0; u < UNROLL; ++u) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i + 32 * u);
            _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
                acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, (__m512bh)_mm512_loadu_si512(X + m * ldx + i + 32 * u));
        }
    for (; i < I; i += 32) {  /* the rest, a masked final vector included, into the first accumulator (a fixed
                                index: a computed one would keep the accumulators out of registers) */
        const __mmask32 k = I - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (I - i)) - 1u);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(k, w + i);
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(k, X + m * ldx + i));
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

static inline __attribute__((always_inline)) void dots_f32(const float *w, const float *X, int64_t ldx, int I,
                                                           int R, float *out) {
    __m512 acc[8][UNROLL];
    _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
        _Pragma("GCC unroll 2") for (int u = 0; u < UNROLL; ++u) acc[m][u] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 * UNROLL <= I; i += 16 * UNROLL)
        _Pragma("GCC unroll 2") for (int u = 0; u < UNROLL; ++u) {
            const __m512 wv = _mm512_loadu_ps(w + i + 16 * u);
            _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
                acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(X + m * ldx + i + 16 * u), acc[m][u]);
        }
    for (; i < I; i += 16) {
        const __mmask16 k = I - i >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (I - i)) - 1u);
        const __m512 wv = _mm512_maskz_loadu_ps(k, w + i);
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m)
            acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(k, X + m * ldx + i), acc[m][0]);
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

/* Groups of 8, 4, 2, 1 rows, each with its register-resident accumulators. */
#define ROW_GROUPS(DOTS, w, X, ldx, M, I, out)                                   \
    for (int m0 = 0; m0 < (M);) {                                                \
        const int left = (M) - m0;                                               \
        if (left >= 8) { DOTS(w, X + m0 * (ldx), ldx, I, 8, out + m0); m0 += 8; } \
        else if (left >= 4) { DOTS(w, X + m0 * (ldx), ldx, I, 4, out + m0); m0 += 4; } \
        else if (left >= 2) { DOTS(w, X + m0 * (ldx), ldx, I, 2, out + m0); m0 += 2; } \
        else { DOTS(w, X + m0 * (ldx), ldx, I, 1, out + m0); m0 += 1; }           \
    }

/* bf16 in, bf16 out, fp32 accumulation (VDPBF16PS: pairs of products summed into fp32 lanes). M <= 64. */
void skinny_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, int M, int O, int I, int ldx, int ldy) {
#pragma omp parallel for schedule(static)
    for (int o = 0; o < O; ++o) {
        float out[64];
        ROW_GROUPS(dots_bf16, W + (int64_t)o * I, X, (int64_t)ldx, M, I, out)
        for (int m = 0; m < M; ++m) Y[(int64_t)m * ldy + o] = f32_to_bf16(out[m]);
    }
}

/* fp32 in and out, fp32 fused multiply-adds. M <= 64. */
void skinny_f32(const float *W, const float *X, float *Y, int M, int O, int I, int ldx, int ldy) {
#pragma omp parallel for schedule(static)
    for (int o = 0; o < O; ++o) {
        float out[64];
        ROW_GROUPS(dots_f32, W + (int64_t)o * I, X, (int64_t)ldx, M, I, out)
        for (int m = 0; m < M; ++m) Y[(int64_t)m * ldy + o] = out[m];
    }
}
