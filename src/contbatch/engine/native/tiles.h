/* AMX's tile unit (tiles.c): what gemm.c's argmax_bf16 calls. Without AMX in the build, or
   without the process's tile state, tiles_ready() is 0 and nothing else may be called. */
#pragma once
#include <stdint.h>

/* a tile product's k per instruction (the head's rows are padded with zeros to a multiple of it)
   and the rows one pair_tiles call takes at most (x's rounded copy is padded to a multiple of it) */
enum { TILE_K = 32, TILE_ROWS = 32 };

/* 1 where the CPU has AMX and Linux gave this process the tile state (asked once) */
int tiles_ready(void);
/* each thread, before its first tile instruction and after its last */
void tiles_begin(void);
void tiles_end(void);
/* a [M, K] float32 rounded to bfloat16 (to nearest, ties to even) into a16 [M rounded up to
   TILE_ROWS, Kp], zeros past M and past K */
void round_rows_bf16(const float *a, int64_t lda, int64_t M, int64_t K, int64_t Kp, uint16_t *a16);
/* the sums of rows (<= TILE_ROWS) of a16 ([*, Kp] bfloat16) by one pair of 16-column panels in the tile
   layout (for each pair of k, each column's two elements; the second panel NR Kp elements on),
   stored to t [rows, 32] */
void pair_tiles(const uint16_t *a16, int64_t Kp, const uint16_t *pair, float *t, int64_t rows);
