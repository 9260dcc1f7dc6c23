/* AMX's tile unit, for CPUs that have it (contbatch.engine.native; tiles.h): the greedy argmax
   head's product (gemm.c's argmax_bf16, TILES), x and the head rounded to bfloat16 once and
   multiplied by tdpbf16ps (16 rows by 16 columns by 32 k an instruction, the products summed in
   float32), at many times the rate of the AVX-512 units' float32 multiply-adds: the head's product
   then waits on memory alone. Its result is within a bound that gemm.c's candidates settle in
   float32.

   Linux hands a process the tile registers' state only once asked (arch_prctl
   ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; oneDNN asks the same); tiles_ready() asks once. A
   refusal (an old kernel, a hypervisor that hides the state) or a build without AMX leaves the
   vector kernel: tiles_ready() is then 0. */

#include "tiles.h"

#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(CONTBATCH_NATIVE_PORTABLE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TILES_BUILT 1
#endif

enum { NR = 16 }; /* a tile's rows, and a panel's columns */

#if defined(TILES_BUILT)
int tiles_ready(void) {
  static int permitted = -1; /* (threads racing here write the same answer) */
  if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

/* Every tile 16 rows of 64 bytes: tiles 0-3 sums (rows [0, 16) and [16, 32) of a block, by a
   pair's two 16-column panels), 4-5 x's rows, 6-7 the panels. */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} TileShape;

void tiles_begin(void) {
  TileShape shape;
  memset(&shape, 0, sizeof shape);
  shape.palette = 1;
  for (int i = 0; i < 8; i++) {
    shape.rows[i] = 16;
    shape.bytes_per_row[i] = 64;
  }
  /* (not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and the stores of the
     rest went away) */
  __asm__ volatile("ldtilecfg %0" : : "m"(shape));
}

void tiles_end(void) { _tile_release(); }

static inline uint16_t nearest_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

void round_rows_bf16(const float *a, int64_t lda, int64_t M, int64_t K, int64_t Kp, uint16_t *a16) {
  const int64_t padded_rows = (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  for (int64_t r = 0; r < padded_rows; r++)
    for (int64_t k = 0; k < Kp; k++) a16[r * Kp + k] = r < M && k < K ? nearest_bf16(a[r * lda + k]) : 0;
}

void pair_tiles(const uint16_t *a16, int64_t Kp, const uint16_t *pair, float *t, int64_t rows) {
  const uint16_t *second = pair + NR * Kp;
  const int two = rows > NR;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += TILE_K) {
    _tile_loadd(4, a16 + k, 2 * Kp);
    _tile_loadd(6, pair + k * NR, 64);
    _tile_loadd(7, second + k * NR, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a16 + NR * Kp + k, 2 * Kp);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, t, 2 * NR * 4);
  _tile_stored(1, t + NR, 2 * NR * 4);
  if (two) {
    _tile_stored(2, t + NR * 2 * NR, 2 * NR * 4);
    _tile_stored(3, t + NR * 2 * NR + NR, 2 * NR * 4);
  }
}

#else
int tiles_ready(void) { return 0; }
void tiles_begin(void) {}
void tiles_end(void) {}
void round_rows_bf16(const float *a, int64_t lda, int64_t M, int64_t K, int64_t Kp, uint16_t *a16) {
  (void)a, (void)lda, (void)M, (void)K, (void)Kp, (void)a16;
}
void pair_tiles(const uint16_t *a16, int64_t Kp, const uint16_t *pair, float *t, int64_t rows) {
  (void)a16, (void)Kp, (void)pair, (void)t, (void)rows;
}
#endif
