/* Multi-head self-attention of one packed sequence and one head, in float32 like the reference. Rows are a
   sequence's own tokens only (no padding), so no mask is needed. Needs HD (head dim), MAXLP. */
#ifndef TG_BERT_ATTENTION_H
#define TG_BERT_ATTENTION_H
#include "gemm.h"

/* ctx[i * ldc + 0..HD) = softmax_j(q_i . k_j / sqrt(HD)) v_j for i, j < L. q, k, v: rows of stride ld.
   kv: scratch for K transposed into panels of PW keys (HD x PW each), then V's rows packed (L x HD): read in
   place, each row of V sits on its own page (a TLB miss per row, half the speed at L = 200); sc: scratch for
   MR rows of scores. */
INL void attend(int L, const float *restrict q, const float *restrict k, const float *restrict v, long ld,
                float *restrict ctx, long ldc, float *restrict kv, float *restrict sc) {
  int lp = (L + NR - 1) / NR * NR;
  float *restrict kt = kv, *restrict vp = kv + (long)HD * lp;
  for (int p = 0; p < lp; p += PW) for (int d = 0; d < HD; d++) for (int jj = 0; jj < PW; jj++)
    kt[(long)p * HD + d * PW + jj] = p + jj < L ? k[(p + jj) * ld + d] : 0.0f;
  for (int j = 0; j < L; j++) for (int d = 0; d < HD; d++) vp[j * HD + d] = v[j * ld + d];
  const float scale = 1.0f / __builtin_sqrtf((float)HD);
  for (int i0 = 0; i0 < L; i0 += MR) {
    int mr = L - i0 < MR ? L - i0 : MR;
    for (int p = 0; p < lp; p += TW)
      micro_store(mr, HD, q + i0 * ld, ld, kt + (long)p * HD, PW, SECOND(HD), sc + p, MAXLP, scale);
    for (int r = 0; r < mr; r++) {
      float *s = sc + r * MAXLP;
      for (int j = L; j < lp; j++) s[j] = -__builtin_inff();
      vf m = (vf)-__builtin_inff();
      for (int j = 0; j < lp; j += VW) m = __builtin_elementwise_max(m, *(vf *)(s + j));
      float mx = vmax(m);
      vf sum = (vf)0;
      for (int j = 0; j < lp; j += VW) { vf e = vexpf(*(vf *)(s + j) - mx); *(vf *)(s + j) = e; sum += e; }
      float inv = 1.0f / vsum(sum);
      for (int j = 0; j < lp; j += VW) *(vf *)(s + j) *= inv;
    }
#if HD % TW == 0
    for (int h = 0; h < HD; h += TW)
      micro_store(mr, L, sc, MAXLP, vp + h, HD, VW, ctx + i0 * ldc + h, ldc, 1.0f);
#else
    for (int r = 0; r < mr; r++) {
      float o[HD];
      for (int d = 0; d < HD; d++) o[d] = 0;
      for (int j = 0; j < L; j++) for (int d = 0; d < HD; d++) o[d] += sc[r * MAXLP + j] * vp[j * HD + d];
      for (int d = 0; d < HD; d++) ctx[(i0 + r) * ldc + d] = o[d];
    }
#endif
  }
}
#endif
