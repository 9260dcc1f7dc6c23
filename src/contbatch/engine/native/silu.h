/* The gated MLP's activation (contbatch.engine.native): silu(g) * u, one element, the same
   expression wherever a kernel applies it (fused.c's silu_mul, gemm.c's gemm_gated), so both give
   the same bits. */

#ifndef CONTBATCH_SILU_H
#define CONTBATCH_SILU_H

#include "exp_nonpositive.h"

/* silu(g) u = g sigmoid(g) u, the sigmoid from e = exp(-|g|): g / (1 + e) for g > 0, g e / (1 + e)
   otherwise (no overflow for any g) */
static inline float silu_times(float g, float u) {
  const float e = exp_nonpositive(g > 0.f ? -g : g);
  return (g > 0.f ? g : g * e) / (1.f + e) * u;
}

#endif
