/* Single-precision matmul tiles over packed panels, with fused epilogues (the fused BERT encoder).
   A micro tile is up to MR rows x TW columns of accumulators, kept in registers for the whole k loop:
   AVX2 6 x 16 (12 of 16 ymm registers), AVX-512 10 x 32 (20 of 32 zmm). Weights are packed in panels of
   PW columns, k rows of PW floats each (models/bert_fused.py panels), so a tile reads its weights as one
   (AVX2) or two (AVX-512) sequential streams, and an AVX2 tile's panel (k x 64 bytes) stays in L1 while
   the row tiles of a block pass over it (panels twice as wide ran 10-20% slower). Column counts are
   multiples of NR. */
#ifndef TG_GEMM_H
#define TG_GEMM_H
#include "bert_math.h"

#define PW 16       /* packed panel width, in columns */
#define NR 32       /* column counts (and attention's padded key counts) are multiples of this */
#define TW (2 * VW) /* micro tile width, in columns: one panel (AVX2) or two (AVX-512) */
/* from a tile's first vector of weights to its second, in panels of k rows: the same panel row (AVX2) or
   the next panel's (AVX-512) */
#define SECOND(k) (VW == PW ? (long)(k) * PW : (long)VW)

/* epilogues, constants after inlining */
#define EPI_STORE 0     /* c = acc * scale */
#define EPI_BIAS 1      /* c = acc + bias */
#define EPI_BIAS_ACT 2  /* c = act(acc + bias) */
#define EPI_BIAS_RES 3  /* c = acc + bias + c (a residual, in place) */

/* c[r * ldc + 0..TW) = epi(sum_k a[r * lda + k] * (b[k * ldb + 0..VW) | b[k * ldb + b2 + 0..VW))) for r < mr;
   mr and epi are constants after inlining, so the accumulators live in registers. c may alias the residual,
   never a or b. */
INL void micro(const int mr, const int epi, int kc, const float *restrict a, long lda, const float *restrict b,
               long ldb, long b2, float *c, long ldc, const float *restrict bias, float scale) {
  vf acc[MR][2];
  for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (vf)0;
  for (int k = 0; k < kc; k++) {
    vf b0 = *(const vf *)(b + k * ldb), b1 = *(const vf *)(b + k * ldb + b2);
    for (int r = 0; r < mr; r++) {
      vf av = (vf)a[r * lda + k];
      acc[r][0] += av * b0; acc[r][1] += av * b1;
    }
  }
  vf bias0 = (vf)0, bias1 = (vf)0;
  if (epi != EPI_STORE) { bias0 = *(const vf *)bias; bias1 = *(const vf *)(bias + VW); }
  for (int r = 0; r < mr; r++) {
    vf *o = (vf *)(c + r * ldc), y0 = acc[r][0] + bias0, y1 = acc[r][1] + bias1;
    if (epi == EPI_STORE) { y0 = acc[r][0] * scale; y1 = acc[r][1] * scale; }
    if (epi == EPI_BIAS_ACT) { y0 = act(y0); y1 = act(y1); }
    if (epi == EPI_BIAS_RES) { y0 += o[0]; y1 += o[1]; }
    o[0] = y0; o[1] = y1;
  }
}

#define MICRO_CASE(n) case n: micro(n, epi, kc, a, lda, b, ldb, b2, c, ldc, bias, scale); break;
/* a micro tile of any height 1..MR, each height compiled on its own */
INL void micro_any(int mr, const int epi, int kc, const float *restrict a, long lda, const float *restrict b,
                   long ldb, long b2, float *c, long ldc, const float *restrict bias, float scale) {
  switch (mr) {
    MICRO_CASE(1) MICRO_CASE(2) MICRO_CASE(3) MICRO_CASE(4) MICRO_CASE(5) MICRO_CASE(6)
#if MR > 6
    MICRO_CASE(7) MICRO_CASE(8) MICRO_CASE(9) MICRO_CASE(10)
#endif
#if MR > 10
    MICRO_CASE(11) MICRO_CASE(12)
#endif
  }
}

/* c[m x n] (row stride ldc) = epi(a[m x k] (row stride lda) . w) with w packed in panels of PW columns and
   bias[n]; n a multiple of NR. Tile columns outermost: their panels stay in cache while every row tile
   reads them. */
INL void gemm(const int epi, int m, int n, int k, const float *restrict a, long lda, const float *restrict w,
              float *c, long ldc, const float *restrict bias) {
  for (int p = 0; p < n; p += TW) for (int r = 0; r < m; r += MR)
    micro_any(m - r < MR ? m - r : MR, epi, k, a + r * lda, lda, w + (long)p * k, PW, SECOND(k), c + r * ldc + p,
              ldc, bias + p, 1.0f);
}

/* one out-of-line copy of each kind: inlining every tile height into every call site multiplied the code
   (and the compile time) several times over, for no speed. Out-of-line functions are emitted after the
   kernel's entry point, which tinygrad runs as the first code of the image. */
#define NOINL static __attribute__((noinline))
NOINL void gemm_bias(int m, int n, int k, const float *restrict a, long lda, const float *restrict w, float *c,
                     long ldc, const float *restrict bias) { gemm(EPI_BIAS, m, n, k, a, lda, w, c, ldc, bias); }
NOINL void gemm_bias_act(int m, int n, int k, const float *restrict a, long lda, const float *restrict w, float *c,
                         long ldc, const float *restrict bias) { gemm(EPI_BIAS_ACT, m, n, k, a, lda, w, c, ldc, bias); }
NOINL void gemm_bias_res(int m, int n, int k, const float *restrict a, long lda, const float *restrict w, float *c,
                         long ldc, const float *restrict bias) { gemm(EPI_BIAS_RES, m, n, k, a, lda, w, c, ldc, bias); }
NOINL void micro_store(int mr, int kc, const float *restrict a, long lda, const float *restrict b, long ldb, long b2,
                       float *c, long ldc, float scale) {
  micro_any(mr, EPI_STORE, kc, a, lda, b, ldb, b2, c, ldc, 0, scale);
}
#endif
