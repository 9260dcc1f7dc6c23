/* Decode attention read in place from a paged KV cache (contbatch.engine.native).

   One query token per row b: out[b, i] = softmax(scale * q[b, i] . k) v over the keys at the
   row's positions [lo[b], hi[b]) of its block table, query head i reading KV head i / (Hq / Hkv)
   (transformers' `repeat_kv`). Position p of row b lives in block tables[b * W + p / bs], at
   offset p % bs; element d of head h of that slot is at
   block * stride_block + offset * stride_offset + h * stride_head + d (head_dim contiguous).
   Row b's query heads are q[b * q_stride_row + i * D + d] (heads and head_dim contiguous); out
   is [B, Hq, D] contiguous. Every row has at least one key (lo < hi). Returns 0, or 1 when a
   scores buffer could not be allocated (out is then incomplete).

   Rows and KV heads are split over `num_threads` OpenMP threads: the process's OpenMP runtime,
   which torch has loaded, so its threads are torch's own (the loader checks that). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline const float *slot(const float *cache, const int64_t *table, int64_t p, int64_t bs,
                                int64_t stride_block, int64_t stride_offset) {
  return cache + table[p / bs] * stride_block + (p % bs) * stride_offset;
}

int paged_decode(const float *q, int64_t q_stride_row, const float *key_cache, const float *value_cache,
                 const int64_t *tables, int64_t W, const int64_t *lo, const int64_t *hi, int64_t B, int64_t Hq,
                 int64_t Hkv, int64_t D, int64_t bs, int64_t stride_block, int64_t stride_offset,
                 int64_t stride_head, float scale, float *out, int num_threads) {
  const int64_t G = Hq / Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : failed)
  for (int64_t task = 0; task < B * Hkv; task++) {
    const int64_t b = task / Hkv, h = task % Hkv, first = lo[b], L = hi[b] - lo[b];
    const float *qb = q + b * q_stride_row + h * G * D;
    const float *keys = key_cache + h * stride_head, *values = value_cache + h * stride_head;
    const int64_t *table = tables + b * W;
    float *ob = out + (b * Hq + h * G) * D;
    float *weights = malloc(sizeof(float) * G * L);
    if (weights == NULL) {
      failed = 1;
      continue;
    }
    for (int64_t i = 0; i < L; i++) { /* scores, each key read once for the G query heads */
      const float *k = slot(keys, table, first + i, bs, stride_block, stride_offset);
      for (int64_t g = 0; g < G; g++) {
        const float *qg = qb + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];
        weights[g * L + i] = dot * scale;
      }
    }
    for (int64_t g = 0; g < G; g++) { /* softmax */
      float *w = weights + g * L, top = w[0], sum = 0.f;
      for (int64_t i = 1; i < L; i++) top = w[i] > top ? w[i] : top;
      for (int64_t i = 0; i < L; i++) {
        w[i] = expf(w[i] - top);
        sum += w[i];
      }
      const float inv = 1.f / sum;
      for (int64_t i = 0; i < L; i++) w[i] *= inv;
    }
    memset(ob, 0, sizeof(float) * G * D);
    for (int64_t i = 0; i < L; i++) { /* the weighted values, each value read once */
      const float *v = slot(values, table, first + i, bs, stride_block, stride_offset);
      for (int64_t g = 0; g < G; g++) {
        const float w = weights[g * L + i];
        float *og = ob + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) og[d] += w * v[d];
      }
    }
    free(weights);
  }
  return failed;
}
