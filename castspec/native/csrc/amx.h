/* What every AMX kernel shares (gemm.c's products, attn_amx.h's attention): the function attribute that lets
 * the compiler emit tile instructions, and the one tile shape they all use. Only in the avx512 build. */
#ifndef CASTSPEC_AMX_H
#define CASTSPEC_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define AMX __attribute__((target("amx-tile,amx-bf16,amx-int8")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Loads the tile shape on the calling thread: all eight tiles 16 rows of 64 bytes (16 fp32 sums or 32 bf16
 * inputs a row). Tile state is per thread: every parallel region that uses tiles configures them first and
 * releases them at its end. */
AMX static inline void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

/* The shape of a product of R <= 16 rows (one row group): its sums (tiles 0-3) and inputs (tile 4) R rows, the
 * weights (tiles 5-7) 16 rows. The tile instructions then read and write those R rows alone: no zeroed rows to
 * pad the inputs to 16, and the sums stored straight into the outputs. Each sum is the same either way (a
 * tile's rows are independent). */
AMX static inline void amx_configure_rows(int R) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.rows[t] = t < 5 ? (uint8_t)R : 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

#endif
