/* Test entry points over kernels/quant.h and kernels/qmatmul.h (tests/test_llama_quant.py).
   Defines: ROWS, COLS, NX (rows of x), NT, G, TYPE, BATCHED_NT, BATCHED_SPLIT. */
#include "quant.h"

#define QMM_NAME mm
#define QMM_TYPE TYPE
#define QMM_NT NT
#include "qmatmul.h"
/* the batched decode's instance, as models/llama_fused.py BATCHED has it (BATCHED_NT, BATCHED_SPLIT) */
#define QMM_NAME mms
#define QMM_TYPE TYPE
#define QMM_NT BATCHED_NT
#define QMM_SPLIT BATCHED_SPLIT
#include "qmatmul.h"

/* every packed block of a ROWS x COLS matrix, dequantised in place of the float32 matrix */
void dequant(float *restrict y, const unsigned char *restrict w) {
  for (int o = 0; o < ROWS; o++) for (int b = 0; b < COLS / 32; b++) {
    v16 lo, hi; dq_at(TYPE, w, o, COLS / 32, b, G, &lo, &hi);
    float *yb = y + (long)o * COLS + b * 32;
    for (int i = 0; i < 16; i++) { yb[i] = lo[i]; yb[16 + i] = hi[i]; }
  }
}

void matvec(float *restrict y, const float *restrict x, const unsigned char *restrict w) {
  mm(y, ROWS, x, COLS, w, ROWS, COLS / 32, NX);
}

void matvec_split(float *restrict y, const float *restrict x, const unsigned char *restrict w) {
  mms(y, ROWS, x, COLS, w, ROWS, COLS / 32, NX);
}
