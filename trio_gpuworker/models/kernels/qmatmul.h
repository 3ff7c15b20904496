/* A template, included once per instance: defines QMM_NAME(y, ys, x, xs, w, O, nb, n), which computes
   y[t*ys + o] = x[t] . W[o] for t < n and o < O (a multiple of G), W packed in layout QMM_TYPE (kernels/quant.h)
   with its rows grouped G at a time (models/quant.py group()), nb 32-weight sub-blocks a row: a block's shared
   scales are unpacked once for all its sub-blocks. Rows of x go QMM_NT at a time (fewer in a last tile), so each
   dequantised block serves up to QMM_NT rows; a tile of W rows x rows of x accumulators hides the FMA latency.
   QMM_SPLIT (default: QMM_NT == 1) gives each row of x two accumulators, as a single row has: a multi-row tile
   with it computes every row bit for bit as a one-row call does (kernels/llama_forward.c's batched decode).
   With AVX-512 (32 registers of 16 floats) a tile takes a group of G rows of W, or half a group for a split tile
   of more than 2 rows of x (4 x 4 x 2 accumulators would take every register). Without it (16 registers of 8
   floats: a v16 takes two) a G-row tile spills its accumulators (measured 1.5x slower), so each pass takes one
   row of W against up to 4 rows of x, dequantising as it goes. Which rows go together never changes a row's
   sums: every output is bit for bit the same on either path and in any tile.
   Needs: G; QMM_NAME, QMM_TYPE, QMM_NT (undefined again at the end, with QMM_SPLIT). */
#include "quant.h"
#ifndef QMM_SPLIT
#define QMM_SPLIT (QMM_NT == 1)
#endif
/* rows of W per AVX-512 tile: a 4-row split tile over a whole group would need 32 accumulators (all the
   registers), so it takes half a group */
#define QMM_GR (QMM_SPLIT && QMM_NT > 2 ? G / 2 : G)
#define QMM_SUBS SUBS(QMM_TYPE)
_Static_assert(QMM_NT >= 1 && QMM_NT <= 4, "qmatmul.h: a last tile takes at most 3 rows, so QMM_NT is 1 to 4");

#if defined(__AVX512VNNI__) && QMM_SPLIT && (QMM_TYPE == 3 || QMM_TYPE == 12 || QMM_TYPE == 14)
/* a decode step's K-quant matmul in integers (kernels/qmatmul_vnni.h) */
#include "qmatmul_vnni.h"
#elif defined(__AVX512F__)
/* rows x[t..t+k) against W rows r0..r0+GR of the group at g (k a constant wherever this is inlined): a tile of
   GR x k accumulators (x2 with QMM_SPLIT), each dequantised block used for all k rows */
INL void CAT(QMM_NAME, _tile)(float *restrict y, int ys, const float *restrict x, int xs,
                              const unsigned char *restrict g, int r0, int nb, int k) {
  v16 acc[QMM_GR][QMM_NT], acc2[QMM_GR][QMM_NT];
  for (int r = 0; r < QMM_GR; r++) for (int j = 0; j < k; j++) acc[r][j] = acc2[r][j] = (v16)0;
  for (int b = 0; b < nb / QMM_SUBS; b++) {
    const unsigned char *gb = g + (long)(b * G + r0) * BS(QMM_TYPE);
    /* a prefetch 4 groups ahead pays in a multi-row tile (bench/decode_steps.py on a Zen 4: 4 rows 7% faster, the
       prefill 1.6%), not in a one-row pass (9% slower in one run) */
    if (QMM_NT > 1) __builtin_prefetch(gb + 4 * G * ROWB(QMM_TYPE, nb));
    dqs st[QMM_GR];
    for (int r = 0; r < QMM_GR; r++) PREP(QMM_TYPE)(gb + r * BS(QMM_TYPE), &st[r]);
    for (int s = 0; s < QMM_SUBS; s++) {
      v16 wl[QMM_GR], wh[QMM_GR];
      for (int r = 0; r < QMM_GR; r++) DQ(QMM_TYPE)(gb + r * BS(QMM_TYPE), &st[r], s, &wl[r], &wh[r]);
      for (int j = 0; j < k; j++) {
        const float *xp = x + j * xs + (b * QMM_SUBS + s) * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
        /* one row of x: lo and hi halves get their own accumulators, for twice the independent FMA chains */
        for (int r = 0; r < QMM_GR; r++) if (QMM_SPLIT) { acc[r][j] += wl[r] * xl; acc2[r][j] += wh[r] * xh; }
                                         else { acc[r][j] += wl[r] * xl; acc[r][j] += wh[r] * xh; }
      }
    }
  }
#if TBS(QMM_TYPE)
  /* the rows' tails */
  const unsigned char *tg = g + (long)(nb / QMM_SUBS) * G * BS(QMM_TYPE);
  for (int u = 0; u < nb % QMM_SUBS; u++) {
    v16 wl[QMM_GR], wh[QMM_GR];
    for (int r = 0; r < QMM_GR; r++) DQT(QMM_TYPE)(tg + (long)(u * G + r0 + r) * TBS(QMM_TYPE), &wl[r], &wh[r]);
    for (int j = 0; j < k; j++) {
      const float *xp = x + j * xs + (nb / QMM_SUBS * QMM_SUBS + u) * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
      for (int r = 0; r < QMM_GR; r++) if (QMM_SPLIT) { acc[r][j] += wl[r] * xl; acc2[r][j] += wh[r] * xh; }
                                       else { acc[r][j] += wl[r] * xl; acc[r][j] += wh[r] * xh; }
    }
  }
#endif
  for (int r = 0; r < QMM_GR; r++) for (int j = 0; j < k; j++) y[j * ys + r0 + r] = hsum(acc[r][j] + acc2[r][j]);
}

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  for (int o = 0; o < O; o += G) {
    const unsigned char *g = w + o * ROWB(QMM_TYPE, nb);
    for (int r0 = 0; r0 < G; r0 += QMM_GR) {
      int t = 0;
      for (; t + QMM_NT <= n; t += QMM_NT) CAT(QMM_NAME, _tile)(y + t * ys + o, ys, x + t * xs, xs, g, r0, nb, QMM_NT);
      /* the rows left (a batched step with fewer sequences than its tile, a prefill chunk's last rows) in one
         tile: each call with a constant k, so its accumulators stay in registers */
      if (QMM_NT > 3 && n - t == 3) CAT(QMM_NAME, _tile)(y + t * ys + o, ys, x + t * xs, xs, g, r0, nb, 3);
      if (QMM_NT > 2 && n - t == 2) CAT(QMM_NAME, _tile)(y + t * ys + o, ys, x + t * xs, xs, g, r0, nb, 2);
      if (QMM_NT > 1 && n - t == 1) CAT(QMM_NAME, _tile)(y + t * ys + o, ys, x + t * xs, xs, g, r0, nb, 1);
    }
  }
}
#else
/* rows x[t..t+k) against W row r of the group at g: k (1 to 4) a constant wherever this is inlined */
INL void CAT(QMM_NAME, _rows)(float *restrict y, int ys, const float *restrict x, int xs,
                              const unsigned char *restrict g, int r, int nb, int k) {
  const unsigned char *restrict wr = g + (long)r * BS(QMM_TYPE);
  v16 acc[4], acc2[4];
  for (int j = 0; j < k; j++) acc[j] = acc2[j] = (v16)0;
  /* 4 rows x 2 accumulators would spill: with QMM_SPLIT and k > 2, the low halves of every block, then the high
     halves (the same sums) */
  const int passes = QMM_SPLIT && k > 2 ? 2 : 1;
  for (int pass = 0; pass < passes; pass++) for (int b = 0; b < nb / QMM_SUBS; b++) {
    const unsigned char *p = wr + (long)b * G * BS(QMM_TYPE);
    if (pass == 0) __builtin_prefetch(p + 4 * G * ROWB(QMM_TYPE, nb));
    dqs st;
    PREP(QMM_TYPE)(p, &st);
    for (int s = 0; s < QMM_SUBS; s++) {
      v16 wl, wh;
      DQ(QMM_TYPE)(p, &st, s, &wl, &wh);
      for (int j = 0; j < k; j++) {
        const float *xp = x + j * xs + (b * QMM_SUBS + s) * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
        if (passes == 2) { if (pass == 0) acc[j] += wl * xl; else acc2[j] += wh * xh; }
        else if (QMM_SPLIT) { acc[j] += wl * xl; acc2[j] += wh * xh; }
        else { acc[j] += wl * xl; acc[j] += wh * xh; }
      }
    }
  }
#if TBS(QMM_TYPE)
  /* the row's tail */
  for (int pass = 0; pass < passes; pass++) for (int u = 0; u < nb % QMM_SUBS; u++) {
    v16 wl, wh;
    DQT(QMM_TYPE)(g + (long)(nb / QMM_SUBS) * G * BS(QMM_TYPE) + (long)(u * G + r) * TBS(QMM_TYPE), &wl, &wh);
    for (int j = 0; j < k; j++) {
      const float *xp = x + j * xs + (nb / QMM_SUBS * QMM_SUBS + u) * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
      if (passes == 2) { if (pass == 0) acc[j] += wl * xl; else acc2[j] += wh * xh; }
      else if (QMM_SPLIT) { acc[j] += wl * xl; acc2[j] += wh * xh; }
      else { acc[j] += wl * xl; acc[j] += wh * xh; }
    }
  }
#endif
  for (int j = 0; j < k; j++) y[j * ys] = hsum(acc[j] + acc2[j]);
}

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  for (int o = 0; o < O; o += G) for (int r = 0; r < G; r++) {
    const unsigned char *g = w + o * ROWB(QMM_TYPE, nb);
    int t = 0;
    for (; t + 4 <= n; t += 4) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, g, r, nb, 4);
    /* the rows of x left in one pass, so each W row is dequantised once for them */
    if (n - t == 3) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, g, r, nb, 3);
    if (n - t == 2) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, g, r, nb, 2);
    if (n - t == 1) CAT(QMM_NAME, _rows)(y + t * ys + o + r, ys, x + t * xs, xs, g, r, nb, 1);
  }
}
#endif

#undef QMM_NAME
#undef QMM_TYPE
#undef QMM_NT
#undef QMM_SPLIT
#undef QMM_GR
#undef QMM_SUBS
