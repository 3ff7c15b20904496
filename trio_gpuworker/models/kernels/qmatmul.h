/* A template, included once per instance: defines QMM_NAME(y, ys, x, xs, w, O, nb, n), which computes
   y[t*ys + o] = x[t] . W[o] for t < n (a multiple of QMM_NT) and o < O (a multiple of G), W packed in
   GGML type QMM_TYPE with its rows grouped G at a time (models/quant.py group()). A G x QMM_NT tile of
   accumulators hides the FMA latency; each dequantised block is reused for QMM_NT rows of x.
   QMM_SPLIT (default: QMM_NT == 1) gives each row of x two accumulators, as a single row has: a multi-row
   tile with it computes every row bit for bit as a one-row call does (kernels/llama_forward.c's batched decode).
   QMM_STAGE (default 0), when at least nb, dequantises each group of G rows once into a stack buffer that every
   tile of QMM_NT rows then reads (a batched step's rows in tiles of 2: 4 rows x 2 accumulators would spill).
   Needs: G; QMM_NAME, QMM_TYPE, QMM_NT (undefined again at the end, with QMM_SPLIT and QMM_STAGE). */
#include "quant.h"
#ifndef QMM_SPLIT
#define QMM_SPLIT (QMM_NT == 1)
#endif
#ifndef QMM_STAGE
#define QMM_STAGE 0
#endif

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  for (int o = 0; o < O; o += G) {
    const unsigned char *g = w + (long)o * nb * BS(QMM_TYPE);
#if QMM_STAGE
    v16 st[QMM_STAGE][G][2];
    for (int b = 0; b < nb; b++) for (int r = 0; r < G; r++) DQ(QMM_TYPE)(g + (b * G + r) * BS(QMM_TYPE), &st[b][r][0], &st[b][r][1]);
#endif
    for (int t = 0; t < n; t += QMM_NT) {
    v16 acc[G][QMM_NT], acc2[G][QMM_NT];
    for (int r = 0; r < G; r++) for (int j = 0; j < QMM_NT; j++) acc[r][j] = acc2[r][j] = (v16)0;
    for (int b = 0; b < nb; b++) {
      v16 wl[G], wh[G];
#if QMM_STAGE
      for (int r = 0; r < G; r++) { wl[r] = st[b][r][0]; wh[r] = st[b][r][1]; }
#else
      for (int r = 0; r < G; r++) DQ(QMM_TYPE)(g + (b * G + r) * BS(QMM_TYPE), &wl[r], &wh[r]);
#endif
      for (int j = 0; j < QMM_NT; j++) {
        const float *xp = x + (t + j) * xs + b * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
        /* one row of x: lo and hi halves get their own accumulators, for twice the independent FMA chains */
        for (int r = 0; r < G; r++) if (QMM_SPLIT) { acc[r][j] += wl[r] * xl; acc2[r][j] += wh[r] * xh; }
                                    else { acc[r][j] += wl[r] * xl; acc[r][j] += wh[r] * xh; }
      }
    }
    for (int r = 0; r < G; r++) for (int j = 0; j < QMM_NT; j++) y[(t + j) * ys + o + r] = hsum(acc[r][j] + acc2[r][j]);
    }
  }
}

#undef QMM_NAME
#undef QMM_TYPE
#undef QMM_NT
#undef QMM_SPLIT
#undef QMM_STAGE
