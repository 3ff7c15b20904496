/* The fused llama decoder (models/llama_fused.py): one call runs T rows through every layer over the GGUF's
   packed weights, appends each row's K and V to its sequence's cache slot, and writes the greedy next ids.
   A prefill chunk is T tokens of one sequence at consecutive positions (HEADS 1: the next id after its last
   row); a batched decode step is one token of each of up to T sequences, each at its own position in its own
   slot (HEADS == T: a next id per row), so the weights are read once for all of them. The host's table
   (kernels/threads.h) says how many threads share the step and gives the SiLU's expf (libm's, called through
   the table: the kernel links nothing).
   Where the model has them (BIASES, HEAD_NORMS: models/architectures.py), q/k/v biases are added to the
   projections and each q and k head is RMS-normed ahead of RoPE.
   Defines (models/llama_fused.py LlamaDims and Step): T, NT, SPLIT, HEADS, D, H, KV, HD, FF, V, S, NL, EPS, G,
   BIASES, HEAD_NORMS and the GGML type of each matrix kind: TYPE_EMBD, TYPE_OUT, TYPE_QKV, TYPE_O, TYPE_GU,
   TYPE_DOWN. */
#include "llama_math.h"
#include "quant.h"
#include "threads.h"

#define NQKV ((H + 2 * KV) * HD)
#define QD (H * HD)  /* the attention output's width: D unless the heads have a size of their own */
#define GQ (H / KV)
#define SQRT_HD __builtin_sqrt((double)HD)
/* packed bytes of one layer's matrix of each kind: rows x blocks per row x bytes per block */
#define SZQKV ((long)NQKV * (D / 32) * BS(TYPE_QKV))
#define SZO ((long)D * (QD / 32) * BS(TYPE_O))
#define SZGU ((long)2 * FF * (D / 32) * BS(TYPE_GU))
#define SZD ((long)D * (FF / 32) * BS(TYPE_DOWN))
#define SLOT ((long)NL * 2 * KV * S * HD)  /* cache floats of one sequence */

#define QMM_NAME mmq
#define QMM_SPLIT SPLIT
#define QMM_TYPE TYPE_QKV
#define QMM_NT NT
#include "qmatmul.h"
#define QMM_NAME mmo
#define QMM_SPLIT SPLIT
#define QMM_TYPE TYPE_O
#define QMM_NT NT
#include "qmatmul.h"
#define QMM_NAME mmgu
#define QMM_SPLIT SPLIT
#define QMM_TYPE TYPE_GU
#define QMM_NT NT
#include "qmatmul.h"
#define QMM_NAME mmd
#define QMM_SPLIT SPLIT
#define QMM_TYPE TYPE_DOWN
#define QMM_NT NT
#include "qmatmul.h"
#define QMM_NAME mmh
#define QMM_TYPE TYPE_OUT
#define QMM_NT (HEADS == 1 ? 1 : NT)
#define QMM_SPLIT 1
#include "qmatmul.h"

/* Layer weights are stacked: layer l's block of a kind starts at l * its size. Scratch: x, h, then either
   q|k|v + attention output, or gate/up pairs + their product; HEADS rows of logits last. ids: T tokens, each
   row's position, each row's cache slot, then n, the rows in use (the rest are padding, never read: a matmul's
   last tile takes fewer rows, kernels/qmatmul.h). bqkv: each layer's q|k|v biases (NQKV floats); hn: each
   layer's q then k head norm weights (2 HD floats); each is one unread float in a model without them. */
typedef struct {
  int *out; float *scr, *cache; const int *ids;
  const unsigned char *embd; const float *an; const unsigned char *wqkv, *wo; const float *fn;
  const unsigned char *wgu, *wd; const double *rope; const float *on; const unsigned char *wout;
  const float *bqkv, *hn;
} job;

/* one row's q|k|v: biases added, then each q and k head RMS-normed, where the model has them */
INL void qkv_extras(float *restrict q, const float *restrict b, const float *restrict hn) {
  if (BIASES) for (int i = 0; i < NQKV; i++) q[i] = q[i] + b[i];
  if (HEAD_NORMS) for (int hh = 0; hh < H + KV; hh++) {
    float y[HD];
    rmsnorm(y, q + hh * HD, hn + (hh < H ? 0 : HD), HD, EPS);
    for (int i = 0; i < HD; i++) q[hh * HD + i] = y[i];
  }
}

/* this thread's share of a matmul's O output rows, in whole groups of G: [*o0, *o1) */
INL void share(int O, int tid, int nt, int *o0, int *o1) { *o0 = O / G * tid / nt * G; *o1 = O / G * (tid + 1) / nt * G; }

/* Threads split each matmul by output rows (each row's sums unchanged, so the result is bit for bit one thread's),
   the attention by rows of the chunk; the row-wise rest runs on thread 0. Barriers between the phases. */
INL void run(job *j, team_t *tm, int tid) {
  int *restrict out = j->out; float *restrict scr = j->scr, *restrict cache = j->cache; const int *restrict ids = j->ids;
  const unsigned char *restrict embd = j->embd, *restrict wqkv = j->wqkv, *restrict wo = j->wo, *restrict wgu = j->wgu;
  const unsigned char *restrict wd = j->wd, *restrict wout = j->wout;
  const float *restrict an = j->an, *restrict fn = j->fn, *restrict on = j->on; const double *restrict rope = j->rope;
  const float *restrict bqkv = j->bqkv, *restrict hn = j->hn;
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
    DQ(TYPE_EMBD)(embd + (((long)(ids[t] / G) * (D / 32) + b) * G + ids[t] % G) * BS(TYPE_EMBD), &lo, &hi);
    *(v16 *)(x + t * D + b * 32) = lo; *(v16 *)(x + t * D + b * 32 + 16) = hi;
  }
  for (int l = 0; l < NL; l++) {
    #define KC(t) (cache + sl[t] * SLOT + (long)l * 2 * KV * S * HD)
    #define VC(t) (KC(t) + (long)KV * S * HD)
    if (tid == 0) for (int t = 0; t < n; t++) rmsnorm(h + t * D, x + t * D, an + l * D, D, EPS);
    SYNC;
    share(NQKV, tid, nt, &o0, &o1);
    mmq(qkv + o0, NQKV, h, D, wqkv + l * SZQKV + (long)o0 * (D / 32) * BS(TYPE_QKV), o1 - o0, D / 32, n);
    SYNC;
    for (int t = tid; t < n; t += nt) {
      int pos = ps[t]; float *q = qkv + t * NQKV, *v = q + (H + KV) * HD, *kc = KC(t), *vc = VC(t);
      const double *cs = rope + (long)pos * HD;
      qkv_extras(q, bqkv + (long)l * NQKV, hn + (long)l * 2 * HD);
      /* q and k heads are adjacent; pairs (2i, 2i+1) rotate in double like the reference's complex128 */
      for (int i = 0; i < (H + KV) * HD / 2; i++) {
        #pragma clang fp contract(off)
        double re = q[2 * i], im = q[2 * i + 1], c = cs[i % (HD / 2)], s = cs[HD / 2 + i % (HD / 2)];
        q[2 * i] = (float)(re * c - im * s); q[2 * i + 1] = (float)(re * s + im * c);
      }
      for (int g = 0; g < KV; g++) for (int i = 0; i < HD; i++) {
        kc[((long)g * S + pos) * HD + i] = q[(H + g) * HD + i]; vc[((long)g * S + pos) * HD + i] = v[g * HD + i];
      }
    }
    SYNC;  /* a prefill chunk's rows attend to the rows cached before them */
    /* the H / KV query heads sharing a KV head go together: each cached K and V row is read once */
    for (int tg = tid; tg < n * KV; tg += nt) {
      int t = tg / KV, g = tg % KV;
      int pos = ps[t]; const float *kc = KC(t), *vc = VC(t), *q = qkv + t * NQKV + g * GQ * HD;
      /* the reference divides float32 scores by a float64 sqrt, so its softmax runs in float64 */
      double mx[GQ], sum[GQ], o[GQ][HD];
      for (int r = 0; r < GQ; r++) { mx[r] = -__builtin_inf(); sum[r] = 0; for (int i = 0; i < HD; i++) o[r][i] = 0; }
      for (int j = 0; j <= pos; j++) {
        const float *k = kc + ((long)g * S + j) * HD;
        for (int r = 0; r < GQ; r++) {
          v16 d = (v16)0;
          for (int i = 0; i < HD; i += 16) d += *(const v16 *)(q + r * HD + i) * *(const v16 *)(k + i);
          sc[r][j] = hsum(d) / SQRT_HD; mx[r] = sc[r][j] > mx[r] ? sc[r][j] : mx[r];
        }
      }
      for (int r = 0; r < GQ; r++) {
        for (int j = pos + 1; j < pos + 8; j++) sc[r][j] = mx[r];
        for (int j = 0; j <= pos; j += 8) *(v8d *)(sc[r] + j) = vexp(*(v8d *)(sc[r] + j) - mx[r]);
        for (int j = 0; j <= pos; j++) sum[r] += sc[r][j];
      }
      for (int j = 0; j <= pos; j++) {
        const float *vv = vc + ((long)g * S + j) * HD;
        for (int r = 0; r < GQ; r++) {
          double p = sc[r][j] / sum[r];
          for (int i = 0; i < HD; i++) o[r][i] += p * vv[i];
        }
      }
      for (int r = 0; r < GQ; r++) for (int i = 0; i < HD; i++) ao[t * QD + (g * GQ + r) * HD + i] = (float)o[r][i];
    }
    SYNC;
    share(D, tid, nt, &o0, &o1);
    mmo(h + o0, D, ao, QD, wo + l * SZO + (long)o0 * (QD / 32) * BS(TYPE_O), o1 - o0, QD / 32, n);
    SYNC;
    if (tid == 0) {
      for (int i = 0; i < n * D; i++) x[i] = x[i] + h[i];
      for (int t = 0; t < n; t++) rmsnorm(h + t * D, x + t * D, fn + l * D, D, EPS);
    }
    SYNC;
    share(2 * FF, tid, nt, &o0, &o1);
    mmgu(gu + o0, 2 * FF, h, D, wgu + l * SZGU + (long)o0 * (D / 32) * BS(TYPE_GU), o1 - o0, D / 32, n);
    /* gate and up rows alternate, so this thread's rows are whole pairs: their products are its own */
    for (int t = 0; t < n; t++) for (int c = o0 / 2; c < o1 / 2; c++) {
      float g = gu[t * 2 * FF + 2 * c]; a[t * FF + c] = g / (1.0f + ex(-g)) * gu[t * 2 * FF + 2 * c + 1];
    }
    SYNC;
    share(D, tid, nt, &o0, &o1);
    mmd(h + o0, D, a, FF, wd + l * SZD + (long)o0 * (FF / 32) * BS(TYPE_DOWN), o1 - o0, FF / 32, n);
    for (int t = 0; t < n; t++) for (int i = o0; i < o1; i++) x[t * D + i] = x[t * D + i] + h[t * D + i];
    SYNC;
  }
  /* a prefill chunk predicts from its last row only; a batched step from every row in use */
  int first = HEADS == 1 ? n - 1 : 0, nh = HEADS == 1 ? 1 : n;
  if (tid == 0) for (int t = 0; t < nh; t++) rmsnorm(h + t * D, x + (first + t) * D, on, D, EPS);
  SYNC;
  share(V, tid, nt, &o0, &o1);
  mmh(lg + o0, V, h, D, wout + (long)o0 * (D / 32) * BS(TYPE_OUT), o1 - o0, D / 32, nh);
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
    const float *restrict hn) {
  job j = {out, scr, cache, ids, embd, an, wqkv, wo, fn, wgu, wd, rope, on, wout, bqkv, hn};
  team_run(tt, MAXT, body, &j);
}
