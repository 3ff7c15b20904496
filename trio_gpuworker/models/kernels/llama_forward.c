/* The fused llama decoder (models/llama_fused.py): one call runs T rows through every layer over the GGUF's
   packed weights, appends each row's K and V to its sequence's cache slot, and writes the greedy next ids.
   A prefill chunk is T tokens of one sequence at consecutive positions (HEADS 1: the next id after its last
   row); a batched decode step is one token of each of up to T sequences, each at its own position in its own
   slot (HEADS == T: a next id per row), so the weights are read once for all of them. The host's table
   (kernels/threads.h) says how many threads share the step and gives the SiLU's expf (libm's, called through
   the table: the kernel links nothing).
   Where the model has them (BIASES, HEAD_NORMS: models/architectures.py), q/k/v biases are added to the
   projections and each q and k head is RMS-normed ahead of RoPE.
   Each layer's q, k, v, o, gate|up (rows interleaved) and down matrices may each be packed in a layout of its own
   (kernels/quant.h; a llama.cpp Q4_K_M file mixes Q4_K and Q6_K within q|k|v and across layers): the layer table
   gives each one's layout and where it starts in its kind's buffer, and one matmul instance per layout the model
   uses (LAYOUTS, a bit per layout) serves every matrix in it.
   Defines (models/llama_fused.py LlamaDims and Step): T, NT, SPLIT, HEADS, D, H, KV, HD, FF, V, S, NL, EPS, G,
   BIASES, HEAD_NORMS, LAYOUTS and the layouts of the embedding and output matrices, TYPE_EMBD and TYPE_OUT. */
#include "llama_math.h"
#include "quant.h"
#include "threads.h"

#define NQKV ((H + 2 * KV) * HD)
#define QD (H * HD)  /* the attention output's width: D unless the heads have a size of their own */
#define GQ (H / KV)
#define SQRT_HD __builtin_sqrt((double)HD)
#define SLOT ((long)NL * 2 * KV * S * HD)  /* cache floats of one sequence */
/* the layer table: for each layer and part, the part's layout and its byte offset in its kind's buffer */
#define PART_Q 0
#define PART_K 1
#define PART_V 2
#define PART_O 3
#define PART_GU 4
#define PART_D 5
#define PARTS 6

/* one matmul instance per layout in use, for the layers' matrices */
#define HAS(t) ((LAYOUTS >> (t)) & 1)
#if HAS(0)
#define QMM_NAME mml0
#define QMM_TYPE 0
#define QMM_SPLIT SPLIT
#define QMM_NT NT
#include "qmatmul.h"
#endif
#if HAS(3)
#define QMM_NAME mml3
#define QMM_TYPE 3
#define QMM_SPLIT SPLIT
#define QMM_NT NT
#include "qmatmul.h"
#endif
#if HAS(8)
#define QMM_NAME mml8
#define QMM_TYPE 8
#define QMM_SPLIT SPLIT
#define QMM_NT NT
#include "qmatmul.h"
#endif
#if HAS(12)
#define QMM_NAME mml12
#define QMM_TYPE 12
#define QMM_SPLIT SPLIT
#define QMM_NT NT
#include "qmatmul.h"
#endif
#if HAS(13)
#define QMM_NAME mml13
#define QMM_TYPE 13
#define QMM_SPLIT SPLIT
#define QMM_NT NT
#include "qmatmul.h"
#endif
#if HAS(14)
#define QMM_NAME mml14
#define QMM_TYPE 14
#define QMM_SPLIT SPLIT
#define QMM_NT NT
#include "qmatmul.h"
#endif

/* rows [o0, o1) of a layer matrix of layout t (nb sub-blocks a row, packed from w) times the n rows of x: one
   out-of-line copy, emitted after the kernel's entry point (tinygrad runs the first code of the image) */
#define MM_CASE(t) case t: CAT(mml, t)(y + o0, ys, x, xs, w + o0 * ROWB(t, nb), o1 - o0, nb, n); break;
static __attribute__((noinline)) void mm_layer(int t, float *restrict y, int ys, const float *restrict x, int xs,
                                               const unsigned char *restrict w, int o0, int o1, int nb, int n) {
  switch (t) {
#if HAS(0)
    MM_CASE(0)
#endif
#if HAS(3)
    MM_CASE(3)
#endif
#if HAS(8)
    MM_CASE(8)
#endif
#if HAS(12)
    MM_CASE(12)
#endif
#if HAS(13)
    MM_CASE(13)
#endif
#if HAS(14)
    MM_CASE(14)
#endif
  }
}
#define QMM_NAME mmh
#define QMM_TYPE TYPE_OUT
#define QMM_NT (HEADS == 1 ? 1 : NT)
#define QMM_SPLIT 1
#include "qmatmul.h"

/* Layer weights are stacked: layer l's block of a kind starts at l * its size. Scratch: x, h, then either
   q|k|v + attention output, or gate/up pairs + their product; HEADS rows of logits last. ids: T tokens, each
   row's position, each row's cache slot, then n, the rows in use (the rest are padding, never read: a matmul's
   last tile takes fewer rows, kernels/qmatmul.h). bqkv: each layer's q|k|v biases (NQKV floats); hn: each
   layer's q then k head norm weights (2 HD floats); each is one unread float in a model without them. lay: the
   layer table, NL x PARTS x {layout, byte offset}. */
typedef struct {
  int *out; float *scr, *cache; const int *ids;
  const unsigned char *embd; const float *an; const unsigned char *wqkv, *wo; const float *fn;
  const unsigned char *wgu, *wd; const double *rope; const float *on; const unsigned char *wout;
  const float *bqkv, *hn; const long *lay;
} job;

/* head hh (q heads, then k heads) of one row's q|k|v, and for a k head its v head too: biases added, the q or k
   head RMS-normed, where the model has them; then rotated, pairs (2i, 2i+1) in double like the reference's
   complex128 (cs: the position's cosines, then its sines) */
INL void qk_head(float *restrict q, int hh, const float *restrict b, const float *restrict hn, const double *restrict cs) {
  float *restrict qh = q + hh * HD;
  if (BIASES) {
    const int vh = (KV + hh) * HD;  /* a k head's v head: H + KV + (hh - H) */
    for (int i = 0; i < HD; i++) qh[i] = qh[i] + b[hh * HD + i];
    if (hh >= H) for (int i = 0; i < HD; i++) q[vh + i] = q[vh + i] + b[vh + i];
  }
  if (HEAD_NORMS) {
    float y[HD];
    rmsnorm(y, qh, hn + (hh < H ? 0 : HD), HD, EPS);
    for (int i = 0; i < HD; i++) qh[i] = y[i];
  }
  for (int i = 0; i < HD / 2; i++) {
    #pragma clang fp contract(off)
    double re = qh[2 * i], im = qh[2 * i + 1], c = cs[i], s = cs[HD / 2 + i];
    qh[2 * i] = (float)(re * c - im * s); qh[2 * i + 1] = (float)(re * s + im * c);
  }
}

/* this thread's share of a matmul's O output rows, in whole groups of G: [*o0, *o1) */
INL void share(int O, int tid, int nt, int *o0, int *o1) { *o0 = O / G * tid / nt * G; *o1 = O / G * (tid + 1) / nt * G; }

/* this thread's share of the O rows of part p of layer l (nb sub-blocks a row, in kind buffer w) times n rows of
   x, into y (row stride ys); its rows are [*o0, *o1) */
INL void part_mm(const long *lay, int l, int p, const unsigned char *w, float *y, int ys, const float *x, int xs,
                 int O, int nb, int n, int tid, int nt, int *o0, int *o1) {
  const long *e = lay + ((long)l * PARTS + p) * 2;
  share(O, tid, nt, o0, o1);
  mm_layer((int)e[0], y, ys, x, xs, w + e[1], *o0, *o1, nb, n);
}

/* Threads split each matmul by output rows (each row's sums unchanged, so the result is bit for bit one thread's),
   the attention by query heads; the row-wise rest runs on thread 0. Barriers between the phases. */
INL void run(job *j, team_t *tm, int tid) {
  int *restrict out = j->out; float *restrict scr = j->scr, *restrict cache = j->cache; const int *restrict ids = j->ids;
  const unsigned char *restrict embd = j->embd, *restrict wqkv = j->wqkv, *restrict wo = j->wo, *restrict wgu = j->wgu;
  const unsigned char *restrict wd = j->wd, *restrict wout = j->wout;
  const float *restrict an = j->an, *restrict fn = j->fn, *restrict on = j->on; const double *restrict rope = j->rope;
  const float *restrict bqkv = j->bqkv, *restrict hn = j->hn; const long *restrict lay = j->lay;
  const int nt = tm->nt;
  const expf_fn ex = tm->tt->expf;
  int sense = 0, o0, o1;
  #define SYNC team_sync(tm, &sense)
  const int *ps = ids + T, *sl = ids + 2 * T;
  /* at least one row in use: the JIT cache's probe replays every graph on all-zero ids */
  const int n = ids[3 * T] < 1 ? 1 : ids[3 * T] > T ? T : ids[3 * T];
  float *x = scr, *h = x + T * D, *qkv = h + T * D, *ao = qkv + T * NQKV, *gu = qkv, *a = gu + T * 2 * FF;
  float *lg = qkv + T * (NQKV + QD > 3 * FF ? NQKV + QD : 3 * FF);
  double sc[GQ][S + 8];
  if (tid == 0) for (int t = 0; t < n; t++) for (int b = 0; b < D / 32; b++) {
    v16 lo, hi;
    dq_at(TYPE_EMBD, embd, ids[t], D / 32, b, G, &lo, &hi);
    *(v16 *)(x + t * D + b * 32) = lo; *(v16 *)(x + t * D + b * 32 + 16) = hi;
  }
  for (int l = 0; l < NL; l++) {
    #define KC(t) (cache + sl[t] * SLOT + (long)l * 2 * KV * S * HD)
    #define VC(t) (KC(t) + (long)KV * S * HD)
    if (tid == 0) for (int t = 0; t < n; t++) rmsnorm(h + t * D, x + t * D, an + l * D, D, EPS);
    SYNC;
    part_mm(lay, l, PART_Q, wqkv, qkv, NQKV, h, D, QD, D / 32, n, tid, nt, &o0, &o1);
    part_mm(lay, l, PART_K, wqkv, qkv + QD, NQKV, h, D, KV * HD, D / 32, n, tid, nt, &o0, &o1);
    part_mm(lay, l, PART_V, wqkv, qkv + QD + KV * HD, NQKV, h, D, KV * HD, D / 32, n, tid, nt, &o0, &o1);
    SYNC;
    /* each thread takes an equal share of the n * (H + KV) q and k heads; a k head's thread caches it and its v */
    for (int it = n * (H + KV) * tid / nt; it < n * (H + KV) * (tid + 1) / nt; it++) {
      int t = it / (H + KV), hh = it % (H + KV), pos = ps[t];
      float *q = qkv + t * NQKV;
      qk_head(q, hh, bqkv + (long)l * NQKV, hn + (long)l * 2 * HD, rope + (long)pos * HD);
      if (hh >= H) {
        float *kc = KC(t) + ((long)(hh - H) * S + pos) * HD, *vc = VC(t) + ((long)(hh - H) * S + pos) * HD;
        for (int i = 0; i < HD; i++) { kc[i] = q[hh * HD + i]; vc[i] = q[(KV + hh) * HD + i]; }
      }
    }
    SYNC;  /* a prefill chunk's rows attend to the rows cached before them */
    /* each thread takes an equal share of the n * H query heads (row t, KV head g, query head r of g in order);
       the heads of one KV head in a share go together, so each cached K and V row is read once a share */
    const int hq0 = n * H * tid / nt, hq1 = n * H * (tid + 1) / nt;
    for (int tg = hq0 / GQ; tg * GQ < hq1; tg++) {
      int t = tg / KV, g = tg % KV, r0 = hq0 - tg * GQ > 0 ? hq0 - tg * GQ : 0, r1 = hq1 - tg * GQ < GQ ? hq1 - tg * GQ : GQ;
      int pos = ps[t]; const float *kc = KC(t), *vc = VC(t), *q = qkv + t * NQKV + g * GQ * HD;
      /* the reference divides float32 scores by a float64 sqrt, so its softmax runs in float64 */
      double mx[GQ], sum[GQ], o[GQ][HD];
      for (int r = r0; r < r1; r++) { mx[r] = -__builtin_inf(); sum[r] = 0; for (int i = 0; i < HD; i++) o[r][i] = 0; }
      for (int j = 0; j <= pos; j++) {
        const float *k = kc + ((long)g * S + j) * HD;
        for (int r = r0; r < r1; r++) {
          v16 d = (v16)0;
          for (int i = 0; i < HD; i += 16) d += *(const v16 *)(q + r * HD + i) * *(const v16 *)(k + i);
          sc[r][j] = hsum(d) / SQRT_HD; mx[r] = sc[r][j] > mx[r] ? sc[r][j] : mx[r];
        }
      }
      for (int r = r0; r < r1; r++) {
        for (int j = pos + 1; j < pos + 8; j++) sc[r][j] = mx[r];
        for (int j = 0; j <= pos; j += 8) *(v8d *)(sc[r] + j) = vexp(*(v8d *)(sc[r] + j) - mx[r]);
        for (int j = 0; j <= pos; j++) sum[r] += sc[r][j];
      }
      for (int j = 0; j <= pos; j++) {
        const float *vv = vc + ((long)g * S + j) * HD;
        for (int r = r0; r < r1; r++) {
          double p = sc[r][j] / sum[r];
          for (int i = 0; i < HD; i++) o[r][i] += p * vv[i];
        }
      }
      for (int r = r0; r < r1; r++) for (int i = 0; i < HD; i++) ao[t * QD + (g * GQ + r) * HD + i] = (float)o[r][i];
    }
    SYNC;
    part_mm(lay, l, PART_O, wo, h, D, ao, QD, D, QD / 32, n, tid, nt, &o0, &o1);
    SYNC;
    if (tid == 0) {
      for (int i = 0; i < n * D; i++) x[i] = x[i] + h[i];
      for (int t = 0; t < n; t++) rmsnorm(h + t * D, x + t * D, fn + l * D, D, EPS);
    }
    SYNC;
    part_mm(lay, l, PART_GU, wgu, gu, 2 * FF, h, D, 2 * FF, D / 32, n, tid, nt, &o0, &o1);
    /* gate and up rows alternate, so this thread's rows are whole pairs: their products are its own */
    for (int t = 0; t < n; t++) for (int c = o0 / 2; c < o1 / 2; c++) {
      float g = gu[t * 2 * FF + 2 * c]; a[t * FF + c] = g / (1.0f + ex(-g)) * gu[t * 2 * FF + 2 * c + 1];
    }
    SYNC;
    part_mm(lay, l, PART_D, wd, h, D, a, FF, D, FF / 32, n, tid, nt, &o0, &o1);
    for (int t = 0; t < n; t++) for (int i = o0; i < o1; i++) x[t * D + i] = x[t * D + i] + h[t * D + i];
    SYNC;
  }
  /* a prefill chunk predicts from its last row only; a batched step from every row in use */
  int first = HEADS == 1 ? n - 1 : 0, nh = HEADS == 1 ? 1 : n;
  if (tid == 0) for (int t = 0; t < nh; t++) rmsnorm(h + t * D, x + (first + t) * D, on, D, EPS);
  SYNC;
  share(V, tid, nt, &o0, &o1);
  mmh(lg + o0, V, h, D, wout + o0 * ROWB(TYPE_OUT, D / 32), o1 - o0, D / 32, nh);
  SYNC;
  if (tid == 0) for (int t = 0; t < (HEADS == 1 ? 1 : n); t++) {
    const float *l = lg + (long)t * V;
    int best = 0; for (int i = 1; i < V; i++) if (l[i] > l[best]) best = i;  /* first max, like numpy */
    out[t] = best;
  }
  #undef SYNC
}

static void body(team_t *tm, int tid) { run((job *)tm->job, tm, tid); }

/* tt: the host's table (kernels/threads.h); the threads it asks for, at most MAXT, run the step */
void forward(int *restrict out, float *restrict scr, float *restrict cache, const int *restrict ids,
    const host_table *restrict tt, const unsigned char *restrict embd, const float *restrict an,
    const unsigned char *restrict wqkv, const unsigned char *restrict wo, const float *restrict fn,
    const unsigned char *restrict wgu, const unsigned char *restrict wd, const double *restrict rope,
    const float *restrict on, const unsigned char *restrict wout, const float *restrict bqkv,
    const float *restrict hn, const long *restrict lay) {
  job j = {out, scr, cache, ids, embd, an, wqkv, wo, fn, wgu, wd, rope, on, wout, bqkv, hn, lay};
  team_run(tt, MAXT, body, &j);
}
