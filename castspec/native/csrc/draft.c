/* The DFlash drafter's block pass in one native call, for one request or several: context rows (the target's
 * tapped features) become keys/values in each request's drafter cache, and its block rows [root, MASK...]
 * attend to all of them and to each other (no causal mask) through every drafter layer.
 *
 * Same reason as step.c: the pass is a few small products, and in eager torch their op dispatch costs more
 * than the arithmetic. Python side: castspec/native/forward.py (NativeDraft); the torch forward it mirrors is
 * castspec/models/dflash.py.
 */
#include "layer.h"

typedef struct {
    StepModel base; /* the drafter's layers, norms, RoPE tables; embed, head and vocab unused */
    const void *fc, *hidden_norm;
    int32_t fc_in; /* len(target_layer_ids) * hidden */
} DraftModel;

/* One request in a drafter pass: its cache ([layers, 1, kv_heads, capacity, head_dim] in the model's dtype),
 * where its new context rows go (slots start ..), how many context and block rows it has. Same layout as
 * native/abi.py's DraftSegment. */
typedef struct {
    void *k, *v; /* the model's dtype */
    int64_t capacity, start;
    int32_t ctx_rows, block_rows;
} DraftSegment;

/* The sizes of the structs castspec/native/abi.py mirrors, compared with its own when the library loads. */
const int64_t castspec_sizeof_DraftModel = sizeof(DraftModel), castspec_sizeof_DraftSegment = sizeof(DraftSegment);

/* What draft_block works in, all from one Arena (see model.h); `rows` is the context and block rows together
 * (ctx holds the fused context rows and then the block's normed rows: one product of every layer's q|k|v weights
 * for both). */
typedef struct {
    RowAttn *see;                                            /* [T] */
    float *x, *ctx, *n, *proj, *act, *heads_out, *probs;      /* [rows, H] x3, [rows, wide] [rows, F]
                                                                [rows, nq] ATTN_PROBS */
    void *xs;                                                /* the bf16 products' inputs */
    int32_t *ctx_seg, *blk_seg;                              /* [C] [T]: each row's segment */
    int64_t *ctx_slot, *blk_slot;                            /* [C] [T]: its cache slot */
} DraftScratch;

/* Each buffer holds the rows that use it: all C + T for the fused context and the q|k|v product, the block's T
 * for the rest (attention, the MLP and the residual run on block rows only). A pass that fuses many context rows
 * (a catch-up: a batch's prompts) then asks for a third of what sizing every buffer for C + T rows did, and stays
 * below the size past which malloc maps fresh pages for each call (whose faults took a fifth of such a pass). */
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static void draft_scratch(Arena *a, const DraftModel *dm, int C, int T, int S16, DraftScratch *s) {
    const StepModel *m = &dm->base;
    const int H = m->hidden, nq = m->heads * m->head_dim, qkv = nq + 2 * m->kv_heads * m->head_dim, F = m->inter;
    const int rows = C + T;
    const size_t f = sizeof(float), esz = m->bf16 ? 2 : 4;
    /* the products' inputs: fc over the context (fc_in wide), q|k|v over all rows (H), and over the block's rows
     * the output projection (nq), the MLP's gate|up (H) and down (F) */
    const int64_t block_in = max64(nq, max64(F, H));
    const int64_t io = max64(GEMM_ROWS(C) * dm->fc_in, max64(GEMM_ROWS(rows) * H, GEMM_ROWS(T) * block_in));
    s->see = take(a, sizeof(RowAttn) * T);
    s->x = take(a, f * T * H);
    s->ctx = take(a, f * rows * H);
    s->n = take(a, f * max64(C, T) * H);  /* fc's output, then attention's and the MLP's */
    s->proj = take(a, f * max64((int64_t)rows * qkv, (int64_t)T * 2 * F));  /* q|k|v, then gate|up */
    s->act = take(a, f * T * F);
    s->heads_out = take(a, f * T * nq);
    s->probs = take(a, f * ATTN_PROBS(m, S16));
    s->xs = take(a, esz * io);
    s->ctx_seg = take(a, sizeof(int32_t) * C);
    s->blk_seg = take(a, sizeof(int32_t) * T);
    s->ctx_slot = take(a, sizeof(int64_t) * C);
    s->blk_slot = take(a, sizeof(int64_t) * T);
}

/* The context rows of every segment (features [C, fc_in], at RoPE positions ctx_pos, concatenated in segment order)
 * are fused (fc, norm) and their keys/values written to their cache's slots [start, start + ctx_rows); each
 * segment's block rows (block_emb [T, hidden], positions block_pos, also concatenated) see their cache up to there
 * and their whole block. out [T, hidden] receives the final-normed block rows. Inputs and output are fp32
 * activations whatever the model's dtype (layer.h). A block's own keys/values go to the slots after its context as
 * scratch (the cache's length stays start + ctx_rows; the caller guarantees capacity for both). With `finish` (F
 * ascending block rows), out [F, hidden] receives only those rows: the last layer still writes every block row's
 * keys and values, which the others attend to, but runs attention, the MLP and the final norm for those rows alone
 * (a batched pass whose trees read one or two positions of each block skips most of its last layer); each row's
 * bits are those of the whole pass, since no step mixes rows. finish NULL: every row. Returns 0, or -1 when out of
 * memory. */
int draft_block(const DraftModel *dm, int nseg, const DraftSegment *segs, int C, const float *features,
                const int64_t *ctx_pos, int T, const float *block_emb, const int64_t *block_pos, const int64_t *finish,
                int F, float *out) {
    const StepModel *m = &dm->base;
    const int H = m->hidden, d = m->head_dim, nh = m->heads, nkv = m->kv_heads, FI = dm->fc_in;
    const int nq = nh * d, nk = nkv * d, qkv = nq + 2 * nk;
    int Smax = 1;
    for (int g = 0; g < nseg; ++g) {
        const int S = (int)(segs[g].start + segs[g].ctx_rows + segs[g].block_rows);
        if (S > Smax) Smax = S;
    }
    const int S16 = (Smax + 15) & ~15;
    Arena arena = {NULL, 0};
    DraftScratch s;
    if (ARENA_LAYOUT(arena, draft_scratch(&arena, dm, C, T, S16, &s))) return -1;
    float *x = s.x, *ctx = s.ctx, *n = s.n, *proj = s.proj, *act = s.act, *heads_out = s.heads_out;
    float *probs = s.probs;
    RowAttn *see = s.see;
    void *xs = s.xs;

    /* each row's segment and cache slot: the rows' norms, RoPE and cache writes below are independent, so a pass
     * of many requests runs them on every thread (FOR_ROWS) */
    int32_t *ctx_seg = s.ctx_seg, *blk_seg = s.blk_seg;
    int64_t *ctx_slot = s.ctx_slot, *blk_slot = s.blk_slot;
    for (int g = 0, c = 0, t = 0; g < nseg; ++g) {
        for (int j = 0; j < segs[g].ctx_rows; ++j, ++c) ctx_seg[c] = g, ctx_slot[c] = segs[g].start + j;
        for (int j = 0; j < segs[g].block_rows; ++j, ++t)
            blk_seg[t] = g, blk_slot[t] = segs[g].start + segs[g].ctx_rows + j;
    }
    SECTIONS_BEGIN(SEC_DRAFTER);
    /* the context: fc over the concatenated taps, then hidden_norm */
    linear(m, dm->fc, NULL, features, C, H, FI, xs, n);
    SECTION_END(SEC_FC);
    FOR_ROWS(C, c, rms_norm(m, n + (int64_t)c * H, dm->hidden_norm, H, ctx + (int64_t)c * H));
    memcpy(x, block_emb, sizeof(float) * T * H);

    float *normed = ctx + (int64_t)C * H, *bproj = proj + (int64_t)C * qkv; /* the block's rows after the context's */
    for (int l = 0; l < m->layers; ++l) {
        const Layer *L = &m->layer[l];
        /* one product of the q|k|v weights for the fused context (no input norm; its k|v columns are its keys and
         * values) and the block's normed rows: the weights read once a layer. Each row's sums are its own
         * (gemm.c), so the context's keys are the bits a product of the k|v weights alone gives. */
        FOR_ROWS(T, t, rms_norm(m, x + (int64_t)t * H, L->attn_norm, H, normed + (int64_t)t * H));
        linear(m, L->qkv_w, L->qkv_b, ctx, C + T, qkv, H, xs, proj);
        SECTION_END(SEC_QKV);
        FOR_ROWS(C, c, {
            const DraftSegment *sg = &segs[ctx_seg[c]];
            const int64_t head_stride = sg->capacity * d, layer = l * nkv * head_stride;
            float *row = proj + (int64_t)c * qkv + nq;
            norm_rope_heads(m, L, row, 0, nkv, ctx_pos[c]);
            write_kv(m, kv_at(m, sg->k, layer), kv_at(m, sg->v, layer), head_stride, ctx_slot[c], row, row + nk);
        });
        /* the blocks */
        FOR_ROWS(T, t, {
            const DraftSegment *sg = &segs[blk_seg[t]];
            const int64_t head_stride = sg->capacity * d, layer = l * nkv * head_stride;
            const int S = (int)(sg->start + sg->ctx_rows + sg->block_rows);
            void *K = kv_at(m, sg->k, layer), *V = kv_at(m, sg->v, layer);
            float *row = bproj + (int64_t)t * qkv;
            norm_rope_heads(m, L, row, nh, nkv, block_pos[t]);
            write_kv(m, K, V, head_stride, blk_slot[t], row + nq, row + nq + nk);
            see[t] = (RowAttn){K, V, head_stride, S, NULL}; /* everything */
        });
        int M = T;
        if (finish && l == m->layers - 1) { /* the rows to finish moved to the front, in order (finish ascends) */
            for (int r = 0; r < F; ++r) {
                const int64_t t = finish[r];
                if (t == r) continue;
                memcpy(x + (int64_t)r * H, x + t * H, sizeof(float) * H);
                memcpy(bproj + (int64_t)r * qkv, bproj + t * qkv, sizeof(float) * nq); /* its query heads */
                see[r] = see[t];
            }
            M = F;
        }
        SECTION_END(SEC_ROPE_KV);
        /* n (the fused context's scratch before the layers) holds attention's and the MLP's outputs */
        attention(m, L, M, bproj, qkv, see, S16, probs, heads_out, x, xs, n);
        mlp(m, L, M, x, n, proj, act, xs, n);
    }
    const int rows_out = finish ? F : T;
    FOR_ROWS(rows_out, t, rms_norm(m, x + (int64_t)t * H, m->final_norm, H, out + (int64_t)t * H));
    SECTION_END(SEC_OTHER);
    free(arena.base);
    return 0;
}

/* One row's log-softmax in place: x - max - log(sum exp(x - max)), the formula torch's log_softmax uses. */
static void log_softmax_row(float *x, int n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + i));
    float top = _mm512_reduce_max_ps(mx);
    for (; i < n; ++i) top = x[i] > top ? x[i] : top;
    const __m512 t = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n, i);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), t))));
    }
    const __m512 lse = _mm512_set1_ps(logf(_mm512_reduce_add_ps(sum)));
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n, i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_sub_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), t), lse));
    }
}

/* The drafter's log-probabilities over its draft vocabulary for the block rows that draft: rows rows[0..R) of
 * hidden [*, H] (final-normed, fp32; rows NULL: its first R rows) through the head's packed panels [S, H] (the
 * target's lm_head rows of the draft vocabulary; bf16 when bf16 is set, else fp32; an Int8Weight when i8 is set),
 * log-softmaxed; out [R, S] fp32. One call for what the pass hands the tree: the head's product (gemm.c, each row's
 * sums its own) and the normalization. Returns 0, or -1 when out of memory. */
int draft_logprobs(int bf16, int i8, const void *head, int S, int H, const float *hidden, const int64_t *rows, int R,
                   float *out) {
    StepModel m;
    memset(&m, 0, sizeof(m));
    m.bf16 = bf16, m.i8 = i8, m.hidden = H;
    Arena arena = {NULL, 0};
    float *x;
    void *xs;
    if (ARENA_LAYOUT(arena, (x = rows ? take(&arena, sizeof(float) * R * H) : NULL,
                             xs = take(&arena, (bf16 ? 2 : 4) * GEMM_ROWS(R) * H))))
        return -1;
    if (rows)
        for (int r = 0; r < R; ++r) memcpy(x + (int64_t)r * H, hidden + rows[r] * H, sizeof(float) * H);
    SECTIONS_BEGIN(SEC_DRAFTER);
    linear(&m, head, NULL, rows ? x : hidden, R, S, H, xs, out);
    SECTION_END(SEC_HEAD);
    FOR_ROWS(R, r, log_softmax_row(out + (int64_t)r * S, S));
    SECTION_END(SEC_OTHER);
    free(arena.base);
    return 0;
}

/* A whole drafter pass in one call (NativeDraft.marginals): its block rows embedded (block_ids, from the target's
 * embedding table `embed` [*, hidden] in the drafter's dtype), draft_block finishing only its block rows rows[0..R)
 * (ascending), then draft_logprobs of those rows through the draft vocabulary's head (packed as the drafter's
 * layers are: panels [S, H] in its dtype, or an Int8Weight). The same bits as the three steps one after the other
 * (every row finished), without the host's work between them, which is a large share of a pass this small, nor
 * the last layer's work for rows no tree reads. out [R, S]. Returns 0, or -1 when out of memory. */
int draft_pass(const DraftModel *dm, int nseg, const DraftSegment *segs, int C, const float *features,
               const int64_t *ctx_pos, int T, const int64_t *block_ids, const void *embed, const int64_t *block_pos,
               const void *head, int S, const int64_t *rows, int R, float *out) {
    const int H = dm->base.hidden;
    float *block = malloc(sizeof(float) * 2 * (size_t)T * H), *hidden = block + (size_t)T * H;
    if (!block) return -1;
    embed_rows(&dm->base, embed, block_ids, T, block);
    int rc = draft_block(dm, nseg, segs, C, features, ctx_pos, T, block, block_pos, rows, R, hidden);
    if (rc == 0) rc = draft_logprobs(dm->base.bf16, dm->base.i8, head, S, H, hidden, NULL, R, out);
    free(block);
    return rc;
}
