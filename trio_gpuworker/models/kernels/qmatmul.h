/* A template, included once per instance: defines QMM_NAME(y, ys, x, xs, w, O, nb, n), which computes
   y[t*ys + o] = x[t] . W[o] for t < n (a multiple of QMM_NT) and o < O (a multiple of G), W packed in
   GGML type QMM_TYPE with its rows grouped G at a time (models/quant.py group()). A G x QMM_NT tile of
   accumulators hides the FMA latency; each dequantised block is reused for QMM_NT rows of x.
   Needs: G; QMM_NAME, QMM_TYPE, QMM_NT (undefined again at the end). */
#include "quant.h"

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  for (int o = 0; o < O; o += G) for (int t = 0; t < n; t += QMM_NT) {
    const unsigned char *g = w + (long)o * nb * BS(QMM_TYPE);
    v16 acc[G][QMM_NT], acc2[G][QMM_NT];
    for (int r = 0; r < G; r++) for (int j = 0; j < QMM_NT; j++) acc[r][j] = acc2[r][j] = (v16)0;
    for (int b = 0; b < nb; b++) {
      v16 wl[G], wh[G];
      for (int r = 0; r < G; r++) DQ(QMM_TYPE)(g + (b * G + r) * BS(QMM_TYPE), &wl[r], &wh[r]);
      for (int j = 0; j < QMM_NT; j++) {
        const float *xp = x + (t + j) * xs + b * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
        /* one row of x: lo and hi halves get their own accumulators, for twice the independent FMA chains */
        for (int r = 0; r < G; r++) if (QMM_NT == 1) { acc[r][j] += wl[r] * xl; acc2[r][j] += wh[r] * xh; }
                                    else { acc[r][j] += wl[r] * xl; acc[r][j] += wh[r] * xh; }
      }
    }
    for (int r = 0; r < G; r++) for (int j = 0; j < QMM_NT; j++) y[(t + j) * ys + o + r] = hsum(acc[r][j] + acc2[r][j]);
  }
}

#undef QMM_NAME
#undef QMM_TYPE
#undef QMM_NT
