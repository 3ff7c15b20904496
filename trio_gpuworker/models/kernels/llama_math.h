/* RMSNorm and a vectorised exp for the llama decoder, in the reference's precision. */
#ifndef TG_LLAMA_MATH_H
#define TG_LLAMA_MATH_H
#include "vec.h"

/* exp(x) of 8 softmax terms (x <= 0) to ~1 ulp: x = k ln2 + r, |r| <= ln2/2, degree-12 Taylor series of e^r;
   a libm call per term was most of the attention time */
INL v8d vexp(v8d x) {
  v8l under = x < -708.0;
  x = (v8d)(((v8l)x & ~under) | ((v8l)(v8d)-708.0 & under));
  v8d k = (x * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;
  v8d r = x - k * 6.93147180369123816490e-01 - k * 1.90821492927058770002e-10, p = (v8d)(1.0 / 479001600.0);
  for (int i = 11; i >= 1; i--) { double f = 1; for (int j = 2; j <= i; j++) f *= j; p = p * r + 1.0 / f; }
  p = p * r + 1.0;
  return p * (v8d)((__builtin_convertvector(k, v8l) + 1023) << 52);
}

/* h = x / sqrt(mean(x^2) + eps) * w over n elements; the sum of squares in double, like the reference's */
INL void rmsnorm(float *restrict h, const float *restrict x, const float *restrict w, int n, float eps) {
  double ss = 0; for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
  float s = __builtin_sqrtf((float)(ss / n) + eps);
  for (int i = 0; i < n; i++) h[i] = x[i] / s * w[i];
}
#endif
