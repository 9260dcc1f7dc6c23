/* Decode attention, and the causal attention of a prefill chunk (`paged_prefill`, at the end),
   read in place from a paged KV cache (contbatch.engine.native).

   One query token per row b: out[b, i] = softmax(scale * q[b, i] . k) v over the keys at the
   row's positions [lo[b], hi[b]) of its block table, query head i reading KV head i / (Hq / Hkv)
   (transformers' `repeat_kv`). Position p of row b lives in block tables[b * W + p / bs], at
   offset p % bs; element d of head h of that slot is at
   block * stride_block + offset * stride_offset + h * stride_head + d (head_dim contiguous).
   Row b's query heads are q[b * q_stride_row + i * D + d] (heads and head_dim contiguous); out
   is [B, Hq, D] contiguous. Every row has at least one key (lo < hi). Returns 0, or 1 when a
   scores buffer could not be allocated (out is then incomplete).

   Tasks (a row and a KV head) go one at a time to whichever of `num_threads` OpenMP threads is
   free (a thread that loses its core to another process holds up only its own tasks): the
   process's OpenMP runtime, which torch has loaded, so its threads are torch's own (the loader
   checks that). Each task finds where its keys lie once, block by block; reads each key and value
   once for all the query heads that share them; and exponentiates with plain arithmetic that the
   compiler vectorises. With AVX-512 (and head_dim a multiple of 16) the scores are taken sixteen
   keys at a time, sixteen independent sums reduced by one tree, and the weighted values of up to
   four query heads are summed in registers over all the keys; with AVX2 and FMA (head_dim a
   multiple of 8) the same eight keys at a time; elsewhere the portable loops below do the same
   sums. A prefill tile on a CPU with AVX-512 (head_dim a multiple of 16) is taken by
   `attend_lanes` instead: its scores with the tile's rows as the lanes of two 512-bit vectors, so
   no sum runs across a vector, and its weighted values by the decode's loops over its rows. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(CONTBATCH_NATIVE_PORTABLE)
#include <immintrin.h>
#define PAGED_DECODE_AVX2 1
#endif

/* weights[g * stride + i] = scale * (q head g) . (key i), key i at keys + off[i], for i < L */
static void scores_portable(const float *qb, const float *keys, const int64_t *off, int64_t L, int64_t G,
                            int64_t D, float scale, float *weights, int64_t stride) {
  for (int64_t i = 0; i < L; i++) {
    const float *k = keys + off[i];
    for (int64_t g = 0; g < G; g++) {
      const float *qg = qb + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];
      weights[g * stride + i] = dot * scale;
    }
  }
}

/* ob[g] = sum over i < L of weights[g * L + i] * (value i), value i at values + off[i] */
static void values_portable(const float *values, const int64_t *off, int64_t L, int64_t G, int64_t D,
                            const float *weights, float *ob) {
  memset(ob, 0, sizeof(float) * G * D);
  for (int64_t i = 0; i < L; i++) {
    const float *v = values + off[i];
    for (int64_t g = 0; g < G; g++) {
      const float w = weights[g * L + i];
      float *og = ob + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) og[d] += w * v[d];
    }
  }
}

#ifdef PAGED_DECODE_AVX2
static inline __m256 sum_lanes(const __m256 a[8]) { /* lane j: the sum of a[j]'s eight lanes */
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores_portable's sums (D a multiple of 8), eight keys at a time */
static void scores_avx2(const float *qb, const float *keys, const int64_t *off, int64_t L, int64_t G,
                        int64_t D, float scale, float *weights) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= L; i += 8) {
    const float *k[8];
    for (int j = 0; j < 8; j++) k[j] = keys + off[i + j];
    for (int64_t g = 0; g < G; g++) {
      const float *qg = qb + g * D;
      __m256 acc[8];
      for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), acc[j]);
      }
      _mm256_storeu_ps(weights + g * L + i, _mm256_mul_ps(sum_lanes(acc), s));
    }
  }
  if (i < L) scores_portable(qb, keys, off + i, L - i, G, D, scale, weights + i, L);
}

/* values_portable's sums (D a multiple of 8): 32 values at a time, kept in cache across the
   heads; each head's 64-wide slices of its output summed in registers */
static void values_avx2(const float *values, const int64_t *off, int64_t L, int64_t G, int64_t D,
                        const float *weights, float *ob) {
  memset(ob, 0, sizeof(float) * G * D);
  for (int64_t i0 = 0; i0 < L; i0 += 32) {
    const int64_t n = L - i0 < 32 ? L - i0 : 32;
    for (int64_t g = 0; g < G; g++) {
      const float *w = weights + g * L + i0;
      float *og = ob + g * D;
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(og + d0 + 8 * c);
        for (int64_t j = 0; j < n; j++) {
          const __m256 wj = _mm256_broadcast_ss(w + j);
          const float *v = values + off[i0 + j] + d0;
          for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(og + d0 + 8 * c, acc[c]);
      }
      for (; d0 < D; d0 += 8) {
        __m256 acc = _mm256_loadu_ps(og + d0);
        for (int64_t j = 0; j < n; j++)
          acc = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j), _mm256_loadu_ps(values + off[i0 + j] + d0), acc);
        _mm256_storeu_ps(og + d0, acc);
      }
    }
  }
}
#endif

#if defined(__AVX512F__) && !defined(CONTBATCH_NATIVE_PORTABLE)
#include <immintrin.h>
#define PAGED_DECODE_AVX512 1
enum { VALUE_ROWS = 6 }; /* rows whose weighted values one pass sums: 24 of the 32 vector registers */
/* lane l: the sum of the lanes of a[SUM16_SLOT[l]] (a tree of 30 shuffles and 15 additions, which
   leaves the sums in this order; the order is its own inverse, so a[SUM16_SLOT[l]] holding key l's
   terms puts key l's score in lane l) */
static const int SUM16_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
static inline __m512 sum_lanes16(const __m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; j++) /* [a_j's 8 partial sums, a_{j+8}'s 8] */
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
  for (int j = 0; j < 4; j++) /* 128-bit lanes of 4 partial sums: a_j, a_{j+8}, a_{j+4}, a_{j+12} */
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xDD));
  for (int j = 0; j < 2; j++) /* 2 partial sums each of c_j's and c_{j+2}'s in each 128-bit lane */
    d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[j], c[j + 2], 0x44), _mm512_shuffle_ps(c[j], c[j + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* scores_portable's sums (D a multiple of 16), sixteen keys at a time: sixteen independent sums,
   reduced by one tree (`sum_lanes16`) */
static void scores_avx512(const float *qb, const float *keys, const int64_t *off, int64_t L, int64_t G, int64_t D,
                          float scale, float *weights) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= L; i += 16) {
    const float *k[16];
    for (int j = 0; j < 16; j++) k[j] = keys + off[i + SUM16_SLOT[j]];
    for (int64_t g = 0; g < G; g++) {
      const float *qg = qb + g * D;
      __m512 acc[16];
      for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + d);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + d), acc[j]);
      }
      _mm512_storeu_ps(weights + g * L + i, _mm512_mul_ps(sum_lanes16(acc), s));
    }
  }
  if (i < L) scores_portable(qb, keys, off + i, L - i, G, D, scale, weights + i, L);
}

/* ob[(g0 + g) D + d] for g < NG (a constant where it is inlined) and d in [d0, d0 + 16 NC): the sum
   over the L values at values + off[j] of weights[(g0 + g) rs + j ks] times the value, times
   inv[g0 + g] where inv is not NULL (decode: a row's weights [g, L], rs = L and ks = 1; a prefill
   tile's, [L, RP] with the rows as lanes, rs = 1 and ks = RP) */
static inline __attribute__((always_inline)) void values_tile(const float *values, const int64_t *off, int64_t L,
                                                              int64_t D, const float *weights, int64_t rs, int64_t ks,
                                                              const float *inv, float *ob, int64_t g0, int64_t d0,
                                                              const int NG, const int NC) {
  __m512 acc[VALUE_ROWS][4];
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < NC; c++) acc[g][c] = _mm512_setzero_ps();
  const float *wg = weights + g0 * rs;
  for (int64_t j = 0; j < L; j++, wg += ks) {
    const float *v = values + off[j] + d0;
    __m512 x[4];
    for (int c = 0; c < NC; c++) x[c] = _mm512_loadu_ps(v + 16 * c);
    for (int g = 0; g < NG; g++) {
      const __m512 w = _mm512_set1_ps(wg[g * rs]);
      for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(w, x[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; g++) {
    const __m512 f = _mm512_set1_ps(inv == NULL ? 1.f : inv[g0 + g]);
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(ob + (g0 + g) * D + d0 + 16 * c, _mm512_mul_ps(acc[g][c], f));
  }
}

/* values_tile over all of D (64 elements at a time, then 16), for NG rows from g0 */
static inline __attribute__((always_inline)) void values_heads(const float *values, const int64_t *off, int64_t L,
                                                               int64_t D, const float *weights, int64_t rs, int64_t ks,
                                                               const float *inv, float *ob, int64_t g0, const int NG) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) values_tile(values, off, L, D, weights, rs, ks, inv, ob, g0, d0, NG, 4);
  for (; d0 < D; d0 += 16) values_tile(values, off, L, D, weights, rs, ks, inv, ob, g0, d0, NG, 1);
}

/* values_portable's sums (D a multiple of 16) for G rows, weighted as values_tile says: up to
   VALUE_ROWS rows and 64 elements of d at a time, summed in registers over all the values */
static void values_avx512(const float *values, const int64_t *off, int64_t L, int64_t G, int64_t D,
                          const float *weights, int64_t rs, int64_t ks, const float *inv, float *ob) {
  for (int64_t g0 = 0; g0 < G; g0 += VALUE_ROWS) {
    switch (G - g0 < VALUE_ROWS ? G - g0 : VALUE_ROWS) { /* (each case inlines values_heads for its row count) */
      case 1: values_heads(values, off, L, D, weights, rs, ks, inv, ob, g0, 1); break;
      case 2: values_heads(values, off, L, D, weights, rs, ks, inv, ob, g0, 2); break;
      case 3: values_heads(values, off, L, D, weights, rs, ks, inv, ob, g0, 3); break;
      case 4: values_heads(values, off, L, D, weights, rs, ks, inv, ob, g0, 4); break;
      case 5: values_heads(values, off, L, D, weights, rs, ks, inv, ob, g0, 5); break;
      default: values_heads(values, off, L, D, weights, rs, ks, inv, ob, g0, 6); break;
    }
  }
}
#endif

/* w[0..n) = softmax(w[0..n)), and w[n..L) = 0 (keys the row does not see: no weight at all) */
static void softmax_row(float *w, int64_t n, int64_t L) {
  float top = w[0], sum = 0.f;
#pragma omp simd reduction(max : top)
  for (int64_t i = 1; i < n; i++) top = w[i] > top ? w[i] : top;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; i++) {
    w[i] = exp_nonpositive(w[i] - top);
    sum += w[i];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; i++) w[i] *= inv;
  for (int64_t i = n; i < L; i++) w[i] = 0.f;
}

/* scores of `rows` query vectors (rows_q, D floats apart) against the L keys at keys + off[i],
   into weights [rows, L]; row r sees the first first_len + r / group keys: softmax over them, 0
   after; then ob[r] (D floats apart) = the weighted sum of the values at values + off[i] */
static void attend(const float *rows_q, int64_t rows, const float *keys, const float *values, const int64_t *off,
                   int64_t L, int64_t D, float scale, float *weights, float *ob, int64_t first_len, int64_t group) {
#ifdef PAGED_DECODE_AVX512
  if (D % 16 == 0) {
    scores_avx512(rows_q, keys, off, L, rows, D, scale, weights);
    for (int64_t r = 0; r < rows; r++) softmax_row(weights + r * L, first_len + r / group, L);
    values_avx512(values, off, L, rows, D, weights, L, 1, NULL, ob);
    return;
  }
#endif
#ifdef PAGED_DECODE_AVX2
  if (D % 8 == 0) {
    scores_avx2(rows_q, keys, off, L, rows, D, scale, weights);
    for (int64_t r = 0; r < rows; r++) softmax_row(weights + r * L, first_len + r / group, L);
    values_avx2(values, off, L, rows, D, weights, ob);
    return;
  }
#endif
  scores_portable(rows_q, keys, off, L, rows, D, scale, weights, L);
  for (int64_t r = 0; r < rows; r++) softmax_row(weights + r * L, first_len + r / group, L);
  values_portable(values, off, L, rows, D, weights, ob);
}

/* off[i] = where position first + i lies in the cache (block by block), for i < end - first */
static void key_offsets(const int64_t *table, int64_t first, int64_t end, int64_t bs, int64_t stride_block,
                        int64_t stride_offset, int64_t *off) {
  for (int64_t p = first, i = 0; p < end;) {
    const int64_t block_end = (p / bs + 1) * bs, stop = block_end < end ? block_end : end;
    const int64_t base = table[p / bs] * stride_block;
    for (int64_t offset = p % bs; p < stop; p++, offset++) off[i++] = base + offset * stride_offset;
  }
}

int paged_decode(const float *q, int64_t q_stride_row, const float *key_cache, const float *value_cache,
                 const int64_t *tables, int64_t W, const int64_t *lo, const int64_t *hi, int64_t B, int64_t Hq,
                 int64_t Hkv, int64_t D, int64_t bs, int64_t stride_block, int64_t stride_offset,
                 int64_t stride_head, float scale, float *out, int num_threads) {
  const int64_t G = Hq / Hkv;
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
  for (int64_t task = 0; task < B * Hkv; task++) {
    const int64_t b = task / Hkv, h = task % Hkv, first = lo[b], end = hi[b], L = end - first;
    const float *qb = q + b * q_stride_row + h * G * D;
    const float *keys = key_cache + h * stride_head, *values = value_cache + h * stride_head;
    float *ob = out + (b * Hq + h * G) * D;
    int64_t *off = malloc(sizeof(int64_t) * L + sizeof(float) * G * L); /* L key offsets, then [G, L] scores */
    if (off == NULL) {
      failed = 1;
      continue;
    }
    float *weights = (float *)(off + L);
    key_offsets(tables + b * W, first, end, bs, stride_block, stride_offset, off);
    attend(qb, G, keys, values, off, L, D, scale, weights, ob, L, G);
    free(off);
  }
  return failed;
}

/* The causal attention of a prefill chunk of one sequence (`paged_prefill`), its queries taken
   PREFILL_TILE positions at a time (with `attend_lanes`, as many as fill 32 rows): a tile's rows
   (each position's query heads of one KV head) share one pass over the keys, each row then
   weighting only those it sees. */
enum { PREFILL_TILE = 8 };

#if defined(__AVX512F__) && !defined(CONTBATCH_NATIVE_PORTABLE)
#include <immintrin.h>
#define PAGED_PREFILL_LANES 1
enum { LANES = 16 }; /* floats in a 512-bit vector */
enum { SCORE_KEYS = 8 }; /* keys whose scores one pass sums for 32 rows: 16 vector registers */

/* qt[d RP + r] = rows_q[r D + d] for r < rows, 0 for the padding rows up to RP (a gather a
   vector) */
static void transpose_rows(const float *rows_q, int64_t rows, int64_t D, int64_t RP, float *qt) {
  const __m512i row = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t c = 0; c < RP; c += LANES) {
    const int64_t live = rows - c < 0 ? 0 : rows - c > LANES ? LANES : rows - c;
    const __mmask16 mask = (__mmask16)((1u << live) - 1);
    const __m512i first = _mm512_add_epi32(row, _mm512_set1_epi32((int)c)); /* the lanes' rows */
    const __m512i where = _mm512_mullo_epi32(first, _mm512_set1_epi32((int)D));
    for (int64_t d = 0; d < D; d++)
      _mm512_storeu_ps(qt + d * RP + c, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, where, rows_q + d, 4));
  }
}

/* key i's scores (two vectors of rows, scaled) stored at wi, and each lane's largest score over
   the keys it sees (i < seen) kept in top */
static inline __attribute__((always_inline)) void keep_scores(float *wi, __m512 a, __m512 b, __m512 s, int64_t i,
                                                              __m512i seen_a, __m512i seen_b, __m512 *top_a,
                                                              __m512 *top_b) {
  a = _mm512_mul_ps(a, s), b = _mm512_mul_ps(b, s);
  _mm512_storeu_ps(wi, a), _mm512_storeu_ps(wi + LANES, b);
  const __m512i key = _mm512_set1_epi32((int)i);
  *top_a = _mm512_mask_max_ps(*top_a, _mm512_cmpgt_epi32_mask(seen_a, key), *top_a, a);
  *top_b = _mm512_mask_max_ps(*top_b, _mm512_cmpgt_epi32_mask(seen_b, key), *top_b, b);
}

/* `attend` with the tile's rows as vector lanes (AVX-512, D a multiple of 16): the queries and
   the scores are kept [d or key, RP] with RP = rows rounded up to 32 (two vectors, the padding
   rows zero), so the scores' sums run down lanes, SCORE_KEYS keys at a time, each key element
   broadcast to all the rows at once; each row's largest score is kept as the scores are stored.
   The weighted values are `values_avx512`'s over the rows (weights [L, RP]: rs = 1, ks = RP),
   divided by each row's sum of weights as they are stored. `buffer` holds RP (D + L + 3) floats.
   The loops the compiler vectorises (the softmax) use 512-bit vectors too, which -march=native
   alone does not choose on every CPU: the prefill attention 8 % faster on the CPU measured. */
__attribute__((target("prefer-vector-width=512"))) static void attend_lanes(
    const float *rows_q, int64_t rows, const float *keys, const float *values, const int64_t *off, int64_t L,
    int64_t D, float scale, float *buffer, float *ob, int64_t first_len, int64_t group) {
  const int64_t RP = (rows + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
  float *qt = buffer, *w = qt + D * RP, *top = w + L * RP, *inv = top + RP; /* [D, RP], [L, RP], [RP], [RP] */
  int32_t *seen = (int32_t *)(inv + RP); /* [RP]: row r sees the first seen[r] keys (a padding row all) */
  for (int64_t r = 0; r < RP; r++) seen[r] = (int32_t)(r < rows ? first_len + r / group : L);
  transpose_rows(rows_q, rows, D, RP, qt);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < RP; c += 2 * LANES) {
    const __m512i seen_a = _mm512_loadu_si512(seen + c), seen_b = _mm512_loadu_si512(seen + c + LANES);
    __m512 top_a = _mm512_set1_ps(-INFINITY), top_b = top_a;
    int64_t i = 0;
    for (; i + SCORE_KEYS <= L; i += SCORE_KEYS) {
      const float *k[SCORE_KEYS];
      __m512 a[SCORE_KEYS], b[SCORE_KEYS];
      for (int j = 0; j < SCORE_KEYS; j++) k[j] = keys + off[i + j], a[j] = _mm512_setzero_ps(), b[j] = a[j];
      for (int64_t d = 0; d < D; d++) {
        const __m512 qa = _mm512_loadu_ps(qt + d * RP + c), qb = _mm512_loadu_ps(qt + d * RP + c + LANES);
        for (int j = 0; j < SCORE_KEYS; j++) {
          const __m512 x = _mm512_set1_ps(k[j][d]);
          a[j] = _mm512_fmadd_ps(qa, x, a[j]), b[j] = _mm512_fmadd_ps(qb, x, b[j]);
        }
      }
      for (int j = 0; j < SCORE_KEYS; j++)
        keep_scores(w + (i + j) * RP + c, a[j], b[j], s, i + j, seen_a, seen_b, &top_a, &top_b);
    }
    for (; i < L; i++) {
      const float *k = keys + off[i];
      __m512 a = _mm512_setzero_ps(), b = a;
      for (int64_t d = 0; d < D; d++) {
        const __m512 x = _mm512_set1_ps(k[d]);
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * RP + c), x, a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * RP + c + LANES), x, b);
      }
      keep_scores(w + i * RP + c, a, b, s, i, seen_a, seen_b, &top_a, &top_b);
    }
    _mm512_storeu_ps(top + c, top_a), _mm512_storeu_ps(top + c + LANES, top_b);
  }
  /* the weights down each lane: every row sees the first first_len keys, so only the keys after
     them are masked (weight 0) */
  float *sum = inv;
  for (int64_t r = 0; r < RP; r++) sum[r] = 0.f;
  for (int64_t i = 0; i < first_len; i++) {
    float *wi = w + i * RP;
#pragma omp simd
    for (int64_t r = 0; r < RP; r++) {
      const float e = exp_nonpositive(wi[r] - top[r]);
      wi[r] = e;
      sum[r] += e;
    }
  }
  for (int64_t i = first_len; i < L; i++) {
    float *wi = w + i * RP;
#pragma omp simd
    for (int64_t r = 0; r < RP; r++) {
      const float e = i < seen[r] ? exp_nonpositive(wi[r] - top[r]) : 0.f;
      wi[r] = e;
      sum[r] += e;
    }
  }
  for (int64_t r = 0; r < RP; r++) inv[r] = 1.f / sum[r];
  values_avx512(values, off, L, rows, D, w, 1, RP, inv, ob);
}
#endif

int paged_prefill(const float *q, int64_t q_stride_row, const float *key_cache, const float *value_cache,
                  const int64_t *table, int64_t start, int64_t n, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                  int64_t stride_block, int64_t stride_offset, int64_t stride_head, float scale, float *out,
                  int num_threads) {
  const int64_t G = Hq / Hkv;
#ifdef PAGED_PREFILL_LANES
  const int by_lanes = D % 16 == 0; /* `attend_lanes`: as many positions as fill two vectors' lanes */
  const int64_t tile = by_lanes ? (G < 2 * LANES ? 2 * LANES / G : 1) : PREFILL_TILE;
#else
  const int64_t tile = PREFILL_TILE;
#endif
  const int64_t tiles = (n + tile - 1) / tile, rows = tile * G;
  int64_t *off = malloc(sizeof(int64_t) * (start + n)); /* every key's place, shared by the tasks */
  if (off == NULL) return 1;
  key_offsets(table, 0, start + n, bs, stride_block, stride_offset, off);
  int failed = 0;
  /* the last tiles see the most keys: taken first, then the shorter ones fill in */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
  for (int64_t task = 0; task < tiles * Hkv; task++) {
    const int64_t t = tiles - 1 - task / Hkv, h = task % Hkv, i0 = t * tile;
    const int64_t m = n - i0 < tile ? n - i0 : tile, L = start + i0 + m;
    const int64_t lanes = (rows + 31) / 32 * 32; /* `attend_lanes`'s rows, rounded up */
    /* queries, outputs, then [rows, L] weights (or `attend_lanes`'s buffer) */
    float *buffer = malloc(sizeof(float) * (2 * rows * D + lanes * (L + D + 3)));
    if (buffer == NULL) {
      failed = 1;
      continue;
    }
    float *tile_q = buffer, *tile_out = buffer + rows * D, *weights = buffer + 2 * rows * D;
    for (int64_t i = 0; i < m; i++) /* position i0 + i's query heads of KV head h: rows i * G ... */
      memcpy(tile_q + i * G * D, q + (i0 + i) * q_stride_row + h * G * D, sizeof(float) * G * D);
    const float *keys = key_cache + h * stride_head, *values = value_cache + h * stride_head;
#ifdef PAGED_PREFILL_LANES
    if (by_lanes)
      attend_lanes(tile_q, m * G, keys, values, off, L, D, scale, weights, tile_out, start + i0 + 1, G);
    else
#endif
      attend(tile_q, m * G, keys, values, off, L, D, scale, weights, tile_out, start + i0 + 1, G);
    for (int64_t i = 0; i < m; i++)
      memcpy(out + ((i0 + i) * Hq + h * G) * D, tile_out + i * G * D, sizeof(float) * G * D);
    free(buffer);
  }
  free(off);
  return failed;
}
