/* The matmul of a decode step over Q4_1, Q4_K and Q6_K (QMM_SPLIT instances: one token per sequence) with
   AVX512-VNNI: included by kernels/qmatmul.h in place of its float instance, with the same QMM_NAME signature.

   The float instance dequantises each weight to float32 (about 5 vector operations per 16 Q4_K weights, 11 per 16
   Q6_K). Here the weights stay the integers they are packed as, and each row of x is read as integers too: every
   256-weight block of x is scaled by a power of two e (its largest |x| just under 2^B e, B = XQ_BITS: 22 for Q4_K,
   21 for Q6_K) and rounded, X = x / e (float32 keeps 24 bits: the error of one x is at most 2^-(B+1) of its
   block's largest |x|), then split into three signed bytes, X = l0 + 2^8 l1 + 2^16 l2. One vpdpbusd multiplies 64
   unsigned weight integers q by 64 signed bytes and adds them four at a time to 16 int32 lanes. The packed layout
   (kernels/quant.h) keeps each lane in one sub-block (Q4_K, 32 weights: lanes 2s and 2s + 1) or 16-weight group
   (Q6_K: lane g) in all four 64-weight chunks of a block, so each of the three bytes of X sums its products over
   the whole block in a lane of its own, and one combination, (l2 sums << 16) + (l1 sums << 8) + l0 sums, gives
   each lane's sum of q * X exactly (in int32 arithmetic, which wraps: the true sum of 16 products fits, 16 * 15 *
   2^22 and 16 * 63 * 2^21 both under 2^31). That sum is turned into float32 once a block, multiplied by its lane's
   scale (d * sc, exact in float32) and its block's e. What the scales leave out is a sum of x per 16 weights,
   taken once per row of x: Q4_K's offsets -(dmin * mn) and Q6_K's -32 each multiply it.
   So every product of a weight and an x is exact, as in the float instance; what differs from the float32
   reference is the rounding of x to B bits in its block and where the sums round: three vpdpbusd per 64 weights
   besides unpacking them, and about 8 operations a block. A row's arithmetic never depends on the other rows in
   its tile, so a batched step computes every row bit for bit as a one-row call does (the test of
   kernels/qmatmul.h holds here too).
   Q4_1 is Q4_K with f16 scales and offsets of its own (kernels/quant.h); a Q4_1 row's tail of 32-weight blocks is
   multiplied in float32 against x itself, as the float instance does.
   Needs: G, QMM_NAME, QMM_TYPE (3, 12 or 14), QMM_NT. */

#ifndef TG_QMATMUL_VNNI_H
#define TG_QMATMUL_VNNI_H
typedef int vsi __attribute__((vector_size(64)));
typedef long long vdi __attribute__((vector_size(64)));
typedef unsigned char vub __attribute__((vector_size(64), aligned(1)));
typedef signed char vsb __attribute__((vector_size(64), aligned(1)));

#define XQ_ROWS 4  /* rows of x quantised at once (on the stack): a split instance's tile takes at most 4 */

/* one 256-weight block of a row of x: its e, e * (sum of X) of each 16 x in order, and the three bytes of each
   X, in the byte order of the weights' layout (kernels/quant.h): 64 c + 8 s + e for x 32 s + 16 n + 8 h + e of
   Q4_1 and Q4_K (c = 2 h + n), 64 c + 4 g + k for x 16 g + 4 c + k of Q6_K */
typedef struct { signed char l[3][256]; float gs[16], e; } __attribute__((aligned(64))) xqb;  /* one cache line a load */

typedef signed char sb8 __attribute__((ext_vector_type(8), aligned(1)));
typedef signed char sb4 __attribute__((ext_vector_type(4), aligned(1)));

INL unsigned fbits(float f) { union { float f; unsigned u; } c = {f}; return c.u; }
INL float bitsf(unsigned u) { union { unsigned u; float f; } c = {u}; return c.f; }
INL int isum(i16 a) { i8 b = a.lo + a.hi; return b[0] + b[1] + b[2] + b[3] + b[4] + b[5] + b[6] + b[7]; }

/* the bytes of 16 X (x 16 i .. 16 i + 15 of a block) into level l of q, in layout t's order */
INL void xq_put(signed char *l, s16 b, int t, int i) {
  if (t != 14) {
    int at = 64 * (i & 1) + 8 * (i >> 1);
    *(sb8 *)(l + at) = b.lo; *(sb8 *)(l + at + 128) = b.hi;
  } else {
    *(sb4 *)(l + 4 * i) = b.lo.lo; *(sb4 *)(l + 64 + 4 * i) = b.lo.hi;
    *(sb4 *)(l + 128 + 4 * i) = b.hi.lo; *(sb4 *)(l + 192 + 4 * i) = b.hi.hi;
  }
}

/* the bits of X: a lane sums 16 products q X in int32, q < 16 (Q4_1, Q4_K) or < 64 (Q6_K) */
#define XQ_BITS(t) ((t) == 14 ? 21 : 22)

/* nblk blocks of one row of x, for layout t. A block whose largest |x| is under 2^-105 reads as zeros; one with
   an infinity or NaN gets e = NaN, so its rows' sums are NaN as the float instance's are */
INL void xq_row(xqb *restrict q, const float *restrict x, int nblk, int t) {
  const unsigned bits = XQ_BITS(t);
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
    else if (ex > bits - 1) { q->e = bitsf((ex + 1 - bits) << 23); inv = bitsf((253 + bits - ex) << 23); }
    for (int i = 0; i < 16; i++) {
      /* |X| <= 2^bits, so l2 stays within [-65, 65] */
      i16 X = (i16)__builtin_ia32_cvtps2dq512_mask(*(const v16 *)(x + 16 * i) * inv, (vsi){0}, 0xffff, 4);
      i16 l0 = ((X + 128) & 255) - 128, X1 = (X - l0) >> 8;
      i16 l1 = ((X1 + 128) & 255) - 128, l2 = (X1 - l1) >> 8;
      xq_put(q->l[0], __builtin_convertvector(l0, s16), t, i);
      xq_put(q->l[1], __builtin_convertvector(l1, s16), t, i);
      xq_put(q->l[2], __builtin_convertvector(l2, s16), t, i);
      q->gs[i] = (float)isum(X) * q->e;
    }
  }
}

/* a block's scales per lane (a: d * sc of the lane's sub-block or group) and the vector that multiplies x's sums
   per 16 weights (m) */
INL void vprep12(const unsigned char *p, v16 *a, v16 *m) {
  float d = ((const float *)p)[0], dmin = ((const float *)p)[1];
  v8 sc = __builtin_convertvector(*(const u8 *)(p + 8), v8) * d;
  v8 mn = -(__builtin_convertvector(*(const u8 *)(p + 16), v8) * dmin);
  *a = __builtin_shufflevector(sc, sc, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  *m = __builtin_shufflevector(mn, mn, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}
INL void vprep3(const unsigned char *p, v16 *a, v16 *m) {
  v8 d = f16x8(p), mn = f16x8(p + 16);
  *a = __builtin_shufflevector(d, d, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  *m = __builtin_shufflevector(mn, mn, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}
INL void vprep14(const unsigned char *p, v16 *a, v16 *m) {
  *a = __builtin_convertvector(*(const s16 *)(p + 4), v16) * *(const float *)p;
  *m = *a * -32.f;
}

/* chunk c's 64 weight integers: lane i holds 4 weights of sub-block i / 2 (Q4_1, Q4_K) or group i (Q6_K) */
INL vub vnib(const unsigned char *q, int c) {
  vub raw = *(const vub *)(q + 64 * (c >> 1));
  return c & 1 ? (vub)((vdi)raw >> 4) & 15 : raw & 15;
}
INL vub vw3(const unsigned char *p, int c) { return vnib(p + 32, c); }
INL vub vw12(const unsigned char *p, int c) { return vnib(p + 24, c); }
INL vub vw14(const unsigned char *p, int c) {
  vub ql = *(const vub *)(p + 20 + 64 * (c >> 1)), qh = *(const vub *)(p + 148);
  vub low = c & 1 ? (vub)((vdi)ql >> 4) & 15 : ql & 15;
  /* bits 2c, 2c + 1 of each qh byte to bits 4-5 (64-bit shifts: what crosses a byte lands outside the mask) */
  vdi h = (vdi)qh;
  vub high = (vub)(c == 0 ? h << 4 : c == 1 ? h << 2 : c == 2 ? h : h >> 2) & 48;
  return low | high;
}
#endif

/* rows of W per tile: each takes 3 int32 accumulators per row of x, so a tile of 4 rows of W fits one row of x */
#define QMV_GR (QMM_NT == 1 ? G : QMM_NT == 2 ? G / 2 : 1)
/* A tile prefetches the weights QMV_AHEAD bytes ahead into L2 (prefetcht2). The hardware prefetcher alone falls
   behind the stream, worst where a row of x is wide (an FF-wide matrix's, 28 KB quantised, shares L1 with it):
   one thread streaming 2048 x 8192 Q4_K rows (out of cache) ran at 17 G weights/s without, 37 with, 16384 x 2048
   rows 42 and 44 (Q6_K: 12 and 29, 26 and 34); 2-4 KiB ahead, or into L1, gained a third as much */
#define QMV_AHEAD 16384

/* the k rows of x quantised at xq (nblk blocks each) against W rows r0..r0+QMV_GR of the group at g. For each
   block: each lane's sums of q times the three bytes of X (level 2 the top byte), over the block's 4 chunks; then
   their exact sum q X (mod 2^32, and the true sum fits: 16 q X in a lane, |X| <= 2^XQ_BITS), to float32 once */
INL void CAT(QMM_NAME, _vtile)(float *restrict y, int ys, const xqb *restrict xq, const float *restrict x, int xs,
                               int nb, const unsigned char *restrict g, int r0, int k) {
  const int nblk = nb / 8;
  v16 acc[QMV_GR][QMM_NT];
  for (int r = 0; r < QMV_GR; r++) for (int j = 0; j < k; j++) acc[r][j] = (v16)0;
  for (int b = 0; b < nblk; b++) {
    const unsigned char *gb = g + (long)(b * G + r0) * BS(QMM_TYPE);
    for (int i = 0; i < QMV_GR * BS(QMM_TYPE); i += 64) __builtin_prefetch(gb + QMV_AHEAD + i, 0, 1);
    vsi s0[QMV_GR][QMM_NT], s1[QMV_GR][QMM_NT], s2[QMV_GR][QMM_NT];
    for (int r = 0; r < QMV_GR; r++) for (int j = 0; j < k; j++) s0[r][j] = s1[r][j] = s2[r][j] = (vsi){0};
    for (int c = 0; c < 4; c++) {
      vub w[QMV_GR];
      for (int r = 0; r < QMV_GR; r++) w[r] = CAT(vw, QMM_TYPE)(gb + r * BS(QMM_TYPE), c);
      for (int j = 0; j < k; j++) {
        const signed char *l = xq[j * nblk + b].l[0] + 64 * c;
        for (int r = 0; r < QMV_GR; r++) {
          s0[r][j] = __builtin_ia32_vpdpbusd512(s0[r][j], (vsi)w[r], (vsi)*(const vsb *)l);
          s1[r][j] = __builtin_ia32_vpdpbusd512(s1[r][j], (vsi)w[r], (vsi)*(const vsb *)(l + 256));
          s2[r][j] = __builtin_ia32_vpdpbusd512(s2[r][j], (vsi)w[r], (vsi)*(const vsb *)(l + 512));
        }
      }
    }
    for (int r = 0; r < QMV_GR; r++) {
      v16 a, m;
      CAT(vprep, QMM_TYPE)(gb + r * BS(QMM_TYPE), &a, &m);
      for (int j = 0; j < k; j++) {
        const xqb *q = xq + j * nblk + b;
        vsi v = (((s2[r][j] << 8) + s1[r][j]) << 8) + s0[r][j];
        v16 f = __builtin_convertvector((i16)v, v16) * a;
        acc[r][j] = m * *(const v16 *)q->gs + (f * q->e + acc[r][j]);
      }
    }
  }
#if TBS(QMM_TYPE)
  /* the rows' tails (Q4_1 blocks after the whole ones), in float32 against x itself, as the float instance does */
  const unsigned char *tg = g + (long)nblk * G * BS(QMM_TYPE);
  for (int u = 0; u < nb % 8; u++) {
    const unsigned char *tb = tg + (long)(u * G + r0) * TBS(QMM_TYPE);
    for (int i = 0; i < QMV_GR * TBS(QMM_TYPE); i += 64) __builtin_prefetch(tb + QMV_AHEAD + i, 0, 1);
    v16 wl[QMV_GR], wh[QMV_GR];
    for (int r = 0; r < QMV_GR; r++) DQT(QMM_TYPE)(tb + r * TBS(QMM_TYPE), &wl[r], &wh[r]);
    for (int j = 0; j < k; j++) {
      const float *xp = x + j * xs + (nblk * 8 + u) * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
      for (int r = 0; r < QMV_GR; r++) acc[r][j] += wl[r] * xl + wh[r] * xh;
    }
  }
#endif
  for (int r = 0; r < QMV_GR; r++) for (int j = 0; j < k; j++) y[j * ys + r0 + r] = hsum(acc[r][j]);
}

INL void QMM_NAME(float *restrict y, int ys, const float *restrict x, int xs,
                  const unsigned char *restrict w, int O, int nb, int n) {
  const int nblk = nb / 8;
  for (int t0 = 0; t0 < n; t0 += XQ_ROWS) {
    const int rows = n - t0 < XQ_ROWS ? n - t0 : XQ_ROWS;
    xqb xq[XQ_ROWS * nblk + 1];  /* + 1: a row of only a tail has no whole block */
    for (int j = 0; j < rows; j++) xq_row(xq + j * nblk, x + (long)(t0 + j) * xs, nblk, QMM_TYPE);
    const float *xt = x + (long)t0 * xs;
    for (int o = 0; o < O; o += G) {
      const unsigned char *g = w + o * ROWB(QMM_TYPE, nb);
      float *yo = y + (long)t0 * ys + o;
      #define VT(t, k) CAT(QMM_NAME, _vtile)(yo + (t) * ys, ys, xq + (t) * nblk, xt + (long)(t) * xs, xs, nb, g, r0, k)
      for (int r0 = 0; r0 < G; r0 += QMV_GR) {
        int t = 0;
        for (; t + QMM_NT <= rows; t += QMM_NT) VT(t, QMM_NT);
        if (QMM_NT > 3 && rows - t == 3) VT(t, 3);
        if (QMM_NT > 2 && rows - t == 2) VT(t, 2);
        if (QMM_NT > 1 && rows - t == 1) VT(t, 1);
      }
      #undef VT
    }
  }
}
#undef QMV_GR
#undef QMV_AHEAD
