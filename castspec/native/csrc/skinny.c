/* Skinny matrix products for decoding on AVX-512 CPUs: Y[M,O] = X[M,I] . W[O,I]^T for a few rows M.
 *
 * Decode steps, tree verification and drafting multiply 1-16 rows by every weight matrix, so they are bound
 * by how fast the weights stream from memory. Weight rows are split across OpenMP threads in blocks of
 * OBLOCK, each read from memory once and dotted with the input rows (which stay in cache) in register-resident
 * groups of up to 8. Every output is a dot product accumulated in the same order whatever M is, so a
 * row's result does not depend on how many rows share the call.
 *
 * Built at first use by castspec/native/build.py; OpenMP resolves to the libgomp torch already loaded (same
 * soname), so this shares torch's thread pool and its thread count.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* Two accumulators per input row (even and odd vectors): enough independent chains to keep the loads
 * streaming, and the same for every group size, so the summation order never depends on M. */
#define UNROLL 2
/* Groups of 4+ rows compute long enough per weight row that the hardware prefetcher falls behind: they fetch
 * the weight row PREFETCH_ROWS ahead themselves (fewer rows are faster without it; docs/performance.md). */
#define PREFETCH_ROWS 4
/* Weight rows per block: a block's rows stay in L1/L2 while every row group of the input passes over them. */
#define OBLOCK 32

/* R rows of X (stride ldx) dotted with one weight row w of length I; R is a constant at every call site, so
 * the loops over rows unroll (UNROLL_LOOP insists) and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dots_bf16(const uint16_t *w, const uint16_t *X, int64_t ldx,
                                                            int I, int R, float *out) {
    const char *ahead = (const char *)(w + (int64_t)PREFETCH_ROWS * I);
    __m512 acc[8][UNROLL];
    UNROLL_LOOP(8) for (int m = 0; m < R; ++m)
        UNROLL_LOOP(2) for (int u = 0; u < UNROLL; ++u) acc[m][u] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 * UNROLL <= I; i += 32 * UNROLL) {
        if (R >= 4) UNROLL_LOOP(2) for (int u = 0; u < UNROLL; ++u) _mm_prefetch(ahead + 2 * (i + 32 * u), _MM_HINT_T0);
        UNROLL_LOOP(2) for (int u = 0; u < UNROLL; ++u) {
            const __m512bh wv = AS_BH(_mm512_loadu_si512(w + i + 32 * u));
            UNROLL_LOOP(8) for (int m = 0; m < R; ++m)
                acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, AS_BH(_mm512_loadu_si512(X + m * ldx + i + 32 * u)));
        }
    }
    for (; i < I; i += 32) {  /* the rest, a masked final vector included, into the first accumulator (a fixed
                                index: a computed one would keep the accumulators out of registers) */
        const __mmask32 k = I - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (I - i)) - 1u);
        const __m512bh wv = AS_BH(_mm512_maskz_loadu_epi16(k, w + i));
        UNROLL_LOOP(8) for (int m = 0; m < R; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, AS_BH(_mm512_maskz_loadu_epi16(k, X + m * ldx + i)));
    }
    UNROLL_LOOP(8) for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

static inline __attribute__((always_inline)) void dots_f32(const float *w, const float *X, int64_t ldx, int I,
                                                           int R, float *out) {
    const char *ahead = (const char *)(w + (int64_t)PREFETCH_ROWS * I);
    __m512 acc[8][UNROLL];
    UNROLL_LOOP(8) for (int m = 0; m < R; ++m)
        UNROLL_LOOP(2) for (int u = 0; u < UNROLL; ++u) acc[m][u] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 * UNROLL <= I; i += 16 * UNROLL) {
        if (R >= 4) UNROLL_LOOP(2) for (int u = 0; u < UNROLL; ++u) _mm_prefetch(ahead + 4 * (i + 16 * u), _MM_HINT_T0);
        UNROLL_LOOP(2) for (int u = 0; u < UNROLL; ++u) {
            const __m512 wv = _mm512_loadu_ps(w + i + 16 * u);
            UNROLL_LOOP(8) for (int m = 0; m < R; ++m)
                acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(X + m * ldx + i + 16 * u), acc[m][u]);
        }
    }
    for (; i < I; i += 16) {
        const __mmask16 k = I - i >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (I - i)) - 1u);
        const __m512 wv = _mm512_maskz_loadu_ps(k, w + i);
        UNROLL_LOOP(8) for (int m = 0; m < R; ++m)
            acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(k, X + m * ldx + i), acc[m][0]);
    }
    UNROLL_LOOP(8) for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

/* Column o of R output rows (stride ldy) from their fp32 dot products: as they are, or rounded to bf16. */
static inline void put_f32(const float *out, int R, float *y, int64_t ldy) {
    for (int m = 0; m < R; ++m) y[m * ldy] = out[m];
}

static inline void put_bf16(const float *out, int R, uint16_t *y, int64_t ldy) {
    uint16_t h[16];
    _mm256_storeu_si256((__m256i *)h, narrow(_mm512_maskz_loadu_ps(lanes(R, 0), out)));
    for (int m = 0; m < R; ++m) y[m * ldy] = h[m];
}

/* Output rows [ob, oe) for input rows [m0, m0 + R): one register-resident group of R rows. */
#define GROUP(DOTS, PUT, R)                                                                           \
    for (int o = ob; o < oe; ++o) {                                                                  \
        float out[8];                                                                                \
        DOTS(W + (int64_t)o * I, X + (int64_t)m0 * ldx, (int64_t)ldx, I, R, out);                     \
        PUT(out, R, Y + (int64_t)m0 * ldy + o, ldy);                                                 \
    }                                                                                                \
    m0 += R;

/* Weight rows split across threads in blocks; every block meets the input rows in groups of up to 8, so up
 * to 8 rows stream the weights in one pass (a second pass over a block, from cache, still costs). */
#define SKINNY(DOTS, PUT)                                                                         \
    _Pragma("omp parallel for schedule(static)") for (int ob = 0; ob < O; ob += OBLOCK) {             \
        const int oe = ob + OBLOCK < O ? ob + OBLOCK : O;                                            \
        for (int m0 = 0; m0 < M;) {                                                                  \
            switch (M - m0 < 8 ? M - m0 : 8) {                                                       \
            case 8: GROUP(DOTS, PUT, 8) break;                                                   \
            case 7: GROUP(DOTS, PUT, 7) break;                                                   \
            case 6: GROUP(DOTS, PUT, 6) break;                                                   \
            case 5: GROUP(DOTS, PUT, 5) break;                                                   \
            case 4: GROUP(DOTS, PUT, 4) break;                                                   \
            case 3: GROUP(DOTS, PUT, 3) break;                                                   \
            case 2: GROUP(DOTS, PUT, 2) break;                                                   \
            default: GROUP(DOTS, PUT, 1) break;                                                  \
            }                                                                                        \
        }                                                                                            \
    }

/* bf16 in, bf16 out, fp32 accumulation (VDPBF16PS: pairs of products summed into fp32 lanes): native/linear.py's
 * products for the torch forward. */
void skinny_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, int M, int O, int I, int ldx, int ldy) {
    SKINNY(dots_bf16, put_bf16)
}

/* bf16 in, the fp32 sums out unrounded: the whole forwards' products (layer.h), whose activations stay fp32. */
void skinny_bf16_f32(const uint16_t *W, const uint16_t *X, float *Y, int M, int O, int I, int ldx, int ldy) {
    SKINNY(dots_bf16, put_f32)
}

/* fp32 in and out, fp32 fused multiply-adds. */
void skinny_f32(const float *W, const float *X, float *Y, int M, int O, int I, int ldx, int ldy) {
    SKINNY(dots_f32, put_f32)
}
