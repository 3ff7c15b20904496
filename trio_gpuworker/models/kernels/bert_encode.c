/* The fused BERT (and XLM-RoBERTa) encoder (models/bert_fused.py): one call runs a pack of sequences, their
   tokens back to back with no padding, through the embeddings and every layer, and writes each sequence's
   final hidden states pooled four ways: mean | [CLS] | max | last token. Defines (BertDims, Capacity): H, NH,
   HD, FF, NL, EPS, ACT; CAP (tokens per call), MAXLP (longest sequence, rounded up to NR), MB (rows per row
   block), THREADS (at most), SCRATCH (floats), POOLS (poolings per sequence).

   Threads split the work without sharing a row block: each owns a slice of the tokens for the row-local
   work (embeddings, projections, FFN, LayerNorms) and a slice of the heads for attention, so a layer needs
   two barriers. in: n_seq, n_tok, n_seq + 1 sequence offsets, then CAP ids, CAP token types and CAP position
   ids (the host numbers positions: XLM-RoBERTa's start past its padding id). */
#include "bert_attention.h"
#include "threads.h"

#define H3 (3 * H)
/* per-thread scratch: an FFN row block, K transposed and V packed, a tile's scores */
#define THREAD_SCRATCH ((long)MB * FF + 2L * HD * MAXLP + (long)MR * MAXLP)

_Static_assert(MR <= 16 && THREADS <= MAXT && SCRATCH >= (long)CAP * 5 * H + THREADS * THREAD_SCRATCH,
               "the host's scratch does not fit this layout (models/bert_fused.py scratch_floats)");
_Static_assert(H % NR == 0 && FF % NR == 0 && H % VW == 0, "hidden and FFN sizes must be multiples of NR");
_Static_assert(POOLS == 4, "the poolings written are mean, [CLS], max and last token (_proto POOLINGS' order)");

typedef struct {
  float *out, *scr;
  const int *in;
  const float *word, *pos, *type, *eln, *wqkv, *bqkv, *wo, *bo, *ln1, *wi, *bi, *wf, *bf, *ln2;
} job;

/* rows [r0, r1) after attention: output projection, residual, LayerNorm, FFN, residual, LayerNorm, then
   the next layer's Q|K|V (l + 1 < NL) */
INL void row_block(job *j, int l, int r0, int r1, float *ffn) {
  int m = r1 - r0;
  float *x = j->scr + (long)r0 * H, *qkv = j->scr + (long)CAP * H + (long)r0 * H3;
  float *ctx = j->scr + (long)CAP * (H + H3) + (long)r0 * H;
  gemm_bias_res(m, H, H, ctx, H, j->wo + (long)l * H * H, x, H, j->bo + l * H);
  for (int r = 0; r < m; r++) layernorm(x + r * H, j->ln1 + l * 2 * H, j->ln1 + l * 2 * H + H, H, EPS);
  gemm_bias_act(m, FF, H, x, H, j->wi + (long)l * H * FF, ffn, FF, j->bi + l * FF);
  gemm_bias_res(m, H, FF, ffn, FF, j->wf + (long)l * FF * H, x, H, j->bf + l * H);
  for (int r = 0; r < m; r++) layernorm(x + r * H, j->ln2 + l * 2 * H, j->ln2 + l * 2 * H + H, H, EPS);
  if (l + 1 < NL) gemm_bias(m, H3, H, x, H, j->wqkv + (long)(l + 1) * H * H3, qkv, H3, j->bqkv + (l + 1) * H3);
}

/* o = mean | first | max | last of the n rows of x */
INL void pool(float *restrict o, const float *restrict x, int n) {
  float *mean = o, *first = o + H, *top = o + 2 * H, *last = o + 3 * H;
  for (int i = 0; i < H; i++) { mean[i] = 0; first[i] = x[i]; top[i] = x[i]; last[i] = x[(long)(n - 1) * H + i]; }
  for (int t = 0; t < n; t++) for (int i = 0; i < H; i++) {
    float v = x[(long)t * H + i];
    mean[i] += v;
    top[i] = v > top[i] ? v : top[i];
  }
  for (int i = 0; i < H; i++) mean[i] /= n;
}

INL void run(job *j, team_t *tm, int tid) {
  const int n_seq = j->in[0], n_tok = j->in[1], *off = j->in + 2, *ids = j->in + 2 + CAP + 1, *tys = ids + CAP;
  const int *pids = tys + CAP;
  const int nt = tm->nt;
  float *x = j->scr, *qkv = x + (long)CAP * H, *ctx = qkv + (long)CAP * H3;
  float *mine = ctx + (long)CAP * H + tid * THREAD_SCRATCH, *kv = mine + (long)MB * FF, *sc = kv + 2L * HD * MAXLP;
  /* this thread's tokens: an even share, in whole micro tiles */
  int tiles = (n_tok + MR - 1) / MR, t0 = tiles * tid / nt * MR, t1 = tiles * (tid + 1) / nt * MR;
  t1 = t1 < n_tok ? t1 : n_tok;
  t0 = t0 < t1 ? t0 : t1;
  int sense = 0;
  for (int t = t0; t < t1; t++) {
    float *xt = x + (long)t * H;
    const float *w = j->word + (long)ids[t] * H, *ps = j->pos + (long)pids[t] * H, *ty = j->type + (long)tys[t] * H;
    for (int i = 0; i < H; i++) xt[i] = (w[i] + ty[i]) + ps[i];
    layernorm(xt, j->eln, j->eln + H, H, EPS);
  }
  for (int r = t0; r < t1; r += MB) {
    int m = t1 - r < MB ? t1 - r : MB;
    gemm_bias(m, H3, H, x + (long)r * H, H, j->wqkv, qkv + (long)r * H3, H3, j->bqkv);
  }
  for (int l = 0; l < NL; l++) {
    team_sync(tm, &sense);
    for (int s = 0; s < n_seq; s++) for (int h = tid; h < NH; h += nt) {
      const float *q = qkv + (long)off[s] * H3 + h * HD;
      attend(off[s + 1] - off[s], q, q + H, q + 2 * H, H3, ctx + (long)off[s] * H + h * HD, H, kv, sc);
    }
    team_sync(tm, &sense);
    for (int r = t0; r < t1; r += MB) row_block(j, l, r, r + MB < t1 ? r + MB : t1, mine);
  }
  team_sync(tm, &sense);
  for (int s = tid; s < n_seq; s += nt)
    pool(j->out + (long)s * POOLS * H, x + (long)off[s] * H, off[s + 1] - off[s]);
}

static void body(team_t *tm, int tid) { run((job *)tm->job, tm, tid); }

/* weights (models/bert_fused.py): word, position and type embeddings, the embedding LayerNorm's w|b, then
   per kind every layer's back to back: packed Q|K|V and its bias, packed output projection and bias, the
   attention LayerNorm's w|b, packed FFN up and bias, packed FFN down and bias, the output LayerNorm's w|b */
void encode(float *restrict out, float *restrict scr, const int *restrict in, const host_table *restrict tt,
            const float *restrict word, const float *restrict pos, const float *restrict type,
            const float *restrict eln, const float *restrict wqkv, const float *restrict bqkv,
            const float *restrict wo, const float *restrict bo, const float *restrict ln1,
            const float *restrict wi, const float *restrict bi, const float *restrict wf,
            const float *restrict bf, const float *restrict ln2) {
  job j = {out, scr, in, word, pos, type, eln, wqkv, bqkv, wo, bo, ln1, wi, bi, wf, bf, ln2};
  team_run(tt, THREADS, body, &j);
}
