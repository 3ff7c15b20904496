/* Vector width, exp, activations and LayerNorm for the fused BERT encoder, in float32 like the reference.
   Needs ACT (0 GELU with erf, HF "gelu"; 1 GELU with tanh; 2 ReLU). WIDE is optional (below). */
#ifndef TG_BERT_MATH_H
#define TG_BERT_MATH_H
#include "vec.h"

/* WIDE: AVX-512's vectors and tiles. A test defines WIDE 1 to run them on AVX2 too (slowly: clang splits
   each vector in two and the tiles spill), which checks the wide tiling where no AVX-512 CPU is at hand. */
#ifndef WIDE
#ifdef __AVX512F__
#define WIDE 1
#else
#define WIDE 0
#endif
#endif

#if WIDE
typedef float vf __attribute__((ext_vector_type(16), aligned(4)));
typedef int vi __attribute__((ext_vector_type(16)));
#define VW 16
/* 10 rows x 32 columns: 20 accumulators. On an Intel Xeon (AVX-512, 2026-12-03) tiles of 11 or 12 rows ran at
   20-25 GFLOP/s and tiles of 6-10 rows at 126-131, everything in L1. 12 was chosen on an AMD EPYC, where 10 was
   not measured. Each row's sum over k runs in the same order either way, so the output does not depend on MR. */
#define MR 10
#else
typedef float vf __attribute__((ext_vector_type(8), aligned(4)));
typedef int vi __attribute__((ext_vector_type(8)));
#define VW 8
#define MR 6
#endif

INL float vsum(vf a) {
  float s = 0;
  for (int i = 0; i < VW; i++) s += a[i];
  return s;
}

INL float vmax(vf a) {
  float s = a[0];
  for (int i = 1; i < VW; i++) s = a[i] > s ? a[i] : s;
  return s;
}

/* e^x in float32 to ~1 ulp (Cephes expf): x = n ln2 + r, |r| <= ln2/2, a polynomial in r. Exactly 0 below
   -87.3 (far-below-max softmax terms); +inf from about 88.4 (callers pass x <= 0 or tolerate inf) */
INL vf vexpf(vf x) {
  vf lo = (vf)-87.33654f;
  vi under = x < lo;
  x = __builtin_elementwise_min(__builtin_elementwise_max(x, lo), (vf)88.72283f);
  vf n = __builtin_elementwise_floor(x * 1.44269504088896341f + 0.5f);
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = (vf)1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return (vf)((vi)(p * (vf)e) & ~under);
}

/* erf(x) to ~2 ulp near 0 and ~3e-7 absolute elsewhere: Cephes erff's odd polynomial below |x| = 1, above
   it 1 - erfc with Abramowitz & Stegun 7.1.26's erfc (which cancels badly near 0) */
INL vf verf(vf x) {
  vi sign = (vi)x & (vi)0x80000000;
  vf ax = (vf)((vi)x & (vi)0x7fffffff), z = x * x;
  vf small = ((((((7.853861353153693e-5f * z - 8.010193625184903e-4f) * z + 5.188327685732524e-3f) * z
                 - 2.685381193529856e-2f) * z + 1.128358514861418e-1f) * z - 3.761262582423300e-1f) * z
              + 1.128379165726710f) * x;
  vf t = 1.0f / (1.0f + 0.3275911f * ax);
  vf y = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
  vf large = (vf)((vi)(1.0f - y * vexpf(-z)) | sign);
  vi near = ax < 1.0f;
  return (vf)(((vi)small & near) | ((vi)large & ~near));
}

INL vf act(vf x) {
#if ACT == 0
  return 0.5f * x * (1.0f + verf(x * 0.70710678118654752f));
#elif ACT == 1
  vf u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + (1.0f - 2.0f / (vexpf(2.0f * u) + 1.0f)));
#else
  return __builtin_elementwise_max(x, (vf)0);
#endif
}

/* x = (x - mean) / sqrt(var + eps) * w + b over n floats (n a multiple of VW), two passes */
INL void layernorm(float *restrict x, const float *restrict w, const float *restrict b, int n, float eps) {
  vf s = (vf)0;
  for (int i = 0; i < n; i += VW) s += *(const vf *)(x + i);
  float mean = vsum(s) / n;
  vf q = (vf)0;
  for (int i = 0; i < n; i += VW) { vf d = *(const vf *)(x + i) - mean; q += d * d; }
  float inv = 1.0f / __builtin_sqrtf(vsum(q) / n + eps);
  for (int i = 0; i < n; i += VW)
    *(vf *)(x + i) = (*(const vf *)(x + i) - mean) * inv * *(const vf *)(w + i) + *(const vf *)(b + i);
}
#endif
