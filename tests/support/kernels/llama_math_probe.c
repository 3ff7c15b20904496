/* Test entry points over kernels/llama_math.h (tests/test_llama_quant.py). Defines: N, EPS. */
#include "llama_math.h"

void rms(float *restrict h, const float *restrict x, const float *restrict w, int rows) {
  for (int r = 0; r < rows; r++) rmsnorm(h + r * N, x + r * N, w, N, EPS);
}

/* n a multiple of 8 */
void exp8(double *restrict y, const double *restrict x, int n) {
  for (int i = 0; i < n; i += 8) *(v8d *)(y + i) = vexp(*(const v8d *)(x + i));
}
