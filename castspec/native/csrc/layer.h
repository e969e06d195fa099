/* The pieces of a Llama / Qwen3 / DFlash-drafter layer for a forward's rows, shared by step.c (target forwards)
 * and draft.c (the drafter's block pass): everything between the products (gemm.c), vectorized.
 *
 * Activations stay in fp32 in a bf16 model too (the residual stream, norms, RoPE, attention, softmax, the
 * MLP's activation): only what enters a bf16 product is rounded, as it enters, and the products' fp32 sums are
 * kept (bf16 weights, not bf16 arithmetic; as the torch forward in castspec/models/ computes it, up to the
 * summation order inside attention and products and the rounding of exp).
 *
 * Keys and values are cached in the model's dtype (a bf16 model's rounded as they are written, half the bytes
 * every later row reads back) and widened to fp32 as attention reads them; a row reads its own key and value
 * back from the cache too, so it sees exactly what later rows will.
 *
 * Every row's arithmetic is independent of the other rows in its forward: the products sum in one order
 * whatever the row count (gemm.c), and attention depends only on the ordered list of keys a row sees
 * (attend_heads), never on the slots they sit in. So a row gives the same bits alone or in any batch, a tree
 * row the bits of the decode step at its position, and a prompt the same cache whatever its chunking.
 */
#ifndef CASTSPEC_LAYER_H
#define CASTSPEC_LAYER_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "sections.h"
#include "simd.h"

void gemm_bf16_f32(const uint16_t *P, const uint16_t *X, float *Y, int M, int O, int I, int ldx, int ldy);
void gemm_f32(const float *P, const float *X, float *Y, int M, int O, int I, int ldx, int ldy);
int gemm_amx_on(void);
void gemm_i8_f32(const int8_t *P, const float *wscale, const int32_t *wsum, const int8_t *X, const float *xscale,
                 float *Y, int M, int O, int I, int ldx, int ldy);

/* All of it sixteen lanes at a time, `k` masking the lanes of a row's last partial vector (simd.h's lanes). */

/* Sixteen elements of a weight (model dtype) from element i, as fp32. */
static inline __m512 load16(const StepModel *m, const void *p, int64_t i, __mmask16 k) {
    return m->bf16 ? widen(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i)) : _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

/* Rows of the embedding `table` [*, hidden] (model dtype) for token ids, as fp32 (exact): a target forward's rows,
 * a drafter pass's block. */
static void embed_rows(const StepModel *m, const void *table, const int64_t *tokens, int M, float *x) {
    const int H = m->hidden;
    for (int r = 0; r < M; ++r)
        for (int i = 0; i < H; i += 16) {
            const __mmask16 k = lanes(H, i);
            _mm512_mask_storeu_ps(x + r * H + i, k, load16(m, table, tokens[r] * H + i, k));
        }
}

/* Sixteen elements of a cached key or value (bf16 or fp32 as `bf`, a constant wherever it is inlined) from
 * element i, as fp32. */
static inline __attribute__((always_inline)) __m512 kv16(const void *p, int64_t i, int bf) {
    return bf ? widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
              : _mm512_loadu_ps((const float *)p + i);
}

/* x[i] += y[i] over n elements: a residual add. */
static void add_to(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n, i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, y + i)));
    }
}

/* fp32 rows -> bf16 copies: a bf16 product's inputs, rounded as they enter it. */
static void to_model(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n, i);
        _mm256_mask_storeu_epi16(out + i, k, narrow(_mm512_maskz_loadu_ps(k, x + i)));
    }
}

/* out = w * rms_norm(x), all in fp32 (the weight widened from the model's dtype). */
static void rms_norm(const StepModel *m, const float *x, const void *w, int n, float *out) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(lanes(n, i), x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + m->eps));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n, i);
        const __m512 normed = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), r);
        _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(load16(m, w, i, k), normed));
    }
}

/* Loops over a forward's rows whose rows are independent (norms, activations, residuals): on every thread for
 * a long forward (a prompt chunk), where they would otherwise run on one core while the others wait; each row's
 * arithmetic is the same either way. */
#define ROWS_PARALLEL_MIN 64
/* Runs the statements for r in [0, M), on every thread from MIN rows. Below it never enters the OpenMP runtime:
 * even a region whose if-clause is false costs microseconds, and a decode step would pay it hundreds of times. */
#define FOR_ROWS_FROM(MIN, M, r, ...)                            \
    do {                                                         \
        if ((M) >= (MIN)) {                                      \
            _Pragma("omp parallel for schedule(static)")         \
            for (int r = 0; r < (M); ++r) { __VA_ARGS__; }       \
        } else {                                                 \
            for (int r = 0; r < (M); ++r) { __VA_ARGS__; }       \
        }                                                        \
    } while (0)
#define FOR_ROWS(M, r, ...) FOR_ROWS_FROM(ROWS_PARALLEL_MIN, M, r, __VA_ARGS__)

/* y[o] += b[o] over one row of O outputs (b in the model's dtype, widened). */
static void add_bias(const StepModel *m, const void *b, float *y, int O) {
    for (int o = 0; o < O; o += 16) {
        const __mmask16 k = lanes(O, o);
        _mm512_mask_storeu_ps(y + o, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, y + o), load16(m, b, o, k)));
    }
}

/* The rows a bf16 product's input scratch holds for M rows: whole groups of 16 (gemm.c's AMX tiles read them). */
#define GEMM_ROWS(M) (((int64_t)(M) + 15) / 16 * 16)

#ifdef CASTSPEC_AVX512
/* One fp32 row -> int8 with one scale: round(x / s), s = max |x| / 127 (all zeros and s = 0 for a zero row), the
 * arithmetic of the torch reference in tests/test_int8.py. I is a multiple of 16. */
static void quantize_row(const float *x, int I, int8_t *q, float *scale) {
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < I; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float s = _mm512_reduce_max_ps(top) / 127.0f;
    *scale = s;
    if (s == 0.0f) {
        memset(q, 0, I);
        return;
    }
    const __m512 sv = _mm512_set1_ps(s);
    for (int i = 0; i < I; i += 16) /* rounded to nearest even, as torch.round */
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + i), sv))));
}
#endif

/* Row r of a product's M input rows X as its kernel reads them, into the scratch xs (GEMM_ROWS(M) * I elements
 * of the model's dtype): in a bf16 model rounded to bf16; with int8 weights (m->i8) quantized to int8, its scale
 * after the rows' int8; in fp32 nothing (the kernel reads X). Rows are independent: any thread may take any. */
static inline void enter_row(const StepModel *m, const float *X, int M, int I, void *xs, int r) {
    if (m->i8) {
#ifdef CASTSPEC_AVX512
        int8_t *q = xs;
        quantize_row(X + (int64_t)r * I, I, q + (int64_t)r * I, (float *)(q + GEMM_ROWS(M) * I) + r);
#else
        abort(); /* int8 weights only in the avx512 build (native/forward.py) */
#endif
    } else if (m->bf16) {
        to_model(X + (int64_t)r * I, (uint16_t *)xs + (int64_t)r * I, I);
    }
}

/* Y[M, O] = X[M, I] . W[O, I]^T + b in fp32 through gemm.c (W packed by native/pack.py), its M rows already in xs
 * (enter_row): beyond 16 rows the rows past M zeroed up to a whole group of 16 where AMX tiles read them (up to
 * 16 rows the tiles take the rows alone), the product's fp32 sums kept, the bias added in fp32. */
static void product(const StepModel *m, const void *W, const void *b, const float *X, int M, int O, int I, void *xs,
                    float *Y) {
    if (m->i8) {
#ifdef CASTSPEC_AVX512
        const Int8Weight *w = W;
        int8_t *q = xs;
        if (M > 16) memset(q + (int64_t)M * I, 0, (GEMM_ROWS(M) - M) * I);
        gemm_i8_f32(w->panels, w->scales, w->sums, q, (float *)(q + GEMM_ROWS(M) * I), Y, M, O, I, I, O);
#else
        abort(); /* as in enter_row */
#endif
    } else if (m->bf16) {
        uint16_t *x16 = xs;
        if (gemm_amx_on() && M > 16) memset(x16 + (int64_t)M * I, 0, sizeof(uint16_t) * (GEMM_ROWS(M) - M) * I);
        gemm_bf16_f32(W, x16, Y, M, O, I, I, O);
    } else {
        gemm_f32(W, X, Y, M, O, I, I, O);
    }
    if (b) FOR_ROWS(M, r, add_bias(m, b, Y + (int64_t)r * O, O));
}

/* product() of rows X: each row enters it as the weights' dtype wants (in a bf16 model rounded to bf16 as it
 * enters, with int8 weights quantized to int8 with one scale a row). xs: scratch of GEMM_ROWS(M) * I elements of
 * that dtype (and M scales for int8). */
static void linear(const StepModel *m, const void *W, const void *b, const float *X, int M, int O, int I,
                   void *xs, float *Y) {
    FOR_ROWS(M, r, enter_row(m, X, M, I, xs, r));
    SECTION_END(SEC_OTHER); /* the product's own section is the caller's next mark */
    product(m, W, b, X, M, O, I, xs, Y);
}

/* RoPE on one head in place, in fp32: x * cos + roll(x, d/2) * signed sin. */
static void rope(const StepModel *m, float *x, int64_t pos) {
    const int d = m->head_dim, h = d / 2;
    float rolled[512];
    memcpy(rolled, x + h, sizeof(float) * h);
    memcpy(rolled + h, x, sizeof(float) * h);
    for (int i = 0; i < d; i += 16) { /* d is a multiple of 16 */
        const __m512 c = _mm512_loadu_ps(m->cos + pos * d + i), s = _mm512_loadu_ps(m->sin + pos * d + i);
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + i), c);
        const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(rolled + i), s);
        _mm512_storeu_ps(x + i, _mm512_add_ps(a, b));
    }
}

/* Sixteen vectors' horizontal sums as one vector (out[j] = sum of v[j]): a tree of lane shuffles and adds,
 * much cheaper than sixteen separate reductions. Its levels: hsum_pairs folds v[2k] and v[2k + 1] into one
 * vector, hsum_quads two of those, hsum_octs two of these, hsum_last the two halves, whose sums the tree leaves
 * 4x4-transposed; the last permute (its own inverse) puts them in order. score_chunk runs the same levels as
 * its vectors come. */
static inline __m512 hsum_pairs(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
static inline __m512 hsum_quads(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __m512 hsum_octs(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 hsum_last(__m512 a, __m512 b) {
    const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
static inline __m512 hsum16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; ++k) t[k] = hsum_pairs(v[2 * k], v[2 * k + 1]);
    for (int k = 0; k < 4; ++k) u[k] = hsum_quads(t[2 * k], t[2 * k + 1]);
    return hsum_last(hsum_octs(u[0], u[1]), hsum_octs(u[2], u[3]));
}

/* The values' weighted sum for H heads over one block of C vectors (16 * C output lanes from i0): each head's
 * accumulators run key by key in order, exactly as for that head alone; the heads share each value row's loads
 * and their independent chains keep the FMA units busy. H and C are constants at every call site. */
static inline __attribute__((always_inline)) void weigh_widened(const float *p, int64_t pstride, int H, int C,
                                                                const void *V, int bf, int n, const int32_t *keys,
                                                                int d, int i0, const float *inv, float *out) {
    __m512 o[4][8];
    UNROLL_LOOP(4) for (int h = 0; h < H; ++h) UNROLL_LOOP(8) for (int k = 0; k < C; ++k) o[h][k] = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j) {
        const int64_t value = (int64_t)(keys ? keys[j] : j) * d + i0;
        __m512 v[8];
        UNROLL_LOOP(8) for (int k = 0; k < C; ++k) v[k] = kv16(V, value + 16 * k, bf);
        UNROLL_LOOP(4) for (int h = 0; h < H; ++h) {
            const __m512 w = _mm512_set1_ps(p[h * pstride + j]);
            UNROLL_LOOP(8) for (int k = 0; k < C; ++k) o[h][k] = _mm512_fmadd_ps(w, v[k], o[h][k]);
        }
    }
    UNROLL_LOOP(4) for (int h = 0; h < H; ++h)
        UNROLL_LOOP(8) for (int k = 0; k < C; ++k)
            _mm512_storeu_ps(out + (int64_t)h * d + i0 + 16 * k, _mm512_mul_ps(o[h][k], _mm512_set1_ps(inv[h])));
}

/* weigh_widened with bf16 values and weights (pb: H rows of pstride bf16 weights, zero at n when n is odd):
 * VDPBF16PS over pairs of keys, as a bf16 model's probs @ v rounds its weights. Each 32-element block of
 * two keys' values is interleaved element by element (within 128-bit lanes), so that a lane holds one element of
 * both keys; each head's accumulators then hold the block's elements in that order, and are put back in order at
 * the end. C (even) counts 16-element vectors, as in weigh_widened. */
static inline __attribute__((always_inline)) void weigh_pairs(const uint16_t *pb, int64_t pstride, int H, int C,
                                                              const uint16_t *V, int n, const int32_t *keys, int d,
                                                              int i0, const float *inv, float *out) {
    __m512 o[4][8];
    UNROLL_LOOP(4) for (int h = 0; h < H; ++h) UNROLL_LOOP(8) for (int k = 0; k < C; ++k) o[h][k] = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 2) {
        const int64_t v0 = (int64_t)(keys ? keys[j] : j) * d + i0;
        const int64_t v1 = j + 1 < n ? (int64_t)(keys ? keys[j + 1] : j + 1) * d + i0 : -1;
        __m512i lo[4], hi[4];
        UNROLL_LOOP(4) for (int b = 0; b < C / 2; ++b) {
            const __m512i a = _mm512_loadu_si512(V + v0 + 32 * b);
            const __m512i c = v1 >= 0 ? _mm512_loadu_si512(V + v1 + 32 * b) : _mm512_set1_epi32(0);
            lo[b] = _mm512_unpacklo_epi16(a, c);
            hi[b] = _mm512_unpackhi_epi16(a, c);
        }
        UNROLL_LOOP(4) for (int h = 0; h < H; ++h) {
            uint32_t pair;
            memcpy(&pair, pb + h * pstride + j, sizeof pair);
            const __m512bh w = AS_BH(_mm512_set1_epi32((int)pair));
            UNROLL_LOOP(4) for (int b = 0; b < C / 2; ++b) {
                o[h][2 * b] = _mm512_dpbf16_ps(o[h][2 * b], w, AS_BH(lo[b]));
                o[h][2 * b + 1] = _mm512_dpbf16_ps(o[h][2 * b + 1], w, AS_BH(hi[b]));
            }
        }
    }
    UNROLL_LOOP(4) for (int h = 0; h < H; ++h)
        UNROLL_LOOP(4) for (int b = 0; b < C / 2; ++b) {
            /* lo holds elements 0-3, 8-11, 16-19, 24-27 of the block, hi 4-7, 12-15, 20-23, 28-31 */
            const __m512 a = _mm512_shuffle_f32x4(o[h][2 * b], o[h][2 * b + 1], 0x44); /* lo 0-1, hi 0-1 */
            const __m512 c = _mm512_shuffle_f32x4(o[h][2 * b], o[h][2 * b + 1], 0xEE); /* lo 2-3, hi 2-3 */
            const __m512 s = _mm512_set1_ps(inv[h]);
            float *dst = out + (int64_t)h * d + i0 + 32 * b;
            _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_shuffle_f32x4(a, a, 0xD8), s));
            _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(c, c, 0xD8), s));
        }
}

/* The weighted sum of H heads' values over one block of C vectors: weigh_pairs where the scores' exponentials were
 * stored as bf16 (bh: a bf16 cache, d a multiple of 32, so C is even), else weigh_widened. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, int64_t pstride, int H, int C,
                                                               const void *V, int bf, int bh, int n,
                                                               const int32_t *keys, int d, int i0, const float *inv,
                                                               float *out) {
    if (bh) weigh_pairs((const uint16_t *)p, 2 * pstride, H, C, (const uint16_t *)V, n, keys, d, i0, inv, out);
    else weigh_widened(p, pstride, H, C, V, bf, n, keys, d, i0, inv, out);
}

/* Heads [0, G) of the weighted sum, over blocks of up to 8 vectors of d, in groups of heads that fit the
 * registers; any other shape head by head through the same code. */
static inline __attribute__((always_inline)) void weigh_all(const float *p, int64_t pstride, int G, const void *V,
                                                            int bf, int bh, int n, const int32_t *keys, int d,
                                                            const float *inv, float *out) {
    for (int i0 = 0; i0 < d; i0 += 128) {
        const int C = d - i0 < 128 ? (d - i0) / 16 : 8;
        int h = 0;
#define WEIGH(HH, CC) \
    weigh_values(p + h * pstride, pstride, HH, CC, V, bf, bh, n, keys, d, i0, inv + h, out + (int64_t)h * d)
        if (C == 4)
            for (; h + 4 <= G; h += 4) WEIGH(4, 4);
        if (C == 4 && G - h == 3) { WEIGH(3, 4); h += 3; }
        if (C == 4 && G - h == 2) { WEIGH(2, 4); h += 2; }
        if (C == 8)
            for (; h + 3 <= G; h += 3) WEIGH(3, 8);
        if (C == 8 && G - h == 2) { WEIGH(2, 8); h += 2; }
        for (; h < G; ++h) switch (C) {
            case 8: WEIGH(1, 8); break;
            case 7: WEIGH(1, 7); break;
            case 6: WEIGH(1, 6); break;
            case 5: WEIGH(1, 5); break;
            case 4: WEIGH(1, 4); break;
            case 3: WEIGH(1, 3); break;
            case 2: WEIGH(1, 2); break;
            default: WEIGH(1, 1); break;
            }
#undef WEIGH
    }
}

/* The scores of HG query heads (q: HG rows of d) against the keys [c0, c0 + w) of a 16-key chunk (slots
 * keys[c0 + j], or c0 + j without a list), unscaled, into sc[0, HG): for each head and key its lane-wise partial
 * products summed in order (key j >= w: zero), then hsum16 of the chunk's sixteen: exactly those operations,
 * with each key's vectors loaded once for all HG heads, and hsum16's levels run as the keys come (two keys'
 * sums folded at once), so that a head's partial tree holds few registers. With bh, the keys are bf16 and the
 * queries too (qh: HG rows of d, rounded once by the caller): each lane takes a pair of dimensions per
 * VDPBF16PS, as a bf16 model's q @ k^T rounds its query, with no widening of the keys; otherwise q is
 * fp32 and each lane one dimension per FMA, the keys widened. HG, d and bh are constants at the call sites
 * (the loops unroll, the query rows stay in registers where they fit). */
static inline __attribute__((always_inline)) void score_chunk(const float *q, const uint16_t *qh, int bh, int HG,
                                                              const void *K, int bf, const int32_t *keys, int c0,
                                                              int w, int d, __m512 *sc) {
    const int nv = bh ? d / 32 : d / 16;
    __m512 t[4], u[4], o[4];
    UNROLL_LOOP(8) for (int kp = 0; kp < 8; ++kp) {
        __m512 acc[4][2];
        UNROLL_LOOP(2) for (int e = 0; e < 2; ++e) {
            const int j = 2 * kp + e;
            UNROLL_LOOP(4) for (int g = 0; g < HG; ++g) acc[g][e] = _mm512_setzero_ps();
            if (j < w) {
                const int64_t key = (int64_t)(keys ? keys[c0 + j] : c0 + j) * d;
                if (bh) {
                    UNROLL_LOOP(4) for (int i = 0; i < nv; ++i) {
                        const __m512bh k = AS_BH(_mm512_loadu_si512((const uint16_t *)K + key + 32 * i));
                        UNROLL_LOOP(4) for (int g = 0; g < HG; ++g) {
                            const __m512bh qi = AS_BH(_mm512_loadu_si512(qh + (int64_t)g * d + 32 * i));
                            acc[g][e] = _mm512_dpbf16_ps(acc[g][e], qi, k);
                        }
                    }
                } else {
                    UNROLL_LOOP(8) for (int i = 0; i < nv; ++i) {
                        const __m512 k = kv16(K, key + 16 * i, bf);
                        UNROLL_LOOP(4) for (int g = 0; g < HG; ++g)
                            acc[g][e] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (int64_t)g * d + 16 * i), k, acc[g][e]);
                    }
                }
            }
        }
        UNROLL_LOOP(4) for (int g = 0; g < HG; ++g) {
            const __m512 pair = hsum_pairs(acc[g][0], acc[g][1]);
            if (kp % 2 == 0) {
                t[g] = pair;
                continue;
            }
            const __m512 quad = hsum_quads(t[g], pair);
            if (kp % 4 == 1) u[g] = quad;
            else if (kp == 3) o[g] = hsum_octs(u[g], quad);
            else sc[g] = hsum_last(o[g], hsum_octs(u[g], quad));
        }
    }
}

/* The cache lines of the next chunk's keys (keys [c0 + 16, c0 + 32) of the list) and of this chunk's values, asked
 * for ahead (es: bytes an element). A row whose keys and values come from memory otherwise reads them as two
 * short streams one after the other, each started by a miss: keys and values fetched side by side, and the keys a
 * chunk ahead, keep more lines in flight. Where they are in the cache already (the tree's other rows, read right
 * after the first) the fetches only take load slots, so attention() asks for them on a thread's first item of
 * each key/value head. Inlined always: GCC deems a function that only fetches free of effects, and drops calls
 * to it. */
static inline __attribute__((always_inline)) void fetch_chunks(const void *K, const void *V, int es, int n,
                                                               const int32_t *keys, int d, int c0) {
    const int row = d * es;
    for (int j = 0; j < 16; ++j) {
        const int ik = c0 + 16 + j, iv = c0 + j;
        if (ik < n) {
            const char *k = (const char *)K + (int64_t)(keys ? keys[ik] : ik) * row;
            for (int b = 0; b < row; b += 64) _mm_prefetch(k + b, _MM_HINT_T0);
        }
        if (iv < n) {
            const char *v = (const char *)V + (int64_t)(keys ? keys[iv] : iv) * row;
            for (int b = 0; b < row; b += 64) _mm_prefetch(v + b, _MM_HINT_T0);
        }
    }
}

/* Softmax attention of G query heads (q: G rows of d) sharing one key/value head, over the n keys they see, in
 * order: slots keys[0..n) of that head (keys NULL: slots [0, n)); out: G rows of d, fp32. p is scratch of G
 * rows of pstride >= n rounded up to 16 floats. With `fetch`, the keys and values are asked for ahead
 * (fetch_chunks), which changes no arithmetic.
 *
 * Everything runs over that compact list (scores sixteen keys at a time through one horizontal-sum tree, the
 * softmax's max and sum over its lanes, the values' weighted sum key by key), so the bits depend only on the
 * ordered keys, never on the slots they occupy or on keys the row does not see: a tree row (prefix and
 * ancestors, parents first) computes exactly what the decode step at its position computes over slots
 * 0..pos. Each head computes the same bits whatever G is: the heads share the loads of each key and value,
 * nothing else.
 *
 * A bf16 cache (d a multiple of 32) multiplies in bf16, as a bf16 model's attention in transformers rounds its
 * query and its weights: the query and the softmax's exponentials (before the division by their sum) rounded to bf16,
 * each multiplied with the keys or values by VDPBF16PS (two dimensions, or two keys, per lane), sums in fp32;
 * half the instructions of widening the cache to fp32. */
static inline __attribute__((always_inline)) void attend_heads_as(const float *q, int G, const void *K,
                                                                  const void *V, int bf, int n,
                                                                  const int32_t *keys, int d, float scale, float *p,
                                                                  int64_t pstride, float *out, int fetch) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax[64];
    for (int g = 0; g < G; ++g) vmax[g] = ninf;
    /* bf16 keys: the queries rounded to bf16 once, for VDPBF16PS (score_chunk) */
    const int bh = bf && d % 32 == 0;
    uint16_t qh[bh ? G * d : 1];
    if (bh) to_model(q, qh, (int64_t)G * d);
    for (int c0 = 0; c0 < n; c0 += 16) {
        const int w = n - c0 < 16 ? n - c0 : 16;
        if (fetch) fetch_chunks(K, V, bf ? 2 : 4, n, keys, d, c0);
        for (int g0 = 0; g0 < G; g0 += 4) { /* up to four heads at a time share each key's loads */
            const int hg = G - g0 < 4 ? G - g0 : 4;
            const float *qg = q + (int64_t)g0 * d;
            __m512 sc[4];
#define SCORES(HG)                                                                      \
    do {                                                                                \
        const uint16_t *qhg = qh + (int64_t)g0 * d;                                     \
        if (bh && d == 64) score_chunk(qg, qhg, 1, HG, K, bf, keys, c0, w, 64, sc);     \
        else if (bh && d == 128) score_chunk(qg, qhg, 1, HG, K, bf, keys, c0, w, 128, sc); \
        else if (bh) score_chunk(qg, qhg, 1, HG, K, bf, keys, c0, w, d, sc);            \
        else if (d == 64) score_chunk(qg, qhg, 0, HG, K, bf, keys, c0, w, 64, sc);      \
        else if (d == 128) score_chunk(qg, qhg, 0, HG, K, bf, keys, c0, w, 128, sc);    \
        else score_chunk(qg, qhg, 0, HG, K, bf, keys, c0, w, d, sc);                    \
    } while (0)
            switch (hg) {
                case 4: SCORES(4); break;
                case 3: SCORES(3); break;
                case 2: SCORES(2); break;
                default: SCORES(1); break;
            }
#undef SCORES
            for (int g = g0; g < g0 + hg; ++g) {
                const __m512 s =
                    _mm512_mask_blend_ps(lanes(n, c0), ninf, _mm512_mul_ps(sc[g - g0], _mm512_set1_ps(scale)));
                _mm512_storeu_ps(p + g * pstride + c0, s);
                vmax[g] = _mm512_max_ps(vmax[g], s);
            }
        }
    }
    float inv[64];
    for (int g = 0; g < G; ++g) {
        float *pg = p + g * pstride;
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[g]));
        __m512 vsum = _mm512_setzero_ps();
        for (int c0 = 0; c0 < n; c0 += 16) {
            const __m512 e = _mm512_maskz_mov_ps(lanes(n, c0), exp16(_mm512_sub_ps(_mm512_loadu_ps(pg + c0), mx)));
            /* bf16 weights (weigh_pairs): written over the front of the head's row of scratch, behind what
             * is still to be read; all sixteen lanes, so that the weight after the last key is zero */
            if (bh) _mm256_storeu_si256((__m256i *)((uint16_t *)pg + c0), narrow(e));
            else _mm512_storeu_ps(pg + c0, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(vsum);
    }
    weigh_all(p, pstride, G, V, bf, bh, n, keys, d, inv, out);
}

/* attend_heads_as over a cache of bf16 (bf) or fp32 keys and values: one copy of the code for each, so that
 * the inner loops test nothing. */
static void attend_heads(const float *q, int G, const void *K, const void *V, int bf, int n, const int32_t *keys,
                         int d, float scale, float *p, int64_t pstride, float *out, int fetch) {
    if (bf) attend_heads_as(q, G, K, V, 1, n, keys, d, scale, p, pstride, out, fetch);
    else attend_heads_as(q, G, K, V, 0, n, keys, d, scale, p, pstride, out, fetch);
}

/* The slots a row sees, ascending, from its mask row visible[0, S) (nonzero = visible) into keys; returns how
 * many. */
static int visible_keys(const uint8_t *visible, int S, int32_t *keys) {
    int n = 0;
    for (int s = 0; s < S; ++s)
        if (visible[s]) keys[n++] = s;
    return n;
}

/* Per-head RMSNorm (when the layer has one: Qwen3, drafters) then RoPE at `pos`, in place, on `nq` query
 * heads followed by `nk` key heads of one row. */
static void norm_rope_heads(const StepModel *m, const Layer *L, float *heads, int nq, int nk, int64_t pos) {
    const int d = m->head_dim;
    for (int h = 0; h < nq + nk; ++h) {
        float *head = heads + h * d;
        if (L->q_norm) {
            float t[512];
            rms_norm(m, head, h < nq ? L->q_norm : L->k_norm, d, t);
            memcpy(head, t, sizeof(float) * d);
        }
        rope(m, head, pos);
    }
}

/* Element `i` of a cache tensor in the model's dtype (the caches' dtype): where it sits. */
static inline void *kv_at(const StepModel *m, const void *base, int64_t i) {
    return (char *)base + i * (m->bf16 ? 2 : 4);
}

/* One row's key and value heads into cache slot `slot` of one layer ([kv_heads, capacity, head_dim], the
 * model's dtype: a bf16 model's rounded as torch rounds them, to nearest even). */
static void write_kv(const StepModel *m, void *K, void *V, int64_t head_stride, int64_t slot, const float *k,
                     const float *v) {
    const int d = m->head_dim;
    for (int g = 0; g < m->kv_heads; ++g) {
        void *key = kv_at(m, K, g * head_stride + slot * d), *value = kv_at(m, V, g * head_stride + slot * d);
        if (m->bf16) {
            to_model(k + g * d, key, d);
            to_model(v + g * d, value, d);
        } else {
            memcpy(key, k + g * d, sizeof(float) * d);
            memcpy(value, v + g * d, sizeof(float) * d);
        }
    }
}

#include "attn_amx.h"

/* Whether attention runs on AMX tiles (attn_amx.h): decided by gemm.c's choice, once per process, so that every
 * forward computes a row alike. */
static inline int attention_on_amx(const StepModel *m) {
#ifdef CASTSPEC_AVX512
    return m->bf16 && gemm_amx_on() && m->head_dim % 64 == 0 && m->heads / m->kv_heads <= 16;
#else
    (void)m;
    return 0;
#endif
}

/* The floats of attention()'s probs scratch, per thread: a group of heads' scores, or attn_amx.h's scratch. */
#define ATTN_PROBS(m, S16)                                                                                   \
    ((int64_t)omp_get_max_threads() *                                                                       \
     (attention_on_amx(m) ? amx_attn_floats(((S16) + 31) & ~31, (m)->head_dim)                              \
                          : (int64_t)((m)->heads / (m)->kv_heads) * (S16)))

/* Attention of M rows' query heads (row r's at q + r * ldq), each over its own RowAttn; then the output
 * projection and the residual into x [M, hidden]. probs is scratch of ATTN_PROBS(m, S16) floats (S16: the
 * largest n rounded up to 16): one block per thread, so that it does not grow with M; heads_out of M * heads *
 * head_dim. */
static void attention(const StepModel *m, const Layer *L, int M, const float *q, int64_t ldq, const RowAttn *rows,
                      int S16, float *probs, float *heads_out, float *x, void *xs, float *att) {
    const int d = m->head_dim, nh = m->heads, nq = nh * d, group = nh / m->kv_heads;
    const float scale = 1.f / sqrtf((float)d);
    if (attention_on_amx(m)) {
#ifdef CASTSPEC_AVX512
        attention_amx(m, M, q, ldq, rows, (S16 + 31) & ~31, probs, heads_out);
#endif
    } else {
        /* work items: a row's query heads that share a key/value head, together (they share the loads), or one by
         * one where there are fewer such groups than threads; the bits are the same either way. (One decode row's
         * three groups on two threads: one thread takes two, which still beats nine single heads shared out, since
         * a group's heads read each key and value once.) Items run
         * head by head over the rows, so a thread's consecutive items read the same keys and values (a tree's rows
         * share their prefix) while they are still in its cache. */
        const int G = M * m->kv_heads >= omp_get_max_threads() && group <= 64 ? group : 1, items = M * (nh / G);
#pragma omp parallel if ((int64_t)M * rows[0].n >= 64)
        {
            const void *last = NULL; /* the keys this thread's previous item read */
#pragma omp for schedule(static)
            for (int it = 0; it < items; ++it) {
                const int r = it % M, h = (it / M) * G;
                const RowAttn *a = &rows[r];
                const int64_t at = (h / group) * a->head_stride; /* the key/value head */
                const void *K = kv_at(m, a->K, at);
                attend_heads(q + r * ldq + h * d, G, K, kv_at(m, a->V, at), m->bf16, a->n, a->keys, d, scale,
                             probs + (int64_t)omp_get_thread_num() * group * S16, S16,
                             heads_out + (int64_t)r * nq + h * d, K != last);
                last = K;
            }
        }
    }
    SECTION_END(SEC_ATTENTION);
    linear(m, L->o_w, L->o_b, heads_out, M, m->hidden, nq, xs, att);
    SECTION_END(SEC_O);
    FOR_ROWS(M, r, add_to(x + (int64_t)r * m->hidden, att + (int64_t)r * m->hidden, m->hidden));
}

/* From how many rows the MLP's silu runs on every thread: the exponentials of a row of `inter` values take long
 * enough that from 8 rows splitting them outweighs entering the OpenMP runtime (docs/performance.md). */
#define SILU_PARALLEL_MIN 8
/* One row's silu(gate) * up from its gate | up halves (gu: 2F values) into act (F). */
static void silu_times(const float *gu, int F, float *act) {
    for (int i = 0; i < F; i += 16) {
        const __mmask16 k = lanes(F, i);
        const __m512 g = _mm512_maskz_loadu_ps(k, gu + i), u = _mm512_maskz_loadu_ps(k, gu + F + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(act + i, k, _mm512_mul_ps(silu, u));
    }
}

/* x += down(silu(gate) * up) of the post-attention-normed rows. n, gu [M, 2 * inter], act [M, inter], att
 * [M, hidden] are scratch. */
static void mlp(const StepModel *m, const Layer *L, int M, float *x, float *n, float *gu, float *act, void *xs,
                float *att) {
    const int H = m->hidden, F = m->inter;
    FOR_ROWS(M, r, rms_norm(m, x + (int64_t)r * H, L->mlp_norm, H, n + (int64_t)r * H));
    linear(m, L->gate_up_w, L->gate_up_b, n, M, 2 * F, H, xs, gu); /* per row: gate | up */
    SECTION_END(SEC_GATE_UP);
    /* silu, the heaviest of the per-row loops, on every thread from SILU_PARALLEL_MIN rows, each row entering the
     * down product on the thread that made it (read on the other core, it cost back most of what was gained) */
    FOR_ROWS_FROM(SILU_PARALLEL_MIN, M, r, {
        silu_times(gu + (int64_t)r * 2 * F, F, act + (int64_t)r * F);
        enter_row(m, act, M, F, xs, r);
    });
    SECTION_END(SEC_SILU);
    product(m, L->down_w, L->down_b, act, M, H, F, xs, att);
    SECTION_END(SEC_DOWN);
    FOR_ROWS(M, r, add_to(x + (int64_t)r * H, att + (int64_t)r * H, H));
}

#endif
