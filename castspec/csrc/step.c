/* One decode step of a Llama / Qwen3 decoder for a single token, in one native call.
 *
 * A decode step streams every weight once and does little else, yet in eager torch its ~50 small ops per
 * layer (norms, RoPE, cache writes, attention, residuals) cost more than the weight reads on a 2-core CPU.
 * Here the whole step is one call: the products use skinny.c's kernels, everything between them is plain C
 * on a few hundred floats. Values are rounded to the model's dtype exactly where the torch forward
 * (castspec/models/decoder.py) rounds them, so both paths compute the same function up to the summation order
 * inside attention and the rounding of exp.
 *
 * Weights are read through the pointers in StepModel (built by castspec/models/native_step.py); the K/V
 * cache is the fp32 [layers, 1, kv_heads, capacity, head_dim] tensor of castspec/cache.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void skinny_bf16(const uint16_t *W, const uint16_t *X, uint16_t *Y, int M, int O, int I, int ldx, int ldy);
void skinny_f32(const float *W, const float *X, float *Y, int M, int O, int I, int ldx, int ldy);

/* Per-layer tensors; a NULL bias or q/k norm is absent. Same field order as native_step.py's Layer. */
typedef struct {
    const void *attn_norm, *qkv_w, *qkv_b, *o_w, *o_b, *q_norm, *k_norm, *mlp_norm, *gate_up_w, *gate_up_b,
        *down_w, *down_b;
} Layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, bf16;
    float eps;
    const void *embed, *final_norm, *head; /* embed [vocab, hidden]; head = lm_head or the tied embedding */
    const void *cos, *sin;                 /* RoPE tables [positions, head_dim], sin with rotate-half's sign */
    const Layer *layer;
} StepModel;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* A float rounded to the model's dtype (a no-op for fp32): what torch stores after every op. */
static inline float rnd(const StepModel *m, float f) { return m->bf16 ? bf16_to_f32(to_bf16(f)) : f; }

/* Element i of a tensor in the model's dtype, as float. */
static inline float at(const StepModel *m, const void *p, int64_t i) {
    return m->bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* out = w * round(rms_norm(x)), as RMSNorm in layers.py: normalized in fp32, rounded, then times the weight. */
static void rms_norm(const StepModel *m, const float *x, const void *w, int n, float *out) {
    float ss = 0.f;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + m->eps);
    for (int i = 0; i < n; ++i) out[i] = rnd(m, at(m, w, i) * rnd(m, x[i] * r));
}

/* y[O] = round(W[O, I] . x + b): the product in the model's dtype through skinny.c, the bias added after
 * rounding, as kernels.linear does for a single row. xs is scratch of I model-dtype elements. */
static void linear(const StepModel *m, const void *W, const void *b, const float *x, int O, int I, void *xs,
                   void *ys, float *y) {
    if (m->bf16) {
        uint16_t *xb = xs, *yb = ys;
        for (int i = 0; i < I; ++i) xb[i] = to_bf16(x[i]);
        skinny_bf16(W, xb, yb, 1, O, I, I, O);
        for (int o = 0; o < O; ++o) y[o] = bf16_to_f32(yb[o]);
    } else {
        skinny_f32(W, x, y, 1, O, I, I, O);
    }
    if (b)
        for (int o = 0; o < O; ++o) y[o] = rnd(m, y[o] + at(m, b, o));
}

/* RoPE on one head in place: x * cos + roll(x, d/2) * signed sin, each product and the sum rounded. */
static void rope(const StepModel *m, float *x, int64_t pos) {
    const int d = m->head_dim, h = d / 2;
    float t[512];
    for (int i = 0; i < d; ++i) {
        const float c = at(m, m->cos, pos * d + i), s = at(m, m->sin, pos * d + i);
        t[i] = rnd(m, rnd(m, x[i] * c) + rnd(m, x[i < h ? i + h : i - h] * s));
    }
    memcpy(x, t, sizeof(float) * d);
}

static inline float dot16(const float *a, const float *b, int d) { /* d a multiple of 16 */
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* Softmax attention of one query head over slots [0, S) of its key/value head; out[d] in fp32. */
static void attend_head(const float *q, const float *K, const float *V, int S, int d, float scale, float *p,
                        float *out) {
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) {
        p[s] = dot16(q, K + (int64_t)s * d, d) * scale;
        if (p[s] > mx) mx = p[s];
    }
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += (p[s] = expf(p[s] - mx));
    const float inv = 1.f / sum;
    for (int i = 0; i < d; i += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int s = 0; s < S; ++s)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(p[s]), _mm512_loadu_ps(V + (int64_t)s * d + i), acc);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
    }
}

/* The step: token at RoPE position `pos`, its keys/values written to cache slot `slot`, attending to slots
 * [0, slot]. logits[vocab] receives the lm_head row (rounded to the model's dtype). With tap_slot (per layer:
 * -1, or j to store the layer's output hidden state as row j of taps_out [*, hidden] in the model's dtype)
 * it also returns the drafter's tapped features. Returns 0, or -1 when out of memory. Supported shapes
 * (checked by the caller): head_dim a multiple of 16 and at most 512. */
int decode_step(const StepModel *m, int64_t token, int64_t pos, int64_t slot, float *k_cache, float *v_cache,
                int64_t capacity, float *logits, const int32_t *tap_slot, void *taps_out) {
    const int H = m->hidden, d = m->head_dim, nh = m->heads, nkv = m->kv_heads, F = m->inter;
    const int nq = nh * d, nk = nkv * d, esz = m->bf16 ? 2 : 4;
    const int wide = F * 2 > nq + 2 * nk ? F * 2 : nq + 2 * nk;
    const int64_t head_stride = capacity * d, layer_stride = nkv * head_stride;
    const int S = (int)slot + 1;
    const int scratch_n = H + H + wide + (nq > H ? nq : H) + F + nq + S * nh;
    float *buf = malloc(sizeof(float) * scratch_n);
    char *xs = malloc((size_t)esz * (wide > H ? wide : H) * 2 + (size_t)esz * m->vocab);
    if (!buf || !xs) {
        free(buf);
        free(xs);
        return -1;
    }
    float *x = buf, *n = x + H, *proj = n + H, *att = proj + wide, *act = att + (nq > H ? nq : H),
          *heads_out = act + F, *probs = heads_out + nq;
    void *ys = xs + (size_t)esz * (wide > H ? wide : H);
    const float scale = 1.f / sqrtf((float)d);

    for (int i = 0; i < H; ++i) x[i] = at(m, m->embed, token * H + i);
    for (int l = 0; l < m->layers; ++l) {
        const Layer *L = &m->layer[l];
        rms_norm(m, x, L->attn_norm, H, n);
        linear(m, L->qkv_w, L->qkv_b, n, nq + 2 * nk, H, xs, ys, proj); /* q | k | v heads */
        float *q = proj, *k = proj + nq, *v = k + nk;
        for (int h = 0; h < nh + nkv; ++h) { /* Qwen3's per-head norms, then RoPE on every q and k head */
            float *head = proj + h * d;
            if (L->q_norm) {
                float t[512];
                rms_norm(m, head, h < nh ? L->q_norm : L->k_norm, d, t);
                memcpy(head, t, sizeof(float) * d);
            }
            rope(m, head, pos);
        }
        float *Kl = k_cache + l * layer_stride, *Vl = v_cache + l * layer_stride;
        for (int g = 0; g < nkv; ++g) {
            memcpy(Kl + g * head_stride + slot * d, k + g * d, sizeof(float) * d);
            memcpy(Vl + g * head_stride + slot * d, v + g * d, sizeof(float) * d);
        }
        const int group = nh / nkv;
#pragma omp parallel for schedule(static) if (S >= 64)
        for (int h = 0; h < nh; ++h)
            attend_head(q + h * d, Kl + (h / group) * head_stride, Vl + (h / group) * head_stride, S, d, scale,
                        probs + (int64_t)h * S, heads_out + h * d);
        for (int i = 0; i < nq; ++i) heads_out[i] = rnd(m, heads_out[i]); /* .to(dtype) before o_proj */
        linear(m, L->o_w, L->o_b, heads_out, H, nq, xs, ys, att);
        for (int i = 0; i < H; ++i) x[i] = rnd(m, x[i] + att[i]);

        rms_norm(m, x, L->mlp_norm, H, n);
        linear(m, L->gate_up_w, L->gate_up_b, n, 2 * F, H, xs, ys, proj); /* gate | up */
        for (int i = 0; i < F; ++i) {
            const float g = proj[i];
            act[i] = rnd(m, rnd(m, g / (1.f + expf(-g))) * proj[F + i]);
        }
        linear(m, L->down_w, L->down_b, act, H, F, xs, ys, att);
        for (int i = 0; i < H; ++i) x[i] = rnd(m, x[i] + att[i]);
        if (tap_slot && tap_slot[l] >= 0) {
            const int64_t off = (int64_t)tap_slot[l] * H;
            for (int i = 0; i < H; ++i) {
                if (m->bf16) ((uint16_t *)taps_out)[off + i] = to_bf16(x[i]);
                else ((float *)taps_out)[off + i] = x[i];
            }
        }
    }
    rms_norm(m, x, m->final_norm, H, n);
    if (m->bf16) {
        uint16_t *xb = (uint16_t *)xs, *yb = (uint16_t *)ys;
        for (int i = 0; i < H; ++i) xb[i] = to_bf16(n[i]);
        skinny_bf16(m->head, xb, yb, 1, m->vocab, H, H, m->vocab);
        for (int o = 0; o < m->vocab; ++o) logits[o] = bf16_to_f32(yb[o]);
    } else {
        skinny_f32(m->head, n, logits, 1, m->vocab, H, H, m->vocab);
    }
    free(buf);
    free(xs);
    return 0;
}
