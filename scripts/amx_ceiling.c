/* What this CPU's AMX unit can do on one core, as JSON: the ceiling that gemm.c's multi-row products and
 * attn_amx.h's attention run under, beside the probe's floors (bytes / read rate, FLOPs / torch's matmul rate).
 *
 *   scripts/amx_ceiling.sh [OUT.json]   (builds this file with cc and runs it on each core, then on both at once)
 *
 * Measured, each the best of several repeats (GFLOP/s, one core):
 *   tdp_only      TDPBF16PS back to back on tiles already loaded: the unit's own rate;
 *   l1_2x2        gemm.c's step shape (two input tiles x two weight tiles into four sums) on operands in L1;
 *   pair_<O>x<I>  gemm.c's loop for 32 rows over a whole bf16 weight of O x I in its packed layout, weights hot
 *                 in the cache level their size allows (960 x 576: L2; 3072 x 576: beyond L2), sums stored out
 *                 after every panel pair as gemm_amx stores them.
 * Numbers only: the arithmetic is random-free and its results unused.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define AMX __attribute__((target("amx-tile,amx-bf16")))
#define TDP_FLOP (2.0 * 16 * 16 * 32) /* one TDPBF16PS: 16 rows x 16 columns x 32 inputs */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

AMX static double tdp_only(long n) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    const double t0 = now();
    for (long i = 0; i < n; ++i) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    return 4.0 * n * TDP_FLOP / (now() - t0) / 1e9;
}

AMX static double l1_2x2(long n, const char *buf) { /* buf: 8 KiB, four 1 KiB tiles twice */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const double t0 = now();
    for (long i = 0; i < n; ++i) {
        const char *b = buf + (i & 1) * 4096;
        _tile_loadd(4, b, 64); _tile_loadd(5, b + 1024, 64);
        _tile_loadd(6, b + 2048, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, b + 3072, 64);
        _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
    }
    return 4.0 * n * TDP_FLOP / (now() - t0) / 1e9;
}

/* 32 rows (X: [32, I] bf16) by a packed weight of `panels` panels of 16 columns ([panels][I/2][16][2]). */
AMX static void pair_product(const char *W, int panels, int I, const char *X, float *Y) {
    const int steps = I / 32;
    const long pstride = 16L * I * 2, lda = 2L * I, ldy = 16L * panels;
    for (int p = 0; p < panels; p += 2) {
        const char *w = W + p * pstride;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int s = 0; s < steps; ++s) {
            const char *wk = w + s * 1024L;
            _tile_loadd(4, X + 64L * s, lda);
            _tile_loadd(5, X + 16 * lda + 64L * s, lda);
            _tile_loadd(6, wk, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(7, wk + pstride, 64);
            _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
        }
        float *y = Y + p * 16;
        _tile_stored(0, y, ldy * 4); _tile_stored(1, y + 16, ldy * 4);
        _tile_stored(2, y + 16 * ldy, ldy * 4); _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
    }
}

static double pair_rate(int O, int I, int repeats) {
    const int panels = O / 16;
    char *W = aligned_alloc(64, (size_t)O * I * 2), *X = aligned_alloc(64, 32UL * I * 2);
    float *Y = aligned_alloc(64, 32UL * O * 4);
    if (!W || !X || !Y) abort();
    memset(W, 1, (size_t)O * I * 2);
    memset(X, 1, 32UL * I * 2);
    double best = 1e30;
    for (int r = 0; r <= repeats; ++r) { /* the first warms the caches */
        const double t0 = now();
        pair_product(W, panels, I, X, Y);
        const double dt = now() - t0;
        if (r && dt < best) best = dt;
    }
    free(W); free(X); free(Y);
    return 2.0 * 32 * O * I / best / 1e9;
}

AMX int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
        fprintf(stderr, "amx_ceiling: this CPU or kernel gives no AMX tile state\n");
        return 1;
    }
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
    static char buf[8192] __attribute__((aligned(64)));
    memset(buf, 1, sizeof buf);
    double tdp = 0, l1 = 0;
    for (int r = 0; r < 5; ++r) {
        const double a = tdp_only(2000000), b = l1_2x2(2000000, buf);
        if (a > tdp) tdp = a;
        if (b > l1) l1 = b;
    }
    const double l2 = pair_rate(960, 576, 50), beyond = pair_rate(3072, 576, 20);
    _tile_release();
    printf("{\"tdp_only\": %.0f, \"l1_2x2\": %.0f, \"pair_960x576\": %.0f, \"pair_3072x576\": %.0f}\n", tdp, l1, l2,
           beyond);
    return 0;
}
