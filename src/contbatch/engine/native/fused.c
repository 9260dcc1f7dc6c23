/* Elementwise steps of the decoder layer, fused (contbatch.engine.native).

   add_rms_norm: for each of `rows` rows of n floats, x += delta (when delta is not NULL), then
   y = weight * (x / sqrt(mean(x^2) + eps)): transformers' residual add and LlamaRMSNorm in one
   pass over the row (x and y distinct).
   silu_mul: out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i], the gated MLP's activation
   (gate_up [rows, 2n], out [rows, n]), silu(x) = x * sigmoid(x) (silu.h).
   rotate_in_place: each of `heads` heads of d floats of each of `rows` rows of x (rows
   `row_stride` floats apart, heads d apart: the q and k heads of the fused projection's output)
   rotated in place by that row's cos and sin (rows `trig_stride` apart, d floats whose halves
   repeat): with halves x1, x2 and c, s, x1 <- x1 c - x2 s and x2 <- x2 c + x1 s, each product
   rounded before the sum (no fused multiply-add), so the bits are transformers' rotate-half
   x cos + rotate_half(x) sin, in one pass and without a new tensor.

   Float32, contiguous rows. Large calls (prefill) hand their rows, ROWS_PER_GRAB at a time, to
   whichever of `num_threads` OpenMP threads is free (torch's own: the loader checks that the
   runtime is torch's libgomp), so a thread that loses its core holds up only its own rows; a
   decode step's few rows run on the calling thread, which costs less than waking the team. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "silu.h"

enum { PARALLEL_ELEMENTS = 1 << 16, ROWS_PER_GRAB = 8 };

void add_rms_norm(float *x, const float *delta, const float *weight, float *y, int64_t rows, int64_t n, float eps,
                  int num_threads) {
#pragma omp parallel for schedule(dynamic, ROWS_PER_GRAB) num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    float *xr = x + r * n, *yr = y + r * n, squares = 0.f;
    if (delta != NULL) {
      const float *dr = delta + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
    }
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
    const float inverse = 1.f / sqrtf(squares / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) yr[i] = weight[i] * (xr[i] * inverse);
  }
}

void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(dynamic, ROWS_PER_GRAB) num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = gate_up + r * 2 * n, *up = gate + n;
    float *o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = silu_times(gate[i], up[i]);
  }
}

/* fused multiply-adds would round once where transformers rounds each product: off here */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_in_place(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t trig_stride,
                     int64_t rows, int64_t heads, int64_t d, int num_threads) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int64_t half = d / 2;
#pragma omp parallel for schedule(dynamic, ROWS_PER_GRAB) num_threads(num_threads) \
    if (rows * heads * d >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos + r * trig_stride, *s = sin + r * trig_stride;
    for (int64_t h = 0; h < heads; h++) {
      float *x1 = x + r * row_stride + h * d, *x2 = x1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; i++) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
}
#pragma GCC pop_options
