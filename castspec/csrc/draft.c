/* The DFlash drafter's block pass in one native call: context rows (the target's tapped features) become
 * keys/values in the drafter's cache, and the block rows [root, MASK...] attend to all of them and to each
 * other (no causal mask) through every drafter layer.
 *
 * Same reason as step.c: the pass is a few small products, and eager torch spent ~4 ms of op dispatch on it
 * per round. Python side: castspec/models/native_step.py (NativeDraft); the torch forward it mirrors is
 * castspec/models/dflash.py.
 */
#include "layer.h"

typedef struct {
    StepModel base; /* the drafter's layers, norms, RoPE tables; embed, head and vocab unused */
    const void *fc, *hidden_norm;
    int32_t fc_in; /* len(target_layer_ids) * hidden */
} DraftModel;

/* C context rows (features [C, fc_in] in the model's dtype, at RoPE positions ctx_pos) are fused (fc, norm)
 * and their keys/values written to cache slots [start, start + C); the T block rows (block_emb [T, hidden],
 * positions block_pos) see every slot up to there and the whole block. out [T, hidden] (model dtype)
 * receives the final-normed block rows. The block's own keys/values go to the slots after the context as
 * scratch (the cache's length stays start + C; the caller guarantees capacity for both). Returns 0, or -1
 * when out of memory. */
int draft_block(const DraftModel *dm, int C, const void *features, const int64_t *ctx_pos, int64_t start, int T,
                const void *block_emb, const int64_t *block_pos, float *k_cache, float *v_cache, int64_t capacity,
                void *out) {
    const StepModel *m = &dm->base;
    const int H = m->hidden, d = m->head_dim, nh = m->heads, nkv = m->kv_heads, F = m->inter, FI = dm->fc_in;
    const int nq = nh * d, nk = nkv * d, qkv = nq + 2 * nk, esz = m->bf16 ? 2 : 4;
    const int rows = C > T ? C : T, wide0 = 2 * F > qkv ? 2 * F : qkv, wide = wide0 > FI ? wide0 : FI;
    const int64_t head_stride = capacity * d, layer_stride = nkv * head_stride;
    const int S = (int)start + C + T, S16 = (S + 15) & ~15;
    const int64_t io = (int64_t)rows * (wide > H ? wide : H);
    float *buf = malloc(sizeof(float) * ((int64_t)rows * (3 * H + wide + F + nq) + (int64_t)T * nh * S16));
    char *xs = malloc((size_t)esz * 2 * io);
    RowAttn *see = malloc(sizeof(RowAttn) * T);
    if (!buf || !xs || !see) {
        free(buf);
        free(xs);
        free(see);
        return -1;
    }
    float *x = buf, *ctx = x + rows * H, *n = ctx + rows * H, *proj = n + rows * H, *act = proj + rows * wide,
          *heads_out = act + rows * F, *probs = heads_out + rows * nq;
    void *ys = xs + (size_t)esz * io;

    /* the context: fc over the concatenated taps, then hidden_norm */
    if (m->bf16) from_model(features, proj, (int64_t)C * FI);
    else memcpy(proj, features, sizeof(float) * C * FI);
    linear(m, dm->fc, NULL, proj, C, H, FI, xs, ys, n);
    for (int c = 0; c < C; ++c) rms_norm(m, n + c * H, dm->hidden_norm, H, ctx + c * H);
    if (m->bf16) from_model(block_emb, x, (int64_t)T * H);
    else memcpy(x, block_emb, sizeof(float) * T * H);

    for (int l = 0; l < m->layers; ++l) {
        const Layer *L = &m->layer[l];
        float *Kl = k_cache + l * layer_stride, *Vl = v_cache + l * layer_stride;
        /* context keys/values: the k|v rows of the fused projection on the fused context, no input norm */
        const void *kv_w = (const char *)L->qkv_w + (size_t)nq * H * esz;
        const void *kv_b = L->qkv_b ? (const char *)L->qkv_b + (size_t)nq * esz : NULL;
        linear(m, kv_w, kv_b, ctx, C, 2 * nk, H, xs, ys, proj);
        for (int c = 0; c < C; ++c) {
            float *row = proj + (int64_t)c * 2 * nk;
            norm_rope_heads(m, L, row, 0, nkv, ctx_pos[c]);
            write_kv(m, Kl, Vl, head_stride, start + c, row, row + nk);
        }
        /* the block */
        for (int t = 0; t < T; ++t) rms_norm(m, x + t * H, L->attn_norm, H, n + t * H);
        linear(m, L->qkv_w, L->qkv_b, n, T, qkv, H, xs, ys, proj);
        for (int t = 0; t < T; ++t) {
            float *row = proj + (int64_t)t * qkv;
            norm_rope_heads(m, L, row, nh, nkv, block_pos[t]);
            write_kv(m, Kl, Vl, head_stride, start + C + t, row + nq, row + nq + nk);
        }
        /* n is free again once the block's projections are taken: it holds attention's and the MLP's outputs */
        for (int t = 0; t < T; ++t) see[t] = (RowAttn){Kl, Vl, head_stride, S, S, NULL}; /* everything */
        attention(m, L, T, proj, qkv, see, S16, probs, heads_out, x, xs, ys, n);
        mlp(m, L, T, x, n, proj, act, xs, ys, n);
    }
    for (int t = 0; t < T; ++t) rms_norm(m, x + t * H, m->final_norm, H, n + t * H);
    if (m->bf16) to_model(n, out, (int64_t)T * H);
    else memcpy(out, n, sizeof(float) * T * H);
    free(buf);
    free(xs);
    free(see);
    return 0;
}
