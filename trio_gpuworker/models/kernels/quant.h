/* Packed GGUF blocks (models/quant.py LAYOUTS) dequantised in registers. A block of layout t holds BW(t) weights in
   BS(t) bytes, SUBS(t) sub-blocks of 32: PREP(t)(p, &st) unpacks what the block's sub-blocks share (the K-quants'
   scales, widened once per block), then DQ(t)(p, &st, s, &lo, &hi) gives the 32 weights of sub-block s.
   Q8_0 (type 8): {f32 d, 32 int8}; F32 (type 0): the 32 weights, dequantised at load from a type with no packed
   layout of its own. Q4_1 (type 3), 256 weights a block: {f16 d[8], f16 m[8], qs[128]}: sub-block s is d[s] * q +
   m[s], its nibbles as Q4_K's below; a row that is not whole blocks ends in a tail of GGUF's own 20-byte Q4_1
   blocks (TBS: DQT(t)(p, &lo, &hi) gives one's 32 weights). The K-quants, 256 weights a block:
   Q4_K (type 12) {f32 d, f32 dmin, u8 sc[8], u8 mn[8], qs[128]}: sub-block s is d*sc[s] * q - dmin*mn[s]; byte
   8s + e of qs's half h (64 bytes) holds its weights 8h + e (low nibble) and 16 + 8h + e (high), so the 4-byte
   lanes of a 64-byte load each hold one sub-block's weights (kernels/qmatmul_vnni.h sums a lane in integers);
   Q5_K (type 13) {f32 d, f32 dmin, u8 sc[8], u8 mn[8], qh[32], qs[128]}, its integers in GGUF's order: sub-block
   s's nibbles the low (s even) or high (s odd) halves of qs[32 (s/2) ..][0..32), bit s of qh[i] the fifth bit of
   its weight i;
   Q6_K (type 14) {f32 d, s8 sc[16], ql[128], qh[64]}: group g of 16 weights is d*sc[g] * (q - 32); its weight
   4c + k takes its low 4 bits from byte 4g + k of ql's half c/2 (the low nibble for even c) and its high 2 from
   bits 2c, 2c+1 of qh[4g + k]: lane g of a 64-byte load holds group g's weights.
   Every weight comes out as the reference's float32 (models/quant.py dequantize): each product of integers and
   f16-derived scales is exact in float32, so a fused multiply-add rounds where the reference's add does. */
#ifndef TG_QUANT_H
#define TG_QUANT_H
#include "vec.h"

#define BS_0 128  /* packed bytes per block, by layout */
#define BS_3 160
#define BS_8 36
#define BS_12 152
#define BS_13 184
#define BS_14 212
#define BW_0 32  /* weights per block */
#define BW_3 256
#define BW_8 32
#define BW_12 256
#define BW_13 256
#define BW_14 256
#define TBS_0 0  /* bytes per 32-weight block of a row's tail (the sub-blocks after its whole blocks), by layout */
#define TBS_3 20
#define TBS_8 0
#define TBS_12 0
#define TBS_13 0
#define TBS_14 0
#define BS(t) CAT(BS_, t)
#define TBS(t) CAT(TBS_, t)
#define SUBS(t) (CAT(BW_, t) / 32)
/* bytes of a row of nb sub-blocks: its whole blocks, then its tail */
#define ROWB(t, nb) ((long)(nb) / SUBS(t) * BS(t) + (long)(nb) % SUBS(t) * TBS(t))
#define DQ(t) CAT(dq, t)
#define DQT(t) CAT(dqt, t)
#define PREP(t) CAT(prep, t)

/* what a block's sub-blocks share: per sub-block (or 16-weight group) scales a and offsets b */
typedef struct { float a[16], b[16]; } dqs;

INL i16 bytes16(const unsigned char *p) { return __builtin_convertvector(*(const u16 *)p, i16); }
INL v16 fv(i16 q) { return __builtin_convertvector(q, v16); }

INL void prep0(const unsigned char *p, dqs *st) { (void)p; (void)st; }
INL void prep8(const unsigned char *p, dqs *st) { (void)p; (void)st; }

/* 8 f16 values at p, as float32 (exact): F16C where the CPU has it, else bit by bit */
#ifdef __F16C__
typedef short hs8 __attribute__((vector_size(16), aligned(1)));
INL v8 f16x8(const unsigned char *p) { return (v8)__builtin_ia32_vcvtph2ps256(*(const hs8 *)p); }
#else
INL float f16f(unsigned h) {
  union { unsigned u; float f; } c;
  unsigned e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) {  /* zero or subnormal: m * 2^-24 */
    float v = (float)m * 0x1p-24f;
    return h & 0x8000 ? -v : v;
  }
  c.u = (h & 0x8000) << 16 | (e == 31 ? 255u << 23 : (e + 112) << 23) | m << 13;
  return c.f;
}
INL v8 f16x8(const unsigned char *p) {
  v8 r;
  for (int i = 0; i < 8; i++) r[i] = f16f(p[2 * i] | p[2 * i + 1] << 8);
  return r;
}
#endif

/* weights q*a + b of 16 nibbles (AVX-512: looked up in the sub-block's table of 16; q*a is exact in float32, a
   4-bit q times an f16-derived a, so with or without FMA this is the reference's weight) */
INL v16 nib16(i16 q, float a, float b) {
#ifdef __AVX512F__
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return __builtin_ia32_permvarsf512(iota * a + b, q);  /* vpermps reads the low 4 bits of each index */
#else
  return fv(q & 15) * a + b;
#endif
}

/* a sub-block's 16 nibble bytes in the Q4_1 / Q4_K order: 8 at p and 8 at p + 64, side by side (their low nibbles
   are its weights 0-15, their high ones 16-31) */
INL i16 halves8(const unsigned char *p) {
  return __builtin_convertvector(__builtin_shufflevector(*(const u8 *)p, *(const u8 *)(p + 64), 0, 1, 2, 3, 4, 5, 6,
                                                         7, 8, 9, 10, 11, 12, 13, 14, 15), i16);
}

/* Q4_1: a 256-weight block's 8 scales d and offsets m */
INL void prep3(const unsigned char *p, dqs *st) { *(v8 *)st->a = f16x8(p); *(v8 *)st->b = f16x8(p + 16); }

INL void dq3(const unsigned char *p, const dqs *st, int s, v16 *lo, v16 *hi) {
  i16 q = halves8(p + 32 + 8 * s);
  *lo = nib16(q, st->a[s], st->b[s]); *hi = nib16(q >> 4, st->a[s], st->b[s]);
}

/* a Q4_1 row's tail block, GGUF's {f16 d, f16 m, 16 nibble bytes: weights 0-15 low, 16-31 high} */
INL void dqt3(const unsigned char *p, v16 *lo, v16 *hi) {
  v8 dm = f16x8(p);  /* d and m (the 6 values after them are the nibbles', unused) */
  i16 q = bytes16(p + 4);
  *lo = nib16(q, dm[0], dm[1]); *hi = nib16(q >> 4, dm[0], dm[1]);
}

INL void dq0(const unsigned char *p, const dqs *st, int s, v16 *lo, v16 *hi) {
  (void)st; (void)s;
  *lo = *(const v16 *)p; *hi = *(const v16 *)(p + 64);
}

INL void dq8(const unsigned char *p, const dqs *st, int s, v16 *lo, v16 *hi) {
  (void)st; (void)s;
  float d = *(const float *)p;
  *lo = __builtin_convertvector(*(const s16 *)(p + 4), v16) * d;
  *hi = __builtin_convertvector(*(const s16 *)(p + 20), v16) * d;
}

/* Q4_K and Q5_K: the 8 sub-blocks' scales d*sc and offsets -(dmin*mn), as the reference computes them */
INL void prep_k(const unsigned char *p, dqs *st) {
  float d = ((const float *)p)[0], dmin = ((const float *)p)[1];
  *(v8 *)st->a = __builtin_convertvector(*(const u8 *)(p + 8), v8) * d;
  *(v8 *)st->b = -(__builtin_convertvector(*(const u8 *)(p + 16), v8) * dmin);
}
INL void prep12(const unsigned char *p, dqs *st) { prep_k(p, st); }
INL void prep13(const unsigned char *p, dqs *st) { prep_k(p, st); }

INL void dq12(const unsigned char *p, const dqs *st, int s, v16 *lo, v16 *hi) {
  i16 q = halves8(p + 24 + 8 * s);
  *lo = nib16(q, st->a[s], st->b[s]); *hi = nib16(q >> 4, st->a[s], st->b[s]);
}

INL void dq13(const unsigned char *p, const dqs *st, int s, v16 *lo, v16 *hi) {
  const unsigned char *q = p + 56 + (s >> 1) * 32;
  int sh = (s & 1) * 4;
  float a = st->a[s], b = st->b[s];
  i16 l0 = ((bytes16(q) >> sh) & 15) | (((bytes16(p + 24) >> s) & 1) << 4);
  i16 l1 = ((bytes16(q + 16) >> sh) & 15) | (((bytes16(p + 40) >> s) & 1) << 4);
  *lo = fv(l0) * a + b; *hi = fv(l1) * a + b;
}

/* Q6_K: the 16 groups' scales d*sc; the weights are scale * (q - 32), with q - 32 an integer first, so a zero
   weight keeps the reference's sign */
INL void prep14(const unsigned char *p, dqs *st) {
  *(v16 *)st->a = __builtin_convertvector(*(const s16 *)(p + 4), v16) * *(const float *)p;
}

/* the 16 weights of group g: weight 4c + k from byte 4g + k of ql's half c / 2 (its nibble c % 2) and bits 2c, 2c + 1
   of byte 4g + k of qh */
INL i16 q6group(const unsigned char *p, int g) {
  i8 l0 = __builtin_convertvector(*(const u8 *)(p + 20 + 4 * (g & ~1)), i8);
  i8 l1 = __builtin_convertvector(*(const u8 *)(p + 84 + 4 * (g & ~1)), i8);
  i8 h = __builtin_convertvector(*(const u8 *)(p + 148 + 4 * (g & ~1)), i8);
  const i16 lsh = {0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4}, hsh = {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6};
  i16 low = g & 1 ? __builtin_shufflevector(l0, l1, 4, 5, 6, 7, 4, 5, 6, 7, 12, 13, 14, 15, 12, 13, 14, 15)
                  : __builtin_shufflevector(l0, l1, 0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11);
  i16 high = g & 1 ? __builtin_shufflevector(h, h, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7)
                   : __builtin_shufflevector(h, h, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  return ((low >> lsh) & 15) | (((high >> hsh) & 3) << 4);
}

INL void dq14(const unsigned char *p, const dqs *st, int s, v16 *lo, v16 *hi) {
  *lo = fv(q6group(p, 2 * s) - 32) * st->a[2 * s]; *hi = fv(q6group(p, 2 * s + 1) - 32) * st->a[2 * s + 1];
}

/* Runtime-typed helpers, for code that reads few weights (an embedding row, a test): a constant t folds each
   switch away. Sub-block b (32 weights) of row r of a matrix of layout t in G-row groups (models/quant.py
   group(): a group's whole blocks, then its rows' tails), nb sub-blocks a row. */
#define LAYOUT_CASE(t, stmt) case t: { stmt; } break;
/* a tail block: only Q4_1 rows have them */
#define DQT_AT(T) if (TBS(T)) dqt3(gr + (long)(nb / SUBS(T)) * g * BS(T) + ((long)(b % SUBS(T)) * g + r % g) * TBS(T), lo, hi)
INL void dq_at(int t, const unsigned char *w, long r, int nb, int b, int g, v16 *lo, v16 *hi) {
  dqs st;
  switch (t) {
#define DQ_AT(T) const unsigned char *gr = w + r / g * g * ROWB(T, nb); \
                 if (b >= nb / SUBS(T) * SUBS(T)) { DQT_AT(T); break; } \
                 const unsigned char *p = gr + ((long)(b / SUBS(T)) * g + r % g) * BS(T); \
                 PREP(T)(p, &st); DQ(T)(p, &st, b % SUBS(T), lo, hi)
    LAYOUT_CASE(0, DQ_AT(0)) LAYOUT_CASE(3, DQ_AT(3)) LAYOUT_CASE(8, DQ_AT(8)) LAYOUT_CASE(12, DQ_AT(12))
    LAYOUT_CASE(13, DQ_AT(13)) LAYOUT_CASE(14, DQ_AT(14))
#undef DQ_AT
#undef DQT_AT
  }
}
#endif
