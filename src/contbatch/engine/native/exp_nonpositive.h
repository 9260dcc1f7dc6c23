/* The native kernels' exponential (contbatch.engine.native): plain arithmetic, so that the
   compiler vectorises the loops that call it (with -fno-trapping-math its clamp is a blend). */

#ifndef CONTBATCH_EXP_NONPOSITIVE_H
#define CONTBATCH_EXP_NONPOSITIVE_H

#include <stdint.h>

/* exp(x) for x <= 0, to about 1 ulp (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a
   polynomial in r, times 2^n built in the exponent bits); x below -87 counts as -87 (exp(-87) is
   1.6e-38: nothing beside a softmax's largest term, 1). */
static inline float exp_nonpositive(float x) {
  const float round = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
  x = x > -87.0f ? x : -87.0f;
  const float n = (x * 1.44269504088896341f + round) - round;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  union {
    int32_t i;
    float f;
  } two_n = {.i = ((int32_t)n + 127) << 23};
  return p * two_n.f;
}

#endif
