/* Attention on AMX tiles (layer.h's attention() where gemm.c uses AMX: a bf16 model, head_dim a multiple of 64),
 * for every forward of the process alike: a decode step, a packed tree, a prompt chunk, several requests' rows.
 *
 * Why: scores and the values' weighted sum are 2 * head_dim multiply-adds per head and key. In fp32 vectors
 * (attend_heads) a tree of 16 rows over a 512-token prefix spends more time there than in its products; one
 * TDPBF16PS multiplies 16 query heads by 16 keys over 32 dimensions at once.
 *
 * Accuracy: keys and values are bf16 in the cache already. Queries and softmax weights are fp32; each enters the
 * tiles as two bf16 terms, hi = bf16(x) and lo = bf16(x - hi) (x to about 16 significant bits), and products of
 * bf16 values are exact in the fp32 sums, so scores and outputs stay close to the fp32 path's.
 *
 * Rows sharing a cache (a tree's rows, a prompt chunk's) are taken in blocks of up to 16 query heads that share
 * a key/value head: each key's tiles are built once per block and used by all of its heads. Every head's
 * arithmetic is nonetheless that of the head alone: a C tile element depends only on its own query row and key
 * column, every head walks its visible keys (its compact list, RowAttn) in chunks of 32 aligned at the list's
 * start, and the chunks every row of a block sees at the same place (whole chunks of its leading run of slots
 * 0, 1, 2, ...; for rows that each see slots 0, 1, 2, ... up to their own end, as a prompt chunk's, every chunk up
 * to the longest one's end, each row's keys past its own end weighted zero) are merely computed for all of them
 * at once, the rest row by row on the same instructions. So a row's bits are the same alone or in any block,
 * and a tree row's are the decode step's at its position.
 */
#ifndef CASTSPEC_ATTN_AMX_H
#define CASTSPEC_ATTN_AMX_H

/* One thread's scratch for attend_block_amx, for rows of up to S32 keys (a multiple of 32). */
typedef struct {
    float *s;       /* [16, S32] scores, then exp */
    uint16_t *p;    /* [2, 16, S32] exp as hi | lo bf16 */
    uint16_t *qa;   /* [2, 16, d] the queries as hi | lo bf16 */
    uint16_t *kt;   /* [d / 32, 16, 32] a gathered group's key tiles */
    uint16_t *vp;   /* [16, 128] a gathered chunk's value tiles (64 columns) */
    uint16_t *kts;  /* [S32 / 16][d / 32, 16, 32] the key tiles of the cache's leading groups (TileCache) */
    uint16_t *vps;  /* [S32 / 32][d / 64][16, 128] the value tiles of its leading chunks */
    uint16_t *rows; /* [32, d] gathered keys or values */
    float *cb;      /* [16, 64] sums after the joint chunks */
    float *tmp;     /* [16, 64] a tile's sums */
} AmxAttnScratch;

/* That scratch taken from `a` (layer.h's Arena: an empty one measures it). */
static AmxAttnScratch amx_attn_scratch(Arena *a, int S32, int d) {
    AmxAttnScratch w;
    w.s = take(a, sizeof(float) * 16 * (size_t)S32);
    w.p = take(a, sizeof(uint16_t) * 32 * (size_t)S32);
    w.qa = take(a, sizeof(uint16_t) * 32 * (size_t)d);
    w.kt = take(a, sizeof(uint16_t) * 16 * (size_t)d);
    w.vp = take(a, sizeof(uint16_t) * 16 * 128);
    w.kts = take(a, sizeof(uint16_t) * (size_t)S32 * d);
    w.vps = take(a, sizeof(uint16_t) * (size_t)S32 * d);
    w.rows = take(a, sizeof(uint16_t) * 32 * (size_t)d);
    w.cb = take(a, sizeof(float) * 16 * 64);
    w.tmp = take(a, sizeof(float) * 16 * 64);
    return w;
}

/* Floats per thread of that scratch (whole cache lines, so that each thread's starts on one). */
static inline int64_t amx_attn_floats(int S32, int d) {
    Arena a = {NULL, 0};
    amx_attn_scratch(&a, S32, d);
    return (int64_t)(a.used / sizeof(float));
}

/* Which tiles of kts / vps hold what: those of the key/value head at K (one layer's, one head's slots) for its
 * first `keys` groups of 16 slots and first `values` chunks of 32. A thread's blocks of the same cache and head
 * (a tree's 16 rows are four blocks of five) read the prefix through these instead of transposing it again. */
typedef struct {
    const uint16_t *K;
    int keys, values;
} TileCache;

#ifdef CASTSPEC_AVX512

#include "amx.h"
#include "model.h"
#include "share.h"

/* How many leading keys of a row are slots 0, 1, 2, ...: its list ascends through distinct slots, so keys[j] ==
 * j holds exactly for j below that count (binary search). */
static int leading_run(const RowAttn *a) {
    if (!a->keys) return a->n;
    int lo = 0, hi = a->n; /* keys[j] == j for j < lo; keys[j] != j for j >= hi */
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (a->keys[mid] == mid) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* A 16 x 16 transpose of 32-bit elements in registers: r[i] lane j -> r[j] lane i. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* u[4i + k], 128-bit block L: rows 4i..4i+3 of column 4L + k */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; ++k) {
        const __m512i xl = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), xh = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
        const __m512i yl = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44),
                      yh = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_i32x4(xl, yl, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(xl, yl, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(xh, yh, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(xh, yh, 0xDD);
    }
}

/* The B tiles of 16 keys (rows of d bf16, `stride` elements apart) for the scores: per 32 dimensions s, 16 rows
 * of dimension pairs x 16 keys x 2 (kt + 512 * s). */
static inline void keys_tiles(const uint16_t *k, int64_t stride, int d, uint16_t *kt) {
    for (int s = 0; s < d / 32; ++s) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(k + j * stride + 32 * s);
        transpose16(r);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt + 512 * s + 32 * p, r[p]);
    }
}

/* The B tiles of 32 values (rows of d bf16, `stride` elements apart), columns [c0, c0 + 64): 16 rows of key
 * pairs x 64 columns x 2 (vp; column block k's tile starts at vp + 32 * k, rows 128 elements apart). */
static inline void value_tiles(const uint16_t *v, int64_t stride, int c0, uint16_t *vp) {
    static const uint16_t pairs[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(pairs); /* lane 2i: a[i], lane 2i + 1: b[i] */
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < 16; ++p)
        for (int h = 0; h < 2; ++h) { /* columns c0 + 32h .. + 32 */
            const __m512i a = _mm512_loadu_si512(v + (2 * p) * stride + c0 + 32 * h);
            const __m512i b = _mm512_loadu_si512(v + (2 * p + 1) * stride + c0 + 32 * h);
            _mm512_storeu_si512(vp + 128 * p + 64 * h, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + 128 * p + 64 * h + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* Fetches n rows of d bf16 (consecutive) into the cache level `hint`. */
#define fetch_rows(p, n, d, hint)                                                                           \
    for (int64_t b_ = 0; b_ < (int64_t)(n) * (d) * 2; b_ += 64) _mm_prefetch((const char *)(p) + b_, hint)

/* Rows [j0, j0 + w) of a row's compact key list copied into `w16` consecutive rows of d (zeros past the list's
 * end n): the keys (or values) of a chunk that is not a run of consecutive slots. */
static void gather_rows(const uint16_t *base, const RowAttn *a, int j0, int w16, int d, uint16_t *out) {
    for (int j = 0; j < w16; ++j) {
        uint16_t *o = out + (int64_t)j * d;
        if (j0 + j < a->n) memcpy(o, base + (int64_t)(a->keys ? a->keys[j0 + j] : j0 + j) * d, 2 * (size_t)d);
        else memset(o, 0, 2 * (size_t)d);
    }
}

/* C tile 0 = scores of the block's 16 query rows (qa, hi and lo) against the 16 keys of kt, summed in one order
 * (per 32 dimensions: hi, then lo). */
AMX static inline void score_tile(const AmxAttnScratch *w, const uint16_t *kt, int d) {
    __asm__ volatile("" ::: "memory"); /* tile loads are asm that names no memory: the tiles' stores land first */
    _tile_zero(0);
    for (int s = 0; s < d / 32; ++s) {
        _tile_loadd(4, w->qa + 32 * s, 2 * d);
        _tile_loadd(5, w->qa + 16 * d + 32 * s, 2 * d);
        _tile_loadd(6, kt + 512 * s, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 6);
    }
}

/* C tiles 0-3 += weights of chunk c (keys 32c .. 32c + 32 of every row of p, hi then lo) x the value tiles vp. */
AMX static inline void weigh_tile(const AmxAttnScratch *w, const uint16_t *vp, int S32, int c) {
    __asm__ volatile("" ::: "memory");
    _tile_loadd(4, w->p + 32 * c, 2 * S32);
    _tile_loadd(5, w->p + 16 * (int64_t)S32 + 32 * c, 2 * S32);
    for (int k = 0; k < 4; ++k) {
        _tile_loadd(6, vp + 32 * k, 256);
        switch (k) { /* tile numbers are immediates */
        case 0: _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6); break;
        case 1: _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(1, 5, 6); break;
        case 2: _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6); break;
        default: _tile_dpbf16ps(3, 4, 6); _tile_dpbf16ps(3, 5, 6); break;
        }
    }
}

AMX static inline void store_sums(float *to) {
    _tile_stored(0, to, 256);
    _tile_stored(1, to + 16, 256);
    _tile_stored(2, to + 32, 256);
    _tile_stored(3, to + 48, 256);
    __asm__ volatile("" ::: "memory"); /* tile stores are asm the compiler cannot see into */
}

AMX static inline void load_sums(const float *from) {
    __asm__ volatile("" ::: "memory");
    _tile_loadd(0, from, 256);
    _tile_loadd(1, from + 16, 256);
    _tile_loadd(2, from + 32, 256);
    _tile_loadd(3, from + 48, 256);
}

/* Where the value tiles of the cache's leading chunk c, columns [c0, c0 + 64), are kept (vps). */
static inline uint16_t *prefix_values(const AmxAttnScratch *w, int c, int c0, int d) {
    return w->vps + ((int64_t)c * (d / 64) + c0 / 64) * 2048;
}

/* Attention of `nb` rows (rows[0..nb), one cache) for the `G` query heads h0 .. h0 + G that share key/value head
 * `kvh` (nb * G <= 16): queries at q + r * ldq + h * d, outputs at out + r * nq + h * d. */
AMX static void attend_block_amx(const StepModel *m, const RowAttn *rows, int nb, int kvh, int G, int h0,
                                      const float *q, int64_t ldq, int S32, const AmxAttnScratch *w, TileCache *tc,
                                      float *out) {
    const int d = m->head_dim, nq = m->heads * d, Q = nb * G;
    const float scale = 1.f / sqrtf((float)d);
    const int64_t at = kvh * rows[0].head_stride;
    const uint16_t *K = (const uint16_t *)rows[0].K + at, *V = (const uint16_t *)rows[0].V + at;
    if (tc->K != K) *tc = (TileCache){K, 0, 0};
    /* Chunks of 32 keys computed for every row of the block at once. Where each row sees slots 0, 1, 2, ... up
     * to its own end (a prompt chunk's rows, a decode step): every chunk up to the longest row's end, read
     * straight from the cache up to its last whole chunk (`direct`), the rest gathered with zeros past that
     * end; a row's keys past its own end get zero weight and chunks past its own last add exact zeros to its
     * sums, so its bits are those of the row alone. Otherwise (a tree's rows): the whole chunks every row sees
     * as slots 0, 1, 2, ..., then each row's own. */
    int shared = INT32_MAX, pure = 1, longest = 0;
    for (int r = 0; r < nb; ++r) {
        const int run = leading_run(&rows[r]);
        if (run < rows[r].n) pure = 0;
        if (run / 32 < shared) shared = run / 32;
        if (rows[r].n > longest) longest = rows[r].n;
    }
    const int direct = pure ? longest / 32 : shared, joint = pure ? (longest + 31) / 32 : shared;
    const RowAttn upto = {rows[0].K, rows[0].V, rows[0].head_stride, longest, NULL}; /* slots [0, longest) */
    for (int i = 0; i < Q; ++i) { /* queries as hi | lo bf16 */
        const float *qi = q + (i / G) * ldq + (h0 + i % G) * d;
        for (int c = 0; c < d; c += 16) {
            const __m512 x = _mm512_loadu_ps(qi + c);
            const __m256i hi = narrow(x);
            _mm256_storeu_si256((__m256i *)(w->qa + i * d + c), hi);
            _mm256_storeu_si256((__m256i *)(w->qa + 16 * d + i * d + c), narrow(_mm512_sub_ps(x, widen(hi))));
        }
    }
    /* scores: the joint chunks for every query row, then each row's own */
    for (int g = 0; g < 2 * joint && 16 * g < longest; ++g) {
        const uint16_t *kt = w->kt;
        if (g < 2 * direct) {
            kt = w->kts + (int64_t)16 * g * d;
            if (g >= tc->keys) { /* groups are built in order: g == tc->keys */
                /* the keys two groups on into L1 and this group's values into L2 (the weighted sum reads them
                 * next): short streams that the hardware prefetcher, still ramping up, would leave to stall the
                 * tile loads */
                fetch_rows(K + (int64_t)16 * (g + 2) * d, g + 2 < 2 * direct ? 16 : 0, d, _MM_HINT_T0);
                fetch_rows(V + (int64_t)16 * g * d, 16, d, _MM_HINT_T1);
                keys_tiles(K + (int64_t)16 * g * d, d, d, w->kts + (int64_t)16 * g * d);
                tc->keys = g + 1;
            }
        } else {
            gather_rows(K, &upto, 16 * g, 16, d, w->rows);
            keys_tiles(w->rows, d, d, w->kt);
        }
        score_tile(w, kt, d);
        _tile_stored(0, w->s + 16 * g, 4 * S32);
    }
    for (int r = 0; r < nb; ++r)
        for (int g = 2 * joint; 16 * g < rows[r].n; ++g) {
            gather_rows(K, &rows[r], 16 * g, 16, d, w->rows);
            keys_tiles(w->rows, d, d, w->kt);
            score_tile(w, w->kt, d);
            _tile_stored(0, w->tmp, 64);
            __asm__ volatile("" ::: "memory");
            for (int i = r * G; i < (r + 1) * G; ++i) memcpy(w->s + (int64_t)i * S32 + 16 * g, w->tmp + 16 * i, 64);
        }
    __asm__ volatile("" ::: "memory");
    /* softmax of each query row over its n keys, as attend_heads_as: exp(score - max), its sum, in 16 lanes */
    float inv[16];
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < Q; ++i) {
        const int n = rows[i / G].n, n32 = (n + 31) & ~31;
        float *si = w->s + (int64_t)i * S32;
        uint16_t *hi = w->p + (int64_t)i * S32, *lo = w->p + 16 * (int64_t)S32 + (int64_t)i * S32;
        __m512 vmax = ninf;
        for (int c = 0; c < n; c += 16) {
            const __m512 sc = _mm512_mask_blend_ps(lanes(n, c), ninf, _mm512_mul_ps(_mm512_loadu_ps(si + c),
                                                                                  _mm512_set1_ps(scale)));
            _mm512_storeu_ps(si + c, sc);
            vmax = _mm512_max_ps(vmax, sc);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int c = 0; c < n32; c += 16) {
            const __mmask16 k = c < n ? lanes(n, c) : 0; /* past n up to the chunk's end: zero weights */
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(si + c), mx)));
            vsum = _mm512_add_ps(vsum, e);
            const __m256i h = narrow(e);
            _mm256_storeu_si256((__m256i *)(hi + c), h);
            _mm256_storeu_si256((__m256i *)(lo + c), narrow(_mm512_sub_ps(e, widen(h))));
        }
        if (32 * joint > n32) { /* joint chunks past this row's end: zero weights */
            memset(hi + n32, 0, sizeof(uint16_t) * (32 * (size_t)joint - n32));
            memset(lo + n32, 0, sizeof(uint16_t) * (32 * (size_t)joint - n32));
        }
        inv[i] = 1.f / _mm512_reduce_add_ps(vsum);
    }
    /* the values' weighted sum, 64 columns at a time: joint chunks for all, then each row's own */
    for (int c0 = 0; c0 < d; c0 += 64) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int c = 0; c < joint; ++c) {
            const uint16_t *vp = w->vp;
            if (c < direct) {
                vp = prefix_values(w, c, c0, d);
                if (c >= tc->values) { /* chunks are built in order, all their columns when first met */
                    for (int b0 = 0; b0 < d; b0 += 64)
                        value_tiles(V + (int64_t)32 * c * d, d, b0, prefix_values(w, c, b0, d));
                    tc->values = c + 1;
                }
            } else {
                gather_rows(V, &upto, 32 * c, 32, d, w->rows);
                value_tiles(w->rows, d, c0, w->vp);
            }
            weigh_tile(w, vp, S32, c);
        }
        store_sums(w->cb);
        for (int r = 0; r < nb; ++r) {
            const float *sums = w->cb;
            if (32 * joint < rows[r].n) {
                load_sums(w->cb);
                for (int c = joint; 32 * c < rows[r].n; ++c) {
                    gather_rows(V, &rows[r], 32 * c, 32, d, w->rows);
                    value_tiles(w->rows, d, c0, w->vp);
                    weigh_tile(w, w->vp, S32, c);
                }
                store_sums(w->tmp);
                sums = w->tmp;
            }
            for (int i = r * G; i < (r + 1) * G; ++i) {
                float *o = out + (int64_t)(i / G) * nq + (h0 + i % G) * d + c0;
                for (int c = 0; c < 64; c += 16)
                    _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(sums + 64 * i + c), _mm512_set1_ps(inv[i])));
            }
        }
    }
}

/* layer.h's attention for M rows on AMX tiles: blocks of consecutive rows that share a cache, up to 16 / group
 * rows each, times the key/value heads, spread over the threads. Work items run head by head over each cache's
 * blocks, and each thread starts on a contiguous range of them (split by their keys), so that a thread's blocks
 * of one cache and head reuse its tiles (TileCache); one that finishes early takes items from the far end of
 * another's range (share.h). scratch: amx_attn_floats(S32, d) per thread. */
AMX static void attention_amx(const StepModel *m, int M, const float *q, int64_t ldq, const RowAttn *rows,
                                   int S32, float *scratch, float *heads_out) {
    const int d = m->head_dim, group = m->heads / m->kv_heads, per = 16 / group, nkv = m->kv_heads;
    int *starts = malloc(sizeof(int) * (M + 1)), nblocks = 0;
    int *order = malloc(sizeof(int) * 2 * (size_t)M * nkv); /* item i: block order[2i], head order[2i + 1] */
    int64_t *cum = malloc(sizeof(int64_t) * ((size_t)M * nkv + 1)); /* keys of the items before item i */
    if (!starts || !order || !cum) abort();
    for (int r = 0; r < M;) { /* blocks: consecutive rows of one cache */
        int e = r + 1;
        while (e < M && e - r < per && rows[e].K == rows[r].K) ++e;
        starts[nblocks++] = r;
        r = e;
    }
    starts[nblocks] = M;
    int items = 0;
    cum[0] = 0;
    for (int b0 = 0; b0 < nblocks;) { /* a run of blocks of one cache, head by head */
        int b1 = b0 + 1;
        while (b1 < nblocks && rows[starts[b1]].K == rows[starts[b0]].K) ++b1;
        for (int kvh = 0; kvh < nkv; ++kvh)
            for (int b = b0; b < b1; ++b, ++items) {
                order[2 * items] = b, order[2 * items + 1] = kvh;
                int64_t keys = 0;
                for (int r = starts[b]; r < starts[b + 1]; ++r) keys += rows[r].n;
                cum[items + 1] = cum[items] + keys + 32; /* + a block's fixed work */
            }
        b0 = b1;
    }
    /* each thread's share: the items whose middle falls in its share of all keys (contiguous ranges); one that
     * finishes early takes items from the far end of another's (share.h) */
    const int nt = omp_get_max_threads();
    Share shares[nt];
    for (int t = 0, it = 0; t < nt; ++t) {
        const int lo = it;
        while (it < items && (t == nt - 1 || (cum[it] + cum[it + 1]) * nt / (2 * cum[items]) <= t)) ++it;
        share_set(&shares[t], lo, it);
    }
#pragma omp parallel num_threads(nt) if (items > 1 && (int64_t)M * rows[0].n >= 64)
    {
        amx_configure();
        const int t = omp_get_thread_num();
        Arena mine = {(char *)(scratch + (int64_t)t * amx_attn_floats(S32, d)), 0};
        const AmxAttnScratch w = amx_attn_scratch(&mine, S32, d);
        TileCache tc = {NULL, 0, 0};
        for (int first, end; (first = shares_take(shares, nt, t, &end)) >= 0;)
            for (int it = first; it < end; ++it) {
                const int b = order[2 * it], kvh = order[2 * it + 1], r0 = starts[b];
                attend_block_amx(m, rows + r0, starts[b + 1] - r0, kvh, group, kvh * group, q + r0 * ldq, ldq, S32,
                                 &w, &tc, heads_out + (int64_t)r0 * m->heads * d);
            }
        _tile_release();
    }
    free(starts);
    free(order);
    free(cum);
}

#endif /* CASTSPEC_AVX512 */
#endif
