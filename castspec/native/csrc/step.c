/* A forward of some rows (a decode step, a causal prefill chunk, a packed tree, several requests' rows) through
 * a Llama / Qwen3 decoder in one native call.
 *
 * Such a forward streams every weight once and does little else, yet in eager torch its ~50 small ops per
 * layer (norms, RoPE, cache writes, attention, residuals) can cost more than the weight reads.
 * Here the whole forward is one call: the products use gemm.c's kernels on packed weights, the rest is layer.h, and every
 * row's bits are independent of the other rows (layer.h), so it takes any number of rows.
 * Weights are read through the pointers in StepModel (built by castspec/native/forward.py); the K/V
 * cache is the [layers, 1, kv_heads, capacity, head_dim] tensor of castspec/models/kvcache.py, in the model's
 * dtype.
 */
#include "layer.h"

/* One request's rows in a forward: its cache ([layers, 1, kv_heads, capacity, head_dim] in the model's dtype),
 * where its rows' keys/values go (slots start ..), and what they see: mask [rows, start + rows] (nonzero =
 * visible) or, when NULL, slots [0, start + r] for its row r (a decode step, a causal prefill chunk). Same
 * layout as native/abi.py's Segment. */
typedef struct {
    void *k, *v; /* the model's dtype */
    int64_t capacity, start;
    int32_t rows;
    const uint8_t *mask;
} Segment;

#ifdef CASTSPEC_SECTIONS
/* sections.h's tables, and their size (exported only by a library that keeps them: native/sections.py) */
double castspec_sections[2][SEC_COUNT], castspec_section_mark;
int castspec_section_table;
const int castspec_section_count = SEC_COUNT;
#endif

/* The sizes of the structs castspec/native/abi.py mirrors, compared with its own when the library loads. */
const int64_t castspec_sizeof_Layer = sizeof(Layer), castspec_sizeof_StepModel = sizeof(StepModel),
              castspec_sizeof_Segment = sizeof(Segment), castspec_sizeof_Int8Weight = sizeof(Int8Weight);

/* What forward_rows works in, all from one Arena (see model.h). */
typedef struct {
    RowAttn *see;                                       /* [M] */
    int32_t *keys, *nkeys;                              /* [M, Smax] [M]: masked rows' visible slots, counts */
    float *x, *n, *proj, *att, *act, *heads_out, *probs; /* [M, H] [M, H] [M, wide] [M, H] [M, F] [M, nq]
                                                           ATTN_PROBS */
    void *xs;                                           /* the bf16 products' inputs */
} StepScratch;

static void step_scratch(Arena *a, const StepModel *m, int M, int R, int Smax, int S16, StepScratch *s) {
    const int H = m->hidden, nq = m->heads * m->head_dim, qkv = nq + 2 * m->kv_heads * m->head_dim, F = m->inter;
    const int wide = 2 * F > qkv ? 2 * F : qkv; /* the widest activation row */
    const size_t f = sizeof(float), esz = m->bf16 ? 2 : 4;
    const int64_t io = GEMM_ROWS(M > R ? M : R) * (wide > H ? wide : H);
    s->see = take(a, sizeof(RowAttn) * M);
    s->keys = take(a, sizeof(int32_t) * M * Smax);
    s->nkeys = take(a, sizeof(int32_t) * M);
    s->x = take(a, f * M * H);
    s->n = take(a, f * (M > R ? M : R) * H);
    s->proj = take(a, f * M * wide);
    s->att = take(a, f * M * H);
    s->act = take(a, f * M * F);
    s->heads_out = take(a, f * M * nq);
    s->probs = take(a, f * ATTN_PROBS(m, S16));
    s->xs = take(a, esz * io); /* R rows: the final norm's */
}

/* The forward of M rows (any number: each row's bits are the same alone or among others), split in order into
 * `nseg` segments (one per request): tokens[r] at RoPE position pos[r]. logits[R, vocab] (fp32 sums of the
 * lm_head product) receive the rows logit_rows[0..R). With tap_slot (per layer: -1, or j to store the layer's
 * output as tap j) taps_out [M, ntaps, hidden] (fp32) receives the drafter's features. Returns 0, or -1 when
 * out of memory (scratch grows with M times the longest segment: callers bound M). Supported (checked by the
 * caller): head_dim a multiple of 16 and at most 512. */
int forward_rows(const StepModel *m, int M, const int64_t *tokens, const int64_t *pos, int nseg,
                 const Segment *segs, int R, const int64_t *logit_rows, float *logits, const int32_t *tap_slot,
                 int ntaps, float *taps_out) {
    const int H = m->hidden, d = m->head_dim, nh = m->heads, nkv = m->kv_heads;
    const int nq = nh * d, nk = nkv * d, qkv = nq + 2 * nk;
    int Smax = 1;
    for (int g = 0; g < nseg; ++g)
        if (segs[g].start + segs[g].rows > Smax) Smax = (int)(segs[g].start + segs[g].rows);
    const int S16 = (Smax + 15) & ~15;
    Arena arena = {NULL, 0};
    StepScratch s;
    if (ARENA_LAYOUT(arena, step_scratch(&arena, m, M, R, Smax, S16, &s))) return -1;
    float *x = s.x, *n = s.n, *proj = s.proj, *att = s.att, *act = s.act, *heads_out = s.heads_out;
    float *probs = s.probs;
    RowAttn *see = s.see;
    void *xs = s.xs;

    /* what each row sees, the same in every layer: a masked row its visible slots as a list (attend_heads), an
     * unmasked one slots [0, start + j] */
    for (int g = 0, r = 0; g < nseg; ++g) {
        const Segment *sg = &segs[g];
        const int S = (int)(sg->start + sg->rows);
        for (int j = 0; j < sg->rows; ++j, ++r)
            s.nkeys[r] = sg->mask ? visible_keys(sg->mask + (int64_t)j * S, S, s.keys + (int64_t)r * Smax)
                                  : (int)sg->start + j + 1;
    }
    SECTIONS_BEGIN(SEC_TARGET);
    embed_rows(m, m->embed, tokens, M, x);
    for (int l = 0; l < m->layers; ++l) {
        const Layer *L = &m->layer[l];
        FOR_ROWS(M, r, rms_norm(m, x + (int64_t)r * H, L->attn_norm, H, n + (int64_t)r * H));
        linear(m, L->qkv_w, L->qkv_b, n, M, qkv, H, xs, proj); /* per row: q | k | v heads */
        SECTION_END(SEC_QKV);
        for (int g = 0, r = 0; g < nseg; ++g) { /* every row's keys/values are in place before any row attends */
            const Segment *sg = &segs[g];
            const int64_t head_stride = sg->capacity * d, layer = l * nkv * head_stride;
            void *K = kv_at(m, sg->k, layer), *V = kv_at(m, sg->v, layer);
            const int r0 = r;
            FOR_ROWS(sg->rows, j, {
                const int rj = r0 + j;
                float *row = proj + (int64_t)rj * qkv;
                norm_rope_heads(m, L, row, nh, nkv, pos[rj]);
                write_kv(m, K, V, head_stride, sg->start + j, row + nq, row + nq + nk);
                see[rj] = (RowAttn){K, V, head_stride, s.nkeys[rj],
                                    sg->mask ? s.keys + (int64_t)rj * Smax : NULL};
            });
            r += sg->rows;
        }
        SECTION_END(SEC_ROPE_KV);
        attention(m, L, M, proj, qkv, see, S16, probs, heads_out, x, xs, att);
        mlp(m, L, M, x, n, proj, act, xs, att);
        if (tap_slot && tap_slot[l] >= 0)
            for (int r = 0; r < M; ++r)
                memcpy(taps_out + ((int64_t)r * ntaps + tap_slot[l]) * H, x + r * H, sizeof(float) * H);
    }
    for (int j = 0; j < R; ++j) rms_norm(m, x + logit_rows[j] * H, m->final_norm, H, n + (int64_t)j * H);
    linear(m, m->head, NULL, n, R, m->vocab, H, xs, logits);
    SECTION_END(SEC_HEAD);
    free(arena.base);
    return 0;
}

/* The index of the first largest value of v[0, V), as numpy's and torch's argmax give it: the first NaN where
 * there is one. One pass: each lane keeps its largest value and where it first saw it (indices as fp32, exact
 * below 2^24), then the lanes' largest value and, among the lanes that hold it, the first index. */
static int64_t first_argmax(const float *v, int V) {
    static const float lane[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    __m512 best = _mm512_set1_ps(-INFINITY), where = _mm512_setzero_ps(), idx = _mm512_loadu_ps(lane);
    const __m512 step = _mm512_set1_ps(16.0f);
    __mmask16 nan = 0;
    int i = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ); /* strictly: a lane keeps its first */
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        best = _mm512_mask_blend_ps(gt, best, x);
        where = _mm512_mask_blend_ps(gt, where, idx);
        idx = _mm512_add_ps(idx, step);
    }
    float b[16], w[16], top = -INFINITY;
    int64_t at = 0;
    _mm512_storeu_ps(b, best);
    _mm512_storeu_ps(w, where);
    for (int l = 0; l < 16; ++l)
        if (b[l] > top || (b[l] == top && (int64_t)w[l] < at)) top = b[l], at = (int64_t)w[l];
    for (int j = i; j < V; ++j) {
        if (v[j] != v[j]) nan = 1;
        else if (v[j] > top) top = v[j], at = j;
    }
    if (nan)
        for (int j = 0; j < V; ++j)
            if (v[j] != v[j]) return j;
    return at;
}

/* The greedy token of each of R rows of logits [R, V] (fp32, contiguous) into out[R]: the verify step's read
 * of its logits, rows split over the threads. */
void argmax_rows(const float *logits, int R, int V, int64_t *out) {
    _Pragma("omp parallel for schedule(static) if (R > 1)")
    for (int r = 0; r < R; ++r) out[r] = first_argmax(logits + (int64_t)r * V, V);
}

/* Moves a walked verify pack's kept cache rows down: in every plane (a layer's kv head) of k and of v, slot dst + i
 * takes slot src[i], for ascending sources above their destinations (so none is overwritten before it is read).
 * One call for all layers, where indexed copies cost a round several framework calls. */
void keep_slots(void *k, void *v, int64_t planes, int64_t capacity, int64_t row_bytes, const int64_t *src,
                int64_t dst, int n) {
    for (int t = 0; t < 2; ++t)
        for (int64_t p = 0; p < planes; ++p) {
            char *plane = (char *)(t ? v : k) + p * capacity * row_bytes;
            for (int i = 0; i < n; ++i) memcpy(plane + (dst + i) * row_bytes, plane + src[i] * row_bytes, row_bytes);
        }
}

/* Puts value x of token t into the list vals/toks (n entries, descending; equal values by token id, the smaller
 * first), keeping at most k entries. */
static void top_insert(float *vals, int64_t *toks, int *n, int k, float x, int64_t t) {
    int at = *n < k ? *n : k - 1;
    while (at > 0 && (vals[at - 1] < x || (vals[at - 1] == x && toks[at - 1] > t))) {
        vals[at] = vals[at - 1], toks[at] = toks[at - 1];
        --at;
    }
    vals[at] = x, toks[at] = t;
    if (*n < k) ++*n;
}

/* Whether value x of token t enters a list of n of at most k entries. */
static inline int top_admits(const float *vals, const int64_t *toks, int n, int k, float x, int64_t t) {
    return n < k || x > vals[k - 1] || (x == vals[k - 1] && t < toks[k - 1]);
}

/* The k largest values of one row v[0, V) (k <= V), descending, and their tokens (the column, or
 * support[column] where a support is given); among equal values the smaller token id comes first, so the list is
 * the first k of one total order whatever columns the row has. One vector pass: a chunk of 16 is read element
 * by element only while the list is not full or where a lane reaches its last value. Returns 1 if the row holds
 * a NaN (the caller then uses another top-k), else 0. */
static int top_k_row(const float *v, int V, int k, const int64_t *support, float *vals, int64_t *toks) {
    int n = 0, i = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        /* lanes that may enter: all while the list fills, then those not below its last value; a NaN lane
         * compares unordered, so it is read too */
        __mmask16 in = n < k ? 0xFFFF : _mm512_cmp_ps_mask(x, _mm512_set1_ps(vals[k - 1]), _CMP_NLT_UQ);
        for (int l = 0; in; ++l, in >>= 1) {
            if (!(in & 1)) continue;
            const float y = v[i + l];
            if (y != y) return 1;
            const int64_t t = support ? support[i + l] : i + l;
            if (top_admits(vals, toks, n, k, y, t)) top_insert(vals, toks, &n, k, y, t);
        }
    }
    for (; i < V; ++i) {
        if (v[i] != v[i]) return 1;
        const int64_t t = support ? support[i] : i;
        if (top_admits(vals, toks, n, k, v[i], t)) top_insert(vals, toks, &n, k, v[i], t);
    }
    return 0;
}

/* top_k_row for each of R rows of x [R, V] (fp32, contiguous) into vals [R, k] and toks [R, k]: the tree
 * builder's candidates from a drafted block's log-probabilities (one row per drafted position), rows over the
 * threads when there are many (a batch's blocks). Returns 1 if some row holds a NaN, else 0. */
int topk_rows(const float *x, int R, int V, int k, const int64_t *support, float *vals, int64_t *toks) {
    int nan = 0;
    _Pragma("omp parallel for schedule(static) reduction(|:nan) if (R >= 32)")
    for (int r = 0; r < R; ++r)
        nan |= top_k_row(x + (int64_t)r * V, V, k, support, vals + (int64_t)r * k, toks + (int64_t)r * k);
    return nan;
}
