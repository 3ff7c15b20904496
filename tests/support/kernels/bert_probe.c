/* Test entry points over kernels/gemm.h, bert_attention.h and bert_math.h (tests/test_bert_kernels.py).
   Defines: ACT, HD, MAXLP. */
#include "bert_attention.h"

/* c = epi(a . w + bias) for m x n (n a multiple of NR), w packed in panels; epi as in gemm.h */
void gemm_epi(int epi, int m, int n, int k, const float *a, const float *w, float *c, const float *bias) {
  switch (epi) {
    case EPI_BIAS: gemm_bias(m, n, k, a, k, w, c, n, bias); break;
    case EPI_BIAS_ACT: gemm_bias_act(m, n, k, a, k, w, c, n, bias); break;
    case EPI_BIAS_RES: gemm_bias_res(m, n, k, a, k, w, c, n, bias); break;
  }
}

/* qkv: L rows of q | k | v (HD each); ctx: L x HD */
void attention(int L, const float *qkv, float *ctx, float *kt, float *sc) {
  attend(L, qkv, qkv + HD, qkv + 2 * HD, 3 * HD, ctx, HD, kt, sc);
}

/* n a multiple of VW; which: 0 exp, 1 erf, 2 act */
void vmath(int which, const float *x, float *y, int n) {
  for (int i = 0; i < n; i += VW) {
    vf v = *(const vf *)(x + i);
    *(vf *)(y + i) = which == 0 ? vexpf(v) : which == 1 ? verf(v) : act(v);
  }
}

void norm_rows(float *x, const float *w, const float *b, int rows, int n, float eps) {
  for (int r = 0; r < rows; r++) layernorm(x + r * n, w, b, n, eps);
}
