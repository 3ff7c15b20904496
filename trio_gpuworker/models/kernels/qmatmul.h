/* A template, included once per instance: defines QMM_NAME(y, ys, x, xs, w, O, nb, n), which computes
   y[t*ys + o] = x[t] . W[o] for t < n (a multiple of QMM_NT) and o < O (a multiple of G), W packed in
   GGML type QMM_TYPE with its rows grouped G at a time (models/quant.py group()). A G x QMM_NT tile of
   accumulators hides the FMA latency; each dequantised block is reused for QMM_NT rows of x.
   QMM_SPLIT (default: QMM_NT == 1) gives each row of x two accumulators, as a single row has: a multi-row
   tile with it computes every row bit for bit as a one-row call does (kernels/llama_forward.c's batched decode).
   QMM_STAGE (default 0), when at least nb, dequantises each group of G rows once into a stack buffer that every
   tile of QMM_NT rows then reads (a batched step's rows in tiles of 2: 4 rows x 2 accumulators would spill).
   Without AVX-512 (16 registers of 8 floats: a v16 takes two) a G-row tile spills its accumulators (measured 1.5x
   slower), so each pass takes one row of W against up to 4 rows of x, whatever QMM_NT, dequantising as it goes
   (staging measured slower there; QMM_STAGE is ignored). Which rows go together never changes a row's sums: every
   output is bit for bit the same on either path.
   Needs: G; QMM_NAME, QMM_TYPE, QMM_NT (undefined again at the end, with QMM_SPLIT and QMM_STAGE). */
#include "quant.h"
#ifndef QMM_SPLIT
#define QMM_SPLIT (QMM_NT == 1)
#endif
#ifndef QMM_STAGE
#define QMM_STAGE 0
#endif

#ifdef __AVX512F__
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
#else
/* rows x[t..t+k) against W row wr: k (1, 2 or 4) a constant wherever this is inlined */
INL void CAT(QMM_NAME, _rows)(float *restrict y, int ys, const float *restrict x, int xs,
                              const unsigned char *restrict wr, int nb, int k) {
  v16 acc[4], acc2[4];
  for (int j = 0; j < k; j++) acc[j] = acc2[j] = (v16)0;
  if (QMM_SPLIT && k > 2) {
    /* 4 rows x 2 accumulators would spill: the low halves of every block, then the high halves (the same sums) */
    for (int b = 0; b < nb; b++) {
      v16 wl, wh;
      __builtin_prefetch(wr + (long)(4 * G * nb + b * G) * BS(QMM_TYPE));
      DQ(QMM_TYPE)(wr + (long)b * G * BS(QMM_TYPE), &wl, &wh);
      for (int j = 0; j < k; j++) acc[j] += wl * *(const v16 *)(x + j * xs + b * 32);
    }
    for (int b = 0; b < nb; b++) {
      v16 wl, wh;
      DQ(QMM_TYPE)(wr + (long)b * G * BS(QMM_TYPE), &wl, &wh);
      for (int j = 0; j < k; j++) acc2[j] += wh * *(const v16 *)(x + j * xs + b * 32 + 16);
    }
  } else {
    for (int b = 0; b < nb; b++) {
      v16 wl, wh;
      __builtin_prefetch(wr + (long)(4 * G * nb + b * G) * BS(QMM_TYPE));
      DQ(QMM_TYPE)(wr + (long)b * G * BS(QMM_TYPE), &wl, &wh);
      for (int j = 0; j < k; j++) {
        const float *xp = x + j * xs + b * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
        if (QMM_SPLIT) { acc[j] += wl * xl; acc2[j] += wh * xh; }
        else { acc[j] += wl * xl; acc[j] += wh * xh; }
      }
    }
  }
  for (int j = 0; j < k; j++) y[j * ys] = hsum(acc[j] + acc2[j]);
}

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  for (int o = 0; o < O; o += G) for (int r = 0; r < G; r++) {
    const unsigned char *wr = w + ((long)o * nb + r) * BS(QMM_TYPE);
    int t = 0;
    for (; t + 4 <= n; t += 4) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, wr, nb, 4);
    for (; t + 2 <= n; t += 2) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, wr, nb, 2);
    for (; t < n; t++) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, wr, nb, 1);
  }
}
#endif

#undef QMM_NAME
#undef QMM_TYPE
#undef QMM_NT
#undef QMM_SPLIT
#undef QMM_STAGE
