/* What a forward's pieces share (layer.h's layers, attn_amx.h's attention): the model's tensors as the Python
 * side hands them over (native/abi.py), what one row attends over, a forward's scratch arena, and exp on
 * sixteen lanes (softmax and SiLU). */
#ifndef CASTSPEC_MODEL_H
#define CASTSPEC_MODEL_H

#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* Per-layer tensors; a NULL bias or q/k norm is absent. Same field order as native/abi.py's Layer. */
typedef struct {
    const void *attn_norm, *qkv_w, *qkv_b, *o_w, *o_b, *q_norm, *k_norm, *mlp_norm, *gate_up_w, *gate_up_b,
        *down_w, *down_b;
} Layer;

/* A weight matrix in int8 (a drafter's, where the CPU has AMX-INT8 or AVX-512 VNNI): packed panels, one fp32
 * scale and one sum of int8 weights per output column (native/pack.py's pack_int8). Same layout as native/abi.py's
 * Int8Weight. */
typedef struct {
    const int8_t *panels;
    const float *scales;
    const int32_t *sums;
} Int8Weight;

/* i8: the layers' matrices are Int8Weights (a bf16 model's otherwise: norms, caches and attention stay bf16). */
typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, bf16, i8;
    float eps;
    const void *embed, *final_norm, *head; /* embed [vocab, hidden]; head = lm_head or the tied embedding */
    const float *cos, *sin;                /* RoPE tables [positions, head_dim] in fp32 whatever the model's
                                              dtype, sin with rotate-half's sign */
    const Layer *layer;
} StepModel;

/* What one row attends over at the current layer: its cache ([kv_heads, capacity, head_dim] from K and V, the
 * model's dtype) at the n slots keys[0..n), ascending (keys NULL: slots [0, n)). */
typedef struct {
    const void *K, *V;
    int64_t head_stride; /* capacity * head_dim */
    int n;
    const int32_t *keys;
} RowAttn;

/* A forward's scratch: one allocation, handed out by `take`. A forward lays its buffers out in one function
 * that takes them all from an Arena, and ARENA_LAYOUT runs it twice: first on an empty arena to measure (take
 * returns NULL and only counts), then on one block of the measured size. The total is thus the sum of what is
 * taken, by construction. */
typedef struct {
    char *base;  /* NULL while measuring */
    size_t used; /* bytes taken so far, each piece rounded up to 64 (cache-line aligned) */
} Arena;

static void *take(Arena *a, size_t bytes) {
    void *p = a->base ? a->base + a->used : NULL;
    a->used += (bytes + 63) & ~(size_t)63;
    return p;
}

/* After a measuring pass over `a`: allocates what it counted and rewinds, for the taking pass. Returns 0, or
 * -1 when out of memory. */
static int arena_open(Arena *a) {
    a->base = aligned_alloc(64, a->used ? a->used : 64);
    a->used = 0;
    return a->base ? 0 : -1;
}

/* `layout`, a call taking every buffer of a forward from `arena` (a fresh Arena), run to measure and then to
 * take from one allocation: 0, or -1 when out of memory. Free arena.base when done. */
#define ARENA_LAYOUT(arena, layout) ((layout), arena_open(&(arena)) ? -1 : ((layout), 0))

/* exp on sixteen lanes (Cody-Waite range reduction and Cephes' expf polynomial, within 2 ulp of expf);
 * inputs below -87 (masked scores) give ~1e-38, which callers zero. */
static __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
