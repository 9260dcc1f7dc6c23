/* Matrix products against weights packed once into column panels (contbatch.engine.native).

   pack_panels lays a weight w [N, K] (transformers' [out, in]) out as panels of NR = 16 output
   columns: panel p (columns [16 p, 16 p + width)) is [K, width] contiguous, width 16 but for the
   last, N % 16, so the packed weight has exactly N * K floats. gemm_panels computes
   c[M, N] = a[M, K] . w^T (a's rows lda floats apart, K contiguous; c contiguous): each panel,
   read once from memory and kept in cache, is multiplied by every tile of 6 rows of a, the tile's
   6 x 16 sums held in twelve AVX2 registers over all of K (each product's terms added in k order,
   fused multiply-adds). With AVX-512, two adjacent panels go together (tile32: 14 rows x 32
   columns in 28 registers, two panel loads and 14 broadcasts for 28 multiply-adds a k, the k
   loop unrolled four times), and each pair's first tile prefetches its own panels ahead of
   its loads (and the next pair, for a weight that streams from memory: pair_after); with AVX2
   each panel's first tile likewise. a's rows go ROW_BLOCK_FLOATS at a time (a block stays in a
   core's L2 while every panel passes; a prefill's thousands of rows do not fit), so a panel is
   read once per block.
   Work is handed out by (row block, pair of panels), PANELS_PER_GRAB panels at a time, to whichever
   of `num_threads` OpenMP threads (torch's, as for the other kernels) is free: a thread that loses
   its core to another process (a server's HTTP side, its client) holds up its own panels only,
   where a static split made every other thread wait for its half. Given `argmax`, gemm_panels also
   finds each row's first maximum (panel_best: each pair's columns scanned right after its tile is stored, while they
   are in cache; the threads' results merged after), which a greedy step would otherwise read
   the whole [M, N] product again for. gemm_gated multiplies a by a gated MLP's fused gate and
   up weight and applies silu(gate) * up as each pair of columns leaves the product, so the
   [M, 2n] product never reaches memory. gemm_preferred() says whether the engine should pack its
   weights this way: this build has the AVX2 and FMA loops (with AVX-512 or without). Without
   AVX2 gemm_panels runs plain loops, right but slow. argmax_bf16 (at the end, AVX-512 builds)
   finds the same argmax from the weight rounded to bfloat16, exactly, by the vector units or by
   AMX's tile unit (tiles.c). */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "silu.h"
#include "tiles.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(CONTBATCH_NATIVE_PORTABLE)
#include <immintrin.h>
#define GEMM_AVX2 1
#endif

enum { NR = 16, MR = 6, PANELS_PER_GRAB = 4 }; /* 4 panels: a run of memory the prefetchers stream */
/* a panel's first row tile prefetches the panel this many rows of k ahead of its loads (6 KB; 48
   and 192 measured slower at 1-32 rows of a) */
enum { FETCH_AHEAD_K = 96 };
/* a row block: about 1 MB of a (half a core's L2 on the machines measured), whole tiles of 6 and of 14 rows */
enum { ROW_BLOCK_FLOATS = 262144, BLOCK_ROWS_MULTIPLE = 42 };

int gemm_preferred(void) {
#if defined(GEMM_AVX2)
  return 1;
#else
  return 0;
#endif
}

void pack_panels(const float *w, int64_t N, int64_t K, float *packed) {
  for (int64_t first = 0; first < N; first += NR) {
    const int64_t width = N - first < NR ? N - first : NR;
    float *panel = packed + first * K;
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = 0; j < width; j++) panel[k * width + j] = w[(first + j) * K + k];
  }
}

/* c[r, j] = sum over k of a[r, k] * panel[k, j], for r < rows, j < width */
static void tile_portable(const float *a, int64_t lda, const float *panel, int64_t K, int64_t width, float *c,
                          int64_t ldc, int64_t rows) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < width; j++) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; k++) sum += a[r * lda + k] * panel[k * width + j];
      c[r * ldc + j] = sum;
    }
}

#ifdef GEMM_AVX2
#define ROW_DECLARE(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define ROW_MULTIPLY(r)                                    \
  if (rows > r) {                                          \
    const __m256 x = _mm256_broadcast_ss(a + r * lda + k); \
    c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0);             \
    c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1);             \
  }
#define ROW_STORE(r)                              \
  if (rows > r) {                                 \
    _mm256_storeu_ps(c + r * ldc, c##r##0);       \
    _mm256_storeu_ps(c + r * ldc + 8, c##r##1);   \
  }

/* tile_portable for a full panel (width 16), rows <= 6 and `fetch` constants where it is inlined;
   with `fetch` (the panel's first tile) the panel is prefetched ahead of the loads, as tile32 does */
static inline __attribute__((always_inline)) void tile16(const float *a, int64_t lda, const float *panel, int64_t K,
                                                         float *c, int64_t ldc, const int rows, const int fetch) {
  ROW_DECLARE(0) ROW_DECLARE(1) ROW_DECLARE(2) ROW_DECLARE(3) ROW_DECLARE(4) ROW_DECLARE(5)
  for (int64_t k = 0; k < K; k++) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * NR), b1 = _mm256_loadu_ps(panel + k * NR + 8);
    if (fetch) _mm_prefetch((const char *)(panel + (k + FETCH_AHEAD_K) * NR), _MM_HINT_T0);
    ROW_MULTIPLY(0) ROW_MULTIPLY(1) ROW_MULTIPLY(2) ROW_MULTIPLY(3) ROW_MULTIPLY(4) ROW_MULTIPLY(5)
  }
  ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* the rows of a times one full panel; the first tile prefetches (tile16) */
static void panel_rows(const float *a, int64_t lda, const float *panel, int64_t K, float *c, int64_t ldc, int64_t M) {
  int64_t m = 0;
  if (M >= MR) {
    tile16(a, lda, panel, K, c, ldc, MR, 1);
    m = MR;
  }
  for (; m + MR <= M; m += MR) tile16(a + m * lda, lda, panel, K, c + m * ldc, ldc, MR, 0);
  const float *am = a + m * lda;
  float *cm = c + m * ldc;
  switch (M - m) { /* (each case inlines tile16 for its row count) */
    case 5: tile16(am, lda, panel, K, cm, ldc, 5, m == 0); break;
    case 4: tile16(am, lda, panel, K, cm, ldc, 4, m == 0); break;
    case 3: tile16(am, lda, panel, K, cm, ldc, 3, m == 0); break;
    case 2: tile16(am, lda, panel, K, cm, ldc, 2, m == 0); break;
    case 1: tile16(am, lda, panel, K, cm, ldc, 1, m == 0); break;
    default: break;
  }
}
#endif

#if defined(GEMM_AVX2) && defined(__AVX512F__)
#define GEMM_AVX512 1
/* Two adjacent full panels at once (32 columns, two registers a row) for up to 14 rows: 28
   accumulators; per k, 2 panel loads and 14 broadcasts feed 28 fused multiply-adds, so the
   multiply-adds bound the loop, not the loads (one panel of 16 rows: 17 loads for 16). */
enum { MR512 = 14 };
#define Z_DECLARE(r) __m512 z##r##0 = _mm512_setzero_ps(), z##r##1 = _mm512_setzero_ps();
#define Z_MULTIPLY(r)                                     \
  if (rows > r) {                                         \
    const __m512 x = _mm512_set1_ps(a[r * lda + k]);      \
    z##r##0 = _mm512_fmadd_ps(x, b0, z##r##0);            \
    z##r##1 = _mm512_fmadd_ps(x, b1, z##r##1);            \
  }
#define Z_STORE(r)                                        \
  if (rows > r) {                                         \
    _mm512_storeu_ps(c + r * ldc, z##r##0);               \
    _mm512_storeu_ps(c + r * ldc + NR, z##r##1);          \
  }
#define Z_ALL(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)

/* tile16 for the panels at `panel` and `panel + 16 K` together (c's columns [0, 32)), rows <= 14
   and `fetch` constants where it is inlined; each sum's terms in k order, as tile16's. With
   `fetch` (a pair's first tile, which reads the pair from L3 or memory: a model's weights do not
   stay in a core's L2 from one product to the next), the loads FETCH_AHEAD_K rows of k ahead are
   prefetched meanwhile: the hardware prefetchers alone left the loop waiting; and the pair at
   `ahead` (NULL: none; see pair_after) into L2. (Prefetching only the pair after this one in
   memory, as before, missed whenever another thread took that pair: 0.6-0.8 times the speed at
   1-32 rows of a from L3, where a pair's first tile is most of its time. Prefetching as well
   the pair that the same OpenMP grab holds next made the engine's decode steps of 1 and 8
   requests 0.93 x as fast.) */
static inline __attribute__((always_inline)) void tile32(const float *a, int64_t lda, const float *panel, int64_t K,
                                                         float *c, int64_t ldc, const int rows, const int fetch,
                                                         const float *ahead) {
  const float *next = panel + NR * K;
  Z_ALL(Z_DECLARE)
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; k++) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * NR), b1 = _mm512_loadu_ps(next + k * NR);
    if (fetch) {
      _mm_prefetch((const char *)(panel + (k + FETCH_AHEAD_K) * NR), _MM_HINT_T0);
      _mm_prefetch((const char *)(next + (k + FETCH_AHEAD_K) * NR), _MM_HINT_T0);
      if (ahead != NULL) {
        _mm_prefetch((const char *)(ahead + k * NR), _MM_HINT_T1);
        _mm_prefetch((const char *)(ahead + NR * K + k * NR), _MM_HINT_T1);
      }
    }
    Z_ALL(Z_MULTIPLY)
  }
  Z_ALL(Z_STORE)
}

#define Z_CASE(r) \
  case r: tile32(am, lda, panel, K, cm, ldc, r, m == 0, ahead); break;

/* panel_rows for two adjacent full panels; the first tile prefetches (tile32) */
static void pair_rows(const float *a, int64_t lda, const float *panel, int64_t K, float *c, int64_t ldc, int64_t M,
                      const float *ahead) {
  int64_t m = 0;
  if (M >= MR512) {
    tile32(a, lda, panel, K, c, ldc, MR512, 1, ahead);
    m = MR512;
  }
  for (; m + MR512 <= M; m += MR512) tile32(a + m * lda, lda, panel, K, c + m * ldc, ldc, MR512, 0, NULL);
  const float *am = a + m * lda;
  float *cm = c + m * ldc;
  switch (M - m) { /* (each case inlines tile32 for its row count) */
    Z_CASE(1) Z_CASE(2) Z_CASE(3) Z_CASE(4) Z_CASE(5) Z_CASE(6)
    Z_CASE(7) Z_CASE(8) Z_CASE(9) Z_CASE(10) Z_CASE(11) Z_CASE(12) Z_CASE(13)
    default: break;
  }
}
#endif

/* Each row's first maximum over the columns [first, first + width) of c, merged into (value[r],
   column[r]) (column -1: none yet); a NaN counts as larger than any number, and the first NaN
   is kept (torch.argmax's rules). Columns must arrive in increasing order for one (value,
   column) pair: a later column replaces only a strictly larger value, or a first NaN. */
static void panel_best(const float *c, int64_t ldc, int64_t M, int64_t first, int64_t width, float *value,
                       int64_t *column) {
  for (int64_t r = 0; r < M; r++) {
    const float *x = c + r * ldc + first;
    float top = x[0];
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t j = 0; j < width; j++) {
      top = x[j] > top ? x[j] : top;
      nan |= x[j] != x[j];
    }
    const float best = value[r]; /* (unset while column[r] < 0) */
    if (column[r] >= 0 && best != best) continue; /* a NaN already: nothing comes first */
    if (nan) {
      int64_t j = 0;
      while (j + 1 < width && x[j] == x[j]) j++;
      value[r] = x[j];
      column[r] = first + j;
    } else if (column[r] < 0 || top > best) {
      int64_t j = 0;
      while (j + 1 < width && x[j] != top) j++;
      value[r] = top;
      column[r] = first + j;
    }
  }
}

/* c's columns of panel q (of N; a's rows M) */
static void one_panel(const float *a, int64_t lda, const float *packed, int64_t K, float *c, int64_t N, int64_t M,
                      int64_t q) {
  const int64_t first = q * NR, width = N - first < NR ? N - first : NR;
  const float *panel = packed + first * K;
#ifdef GEMM_AVX2
  if (width == NR) {
    panel_rows(a, lda, panel, K, c + first, N, M);
    return;
  }
#endif
  tile_portable(a, lda, panel, K, width, c + first, N, M);
}

/* c[r, j] for r < rows, j < 32 (rows ldc floats apart) = a's rows times the two full panels at
   `pair` (tile32 with AVX-512, tile16 twice with AVX2, plain loops elsewhere); `ahead`: pair_after's */
static void pair_product(const float *a, int64_t lda, const float *pair, int64_t K, float *c, int64_t ldc,
                         int64_t rows, const float *ahead) {
#if defined(GEMM_AVX512)
  pair_rows(a, lda, pair, K, c, ldc, rows, ahead);
#elif defined(GEMM_AVX2)
  (void)ahead;
  panel_rows(a, lda, pair, K, c, ldc, rows);
  panel_rows(a, lda, pair + NR * K, K, c + NR, ldc, rows);
#else
  (void)ahead;
  tile_portable(a, lda, pair, K, NR, c, ldc, rows);
  tile_portable(a, lda, pair + NR * K, K, NR, c + NR, ldc, rows);
#endif
}

/* A weight of more than STREAMED_WEIGHT_BYTES (an LM head: the demo model's is 47 MiB) comes from
   memory in a step; there the pair after the one at column `first` in memory, fetched into L2 by
   this pair's first tile (whichever thread multiplies it: it passes through the shared cache),
   made the products 1.04-1.21 x faster at 8-32 rows. A layer's weights come from L3 in a decode
   step, and there it was 0.77-0.95 x. That pair (of a weight packed [N, K]) when it is whole and
   the weight streams, else NULL. */
enum { STREAMED_WEIGHT_BYTES = 8 << 20 };
static const float *pair_after(const float *packed, int64_t N, int64_t K, int64_t first) {
  if ((int64_t)sizeof(float) * N * K <= STREAMED_WEIGHT_BYTES || first + 4 * NR > N) return NULL;
  return packed + (first + 2 * NR) * K;
}

/* rows of a (K floats each) that stay in a core's cache while it multiplies them by the panels */
static int64_t block_rows(int64_t K) {
  const int64_t fit = ROW_BLOCK_FLOATS / (K > 0 ? K : 1);
  return fit > BLOCK_ROWS_MULTIPLE ? fit - fit % BLOCK_ROWS_MULTIPLE : BLOCK_ROWS_MULTIPLE;
}

/* 0, or -1 when `argmax` was asked for and its scratch could not be allocated (c is then the
   product, argmax untouched). */
int gemm_panels(const float *a, int64_t lda, const float *packed, float *c, int64_t M, int64_t N, int64_t K,
                int num_threads, int64_t *argmax) {
  const int64_t panels = (N + NR - 1) / NR, pairs = (panels + 1) / 2;
  const int64_t rows_per_block = block_rows(K);
  const int64_t blocks = M > 0 ? (M + rows_per_block - 1) / rows_per_block : 0;
  /* with argmax: one (value, column) per row and thread, merged after the products */
  float *values = argmax == NULL ? NULL : malloc(sizeof(float) * M * num_threads);
  int64_t *columns = argmax == NULL ? NULL : malloc(sizeof(int64_t) * M * num_threads);
  if (argmax != NULL && (values == NULL || columns == NULL)) {
    free(values);
    free(columns);
    values = NULL;
    columns = NULL; /* no memory: the product alone, and -1 */
  }
  for (int64_t i = 0; columns != NULL && i < M * num_threads; i++) columns[i] = -1;
#pragma omp parallel num_threads(num_threads)
  {
    const int t = omp_get_thread_num();
#pragma omp for schedule(dynamic, PANELS_PER_GRAB / 2)
    for (int64_t i = 0; i < blocks * pairs; i++) { /* row block by row block, each over all pairs */
      const int64_t m0 = i / pairs * rows_per_block, rows = M - m0 < rows_per_block ? M - m0 : rows_per_block;
      const int64_t p = 2 * (i % pairs), first = p * NR, width = N - first < 2 * NR ? N - first : 2 * NR;
      const float *am = a + m0 * lda;
      float *cm = c + m0 * N;
      if (width == 2 * NR)
        pair_product(am, lda, packed + first * K, K, cm + first, N, rows, pair_after(packed, N, K, first));
      else
        for (int64_t q = p; q < p + 2 && q < panels; q++) one_panel(am, lda, packed, K, cm, N, rows, q);
      if (columns != NULL) panel_best(cm, N, rows, first, width, values + t * M + m0, columns + t * M + m0);
    }
  }
  if (argmax == NULL) return 0;
  if (columns == NULL) return -1;
  for (int64_t r = 0; r < M; r++) { /* the threads' bests: a NaN first, else the largest, the lowest column on ties */
    int64_t pick = -1;
    float best = 0.f;
    for (int t = 0; t < num_threads; t++) {
      const int64_t col = columns[t * M + r];
      if (col < 0) continue;
      const float v = values[t * M + r];
      const int nan = v != v, best_nan = pick >= 0 && best != best;
      if (pick < 0 || (nan && (!best_nan || col < pick)) ||
          (!nan && !best_nan && (v > best || (v == best && col < pick)))) {
        pick = col;
        best = v;
      }
    }
    argmax[r] = pick;
  }
  free(values);
  free(columns);
  return 0;
}

/* out[r, j] (rows ldo floats apart) = silu(g) u for g = c[r, j], u = c[r, n + j] of c = a . w^T,
   w [2n, K] (the gate's rows, then the up projection's) packed by pack_panels, n a multiple of
   32: the gated MLP's activation without its [M, 2n] product in memory. Work is handed out as gemm_panels does, by
   (row block, pair of the gate's panels); each task writes the gate's 32 columns where their
   activations go, the up projection's pair into a scratch of the thread's, and then combines the
   two while they are in cache (silu_times: silu_mul's bits). 0; -1 when a thread's scratch could
   not be allocated (out incomplete); -2 when n is not a multiple of 32 (out untouched). */
int gemm_gated(const float *a, int64_t lda, const float *packed, float *out, int64_t ldo, int64_t M, int64_t n,
               int64_t K, int num_threads) {
  if (n % (2 * NR)) return -2;
  const int64_t pairs = n / (2 * NR), rows_per_block = block_rows(K);
  const int64_t blocks = M > 0 ? (M + rows_per_block - 1) / rows_per_block : 0;
  int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
  {
    float *up = malloc(sizeof(float) * rows_per_block * 2 * NR); /* [rows, 32] */
    failed = up == NULL;
#pragma omp for schedule(dynamic, PANELS_PER_GRAB / 2)
    for (int64_t i = 0; i < blocks * pairs; i++) {
      if (up == NULL) continue;
      const int64_t m0 = i / pairs * rows_per_block, rows = M - m0 < rows_per_block ? M - m0 : rows_per_block;
      const int64_t first = i % pairs * 2 * NR;
      const float *am = a + m0 * lda;
      float *gate = out + m0 * ldo + first;
      pair_product(am, lda, packed + first * K, K, gate, ldo, rows, pair_after(packed, 2 * n, K, first));
      pair_product(am, lda, packed + (n + first) * K, K, up, 2 * NR, rows, pair_after(packed, 2 * n, K, n + first));
      for (int64_t r = 0; r < rows; r++) {
        float *g = gate + r * ldo;
        const float *u = up + r * 2 * NR;
#pragma omp simd
        for (int j = 0; j < 2 * NR; j++) g[j] = silu_times(g[j], u[j]);
      }
    }
    free(up);
  }
  return failed ? -1 : 0;
}

/* Each row's argmax of a . w^T as gemm_panels finds it (float32), from w rounded to bfloat16
   (`head16`; `rows32`: w itself, [N, K]; `norms`: each w row's Euclidean norm), by one of two
   kernels (`kernel`, a bit of argmax_bf16_kernels()):
   - VECTORS (AVX-512): head16 in pack_panels' layout (16-bit elements), each bfloat16 widened to
     float32 in the registers and multiplied by a in float32 (the pair tile, tile32_bf16);
   - TILES (AMX): head16 in the tile layout (for each 16 columns, each pair of k: the 16 columns'
     two elements; K padded with zeros to TILE_K), a rounded to bfloat16 too (to nearest), the
     products of 32 rows by 32 columns summed in float32 by the tile unit (tdpbf16ps: subnormal
     inputs and results flushed to zero, which the absolute term below covers).
   Each approximate logit v is within e = bound * |a_r| * norms[col] + K 2^-120 (|a_r| + max_norm
   + 1) of the float32 kernel's own (the caller's `bound`: the operands' rounding and both sides'
   float32 sums, with a margin; the absolute term: subnormals and underflow, far below any e that
   matters); a column whose v + e is below the row's largest v - e cannot be its argmax.
   The others (the candidates, a handful a row on trained models) are summed again in float32,
   fused multiply-adds in k order from zero, which is what tile32 does in each lane: the same
   bits, so the same argmax and the same first column on ties. A row whose norm is not finite or
   too large, or whose candidates overflow CANDIDATES, gets -1 (the caller takes it in float32).
   Full pairs only (N a multiple of 32). The number of rows left to float32 (>= 0); -1 when its
   scratch could not be allocated, -2 for a kernel this build does not run (argmax untouched). */
enum { CANDIDATES = 64, VECTORS = 1, TILES = 2 };

int argmax_bf16_kernels(void) {
  int kernels = 0;
#if defined(GEMM_AVX512)
  kernels |= VECTORS;
#endif
  if (tiles_ready()) kernels |= TILES;
  return kernels;
}

#if defined(GEMM_AVX512)
static inline __m512 widen_bf16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* tile32 over bfloat16 panels, its sums stored to t [rows, 32]; each tile prefetches its own pair
   ahead (1.2 x at one row of a where it fetched the next pair in memory, 1.05 x at 8) */
static inline __attribute__((always_inline)) void tile32_bf16(const float *a, int64_t lda, const uint16_t *panel,
                                                              int64_t K, float *c, const int rows) {
  const uint16_t *next = panel + NR * K;
  const int64_t ldc = 2 * NR;
  Z_ALL(Z_DECLARE)
  for (int64_t k = 0; k < K; k++) {
    const __m512 b0 = widen_bf16(panel + k * NR), b1 = widen_bf16(next + k * NR);
    if ((k & 1) == 0) { /* a cache line holds two k of a bfloat16 panel */
      _mm_prefetch((const char *)(panel + (k + FETCH_AHEAD_K) * NR), _MM_HINT_T0);
      _mm_prefetch((const char *)(next + (k + FETCH_AHEAD_K) * NR), _MM_HINT_T0);
    }
    Z_ALL(Z_MULTIPLY)
  }
  Z_ALL(Z_STORE)
}

#define ZB_CASE(r) \
  case r: tile32_bf16(am, lda, panel, K, t, r); break;

/* One thread's view of a row: its best lower bound and the columns that may still beat it. */
typedef struct {
  float lower;
  int count, overflow;
  int32_t column[CANDIDATES];
  float upper[CANDIDATES];
} Row;

/* Row `row`'s candidates among one pair's 32 columns: `value` their approximate logits, e = scale *
   norms + absolute; the bounds in vectors, a column kept only when its upper bound reaches the
   row's best lower bound so far (rarely, once that bound has risen). */
static void keep_pair(Row *row, const float *value, const float *norms, float scale, float absolute, int32_t first) {
  const __m512 s = _mm512_set1_ps(scale), add = _mm512_set1_ps(absolute);
  const __m512 v0 = _mm512_loadu_ps(value), v1 = _mm512_loadu_ps(value + NR);
  const __m512 e0 = _mm512_fmadd_ps(s, _mm512_loadu_ps(norms), add);
  const __m512 e1 = _mm512_fmadd_ps(s, _mm512_loadu_ps(norms + NR), add);
  const float lower = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_sub_ps(v0, e0), _mm512_sub_ps(v1, e1)));
  if (lower > row->lower) row->lower = lower;
  const __m512 floor = _mm512_set1_ps(row->lower);
  const uint32_t reach = (uint32_t)_mm512_cmp_ps_mask(_mm512_add_ps(v0, e0), floor, _CMP_GE_OQ) |
                         (uint32_t)_mm512_cmp_ps_mask(_mm512_add_ps(v1, e1), floor, _CMP_GE_OQ) << NR;
  for (uint32_t bits = reach; bits != 0 && !row->overflow; bits &= bits - 1) {
    const int j = __builtin_ctz(bits);
    const float upper = value[j] + (j < NR ? e0[j] : e1[j - NR]);
    if (row->count == CANDIDATES) { /* drop those the lower bound has passed, then give up if still full */
      int kept = 0;
      for (int i = 0; i < row->count; i++)
        if (row->upper[i] >= row->lower) {
          row->column[kept] = row->column[i];
          row->upper[kept++] = row->upper[i];
        }
      row->count = kept;
      if (kept == CANDIDATES) {
        row->overflow = 1;
        break;
      }
    }
    row->column[row->count] = first + j;
    row->upper[row->count++] = upper;
  }
}

static float exact_logit(const float *a, const float *w, int64_t K) {
  float sum = 0.f;
  for (int64_t k = 0; k < K; k++) sum = fmaf(a[k], w[k], sum);
  return sum;
}
#endif

int argmax_bf16(const float *a, int64_t lda, const uint16_t *head16, const float *norms, const float *rows32,
                int64_t M, int64_t N, int64_t K, float bound, float max_norm, int kernel, int num_threads,
                int64_t *argmax) {
  if ((argmax_bf16_kernels() & kernel) == 0 || (kernel != VECTORS && kernel != TILES)) return -2;
#if defined(GEMM_AVX512)
  const int64_t Kp = kernel == TILES ? (K + TILE_K - 1) / TILE_K * TILE_K : K;
  const int64_t block = kernel == TILES ? TILE_ROWS : MR512;
  float *scale = malloc(sizeof(float) * (M > 0 ? M : 1)); /* bound * |a_r|, or NAN: the row goes to float32 */
  float *absolute = malloc(sizeof(float) * (M > 0 ? M : 1));
  Row *state = malloc(sizeof(Row) * (M > 0 ? M : 1) * num_threads);
  uint16_t *a16 = kernel == TILES ? malloc(sizeof(uint16_t) * ((M + block - 1) / block * block) * Kp + 64) : NULL;
  if (scale == NULL || absolute == NULL || state == NULL || (kernel == TILES && a16 == NULL)) {
    free(scale);
    free(absolute);
    free(state);
    free(a16);
    return -1;
  }
  for (int64_t r = 0; r < M; r++) {
    double squares = 0.;
    for (int64_t k = 0; k < K; k++) squares += (double)a[r * lda + k] * a[r * lda + k];
    const float norm = (float)sqrt(squares);
    scale[r] = isfinite(norm) && norm < 1e30f && norm * max_norm < 1e30f ? bound * norm : NAN;
    absolute[r] = (float)K * 0x1p-120f * (norm + max_norm + 1.f);
  }
  if (kernel == TILES) round_rows_bf16(a, lda, M, K, Kp, a16);
  for (int64_t i = 0; i < M * num_threads; i++) {
    state[i].lower = -INFINITY;
    state[i].count = state[i].overflow = 0;
  }
  const int64_t pairs = N / (2 * NR);
#pragma omp parallel num_threads(num_threads)
  {
    Row *mine = state + (int64_t)omp_get_thread_num() * M;
    float t[2 * NR * 2 * NR];
    if (kernel == TILES) tiles_begin();
#pragma omp for schedule(dynamic, PANELS_PER_GRAB / 2)
    for (int64_t p = 0; p < pairs; p++) {
      const uint16_t *panel = head16 + p * 2 * NR * Kp;
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t rows = M - m0 < block ? M - m0 : block;
        const float *am = a + m0 * lda;
        if (kernel == TILES) pair_tiles(a16 + m0 * Kp, Kp, panel, t, rows);
        if (kernel == VECTORS) switch (rows) {
            ZB_CASE(1) ZB_CASE(2) ZB_CASE(3) ZB_CASE(4) ZB_CASE(5) ZB_CASE(6) ZB_CASE(7)
            ZB_CASE(8) ZB_CASE(9) ZB_CASE(10) ZB_CASE(11) ZB_CASE(12) ZB_CASE(13) ZB_CASE(14)
            default: break;
          }
        for (int64_t r = 0; r < rows; r++) {
          const float sr = scale[m0 + r];
          if (!isnan(sr))
            keep_pair(mine + m0 + r, t + r * 2 * NR, norms + p * 2 * NR, sr, absolute[m0 + r], (int32_t)(p * 2 * NR));
        }
      }
    }
    if (kernel == TILES) tiles_end();
  }
  int left = 0;
  for (int64_t r = 0; r < M; r++) { /* the threads' candidates above the best lower bound, summed in float32 */
    float lower = -INFINITY;
    int fallback = isnan(scale[r]);
    for (int th = 0; th < num_threads; th++) {
      const Row *row = state + (int64_t)th * M + r;
      fallback |= row->overflow;
      if (row->lower > lower) lower = row->lower;
    }
    int64_t pick = -1;
    float best = -INFINITY;
    for (int th = 0; th < num_threads && !fallback; th++) {
      const Row *row = state + (int64_t)th * M + r;
      for (int i = 0; i < row->count; i++) {
        if (row->upper[i] < lower) continue;
        const int64_t column = row->column[i];
        const float value = exact_logit(a + r * lda, rows32 + column * K, K);
        if (!isfinite(value)) fallback = 1;
        if (pick < 0 || value > best || (value == best && column < pick)) {
          pick = column;
          best = value;
        }
      }
    }
    argmax[r] = fallback || pick < 0 ? -1 : pick;
    left += argmax[r] < 0;
  }
  free(scale);
  free(absolute);
  free(state);
  free(a16);
  return left;
#else
  (void)a, (void)lda, (void)head16, (void)norms, (void)rows32, (void)M, (void)N, (void)K, (void)bound;
  (void)max_norm, (void)num_threads, (void)argmax;
  return -2;
#endif
}
