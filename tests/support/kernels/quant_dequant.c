/* One entry point for the tinygrad bridge test (a tinygrad CPU program runs the first function of its image):
   every packed block of a ROWS x COLS matrix of GGML type TYPE, dequantised. Defines: ROWS, COLS, G, TYPE. */
#include "quant.h"

void dequant(float *restrict y, const unsigned char *restrict w) {
  for (int o = 0; o < ROWS; o++) for (int b = 0; b < COLS / 32; b++) {
    v16 lo, hi; dq_at(TYPE, w, o, COLS / 32, b, G, &lo, &hi);
    float *yb = y + (long)o * COLS + b * 32;
    for (int i = 0; i < 16; i++) { yb[i] = lo[i]; yb[16 + i] = hi[i]; }
  }
}
