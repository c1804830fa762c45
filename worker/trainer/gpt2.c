/* gpt2.c — GPT-2 forward, backward and AdamW step over the dt_ops_t kernel table.
 * See gpt2.h for the layout invariants. */
#include "gpt2.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dt_log.h"
#include "dt_util.h"
#include "rng.h"

/* ------------------------------------------------------------------------------------------ */
/* Configuration and allocation                                                                */
/* ------------------------------------------------------------------------------------------ */

int dt_gpt2_padded_vocab(int vocab)
{
  return (vocab + 127) / 128 * 128;
}

int dt_gpt2_config_validate(const dt_gpt2_config_t *c, char *why, size_t whylen)
{
  const char *msg = NULL;
  if (c->layers < 1)
    msg = "layers must be >= 1";
  else if (c->heads < 1)
    msg = "heads must be >= 1";
  else if (c->channels < 1 || c->channels % c->heads != 0)
    msg = "channels must be a positive multiple of heads";
  else if (c->vocab < 2 || c->vocab > 65536)
    msg = "vocab must be in [2, 65536] (tokens are uint16)";
  else if (c->padded_vocab < c->vocab)
    msg = "padded vocab must be >= vocab";
  else if (c->max_seq < 1)
    msg = "max_seq must be >= 1";
  if (msg) {
    snprintf(why, whylen, "%s (layers=%d heads=%d channels=%d vocab=%d padded_vocab=%d max_seq=%d)",
             msg, c->layers, c->heads, c->channels, c->vocab, c->padded_vocab, c->max_seq);
    return DT_EINVAL;
  }
  return 0;
}

static void point_tensors(dt_gpt2_tensors_t *t, float *flat, const size_t *offsets)
{
  float **ptrs[DT_GPT2_NUM_TENSORS] = {
      &t->wte,  &t->wpe,  &t->ln1w, &t->ln1b, &t->qkvw,    &t->qkvb,    &t->attprojw, &t->attprojb,
      &t->ln2w, &t->ln2b, &t->fcw,  &t->fcb,  &t->fcprojw, &t->fcprojb, &t->lnfw,     &t->lnfb};
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++)
    *ptrs[i] = flat + offsets[i];
}

int dt_gpt2_create(dt_gpt2_t *m, const dt_gpt2_config_t *cfg, const dt_ops_t *ops)
{
  char why[256];
  memset(m, 0, sizeof *m);
  if (dt_gpt2_config_validate(cfg, why, sizeof why) != 0) {
    DT_ERROR(TRAIN, "invalid model config: %s", why);
    return DT_EINVAL;
  }
  m->cfg = *cfg;
  m->ops = ops;
  size_t i = 0, off = 0;
#define DT__SIZE(name, n, wd)                                                                      \
  m->tensor_sizes[i] = (n);                                                                        \
  m->tensor_offsets[i] = off;                                                                      \
  off += (n);                                                                                      \
  i++;
  DT_GPT2_TENSORS(DT__SIZE, *cfg)
#undef DT__SIZE
  m->num_params = off;
  m->bytes_params = m->bytes_grads = off * sizeof(float);
  m->params_flat = dt_calloc_aligned(m->bytes_params, "parameters");
  m->grads_flat = dt_calloc_aligned(m->bytes_grads, "gradients");
  if (!m->params_flat || !m->grads_flat) {
    dt_gpt2_destroy(m);
    return DT_ENOMEM;
  }
  point_tensors(&m->params, m->params_flat, m->tensor_offsets);
  point_tensors(&m->grads, m->grads_flat, m->tensor_offsets);
  return 0;
}

void dt_gpt2_destroy(dt_gpt2_t *m)
{
  dt_free_aligned(m->params_flat);
  dt_free_aligned(m->grads_flat);
  dt_free_aligned(m->m_flat);
  dt_free_aligned(m->v_flat);
  dt_gpt2_acts_t *a = &m->acts;
  float *bufs[] = {a->encoded,  a->ln1,      a->ln1_mean,  a->ln1_rstd,  a->qkv,
                   a->atty,     a->att,      a->residual2, a->ln2,       a->ln2_mean,
                   a->ln2_rstd, a->fch,      a->fch_gelu,  a->residual3, a->lnf,
                   a->lnf_mean, a->lnf_rstd, a->logits,    a->losses,    a->dresidual,
                   a->dbuf,     a->dbuf4,    a->dqkv,      a->datt,      a->tmp};
  for (size_t k = 0; k < DT_ARRAY_SIZE(bufs); k++)
    dt_free_aligned(bufs[k]);
  dt_free_aligned(a->targets);
  memset(m, 0, sizeof *m);
}

void dt_gpt2_init_weights(dt_gpt2_t *m, uint64_t seed)
{
  const dt_gpt2_config_t *c = &m->cfg;
  dt_rng_t rng;
  dt_rng_seed(&rng, seed);
  memset(m->params_flat, 0, m->bytes_params);
  const float std = 0.02f;
  const float proj_std = 0.02f / sqrtf(2.0f * (float)c->layers);
  /* Embeddings: only the real vocabulary rows; the padding stays zero. */
  dt_rng_normal(&rng, m->params.wte, (size_t)c->vocab * c->channels, 0.0f, std);
  dt_rng_normal(&rng, m->params.wpe, m->tensor_sizes[1], 0.0f, std);
  dt_rng_normal(&rng, m->params.qkvw, m->tensor_sizes[4], 0.0f, std);
  dt_rng_normal(&rng, m->params.attprojw, m->tensor_sizes[6], 0.0f, proj_std);
  dt_rng_normal(&rng, m->params.fcw, m->tensor_sizes[10], 0.0f, std);
  dt_rng_normal(&rng, m->params.fcprojw, m->tensor_sizes[12], 0.0f, proj_std);
  float *ones[] = {m->params.ln1w, m->params.ln2w, m->params.lnfw};
  size_t nones[] = {m->tensor_sizes[2], m->tensor_sizes[8], m->tensor_sizes[14]};
  for (int k = 0; k < 3; k++)
    for (size_t j = 0; j < nones[k]; j++)
      ones[k][j] = 1.0f;
}

int dt_gpt2_alloc_activations(dt_gpt2_t *m, int B, int T)
{
  const dt_gpt2_config_t *c = &m->cfg;
  if (T > c->max_seq) {
    DT_ERROR(TRAIN, "sequence length %d exceeds the model's max_seq %d", T, c->max_seq);
    return DT_EINVAL;
  }
  dt_gpt2_acts_t *a = &m->acts;
  if (a->B == B && a->T == T)
    return 0;
  if (a->encoded) {
    DT_ERROR(TRAIN, "activations already allocated for B=%d T=%d", a->B, a->T);
    return DT_EINVAL;
  }
  const size_t N = (size_t)B * T, C = (size_t)c->channels, L = (size_t)c->layers;
  const size_t NH = (size_t)c->heads, Vp = (size_t)c->padded_vocab;
  size_t total = 0;
  int ok = 1;
#define DT__ALLOC(field, count)                                                                    \
  do {                                                                                             \
    a->field = dt_calloc_aligned((count) * sizeof(float), "activation " #field);                   \
    total += (count) * sizeof(float);                                                              \
    ok = ok && a->field;                                                                           \
  } while (0)
  DT__ALLOC(encoded, N * C);
  DT__ALLOC(ln1, L * N * C);
  DT__ALLOC(ln1_mean, L * N);
  DT__ALLOC(ln1_rstd, L * N);
  DT__ALLOC(qkv, L * N * 3 * C);
  DT__ALLOC(atty, L * N * C);
  DT__ALLOC(att, L * B * NH * T * T);
  DT__ALLOC(residual2, L * N * C);
  DT__ALLOC(ln2, L * N * C);
  DT__ALLOC(ln2_mean, L * N);
  DT__ALLOC(ln2_rstd, L * N);
  DT__ALLOC(fch, L * N * 4 * C);
  DT__ALLOC(fch_gelu, L * N * 4 * C);
  DT__ALLOC(residual3, L * N * C);
  DT__ALLOC(lnf, N * C);
  DT__ALLOC(lnf_mean, N);
  DT__ALLOC(lnf_rstd, N);
  DT__ALLOC(logits, N * Vp);
  DT__ALLOC(losses, N);
  DT__ALLOC(dresidual, N * C);
  DT__ALLOC(dbuf, N * C);
  DT__ALLOC(dbuf4, N * 4 * C);
  DT__ALLOC(dqkv, N * 3 * C);
  DT__ALLOC(datt, (size_t)B * NH * T * T);
  DT__ALLOC(tmp, N * C);
#undef DT__ALLOC
  a->targets = dt_calloc_aligned(N * sizeof(int), "targets");
  if (!ok || !a->targets)
    return DT_ENOMEM;
  a->B = B;
  a->T = T;
  m->bytes_acts = total + N * sizeof(int);
  return 0;
}

int dt_gpt2_alloc_optimizer(dt_gpt2_t *m)
{
  if (m->m_flat)
    return 0;
  m->m_flat = dt_calloc_aligned(m->bytes_params, "AdamW first moment");
  m->v_flat = dt_calloc_aligned(m->bytes_params, "AdamW second moment");
  if (!m->m_flat || !m->v_flat)
    return DT_ENOMEM;
  m->bytes_optim = 2 * m->bytes_params;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* ------------------------------------------------------------------------------------------ */
/* Units                                                                                       */
/* ------------------------------------------------------------------------------------------ */

int dt_gpt2_unit_ranges(const dt_gpt2_t *m, int unit, dt_flat_range_t *r)
{
  const int L = m->cfg.layers;
  int n = 0;
  if (unit == DT_UNIT_EMBED || unit == DT_UNIT_FINAL) {
    int first = unit == DT_UNIT_EMBED ? DT_T_WTE : DT_T_LNFW;
    for (int k = first; k < first + 2; k++)
      r[n++] = (dt_flat_range_t){m->tensor_offsets[k], m->tensor_sizes[k], k};
    return n;
  }
  for (int k = DT_T_LN1W; k <= DT_T_FCPROJB; k++) {
    size_t per = m->tensor_sizes[k] / (size_t)L;
    r[n++] = (dt_flat_range_t){m->tensor_offsets[k] + (size_t)unit * per, per, k};
  }
  return n;
}

void dt_gpt2_unit_view(const dt_gpt2_t *m, int unit, float *flat, dt_gpt2_view_t *v)
{
  dt_flat_range_t r[DT_UNIT_MAX_RANGES];
  int n = dt_gpt2_unit_ranges(m, unit, r);
  memset(v, 0, sizeof *v);
  for (int i = 0; i < n; i++)
    v->t[r[i].tensor] = flat + r[i].off;
}

static int acquire(dt_gpt2_t *m, int unit, int grads, dt_gpt2_view_t *p, dt_gpt2_view_t *g)
{
  if (m->hooks)
    return m->hooks->acquire(m->hooks->ud, unit, grads, p, g);
  dt_gpt2_unit_view(m, unit, m->params_flat, p);
  if (grads)
    dt_gpt2_unit_view(m, unit, m->grads_flat, g);
  return 0;
}

static int release(dt_gpt2_t *m, int unit, int grads)
{
  return m->hooks ? m->hooks->release(m->hooks->ud, unit, grads) : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Runs the model to the final LayerNorm and the logits. A batch (B, T) smaller than the
 * allocated one uses the buffers with the per-layer strides of the allocated size. The
 * embeddings stay acquired from the LM head to the caller (the backward pass needs them). */
static int forward_to_logits(dt_gpt2_t *m, const int *inputs, int B, int T)
{
  const dt_ops_t *k = m->ops;
  const dt_gpt2_config_t *c = &m->cfg;
  const int C = c->channels, NH = c->heads, L = c->layers;
  const size_t N = (size_t)B * T, An = (size_t)m->acts.B * m->acts.T;
  const size_t att_stride = (size_t)m->acts.B * NH * m->acts.T * m->acts.T;
  dt_gpt2_acts_t *a = &m->acts;
  dt_gpt2_view_t p, unused;

  DT_CHECK(acquire(m, DT_UNIT_EMBED, 0, &p, &unused));
  k->encoder_forward(a->encoded, inputs, p.t[DT_T_WTE], p.t[DT_T_WPE], B, T, C);
  DT_CHECK(release(m, DT_UNIT_EMBED, 0));
  const float *x = a->encoded;
  for (int l = 0; l < L; l++) {
    float *ln1 = a->ln1 + l * An * C, *qkv = a->qkv + l * An * 3 * C;
    float *atty = a->atty + l * An * C, *att = a->att + l * att_stride;
    float *res2 = a->residual2 + l * An * C, *ln2 = a->ln2 + l * An * C;
    float *fch = a->fch + l * An * 4 * C, *fchg = a->fch_gelu + l * An * 4 * C;
    float *res3 = a->residual3 + l * An * C;
    DT_CHECK(acquire(m, l, 0, &p, &unused));
    k->layernorm_forward(ln1, a->ln1_mean + l * An, a->ln1_rstd + l * An, x, p.t[DT_T_LN1W],
                         p.t[DT_T_LN1B], (int)N, C);
    k->matmul_forward(qkv, ln1, p.t[DT_T_QKVW], p.t[DT_T_QKVB], (int)N, C, 3 * C, 3 * C);
    k->attention_forward(atty, att, qkv, B, T, C, NH);
    k->matmul_forward(a->tmp, atty, p.t[DT_T_ATTPROJW], p.t[DT_T_ATTPROJB], (int)N, C, C, C);
    k->residual_forward(res2, x, a->tmp, N * C);
    k->layernorm_forward(ln2, a->ln2_mean + l * An, a->ln2_rstd + l * An, res2, p.t[DT_T_LN2W],
                         p.t[DT_T_LN2B], (int)N, C);
    k->matmul_forward(fch, ln2, p.t[DT_T_FCW], p.t[DT_T_FCB], (int)N, C, 4 * C, 4 * C);
    k->gelu_forward(fchg, fch, N * 4 * C);
    k->matmul_forward(a->tmp, fchg, p.t[DT_T_FCPROJW], p.t[DT_T_FCPROJB], (int)N, 4 * C, C, C);
    k->residual_forward(res3, res2, a->tmp, N * C);
    DT_CHECK(release(m, l, 0));
    x = res3;
  }
  DT_CHECK(acquire(m, DT_UNIT_FINAL, 0, &p, &unused));
  k->layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, x, p.t[DT_T_LNFW], p.t[DT_T_LNFB], (int)N,
                       C);
  DT_CHECK(release(m, DT_UNIT_FINAL, 0));
  /* Only the real vocabulary columns are computed; the padded ones are never read. */
  DT_CHECK(acquire(m, DT_UNIT_EMBED, 0, &p, &unused));
  k->matmul_forward(a->logits, a->lnf, p.t[DT_T_WTE], NULL, (int)N, C, c->vocab, c->padded_vocab);
  return 0;
}

int dt_gpt2_forward(dt_gpt2_t *m, const int *inputs, int B, int T)
{
  DT_CHECK(forward_to_logits(m, inputs, B, T));
  return release(m, DT_UNIT_EMBED, 0);
}

static float mean_loss(const float *losses, size_t n)
{
  double acc = 0.0;
  for (size_t i = 0; i < n; i++)
    acc += losses[i];
  return (float)(acc / (double)n);
}

int dt_gpt2_eval_loss(dt_gpt2_t *m, const int *inputs, const int *targets, int B, int T,
                      float *loss)
{
  DT_CHECK(dt_gpt2_forward(m, inputs, B, T));
  const size_t N = (size_t)B * T;
  m->ops->crossentropy_forward_backward(m->acts.losses, m->acts.logits, targets, 0.0f, (int)N,
                                        m->cfg.vocab, m->cfg.padded_vocab);
  *loss = mean_loss(m->acts.losses, N);
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Backward                                                                                    */
/* ------------------------------------------------------------------------------------------ */

int dt_gpt2_forward_backward(dt_gpt2_t *m, const int *inputs, const int *targets, int B, int T,
                             float grad_scale, float *loss)
{
  const dt_ops_t *k = m->ops;
  const dt_gpt2_config_t *c = &m->cfg;
  const int C = c->channels, NH = c->heads, L = c->layers;
  const size_t N = (size_t)B * T, An = (size_t)m->acts.B * m->acts.T;
  const size_t att_stride = (size_t)m->acts.B * NH * m->acts.T * m->acts.T;
  dt_gpt2_acts_t *a = &m->acts;
  dt_gpt2_view_t p, g, ep, eg;

  DT_CHECK(forward_to_logits(m, inputs, B, T)); /* leaves the embeddings acquired */
  /* d(mean loss)/d(loss_i) = 1/N, times the caller's scale (1/K for K micro-batches). */
  k->crossentropy_forward_backward(a->losses, a->logits, targets, grad_scale / (float)N, (int)N,
                                   c->vocab, c->padded_vocab);
  *loss = mean_loss(a->losses, N);

  /* The embeddings' gradients accumulate from the LM head now and the encoder at the end. */
  DT_CHECK(acquire(m, DT_UNIT_EMBED, 1, &ep, &eg));
  DT_CHECK(release(m, DT_UNIT_EMBED, 0));
  /* LM head (tied): dlnf = dlogits @ wte[:V]; dwte[:V] += dlogits^T @ lnf */
  k->matmul_backward(a->dbuf, eg.t[DT_T_WTE], NULL, a->logits, a->lnf, ep.t[DT_T_WTE], (int)N, C,
                     c->vocab, c->padded_vocab);
  memset(a->dresidual, 0, N * C * sizeof(float));
  const float *xL = L > 0 ? a->residual3 + (size_t)(L - 1) * An * C : a->encoded;
  DT_CHECK(acquire(m, DT_UNIT_FINAL, 1, &p, &g));
  k->layernorm_backward(a->dresidual, g.t[DT_T_LNFW], g.t[DT_T_LNFB], a->dbuf, xL, p.t[DT_T_LNFW],
                        a->lnf_mean, a->lnf_rstd, (int)N, C);
  DT_CHECK(release(m, DT_UNIT_FINAL, 1));

  for (int l = L - 1; l >= 0; l--) {
    const float *x = l == 0 ? a->encoded : a->residual3 + (size_t)(l - 1) * An * C;
    float *ln1 = a->ln1 + l * An * C, *qkv = a->qkv + l * An * 3 * C;
    float *atty = a->atty + l * An * C, *att = a->att + l * att_stride;
    float *res2 = a->residual2 + l * An * C, *ln2 = a->ln2 + l * An * C;
    float *fch = a->fch + l * An * 4 * C, *fchg = a->fch_gelu + l * An * 4 * C;
    DT_CHECK(acquire(m, l, 1, &p, &g));
    /* MLP branch: the residual gradient flows unchanged into the branch output. */
    k->matmul_backward(a->dbuf4, g.t[DT_T_FCPROJW], g.t[DT_T_FCPROJB], a->dresidual, fchg,
                       p.t[DT_T_FCPROJW], (int)N, 4 * C, C, C);
    k->gelu_backward(a->dbuf4, fch, a->dbuf4, N * 4 * C);
    k->matmul_backward(a->dbuf, g.t[DT_T_FCW], g.t[DT_T_FCB], a->dbuf4, ln2, p.t[DT_T_FCW], (int)N,
                       C, 4 * C, 4 * C);
    k->layernorm_backward(a->dresidual, g.t[DT_T_LN2W], g.t[DT_T_LN2B], a->dbuf, res2,
                          p.t[DT_T_LN2W], a->ln2_mean + l * An, a->ln2_rstd + l * An, (int)N, C);
    /* Attention branch. */
    k->matmul_backward(a->dbuf, g.t[DT_T_ATTPROJW], g.t[DT_T_ATTPROJB], a->dresidual, atty,
                       p.t[DT_T_ATTPROJW], (int)N, C, C, C);
    k->attention_backward(a->dqkv, a->datt, a->dbuf, qkv, att, B, T, C, NH);
    k->matmul_backward(a->dbuf, g.t[DT_T_QKVW], g.t[DT_T_QKVB], a->dqkv, ln1, p.t[DT_T_QKVW],
                       (int)N, C, 3 * C, 3 * C);
    k->layernorm_backward(a->dresidual, g.t[DT_T_LN1W], g.t[DT_T_LN1B], a->dbuf, x, p.t[DT_T_LN1W],
                          a->ln1_mean + l * An, a->ln1_rstd + l * An, (int)N, C);
    DT_CHECK(release(m, l, 1));
  }
  k->encoder_backward(eg.t[DT_T_WTE], eg.t[DT_T_WPE], a->dresidual, inputs, B, T, C);
  return release(m, DT_UNIT_EMBED, 1);
}

void dt_gpt2_zero_grad(dt_gpt2_t *m)
{
  memset(m->grads_flat, 0, m->bytes_grads);
}

float dt_gpt2_grad_norm(dt_gpt2_t *m)
{
  return (float)sqrt(m->ops->sum_squares(m->grads_flat, m->num_params));
}

int dt_gpt2_tensor_decays(int tensor)
{
  static const int decays[DT_GPT2_NUM_TENSORS] = {
#define DT__WD(name, n, wd) wd,
      DT_GPT2_TENSORS(DT__WD, (dt_gpt2_config_t){0})
#undef DT__WD
  };
  return tensor >= 0 && tensor < DT_GPT2_NUM_TENSORS && decays[tensor];
}

int dt_gpt2_adamw_step(dt_gpt2_t *m, const dt_adamw_t *h, float grad_scale, int t)
{
  DT_CHECK(dt_gpt2_alloc_optimizer(m));
  for (int i = 0; i < DT_GPT2_NUM_TENSORS; i++) {
    size_t off = m->tensor_offsets[i];
    m->ops->adamw_update(m->params_flat + off, m->grads_flat + off, m->m_flat + off,
                         m->v_flat + off, m->tensor_sizes[i], h->lr, h->beta1, h->beta2, h->eps,
                         dt_gpt2_tensor_decays(i) ? h->weight_decay : 0.0f, grad_scale, t);
  }
  return 0;
}
