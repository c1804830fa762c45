/* attention.c — causal multi-head self-attention, forward and backward.
 *
 * Each (batch, head) pair is independent and handled by one thread; its products are GEMMs on
 * strided views of the packed qkv rows, through OpenBLAS (single-threaded inside the parallel
 * region). Causality is exploited by blocking the T x T score matrix into row blocks of
 * ATT_BLOCK: row block [r0, r1) only needs key columns [0, r1), which skips ~3/8 of the work
 * at T = 256 instead of computing the full square and masking it.
 *
 * Context parallelism: the _cp variants take the Tq queries at global positions [q0, q0 + Tq)
 * of a sequence whose packed qkv rows hold Tall positions per batch element, against the keys
 * [0, Tk), Tk = q0 + Tq (causal: no later key is needed). With q0 = 0 and Tq = Tk = Tall they
 * are the plain kernels, product for product, except that the _cp backward accumulates (+=)
 * into dqkv: a rank's two query chunks (context_parallel in gpt2.c) add to the same keys.
 *
 * Invariant: att holds the softmax probabilities with exact zeros above the diagonal (inside
 * the diagonal blocks too), because the blocked products read those entries.
 *
 * The _flash variants keep no (T, T) matrix: per query row only its log-sum-exp (lse), and the
 * backward recomputes the probabilities from q, k and lse. Each thread runs the materialised
 * kernels' per-head code on a scratch of its own that holds one head's probabilities and their
 * gradients for a band of query rows (the whole chunk when that fits FLASH_SCRATCH floats, the
 * band being a chunk of its own, at q0 + its first row): the same big GEMMs, plus the scores
 * again in the backward. The softmax backward's sum_j P dP is dout . out, taken from the
 * recomputed P, so these kernels do not read out.
 *
 * The _flash_bf16 variants are bf16 attention with the tensor-core kernels' arithmetic
 * (kernels/cuda/flash_mma.cuh), so that --precision bf16 means the same math on every device:
 * q, k, v in bf16 (the qkv layer's bf16 output) and dout rounded to bf16 (a scratch copy); scores,
 * softmax statistics and every sum in fp32; the probabilities rounded to bf16 before P V and P^T
 * dO, as the GPU rounds them: exp(s - m) with m the running maximum over the 64-key tiles streamed
 * so far (keys from 0), the tile's sum later rescaled by exp(m - the row's maximum); the score
 * gradients dS = P (dP - D) rounded before dS K and dS^T Q, with D = dout . out in fp32 from the
 * fp32 tensors and the 1/sqrt(hs) applied after those products. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "vecmath.h"

#define ATT_BLOCK     64 /* also the tensor-core kernels' key tile (FMMA_ROWS), which bf16 follows */
#define FLASH_SCRATCH ((size_t)1 << 22) /* floats per thread: 16 MiB */

/* One head's view: q of its Tq query rows (from position q0), k and v from position 0, rows
 * 3C apart; o and dO (Tq rows) C apart. bf16: the _flash_bf16 arithmetic (see the top), on q,
 * k, v and dO already rounded. */
typedef struct {
  const float *q, *k, *v;
  int Tq, q0, C, hs, bf16;
  float scale;
} head_t;

static head_t head_view(const float *qkv, int bh, int Tq, int q0, int Tall, int C, int NH)
{
  const int hs = C / NH, b = bh / NH, h = bh % NH;
  const float *base = qkv + (size_t)b * Tall * 3 * C + (size_t)h * hs;
  return (head_t){.q = base + (size_t)q0 * 3 * C,
                  .k = base + C,
                  .v = base + 2 * C,
                  .Tq = Tq,
                  .q0 = q0,
                  .C = C,
                  .hs = hs,
                  .bf16 = 0,
                  .scale = 1.0f / sqrtf((float)hs)};
}

/* The band of a head's query rows [r0, r1) as a head of its own (queries from q0 + r0). */
static head_t head_band(head_t x, int r0, int r1)
{
  x.q += (size_t)r0 * 3 * x.C;
  x.q0 += r0;
  x.Tq = r1 - r0;
  return x;
}

/* scores[r0:r1, 0:kn] = scale Q[r0:r1] K[0:kn]^T into the rows of A (row stride Tk) */
static void head_scores(const head_t *x, float *A, int r0, int r1, int kn, int Tk)
{
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, kn, x->hs, x->scale,
              x->q + (size_t)r0 * 3 * x->C, 3 * x->C, x->k, 3 * x->C, 0.0f, A + (size_t)r0 * Tk,
              Tk);
}

/* bf16 attention's row of scores [0, last] (see the top): each becomes its bf16-rounded
 * exp(s - m), m the running maximum of the 64-key tiles up to its own, times exp(m - maxv) for
 * the row's maximum maxv; returns the row's sum of exp(s - maxv), taken unrounded. */
static float bf16_probs(float *row, int last, float maxv)
{
  float sum = 0.0f, m = -INFINITY;
  for (int j0 = 0; j0 <= last; j0 += ATT_BLOCK) {
    const int j1 = j0 + ATT_BLOCK <= last ? j0 + ATT_BLOCK : last + 1;
    for (int j = j0; j < j1; j++)
      m = row[j] > m ? row[j] : m;
    const float corr = expf(m - maxv);
    float tile = 0.0f;
#pragma omp simd reduction(+ : tile)
    for (int j = j0; j < j1; j++) {
      const float e = expf(row[j] - m);
      tile += e;
      row[j] = dt_bf16_round(e) * corr;
    }
    sum += tile * corr;
  }
  return sum;
}

/* A (Tq, Tk = q0 + Tq): the probabilities, zero above the diagonal; o = A V; lse (may be NULL)
 * each row's log-sum-exp. bf16: A holds bf16_probs' unnormalised rows and o is divided by the
 * rows' sums after the product. */
static void head_forward(const head_t *x, float *o, float *A, float *lse)
{
  const int Tq = x->Tq, q0 = x->q0, Tk = q0 + Tq, C3 = 3 * x->C;
  float inv[ATT_BLOCK];
  for (int r0 = 0; r0 < Tq; r0 += ATT_BLOCK) {
    int r1 = r0 + ATT_BLOCK < Tq ? r0 + ATT_BLOCK : Tq, kn = q0 + r1;
    head_scores(x, A, r0, r1, kn, Tk);
    for (int t = r0; t < r1; t++) {
      float *row = A + (size_t)t * Tk;
      const int last = q0 + t; /* the query's own position: its last key */
      float maxv = -INFINITY;
      for (int j = 0; j <= last; j++)
        maxv = row[j] > maxv ? row[j] : maxv;
      float sum = 0.0f;
      if (x->bf16) {
        sum = bf16_probs(row, last, maxv);
        inv[t - r0] = 1.0f / sum;
      } else {
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j <= last; j++) {
          row[j] = expf(row[j] - maxv);
          sum += row[j];
        }
        float inv_sum = 1.0f / sum;
        for (int j = 0; j <= last; j++)
          row[j] *= inv_sum;
      }
      memset(row + last + 1, 0, (size_t)(Tk - last - 1) * sizeof(float));
      if (lse)
        lse[t] = maxv + logf(sum);
    }
    /* out[r0:r1] = A[r0:r1, 0:kn] V[0:kn] */
    float *orow = o + (size_t)r0 * x->C;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, x->hs, kn, 1.0f,
                A + (size_t)r0 * Tk, Tk, x->v, C3, 0.0f, orow, x->C);
    if (x->bf16)
      for (int t = r0; t < r1; t++)
        for (int i = 0; i < x->hs; i++)
          orow[(size_t)(t - r0) * x->C + i] *= inv[t - r0];
  }
}

/* The backward's row pass: dq (Tq rows, 3C apart; beta 0 written (=), 1 accumulated (+=)) and
 * in dP (Tq, Tk) the score gradients dS, zero above the diagonal. D: the rows' sum_j P dP, or
 * NULL to take it from A and dP (bf16 passes dout . out). */
static void head_backward_rows(const head_t *x, float *dq, float *dP, const float *A,
                               const float *dO, const float *D, float beta)
{
  const int Tq = x->Tq, q0 = x->q0, Tk = q0 + Tq, C = x->C, C3 = 3 * C, hs = x->hs;
  for (int r0 = 0; r0 < Tq; r0 += ATT_BLOCK) {
    int r1 = r0 + ATT_BLOCK < Tq ? r0 + ATT_BLOCK : Tq, kn = q0 + r1;
    /* dA[r0:r1, 0:kn] = dO[r0:r1] V[0:kn]^T */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, kn, hs, 1.0f, dO + (size_t)r0 * C,
                C, x->v, C3, 0.0f, dP + (size_t)r0 * Tk, Tk);
    /* softmax backward: dS = A * (dA - sum_j A dA), zero above the diagonal because A is; fp32
     * folds the 1/sqrt(hs) of the scores in here, bf16 rounds dS and applies it to the
     * products. The column blocks of the column pass read rows past this block's kn only when
     * q0 is not a multiple of the block: then the whole rest of the row is zeroed. */
    const int zero_to = q0 % ATT_BLOCK == 0 ? kn : Tk;
    for (int t = r0; t < r1; t++) {
      const float *a = A + (size_t)t * Tk;
      float *d = dP + (size_t)t * Tk;
      const int last = q0 + t;
      float dot = 0.0f;
      if (D)
        dot = D[t];
      else {
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j <= last; j++)
          dot += a[j] * d[j];
      }
      if (x->bf16)
        for (int j = 0; j <= last; j++)
          d[j] = dt_bf16_round(a[j] * (d[j] - dot));
      else
        for (int j = 0; j <= last; j++)
          d[j] = x->scale * a[j] * (d[j] - dot);
      for (int j = last + 1; j < zero_to; j++)
        d[j] = 0.0f;
    }
    /* dQ[r0:r1] = dS[r0:r1, 0:kn] K[0:kn] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, kn,
                x->bf16 ? x->scale : 1.0f, dP + (size_t)r0 * Tk, Tk, x->k, C3, beta,
                dq + (size_t)r0 * C3, C3);
  }
}

/* The column pass: dk, dv (q0 + Tq rows, 3C apart) from the rows' dS (in dP) and A. */
static void head_backward_cols(const head_t *x, float *dk, float *dv, const float *dP,
                               const float *A, const float *dO, float beta)
{
  const int Tq = x->Tq, q0 = x->q0, Tk = q0 + Tq, C = x->C, C3 = 3 * C, hs = x->hs;
  /* Column blocks [j0, j1) of dS and A are nonzero only in the rows of queries at or after
   * position j0: local rows t >= j0 - q0. */
  for (int j0 = 0; j0 < Tk; j0 += ATT_BLOCK) {
    int j1 = j0 + ATT_BLOCK < Tk ? j0 + ATT_BLOCK : Tk;
    int t0 = j0 > q0 ? j0 - q0 : 0;
    /* dK[j0:j1] = dS[t0:Tq, j0:j1]^T Q[t0:Tq] */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hs, Tq - t0,
                x->bf16 ? x->scale : 1.0f, dP + (size_t)t0 * Tk + j0, Tk, x->q + (size_t)t0 * C3,
                C3, beta, dk + (size_t)j0 * C3, C3);
    /* dV[j0:j1] = A[t0:Tq, j0:j1]^T dO[t0:Tq] */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hs, Tq - t0, 1.0f,
                A + (size_t)t0 * Tk + j0, Tk, dO + (size_t)t0 * C, C, beta, dv + (size_t)j0 * C3,
                C3);
  }
}

/* dq (Tq rows), dk, dv (q0 + Tq rows), 3C apart: beta 0 written (=), 1 accumulated (+=). dP is
 * a (Tq, Tk) scratch. fp32 only (bf16 rounds A between the passes). */
static void head_backward(const head_t *x, float *dq, float *dk, float *dv, float *dP,
                          const float *A, const float *dO, float beta)
{
  head_backward_rows(x, dq, dP, A, dO, NULL, beta);
  head_backward_cols(x, dk, dv, dP, A, dO, beta);
}

/* dqkv's q, k and v pointers of head bh (q from row q0) */
static void head_grads(float *dqkv, int bh, int q0, int Tall, int C, int NH, float **dq, float **dk,
                       float **dv)
{
  const int hs = C / NH, b = bh / NH, h = bh % NH;
  float *base = dqkv + (size_t)b * Tall * 3 * C + (size_t)h * hs;
  *dq = base + (size_t)q0 * 3 * C;
  *dk = base + C;
  *dv = base + 2 * C;
}

void dt_cpu_attention_forward_cp(float *out, float *att, const float *qkv, int B, int Tq, int q0,
                                 int Tall, int C, int NH)
{
  const size_t Tk = (size_t)q0 + Tq;
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    const head_t x = head_view(qkv, bh, Tq, q0, Tall, C, NH);
    float *o = out + (size_t)(bh / NH) * Tq * C + (size_t)(bh % NH) * x.hs;
    head_forward(&x, o, att + (size_t)bh * Tq * Tk, NULL);
  }
}

void dt_cpu_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
{
  dt_cpu_attention_forward_cp(out, att, qkv, B, T, 0, T, C, NH);
}

static void attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int Tq, int q0, int Tall, int C, int NH,
                               float beta)
{
  const size_t Tk = (size_t)q0 + Tq;
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    const head_t x = head_view(qkv, bh, Tq, q0, Tall, C, NH);
    float *dq, *dk, *dv;
    head_grads(dqkv, bh, q0, Tall, C, NH, &dq, &dk, &dv);
    const float *dO = dout + (size_t)(bh / NH) * Tq * C + (size_t)(bh % NH) * x.hs;
    head_backward(&x, dq, dk, dv, scratch + (size_t)bh * Tq * Tk, att + (size_t)bh * Tq * Tk, dO,
                  beta);
  }
}

void dt_cpu_attention_backward_cp(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                  const float *att, int B, int Tq, int q0, int Tall, int C, int NH)
{
  attention_backward(dqkv, scratch, dout, qkv, att, B, Tq, q0, Tall, C, NH, 1.0f);
}

void dt_cpu_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH)
{
  attention_backward(dqkv, scratch, dout, qkv, att, B, T, 0, T, C, NH, 0.0f);
}

/* Query rows per flash band: all Tq when two (Tq, Tk) matrices fit the scratch, else the most
 * whole row blocks that do (at least one). */
static int flash_band(int Tq, int q0)
{
  const size_t Tk = (size_t)q0 + Tq, rows = FLASH_SCRATCH / (2 * Tk);
  if (rows >= (size_t)Tq)
    return Tq;
  return rows < ATT_BLOCK ? ATT_BLOCK : (int)(rows / ATT_BLOCK * ATT_BLOCK);
}

/* The flash forward on qkv (bf16: already rounded). */
static int flash_forward(float *out, float *lse, const float *qkv, int B, int Tq, int q0, int Tall,
                         int C, int NH, int bf16)
{
  const int band = flash_band(Tq, q0);
  int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
  for (int bh = 0; bh < B * NH; bh++) {
    float *A = malloc((size_t)band * (q0 + Tq) * sizeof(float));
    if (!A) {
      failed = 1;
      continue;
    }
    head_t x = head_view(qkv, bh, Tq, q0, Tall, C, NH);
    x.bf16 = bf16;
    float *o = out + (size_t)(bh / NH) * Tq * C + (size_t)(bh % NH) * x.hs;
    for (int r0 = 0; r0 < Tq; r0 += band) {
      const head_t y = head_band(x, r0, r0 + band < Tq ? r0 + band : Tq);
      head_forward(&y, o + (size_t)r0 * C, A, lse + (size_t)bh * Tq + r0);
    }
    free(A);
  }
  return failed ? -1 : 0;
}

/* Sets to 0 the rows of one head's gradients that its backward adds into: dq's Tq rows and dk's
 * and dv's Tk, hs columns each, 3C apart (a write: ops.h's accumulate 0). */
static void zero_head_grads(float *dq, float *dk, float *dv, int Tq, int Tk, int C, int hs)
{
  for (int t = 0; t < Tq; t++)
    memset(dq + (size_t)t * 3 * C, 0, (size_t)hs * sizeof(float));
  for (int j = 0; j < Tk; j++) {
    memset(dk + (size_t)j * 3 * C, 0, (size_t)hs * sizeof(float));
    memset(dv + (size_t)j * 3 * C, 0, (size_t)hs * sizeof(float));
  }
}

/* The flash backward on qkv and dout (bf16: both rounded; dout32 and out, the fp32 tensors,
 * give D), adding into dqkv or (accumulate 0) writing it. */
static int flash_backward(float *dqkv, const float *dout, const float *qkv, const float *dout32,
                          const float *out, const float *lse, int B, int Tq, int q0, int Tall,
                          int C, int NH, int bf16, int accumulate)
{
  const int band = flash_band(Tq, q0);
  int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
  for (int bh = 0; bh < B * NH; bh++) {
    float *A = malloc((2 * (size_t)band * (q0 + Tq) + (size_t)band) * sizeof(float));
    if (!A) {
      failed = 1;
      continue;
    }
    head_t x = head_view(qkv, bh, Tq, q0, Tall, C, NH);
    x.bf16 = bf16;
    float *dq, *dk, *dv;
    head_grads(dqkv, bh, q0, Tall, C, NH, &dq, &dk, &dv);
    if (!accumulate)
      zero_head_grads(dq, dk, dv, Tq, q0 + Tq, C, x.hs);
    const size_t ho = (size_t)(bh / NH) * Tq * C + (size_t)(bh % NH) * x.hs;
    for (int r0 = 0; r0 < Tq; r0 += band) {
      const head_t y = head_band(x, r0, r0 + band < Tq ? r0 + band : Tq);
      const int Tk = y.q0 + y.Tq;
      const float *L = lse + (size_t)bh * Tq + r0;
      float *dP = A + (size_t)y.Tq * Tk, *D = dP + (size_t)y.Tq * Tk;
      /* the band's probabilities again: exp(scores - lse), zero above the diagonal */
      for (int b0 = 0; b0 < y.Tq; b0 += ATT_BLOCK) {
        const int b1 = b0 + ATT_BLOCK < y.Tq ? b0 + ATT_BLOCK : y.Tq;
        head_scores(&y, A, b0, b1, y.q0 + b1, Tk);
        for (int t = b0; t < b1; t++) {
          float *row = A + (size_t)t * Tk;
          const int last = y.q0 + t;
#pragma omp simd
          for (int j = 0; j <= last; j++)
            row[j] = expf(row[j] - L[t]);
          memset(row + last + 1, 0, (size_t)(Tk - last - 1) * sizeof(float));
        }
      }
      const float *dO = dout + ho + (size_t)r0 * C;
      if (!bf16) {
        head_backward(&y, dq + (size_t)r0 * 3 * C, dk, dv, dP, A, dO, 1.0f);
        continue;
      }
      for (int t = 0; t < y.Tq; t++) { /* D = dout . out, fp32 */
        const float *g = dout32 + ho + (size_t)(r0 + t) * C, *o = out + ho + (size_t)(r0 + t) * C;
        float dot = 0.0f;
        for (int i = 0; i < x.hs; i++)
          dot += g[i] * o[i];
        D[t] = dot;
      }
      head_backward_rows(&y, dq + (size_t)r0 * 3 * C, dP, A, dO, D, 1.0f);
      for (size_t i = 0; i < (size_t)y.Tq * Tk; i++) /* P in bf16 for dV = P^T dO */
        A[i] = dt_bf16_round(A[i]);
      head_backward_cols(&y, dk, dv, dP, A, dO, 1.0f);
    }
    free(A);
  }
  return failed ? -1 : 0;
}

int dt_cpu_attention_forward_flash(float *out, float *lse, const float *qkv, int B, int Tq, int q0,
                                   int Tall, int C, int NH)
{
  return flash_forward(out, lse, qkv, B, Tq, q0, Tall, C, NH, 0);
}

int dt_cpu_attention_backward_flash(float *dqkv, const float *dout, const float *qkv,
                                    const float *out, const float *lse, int B, int Tq, int q0,
                                    int Tall, int C, int NH, int accumulate)
{
  (void)out; /* sum_j P dP comes from the recomputed P (see the top) */
  return flash_backward(dqkv, dout, qkv, NULL, NULL, lse, B, Tq, q0, Tall, C, NH, 0, accumulate);
}

int dt_cpu_attention_forward_flash_bf16(float *out, float *lse, const float *qkv, int B, int Tq,
                                        int q0, int Tall, int C, int NH)
{
  return flash_forward(out, lse, qkv, B, Tq, q0, Tall, C, NH, 1);
}

int dt_cpu_attention_backward_flash_bf16(float *dqkv, const float *dout, const float *qkv,
                                         const float *out, const float *lse, int B, int Tq, int q0,
                                         int Tall, int C, int NH, int accumulate)
{
  float *dout_r = dt_cpu_bf16_copy(dout, (size_t)B * Tq, (size_t)C, (size_t)C);
  const int err = dout_r ? flash_backward(dqkv, dout_r, qkv, dout, out, lse, B, Tq, q0, Tall, C, NH,
                                          1, accumulate)
                         : -1;
  free(dout_r);
  return err;
}
