/* Matrix products of the whole native forwards (layer.h): Y[M, O] = X[M, I] . W[O, I]^T for any row count M,
 * on weights packed once at load (castspec/native/pack.py) into panels of 16 output columns.
 *
 * A decode step multiplies one row by every weight matrix and is bound by reading the weights; a tree verify or
 * a serving round multiplies 8-64 rows, which costs compute as well. Both run here as register tiles of up to
 * 8 rows x 3-6 panels (AVX2: 1-4): per step along I, each weight vector is loaded once and used by every row of
 * the tile, each row's input is broadcast once and used by every panel. The threads take the panels a few at a
 * time, each from its own contiguous share first (share.h); every group of rows meets those panels while they
 * are still in cache, so the weights stream from memory once per forward whatever M is, fetched ahead of the
 * compute (PRODUCT) so that the stream and the dot products overlap.
 *
 * Packed layouts (16 = output columns of a panel, lanes of a vector):
 *   bf16: [O/16/G][I/2][G][16][2], the k-pairs VDPBF16PS consumes (input I even), panels interleaved in groups
 *         of G = gemm_panel_group(): a tile's G panels are one stream of whole 64-byte lines along I, not G
 *         streams, which the hardware prefetcher follows better (measured on a Zen 5 EPYC, docs/performance.md);
 *         G = 1 (plain panels) where AMX tiles read them (1 KiB blocks of one panel);
 *   int8: [O/16/G][I/4][G][16][4], the quads VPDPBUSD consumes, grouped as bf16 (G = 1 with AMX tiles);
 *   fp32: [O/16][I][16].
 * O is padded to whole panels (and grouped panels to whole groups) with zero columns, computed and never stored.
 *
 * Every output is computed by the same instructions in the same order whatever M is, wherever the row sits in
 * the call and whichever tile or thread computes it: along I in order (bf16: in chunks of KCHUNK pairs, each
 * summed from zero and added to the output in order). So a row's result depends only on that row (the
 * bit-exactness of issue 16 rests on it).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "share.h"
#include "simd.h"

#ifdef CASTSPEC_AVX2
#define MAX_R 4 /* rows per tile: 16 registers of 256 bits hold 4 rows x 1 panel (8 accumulators) and its operands */
#else
#define MAX_R 8 /* rows per tile */
#endif
/* bf16 sums run in chunks of this many k-pairs (32 inputs, an AMX tile's depth), each from zero, added to the
 * output in order: a long sum's rounding error grows with its number of sequential additions, and one chain over
 * all of I lost accuracy against fp32 (greedy agreement, docs/performance.md). */
#define KCHUNK 16
#define BLOCK 24 /* most panels per block when several row groups share it: a multiple of every tile width below */
/* Panels per group of the bf16 layout on AVX-512 tiles, whose 8-row tiles are 3 panels wide (the AVX2 build keeps
 * plain panels: its tiles are 1-4 panels wide, and it was not measured interleaved). */
#ifdef CASTSPEC_AVX2
#define PANEL_GROUP 1
#define UNIT 8 /* panels a thread takes at a time when one row group passes over them (share.h) */
#else
#define PANEL_GROUP 3
#define UNIT 6 /* two groups */
#endif
/* Products of at least PREFETCH_MIN_ROWS rows fetch each weight line PREFETCH_LINES steps along I ahead: their
 * compute per line is long enough that the hardware prefetcher falls behind (docs/performance.md). With several
 * row groups, blocks hold at most BLOCK_BYTES of weights, so that the block being multiplied and the next one fit
 * in a core's L2 together (FETCH_NEXT: whether they fetch that next block). All overridable at build time.
 */
#ifdef CASTSPEC_AVX2 /* on the AVX2 CPU tuned for (docs/performance.md), fetching ahead paid at every row count, and
                        fetching the next block did not */
#ifndef PREFETCH_MIN_ROWS
#define PREFETCH_MIN_ROWS 1
#endif
#ifndef FETCH_NEXT
#define FETCH_NEXT 0
#endif
#endif
#ifndef PREFETCH_MIN_ROWS
#define PREFETCH_MIN_ROWS 4
#endif
#ifndef PREFETCH_LINES
#define PREFETCH_LINES 32
#endif
/* The same for products of PREFETCH_WIDE_ROWS-8 rows (one group of rows), and of 9-16 rows (one pass of two
 * groups, gemm_bf16_f32's pairs), whose steps take more compute: native/build.py fetches further ahead for them
 * where that measured faster. */
#ifndef PREFETCH_WIDE_ROWS
#define PREFETCH_WIDE_ROWS MAX_R
#endif
#ifndef PREFETCH_LINES_WIDE
#define PREFETCH_LINES_WIDE PREFETCH_LINES
#endif
#ifndef PREFETCH_LINES_PAIRS
#define PREFETCH_LINES_PAIRS PREFETCH_LINES
#endif
/* Where those lines go: L1 (T0) where this was tuned first; native/build.py picks L2 (T1), or non-temporal (NTA:
 * not kept in a victim L3), on CPUs where that measured faster (docs/performance.md). */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
#ifndef FETCH_NEXT
#define FETCH_NEXT 1 /* whether row groups after the first fetch the next block */
#endif
#ifndef BLOCK_BYTES
#define BLOCK_BYTES (192 * 1024)
#endif

/* What a tile fetches beside its loads (see PRODUCT): with `ahead`, the weight line `ahead` steps further along
 * I, into L1; with `next`, on every `every`-th step from step `phase`, the line `next` elements on (the same line
 * of the block its thread multiplies next), into L2. */
typedef struct {
    int ahead;
    int64_t next;
    int every, phase;
} Fetch;

/* Step i's countdown: whether step i fetches the next block's lines, then the countdown for step i + 1. */
static inline __attribute__((always_inline)) int fetch_next_now(const Fetch *f, int *countdown) {
    if (!f->next) return 0;
    const int now = *countdown == 0;
    *countdown = now ? f->every - 1 : *countdown - 1;
    return now;
}

/* step: bytes from one step along I to the next (a line, or a group's lines). */
static inline __attribute__((always_inline)) void fetch_lines(const Fetch *f, const void *line, size_t esz,
                                                              int64_t step, int now) {
    if (f->ahead) _mm_prefetch((const char *)line + f->ahead * step, PREFETCH_HINT);
    if (now) _mm_prefetch((const char *)line + f->next * (int64_t)esz, _MM_HINT_T1);
}

/* Where panel q of a matrix packed in groups of G panels (pstride bytes a panel) starts: its first step's
 * 64-byte line (a bf16 k-pair's, an int8 quad's); its next step's is 64 * G bytes on. */
static inline const void *panel_at(const void *P, int64_t q, int64_t pstride, int G) {
    return (const char *)P + q / G * G * pstride + q % G * 64;
}

/* Steps [p0, pe) of one chunk of a tile of R rows x NB panels (the panels' first lines in `panel`, `step`
 * elements from one step to the next): the sums from zero, then stored into Y (the first chunk, p0 = 0) or added
 * to it. R and NB are constants at every call site (the accumulators stay in registers). */
static inline __attribute__((always_inline)) void chunk_bf16(const uint16_t *const *panel, int64_t step, int p0,
                                                             int pe, const uint32_t *X, int64_t ldx2, int R, int NB,
                                                             float *Y, int64_t ldy, int64_t valid, const Fetch *f,
                                                             int *countdown) {
    __m512 acc[MAX_R][8];
    UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int p = p0; p < pe; ++p) {
        __m512bh w[8];
        const int now = fetch_next_now(f, countdown);
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) {
            const uint16_t *line = panel[b] + p * step;
            w[b] = AS_BH(_mm512_loadu_si512(line));
            fetch_lines(f, line, sizeof(uint16_t), step * 2, now);
        }
        UNROLL_LOOP(8) for (int r = 0; r < R; ++r) {
            const __m512bh x = AS_BH(_mm512_set1_epi32((int)X[r * ldx2 + p]));
            UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], x, w[b]);
        }
    }
    UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b)
            if (valid > 16 * b) {
                const __mmask16 k = lanes(valid, 16 * b);
                float *y = Y + r * ldy + 16 * b;
                _mm512_mask_storeu_ps(y, k, p0 ? _mm512_add_ps(_mm512_maskz_loadu_ps(k, y), acc[r][b]) : acc[r][b]);
            }
}

/* One tile: R rows x NB panels (panels q0 on of P, packed in groups of G) along all of I, in chunks of KCHUNK
 * k-pairs (each summed from zero and added to Y in order); each step loads one 64-byte line per panel. With R2 > 0
 * a second group of R2 rows (X and Y MAX_R rows on) takes every chunk right after the first, from L1: for 9-16
 * rows the weights then stream from memory in one pass of one group's pattern, which measured faster than a
 * second group passing over each block from L2 with grouped panels (docs/performance.md). */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *P, int64_t q0, int G, int64_t pstride,
                                                            int I2, const uint32_t *X, int64_t ldx2, int R, int R2,
                                                            int NB, float *Y, int64_t ldy, int64_t valid, Fetch f) {
    const int64_t step = 32 * (int64_t)G; /* elements */
    const uint16_t *panel[8];
    UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) panel[b] = panel_at(P, q0 + b, 2 * pstride, G);
    const Fetch none = {0, 0, 1, 0};
    int countdown = f.phase, unused = 0;
    for (int p0 = 0; p0 < I2; p0 += KCHUNK) {
        const int pe = I2 - p0 < KCHUNK ? I2 : p0 + KCHUNK;
        chunk_bf16(panel, step, p0, pe, X, ldx2, R, NB, Y, ldy, valid, &f, &countdown);
        if (R2)
            chunk_bf16(panel, step, p0, pe, X + MAX_R * ldx2, ldx2, R2, NB, Y + MAX_R * ldy, ldy, valid, &none,
                       &unused);
    }
}

#ifdef CASTSPEC_AVX2
/* The same tile on 256-bit vectors (csrc/avx2.h's build), with the rows' inputs widened to fp32 beforehand
 * (XW [rows, I]; gemm_bf16_f32). Each 64-byte line of a panel is two halves of 8 columns x 2 inputs, split once
 * into its odd and even bf16 elements widened to fp32, so that every step is two fused multiply-adds per
 * accumulator, odd element first: the operations and the order of _mm512_dpbf16_ps there, without splitting a
 * weight once per row or an input once per panel. */
static inline __attribute__((always_inline)) void tile_bf16_avx2(const uint16_t *P, int64_t pstride, int I2,
                                                                 const float *XW, int64_t ldx, int R, int NB,
                                                                 float *Y, int64_t ldy, int64_t valid, Fetch f) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    int countdown = f.phase;
    for (int p0 = 0; p0 < I2; p0 += KCHUNK) {
        const int pe = I2 - p0 < KCHUNK ? I2 : p0 + KCHUNK;
        __m256 acc[MAX_R][4][2];
        UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
            UNROLL_LOOP(4) for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
        for (int p = p0; p < pe; ++p) {
            __m256 we[4][2], wo[4][2];
            const int now = fetch_next_now(&f, &countdown);
            UNROLL_LOOP(4) for (int b = 0; b < NB; ++b) {
                const uint16_t *line = P + b * pstride + (int64_t)p * 32;
                UNROLL_LOOP(2) for (int h = 0; h < 2; ++h) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(line + 16 * h));
                    we[b][h] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                    wo[b][h] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
                }
                fetch_lines(&f, line, sizeof(uint16_t), 64, now);
            }
            UNROLL_LOOP(8) for (int r = 0; r < R; ++r) {
                const __m256 xe = _mm256_broadcast_ss(XW + r * ldx + 2 * p);
                const __m256 xo = _mm256_broadcast_ss(XW + r * ldx + 2 * p + 1);
                UNROLL_LOOP(4) for (int b = 0; b < NB; ++b)
                    UNROLL_LOOP(2) for (int h = 0; h < 2; ++h)
                        acc[r][b][h] = _mm256_fmadd_ps(we[b][h], xe, _mm256_fmadd_ps(wo[b][h], xo, acc[r][b][h]));
            }
        }
        UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
            UNROLL_LOOP(4) for (int b = 0; b < NB; ++b)
                if (valid > 16 * b) {
                    const __mmask16 k = lanes(valid, 16 * b);
                    float *y = Y + r * ldy + 16 * b;
                    const __m512 sum = {acc[r][b][0], acc[r][b][1]};
                    _mm512_mask_storeu_ps(y, k, p0 ? _mm512_add_ps(_mm512_maskz_loadu_ps(k, y), sum) : sum);
                }
    }
}
#endif

static inline __attribute__((always_inline)) void tile_f32(const float *P, int64_t pstride, int I,
                                                           const float *X, int64_t ldx, int R, int NB, float *Y,
                                                           int64_t ldy, int64_t valid, Fetch f) {
    int countdown = f.phase;
    __m512 acc[MAX_R][8];
    UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int i = 0; i < I; ++i) {
        __m512 w[8];
        const int now = fetch_next_now(&f, &countdown);
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) {
            const float *line = P + b * pstride + (int64_t)i * 16;
            w[b] = _mm512_loadu_ps(line);
            fetch_lines(&f, line, sizeof(float), 64, now);
        }
        UNROLL_LOOP(8) for (int r = 0; r < R; ++r) {
            const __m512 x = _mm512_set1_ps(X[r * ldx + i]);
            UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(w[b], x, acc[r][b]);
        }
    }
    UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b)
            if (valid > 16 * b) _mm512_mask_storeu_ps(Y + r * ldy + 16 * b, lanes(valid, 16 * b), acc[r][b]);
}

#ifdef CASTSPEC_AVX512
/* The scales of an int8 product: one per input row (rows) and one per output column (cols), and the columns'
 * sums of weights (sums; the AVX-512 VNNI tiles' correction), each from the product's first row or column. */
typedef struct {
    const float *rows, *cols;
    const int32_t *sums;
} Scales;

#define VNNI __attribute__((target("avx512vnni")))
/* The int8 tile on AVX-512 VNNI (CPUs without AMX): VPDPBUSD multiplies unsigned by signed bytes, so each input
 * quad goes in as x + 128 (its sign bit flipped) and the sums come out 128 x the column's weight sum too many,
 * which is taken off: integer sums, exactly those of AMX's TDPBSSD, then scaled as gemm_amx scales them. Each
 * step along I loads one 64-byte line per panel (16 columns x 4 inputs, the packed layout; panels q0 on of P,
 * in groups of G as the bf16 ones) and one quad per row. */
static inline __attribute__((always_inline)) VNNI void tile_i8(const int8_t *P, int64_t q0, int G, int64_t pstride,
                                                               int I4, const int32_t *X, int64_t ldx4, int R,
                                                               int NB, float *Y, int64_t ldy, int64_t valid,
                                                               Scales q, Fetch f) {
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);
    const int64_t step = 64 * (int64_t)G; /* bytes */
    const int8_t *panel[8];
    UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) panel[b] = panel_at(P, q0 + b, pstride, G);
    int countdown = f.phase;
    __m512i acc[MAX_R][8];
    UNROLL_LOOP(8) for (int r = 0; r < R; ++r)
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_si512();
    for (int p = 0; p < I4; ++p) {
        __m512i w[8];
        const int now = fetch_next_now(&f, &countdown);
        UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) {
            const int8_t *line = panel[b] + (int64_t)p * step;
            w[b] = _mm512_loadu_si512(line);
            fetch_lines(&f, line, 1, step, now);
        }
        UNROLL_LOOP(8) for (int r = 0; r < R; ++r) {
            const __m512i x = _mm512_xor_si512(_mm512_set1_epi32(X[r * ldx4 + p]), flip);
            UNROLL_LOOP(8) for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], x, w[b]);
        }
    }
    UNROLL_LOOP(8) for (int b = 0; b < NB; ++b)
        if (valid > 16 * b) {
            const __mmask16 k = lanes(valid, 16 * b);
            const __m512i extra = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(k, q.sums + 16 * b), 7);
            const __m512 cols = _mm512_maskz_loadu_ps(k, q.cols + 16 * b);
            UNROLL_LOOP(8) for (int r = 0; r < R; ++r) {
                const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], extra));
                _mm512_mask_storeu_ps(Y + r * ldy + 16 * b, k,
                                      _mm512_mul_ps(_mm512_mul_ps(sums, _mm512_set1_ps(q.rows[r])), cols));
            }
        }
}
#endif

/* Panels [0, np) of a block for R rows: tiles NB wide, then the rest in tiles of 4, 2 and 1 (np - b < NB). */
#define SWEEP(TILE, R, NB)                                                 \
    do {                                                                   \
        int b = 0;                                                         \
        for (; b + (NB) <= np; b += (NB)) TILE(R, NB, b);                  \
        if ((NB) > 4 && np - b >= 4) { TILE(R, 4, b); b += 4; }            \
        if ((NB) > 2 && np - b >= 2) { TILE(R, 2, b); b += 2; }            \
        if (np - b >= 1) TILE(R, 1, b);                                    \
    } while (0)

#ifdef CASTSPEC_AVX2
/* Tile widths per row count: 8 accumulators of 256 bits (two per row and panel), plus the widened weights and
 * inputs, in 16 registers. */
#define ROWS(TILE, R)                      \
    switch (R) {                           \
    case 4: SWEEP(TILE, 4, 1); break;      \
    case 3: SWEEP(TILE, 3, 1); break;      \
    case 2: SWEEP(TILE, 2, 2); break;      \
    default: SWEEP(TILE, 1, 4); break;     \
    }
#else
/* Tile widths per row count: one group of PANEL_GROUP panels (one stream of lines, up to 24 accumulators),
 * which measured faster than two groups from 2 rows on (one row: level either way, and it keeps two). */
#define ROWS(TILE, R)                      \
    switch (R) {                           \
    case 8: SWEEP(TILE, 8, 3); break;      \
    case 7: SWEEP(TILE, 7, 3); break;      \
    case 6: SWEEP(TILE, 6, 3); break;      \
    case 5: SWEEP(TILE, 5, 3); break;      \
    case 4: SWEEP(TILE, 4, 3); break;      \
    case 3: SWEEP(TILE, 3, 3); break;      \
    case 2: SWEEP(TILE, 2, 3); break;      \
    default: SWEEP(TILE, 1, 6); break;     \
    }
#endif

/* The threads take the panels a unit at a time (share.h: a unit of UNIT panels, or with several row groups a
 * block), and every group of up to MAX_R rows passes over a unit while it is in cache, so the weights stream
 * from memory once whatever M is. The first group fetches its lines ahead; with several groups, every group also
 * fetches its share of the next block's lines into L2 (the block its thread most likely takes next: the next one
 * of its share), so that the stream overlaps all of the compute, and blocks are smaller (BLOCK_BYTES). The order
 * of work changes no bits: every output sums the same steps in the same order. TILE(R, NB, b) sees blk, m0,
 * fetch. */
#define PRODUCT(TILE, panel_bytes)                                                                       \
    PRODUCT_ROWS(TILE, panel_bytes, M, ROWS,                                                             \
                 M >= PREFETCH_WIDE_ROWS && M <= MAX_R ? PREFETCH_LINES_WIDE : PREFETCH_LINES)
/* PRODUCT as if the product had MR rows, its groups' tiles chosen by WIDTHS(TILE, R) (gemm_bf16_f32's pairs pass
 * as one group of MAX_R), fetching LINES steps ahead. */
#define PRODUCT_ROWS(TILE, panel_bytes, MR, WIDTHS, LINES)                                                \
    const int panels = (O + 15) / 16, groups = ((MR) + MAX_R - 1) / MAX_R;                                \
    const int ahead = (MR) >= PREFETCH_MIN_ROWS ? (LINES) : 0;                                            \
    int block = UNIT;                                                                                     \
    if (groups > 1) {                                                                                     \
        block = (int)(BLOCK_BYTES / (panel_bytes)) / 3 * 3; /* whole 8-row tiles */                       \
        block = block < 3 ? 3 : block > BLOCK ? BLOCK : block;                                            \
    }                                                                                                     \
    const int nt = omp_get_max_threads();                                                                 \
    Share shares[nt];                                                                                     \
    shares_init(shares, nt, (panels + block - 1) / block);                                                \
    _Pragma("omp parallel num_threads(nt)") {                                                             \
        for (int u, e; (u = shares_take(shares, nt, omp_get_thread_num(), &e)) >= 0;)                     \
        for (int blk = u * block; blk < e * block && blk < panels; blk += block) {                        \
            const int np = panels - blk < block ? panels - blk : block;                                   \
            const int64_t next = FETCH_NEXT && groups > 1 && blk + block < panels ? (int64_t)block * pstride : 0; \
            for (int g = 0; g < groups; ++g) {                                                            \
                const int m0 = g * MAX_R, R = (MR) - m0 < MAX_R ? (MR) - m0 : MAX_R;                      \
                if ((g == 0 && ahead) || next) {                                                          \
                    const Fetch fetch = {g == 0 ? ahead : 0, next, groups, g};                            \
                    WIDTHS(TILE, R)                                                                       \
                } else { /* a copy without the fetches' tests (TILE inlines a constant) */                \
                    const Fetch fetch = {0, 0, 1, 0};                                                     \
                    WIDTHS(TILE, R)                                                                       \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

#ifdef CASTSPEC_AVX512
int gemm_panel_group(void);

/* gemm_i8_f32 on AVX-512 VNNI tiles, through PRODUCT as the bf16 products (P packed in groups of
 * gemm_panel_group() panels). */
VNNI static void gemm_i8_vnni(const int8_t *P, const float *wscale, const int32_t *wsum, const int8_t *X,
                              const float *xscale, float *Y, int M, int O, int I, int ldx, int ldy) {
    const int64_t pstride = (int64_t)16 * I; /* bytes per panel */
    const int32_t *X4 = (const int32_t *)X;
    const int G = gemm_panel_group();
#define TILE_I8(R, NB, b)                                                                                    \
    tile_i8(P, blk + (b), G, pstride, I / 4, X4 + (int64_t)m0 * (ldx / 4), ldx / 4, R, NB,                    \
            Y + (int64_t)m0 * ldy + (int64_t)(blk + (b)) * 16, ldy, (int64_t)O - (int64_t)(blk + (b)) * 16,   \
            (Scales){xscale + m0, wscale + (int64_t)(blk + (b)) * 16, wsum + (int64_t)(blk + (b)) * 16}, fetch)
    PRODUCT(TILE_I8, 16 * (int64_t)I)
#undef TILE_I8
}
#endif

#ifdef CASTSPEC_AVX512
/* AMX (Intel's tile unit), where the CPU has it: one TDPBF16PS multiplies 16 rows x 32 inputs by a 32 x 16 block
 * of weights, which is exactly 16 consecutive k-pairs of a packed panel (1 KiB, rows of 64 bytes). Rows go in
 * groups of 16: a product of fewer rows runs on tiles of its rows alone (amx_configure_rows), and in one of more
 * rows a last group with fewer is padded with zero rows; either way a row's sums are the same instructions' and
 * never depend on the others. Tiles 0-3 hold sums (amx_groups1/2 say whose), 4-7 inputs and weights. Beyond 16
 * rows the caller pads X with zero rows to whole groups (layer.h's product). */
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether bf16 products use AMX: decided once when the library is loaded (gemm_use_amx), for every product of
 * the process alike, since a row's bits differ between AMX and AVX-512 tiles. */
static int amx_on;

/* Asks Linux for the tile state (AMX's registers are off until a process asks); 1 if AMX is now in use. */
int gemm_use_amx(int want) {
    amx_on = want && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_on;
}

int gemm_amx_on(void) { return amx_on; }

#ifndef AMX_AHEAD
#define AMX_AHEAD 2048 /* bytes: two steps of a panel */
#endif

/* C tile `t`, the sums of group `g` (rows 16 * g on) for panel `pn`: straight into Y for a whole tile's rows (16,
 * or all of a product's fewer rows) of 16 valid columns, else through a buffer. With `q` (int8 products), the
 * tile holds int32 sums, which leave through the buffer as fp32, each times its row's scale and then its
 * column's. */
#define AMX_STORE(t, g, pn)                                                                             \
    do {                                                                                                \
        const int m0 = 16 * (g), R = M - m0 < 16 ? M - m0 : 16;                                          \
        float *y = Y + (int64_t)m0 * ldy + (int64_t)(pn) * 16;                                          \
        const int64_t valid = (int64_t)O - (int64_t)(pn) * 16;                                          \
        if (!q && R == tile_rows && valid >= 16) {                                                      \
            _tile_stored(t, y, ldy * 4);                                                                \
        } else {                                                                                        \
            _tile_stored(t, buf, 64);                                                                   \
            __asm__ volatile("" ::: "memory"); /* the tile store is asm the compiler cannot see into */ \
            for (int r = 0; r < R; ++r) {                                                               \
                __m512 v = _mm512_loadu_ps(buf + 16 * r);                                               \
                if (q)                                                                                  \
                    v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(v)),         \
                                                    _mm512_set1_ps(q->rows[m0 + r])),                   \
                                      _mm512_maskz_loadu_ps(lanes(valid, 0), q->cols + (int64_t)(pn) * 16)); \
                _mm512_mask_storeu_ps(y + r * ldy, lanes(valid, 0), v);                                 \
            }                                                                                           \
        }                                                                                               \
    } while (0)

/* Fetches the weights AMX_AHEAD bytes past step wk of nb panels (stride bytes apart) into L1. */
#define AMX_FETCH(wk, nb, stride)                                                                       \
    for (int b = 0; b < (nb); ++b)                                                                      \
        for (int l = 0; l < 16; ++l) _mm_prefetch((wk) + b * (stride) + AMX_AHEAD + 64 * l, _MM_HINT_T0)

/* C tile c += input tile x . weight tile w: bf16 pairs into fp32 sums, or (i8) int8 quads into int32 sums. */
#define AMX_DP(i8, c, x, w)              \
    do {                                 \
        if (i8) _tile_dpbssd(c, x, w);   \
        else _tile_dpbf16ps(c, x, w);    \
    } while (0)

/* The shapes of one step along the block's panels: all four C tiles (C0-C3) hold sums, so one group of 16
 * rows takes 4 panels a step and two groups (pair) 2 panels, C0/C1 the first group's and C2/C3 the second's.
 * Every weight tile loaded is used by both groups of a pair, so for up to 32 rows the weights stream from
 * memory once, overlapped with all of the compute (a second group that ran after the first, over the block in
 * cache, left the memory stream idle meanwhile). Each step along I takes 64 bytes of every input row and a 1 KiB
 * tile of each panel (32 bf16 inputs, or 64 int8 ones when i8). Each C tile sums along I from zero in the same
 * order whatever the shape: no bits depend on it. `fetch`: whether this step streams the weights from memory
 * (the first groups over a block), fetching ahead. */
static inline __attribute__((always_inline)) AMX void amx_groups(const char *w, int64_t pstride, int nb,
                                                                 const char *a, int64_t lda, int steps, int fetch,
                                                                 int pair, int i8) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int s = 0; s < steps; ++s) {
        const char *wk = w + (int64_t)s * 1024;
        if (fetch) AMX_FETCH(wk, nb, pstride);
        _tile_loadd(4, a + 64 * s, lda);
        if (pair) {
            _tile_loadd(5, a + 16 * lda + 64 * s, lda);
            _tile_loadd(6, wk, 64);
            AMX_DP(i8, 0, 4, 6);
            AMX_DP(i8, 2, 5, 6);
            if (nb > 1) { _tile_loadd(7, wk + pstride, 64); AMX_DP(i8, 1, 4, 7); AMX_DP(i8, 3, 5, 7); }
        } else {
            _tile_loadd(5, wk, 64);
            AMX_DP(i8, 0, 4, 5);
            if (nb > 1) { _tile_loadd(6, wk + pstride, 64); AMX_DP(i8, 1, 4, 6); }
            if (nb > 2) { _tile_loadd(7, wk + 2 * pstride, 64); AMX_DP(i8, 2, 4, 7); }
            if (nb > 3) { _tile_loadd(5, wk + 3 * pstride, 64); AMX_DP(i8, 3, 4, 5); }
        }
    }
}

/* P: packed panels, X: inputs (lda bytes a row; beyond 16 rows in whole groups of 16), both bf16, or both int8
 * with q. */
AMX static void gemm_amx(const void *P, const void *X, int64_t lda, float *Y, int M, int O, int I, int ldy,
                         const Scales *q) {
    const int esz = q ? 1 : 2, steps = I * esz / 64;
    const int64_t pstride = (int64_t)16 * I * esz; /* bytes per panel */
    const int groups = (M + 15) / 16, panels = (O + 15) / 16;
    if (M <= 0) return; /* no rows (a prompt chunk whose logits nobody reads): a tile of no rows cannot be set */
    const int tile_rows = M < 16 ? M : 16; /* one row group of fewer than 16 rows: tiles of its rows alone */
    /* units of work (share.h): a step of one group (4 panels) or two of a pair; with more than one pair, 8
     * panels, which every pair multiplies while they are in cache */
    const int unit = groups > 2 ? 8 : 4, nt = omp_get_max_threads();
    Share shares[nt];
    shares_init(shares, nt, (panels + unit - 1) / unit);
    _Pragma("omp parallel num_threads(nt)") {
        float buf[16 * 16];
        if (tile_rows < 16) amx_configure_rows(tile_rows);
        else amx_configure();
        for (int u, e; (u = shares_take(shares, nt, omp_get_thread_num(), &e)) >= 0;)
        for (int blk = u * unit; blk < e * unit && blk < panels; blk += unit) {
            const int bend = panels - blk < unit ? panels : blk + unit;
            /* groups in pairs: the first pair streams the unit from memory, later ones (more than 32 rows)
             * read it again from cache (pairs measured faster than sets of 3-4 groups sharing one weight tile,
             * whose inputs' loads then outweigh the weights') */
            for (int g0 = 0; g0 < groups; g0 += 2) {
                const int pair = groups - g0 > 1, step = pair ? 2 : 4, fetch = g0 == 0;
                const char *a = (const char *)X + 16 * g0 * lda;
                for (int panel = blk; panel < bend; panel += step) {
                    const int nb = bend - panel < step ? bend - panel : step;
                    const char *w = (const char *)P + (int64_t)panel * pstride;
                    if (pair) {
                        if (q) amx_groups(w, pstride, nb, a, lda, steps, fetch, 1, 1);
                        else amx_groups(w, pstride, nb, a, lda, steps, fetch, 1, 0);
                        AMX_STORE(0, g0, panel);
                        AMX_STORE(2, g0 + 1, panel);
                        if (nb > 1) { AMX_STORE(1, g0, panel + 1); AMX_STORE(3, g0 + 1, panel + 1); }
                    } else {
                        if (q) amx_groups(w, pstride, nb, a, lda, steps, fetch, 0, 1);
                        else amx_groups(w, pstride, nb, a, lda, steps, fetch, 0, 0);
                        AMX_STORE(0, g0, panel);
                        if (nb > 1) AMX_STORE(1, g0, panel + 1);
                        if (nb > 2) AMX_STORE(2, g0, panel + 2);
                        if (nb > 3) AMX_STORE(3, g0, panel + 3);
                    }
                }
            }
        }
        _tile_release();
    }
}

/* Int8 products (a drafter's, where the CPU has AMX-INT8 or AVX-512 VNNI; native/forward.py): Y[M, O] =
 * (X . W^T) * xscale[row] * wscale[column], X [M, I] int8 (I a multiple of 64; beyond 16 rows followed by zero
 * rows up to a multiple of 16), W packed [O/16/G][I/4][G][16][4] (the quads of inputs TDPBSSD and VPDPBUSD
 * multiply, in groups of G = gemm_panel_group() panels; native/pack.py) with one fp32 scale and one weight sum
 * (wsum) per column. The sums are integers, exact in any
 * order and on either unit, so a row's result depends only on that row, and is the same on AMX and on AVX-512
 * VNNI. */
void gemm_i8_f32(const int8_t *P, const float *wscale, const int32_t *wsum, const int8_t *X, const float *xscale,
                 float *Y, int M, int O, int I, int ldx, int ldy) {
    if (amx_on) {
        const Scales q = {xscale, wscale, wsum};
        gemm_amx(P, X, ldx, Y, M, O, I, ldy, &q);
        return;
    }
    gemm_i8_vnni(P, wscale, wsum, X, xscale, Y, M, O, I, ldx, ldy);
}
#else
int gemm_use_amx(int want) { (void)want; return 0; }
int gemm_amx_on(void) { return 0; }
void gemm_i8_f32(const int8_t *P, const float *wscale, const int32_t *wsum, const int8_t *X, const float *xscale,
                 float *Y, int M, int O, int I, int ldx, int ldy) {
    (void)P, (void)wscale, (void)wsum, (void)X, (void)xscale, (void)Y, (void)M, (void)O, (void)I, (void)ldx, (void)ldy;
    abort(); /* never called: native/build.py offers int8 products only in the avx512 build */
}
#endif

/* Panels per group of the bf16 layout the products read now (pack.py packs in it): 1 where they use AMX. */
int gemm_panel_group(void) { return gemm_amx_on() ? 1 : PANEL_GROUP; }

/* X: M rows of bf16 (stride ldx, even) entering the product, beyond 16 rows followed by zero rows up to a
 * multiple of 16 (the AMX path reads whole groups there); Y: their fp32 sums. P: packed in groups of
 * gemm_panel_group() panels. */
void gemm_bf16_f32(const uint16_t *P, const uint16_t *X, float *Y, int M, int O, int I, int ldx, int ldy) {
#ifdef CASTSPEC_AVX512
    if (amx_on && I % 32 == 0) {
        gemm_amx(P, X, (int64_t)ldx * 2, Y, M, O, I, ldy, NULL);
        return;
    }
#endif
    const int64_t pstride = (int64_t)16 * I; /* elements per panel */
#ifdef CASTSPEC_AVX2
    float *XW = malloc(sizeof(float) * ((size_t)M * I + 16)); /* the inputs as fp32 (exact) */
    if (!XW) abort();
    for (int r = 0; r < M; ++r)
        for (int i = 0; i < I; i += 16) {
            const __mmask16 k = lanes(I, i);
            _mm512_mask_storeu_ps(XW + (int64_t)r * I + i, k, widen(_mm256_maskz_loadu_epi16(k, X + (int64_t)r * ldx + i)));
        }
#define TILE_BF16(R, NB, b)                                                                                 \
    tile_bf16_avx2(P + (int64_t)(blk + (b)) * pstride, pstride, I / 2, XW + (int64_t)m0 * I, I, R, NB,        \
                   Y + (int64_t)m0 * ldy + (int64_t)(blk + (b)) * 16, ldy, (int64_t)O - (int64_t)(blk + (b)) * 16, fetch)
    PRODUCT(TILE_BF16, 32 * (int64_t)I)
#undef TILE_BF16
    free(XW);
#else
    const uint32_t *X2 = (const uint32_t *)X;
    const int G = gemm_panel_group();
#define TILE_BF16_2(R, R2, NB, b)                                                                             \
    tile_bf16(P, blk + (b), G, pstride, I / 2, X2 + (int64_t)m0 * (ldx / 2), ldx / 2, R, R2, NB,              \
              Y + (int64_t)m0 * ldy + (int64_t)(blk + (b)) * 16, ldy, (int64_t)O - (int64_t)(blk + (b)) * 16, fetch)
#define TILE_BF16(R, NB, b) TILE_BF16_2(R, 0, NB, b)
/* 9-16 rows: pairs of a group of 8 and one of M - 8 (tile_bf16) */
#define TILE_PAIR(R, NB, b)                                                                                 \
    switch (M - MAX_R) {                                                                                    \
    case 8: TILE_BF16_2(R, 8, NB, b); break;                                                                \
    case 7: TILE_BF16_2(R, 7, NB, b); break;                                                                \
    case 6: TILE_BF16_2(R, 6, NB, b); break;                                                                \
    case 5: TILE_BF16_2(R, 5, NB, b); break;                                                                \
    case 4: TILE_BF16_2(R, 4, NB, b); break;                                                                \
    case 3: TILE_BF16_2(R, 3, NB, b); break;                                                                \
    case 2: TILE_BF16_2(R, 2, NB, b); break;                                                                \
    default: TILE_BF16_2(R, 1, NB, b); break;                                                               \
    }
#define PAIR_WIDTHS(TILE, R) \
    (void)(R);               \
    SWEEP(TILE, MAX_R, 3);
    if (M > MAX_R && M <= 2 * MAX_R) {
        PRODUCT_ROWS(TILE_PAIR, 32 * (int64_t)I, MAX_R, PAIR_WIDTHS, PREFETCH_LINES_PAIRS)
    } else {
        PRODUCT(TILE_BF16, 32 * (int64_t)I)
    }
#undef PAIR_WIDTHS
#undef TILE_PAIR
#undef TILE_BF16
#undef TILE_BF16_2
#endif
}

void gemm_f32(const float *P, const float *X, float *Y, int M, int O, int I, int ldx, int ldy) {
    const int64_t pstride = (int64_t)16 * I;
#define TILE_F32(R, NB, b)                                                                              \
    tile_f32(P + (int64_t)(blk + (b)) * pstride, pstride, I, X + (int64_t)m0 * ldx, ldx, R, NB,           \
             Y + (int64_t)m0 * ldy + (int64_t)(blk + (b)) * 16, ldy, (int64_t)O - (int64_t)(blk + (b)) * 16, fetch)
    PRODUCT(TILE_F32, 64 * (int64_t)I)
#undef TILE_F32
}
