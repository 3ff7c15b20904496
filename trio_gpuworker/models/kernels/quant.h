/* Packed GGUF blocks (models/quant.py) dequantised in registers: DQ(t)(p, &lo, &hi) gives the 32 weights of
   the block at p. Q4_1 (type 3): {f32 d, f32 m, 16 nibble bytes}; Q8_0 (type 8): {f32 d, 32 int8}; F32
   (type 0): the 32 weights, dequantised at load from a type with no packed layout of its own. */
#ifndef TG_QUANT_H
#define TG_QUANT_H
#include "vec.h"

#define BS_0 128  /* packed bytes per block, by GGML type */
#define BS_3 24
#define BS_8 36
#define BS(t) CAT(BS_, t)
#define DQ(t) CAT(dq, t)

INL void dq3(const unsigned char *p, v16 *lo, v16 *hi) {
  float d = ((const float *)p)[0], m = ((const float *)p)[1];
#ifdef __AVX512F__
  /* the block's 16 possible weights, looked up by nibble (vpermps reads the low 4 bits of each index) */
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 tab = iota * d + m;  /* q*d is exact in float32 (4-bit q, f16 d): with or without FMA, the reference's weights */
  i16 q = __builtin_convertvector(*(const u16 *)(p + 8), i16);
  *lo = __builtin_ia32_permvarsf512(tab, q); *hi = __builtin_ia32_permvarsf512(tab, q >> 4);
#else
  /* each nibble byte widened to its own 32-bit lane first: masks and shifts of bytes would cost shuffles */
  i16 q = __builtin_shufflevector(__builtin_convertvector(*(const u8 *)(p + 8), i8),
                                  __builtin_convertvector(*(const u8 *)(p + 16), i8),
                                  0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  *lo = __builtin_convertvector(q & 15, v16) * d + m; *hi = __builtin_convertvector(q >> 4, v16) * d + m;
#endif
}

INL void dq0(const unsigned char *p, v16 *lo, v16 *hi) {
  *lo = *(const v16 *)p; *hi = *(const v16 *)(p + 64);
}

INL void dq8(const unsigned char *p, v16 *lo, v16 *hi) {
  float d = *(const float *)p;
  *lo = __builtin_convertvector(*(const s16 *)(p + 4), v16) * d;
  *hi = __builtin_convertvector(*(const s16 *)(p + 20), v16) * d;
}
#endif
