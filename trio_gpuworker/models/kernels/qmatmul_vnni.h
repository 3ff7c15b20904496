/* The K-quant matmul of a decode step (Q4_K and Q6_K, QMM_SPLIT instances: one token per sequence) with
   AVX512-VNNI: included by kernels/qmatmul.h in place of its float instance, with the same QMM_NAME signature.

   The float instance dequantises each weight to float32 (about 5 vector operations per 16 Q4_K weights, 11 per 16
   Q6_K). Here the weights stay the integers they are packed as, and each row of x is read as integers too: every
   256-weight block of x is scaled by a power of two e (its largest |x| just under 2^22 e) and rounded, X = x / e
   (22 significant bits against float32's 24: the error of one x is at most 2^-23 of its block's largest |x|), then
   split into three signed bytes, X = l0 + 2^8 l1 + 2^16 l2. One vpdpbusd multiplies 64 unsigned weight integers q
   by 64 signed bytes and sums them four at a time into 16 int32 lanes; three of them, with two shifts between
   (Horner's rule), give each lane's sum of q * X exactly (|q * X| four at a time stays below 2^31). The lanes of a
   64-weight chunk fall in whole sub-blocks (Q4_K, 32 weights) or 16-weight groups (Q6_K), so each lane's exact
   sum is turned into float32 once and multiplied by its sub-block's scale (d * sc, exact in float32), and a
   block's sum by its e. What the scales leave out is a sum of x per 16 weights, taken once per row of x: Q4_K's
   offsets -(dmin * mn) and Q6_K's -32 each multiply it.
   So every product of a weight and an x is exact, as in the float instance; what differs from the float32
   reference is the rounding of x to 22 bits in its block and where the sums round: about 7 operations per 64
   weights besides unpacking them. A row's arithmetic never depends on the other rows in its tile, so a batched
   step computes every row bit for bit as a one-row call does (the test of kernels/qmatmul.h holds here too).
   Needs: G, QMM_NAME, QMM_TYPE (12 or 14), QMM_NT. */

#ifndef TG_QMATMUL_VNNI_H
#define TG_QMATMUL_VNNI_H
typedef int vsi __attribute__((vector_size(64)));
typedef short vhi __attribute__((vector_size(64)));
typedef long long vdi __attribute__((vector_size(64)));
typedef unsigned char vub __attribute__((vector_size(64), aligned(1)));
typedef unsigned char vub32 __attribute__((vector_size(32), aligned(1)));
typedef signed char vsb __attribute__((vector_size(64), aligned(1)));


#define XQ_ROWS 4  /* rows of x quantised at once (on the stack): a split instance's tile takes at most 4 */

/* one 256-weight block of a row of x: its e, e * (sum of X) of each 16 x in order, and the three bytes of each
   X, in the byte order of the weights' layout (xq_at) */
typedef struct { float e, gs[16]; signed char l[3][256]; } xqb;

/* where the 32 x of sub-block s go in a block's bytes: Q4_K packs sub-blocks s and s + 1 as the low and high
   nibbles of the same 32 bytes, so a 64-byte load holds sub-blocks (0, 2) in its low nibbles and (1, 3) in its
   high ones; Q6_K's 64-byte chunks hold weights in order */
INL int xq_at(int t, int s) { return t == 12 ? (s >> 2) * 128 + (s & 1) * 64 + ((s >> 1) & 1) * 32 : 32 * s; }

INL unsigned fbits(float f) { union { float f; unsigned u; } c = {f}; return c.u; }
INL float bitsf(unsigned u) { union { unsigned u; float f; } c = {u}; return c.f; }
INL int isum(i16 a) { i8 b = a.lo + a.hi; return b[0] + b[1] + b[2] + b[3] + b[4] + b[5] + b[6] + b[7]; }

/* nblk blocks of one row of x, for layout t. A block whose largest |x| is under 2^-105 reads as zeros; one with
   an infinity or NaN gets e = NaN, so its rows' sums are NaN as the float instance's are */
INL void xq_row(xqb *restrict q, const float *restrict x, int nblk, int t) {
  for (int b = 0; b < nblk; b++, q++, x += 256) {
    v16 m = (v16)0, z = (v16)0;  /* z: NaN where an x is an infinity or NaN (max() passes over a NaN) */
    for (int i = 0; i < 16; i++) {
      v16 v = *(const v16 *)(x + 16 * i);
      m = __builtin_elementwise_max(m, __builtin_elementwise_abs(v));
      z += v * 0.f;
    }
    v8 m8 = __builtin_elementwise_max(m.lo, m.hi);
    v4 m4 = __builtin_elementwise_max(m8.lo, m8.hi);
    float mx = __builtin_fmaxf(__builtin_fmaxf(m4.x, m4.y), __builtin_fmaxf(m4.z, m4.w));
    unsigned ex = (fbits(mx) >> 23) & 255;  /* mx < 2^(ex - 126) */
    float inv = 0;
    q->e = 0;
    if (hsum(z) != 0) q->e = __builtin_nanf("");
    else if (ex > 21) { q->e = bitsf((ex - 21) << 23); inv = bitsf((275 - ex) << 23); }
    for (int i = 0; i < 16; i++) {
      /* |X| <= 2^22, so l2 stays within [-65, 65] */
      i16 X = (i16)__builtin_ia32_cvtps2dq512_mask(*(const v16 *)(x + 16 * i) * inv, (vsi){0}, 0xffff, 4);
      i16 l0 = ((X + 128) & 255) - 128, X1 = (X - l0) >> 8;
      i16 l1 = ((X1 + 128) & 255) - 128, l2 = (X1 - l1) >> 8;
      int at = xq_at(t, i >> 1) + 16 * (i & 1);
      *(s16 *)(q->l[0] + at) = __builtin_convertvector(l0, s16);
      *(s16 *)(q->l[1] + at) = __builtin_convertvector(l1, s16);
      *(s16 *)(q->l[2] + at) = __builtin_convertvector(l2, s16);
      q->gs[i] = (float)isum(X) * q->e;
    }
  }
}

/* sum of q * X in each int32 lane: four u8 weights against four x, three bytes of X at a time */
INL vsi vdot(vub w, const signed char *l0, const signed char *l1, const signed char *l2) {
  vsi v = __builtin_ia32_vpdpbusd512((vsi){0}, (vsi)w, (vsi)*(const vsb *)l2);
  v = __builtin_ia32_vpdpbusd512(v << 8, (vsi)w, (vsi)*(const vsb *)l1);
  return __builtin_ia32_vpdpbusd512(v << 8, (vsi)w, (vsi)*(const vsb *)l0);
}

/* a block's scales (a: d * sc per sub-block or group) and the vector that multiplies x's sums per 16 weights (m) */
INL void vprep12(const unsigned char *p, v16 *a, v16 *m) {
  float d = ((const float *)p)[0], dmin = ((const float *)p)[1];
  v8 sc = __builtin_convertvector(*(const u8 *)(p + 8), v8) * d;
  v8 mn = -(__builtin_convertvector(*(const u8 *)(p + 16), v8) * dmin);
  *a = __builtin_shufflevector(sc, sc, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
  *m = __builtin_shufflevector(mn, mn, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}
INL void vprep14(const unsigned char *p, v16 *a, v16 *m) {
  *a = __builtin_convertvector(*(const s16 *)(p + 4), v16) * *(const float *)p;
  *m = *a * -32.f;
}

/* chunk c's 64 weight integers, and the scale of each of its 16 lanes */
INL vub vw12(const unsigned char *p, int c) {
  vub raw = *(const vub *)(p + 24 + 64 * (c >> 1));
  return c & 1 ? (vub)((vdi)raw >> 4) & 15 : raw & 15;
}
INL v16 vs12(v16 a, int c) {
  /* lanes 0-7: sub-block 4 (c / 2) + c % 2; lanes 8-15: the one two after it */
  return c == 0 ? __builtin_shufflevector(a, a, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
       : c == 1 ? __builtin_shufflevector(a, a, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3)
       : c == 2 ? __builtin_shufflevector(a, a, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6)
                : __builtin_shufflevector(a, a, 5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7);
}
INL vub vw14(const unsigned char *p, int c) {
  int h = c >> 1;
  vub ql = *(const vub *)(p + 20 + 64 * h);
  vub32 qh32 = *(const vub32 *)(p + 148 + 32 * h);
  vub qh = __builtin_shufflevector(qh32, qh32, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                   20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                   11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  /* bits 2k, 2k+1 of qh are the top two of quarter k: the low half of the chunk takes k = 2 (c % 2), the high
     half k + 1; each brought to bits 4-5 by a shift of its own (16-bit lanes: what crosses a byte is masked off) */
  const vhi up = {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
  const vhi down = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
  if (c & 1) return (((vub)((vdi)ql >> 4)) & 15) | ((vub)__builtin_ia32_psrlv32hi((vhi)qh, down) & 48);
  return (ql & 15) | ((vub)__builtin_ia32_psllv32hi((vhi)qh, up) & 48);
}
INL v16 vs14(v16 a, int c) {
  /* lanes 4i..4i+3: group 4c + i */
  return c == 0 ? __builtin_shufflevector(a, a, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
       : c == 1 ? __builtin_shufflevector(a, a, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7)
       : c == 2 ? __builtin_shufflevector(a, a, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11)
                : __builtin_shufflevector(a, a, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15);
}
#endif

/* rows of W per tile: 4 rows of x against a whole group would need 32 accumulators */
#define QMV_GR (QMM_NT > 2 ? G / 2 : G)

/* the k rows of x quantised at xq (nblk blocks each) against W rows r0..r0+QMV_GR of the group at g */
INL void CAT(QMM_NAME, _vtile)(float *restrict y, int ys, const xqb *restrict xq, int nblk,
                               const unsigned char *restrict g, int r0, int k) {
  v16 acc[QMV_GR][QMM_NT], ba[QMV_GR][QMM_NT];
  for (int r = 0; r < QMV_GR; r++) for (int j = 0; j < k; j++) acc[r][j] = (v16)0;
  for (int b = 0; b < nblk; b++) {
    const unsigned char *gb = g + (long)(b * G + r0) * BS(QMM_TYPE);
    v16 a[QMV_GR], m[QMV_GR];
    for (int r = 0; r < QMV_GR; r++) CAT(vprep, QMM_TYPE)(gb + r * BS(QMM_TYPE), &a[r], &m[r]);
    for (int c = 0; c < 4; c++) {
      vub w[QMV_GR]; v16 s[QMV_GR];
      for (int r = 0; r < QMV_GR; r++) { w[r] = CAT(vw, QMM_TYPE)(gb + r * BS(QMM_TYPE), c); s[r] = CAT(vs, QMM_TYPE)(a[r], c); }
      for (int j = 0; j < k; j++) {
        const signed char *l = xq[j * nblk + b].l[0] + 64 * c;
        for (int r = 0; r < QMV_GR; r++) {
          v16 f = __builtin_convertvector((i16)vdot(w[r], l, l + 256, l + 512), v16);
          ba[r][j] = c == 0 ? f * s[r] : f * s[r] + ba[r][j];
        }
      }
    }
    for (int j = 0; j < k; j++) {
      const xqb *q = xq + j * nblk + b;
      v16 gs = *(const v16 *)q->gs;
      for (int r = 0; r < QMV_GR; r++) acc[r][j] = m[r] * gs + (ba[r][j] * q->e + acc[r][j]);
    }
  }
  for (int r = 0; r < QMV_GR; r++) for (int j = 0; j < k; j++) y[j * ys + r0 + r] = hsum(acc[r][j]);
}

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  const int nblk = nb / 8;
  for (int t0 = 0; t0 < n; t0 += XQ_ROWS) {
    const int rows = n - t0 < XQ_ROWS ? n - t0 : XQ_ROWS;
    xqb xq[XQ_ROWS * nblk];
    for (int j = 0; j < rows; j++) xq_row(xq + j * nblk, x + (long)(t0 + j) * xs, nblk, QMM_TYPE);
    for (int o = 0; o < O; o += G) {
      const unsigned char *g = w + (long)o * nblk * BS(QMM_TYPE);
      float *yo = y + (long)t0 * ys + o;
      for (int r0 = 0; r0 < G; r0 += QMV_GR) {
        int t = 0;
        for (; t + QMM_NT <= rows; t += QMM_NT) CAT(QMM_NAME, _vtile)(yo + t * ys, ys, xq + t * nblk, nblk, g, r0, QMM_NT);
        if (QMM_NT > 3 && rows - t == 3) CAT(QMM_NAME, _vtile)(yo + t * ys, ys, xq + t * nblk, nblk, g, r0, 3);
        if (QMM_NT > 2 && rows - t == 2) CAT(QMM_NAME, _vtile)(yo + t * ys, ys, xq + t * nblk, nblk, g, r0, 2);
        if (QMM_NT > 1 && rows - t == 1) CAT(QMM_NAME, _vtile)(yo + t * ys, ys, xq + t * nblk, nblk, g, r0, 1);
      }
    }
  }
}
#undef QMV_GR
